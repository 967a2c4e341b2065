"""``hardeq reproduce vae-latent``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..vae_study import VaeStudy
from .run import CONFIG_PATH, load_config

__all__ = ["VaeLatentStudy", "STUDY"]


class VaeLatentStudy(VaeStudy):
    """VAE on MNIST with a constrained latent; every gradient estimator (docs/vae.md)."""

    subsets = ("methods", "constraints")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        protocol = self.config["protocol"]
        parser.add_argument("--methods", nargs="+", default=None, choices=protocol["methods"], metavar="NAME",
                            help=f"subset of {', '.join(protocol['methods'])} (default: all)")
        parser.add_argument("--constraints", nargs="+", default=None, choices=list(protocol["constraints"]),
                            help="latent constraints to run (default: the preset's)")
        super().add_arguments(parser)

    def markdown(self, doc: dict[str, Any], out: Path) -> str:
        from .report import render_markdown

        return render_markdown(doc)

    def figures(self, doc: dict[str, Any], out: Path) -> list[Path]:
        from .figures import plot_curves, plot_gap, plot_metrics

        return [plot_metrics(doc, out), plot_curves(doc, out), plot_gap(doc, out)]


STUDY = VaeLatentStudy("vae-latent", load_config(CONFIG_PATH))
