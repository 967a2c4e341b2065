"""Figures written reproducibly: PNGs from matplotlib's Agg backend at a fixed DPI without the ``Software``
metadata entry (which names the matplotlib version), so ``hardeq report`` rewrites a figure from its JSON with
the same bytes wherever the same matplotlib and FreeType render it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["PNG_METADATA", "save_png"]

#: PNG text chunks: none (matplotlib would otherwise write its version under "Software")
PNG_METADATA: dict[str, Any] = {"Software": None}


def save_png(fig: Any, path: Path, *, dpi: int) -> Path:
    """``fig.savefig(path, dpi=dpi)`` as a PNG without metadata; returns ``path``."""
    fig.savefig(path, dpi=dpi, format="png", metadata=PNG_METADATA)
    return Path(path)
