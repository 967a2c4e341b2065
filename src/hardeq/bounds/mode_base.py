r"""Shared parts of the mode solvers (:mod:`hardeq.bounds.mode`): tolerances, operator types, :class:`ModeNotFound`."""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

#: a linear operator on ``(B, .)`` float64 vectors (``A z``, ``A^T lambda``, ``|A| x``)
_Operator = Callable[[Tensor], Tensor]


class _Solver(Protocol):
    """``solve(w, r, exact=False)``, the linear solve of :func:`dual_newton`."""

    def __call__(self, w: Tensor, r: Tensor, exact: bool = False) -> Tensor: ...

__all__ = ["ACCEPT_RTOL", "CONVERGED_RTOL", "JACOBIAN_RIDGE", "MAX_ACTIVE_SET_FACTOR", "MAX_NEWTON", "ModeNotFound",
           "accept_rtol", "clamped_rtol"]

#: per-row relative residual (of |A||z| + |k|) at which the float64 iterations stop
CONVERGED_RTOL = 1e-13
#: per-row relative residual accepted at the end (round-off of a long row's sum may stall above CONVERGED_RTOL);
#: at most half the library's float64 tolerance 1e-12 of |A||z|, since |k| <= |A||z| on the plane
ACCEPT_RTOL = 4e-13
#: Newton iterations of the diagonal dual method, and iterations of the general active-set method per bound
MAX_NEWTON = 100
MAX_ACTIVE_SET_FACTOR = 4


def accept_rtol(dtype: torch.dtype) -> float:
    """The per-row relative residual (of ``|A||z| + |k|``) at which a float64 mode is accepted for a distribution
    in ``dtype``: :data:`ACCEPT_RTOL` in float64; in a coarser dtype half its machine epsilon (float32: 6e-8), no
    more than the rounding of the mode to that dtype adds anyway. A float32 problem whose polytope meets the box only
    at a vertex can be empty in exact arithmetic on its rounded data and still feasible to float32 precision."""
    return max(ACCEPT_RTOL, torch.finfo(dtype).eps / 2)


def clamped_rtol(dtype: torch.dtype) -> float:
    """The per-row relative residual accepted after a general covariance's mode is clamped into the box:
    :func:`accept_rtol` in float64; in a coarser dtype 16 times its machine epsilon (float32: 1.9e-6, within the
    library's float32 per-row tolerance 1e-5). The active-set method ends on the float64 plane, and where a float32
    plane misses a degenerate vertex by its round-off, the clamp of a coordinate the rows fix moves the point off the
    plane by about that much (measured up to 2.5e-7 relative)."""
    return accept_rtol(dtype) if dtype == torch.float64 else max(accept_rtol(dtype), 16 * torch.finfo(dtype).eps)


#: relative Levenberg term of the dual Newton system (a row whose coordinates are all at bounds has J_ii = 0)
JACOBIAN_RIDGE = 1e-12


class ModeNotFound(ValueError):
    """The mode solver could not meet a row of ``A z = k`` inside the box: the polytope is empty (or so thin that
    float64 cannot find a point in it). The message names the batch element and row and gives the residual.

    Examples:
        >>> from hardeq.bounds import truncated_mode
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total)
        >>> truncated_mode(d, torch.zeros(3, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64))
        Traceback (most recent call last):
            ...
        hardeq.bounds.mode_base.ModeNotFound: the mode's ... found no point of the plane A z = k inside the box ...
    """
