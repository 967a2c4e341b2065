"""Gradient estimators for exact constrained samples (DESIGN.md section 2)."""

from .registry import ESTIMATORS, Estimator, available_estimators, get_estimator, register_estimator

__all__ = ["ESTIMATORS", "Estimator", "available_estimators", "get_estimator", "register_estimator"]
