"""Exceptions and warnings raised by hardeq."""

from __future__ import annotations

__all__ = ["NotPSDError", "NumericalWarning"]


class NotPSDError(RuntimeError):
    """A matrix that must be symmetric positive definite (usually ``A Sigma A^T``) is not, numerically."""


class NumericalWarning(RuntimeWarning):
    """A computation lost accuracy (for example it needed jitter, or a residual stayed large)."""
