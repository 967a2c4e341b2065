r"""A generic training harness for many small, independent models trained at once.

The studies train the same small network many times: one copy per seed and per method. Instead of a
Python loop over them, the harness trains all *members* together as one batched model:

* :class:`BatchedMLP` holds ``M`` independent MLPs as weights of shape ``(M, fan_in, fan_out)`` and evaluates
  them with :func:`torch.baddbmm`. Member ``i`` is initialised exactly as ``nn.Linear``'s default would be
  after ``torch.manual_seed(seeds[i])`` (so a member equals the network a per-seed script would build), and
  members may have different output sizes (padded with zero columns that never receive gradient).
* Each member draws its own minibatch order from its own ``torch.Generator`` seeded with its seed, so
  members that share a seed (e.g. different methods with seed 3) see the same data order -- common random
  numbers -- and a member's trajectory does not depend on how many other members are trained with it.
* One loss, the sum over members of their per-sample mean losses, is back-propagated; since members share no
  parameters, each member's gradient is the gradient of its own loss, and Adam (elementwise) then updates
  every member exactly as a separate optimiser would.

A :class:`Task` says how to turn a member's outputs into per-sample losses and into evaluation metrics.
:func:`train` runs the epochs, evaluates every member on the training and validation sets after each epoch
(full passes, not running minibatch averages), keeps the per-member best-validation parameters,
checkpoints atomically, resumes bit-exactly, and shows a ``tqdm`` bar.

Distributed data parallel (``torchrun --nproc_per_node=N``): every rank holds all members; each minibatch
(of every member) is split into ``N`` contiguous shards, rank ``r`` computes the *sum* of its shard's
per-sample losses divided by the *global* minibatch size, and the gradients are summed over ranks with one
explicit ``all_reduce`` of a flat buffer (gloo on CPU, nccl on GPU). This equals the single-process
gradient for any shard sizes (including an uneven last minibatch, where DDP's gradient *averaging* would
be off), up to floating-point summation order. All ranks then take the same Adam step, so they stay in
sync without broadcasting parameters; evaluation is done redundantly on every rank (cheap here) and only
rank 0 writes checkpoints and results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BatchedMLP",
    "DistContext",
    "Task",
    "TrainConfig",
    "TrainResult",
    "Interrupted",
    "atomic_torch_save",
    "evaluate",
    "init_distributed",
    "load_checkpoint",
    "train",
]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "tanh": torch.tanh, "gelu": F.gelu}
_ACTIVATION_MODULES: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


# ----------------------------------------------------------------------------------------------------------
# the batched model
# ----------------------------------------------------------------------------------------------------------


class BatchedMLP(nn.Module):
    r"""``M`` independent multilayer perceptrons evaluated together.

    Layer ``l`` holds ``weight_l`` of shape ``(M, fan_in, fan_out)`` and ``bias_l`` of shape ``(M, 1, fan_out)``;
    the forward pass is ``h = act(baddbmm(bias, h, weight))``.

    Args:
        in_features: input size (shared by all members).
        hidden_features: sizes of the hidden layers, e.g. ``(32, 32)``.
        out_features: output size, one int for all members or one per member (outputs are then padded to
            the largest size with zero weights that never receive gradient: read ``output[i, :, :out_i]``).
        seeds: one seed per member; member ``i`` gets exactly the parameters that ``nn.Linear``'s default
            initialisation draws after ``torch.manual_seed(seeds[i])`` for the layers in order (the global
            RNG state is left untouched).
        activation: ``"relu"`` (default), ``"tanh"`` or ``"gelu"``.
        detach_outputs: optional boolean mask ``(M, max(out_features))``: the marked outputs are computed from
            *detached* last hidden features, so their gradient trains their own output weights but not the
            shared hidden layers (a stop-gradient head, e.g. a variance head that must not shape the features).
        dtype, device: of the parameters.

    Shapes:
        input ``(M, B, in_features)`` (or ``(B, in_features)``, shared by all members);
        output ``(M, B, max(out_features))``.

    Example:
        >>> net = BatchedMLP(3, (32, 32), [3, 6], seeds=[0, 0])
        >>> net(torch.zeros(2, 5, 3)).shape
        torch.Size([2, 5, 6])
    """

    def __init__(self, in_features: int, hidden_features: Sequence[int], out_features: int | Sequence[int],
                 seeds: Sequence[int], *, activation: str = "relu", detach_outputs: Tensor | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        seeds = [int(s) for s in seeds]
        if not seeds:
            raise ValueError("seeds must name at least one member, got an empty sequence.")
        if isinstance(out_features, int):
            out_features = [out_features] * len(seeds)
        out_features = [int(o) for o in out_features]
        if len(out_features) != len(seeds):
            raise ValueError(f"out_features has {len(out_features)} entries but there are {len(seeds)} seeds.")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}.")
        self.in_features = int(in_features)
        self.hidden_features = tuple(int(h) for h in hidden_features)
        self.out_features = out_features
        self.seeds = seeds
        self.activation = activation
        self._act = _ACTIVATIONS[activation]
        sizes = [self.in_features, *self.hidden_features, max(out_features)]
        self.num_layers = len(sizes) - 1
        M = len(seeds)
        weights = [torch.zeros(M, sizes[i], sizes[i + 1], dtype=dtype) for i in range(self.num_layers)]
        biases = [torch.zeros(M, 1, sizes[i + 1], dtype=dtype) for i in range(self.num_layers)]
        for m, (seed, out) in enumerate(zip(seeds, out_features)):  # one-off initialisation, not training
            for i, layer in enumerate(self.reference_layers(seed, out)):
                weights[i][m, :, : layer.out_features] = layer.weight.detach().T.to(dtype)
                biases[i][m, 0, : layer.out_features] = layer.bias.detach().to(dtype)
        for i in range(self.num_layers):
            self.register_parameter(f"weight{i}", nn.Parameter(weights[i].to(device)))
            self.register_parameter(f"bias{i}", nn.Parameter(biases[i].to(device)))
        if detach_outputs is not None:
            detach_outputs = torch.as_tensor(detach_outputs, dtype=torch.bool)
            if detach_outputs.shape != (M, sizes[-1]):
                raise ValueError(f"detach_outputs must have shape (M, max(out_features)) = {(M, sizes[-1])}, got "
                                 f"{tuple(detach_outputs.shape)}.")
            if not bool(detach_outputs.any()):
                detach_outputs = None
        self._detach: Tensor | None
        self.register_buffer("_detach", None if detach_outputs is None else detach_outputs.unsqueeze(1).to(device),
                             persistent=False)

    def reference_layers(self, seed: int, out_features: int) -> list[nn.Linear]:
        """The ``nn.Linear`` layers a per-seed script would build with ``torch.manual_seed(seed)`` (float32)."""
        sizes = [self.in_features, *self.hidden_features, out_features]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return [nn.Linear(sizes[i], sizes[i + 1]) for i in range(len(sizes) - 1)]

    def member(self, index: int) -> nn.Sequential:
        """Member ``index`` as an ordinary ``nn.Sequential`` of ``nn.Linear`` layers (a copy, same dtype)."""
        layers: list[nn.Module] = []
        out = self.out_features[index]
        for i in range(self.num_layers):
            W = getattr(self, f"weight{i}")[index].detach()
            b = getattr(self, f"bias{i}")[index, 0].detach()
            if i == self.num_layers - 1:
                W, b = W[:, :out], b[:out]
            lin = nn.Linear(W.shape[0], W.shape[1], dtype=W.dtype, device=W.device)
            with torch.no_grad():
                lin.weight.copy_(W.T)
                lin.bias.copy_(b)
            layers.append(lin)
            if i < self.num_layers - 1:
                layers.append(_ACTIVATION_MODULES[self.activation]())
        return nn.Sequential(*layers)

    @property
    def num_members(self) -> int:
        return len(self.seeds)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            x = x.expand(self.num_members, *x.shape)
        h = x
        for i in range(self.num_layers - 1):
            h = self._act(torch.baddbmm(getattr(self, f"bias{i}"), h, getattr(self, f"weight{i}")))
        W, b = getattr(self, f"weight{self.num_layers - 1}"), getattr(self, f"bias{self.num_layers - 1}")
        out = torch.baddbmm(b, h, W)
        if self._detach is not None:
            out = torch.where(self._detach, torch.baddbmm(b, h.detach(), W), out)
        return out

    def extra_repr(self) -> str:
        return (f"members={self.num_members}, in={self.in_features}, hidden={self.hidden_features}, "
                f"out={sorted(set(self.out_features))}, activation={self.activation}")


# ----------------------------------------------------------------------------------------------------------
# tasks, configuration, results
# ----------------------------------------------------------------------------------------------------------


class Task(ABC):
    """What the harness trains: per-sample losses and evaluation metrics of the members' outputs.

    ``batch`` maps names to tensors; in :meth:`loss` every tensor has shape ``(M, b, ...)`` (each member's
    own minibatch); in :meth:`metrics` shape ``(N, ...)`` (a whole split, shared by all members).
    """

    def forward(self, model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
        """Model outputs ``(M, b, out)``; the default feeds ``batch["x"]``."""
        return model(batch["x"])

    @abstractmethod
    def loss(self, output: Tensor, batch: Mapping[str, Tensor]) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """Per-sample training losses, shape ``(M, b)``; the harness averages over the global minibatch.

        May also return a dict of per-sample values ``(M, b)`` (e.g. the squared error of the prediction);
        the harness averages each over the epoch's samples into ``history["train_<name>"]`` -- the running
        training metric of the model as it was when each minibatch was seen, as ``loss_train`` curves are
        usually drawn.
        """
        ...

    @abstractmethod
    def metrics(self, output: Tensor, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Metrics of every member on a split, each of shape ``(M,)`` (NaN where a metric does not apply)."""
        ...


