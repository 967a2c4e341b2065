"""Running the ``synthetic`` study: one block per (family, constraint case, loss), resumable between blocks
through the harness's :func:`~hardeq_studies.harness.run_blocks`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..harness import DistContext, run_blocks
from .task import run_block

__all__ = ["blocks", "block_key", "run"]


def blocks(config: dict) -> list[tuple[str, str, str]]:
    """``(family, case, loss)`` of every block, in run order."""
    return [(family, case, loss) for family in ("gaussian", "poisson")
            for case in config[family]["cases"] for loss in config[family]["losses"]]


def block_key(block: tuple[str, str, str]) -> str:
    return "/".join(block)


def run(config: dict, seed: int | None = None, *, checkpoint_path: Path | None = None, resume: bool = False,
        on_block: Callable[[str, list[dict]], None] | None = None,
        progress: Callable[[str], None] | None = None, ctx: DistContext | None = None) -> list[dict]:
    """All records of the study (prints nothing). With ``checkpoint_path``, the records of every finished block
    are checkpointed; ``resume`` skips the blocks of a checkpoint of the same run (same config and seed).
    ``on_block(key, records)`` is called after each newly computed block.

    Under ``torchrun`` (``ctx.world_size = W > 1``) rank ``r`` computes blocks ``r, r + W, ...`` (each block is
    seeded from its key, so it does not matter which process computes it; each rank checkpoints its own
    blocks to ``checkpoint_path`` with ``.rank{r}`` inserted) and the records are gathered on every rank.
    """
    ctx = ctx or DistContext()
    keys = [block_key(b) for b in blocks(config)]
    mine = {block_key(b): (lambda b=b: run_block(config, *b, seed=seed, progress=progress))
            for i, b in enumerate(blocks(config)) if i % ctx.world_size == ctx.rank}
    path = checkpoint_path
    if ctx.enabled and path is not None:
        path = Path(path).with_name(f"{Path(path).stem}.rank{ctx.rank}{Path(path).suffix}")
    done = run_blocks(mine, checkpoint_path=path, resume=resume, on_block=on_block,
                      run_id={"study": "synthetic", "config": config, "seed": seed, "world": ctx.world_size})
    if ctx.enabled:
        import torch.distributed as dist

        parts: list = [None] * ctx.world_size
        dist.all_gather_object(parts, done)
        done = {k: v for part in parts for k, v in part.items()}
    return [r for key in keys for r in done[key]]
