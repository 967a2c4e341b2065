"""Reusable layers that return constrained distributions."""

from .heads import ConstrainedGaussianHead

__all__ = ["ConstrainedGaussianHead"]
