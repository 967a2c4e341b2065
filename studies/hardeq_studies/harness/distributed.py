r"""Data parallelism under ``torchrun``: the process group, and the gradient sum over ranks.

Every rank holds all members; each minibatch (of every member) is split into ``N`` contiguous shards, rank
``r`` computes the *sum* of its shard's per-sample losses divided by the *global* minibatch size, and the
gradients are summed over ranks with one explicit ``all_reduce`` of a flat buffer (gloo on CPU, nccl on GPU).
This equals the single-process gradient for any shard sizes (including an uneven last minibatch, where DDP's
gradient *averaging* would be off), up to floating-point summation order. All ranks then take the same
optimiser step, so they stay in sync without broadcasting parameters; evaluation is done redundantly on every
rank and only rank 0 writes checkpoints and results.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["DistContext", "init_distributed", "allreduce_gradients", "allreduce_sum", "barrier"]


@dataclass
class DistContext:
    """Rank, world size and device of this process (``world_size == 1`` without ``torchrun``)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None = None) -> DistContext:
    """Join the process group that ``torchrun`` describes in the environment (``WORLD_SIZE > 1``).

    Backend: nccl when CUDA is used (one GPU per local rank), else gloo. Without ``torchrun`` (or with
    ``WORLD_SIZE=1``) returns a single-process context on ``device`` (default: cuda if available, else cpu)
    and initialises nothing.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was requested but CUDA is not available here.")
    if world <= 1:
        dev = torch.device(device) if device is not None else torch.device("cuda" if use_cuda else "cpu")
        return DistContext(0, 1, dev)
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistContext(dist.get_rank(), dist.get_world_size(), dev)


def allreduce_gradients(params: Sequence[Tensor]) -> None:
    """Sum the gradients over ranks with one all_reduce of a flat buffer."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset: offset + n].view_as(p).clone()
        offset += n


def allreduce_sum(t: Tensor, ctx: DistContext) -> Tensor:
    """``t`` summed over ranks (in place; a no-op in a single process)."""
    if ctx.enabled:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()
