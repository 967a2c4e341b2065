"""``hardeq reproduce synthetic``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from ..runtime import RunSetup

__all__ = ["SyntheticStudy", "STUDY"]


class SyntheticStudy(Study):
    """Bias, variance and average error of gradient estimators on synthetic problems (docs/synthetic.md)."""

    distributed = True
    default_threads = None  # torch's own

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--estimates", type=positive_int, default=None,
                            help="estimates per parameter set (default: the preset's, 1000 quick / 10000 cpu)")
        parser.epilog = ("--seeds sets the number of random parameter sets (default 4 quick / 20 cpu); "
                         "--epochs does not apply to this study (it trains nothing).")

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        from .data import load_config

        if getattr(args, "epochs", None) is not None:
            raise ValueError("--epochs does not apply to the synthetic study (it trains nothing); "
                             "use --seeds (parameter sets) or --estimates.")
        return load_config(args.preset, n_sets=getattr(args, "seeds", None),
                           n_estimates=getattr(args, "estimates", None))

    def execute(self, run: RunSetup) -> dict[str, Any]:
        from .run import run as run_blocks

        config = run.settings
        timing: dict[str, Any] = {"blocks_s": {}}
        bar = tqdm = None
        if not (run.quiet or not run.ctx.is_main):
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
        if tqdm is not None:
            n_calls = sum(len(config[f]["estimators"]) * len(config[f]["cases"]) * len(config[f]["losses"])
                          for f in ("gaussian", "poisson"))
            n_chunks = math.ceil(config["n_sets"] / max(1, int(config.get("sets_per_chunk", config["n_sets"]))))
            bar = tqdm(total=n_calls * n_chunks, desc="synthetic", unit="call", disable=None)
        t_block = [time.perf_counter()]

        def on_block(key: str, _records: list[dict]) -> None:
            now = time.perf_counter()
            timing["blocks_s"][key] = now - t_block[0]
            t_block[0] = now

        records = run_blocks(config, checkpoint_path=run.checkpoint_dir / "synthetic.pt", resume=run.resume,
                             on_block=on_block, progress=None if bar is None else (lambda _name: bar.update(1)),
                             ctx=run.ctx)
        if bar is not None:
            bar.close()
        if run.ctx.enabled:
            timing["world_size"] = run.ctx.world_size
        return {"records": records, "timing": timing}

    def document(self, run: RunSetup, result: dict[str, Any], wall: float) -> dict[str, Any]:
        import hardeq

        config, timing = run.settings, result["timing"]
        timing["total_s"] = float(sum(timing["blocks_s"].values()))
        figures = [f"synthetic_{f}_{loss}.png" for f in ("gaussian", "poisson") for loss in config[f]["losses"]]
        return {"config": config, "records": result["records"], "timing": timing, "figures": figures,
                "command": run.command, "hardeq_version": hardeq.__version__}

    def markdown(self, doc: dict[str, Any], out: Path) -> str:
        from .report import render_markdown

        return render_markdown(doc, command=doc.get("command"))

    def figures(self, doc: dict[str, Any], out: Path) -> list[Path]:
        from .report import plot

        return plot(doc, out)


STUDY = SyntheticStudy("synthetic", json.loads((Path(__file__).resolve().parent / "config.json").read_text()))
