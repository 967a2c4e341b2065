r"""The denoiser (a ``diffusers.UNet2DModel``) and its DDPM training, and the small feature classifier.

**Training** (:func:`train_denoiser`): the :math:`\varepsilon`-prediction loss of DDPM,
:math:`\lVert\varepsilon - \varepsilon_\theta(\sqrt{\bar\alpha_t}x_0 + \sqrt{1-\bar\alpha_t}\,\varepsilon, t)\rVert^2`
with ``t`` uniform on ``0..T-1`` and linear :math:`\beta_t` (``1e-4 .. 0.02``, ``T = 1000`` unless a preset
says otherwise), Adam with a linear warm-up, gradient clipping and an exponential moving average (EMA) of the
weights; the EMA weights are what the study samples from. Every random draw of step ``s`` (batch, ``t``,
:math:`\varepsilon`, dropout) is seeded from ``(seed, s)``, so a run resumed from a checkpoint equals an
uninterrupted one. The checkpoint (atomic, ``weights_only`` loadable) is written every ``checkpoint_every``
steps; once training is complete it is kept as a cache of the trained denoiser.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..extras import require
from ..harness import (BatchSource, Hooks, Objective, ShuffledBatches, TrainConfig, load_checkpoint, run_fingerprint,
                       train)

__all__ = ["build_unet", "count_parameters", "DenoiserSteps", "train_denoiser", "SmallCNN", "train_classifier",
           "classifier_outputs"]


def build_unet(cfg: dict[str, Any], channels: int, *, sample_size: int = 32) -> nn.Module:
    """A ``diffusers.UNet2DModel`` from the ``unet`` settings: ``block_out_channels`` (one per resolution, the
    first at full resolution), ``layers_per_block``, ``attention`` (indices of the resolutions with self-attention,
    0 = full resolution; the middle block always has attention), ``dropout``, ``norm_num_groups`` and
    ``attention_head_dim``."""
    diffusers = require("diffusers", "diffusion", purpose="the diffusion study's U-Net")
    ch = tuple(int(c) for c in cfg["block_out_channels"])
    attn = {int(i) for i in cfg.get("attention", [])}
    down = tuple("AttnDownBlock2D" if i in attn else "DownBlock2D" for i in range(len(ch)))
    up = tuple("AttnUpBlock2D" if (len(ch) - 1 - j) in attn else "UpBlock2D" for j in range(len(ch)))
    return diffusers.UNet2DModel(
        sample_size=sample_size, in_channels=channels, out_channels=channels, block_out_channels=ch,
        layers_per_block=int(cfg["layers_per_block"]), down_block_types=down, up_block_types=up,
        dropout=float(cfg.get("dropout", 0.0)), norm_num_groups=int(cfg.get("norm_num_groups", 8)),
        attention_head_dim=cfg.get("attention_head_dim", 8))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63 - 1))


class DenoiserSteps(BatchSource):
    r"""The denoiser's training steps as a harness source; harness epoch ``e`` is steps ``e * every`` to
    ``(e + 1) * every - 1`` (one checkpoint interval).

    Step ``s`` takes batch ``s mod (N // B)`` of data epoch ``s // (N // B)`` (a permutation seeded from
    ``(seed + 7919, data epoch)``) and draws ``t``, :math:`\varepsilon` and the dropout seed from ``(seed, s)``:
    every step is a function of its index, so the source has no state to checkpoint."""

    def __init__(self, images: Tensor, num_timesteps: int, batch_size: int, *, seed: int, steps: int, every: int,
                 device: torch.device) -> None:
        self.images, self.T, self.B, self.seed, self.steps = images, int(num_timesteps), int(batch_size), seed, steps
        self.every, self.device = max(1, int(every)), device
        self.num_samples = N = int(images.shape[0])
        if N < self.B:
            raise ValueError(f"batch_size {self.B} exceeds the {N} training images.")
        self.per_epoch = N // self.B
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    @property
    def epochs(self) -> int:
        """Harness epochs: checkpoint intervals, the last one possibly shorter."""
        return -(-self.steps // self.every)

    def epoch(self, epoch: int) -> Iterator[tuple[dict[str, Tensor], int]]:
        B = self.B
        for s in range(epoch * self.every, min((epoch + 1) * self.every, self.steps)):
            data_epoch = s // self.per_epoch
            if data_epoch != self._perm_epoch:
                self._perm = torch.randperm(self.num_samples, generator=_step_generator(self.seed + 7919, data_epoch))
                self._perm_epoch = data_epoch
            gen = _step_generator(self.seed, s)
            idx = self._perm[(s % self.per_epoch) * B:(s % self.per_epoch + 1) * B]
            x0 = self.images[idx].to(self.device)
            t = torch.randint(0, self.T, (B,), generator=gen).to(self.device)
            eps = torch.randn(x0.shape, generator=gen).to(self.device)
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))  # dropout
            yield {"x0": x0, "t": t, "eps": eps}, B


class _StepLog(Hooks):
    """Per-step losses and training seconds (checkpointed with the run); a log line every ``log_every`` steps."""

    def __init__(self, steps: int, log_every: int, log: Callable[[str], None]) -> None:
        self.losses, self.seconds = torch.zeros(steps, dtype=torch.float32), 0.0
        self.log_every, self.log, self.t_last = log_every, log, time.perf_counter()

    def on_step(self, trainer: Any, loss: Tensor, extra: Any) -> None:
        s = trainer.step - 1
        self.losses[s] = float(loss)
        now = time.perf_counter()
        self.seconds += now - self.t_last
        self.t_last = now
        if self.log_every and (s + 1) % self.log_every == 0:
            lo = max(0, s + 1 - self.log_every)
            self.log(f"[diffusion] step {s + 1}/{self.losses.shape[0]}: loss "
                     f"{float(self.losses[lo:s + 1].mean()):.4f}, {self.seconds / (s + 1):.3f} s/step, "
                     f"{self.seconds:.0f} s")

    def state_dict(self) -> dict[str, Any]:
        return {"losses": self.losses.clone(), "seconds": self.seconds}

    def load_state_dict(self, state: Any) -> None:
        self.losses, self.seconds, self.t_last = state["losses"].clone(), float(state["seconds"]), time.perf_counter()


def train_denoiser(model: nn.Module, images: Tensor, abar: Tensor, cfg: dict[str, Any], *, steps: int, seed: int,
                   checkpoint_path: Path | None, resume: bool, run_id: Any, device: torch.device,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train ``model`` (in place) for ``steps`` steps on ``images`` (``(N, C, H, W)`` in ``[-1, 1]``) with the
    harness; return ``{"ema": state_dict, "losses": (steps,) float32, "seconds", "steps", "cached": bool}``.

    ``cfg``: ``batch_size``, ``lr``, ``warmup``, ``ema_decay``, ``grad_clip``, ``weight_decay``,
    ``checkpoint_every``, ``log_every``. A complete checkpoint of the same run is returned as is (``cached``);
    an incomplete one is continued with ``resume`` (a checkpoint of another run then raises ``ValueError``)
    and ignored otherwise."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    model.to(device)
    source = DenoiserSteps(images, abar.shape[0], int(cfg["batch_size"]), seed=seed, steps=steps,
                           every=int(cfg.get("checkpoint_every", 500)), device=device)
    warmup, lr, clip = int(cfg.get("warmup", 0)), float(cfg["lr"]), float(cfg.get("grad_clip", 0.0))
    config = TrainConfig(source.epochs, source.B, checkpoint_every=1, ema_decay=float(cfg["ema_decay"]),
                         ema_warmup=True, clip_grad_norm=clip if clip > 0 else None, schedule_per_step=True,
                         zero_grad_to_none=True)
    cached = False
    if checkpoint_path is not None and Path(checkpoint_path).exists():
        ck = load_checkpoint(checkpoint_path)
        cached = (ck.get("fingerprint") == run_fingerprint(run_id, config, [seed], source.num_samples)
                  and int(ck.get("epoch", -1)) == config.epochs)
        if resume and not cached:
            log(f"[diffusion] resuming the denoiser's training at step {int(ck.get('step', 0))}/{steps}")
    abar_dev = abar.to(device=device, dtype=torch.float32)

    def objective(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        a = abar_dev[batch["t"]].view(-1, 1, 1, 1)
        xt = a.sqrt() * batch["x0"] + (1 - a).sqrt() * batch["eps"]
        return (model(xt, batch["t"]).sample - batch["eps"]).square().mean()

    def warm_up(opt: torch.optim.Optimizer) -> Any:  # lr * min(1, (s + 1) / warmup) at step s
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warmup))

    step_log = _StepLog(steps, int(cfg.get("log_every", 0)), log)
    res = train(model, Objective(objective), source, None, config, [seed],
                optimizer=lambda p: torch.optim.Adam(p, lr=lr, weight_decay=float(cfg.get("weight_decay", 0.0))),
                scheduler=warm_up if warmup > 0 else None, hooks=step_log, checkpoint_path=checkpoint_path,
                resume=resume or cached, run_id=run_id, progress=False, desc="diffusion denoiser")
    return {"ema": res.final_state, "losses": step_log.losses, "seconds": step_log.seconds, "steps": steps,
            "cached": cached}


# ------------------------------------------------------------------------------------------ classifier
class SmallCNN(nn.Module):
    """A small CNN classifier of 32x32 images; :meth:`features` is its penultimate layer (the feature space of
    the classifier Fréchet distance)."""

    def __init__(self, channels: int, widths: tuple[int, ...] = (32, 64, 64), features: int = 128,
                 classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = channels
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2)]
            c = w
        self.body = nn.Sequential(*layers, nn.Flatten())
        side = 32 // 2 ** len(widths)
        self.fc = nn.Sequential(nn.Linear(c * side * side, features), nn.ReLU())
        self.head = nn.Linear(features, classes)

    def features(self, x: Tensor) -> Tensor:
        return self.fc(self.body(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def _classifier_input(images_u8: Tensor) -> Tensor:
    return images_u8.to(torch.float32) / 127.5 - 1


def train_classifier(images_u8: Tensor, labels: Tensor, cfg: dict[str, Any], *, seed: int,
                     device: torch.device) -> tuple[SmallCNN, float]:
    """Train :class:`SmallCNN` on 8-bit images ``(N, C, 32, 32)`` for ``cfg["epochs"]`` epochs (Adam); returns
    the model (eval mode) and the training seconds."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    net = SmallCNN(images_u8.shape[1], tuple(cfg.get("widths", (32, 64, 64))), int(cfg.get("features", 128))).to(device)
    gen = torch.Generator().manual_seed(seed)
    B, max_steps = int(cfg.get("batch_size", 128)), cfg.get("max_steps")
    source = ShuffledBatches({"x": images_u8, "y": labels}, B, gen, drop_last=True,
                             max_steps=None if max_steps is None else int(max_steps))

    def objective(net: SmallCNN, batch: dict[str, Tensor]) -> Tensor:
        logits = net(_classifier_input(batch["x"]).to(device))
        return nn.functional.cross_entropy(logits, batch["y"].to(device))

    train(net, Objective(objective), source, None, TrainConfig(int(cfg.get("epochs", 1)), B, zero_grad_to_none=True),
          [seed], optimizer=lambda p: torch.optim.Adam(p, lr=float(cfg.get("lr", 1e-3))), progress=False,
          desc="diffusion classifier")
    return net.eval(), time.perf_counter() - t0


@torch.no_grad()
def classifier_outputs(net: SmallCNN, images_u8: Tensor, *, batch_size: int = 500) -> tuple[Tensor, Tensor]:
    """Features ``(N, F)`` and class probabilities ``(N, 10)`` of 8-bit images, float32 on the CPU."""
    device = next(net.parameters()).device
    feats, probs = [], []
    for i in range(0, images_u8.shape[0], batch_size):
        f = net.features(_classifier_input(images_u8[i:i + batch_size]).to(device))
        feats.append(f.cpu())
        probs.append(torch.softmax(net.head(f), -1).cpu())
    if not feats:
        return torch.empty(0, net.head.in_features), torch.empty(0, net.head.out_features)
    return torch.cat(feats), torch.cat(probs)
