"""What the harness trains (:class:`Task`), how (:class:`TrainConfig`) and what it returns (:class:`TrainResult`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Task", "Objective", "TrainConfig", "TrainResult", "Interrupted", "Hooks", "OnEpoch"]


class Task(ABC):
    """Per-sample losses and evaluation metrics of the members' outputs.

    ``batch`` maps names to tensors (or anything :meth:`forward` understands, e.g. a graph batch). In
    :meth:`loss` tensors have shape ``(M, b, ...)`` when every member gets its own minibatch (in-memory data)
    or ``(b, ...)`` when all members share one (a loader); in :meth:`metrics` they are one evaluation batch,
    shared by all members.
    """

    def forward(self, model: nn.Module, batch: Mapping[str, Any]) -> Tensor:
        """Model outputs ``(M, b, out)``; the default feeds ``batch["x"]``."""
        return model(batch["x"])

    @abstractmethod
    def loss(self, output: Tensor, batch: Mapping[str, Any]) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """Per-sample training losses, shape ``(M, b)``; the harness sums them and divides by the global
        minibatch size.

        May also return a dict of per-sample values ``(M, b)``; the harness averages each over the epoch's
        samples into ``history["train_<name>"]`` (the running training metric).

        A batch-level objective that is no mean of per-sample terms (a Sharpe ratio over the batch, a mean
        over pixels) is returned as a 0-dim tensor and minimised as it is (divided by the world size under
        DDP, whose gradients are summed over ranks); its extra values are 0-dim too and are averaged over the
        epoch's batches.
        """

    @abstractmethod
    def metrics(self, output: Tensor, batch: Mapping[str, Any],
                generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Metrics of every member on one evaluation batch, each ``(M,)``: *means over the batch's samples*
        (the harness combines batches weighted by their sizes; NaN where a metric does not apply).

        ``generator`` is the evaluation's own random stream (for stochastic metrics such as importance-
        sampled likelihoods); drawing from it never disturbs training's random numbers.
        """


class Objective(Task):
    """The task of one model (no member dimension) given by one function.

    ``loss(model, batch)`` returns per-item losses ``(b,)`` (their mean is minimised; the epoch's mean is
    ``history["train_loss"]``) or a 0-dim batch-level objective, optionally as ``(loss, extra)`` with extra
    values of the same shape (``history["train_<name>"]``). ``metrics(model, batch, generator)``, when given,
    returns the validation metrics ``{name: 0-dim}`` of one evaluation batch.
    """

    def __init__(self, loss: Callable[[nn.Module, Any], Any],
                 metrics: Callable[[nn.Module, Any, torch.Generator | None], dict[str, Tensor]] | None = None) -> None:
        self._loss, self._metrics = loss, metrics

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return model, batch

    def loss(self, output: Any, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        value = self._loss(*output)
        value, extra = value if isinstance(value, tuple) else (value, {})
        if value.dim() == 0:
            return value, dict(extra)
        return value.unsqueeze(0), {"loss": value.unsqueeze(0), **{k: v.unsqueeze(0) for k, v in extra.items()}}

    def metrics(self, output: Any, batch: Any, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        if self._metrics is None:
            raise ValueError("this Objective has no metrics; pass metrics=... to validate, or val_data=None.")
        return {k: torch.as_tensor(v).reshape(1) for k, v in self._metrics(*output, generator).items()}


@dataclass
class TrainConfig:
    """Optimisation settings of :func:`~hardeq_studies.harness.train` (a study's config fills these).

    Attributes:
        epochs: passes over the training data (at least 1).
        batch_size: global minibatch size per member for in-memory data (split over ranks under DDP); the
            last minibatch of an epoch is smaller when the size is not a multiple (``drop_last=False``).
        lr, betas, eps: Adam's, used when no ``optimizer`` factory is given to ``train``.
        select_metric: validation metric (key of :meth:`Task.metrics`) whose minimum picks each member's
            best epoch; ties keep the earlier epoch.
        checkpoint_every: epochs between checkpoints (and always after the last epoch).
        eval_train: also evaluate on the whole training set after every epoch (``history["train_eval_*"]``).
        patience: per-member early stopping: a member whose ``select_metric`` has not improved for this many
            epochs stops training (its parameters are frozen); training ends when every member stopped.
            ``None``: never stop early.
        ema_decay: keep an exponential moving average of the weights, updated after every optimiser step
            (``ema = decay * ema + (1 - decay) * w``); evaluation, model selection and the returned states
            then use the averaged weights. ``None``: off.
        eval_batch_size: evaluate in batches of this many samples (in-memory splits); ``None``: one batch.
        eval_seed: seed of the evaluation random stream (the generator passed to :meth:`Task.metrics` is
            reseeded from ``(eval_seed, epoch)`` before each evaluation, so resumed runs draw the same numbers).
        ema_warmup: use ``decay_s = min(ema_decay, (1 + s) / (10 + s))`` at optimiser step ``s`` (0-based), the
            usual warm-up of diffusion models, instead of a constant decay.
        clip_grad_norm: clip the global gradient norm of all parameters to this value before every step.
        schedule_per_step: step the scheduler after every optimiser step (a warm-up) instead of every epoch.
        zero_grad_to_none: free the gradients between steps (``zero_grad(set_to_none=True)``): a parameter
            that gets no gradient in a step is then left alone by the optimiser, as in a plain torch loop.
        raise_nonfinite: raise ``FloatingPointError`` (naming the run's ``desc``, the epoch and the step) when
            a minibatch loss is not finite (one device sync per step).
    """

    epochs: int
    batch_size: int
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    select_metric: str = "mse"
    checkpoint_every: int = 10
    eval_train: bool = False
    patience: int | None = None
    ema_decay: float | None = None
    eval_batch_size: int | None = None
    eval_seed: int = 0
    ema_warmup: bool = False
    clip_grad_norm: float | None = None
    schedule_per_step: bool = False
    zero_grad_to_none: bool = False
    raise_nonfinite: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {self.epochs!r}.")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}.")
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"patience must be a positive integer or None, got {self.patience!r}.")
        if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1) or None, got {self.ema_decay!r}.")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be a positive integer or None, got {self.eval_batch_size!r}.")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive or None, got {self.clip_grad_norm!r}.")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    def result_fields(self) -> dict[str, Any]:
        """The settings that determine the result (a run may be resumed with another checkpoint interval).

        The optional features are left out while they are off, so that runs recorded before they existed
        keep their fingerprints.
        """
        d = {k: v for k, v in self.to_dict().items() if k != "checkpoint_every"}
        for key, off in (("patience", None), ("ema_decay", None), ("eval_batch_size", None), ("eval_seed", 0),
                         ("ema_warmup", False), ("clip_grad_norm", None), ("schedule_per_step", False),
                         ("zero_grad_to_none", False), ("raise_nonfinite", False)):
            if d[key] == off:
                del d[key]
        return d


