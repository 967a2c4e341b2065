"""Gradient estimators for exact constrained samples (DESIGN.md section 2)."""

from . import normal, poisson  # noqa: F401  (registers the estimators)
from .registry import ESTIMATORS, Estimator, available_estimators, get_estimator, register_estimator

__all__ = ["ESTIMATORS", "Estimator", "available_estimators", "get_estimator", "register_estimator"]
