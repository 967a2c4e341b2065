"""Writing study results: ``OUT/NAME.json`` (the results document), Markdown tables, atomic text files.

The results document is ``{"study", "preset", "config", "environment", "records", ...}``; a record is
``{"dataset", "method", "metric", "mean", "std", "n_seeds", "paper", ...}`` in the metric's natural units
(``paper``: the source paper's value in the same units, or ``null``). ``environment`` records the versions,
the device, the code fingerprint (:func:`~hardeq_studies.harness.code_fingerprint`) and the git commit with a
flag telling whether the working tree had uncommitted changes outside ``results/``.

A ``cpu`` or ``paper`` result (the presets whose results are committed) is refused from a dirty tree: its commit
would not say which code computed it. ``hardeq reproduce --allow-dirty`` (:func:`allow_dirty`) writes it anyway
and records ``"allow_dirty": true`` beside ``"dirty": true``.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .harness.checkpoint import code_fingerprint, git_state

__all__ = ["wall_time", "environment", "git_state", "write_json", "atomic_write_text", "markdown_table", "RECORD_KEYS",
           "COMMITTED_PRESETS", "allow_dirty", "dirty_refusal"]

#: keys every record carries
RECORD_KEYS = ("dataset", "method", "metric", "mean", "std", "n_seeds", "paper")
#: presets whose results are committed, so must name the commit that computed them
COMMITTED_PRESETS = ("cpu", "paper")

_ALLOW_DIRTY = False


def allow_dirty(allow: bool = True) -> None:
    """Let :func:`write_json` write ``cpu`` / ``paper`` results from a dirty tree (``--allow-dirty``); the
    results document then records ``"allow_dirty": true``."""
    global _ALLOW_DIRTY
    _ALLOW_DIRTY = bool(allow)


def dirty_refusal(study: str, preset: str) -> str | None:
    """Why a ``preset`` result of ``study`` may not be written now (a committed preset from a dirty tree,
    without :func:`allow_dirty`), or ``None``."""
    if preset not in COMMITTED_PRESETS or _ALLOW_DIRTY or git_state()["dirty"] is not True:
        return None
    return (f"the working tree has uncommitted changes, so the commit recorded in {study}.json would not name the "
            f"code of this {preset} result; commit them first, or pass --allow-dirty (the JSON then says so)")


def environment(device: str | torch.device | None = None) -> dict[str, Any]:
    """Versions, machine facts, the code fingerprint and git state recorded with every result."""
    import hardeq

    return {
        "hardeq": hardeq.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device) if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "code": code_fingerprint(),
        **git_state(),
    }


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (never a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, study: str, preset: str, config: dict, records: list[dict], *,
               device: str | torch.device | None = None, **extra: Any) -> dict:
    """Write the study's results document (every record completed with the :data:`RECORD_KEYS`) and return it.

    A ``cpu`` / ``paper`` result from a dirty tree raises ``ValueError`` unless :func:`allow_dirty` was called."""
    refusal = dirty_refusal(study, preset)
    if refusal:
        raise ValueError(f"{path}: not written: {refusal}.")
    for r in records:
        for key in RECORD_KEYS:
            r.setdefault(key, None)
    env = environment(device)
    if env["dirty"] and _ALLOW_DIRTY:
        env["allow_dirty"] = True
    doc = {"study": study, "preset": preset, "config": config, "environment": env,
           "records": records, **extra}
    atomic_write_text(Path(path), json.dumps(doc, indent=1, default=float) + "\n")
    return doc


def markdown_table(header: list[str], rows: Iterable[list[Any]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def wall_time(doc: Mapping[str, Any], last_leg_seconds: float | None) -> tuple[float | None, str]:
    """The wall time a report prints: ``(seconds, label)``.

    A run document that records ``wall_seconds_total`` (top level or under ``timing``; the sum over every leg of
    a resumed run) gives that total, labelled with the legs' seconds when ``resumed_legs`` holds several, and as
    the last leg alone when the run was resumed (``resumed``) but only one leg was recorded.
    Otherwise the study's own key (``last_leg_seconds``) is all the document has: labelled "last leg" when the
    command ran with ``--resume`` (it then counts only the last leg), else "total".
    """
    timing = doc.get("timing") if isinstance(doc.get("timing"), Mapping) else {}
    total = doc.get("wall_seconds_total", timing.get("wall_seconds_total"))
    if total is not None:
        legs = doc.get("resumed_legs", timing.get("resumed_legs")) or []
        if len(legs) > 1:
            return float(total), (f"total across the {len(legs)} legs of a resumed run: "
                                  + " + ".join(f"{x:,.0f}" for x in legs) + " s")
        if doc.get("resumed"):
            return float(total), "the last leg of a resumed run; its earlier legs are not recorded"
        return float(total), "total"
    resumed = "--resume" in str(doc.get("command", ""))
    return (None if last_leg_seconds is None else float(last_leg_seconds),
            "last leg: run with --resume, and earlier legs, if any, are not recorded" if resumed else "total")
