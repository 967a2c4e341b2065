"""``hardeq reproduce portfolio``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from .data import CONFIG_PATH, load_config

__all__ = ["PortfolioStudy", "STUDY"]


class PortfolioStudy(Study):
    """StemGNN portfolio allocations with weights summing to one (docs/portfolio.md)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from .task import METHODS

        parser.add_argument("--methods", nargs="+", default=None, metavar="NAME", choices=list(METHODS),
                            help=f"subset of {', '.join(METHODS)} (default: all)")
        parser.add_argument("--num-assets", type=positive_int, default=None,
                            help="stocks drawn from the data set (default: the preset's)")
        parser.add_argument("--checkpoint-dir", type=Path, default=None,
                            help="default: OUT/checkpoints (removed after a completed run unless --keep-checkpoints)")
        parser.add_argument("--keep-checkpoints", action="store_true")
        parser.add_argument("--config", type=Path, default=None, help="alternative config JSON")
        parser.add_argument("--threads", type=positive_int, default=1,
                            help="intra-op threads (default 1: robust when the CPU is shared)")

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        from ..results import write_json
        from ..runtime import discard_checkpoint, setup_run
        from .report import significance, summarise
        from .run import run, settings

        config = load_config(getattr(args, "config", None))
        s = settings(config, args.preset)
        if getattr(args, "num_assets", None):
            s["data"]["num_assets"] = int(args.num_assets)
        r = setup_run(args, s, "portfolio")
        epochs, device, ckpt, out = r.epochs, r.device, r.checkpoint, r.out
        t0 = time.perf_counter()
        result = run(s, r.trials, epochs=epochs, methods=getattr(args, "methods", None),
                     checkpoint_path=ckpt, resume=bool(args.resume), device=device,
                     progress=not bool(getattr(args, "quiet", False)))
        wall = time.perf_counter() - t0
        summary = summarise(result, config["paper"])
        used = {**s, "preset": args.preset, "runs": result["runs"], "epochs": epochs,
                "methods_run": result["methods"], "paper": config["paper"], "source": config["source"]}
        data = result["data"]
        doc = write_json(out / "portfolio.json", "portfolio", args.preset, used, summary["records"], device=device,
                         data={**data.describe(), "tickers": data.table.tickers}, per_run=summary["per_run"],
                         significance=significance(summary["per_run"], result["methods"]),
                         curves=summary["curves"], weights=summary["weights"], training=summary["training"],
                         timing={"total_s": wall, **result["timing"]},
                         command=(getattr(args, "command_line", None)
                                  or f"hardeq reproduce portfolio --preset {args.preset}"))
        discard_checkpoint(args, ckpt)
        return doc

    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        from ..results import atomic_write_text
        from .report import plot_cumulative, plot_weights, render_markdown

        out = Path(out)
        text = render_markdown(doc)
        atomic_write_text(out / "portfolio.md", text)
        paths = [out / "portfolio.md", plot_cumulative(doc, out), plot_weights(doc, out)]
        if not quiet:
            print(text)
        return paths


STUDY = PortfolioStudy("portfolio", load_config(CONFIG_PATH))
