"""Distributions conditioned on hard equality constraints."""

from .kl import kl_constrained_normal
from .normal import ConstrainedNormal, affine_subspace
from .poisson import ConstrainedPoisson

__all__ = ["ConstrainedNormal", "ConstrainedPoisson", "affine_subspace", "kl_constrained_normal"]
