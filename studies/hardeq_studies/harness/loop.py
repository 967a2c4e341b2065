r"""The training loop, in parts with one job each.

:func:`train` wires them together; :class:`Trainer` holds the state of one run:

* :meth:`Trainer.restore` -- resume from a checkpoint (refusing one of another run);
* :meth:`Trainer.train_epoch` -- one pass over the training source; :meth:`Trainer.optimizer_step` is the
  one place where a loss is back-propagated (gradient sum over ranks, clipping, optimiser and per-step
  schedule, early-stopped members kept frozen, EMA update, :class:`Hooks` ``on_step``);
* :meth:`Trainer.evaluate_epoch` -- the running training metrics and the validation metrics of every member;
* :meth:`Trainer.select` -- each member's best-validation parameters and its early-stopping counter;
* :meth:`Trainer.checkpoint` -- an atomic checkpoint (rank 0 only);
* :mod:`.progress` -- progress bar and log line.

Without validation data (``val_data=None``) nothing is evaluated or selected: the result's best state is the
final one (a generative model trained for a fixed budget, evaluated by the study afterwards).

One loss, the sum over members of their per-sample losses divided by the global minibatch size, is
back-propagated; since members share no parameters, each member's gradient is the gradient of its own loss,
and an elementwise optimiser (Adam) updates every member exactly as a separate optimiser would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint import atomic_torch_save, fingerprint, load_checkpoint
from .data import BatchSource, as_source, eval_batches
from .distributed import DistContext, allreduce_gradients, allreduce_sum, barrier
from .members import merge_members
from .progress import Heartbeat, progress_bar, report_epoch
from .task import Hooks, OptimizerFactory, SchedulerFactory, Task, TrainConfig, TrainResult

__all__ = ["train", "evaluate", "Trainer", "run_fingerprint"]


def _eval_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, data: Any, state: Mapping[str, Tensor] | None = None, *,
             batch_size: int | None = None, generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """Metrics ``{name: (M,)}`` of every member on a whole split, optionally with parameters ``state``.

    Args:
        data: a mapping of tensors (evaluated in contiguous chunks of ``batch_size``; one pass when ``None``)
            or an iterable of batches.
        state: parameters to evaluate (the model's own are restored afterwards).
        generator: the evaluation's random stream, passed to :meth:`Task.metrics`.

    Batches are combined as means weighted by their sizes (exact for per-sample means).
    """
    if state is not None:
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    try:
        totals: dict[str, Tensor] = {}
        count, first, num_batches = 0, None, 0
        for batch, size in eval_batches(data, batch_size):
            num_batches += 1
            out = task.forward(model, batch)
            metrics = {k: v.detach() for k, v in task.metrics(out, batch, generator=generator).items()}
            if first is None:
                first = metrics
            for k, v in metrics.items():
                totals[k] = totals[k] + v.to(torch.float64) * size if k in totals else v.to(torch.float64) * size
            count += size
        if first is None:
            raise ValueError("the evaluation split is empty.")
        if num_batches == 1:  # a single batch: its values as they are
            return first
        return {k: (v / count).to(first[k].dtype) for k, v in totals.items()}
    finally:
        if state is not None:
            model.load_state_dict(saved)


def run_fingerprint(run_id: Any, config: TrainConfig, member_seeds: Sequence[int], num_samples: int | None,
                    world_size: int = 1) -> str:
    """The fingerprint :func:`train` writes into its checkpoints (a study can tell a finished run's checkpoint)."""
    return fingerprint({"run": run_id, "config": config.result_fields(), "seeds": [int(s) for s in member_seeds],
                        "N": num_samples, "world": world_size})


class Trainer:
    """The state of one training run; see the module docstring and :func:`train` for the arguments."""

    def __init__(self, model: nn.Module, task: Task, source: BatchSource, val_data: Any, config: TrainConfig,
                 member_seeds: Sequence[int], *, ctx: DistContext, optimizer: OptimizerFactory | None,
                 scheduler: SchedulerFactory | None, run_id: Any, checkpoint_path: Path | None,
                 hooks: Sequence[Hooks] = (), desc: str = "train") -> None:
        self.model, self.task, self.source, self.val_data, self.config = model, task, source, val_data, config
        self.ctx, self.hooks, self.desc = ctx, list(hooks), desc
        self.M = M = len(member_seeds)
        self.params = list(model.parameters())
        self.optimizer = (optimizer(self.params) if optimizer is not None else
                          torch.optim.Adam(self.params, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                                           foreach=True))
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.checkpoint_path = None if checkpoint_path is None else Path(checkpoint_path)
        self.run_hash = run_fingerprint(run_id, config, member_seeds, source.num_samples, ctx.world_size)
        self.history: dict[str, Tensor] = {}
        self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.best_value = torch.full((M,), math.inf, dtype=torch.float64)
        self.best_epoch = torch.zeros(M, dtype=torch.long)
        self.since_best = torch.zeros(M, dtype=torch.long)
        self.stopped_epoch = torch.zeros(M, dtype=torch.long)
        self.frozen: dict[str, Tensor] | None = None  # parameters of the members that stopped early
        self.ema = ({k: v.detach().clone() for k, v in model.state_dict().items()}
                    if config.ema_decay is not None else None)
        self.epoch = 0
        self.step = 0  # optimiser steps taken
        self.heartbeat: Heartbeat | None = None  # status lines within long epochs (set by train)

    # ---------------------------------------------------------------------------------------- resume
    def restore(self) -> None:
        """Continue from ``checkpoint_path`` (raises ``ValueError`` for a checkpoint of another run)."""
        ck = load_checkpoint(self.checkpoint_path)
        if ck.get("fingerprint") != self.run_hash:
            raise ValueError(f"checkpoint {self.checkpoint_path} belongs to a different run (fingerprint "
                             f"{ck.get('fingerprint')} != {self.run_hash}); remove it, or pass --fresh instead of "
                             "--resume.")
        dev = self.ctx.device
        self.model.load_state_dict(ck["model"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.source.load_state_dict(ck["generators"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(ck["scheduler"])
        self.best_state = {k: v.to(dev) for k, v in ck["best_state"].items()}
        self.best_value, self.best_epoch = ck["best_value"], ck["best_epoch"]
        self.history = dict(ck["history"])
        self.since_best = ck.get("since_best", self.since_best)
        self.stopped_epoch = ck.get("stopped_epoch", self.stopped_epoch)
        if ck.get("frozen") is not None:
            self.frozen = {k: v.to(dev) for k, v in ck["frozen"].items()}
        if ck.get("ema") is not None:
            self.ema = {k: v.to(dev) for k, v in ck["ema"].items()}
        self.epoch = int(ck["epoch"])
        self.step = int(ck.get("step", 0))
        if ck.get("torch_rng") is not None:  # dropout and other draws from torch's global stream
            torch.set_rng_state(ck["torch_rng"])
        if ck.get("cuda_rng") is not None and dev.type == "cuda":
            torch.cuda.set_rng_state(ck["cuda_rng"], dev)
        for hook, state in zip(self.hooks, ck.get("hooks", [])):
            hook.load_state_dict(state)

    def checkpoint(self) -> None:
        """Atomic checkpoint of everything the next epochs depend on (rank 0 only)."""
        if self.checkpoint_path is None or not self.ctx.is_main:
            return
        def cpu(d):
            return None if d is None else {k: v.detach().cpu() for k, v in d.items()}

        state = {
            "fingerprint": self.run_hash, "epoch": self.epoch, "model": cpu(self.model.state_dict()),
            "optimizer": self.optimizer.state_dict(), "generators": self.source.state_dict(),
            "best_state": cpu(self.best_state), "best_value": self.best_value, "best_epoch": self.best_epoch,
            "history": self.history, "step": self.step, "torch_rng": torch.get_rng_state(),
        }
        if self.hooks:
            state["hooks"] = [hook.state_dict() for hook in self.hooks]
        if self.ctx.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.ctx.device)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.config.patience is not None:
            state.update(since_best=self.since_best, stopped_epoch=self.stopped_epoch, frozen=cpu(self.frozen))
        if self.ema is not None:
            state["ema"] = cpu(self.ema)
        atomic_torch_save(state, self.checkpoint_path)

    # ------------------------------------------------------------------------------------------ train
    @property
    def stopped(self) -> Tensor:
        return self.stopped_epoch > 0

    def train_epoch(self) -> dict[str, Tensor]:
        """One pass over the training source; returns the running per-sample values averaged over it (per
        batch for a batch-level loss)."""
        self.epoch_started = time.perf_counter()  # for hooks that time epochs
        self.model.train()
        running: dict[str, Tensor] = {}
        count = 0
        for i, (batch, b_global) in enumerate(self.source.epoch(self.epoch)):
            out = self.task.forward(self.model, batch)
            per_sample, extra = self.task.loss(out, batch), {}
            if isinstance(per_sample, tuple):
                per_sample, extra = per_sample
            batch_level = per_sample.dim() == 0
            for k, v in extra.items():
                total = (v.detach().reshape(1) if batch_level else v.detach().sum(1)).to(torch.float64)
                running[k] = running[k] + total if k in running else total
            count += 1 if batch_level else b_global
            loss = per_sample / self.ctx.world_size if batch_level else per_sample.sum() / b_global
            if self.config.raise_nonfinite and not bool(torch.isfinite(loss)):
                raise FloatingPointError(f"{self.desc}, epoch {self.epoch + 1}: non-finite loss at step {i}.")
            self.optimizer_step(loss, extra)
            if self.heartbeat is not None and self.heartbeat.due():
                self.heartbeat.say(f"[{self.desc}] epoch {self.epoch + 1}/{self.config.epochs}, step {i + 1} of "
                                   f"the epoch ({self.step} in all)")
        if self.scheduler is not None and not self.config.schedule_per_step:
            self.scheduler.step()
        if not running:
            return {}
        names = sorted(running)
        sums = allreduce_sum(torch.stack([running[k] for k in names]), self.ctx)  # (R, M)
        return {f"train_{k}": sums[i] / count for i, k in enumerate(names)}

    def optimizer_step(self, loss: Tensor, extra: Mapping[str, Tensor] | None = None) -> None:
        """Back-propagate ``loss`` and take one optimiser step, with everything that goes with it."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=cfg.zero_grad_to_none)
        loss.backward()
        if self.ctx.enabled:
            allreduce_gradients(self.params)
        if cfg.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.clip_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None and cfg.schedule_per_step:
            self.scheduler.step()
        self._after_step()
        self.step += 1
        if self.hooks:
            detached = {k: v.detach() for k, v in (extra or {}).items()}
            for hook in self.hooks:
                hook.on_step(self, loss.detach(), detached)

    @torch.no_grad()
    def _after_step(self) -> None:
        if self.frozen is not None and bool(self.stopped.any()):
            self.model.load_state_dict(merge_members(self.model, self.model.state_dict(), self.frozen,
                                                     self.stopped.to(self.ctx.device)))
        if self.ema is not None:
            decay = float(self.config.ema_decay)
            if self.config.ema_warmup:
                decay = min(decay, (1 + self.step) / (10 + self.step))
            for k, v in self.model.state_dict().items():
                if v.is_floating_point():
                    self.ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
                else:
                    self.ema[k].copy_(v)

    # --------------------------------------------------------------------------------------- evaluate
    def eval_state(self) -> dict[str, Tensor] | None:
        """The parameters evaluated and selected: the EMA's when enabled, else the model's own."""
        return self.ema

    def evaluate_epoch(self, running: dict[str, Tensor]) -> dict[str, Tensor]:
        """The epoch's metrics ``{"train_*", "val_*": (M,)}``, recorded into :attr:`history`."""
        cfg = self.config
        metrics = dict(running)
        if self.val_data is not None:
            self.model.eval()
            metrics.update(self._validate())
        for k, v in metrics.items():
            if k not in self.history:
                self.history[k] = torch.full((cfg.epochs, self.M), math.nan, dtype=torch.float64)
            row = v.detach().to("cpu", torch.float64)
            self.history[k][self.epoch] = torch.where(self.stopped, math.nan, row) if cfg.patience else row
        return metrics

    def _validate(self) -> dict[str, Tensor]:
        cfg = self.config
        gen = _eval_generator(cfg.eval_seed, self.epoch)
        metrics = {}
        if cfg.eval_train:
            data = self.source.data if hasattr(self.source, "data") else None
            if data is None:
                raise ValueError("eval_train needs in-memory training data (a mapping of tensors).")
            metrics.update({f"train_eval_{k}": v for k, v in evaluate(
                self.model, self.task, data, self.eval_state(), batch_size=cfg.eval_batch_size,
                generator=gen).items()})
        metrics.update({f"val_{k}": v for k, v in evaluate(
            self.model, self.task, self.val_data, self.eval_state(), batch_size=cfg.eval_batch_size,
            generator=gen).items()})
        return metrics

    @torch.no_grad()
    def select(self, metrics: Mapping[str, Tensor]) -> None:
        """Keep each member's best-validation parameters; stop members out of patience (no-op without
        validation data)."""
        cfg = self.config
        if self.val_data is None:
            return
        key = f"val_{cfg.select_metric}"
        if key not in metrics:
            raise ValueError(f"select_metric {cfg.select_metric!r} is not among the task's metrics "
                             f"{sorted(k[4:] for k in metrics if k.startswith('val_'))}.")
        current = metrics[key].detach().to("cpu", torch.float64)
        improved = (current < self.best_value) & ~self.stopped  # NaN never improves
        if bool(improved.any()):
            state = self.eval_state() or self.model.state_dict()
            self.best_state = merge_members(self.model, self.best_state, {k: v.detach() for k, v in state.items()},
                                            improved.to(self.ctx.device))
            self.best_value = torch.where(improved, current, self.best_value)
            self.best_epoch = torch.where(improved, torch.full_like(self.best_epoch, self.epoch + 1), self.best_epoch)
        if cfg.patience is not None:
            self.since_best = torch.where(improved, torch.zeros_like(self.since_best), self.since_best + 1)
            newly = (self.since_best >= cfg.patience) & ~self.stopped
            if bool(newly.any()):
                now = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                self.frozen = now if self.frozen is None else merge_members(self.model, self.frozen, now,
                                                                            newly.to(self.ctx.device))
                self.stopped_epoch = torch.where(newly, torch.full_like(self.stopped_epoch, self.epoch + 1),
                                                 self.stopped_epoch)

    def result(self, epochs_run: int) -> TrainResult:
        final = self.eval_state() or self.model.state_dict()
        best = final if self.val_data is None else self.best_state
        return TrainResult(
            best_state={k: v.detach().cpu().clone() for k, v in best.items()},
            final_state={k: v.detach().cpu().clone() for k, v in final.items()},
            best_epoch=self.best_epoch.clone(), best_value=self.best_value.clone(),
            history={k: v.clone() for k, v in self.history.items()},
            stopped_epoch=self.stopped_epoch.clone(), epochs_run=epochs_run)


def train(
    model: nn.Module,
    task: Task,
    train_data: Any,
    val_data: Any,
    config: TrainConfig,
    member_seeds: Sequence[int],
    *,
    optimizer: OptimizerFactory | None = None,
    scheduler: SchedulerFactory | None = None,
    checkpoint_path: Path | None = None,
    resume: bool = False,
    run_id: Any = None,
    progress: bool = True,
    desc: str = "train",
    callback: Callable[[int, dict[str, Any]], None] | None = None,
    hooks: Hooks | Sequence[Hooks] | None = None,
    ctx: DistContext | None = None,
    position: int = 0,
    log_every: int = 0,
) -> TrainResult:
    r"""Train all members of ``model`` for ``config.epochs`` epochs; keep each member's best-validation state.

    Args:
        model: a member model (:class:`BatchedMLP`, :class:`MemberList`, ...) with ``M`` members, on
            ``ctx.device``.
        task: the losses and metrics.
        train_data: a mapping of in-memory tensors (per-member shuffled minibatches of
            ``config.batch_size``), a loader factory ``make(epoch, ctx)`` or a :class:`BatchSource`.
        val_data: a mapping of tensors or an iterable of batches (evaluated in batches of
            ``config.eval_batch_size``); ``None``: no evaluation nor selection (the best state is the final one).
        config: optimisation settings.
        member_seeds: ``M`` seeds (the in-memory source's per-member sample orders).
        optimizer: ``optimizer(params)`` (default: Adam with the config's lr, betas, eps).
        scheduler: ``scheduler(optimizer)``, stepped after every epoch (or every step with
            ``config.schedule_per_step``; checkpointed with ``state_dict``).
        checkpoint_path: where to checkpoint (every ``config.checkpoint_every`` epochs, at the end, and when
            every member stopped early); tensors and plain containers only, loaded with ``weights_only=True``.
        resume: continue from ``checkpoint_path`` if it exists; the result equals an uninterrupted run's.
        run_id: JSON-able description of the run, hashed into the checkpoint; a checkpoint whose hash differs
            raises ``ValueError``.
        progress: show a ``tqdm`` bar (rank 0, stderr a terminal) or, when stderr is not a terminal, print a
            status line every ``log_every`` epochs (0: only the heartbeat) and at least every
            :data:`~.progress.HEARTBEAT_S` seconds, within an epoch too.
        callback: ``callback(epoch, info)`` after every epoch (after checkpointing); may raise
            :class:`Interrupted` to stop.
        hooks: :class:`Hooks` called after every optimiser step and every epoch; their state is checkpointed.
        ctx: distributed context (default: one process on the model's device).
        position: line of the progress bar (several trainings in parallel processes).

    Returns:
        :class:`TrainResult`.
    """
    ctx = ctx or DistContext(device=next(model.parameters()).device)
    source = as_source(train_data, config.batch_size, member_seeds, ctx)
    hooks = [] if hooks is None else [hooks] if isinstance(hooks, Hooks) else list(hooks)
    tr = Trainer(model, task, source, val_data, config, member_seeds, ctx=ctx, optimizer=optimizer,
                 scheduler=scheduler, run_id=run_id, checkpoint_path=checkpoint_path, hooks=hooks, desc=desc)
    if resume and checkpoint_path is not None and Path(checkpoint_path).exists():
        tr.restore()
    bar = progress_bar(progress, ctx, total=config.epochs, initial=tr.epoch, desc=desc, unit="epoch", leave=False,
                       position=position)
    tr.heartbeat = Heartbeat(bool(progress) and ctx.is_main and bool(bar.disable))
    epochs_run, t_start = 0, time.perf_counter()
    try:
        while tr.epoch < config.epochs and not bool(tr.stopped.all()):
            metrics = tr.evaluate_epoch(tr.train_epoch())
            tr.select(metrics)
            for hook in hooks:
                hook.on_epoch(tr, metrics)
            tr.epoch += 1
            epochs_run += 1
            done = tr.epoch
            if (done % max(1, config.checkpoint_every) == 0 or done == config.epochs
                    or bool(tr.stopped.all())):
                tr.checkpoint()
                barrier(ctx)
            report_epoch(tr, bar, progress, log_every, desc, t_start, tr.heartbeat)
            if callback is not None:
                callback(done, {"metrics": metrics, "best_value": tr.best_value})
    finally:
        bar.close()
    return tr.result(epochs_run)
