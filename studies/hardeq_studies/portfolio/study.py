"""``hardeq reproduce portfolio``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from ..runtime import RunSetup, add_run_arguments
from .data import CONFIG_PATH, load_config

__all__ = ["PortfolioStudy", "STUDY"]


class PortfolioStudy(Study):
    """StemGNN portfolio allocations with weights summing to one (docs/portfolio.md)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from .task import METHODS

        parser.add_argument("--methods", nargs="+", default=None, metavar="NAME", choices=list(METHODS),
                            help=f"subset of {', '.join(METHODS)} (default: all)")
        parser.add_argument("--num-assets", type=positive_int, default=None,
                            help="run one universe of this many stocks instead of the preset's universes")
        parser.add_argument("--config", type=Path, default=None, help="alternative config JSON")
        add_run_arguments(parser)

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        from .run import settings

        s = settings(load_config(getattr(args, "config", None)), args.preset)
        if getattr(args, "num_assets", None):
            n = int(args.num_assets)
            s["universes"] = {f"{s['data']['dataset']}-{n}": {"num_assets": n}}
        return s

    def execute(self, run: RunSetup) -> dict[str, Any]:
        from .run import run as run_units

        return run_units(run.settings, run.trials, epochs=run.epochs, methods=getattr(run.args, "methods", None),
                         checkpoint_path=run.checkpoint, resume=run.resume, device=run.device,
                         progress=not run.quiet)

    def document(self, run: RunSetup, result: dict[str, Any], wall: float) -> dict[str, Any]:
        from .report import document

        config = load_config(getattr(run.args, "config", None))
        used = {**run.settings, "preset": run.preset, "runs": result["runs"], "epochs": run.epochs,
                "methods_run": result["methods"], "paper": config["paper"], "source": config["source"]}
        return {"config": used, "device": run.device, **document(result, config["paper"]),
                "timing": {"total_s": wall, **{u: r["timing"] for u, r in result["universes"].items()}}}

    def markdown(self, doc: dict[str, Any], out: Path) -> str:
        from .report import render_markdown

        return render_markdown(doc)

    def figures(self, doc: dict[str, Any], out: Path) -> list[Path]:
        from .report import plot_cumulative, plot_weights

        return [plot_cumulative(doc, out), plot_weights(doc, out)]


STUDY = PortfolioStudy("portfolio", load_config(CONFIG_PATH))
