"""Distributions conditioned on hard equality constraints."""

from .kl import kl_constrained_normal
from .normal import ConstrainedNormal, affine_subspace
from .plane_transform import PlaneTransform  # registers biject_to / transform_to for the support
from .poisson import ConstrainedPoisson

__all__ = ["ConstrainedNormal", "ConstrainedPoisson", "PlaneTransform", "affine_subspace", "kl_constrained_normal"]
