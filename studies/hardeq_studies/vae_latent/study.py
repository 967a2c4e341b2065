"""``hardeq reproduce vae-latent``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from ..runtime import add_run_arguments
from .run import CONFIG_PATH, load_config

__all__ = ["VaeLatentStudy", "STUDY"]


class VaeLatentStudy(Study):
    """VAE on MNIST with a constrained latent; every gradient estimator (docs/vae.md)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        protocol = self.config["protocol"]
        parser.add_argument("--methods", nargs="+", default=None, choices=protocol["methods"], metavar="NAME",
                            help=f"subset of {', '.join(protocol['methods'])} (default: all)")
        parser.add_argument("--constraints", nargs="+", default=None, choices=list(protocol["constraints"]),
                            help="latent constraints to run (default: the preset's)")
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
        r = setup_run(args, s, "vae-latent")
        trials, epochs, device, ckpt, out = r.trials, r.epochs, r.device, r.checkpoint, r.out
        t0 = time.perf_counter()
        result = run(s, trials, epochs, methods=getattr(args, "methods", None),
                     constraints=getattr(args, "constraints", None), checkpoint_path=ckpt,
                     resume=bool(args.resume), device=device, progress=not bool(getattr(args, "quiet", False)))
        wall = time.perf_counter() - t0
        summary = summarise(result, self.config)
        used = {**s, "preset": args.preset, "trials": trials, "epochs": epochs, "methods_run": result["methods"],
                "constraints_run": result["constraints"], "paper": self.config["paper"],
                "source": self.config["source"]}
        doc = write_json(out / "vae-latent.json", "vae-latent", args.preset, used, summary["records"], device=device,
                         data={"n_train": result["n_train"], "n_test": result["n_test"]},
                         per_trial=summary["per_trial"], curves=summary["curves"],
                         significance=summary["significance"], timing={"total_s": wall, **summary["timing"]},
                         command=(getattr(args, "command_line", None)
                                  or f"hardeq reproduce vae-latent --preset {args.preset}"))
        discard_checkpoint(args, ckpt)
        return doc

    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        from ..results import atomic_write_text
        from .report import plot_curves, plot_metrics, render_markdown

        out = Path(out)
        text = render_markdown(doc)
        atomic_write_text(out / "vae-latent.md", text)
        paths = [out / "vae-latent.md", plot_metrics(doc, out), plot_curves(doc, out)]
        if not quiet:
            print(text)
        return paths


STUDY = VaeLatentStudy("vae-latent", load_config(CONFIG_PATH))
