"""Writing study results: ``results/NAME.json`` (DESIGN.md section 5) and Markdown tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch

__all__ = ["environment", "write_json", "atomic_write_text", "markdown_table"]


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    try:
        git = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        git = "unknown"
    import hardeq

    return {
        "hardeq": hardeq.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "git": git,
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


def write_json(path: Path, study: str, preset: str, config: dict, records: list[dict], **extra: Any) -> dict:
    """Write the study's results document and return it."""
    doc = {"study": study, "preset": preset, "config": config, "environment": environment(),
           "records": records, **extra}
    atomic_write_text(Path(path), json.dumps(doc, indent=1, default=float) + "\n")
    return doc


def markdown_table(header: list[str], rows: Iterable[list[Any]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
