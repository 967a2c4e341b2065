"""``hardeq reproduce chemical``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from ..runtime import RunSetup, add_run_arguments
from .data import CONFIG_PATH, load_config

__all__ = ["ChemicalStudy", "STUDY"]


class ChemicalStudy(Study):
    """Neural surrogates of three chemical processes with exact mass balances (docs/chemical.md)."""

    distributed = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from .task import METHOD_NAMES

        parser.add_argument("--datasets", nargs="+", default=None, metavar="NAME",
                            choices=list(self.config["datasets"]),
                            help=f"subset of {', '.join(self.config['datasets'])} (default: all)")
        parser.add_argument("--methods", nargs="+", default=None, metavar="NAME", choices=list(METHOD_NAMES),
                            help=f"subset of {', '.join(METHOD_NAMES)} (default: all in the config)")
        parser.add_argument("--dtype", choices=["float32", "float64"], default=None, help="default: the config's")
        parser.add_argument("--checkpoint-every", type=positive_int, default=None, help="epochs between checkpoints")
        parser.add_argument("--config", type=Path, default=None, help="alternative config JSON")
        parser.add_argument("--jobs", type=positive_int, default=None,
                            help="parallel worker processes; the units are the data sets, the largest split into its "
                                 "baselines and its ours* variants (default: the preset's)")
        add_run_arguments(parser)

    def _config(self, args: argparse.Namespace) -> dict[str, Any]:
        config = load_config(getattr(args, "config", None))
        preset = config.get("presets", {}).get(getattr(args, "preset", None), {})
        if "nonnegative_flows" in preset and "nonnegative_flows" in config:  # the preset's draws / burn-in
            config["nonnegative_flows"] = {**config["nonnegative_flows"], **preset["nonnegative_flows"]}
        if getattr(args, "checkpoint_every", None):
            config["train"]["checkpoint_every"] = int(args.checkpoint_every)
        return config

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        return dict(self._config(args)["presets"][args.preset])

    def execute(self, run: RunSetup) -> dict[str, Any]:
        import torch

        from .run import run as run_all

        jobs = getattr(run.args, "jobs", None) or run.settings.get("jobs", 1)
        if run.device.type != "cpu":
            jobs = 1
        result = run_all(self._config(run.args), run.trials, epochs=run.epochs,
                         datasets=getattr(run.args, "datasets", None), methods=getattr(run.args, "methods", None),
                         dtype=getattr(run.args, "dtype", None), checkpoint_dir=run.checkpoint_dir, resume=run.resume,
                         progress=not run.quiet, ctx=run.ctx, jobs=jobs, threads=torch.get_num_threads())
        return {**result, "jobs": jobs, "threads": torch.get_num_threads()}

    def document(self, run: RunSetup, result: dict[str, Any], wall: float) -> dict[str, Any]:
        from .report import significance

        config = self._config(run.args)
        datasets = list(result["curves"])
        methods = list(next(iter(result["curves"].values())))
        used = {**config, "preset": run.preset, "seeds": run.trials, "epochs": run.epochs,
                "datasets_run": datasets, "methods_run": methods,
                "dtype_run": getattr(run.args, "dtype", None) or config["dtype"], "world_size": run.ctx.world_size,
                "jobs": result["jobs"], "threads": result["threads"]}
        doc = {"config": used, "records": result["records"], "device": run.device, "per_seed": result["per_seed"],
               "significance": significance(result["per_seed"], methods),
               "timing": {"total_s": wall, **result["timing"]}, "cpu_timing": result["cpu_timing"]}
        if result.get("nonnegative_flows"):  # the non-negative-flows variant (chemical/bounds.py)
            from .bounds import summarise

            per_seed = result["nonnegative_flows"]
            parts = {d: summarise(p, d) for d, p in per_seed.items()}
            doc["nonnegative_flows"] = {"config": config["nonnegative_flows"], "per_seed": per_seed,
                                        "significance": {d: p["significance"] for d, p in parts.items()}}
            doc["records"] = doc["records"] + [r for p in parts.values() for r in p["records"]]
        return doc

    def write_extra(self, run: RunSetup, result: dict[str, Any]) -> None:
        from ..results import atomic_write_text

        atomic_write_text(run.out / "chemical.curves.json", json.dumps(result["curves"]) + "\n")

    def markdown(self, doc: dict[str, Any], out: Path) -> str:
        from .report import render_markdown

        return render_markdown(doc)

    def figures(self, doc: dict[str, Any], out: Path) -> list[Path]:
        from .report import plot_curves

        curves_path = out / "chemical.curves.json"
        if not curves_path.exists():
            return []
        return plot_curves(json.loads(curves_path.read_text()), out,
                           variance_floor=doc["config"]["ours"]["variance_floor"])

    def console(self, doc: dict[str, Any], out: Path, text: str) -> str:
        from .report import summarize

        cfg = doc["config"]
        return summarize(doc["records"], cfg["methods_run"], cfg["datasets_run"])


STUDY = ChemicalStudy("chemical", load_config(CONFIG_PATH))
