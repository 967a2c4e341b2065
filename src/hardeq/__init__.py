"""hardeq: hard linear equality constraints for deep generative models, by exact conditioning."""

from __future__ import annotations

from . import baselines, estimators
from .constraints import EqualityConstraint, LinearConstraint, SparseConstraint, SumConstraint
from .distributions import ConstrainedNormal, ConstrainedPoisson
from .errors import NotPSDError, NumericalWarning
from .linalg.covariance import Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance

__version__ = "0.1.0"

__all__ = [
    "ConstrainedNormal",
    "ConstrainedPoisson",
    "Covariance",
    "DiagonalCovariance",
    "FullCovariance",
    "LowRankCovariance",
    "EqualityConstraint",
    "LinearConstraint",
    "SparseConstraint",
    "SumConstraint",
    "NotPSDError",
    "NumericalWarning",
    "baselines",
    "estimators",
    "__version__",
]
