"""Writing study results: ``OUT/NAME.json`` (the results document), Markdown tables, atomic text files.

The results document is ``{"study", "preset", "config", "environment", "records", ...}``; a record is
``{"dataset", "method", "metric", "mean", "std", "n_seeds", "paper", ...}`` in the metric's natural units
(``paper``: the source paper's value in the same units, or ``null``). ``environment`` records the versions,
the device, and the git commit with a flag telling whether the working tree had uncommitted changes.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment", "git_state", "write_json", "atomic_write_text", "markdown_table", "RECORD_KEYS"]

#: keys every record carries
RECORD_KEYS = ("dataset", "method", "metric", "mean", "std", "n_seeds", "paper")


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """``{"git": commit or "unknown", "dirty": bool or None}`` of the source tree this package runs from
    (``dirty``: tracked files differ from the commit; ``None`` outside a git checkout)."""
    head = _git("rev-parse", "HEAD")
    if not head:
        return {"git": "unknown", "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git": head.strip(), "dirty": None if status is None else bool(status.strip())}


def environment(device: str | torch.device | None = None) -> dict[str, Any]:
    """Versions, machine facts and git state recorded with every result."""
    import hardeq

    return {
        "hardeq": hardeq.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device) if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
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
    """Write the study's results document (every record completed with the :data:`RECORD_KEYS`) and return it."""
    for r in records:
        for key in RECORD_KEYS:
            r.setdefault(key, None)
    doc = {"study": study, "preset": preset, "config": config, "environment": environment(device),
           "records": records, **extra}
    atomic_write_text(Path(path), json.dumps(doc, indent=1, default=float) + "\n")
    return doc


def markdown_table(header: list[str], rows: Iterable[list[Any]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
