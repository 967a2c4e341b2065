"""Gradient estimators for exact constrained samples: one forward pass (the exact sample), many backward passes."""

from . import normal, poisson  # noqa: F401  (registers the estimators)
from .registry import ESTIMATORS, Estimator, available_estimators, get_estimator, register_estimator

__all__ = ["ESTIMATORS", "Estimator", "available_estimators", "get_estimator", "register_estimator"]
