"""``hardeq reproduce chemical``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int
from .data import CONFIG_PATH, load_config

__all__ = ["ChemicalStudy", "STUDY"]


class ChemicalStudy(Study):
    """Neural surrogates of three chemical processes with exact mass balances (docs/chemical.md)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from .task import METHOD_NAMES

        parser.add_argument("--datasets", nargs="+", default=None, metavar="NAME",
                            choices=list(self.config["datasets"]),
                            help=f"subset of {', '.join(self.config['datasets'])} (default: all)")
        parser.add_argument("--methods", nargs="+", default=None, metavar="NAME", choices=list(METHOD_NAMES),
                            help=f"subset of {', '.join(METHOD_NAMES)} (default: all in the config)")
        parser.add_argument("--dtype", choices=["float32", "float64"], default=None, help="default: the config's")
        parser.add_argument("--checkpoint-dir", type=Path, default=None,
                            help="default: OUT/checkpoints (removed after a completed run unless --keep-checkpoints)")
        parser.add_argument("--checkpoint-every", type=positive_int, default=None, help="epochs between checkpoints")
        parser.add_argument("--keep-checkpoints", action="store_true")
        parser.add_argument("--config", type=Path, default=None, help="alternative config JSON")
        parser.add_argument("--jobs", type=positive_int, default=None,
                            help="parallel worker processes; the units are the data sets, the largest split into its "
                                 "baselines and its ours* variants (default: the preset's)")
        parser.add_argument("--threads", type=positive_int, default=1, help="intra-op threads per process (default 1)")

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        import torch

        from ..harness import init_distributed
        from ..results import atomic_write_text, write_json
        from .run import run

        config = load_config(getattr(args, "config", None))
        preset = config["presets"][args.preset]
        num_seeds = args.seeds if args.seeds is not None else preset["seeds"]
        epochs = args.epochs if args.epochs is not None else preset["epochs"]
        if getattr(args, "checkpoint_every", None):
            config["train"]["checkpoint_every"] = int(args.checkpoint_every)
        out = Path(args.out)
        ckpt_dir = getattr(args, "checkpoint_dir", None) or out / "checkpoints"
        quiet = bool(getattr(args, "quiet", False))
        ctx = init_distributed(getattr(args, "device", None) or preset.get("device"))
        threads = int(getattr(args, "threads", 1) or 1)
        jobs = getattr(args, "jobs", None) or preset.get("jobs", 1)
        if ctx.device.type != "cpu":
            jobs = 1
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        result = run(config, list(range(num_seeds)), epochs=epochs, datasets=getattr(args, "datasets", None),
                     methods=getattr(args, "methods", None), dtype=getattr(args, "dtype", None),
                     checkpoint_dir=ckpt_dir, resume=bool(args.resume), progress=not quiet, ctx=ctx, jobs=jobs,
                     threads=threads)
        wall = time.perf_counter() - t0
        datasets = list(result["curves"])
        methods = list(next(iter(result["curves"].values())))
        used = {**config, "preset": args.preset, "seeds": list(range(num_seeds)), "epochs": epochs,
                "datasets_run": datasets, "methods_run": methods,
                "dtype_run": getattr(args, "dtype", None) or config["dtype"], "world_size": ctx.world_size,
                "jobs": jobs, "threads": threads}
        doc: dict[str, Any] = {}
        if ctx.is_main:
            from .report import significance

            doc = write_json(out / "chemical.json", "chemical", args.preset, used, result["records"],
                             device=ctx.device, per_seed=result["per_seed"],
                             significance=significance(result["per_seed"], methods),
                             timing={"total_s": wall, **result["timing"]}, cpu_timing=result["cpu_timing"],
                             command=getattr(args, "command_line", None)
                             or f"hardeq reproduce chemical --preset {args.preset}")
            atomic_write_text(out / "chemical.curves.json", json.dumps(result["curves"]) + "\n")
            if not getattr(args, "keep_checkpoints", False):
                for p in Path(ckpt_dir).glob("chemical-*.pt"):
                    p.unlink()
                try:
                    Path(ckpt_dir).rmdir()
                except OSError:
                    pass
        if ctx.enabled:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
        return doc

    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        from ..results import atomic_write_text
        from .report import plot_curves, render_markdown, summarize

        out = Path(out)
        text = render_markdown(doc)
        atomic_write_text(out / "chemical.md", text)
        curves_path = out / "chemical.curves.json"
        paths = [out / "chemical.md"]
        if curves_path.exists():
            paths += plot_curves(json.loads(curves_path.read_text()), out,
                                 variance_floor=doc["config"]["ours"]["variance_floor"])
        if not quiet:
            cfg = doc["config"]
            print(summarize(doc["records"], cfg["methods_run"], cfg["datasets_run"]))
        return paths


STUDY = ChemicalStudy("chemical", load_config(CONFIG_PATH))
