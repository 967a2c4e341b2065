"""``hardeq reproduce mof``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from .data import CONFIG_PATH, load_config

__all__ = ["MofStudy", "STUDY"]


class MofStudy(Study):
    """Charge-neutral partial charges on MOF graphs with an MPNN (docs/mof.md)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--splits", type=positive_int, default=None,
                            help="number of random splits (default: the preset's; --seeds is a synonym)")
        parser.add_argument("--groups", nargs="+", default=None, choices=list(self.config["groups"]),
                            help="train only these method groups (default: all)")
        parser.add_argument("--graphs", type=self._graphs, default=None,
                            help=f"use only the first N graphs, at least {self.min_graphs()} (default: the preset's)")
        parser.add_argument("--jobs", type=positive_int, default=None,
                            help="parallel processes (default: the preset's)")
        parser.add_argument("--threads", type=positive_int, default=None, help="intra-op threads per process")
        parser.add_argument("--checkpoint-dir", type=Path, default=None,
                            help="default: OUT/checkpoints (removed after a completed run unless --keep-checkpoints)")
        parser.add_argument("--keep-checkpoints", action="store_true")

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
        if getattr(args, "epochs", None):
            s["epochs"] = int(args.epochs)
        for key in ("graphs", "jobs", "threads", "groups"):
            if getattr(args, key, None):
                s[key] = getattr(args, key)
        if getattr(args, "device", None):
            s["device"] = str(args.device)
        return s

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        import torch

        from ..results import atomic_write_text, write_json
        from .data import load_graphs, pyg
        from .evaluate import evaluate_all, significance
        from .run import train_all

        from ..extras import require

        pyg()  # clear errors naming hardeq-studies[graphs] before any work
        require("tqdm", "graphs", purpose="the training harness's progress reports")
        require("matplotlib", "graphs", purpose="the mof study's figures")
        s = self.settings(args)
        out = Path(args.out)
        ckpt = getattr(args, "checkpoint_dir", None) or out / "checkpoints"
        device = s.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        threads = int(s.get("threads") or torch.get_num_threads())
        torch.set_num_threads(threads)
        quiet = bool(getattr(args, "quiet", False))
        t0 = time.perf_counter()
        units = train_all(self.config, s, checkpoint_dir=ckpt, resume=bool(args.resume), device=device,
                          jobs=int(s.get("jobs") or 1), threads=threads, progress=not quiet)
        train_s = time.perf_counter() - t0
        ev = evaluate_all(self.config, s, units)
        per_split = ev.pop("per_split")
        sig = significance(per_split, [tuple(p) for p in self.config["significance"]])
        facts = load_graphs(None, s.get("graphs")).facts
        wall = time.perf_counter() - t0
        used = {**self.config, "preset": args.preset, "settings": s, "device_run": device}
        doc = write_json(out / "mof.json", "mof", args.preset, used, ev.pop("records"), device=device,
                         per_split=per_split, significance=sig, data=facts,
                         timing={"total_s": wall, "train_s": train_s, **ev.pop("unit_seconds")},
                         command=getattr(args, "command_line", None) or f"hardeq reproduce mof --preset {args.preset}",
                         **{k: v for k, v in ev.items() if k not in ("curves", "parity")})
        atomic_write_text(out / "mof.curves.json", json.dumps({"curves": ev["curves"], "parity": ev["parity"]}) + "\n")
        if not getattr(args, "keep_checkpoints", False):
            for p in Path(ckpt).glob("mof-*.pt"):
                p.unlink()
            if Path(ckpt).is_dir() and not any(Path(ckpt).iterdir()):
                shutil.rmtree(ckpt, ignore_errors=True)
        return doc

    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        from ..results import atomic_write_text
        from .report import plot_curves, plot_parity, render_markdown

        out = Path(out)
        atomic_write_text(out / "mof.md", render_markdown(doc))
        paths = [out / "mof.md"]
        extra_path = out / "mof.curves.json"
        if extra_path.exists():
            extra = json.loads(extra_path.read_text())
            paths += [plot_curves(extra["curves"], out), plot_parity(extra["parity"], out)]
        if not quiet:
            print(render_markdown(doc, brief=True))
        return paths


STUDY = MofStudy("mof", load_config(CONFIG_PATH))