@dataclass
class TrainConfig:
    """Optimisation settings of :func:`train` (the study's config fills these; no defaults hide in argparse).

    Attributes:
        epochs: passes over the training set.
        batch_size: global minibatch size per member (split over ranks under DDP); the last minibatch of an
            epoch is smaller when the training set size is not a multiple (``drop_last=False``).
        lr, betas, eps: Adam's.
        select_metric: validation metric (key of :meth:`Task.metrics`) whose minimum picks each member's
            best epoch; ties keep the earlier epoch.
        checkpoint_every: epochs between checkpoints (and always after the last epoch).
        eval_train: also evaluate on the whole training set after every epoch (``history["train_eval_*"]``);
            off by default: the running per-minibatch values returned by :meth:`Task.loss` are cheaper.
    """

    epochs: int
    batch_size: int
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    select_metric: str = "mse"
    checkpoint_every: int = 10
    eval_train: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass
class TrainResult:
    """What :func:`train` returns (all tensors on the CPU).

    Attributes:
        best_state: per-member parameters at each member's best validation epoch (a ``state_dict``).
        final_state: parameters after the last epoch.
        best_epoch: ``(M,)`` 1-based epoch of each member's best validation ``select_metric``.
        best_value: ``(M,)`` that validation value.
        history: ``"train_<metric>"`` / ``"val_<metric>"`` -> ``(epochs, M)`` per-epoch metrics.
        epochs_run: epochs trained in this call (less than ``epochs`` after a resume).
    """

    best_state: dict[str, Tensor]
    final_state: dict[str, Tensor]
    best_epoch: Tensor
    best_value: Tensor
    history: dict[str, Tensor]
    epochs_run: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Interrupted(RuntimeError):
    """Raised by a callback to stop training (used by tests to simulate an interrupted run)."""


