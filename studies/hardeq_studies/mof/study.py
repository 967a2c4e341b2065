"""``hardeq reproduce mof``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from ..runtime import RunSetup, add_run_arguments
from .data import CONFIG_PATH, load_config

__all__ = ["MofStudy", "STUDY"]


class MofStudy(Study):
    """Charge-neutral partial charges on MOF graphs with an MPNN (docs/mof.md)."""

    default_device = None  # CUDA when available
    default_threads = None  # torch's own unless the preset or --threads says

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--splits", type=positive_int, default=None,
                            help="number of random splits (default: the preset's; --seeds is a synonym)")
        parser.add_argument("--groups", nargs="+", default=None, choices=list(self.config["groups"]),
                            help="train only these method groups (default: all)")
        parser.add_argument("--graphs", type=self._graphs, default=None,
                            help=f"use only the first N graphs, at least {self.min_graphs()} (default: the preset's)")
        parser.add_argument("--steps", type=positive_int, default=None,
                            help="optimiser steps per model, equal for every method (default: the preset's; "
                                 "the paper preset counts epochs instead)")
        parser.add_argument("--eval-every", type=positive_int, default=None,
                            help="optimiser steps between validations with --steps (default: the preset's)")
        parser.add_argument("--jobs", type=positive_int, default=None,
                            help="parallel processes (default: the preset's)")
        add_run_arguments(parser)

    def min_graphs(self) -> int:
        """The fewest graphs whose split (config ``split.fractions``) leaves train, validation and test non-empty."""
        f_train, f_val = self.config["split"]["fractions"]
        return next(n for n in range(3, 10_000) if 0 < int(n * f_train) < int(n * (f_train + f_val)) < n
                    and all(0 < int(m * f_train) < int(m * (f_train + f_val)) < m for m in range(n, n + 50)))

    def _graphs(self, text: str) -> int:
        """argparse type of ``--graphs``: a count that leaves every part of the split non-empty."""
        n = positive_int(text)
        if n < self.min_graphs():
            raise argparse.ArgumentTypeError(f"must be at least {self.min_graphs()} (train/validation/test "
                                             f"fractions {self.config['split']['fractions']}), got {n}")
        return n

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        """The preset's settings with the command line's overrides."""
        s = dict(self.config["presets"][args.preset])
        for key in ("description", "duration"):
            s.pop(key, None)
        splits = getattr(args, "splits", None) or getattr(args, "seeds", None)
        if splits:
            s["splits"] = int(splits)
        if getattr(args, "epochs", None):  # a budget in data epochs (unless --steps is given too)
            s["epochs"], s["steps"] = int(args.epochs), None
        for key in ("graphs", "jobs", "threads", "groups", "steps", "eval_every"):
            if getattr(args, key, None):
                s[key] = getattr(args, key)
        if getattr(args, "device", None):
            s["device"] = str(args.device)
        return s

    def execute(self, run: RunSetup) -> dict[str, Any]:
        import torch

        from ..extras import require
        from .data import load_graphs, pyg
        from .evaluate import evaluate_all
        from .run import train_all

        pyg()  # clear errors naming hardeq-studies[graphs] before any work
        require("tqdm", "graphs", purpose="the training harness's progress reports")
        require("matplotlib", "graphs", purpose="the mof study's figures")
        s = run.settings
        t0 = time.perf_counter()
        units = train_all(self.config, s, checkpoint_dir=run.checkpoint_dir, resume=run.resume,
                          device=str(run.device), jobs=int(s.get("jobs") or 1), threads=torch.get_num_threads(),
                          progress=not run.quiet)
        train_s = time.perf_counter() - t0
        return {"ev": evaluate_all(self.config, s, units), "train_s": train_s,
                "facts": load_graphs(None, s.get("graphs")).facts}

    def document(self, run: RunSetup, result: dict[str, Any], wall: float) -> dict[str, Any]:
        from .evaluate import significance, threshold_counts

        ev = dict(result["ev"])
        per_split = ev.pop("per_split")
        sig = significance(per_split, [tuple(p) for p in self.config["significance"]])
        thresholds = [threshold_counts(per_split, c["a"], c["metric"], float(c["expect"].split(">")[1]))
                      for c in self.config["claims"] if "b" not in c]
        used = {**self.config, "preset": run.preset, "settings": run.settings, "device_run": str(run.device)}
        return {"config": used, "records": ev.pop("records"), "device": str(run.device), "per_split": per_split,
                "significance": sig, "thresholds": thresholds, "data": result["facts"],
                "timing": {"total_s": wall, "train_s": result["train_s"], **ev.pop("unit_seconds")},
                "command": run.command,
                **{k: v for k, v in ev.items() if k not in ("curves", "model_curves", "parity")}}

    def write_extra(self, run: RunSetup, result: dict[str, Any]) -> None:
        from ..results import atomic_write_text

        ev = result["ev"]
        atomic_write_text(run.out / "mof.curves.json",
                          json.dumps({"curves": ev["curves"], "parity": ev["parity"],
                                      **({"models": ev["model_curves"]} if "model_curves" in ev else {})}) + "\n")

    def markdown(self, doc: dict[str, Any], out: Path) -> str:
        from .report import render_markdown

        return render_markdown(doc)

    def figures(self, doc: dict[str, Any], out: Path) -> list[Path]:
        from .figures import plot_curves, plot_parity, plot_stopping

        extra_path = out / "mof.curves.json"
        if not extra_path.exists():
            return []
        extra = json.loads(extra_path.read_text())
        stopping = plot_stopping(extra["models"], out) if extra.get("models") else None
        return [plot_curves(extra["curves"], out), plot_parity(extra["parity"], out)] + ([stopping] if stopping else [])

    def console(self, doc: dict[str, Any], out: Path, text: str) -> str:
        from .report import render_markdown

        return render_markdown(doc, brief=True)


STUDY = MofStudy("mof", load_config(CONFIG_PATH))
