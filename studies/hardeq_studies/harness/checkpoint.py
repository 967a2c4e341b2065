"""Atomic checkpoints (a temporary file in the same folder, then ``os.replace``), and resumable blocks."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_torch_save", "load_checkpoint", "fingerprint", "run_blocks"]


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, then ``os.replace`` (never a torn file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".ckpt.tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint (``weights_only=True``: tensors and plain containers only; on the CPU)."""
    return torch.load(Path(path), map_location="cpu", weights_only=True)


def fingerprint(obj: Any) -> str:
    """A short hash of a JSON-able description of a run (a checkpoint of another run is refused)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_blocks(blocks: Mapping[str, Callable[[], Any]], *, checkpoint_path: Path | None = None, resume: bool = False,
               run_id: Any = None, on_block: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
    """Compute independent blocks of a study (``key -> compute()``) in order, checkpointing after each.

    For studies that are not one training run (e.g. Monte Carlo measurements in blocks): after every block,
    the results so far are saved atomically to ``checkpoint_path`` with the fingerprint of ``run_id``; with
    ``resume``, blocks found in a checkpoint of the same run are not recomputed (a checkpoint of another run
    raises ``ValueError``). Block results must be plain containers (dicts, lists, str, numbers, None, tensors),
    as ``weights_only`` loading requires. Each block must be deterministic on its own (seeded from its key),
    so a resumed run equals an uninterrupted one.

    Returns:
        ``{key: result}`` in the order of ``blocks``.
    """
    run_hash = fingerprint(run_id)
    done: dict[str, Any] = {}
    if resume and checkpoint_path is not None and Path(checkpoint_path).exists():
        ck = load_checkpoint(checkpoint_path)
        if ck.get("fingerprint") != run_hash:
            raise ValueError(f"checkpoint {checkpoint_path} belongs to a different run (fingerprint "
                             f"{ck.get('fingerprint')} != {run_hash}); remove it or run without --resume.")
        done = dict(ck["blocks"])
    for key, compute in blocks.items():
        if key in done:
            continue
        done[key] = compute()
        if checkpoint_path is not None:
            atomic_torch_save({"fingerprint": run_hash, "blocks": done}, Path(checkpoint_path))
        if on_block is not None:
            on_block(key, done[key])
    return {key: done[key] for key in blocks}
