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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..extras import require
from ..harness import atomic_torch_save, fingerprint, load_checkpoint

__all__ = ["build_unet", "count_parameters", "EMA", "train_denoiser", "SmallCNN", "train_classifier",
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


class EMA:
    """Exponential moving average of a model's floating-point state, with the usual warm-up
    ``decay_s = min(decay, (1 + s) / (10 + s))``."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = float(decay)
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                self.shadow[k].mul_(d).add_(v.detach(), alpha=1 - d)
            else:
                self.shadow[k].copy_(v)


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63 - 1))


def train_denoiser(model: nn.Module, images: Tensor, abar: Tensor, cfg: dict[str, Any], *, steps: int, seed: int,
                   checkpoint_path: Path | None, resume: bool, run_id: Any, device: torch.device,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train ``model`` (in place) for ``steps`` steps on ``images`` (``(N, C, H, W)`` in ``[-1, 1]``); return
    ``{"ema": state_dict, "losses": (steps,) float32, "seconds", "steps", "cached": bool}``.

    ``cfg``: ``batch_size``, ``lr``, ``warmup``, ``ema_decay``, ``grad_clip``, ``weight_decay``,
    ``checkpoint_every``, ``log_every``. A complete checkpoint of the same run (``run_id``'s fingerprint) is
    returned as is (``cached``); an incomplete one is continued with ``resume`` (a checkpoint of another run
    then raises ``ValueError``) and ignored otherwise."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    run_hash = fingerprint(run_id)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=float(cfg["lr"]), weight_decay=float(cfg.get("weight_decay", 0.0)))
    ema = EMA(model, float(cfg["ema_decay"]))
    losses = torch.zeros(steps, dtype=torch.float32)
    start, seconds = 0, 0.0
    if checkpoint_path is not None and Path(checkpoint_path).exists():
        ck = load_checkpoint(checkpoint_path)
        same = ck.get("fingerprint") == run_hash
        if same and ck.get("complete"):
            model.load_state_dict(ck["model"])
            return {"ema": ck["ema"], "losses": ck["losses"], "seconds": float(ck["seconds"]), "steps": steps,
                    "cached": True}
        if resume:
            if not same:
                raise ValueError(f"checkpoint {checkpoint_path} belongs to a different run (fingerprint "
                                 f"{ck.get('fingerprint')} != {run_hash}); remove it or run without --resume.")
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            ema.shadow = {k: v.to(device) for k, v in ck["ema"].items()}
            start, seconds = int(ck["step"]), float(ck["seconds"])
            losses[:start] = ck["losses"][:start]
            log(f"[diffusion] resuming the denoiser's training at step {start}/{steps}")

    def save(step: int, complete: bool) -> None:
        if checkpoint_path is None:
            return
        atomic_torch_save({"fingerprint": run_hash, "step": step, "complete": complete,
                           "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                           "ema": {k: v.detach().cpu() for k, v in ema.shadow.items()},
                           "opt": opt.state_dict() if not complete else {}, "losses": losses.clone(),
                           "seconds": seconds}, Path(checkpoint_path))

    N, B = images.shape[0], int(cfg["batch_size"])
    if N < B:
        raise ValueError(f"batch_size {B} exceeds the {N} training images.")
    per_epoch = N // B
    abar_dev = abar.to(device=device, dtype=torch.float32)
    T = abar.shape[0]
    warmup, lr, clip = int(cfg.get("warmup", 0)), float(cfg["lr"]), float(cfg.get("grad_clip", 0.0))
    every, log_every = int(cfg.get("checkpoint_every", 500)), int(cfg.get("log_every", 0))
    perm_epoch, perm = -1, None
    model.train()
    t_last = time.perf_counter()
    for s in range(start, steps):
        epoch = s // per_epoch
        if epoch != perm_epoch:
            perm = torch.randperm(N, generator=_step_generator(seed + 7919, epoch))
            perm_epoch = epoch
        gen = _step_generator(seed, s)
        idx = perm[(s % per_epoch) * B:(s % per_epoch + 1) * B]
        x0 = images[idx].to(device)
        t = torch.randint(0, T, (B,), generator=gen).to(device)
        eps = torch.randn(x0.shape, generator=gen).to(device)
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))  # dropout
        a = abar_dev[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (s + 1) / warmup) if warmup > 0 else lr
        loss = (model(xt, t).sample - eps).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        ema.update(model, s)
        losses[s] = float(loss.detach())
        now = time.perf_counter()
        seconds += now - t_last
        t_last = now
        if log_every and (s + 1) % log_every == 0:
            lo = max(0, s + 1 - log_every)
            log(f"[diffusion] step {s + 1}/{steps}: loss {float(losses[lo:s + 1].mean()):.4f}, "
                f"{seconds / (s + 1):.3f} s/step, "
                f"{seconds:.0f} s")
        if (s + 1) % every == 0 and s + 1 < steps:
            save(s + 1, False)
    save(steps, True)
    return {"ema": {k: v.detach().cpu() for k, v in ema.shadow.items()}, "losses": losses, "seconds": seconds,
            "steps": steps, "cached": False}


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
    opt = torch.optim.Adam(net.parameters(), lr=float(cfg.get("lr", 1e-3)))
    gen = torch.Generator().manual_seed(seed)
    B, N = int(cfg.get("batch_size", 128)), images_u8.shape[0]
    max_steps = cfg.get("max_steps")
    step = 0
    net.train()
    for _ in range(int(cfg.get("epochs", 1))):
        perm = torch.randperm(N, generator=gen)
        for i in range(0, N - B + 1 if N >= B else 1, B):
            idx = perm[i:i + B]
            logits = net(_classifier_input(images_u8[idx]).to(device))
            loss = nn.functional.cross_entropy(logits, labels[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if max_steps is not None and step >= int(max_steps):
                break
        if max_steps is not None and step >= int(max_steps):
            break
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
