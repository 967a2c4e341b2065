r"""The per-row residual check: is every row of :math:`Az = k` met to round-off?

The criterion, per sample and per constraint row ``i``:

.. math::  |(Az - k)_i| \le \mathrm{rtol}\,(|A||z|)_i,

relative to the size of the terms summed in *that* row, never to the largest row (a small group must not hide
behind a large one; the criterion is invariant to rescaling one constraint). ``rtol = min(eps max(4, 2 sqrt(n)), cap)``
with ``cap`` a quarter of the library's exactness target (1e-5 float32, 1e-12 float64). :math:`Az` and
:math:`|A||z|` come from :meth:`~hardeq.EqualityConstraint.matvec_and_scale` and the common case costs one host
synchronisation; only when a row fails, and for float32 and below, the residual is
re-evaluated in float64, so that evaluation noise never asks for a refinement that cannot help.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...errors import NotPSDError

if TYPE_CHECKING:
    from ...constraints import EqualityConstraint

__all__ = ["CHECK_RTOL_CAP", "ResidualCheck", "check_rtol"]

#: cap of the check's tolerance per row, a quarter of the exactness target 1e-5 (float32) / 1e-12 (float64)
CHECK_RTOL_CAP = {torch.float32: 2.5e-6, torch.float64: 2.5e-13}


def check_rtol(dtype: torch.dtype, n: int) -> float:
    """The check's relative tolerance per row for vectors of size ``n`` in ``dtype``."""
    eps = torch.finfo(dtype).eps
    return min(eps * max(4.0, 2.0 * math.sqrt(n)), CHECK_RTOL_CAP.get(dtype, 1e3 * eps))


class ResidualCheck:
    """The per-row check of one constraint (see the module docstring)."""

    def __init__(self, constraint: "EqualityConstraint") -> None:
        self.constraint = constraint
        self._wide: "EqualityConstraint | None" = None

    @torch.no_grad()
    def failing(self, z: Tensor, method: str = "") -> Tensor | None:
        """Boolean mask ``(*sample, *batch)`` of the vectors with a row that fails the check, or ``None`` if none.

        Raises:
            NotPSDError: if the residual is NaN or infinite.
        """
        con = self.constraint
        rtol = check_rtol(z.dtype, z.shape[-1])
        Az, scale = con.matvec_and_scale(z)
        res = (Az - con.k).abs()
        bad = ~(res <= rtol * scale)  # NaN fails too
        if not bool(bad.any()):
            return None
        if not bool(torch.isfinite(res).all()):
            raise NotPSDError(
                f"conditioning produced NaN/inf (method {method!r}, dtype {z.dtype}); the inputs are not finite or "
                "the scales are out of range for this dtype (try float64)."
            )
        if z.dtype != torch.float64:
            if self._wide is None:
                self._wide = con.to(dtype=torch.float64)
            wide = self._wide
            res64 = (wide.matvec(z.double()) - wide.k).abs()
            bad = res64 > rtol * scale.double()
        bad = bad.any(-1)
        return bad if bool(bad.any()) else None
