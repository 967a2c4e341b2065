"""Optional dependencies of the studies, installed through pip extras (``pip install "hardeq-studies[NAME]"``)."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingDependency", "require", "install_hint"]


class MissingDependency(ImportError):
    """An optional dependency of a study is not installed; the message says what to install."""


def install_hint(extra: str) -> str:
    """The command that installs extra ``extra``."""
    return f'pip install "hardeq-studies[{extra}]"'


def require(module: str, extra: str, *, purpose: str | None = None) -> ModuleType:
    """Import ``module``, or raise :class:`MissingDependency` naming the pip extra that provides it.

    Args:
        module: importable name, e.g. ``"matplotlib"`` or ``"torch_geometric"``.
        extra: the pip extra of ``hardeq`` that installs it, e.g. ``"chemical"`` or ``"graphs"``.
        purpose: what needs it (shown in the message), e.g. ``"the chemical study's plots"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        need = f" for {purpose}" if purpose else ""
        raise MissingDependency(f"{module!r} is needed{need} but is not installed; install it with: "
                                f"{install_hint(extra)}") from exc
