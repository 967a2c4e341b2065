"""Distributions conditioned on hard equality constraints."""

from .kl import kl_constrained_normal
from .normal import ConstrainedNormal, affine_subspace

__all__ = ["ConstrainedNormal", "affine_subspace", "kl_constrained_normal"]
