"""``hardeq reproduce synthetic``: the study's contract (flags, run, report)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from ..contract import Study, positive_int

__all__ = ["SyntheticStudy", "STUDY"]


class SyntheticStudy(Study):
    """Bias, variance and average error of gradient estimators on synthetic problems (docs/synthetic.md)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--estimates", type=positive_int, default=None,
                            help="estimates per parameter set (default: the preset's, 1000 quick / 10000 cpu)")
        parser.epilog = ("--seeds sets the number of random parameter sets (default 4 quick / 20 cpu); "
                         "--epochs does not apply to this study (it trains nothing).")

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        import hardeq

        from ..harness import init_distributed
        from ..results import write_json
        from .data import load_config
        from .run import run

        if getattr(args, "epochs", None) is not None:
            raise ValueError("--epochs does not apply to the synthetic study (it trains nothing); "
                             "use --seeds (parameter sets) or --estimates.")
        out = Path(args.out)
        config = load_config(args.preset, n_sets=getattr(args, "seeds", None),
                             n_estimates=getattr(args, "estimates", None))
        checkpoint = out / "checkpoints" / "synthetic.pt"
        timing: dict[str, Any] = {"blocks_s": {}}
        ctx = init_distributed(getattr(args, "device", None) or "cpu")
        quiet = bool(getattr(args, "quiet", False)) or not ctx.is_main
        bar = tqdm = None
        if not quiet:
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

        records = run(config, checkpoint_path=checkpoint, resume=bool(args.resume), on_block=on_block,
                      progress=None if bar is None else (lambda _name: bar.update(1)), ctx=ctx)
        if ctx.enabled:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
            if not ctx.is_main:
                return {}
            timing["world_size"] = ctx.world_size
        if bar is not None:
            bar.close()
        timing["total_s"] = float(sum(timing["blocks_s"].values()))
        command = getattr(args, "command_line", None) or f"hardeq reproduce synthetic --preset {args.preset}"
        figures = [f"synthetic_{f}_{loss}.png" for f in ("gaussian", "poisson") for loss in config[f]["losses"]]
        doc = write_json(out / "synthetic.json", "synthetic", args.preset, config, records, timing=timing,
                         figures=figures, command=command, hardeq_version=hardeq.__version__)
        for p in checkpoint.parent.glob("synthetic*.pt"):
            p.unlink()
        if checkpoint.parent.exists():
            try:
                checkpoint.parent.rmdir()
            except OSError:
                pass
        return doc

    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        from ..results import atomic_write_text
        from .report import plot, render_markdown

        out = Path(out)
        paths = plot(doc, out)
        text = render_markdown(doc, command=doc.get("command"))
        atomic_write_text(out / "synthetic.md", text)
        if not quiet:
            print(text)
        return [out / "synthetic.md", *paths]


STUDY = SyntheticStudy("synthetic", json.loads((Path(__file__).resolve().parent / "config.json").read_text()))
