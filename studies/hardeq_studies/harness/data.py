r"""Where the harness's minibatches come from, and how a split is evaluated in batches.

Three training sources:

* :class:`MemberBatches` -- in-memory tensors (tabular data, MNIST-sized arrays, time-series windows cut in
  advance). Every member draws its own sample order per epoch from its own ``torch.Generator`` seeded with
  its seed, so members that share a seed (e.g. different methods with seed 3) see the same data order --
  common random numbers -- and a member's trajectory does not depend on how many other members train with
  it. Batches have shape ``(M, b, ...)``.
* :class:`LoaderBatches` -- any iterable of batches (a ``DataLoader``, a PyG loader of ragged graphs): a
  factory ``make(epoch, ctx)`` returns the epoch's iterable; all members share each batch. For a
  bit-exact ``--resume`` the factory must derive its shuffling from ``epoch`` (e.g. a generator seeded with
  ``(seed, epoch)``) and, under DDP, yield this rank's shard of every global batch.
* :class:`ShuffledBatches` -- one model (no member dimension), in-memory tensors shuffled each epoch by one
  generator, optionally re-drawn each epoch from the same generator (a fresh binarisation of images).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .distributed import DistContext

__all__ = ["BatchSource", "MemberBatches", "LoaderBatches", "ShuffledBatches", "as_source", "eval_batches"]


class BatchSource(ABC):
    """Interface of a training source: ``epoch(epoch)`` yields ``(batch, global_batch_size)``; the state of
    its random streams is saved in checkpoints through ``state_dict`` / ``load_state_dict``."""

    num_samples: int | None = None

    @abstractmethod
    def epoch(self, epoch: int) -> Iterator[tuple[Any, int]]:
        """Yield ``(batch, global_batch_size)`` for one epoch."""

    def state_dict(self) -> list:
        return []

    def load_state_dict(self, state: list) -> None:
        return None


class MemberBatches(BatchSource):
    """Per-member shuffled minibatches of in-memory tensors (see the module docstring).

    Args:
        data: name -> tensor with a leading sample dimension ``N`` (on ``ctx.device``).
        batch_size: global minibatch size per member.
        member_seeds: ``M`` seeds; member ``i``'s order is ``torch.randperm(N, generator=g_i)`` each epoch,
            ``g_i = torch.Generator().manual_seed(member_seeds[i])`` (one generator per distinct seed).
        ctx: under DDP every rank keeps its contiguous shard of every minibatch.
    """

    def __init__(self, data: Mapping[str, Tensor], batch_size: int, member_seeds: Sequence[int],
                 ctx: DistContext) -> None:
        if not data:
            raise ValueError("data must hold at least one tensor, got an empty mapping.")
        self.data = dict(data)
        self.num_samples = N = int(next(iter(self.data.values())).shape[0])
        for k, v in self.data.items():
            if int(v.shape[0]) != N:
                raise ValueError(f"all training tensors must have the same number of samples; {k!r} has "
                                 f"{int(v.shape[0])}, expected {N}.")
            if v.device != ctx.device:
                raise ValueError(f"data tensor {k!r} is on {v.device}, expected {ctx.device}.")
        self.batch_size = int(batch_size)
        self.ctx = ctx
        seeds = [int(s) for s in member_seeds]
        unique = sorted(set(seeds))
        self.member_to_unique = torch.tensor([unique.index(s) for s in seeds], device=ctx.device)
        self.generators = [torch.Generator().manual_seed(s) for s in unique]

    def epoch(self, epoch: int) -> Iterator[tuple[dict[str, Tensor], int]]:
        N, B = self.num_samples, self.batch_size
        perms = torch.stack([torch.randperm(N, generator=g) for g in self.generators]).to(self.ctx.device)
        order = perms[self.member_to_unique]  # (M, N): member i's sample order this epoch
        for j in range(math.ceil(N / B)):
            idx = order[:, j * B: (j + 1) * B]  # (M, b)
            b_global = int(idx.shape[1])
            if self.ctx.enabled:
                idx = idx.tensor_split(self.ctx.world_size, dim=1)[self.ctx.rank]
            yield {k: v[idx] for k, v in self.data.items()}, b_global

    def state_dict(self) -> list:
        return [g.get_state() for g in self.generators]

    def load_state_dict(self, state: list) -> None:
        if len(state) != len(self.generators):
            raise ValueError(f"checkpoint holds {len(state)} generator states, expected {len(self.generators)}.")
        for g, s in zip(self.generators, state):
            g.set_state(s)


class LoaderBatches(BatchSource):
    """Batches from a loader factory, shared by all members (see the module docstring).

    Args:
        make: ``make(epoch, ctx) -> Iterable`` of batches (0-based epoch).
        batch_size_of: the *global* size of a batch (default: dim 0 of its first tensor, times the world size).
        num_samples: samples per epoch, if known (only used for progress messages).
    """

    def __init__(self, make: Callable[[int, DistContext], Iterable[Any]], ctx: DistContext, *,
                 batch_size_of: Callable[[Any], int] | None = None, num_samples: int | None = None) -> None:
        if not callable(make):
            raise TypeError(f"make must be callable as make(epoch, ctx), got {type(make).__name__}.")
        self.make = make
        self.ctx = ctx
        self.batch_size_of = batch_size_of or (lambda b: _first_size(b) * ctx.world_size)
        self.num_samples = num_samples

    def epoch(self, epoch: int) -> Iterator[tuple[Any, int]]:
        for batch in self.make(epoch, self.ctx):
            yield batch, int(self.batch_size_of(batch))


class ShuffledBatches(BatchSource):
    """Minibatches of one model's in-memory data, in a fresh random order every epoch.

    Each epoch draws ``perm = torch.randperm(N, generator=generator)`` and then, with ``redraw``, the epoch's
    data ``redraw(data, generator)`` from the same generator; batch ``j`` is ``data[perm[j*B:(j+1)*B]]`` moved
    to ``device`` (``(b, ...)``, no member dimension).

    Args:
        data: name -> tensor with a leading sample dimension ``N`` (any device).
        batch_size: ``B``.
        generator: the shuffling stream (its state is checkpointed).
        redraw: optional ``redraw(data, generator) -> data`` called once per epoch after the permutation.
        drop_last: skip the last, smaller batch (unless it is the only one: ``N < B`` gives one batch of ``N``).
        max_steps: stop after this many batches in all (counted over epochs; ``None``: no limit).
        device: where the batches go (default: where the data is).
    """

    def __init__(self, data: Mapping[str, Tensor], batch_size: int, generator: torch.Generator, *,
                 redraw: Callable[[dict[str, Tensor], torch.Generator], dict[str, Tensor]] | None = None,
                 drop_last: bool = False, max_steps: int | None = None,
                 device: torch.device | str | None = None) -> None:
        if not data:
            raise ValueError("data must hold at least one tensor, got an empty mapping.")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        self.data = dict(data)
        self.num_samples = int(next(iter(self.data.values())).shape[0])
        self.batch_size, self.generator, self.redraw = int(batch_size), generator, redraw
        self.drop_last, self.max_steps, self.device = bool(drop_last), max_steps, device
        self.steps = 0

    def batches_per_epoch(self) -> int:
        N, B = self.num_samples, self.batch_size
        return max(1, N // B) if self.drop_last else math.ceil(N / B)

    def epoch(self, epoch: int) -> Iterator[tuple[dict[str, Tensor], int]]:
        perm = torch.randperm(self.num_samples, generator=self.generator)
        data = self.redraw(self.data, self.generator) if self.redraw is not None else self.data
        for j in range(self.batches_per_epoch()):
            if self.max_steps is not None and self.steps >= self.max_steps:
                return
            idx = perm[j * self.batch_size: (j + 1) * self.batch_size]
            batch = {k: v[idx].to(self.device) if self.device is not None else v[idx] for k, v in data.items()}
            self.steps += 1
            yield batch, int(idx.shape[0])

    def state_dict(self) -> list:
        return [self.generator.get_state(), self.steps]

    def load_state_dict(self, state: list) -> None:
        self.generator.set_state(state[0])
        self.steps = int(state[1])


def _first_size(batch: Any) -> int:
    if isinstance(batch, Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        for v in batch.values():
            if isinstance(v, Tensor):
                return int(v.shape[0])
    num = getattr(batch, "num_graphs", None)  # a PyG Batch
    if num is not None:
        return int(num)
    raise TypeError(f"cannot tell the size of a batch of type {type(batch).__name__}; pass batch_size_of.")


def as_source(data: Any, batch_size: int, member_seeds: Sequence[int], ctx: DistContext) -> BatchSource:
    """A :class:`BatchSource` for ``data``: a source as is, a mapping of tensors as :class:`MemberBatches`,
    a callable as :class:`LoaderBatches`."""
    if isinstance(data, BatchSource):
        return data
    if isinstance(data, Mapping):
        return MemberBatches(data, batch_size, member_seeds, ctx)
    if callable(data):
        return LoaderBatches(data, ctx)
    raise TypeError("training data must be a mapping of tensors, a BatchSource or a loader factory "
                    f"make(epoch, ctx); got {type(data).__name__}.")


def eval_batches(data: Any, batch_size: int | None) -> Iterator[tuple[Any, int]]:
    """``(batch, size)`` pairs of an evaluation split: a mapping of tensors in contiguous chunks of
    ``batch_size`` (one chunk when ``None``), or any iterable of batches as it comes."""
    if isinstance(data, Mapping):
        N = _first_size(data)
        step = N if batch_size is None else int(batch_size)
        for start in range(0, N, max(1, step)):
            if start == 0 and step >= N:
                yield data, N
            else:
                yield {k: v[start: start + step] for k, v in data.items()}, min(step, N - start)
        return
    for batch in data:
        yield batch, _first_size(batch)