@dataclass
class TrainResult:
    """What :func:`~hardeq_studies.harness.train` returns (all tensors on the CPU).

    Attributes:
        best_state: per-member parameters at each member's best validation epoch (a ``state_dict``).
        final_state: parameters after the last epoch (the EMA weights when ``ema_decay`` is set).
        best_epoch: ``(M,)`` 1-based epoch of each member's best validation ``select_metric``.
        best_value: ``(M,)`` that validation value.
        history: ``"train_<metric>"`` / ``"val_<metric>"`` -> ``(epochs, M)`` per-epoch metrics (NaN after a
            member stopped early, and for epochs not run).
        stopped_epoch: ``(M,)`` the epoch after which each member stopped early (0: it never did).
        epochs_run: epochs trained in this call (less than ``epochs`` after a resume or early stop).
    """

    best_state: dict[str, Tensor]
    final_state: dict[str, Tensor]
    best_epoch: Tensor
    best_value: Tensor
    history: dict[str, Tensor]
    stopped_epoch: Tensor | None = None
    epochs_run: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Hooks:
    """Callbacks of :func:`~hardeq_studies.harness.train`; override the ones you need.

    A hook that accumulates something across steps (a per-step loss curve, a wall-clock total) returns it
    from :meth:`state_dict`; it is saved in the run's checkpoints and handed back to :meth:`load_state_dict`
    on ``--resume``, so a resumed run's hook ends in the same state as an uninterrupted one.
    """

    def on_step(self, trainer: Any, loss: Tensor, extra: Mapping[str, Tensor]) -> None:
        """After optimiser step ``trainer.step - 1`` (0-based; after the per-step schedule's step and the EMA
        update), with its loss (detached) and extra values."""

    def on_epoch(self, trainer: Any, metrics: Mapping[str, Tensor]) -> None:
        """After epoch ``trainer.epoch`` (0-based) was trained, evaluated and selected on; before the checkpoint."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


class OnEpoch(Hooks):
    """A hook from a function ``fn(trainer, metrics)`` called after every epoch (it keeps no state in the
    checkpoint: for curves of a run that is not resumed mid-way)."""

    def __init__(self, fn: Callable[[Any, Mapping[str, Tensor]], None]) -> None:
        self.fn = fn

    def on_epoch(self, trainer: Any, metrics: Mapping[str, Tensor]) -> None:
        self.fn(trainer, metrics)


class Interrupted(RuntimeError):
    """Raised by a callback to stop training (used by tests to simulate an interrupted run)."""


#: ``optimizer(params) -> torch.optim.Optimizer``; ``scheduler(optimizer) -> LRScheduler`` (stepped per epoch)
OptimizerFactory = Callable[[list], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
