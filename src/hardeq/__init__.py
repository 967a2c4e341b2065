"""hardeq: hard linear equality constraints for deep generative models, by exact conditioning.

The subpackages :mod:`hardeq.nn` (layers returning constrained distributions), :mod:`hardeq.diffusion` (diffusion
samplers) and :mod:`hardeq.testing` (conformance suites) are imported on first attribute access
(``hardeq.nn.ConstrainedGaussianHead`` works after ``import hardeq``), as torch does for its own submodules, so
``import hardeq`` needs only torch and numpy. Optional dependencies load only when the part that needs them is used:
``diffusers`` for :class:`hardeq.diffusion.ConstrainedScheduler` (``pip install "hardeq[diffusion]"``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from . import baselines, bounds, estimators
from .constraints import EqualityConstraint, LinearConstraint, SparseConstraint, SumConstraint, register_pair
from .distributions import ConstrainedNormal, ConstrainedPoisson
from .distributions.truncated import TruncatedConstrainedNormal
from .errors import NotPSDError, NumericalWarning
from .linalg.block_diagonal import BlockDiagonalCovariance
from .linalg.covariance import (Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance,
                                register_trace_inv_mul)
from .manifold import ManifoldNormal, NonlinearConstraint

if TYPE_CHECKING:
    from . import diffusion, nn, testing

__version__ = "0.1.0"

#: subpackages imported on first access (``hardeq.nn``), not by ``import hardeq``
_LAZY_SUBMODULES = ("diffusion", "nn", "testing")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # also binds it as an attribute of this module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))

__all__ = [
    "ConstrainedNormal",
    "ConstrainedPoisson",
    "TruncatedConstrainedNormal",
    "Covariance",
    "DiagonalCovariance",
    "FullCovariance",
    "LowRankCovariance",
    "BlockDiagonalCovariance",
    "register_trace_inv_mul",
    "EqualityConstraint",
    "LinearConstraint",
    "SparseConstraint",
    "SumConstraint",
    "NonlinearConstraint",
    "ManifoldNormal",
    "register_pair",
    "NotPSDError",
    "NumericalWarning",
    "baselines",
    "bounds",
    "diffusion",
    "estimators",
    "nn",
    "testing",
    "__version__",
]