# ----------------------------------------------------------------------------------------------------------
# distributed
# ----------------------------------------------------------------------------------------------------------


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

    Backend: nccl when CUDA is available (one GPU per local rank), else gloo. Without ``torchrun`` (or with
    ``WORLD_SIZE=1``) returns a single-process context and initialises nothing.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
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


def _allreduce_gradients(params: Sequence[Tensor]) -> None:
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


def _barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()


# ----------------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------------


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then ``os.replace`` (never a torn file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".ckpt.tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`train` (``weights_only=True``: tensors and plain containers)."""
    return torch.load(Path(path), map_location="cpu", weights_only=True)


def fingerprint(obj: Any) -> str:
    """A short hash of a JSON-able description of a run (refuses to resume a different run)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------


def _progress_enabled(progress: bool, ctx: DistContext) -> bool:
    return bool(progress) and ctx.is_main and sys.stderr.isatty()


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, data: Mapping[str, Tensor],
             state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Metrics ``{name: (M,)}`` of every member on a whole split, optionally with parameters ``state``."""
    if state is not None:
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    try:
        out = task.forward(model, data)
        return {k: v.detach() for k, v in task.metrics(out, data).items()}
    finally:
        if state is not None:
            model.load_state_dict(saved)


def train(
    model: nn.Module,
    task: Task,
    train_data: Mapping[str, Tensor],
    val_data: Mapping[str, Tensor],
    config: TrainConfig,
    member_seeds: Sequence[int],
    *,
    checkpoint_path: Path | None = None,
    resume: bool = False,
    run_id: Any = None,
    progress: bool = True,
    desc: str = "train",
    callback: Callable[[int, dict[str, Any]], None] | None = None,
    ctx: DistContext | None = None,
    position: int = 0,
    log_every: int = 0,
) -> TrainResult:
    r"""Train all members of ``model`` for ``config.epochs`` epochs; keep each member's best-validation state.

    Args:
        model: a batched model (e.g. :class:`BatchedMLP`) with ``M`` members, on ``ctx.device``.
        task: the losses and metrics.
        train_data, val_data: name -> tensor with a leading sample dimension (on ``ctx.device``).
        config: optimisation settings.
        member_seeds: ``M`` seeds; member ``i``'s minibatch order comes from
            ``torch.Generator().manual_seed(member_seeds[i])`` (one ``randperm`` per epoch).
        checkpoint_path: where to checkpoint (every ``config.checkpoint_every`` epochs and at the end). The
            checkpoint holds parameters, optimiser state, generator states, the best-so-far states and the
            metric history -- tensors and plain containers only, loaded with ``weights_only=True``.
        resume: continue from ``checkpoint_path`` if it exists; the result equals an uninterrupted run's.
        run_id: JSON-able description of the run, hashed into the checkpoint; resuming a checkpoint whose
            hash differs raises ``ValueError``.
        progress: show a ``tqdm`` bar (only on rank 0 and when stderr is a terminal).
        callback: ``callback(epoch, info)`` after every epoch (after checkpointing); may raise
            :class:`Interrupted` to stop.
        ctx: distributed context (:func:`init_distributed`); default single process on the model's device.
        position: line of the progress bar (for several trainings in parallel processes).
        log_every: when ``progress`` is on but stderr is not a terminal (``nohup``), print one status line
            to stderr every ``log_every`` epochs instead of a bar (0: never).

    Returns:
        :class:`TrainResult`.
    """
    from tqdm.auto import tqdm

    ctx = ctx or DistContext(device=next(model.parameters()).device)
    member_seeds = [int(s) for s in member_seeds]
    M = len(member_seeds)
    names = list(train_data)
    N = int(train_data[names[0]].shape[0])
    for k, v in list(train_data.items()) + list(val_data.items()):
        if v.device != ctx.device:
            raise ValueError(f"data tensor {k!r} is on {v.device}, expected {ctx.device}.")
    if any(int(v.shape[0]) != N for v in train_data.values()):
        raise ValueError("all training tensors must have the same number of samples.")
    B = int(config.batch_size)
    num_batches = math.ceil(N / B)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=config.lr, betas=tuple(config.betas), eps=config.eps, foreach=True)

    # one generator per distinct seed; members sharing a seed share the order (common random numbers)
    unique_seeds = sorted(set(member_seeds))
    member_to_unique = torch.tensor([unique_seeds.index(s) for s in member_seeds], device=ctx.device)
    generators = [torch.Generator().manual_seed(s) for s in unique_seeds]

    # what determines the result (not checkpoint_every: a run may be resumed with another interval)
    same_result = {k: v for k, v in config.to_dict().items() if k != "checkpoint_every"}
    run_hash = fingerprint({"run": run_id, "config": same_result, "seeds": member_seeds, "N": N,
                            "world": ctx.world_size})
    history: dict[str, Tensor] = {}
    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    best_value = torch.full((M,), math.inf, dtype=torch.float64)
    best_epoch = torch.zeros(M, dtype=torch.long)
    start_epoch = 0

    if resume and checkpoint_path is not None and Path(checkpoint_path).exists():
        ck = load_checkpoint(checkpoint_path)
        if ck.get("fingerprint") != run_hash:
            raise ValueError(
                f"checkpoint {checkpoint_path} belongs to a different run (fingerprint {ck.get('fingerprint')} "
                f"!= {run_hash}); remove it or run without --resume."
            )
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        for g, s in zip(generators, ck["generators"]):
            g.set_state(s)
        best_state = {k: v.to(ctx.device) for k, v in ck["best_state"].items()}
        best_value = ck["best_value"]
        best_epoch = ck["best_epoch"]
        history = dict(ck["history"])
        start_epoch = int(ck["epoch"])

    def save(epoch: int) -> None:
        if checkpoint_path is None or not ctx.is_main:
            return
        atomic_torch_save({
            "fingerprint": run_hash,
            "epoch": epoch,
            "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "generators": [g.get_state() for g in generators],
            "best_state": {k: v.cpu() for k, v in best_state.items()},
            "best_value": best_value,
            "best_epoch": best_epoch,
            "history": history,
        }, Path(checkpoint_path))

    bar = tqdm(total=config.epochs, initial=start_epoch, desc=desc, unit="epoch", leave=False,
               disable=not _progress_enabled(progress, ctx), dynamic_ncols=True, position=position)
    epochs_run = 0
    t_start = time.perf_counter()
    try:
        for epoch in range(start_epoch, config.epochs):
            model.train()
            perms = torch.stack([torch.randperm(N, generator=g) for g in generators]).to(ctx.device)
            order = perms[member_to_unique]  # (M, N): member i's sample order this epoch
            running: dict[str, Tensor] = {}
            for j in range(num_batches):
                idx = order[:, j * B: (j + 1) * B]  # (M, b)
                b_global = idx.shape[1]
                if ctx.enabled:
                    idx = idx.tensor_split(ctx.world_size, dim=1)[ctx.rank]
                batch = {k: v[idx] for k, v in train_data.items()}  # (M, b_local, ...)
                out = task.forward(model, batch)
                per_sample = task.loss(out, batch)
                if isinstance(per_sample, tuple):
                    per_sample, extra = per_sample
                    for k, v in extra.items():
                        total = v.detach().sum(1).to(torch.float64)
                        running[k] = running[k] + total if k in running else total
                loss = per_sample.sum() / b_global
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                if ctx.enabled:
                    _allreduce_gradients(params)
                optimizer.step()
            # end of epoch: evaluate every member on whole splits
            model.eval()
            metrics: dict[str, Tensor] = {}
            if running:
                names_r = sorted(running)
                sums = torch.stack([running[k] for k in names_r])  # (R, M), this rank's samples
                if ctx.enabled:
                    import torch.distributed as dist

                    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
                metrics.update({f"train_{k}": sums[i] / N for i, k in enumerate(names_r)})
            if config.eval_train:
                metrics.update({f"train_eval_{k}": v for k, v in evaluate(model, task, train_data).items()})
            metrics.update({f"val_{k}": v for k, v in evaluate(model, task, val_data).items()})
            for k, v in metrics.items():
                if k not in history:
                    history[k] = torch.full((config.epochs, M), math.nan, dtype=torch.float64)
                history[k][epoch] = v.detach().to("cpu", torch.float64)
            current = metrics[f"val_{config.select_metric}"].detach().to("cpu", torch.float64)
            improved = current < best_value  # NaN never improves
            if bool(improved.any()):
                imp = improved.to(ctx.device)
                with torch.no_grad():
                    for k, v in model.state_dict().items():
                        mask = imp.view((M,) + (1,) * (v.dim() - 1))
                        best_state[k] = torch.where(mask, v.detach(), best_state[k])
                best_value = torch.where(improved, current, best_value)
                best_epoch = torch.where(improved, torch.full_like(best_epoch, epoch + 1), best_epoch)
            epochs_run += 1
            done = epoch + 1
            if done % max(1, config.checkpoint_every) == 0 or done == config.epochs:
                save(done)
                _barrier(ctx)
            bar.update(1)
            if bar.disable is False:
                bar.set_postfix_str(f"best val {config.select_metric} (median) "
                                    f"{best_value.median().item():.3g}")
            if (log_every and progress and ctx.is_main and bar.disable
                    and (done % log_every == 0 or done == config.epochs)):
                print(f"[{desc}] epoch {done}/{config.epochs}  best val {config.select_metric} (median over "
                      f"members) {best_value.median().item():.4g}  {time.perf_counter() - t_start:.0f} s",
                      file=sys.stderr, flush=True)
            if callback is not None:
                callback(done, {"metrics": metrics, "best_value": best_value})
    finally:
        bar.close()
    return TrainResult(
        best_state={k: v.detach().cpu().clone() for k, v in best_state.items()},
        final_state={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        best_epoch=best_epoch.clone(),
        best_value=best_value.clone(),
        history={k: v.clone() for k, v in history.items()},
        epochs_run=epochs_run,
    )
