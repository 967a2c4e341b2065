"""``hardeq reproduce vae-data``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..runtime import RunSetup
from ..vae_study import VaeStudy
from .run import CONFIG_PATH, load_config

__all__ = ["VaeDataStudy", "STUDY"]


class VaeDataStudy(VaeStudy):
    """VAE, Ladder VAE, Graph VAE on MNIST with pixel sum 100: unconstrained, + CL, ours (docs/vae.md)."""

    subsets = ("models", "variants")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        protocol = self.config["protocol"]
        parser.add_argument("--models", nargs="+", default=None, choices=protocol["models"],
                            help="subset of the models (default: all)")
        parser.add_argument("--variants", nargs="+", default=None, choices=list(protocol["variants"]),
                            help="subset of the trained variants (default: all)")
        super().add_arguments(parser)

    def document(self, run: RunSetup, result: Any, wall: float) -> dict[str, Any]:
        """The shared document plus the constraint layer's dependent pixel (``data.cl_pixel``, its training
        variance and mean)."""
        doc = super().document(run, result, wall)
        doc["data"].update({k: result[k] for k in ("cl_pixel", "cl_pixel_variance", "cl_pixel_mean")})
        return doc

    def markdown(self, doc: dict[str, Any], out: Path) -> str:
        from .report import render_markdown

        return render_markdown(doc)

    def figures(self, doc: dict[str, Any], out: Path) -> list[Path]:
        from .figures import plot_curves, plot_images

        return [*plot_images(doc, out), plot_curves(doc, out)]


STUDY = VaeDataStudy("vae-data", load_config(CONFIG_PATH))
