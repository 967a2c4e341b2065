"""Atomic checkpoints (a temporary file in the same folder, then ``os.replace``), and resumable blocks.

Provenance: every checkpoint records the code that wrote it. :func:`code_fingerprint` hashes the sources
(``*.py``) and configs (``*.json``) of the packages ``hardeq`` and ``hardeq_studies``; :func:`fingerprint`, the
hash a checkpoint is matched by, covers that code hash as well as the run's settings, and
:func:`atomic_torch_save` stamps every checkpoint dict with :func:`code_stamp` (the code hash, the git commit
and whether the tree was dirty). :func:`code_mismatch` explains a checkpoint written by other code, so
``--resume`` refuses it with a reason instead of silently mixing two versions of the code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_torch_save", "load_checkpoint", "fingerprint", "run_blocks", "code_fingerprint", "code_stamp",
           "code_mismatch", "git_state", "CODE_KEY", "CODE_PACKAGES"]

#: the packages whose sources make up the code a checkpoint or result was computed with
CODE_PACKAGES = ("hardeq", "hardeq_studies")
#: the key under which :func:`atomic_torch_save` stores :func:`code_stamp` in a checkpoint dict
CODE_KEY = "code_provenance"


@lru_cache(maxsize=None)
def code_fingerprint(packages: tuple[str, ...] = CODE_PACKAGES) -> str:
    """SHA-256 (16 hex digits) of the ``*.py`` and ``*.json`` files of ``packages``, by relative path and bytes.

    Computed once per process (the sources of a running process do not change under it)."""
    h = hashlib.sha256()
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"code_fingerprint: {package!r} is not an importable package.")
        root = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and p.is_file()
                       and "__pycache__" not in p.parts)
        for p in files:
            h.update(f"{package}/{p.relative_to(root).as_posix()}\0".encode())
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """``{"git": commit or "unknown", "dirty": bool or None}`` of the source tree this package runs from
    (``dirty``: tracked files outside ``results/`` differ from the commit, so that writing one study's results
    does not make the next study's dirty; ``None`` outside a git checkout)."""
    head = _git("rev-parse", "HEAD")
    if not head:
        return {"git": "unknown", "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ":(top,exclude)results")
    return {"git": head.strip(), "dirty": None if status is None else bool(status.strip())}


@lru_cache(maxsize=None)
def code_stamp() -> dict[str, Any]:
    """``{"code": code_fingerprint(), "git": commit or "unknown", "dirty": bool or None}`` of this process."""
    return {"code": code_fingerprint(), **git_state()}


def code_mismatch(checkpoint: Mapping[str, Any]) -> str | None:
    """Why ``checkpoint`` (a loaded checkpoint dict) was not written by this code, or ``None`` when it was."""
    theirs = checkpoint.get(CODE_KEY) if isinstance(checkpoint, Mapping) else None
    mine = code_stamp()
    if not isinstance(theirs, Mapping) or "code" not in theirs:
        return (f"records no code fingerprint (written before checkpoints recorded their code); this code is "
                f"{mine['code']} (commit {mine['git'][:12]})")
    if theirs["code"] == mine["code"]:
        return None

    def describe(stamp: Mapping[str, Any]) -> str:
        dirty = " with uncommitted changes" if stamp.get("dirty") else ""
        return f"code {stamp.get('code')} (commit {str(stamp.get('git', 'unknown'))[:12]}{dirty})"

    return (f"was written by other code: {describe(theirs)}, but this is {describe(mine)}; the sources of "
            f"{' or '.join(CODE_PACKAGES)} changed since, so resuming would mix two versions of the code")


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, then ``os.replace`` (never a torn file).

    A dict is saved with its provenance added under :data:`CODE_KEY` (:func:`code_stamp`)."""
    path = Path(path)
    if isinstance(obj, dict) and CODE_KEY not in obj:
        obj = {**obj, CODE_KEY: code_stamp()}
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
    """A short hash of a JSON-able description of a run and of the code (:func:`code_fingerprint`) that runs it;
    a checkpoint of another run, or of the same settings run by other code, is refused or recomputed."""
    run = {"run": obj, "code": code_fingerprint()}
    return hashlib.sha256(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
        why = code_mismatch(ck)
        if why:
            raise ValueError(f"checkpoint {checkpoint_path} {why}; remove it, or pass --fresh instead of --resume.")
        if ck.get("fingerprint") != run_hash:
            raise ValueError(f"checkpoint {checkpoint_path} belongs to a different run (fingerprint "
                             f"{ck.get('fingerprint')} != {run_hash}); remove it, or pass --fresh instead of --resume.")
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
