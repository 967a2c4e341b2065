"""``hardeq reproduce vae-data``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from ..runtime import add_run_arguments
from .run import CONFIG_PATH, load_config

__all__ = ["VaeDataStudy", "STUDY"]


class VaeDataStudy(Study):
    """VAE, Ladder VAE, Graph VAE on MNIST with pixel sum 100: unconstrained, + CL, ours (docs/vae.md)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        protocol = self.config["protocol"]
        parser.add_argument("--models", nargs="+", default=None, choices=protocol["models"],
                            help="subset of the models (default: all)")
        parser.add_argument("--variants", nargs="+", default=None, choices=list(protocol["variants"]),
                            help="subset of the trained variants (default: all)")
        parser.add_argument("--importance-samples", type=positive_int, default=None,
                            help="K of the importance-sampled NLL (default: the preset's)")
        add_run_arguments(parser)

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        from ..results import write_json
        from ..runtime import discard_checkpoint, setup_run
        from .report import summarise
        from .run import run, settings

        s = settings(self.config, args.preset)
        if getattr(args, "importance_samples", None):
            s["importance_samples"] = int(args.importance_samples)
        r = setup_run(args, s, "vae-data")
        trials, epochs, device, ckpt, out = r.trials, r.epochs, r.device, r.checkpoint, r.out
        t0 = time.perf_counter()
        result = run(s, trials, epochs, models=getattr(args, "models", None),
                     variants=getattr(args, "variants", None), checkpoint_path=ckpt,
                     resume=bool(args.resume), device=device, progress=not bool(getattr(args, "quiet", False)))
        wall = time.perf_counter() - t0
        summary = summarise(result, self.config)
        used = {**s, "preset": args.preset, "trials": trials, "epochs": epochs, "models_run": result["models"],
                "variants_run": result["variants"], "paper": self.config["paper"], "source": self.config["source"]}
        doc = write_json(out / "vae-data.json", "vae-data", args.preset, used, summary["records"], device=device,
                         data={"n_train": result["n_train"], "n_test": result["n_test"]},
                         per_trial=summary["per_trial"], curves=summary["curves"], images=summary["images"],
                         significance=summary["significance"], timing={"total_s": wall, **summary["timing"]},
                         command=(getattr(args, "command_line", None)
                                  or f"hardeq reproduce vae-data --preset {args.preset}"))
        discard_checkpoint(args, ckpt)
        return doc

    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        from ..results import atomic_write_text
        from .report import plot_curves, plot_images, render_markdown

        out = Path(out)
        text = render_markdown(doc)
        atomic_write_text(out / "vae-data.md", text)
        paths = [out / "vae-data.md", *plot_images(doc, out), plot_curves(doc, out)]
        if not quiet:
            print(text)
        return paths


STUDY = VaeDataStudy("vae-data", load_config(CONFIG_PATH))
