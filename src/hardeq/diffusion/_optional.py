"""Lazy import of the optional dependencies of :mod:`hardeq.diffusion` (private)."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require_diffusers", "require_tqdm", "INSTALL_HINT"]

#: the command that installs the optional dependencies of ``hardeq.diffusion``
INSTALL_HINT = 'pip install "hardeq[diffusion]"'


def _require(module: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module!r} is needed for {purpose} but is not installed; install it with: {INSTALL_HINT}"
        ) from exc


def require_diffusers() -> ModuleType:
    """Import ``diffusers`` or raise ``ImportError`` naming the pip extra that installs it."""
    return _require("diffusers", "hardeq.diffusion.ConstrainedScheduler")


def require_tqdm() -> ModuleType:
    """Import ``tqdm`` (progress bars) or raise ``ImportError`` naming the pip extra."""
    return _require("tqdm", "progress bars (progress=True)")
