"""What every study's ``run`` does around its computation: the device, threads, trials, epochs and checkpoint
file from the command line and the preset, and the removal of the checkpoint after a completed run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["RunSetup", "add_run_arguments", "setup_run", "discard_checkpoint"]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags :func:`setup_run` and :func:`discard_checkpoint` read: ``--threads``, ``--checkpoint-dir``,
    ``--keep-checkpoints``."""
    from .contract import positive_int

    parser.add_argument("--threads", type=positive_int, default=None,
                        help="intra-op threads (default: the preset's; 1 is fastest on a shared CPU)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="default: OUT/checkpoints (removed after a completed run unless --keep-checkpoints)")
    parser.add_argument("--keep-checkpoints", action="store_true")


@dataclass(frozen=True)
class RunSetup:
    """The resolved run: ``device``, ``trials`` (seed indices), ``epochs``, ``checkpoint`` (file), ``out``."""

    device: torch.device
    trials: list[int]
    epochs: int
    checkpoint: Path
    out: Path


def setup_run(args: argparse.Namespace, settings: dict[str, Any], name: str) -> RunSetup:
    """Resolve ``--device`` (CUDA asked for but absent: ``ValueError``), ``--threads`` (sets torch's intra-op
    threads), ``--seeds`` and ``--epochs`` against the preset's ``settings``; the checkpoint is
    ``--checkpoint-dir`` (default ``OUT/checkpoints``) ``/ NAME-PRESET.pt``."""
    device = torch.device(getattr(args, "device", None) or settings.get("device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for (the paper preset's default) but CUDA is not available; "
                         "pass --device cpu to run it on the CPU.")
    torch.set_num_threads(int(getattr(args, "threads", None) or settings.get("threads", 1)))
    seeds = args.seeds if getattr(args, "seeds", None) is not None else int(settings["seeds"])
    epochs = args.epochs if getattr(args, "epochs", None) is not None else int(settings["epochs"])
    out = Path(args.out)
    ckpt_dir = Path(getattr(args, "checkpoint_dir", None) or out / "checkpoints")
    return RunSetup(device, list(range(seeds)), epochs, ckpt_dir / f"{name}-{args.preset}.pt", out)


def discard_checkpoint(args: argparse.Namespace, checkpoint: Path) -> None:
    """After a completed run: remove the checkpoint (and its folder when empty) unless ``--keep-checkpoints``."""
    if getattr(args, "keep_checkpoints", False):
        return
    checkpoint.unlink(missing_ok=True)
    try:
        checkpoint.parent.rmdir()
    except OSError:
        pass

