r"""The per-row residual check: is every row of :math:`Az = k` met to round-off?

The criterion, per sample and per constraint row ``i``:

.. math::  |(Az - k)_i| \le \mathrm{rtol}\,\big((|A||z|)_i + |k_i|\big),

relative to the size of the terms summed in *that* row (as :meth:`~hardeq.EqualityConstraint.check`), never to
the largest row (a small group must not hide
behind a large one; the criterion is invariant to rescaling one constraint). ``rtol = min(eps max(4, 2 sqrt(n)), cap)``
with ``cap`` a quarter of the library's exactness target (1e-5 float32, 1e-12 float64). :math:`Az` and
:math:`|A||z|` come from :meth:`~hardeq.EqualityConstraint.matvec_and_scale` and the common case costs one host
synchronisation; only when a row fails, and for float32 and below, the residual is
re-evaluated in float64, so that evaluation noise never asks for a refinement that cannot help.

A row whose terms are all (nearly) zero would have a (nearly) zero tolerance and could pass only when met exactly.
The conditioner sets the coordinates a single row determines exactly after every step
(:meth:`~hardeq.EqualityConstraint.pinned_values`); for coordinates that several rows determine jointly, the
tolerance has an absolute floor :math:`\varepsilon^2(|A|\sigma)_i` (:math:`\sigma`: the prior standard deviations),
which such rows reach after a refinement step or two (their terms come back at :math:`\varepsilon^2|\hat z|`, then
:math:`\varepsilon^3|\hat z|`). Elsewhere the floor is at most the relative tolerance itself at scale ratios up to
:math:`10^8` in float32 (:math:`\varepsilon_{32}^2 \cdot 10^8 = 1.4\cdot 10^{-6}` next to
:math:`\mathrm{rtol} = 2.5\cdot 10^{-6}`; negligible in float64), so rows stay within the exactness target.
:meth:`ResidualCheck.describe` names the failing row of a failing vector, its residual and its tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...errors import NotPSDError

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["CHECK_RTOL_CAP", "DEFERRED_MESSAGE", "ResidualCheck", "check_rtol"]

#: the message of the deferred per-row check (:meth:`ResidualCheck.defer`)
DEFERRED_MESSAGE = ("hardeq: a conditioned vector misses a row of A z = k beyond its tolerance rtol (|A||z| + |k|)_i "
                    "(checked on the device, without a host read: the sync-free path of a GPU, validated or not, or "
                    "of torch.compile / CUDA-graph capture). A Sigma A^T is too ill-conditioned for the sync-free "
                    "path (float64 Cholesky of the equilibrated Gram matrix, refined), or the inputs are not finite. "
                    "Use float64, rescale/remove nearly dependent rows of A, or the checked path (eager mode on a "
                    "CPU: it escalates to a QR factor and names the row).")

#: cap of the check's tolerance per row, a quarter of the exactness target 1e-5 (float32) / 1e-12 (float64)
CHECK_RTOL_CAP = {torch.float32: 2.5e-6, torch.float64: 2.5e-13}


def check_rtol(dtype: torch.dtype, n: int) -> float:
    """The check's relative tolerance per row for vectors of size ``n`` in ``dtype``."""
    eps = torch.finfo(dtype).eps
    return min(eps * max(4.0, 2.0 * math.sqrt(n)), CHECK_RTOL_CAP.get(dtype, 1e3 * eps))


class ResidualCheck:
    """The per-row check of one constraint (see the module docstring).

    Args:
        constraint: the constraint.
        covariance: the prior covariance, optional: with it, the tolerance of row ``i`` has the absolute floor
            ``eps^2 (|A| sigma)_i`` (``sigma``: the prior standard deviations) -- the coordinates several rows
            determine jointly (``z_1 + z_2 = 0`` and ``z_1 - z_2 = 0``) come back at ``eps^2 |z_hat|`` and can never
            meet a tolerance that is relative to themselves. Computed on the first failure only (O(n a) once).
    """

    def __init__(self, constraint: "EqualityConstraint", covariance: "Covariance | None" = None) -> None:
        self.constraint = constraint
        self.covariance = covariance
        self._wide: "EqualityConstraint | None" = None
        self._floor: Tensor | None = None
        self._base: tuple[float, Tensor] | None = None  # (rtol, rtol |k| + floor) of defer()

    def floor(self) -> Tensor | float:
        r""":math:`\varepsilon^2(|A|\sigma)_i` (``(*batch, a)``, float64), 0 without a covariance."""
        if self.covariance is None:
            return 0.0
        if self._floor is None:
            with torch.no_grad():
                self._floor = self._abs_sigma().to(torch.float64).mul_(torch.finfo(self.constraint.dtype).eps ** 2)
        return self._floor

    def _abs_sigma(self) -> Tensor:
        r""":math:`|A|\sigma` (``(*batch, a)``) in the working precision (a tolerance: the working precision is plenty,
        and the ``(*batch, n)`` passes stay in it); needs a covariance."""
        cov = self.covariance
        assert cov is not None
        with torch.no_grad():
            scale = getattr(cov, "scale", None) if type(cov).__name__ == "DiagonalCovariance" else None
            sigma = scale.detach().abs() if isinstance(scale, Tensor) else cov.diagonal().detach().clamp_min(0).sqrt()
            return self.constraint.abs_matvec(sigma.to(self.constraint.dtype))

    @torch.no_grad()
    def failing(self, z: Tensor, method: str = "") -> Tensor | None:
        """Boolean mask ``(*sample, *batch)`` of the vectors with a row that fails the check, or ``None`` if none.

        Raises:
            NotPSDError: if the residual is NaN or infinite.
        """
        con = self.constraint
        rtol = check_rtol(z.dtype, z.shape[-1])
        Az, scale = con.matvec_and_scale(z)
        scale = scale + con.k.abs()
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
            wide = self.wide()
            res = (wide.matvec(z.double()) - wide.k).abs()
        bad = res > (rtol * scale.to(torch.float64) + self.floor()).to(res.dtype)
        bad = bad.any(-1)
        return bad if bool(bad.any()) else None

    def defer(self, z: Tensor, cause: "Callable[[Tensor], str] | None" = None) -> Tensor:
        r"""The per-row check of ``z`` on the device, without a host read: every row of every vector must meet
        :math:`|(Az - k)_i| \le \mathrm{rtol}\,((|A||z|)_i + |k_i|) + \varepsilon^2(|A|\sigma)_i`, with the
        residual and the scale evaluated in float64 (so that evaluation noise never fails an exact vector); the
        error is deferred with ``torch._assert_async`` (a GPU raises it at its next synchronisation, a CPU at once).
        In eager mode on the CPU the error is re-raised as :class:`~hardeq.NotPSDError` naming the row
        (:meth:`describe`, and ``cause(z)`` when given). Inside a ``torch.func`` transform (which has no batching rule
        for a device assertion) the vectors that fail are returned as NaN instead. Returns ``z``. Cost: one float64
        copy of ``z`` (for float32), :math:`Az` and :math:`|A||z|` in float64 (O(n a), O(nnz) sparse) and a few
        elementwise passes over ``(*sample, *batch, a)``."""
        from ..._utils import assert_deferred

        with torch.no_grad():
            wide = self.wide()
            zd = z.detach()
            # the residual in float64 (it cancels); |A||z| (a tolerance) in the working precision, widened
            miss = wide._shortfall(zd.to(torch.float64)).abs_()  # |(A z - k)_i|
            scale = self.constraint.abs_matvec(zd.abs())
            rtol = check_rtol(z.dtype, z.shape[-1])
            # (the scale in the working precision added to the float64 base: widened exactly, no float64 copy)
            met = miss <= torch.add(self.base(rtol), scale, alpha=rtol)
        if torch._C._functorch.maybe_current_level() is not None:  # vmap / grad: NaN marks a failing vector
            return torch.where(met.all(-1, keepdim=True), z, torch.nan)

        def named() -> NotPSDError:
            why = "" if cause is None else f"; {cause(z)}"
            return NotPSDError(f"{DEFERRED_MESSAGE} {self.describe(z)}{why}")

        assert_deferred(met.all(), DEFERRED_MESSAGE, named)
        return z

    def base(self, rtol: float) -> Tensor:
        r""":math:`\mathrm{rtol}|k| + \varepsilon^2(|A|\sigma)`, float64 (``(*batch, a)``): the part of the tolerance of
        :meth:`defer` that does not depend on the vector; computed once per check and ``rtol``."""
        if self._base is None or self._base[0] != rtol:
            with torch.no_grad():
                k_part = self.wide().k.detach().abs() * rtol
                if self.covariance is None:
                    base = k_part
                elif self._floor is not None:
                    base = k_part + self._floor
                else:  # (the floor added in float64 from the working precision: widened exactly, as floor() does)
                    base = torch.add(k_part, self._abs_sigma(), alpha=torch.finfo(self.constraint.dtype).eps ** 2)
                self._base = (rtol, base)
        return self._base[1]

    def wide(self) -> "EqualityConstraint":
        """The constraint in float64 (itself when it is float64), converted once."""
        if self.constraint.dtype == torch.float64:
            return self.constraint
        if self._wide is None:
            self._wide = self.constraint.to(dtype=torch.float64)
        return self._wide

    @torch.no_grad()
    def describe(self, z: Tensor) -> str:
        """The row that fails by the largest factor over its tolerance: its index (batch and sample indices
        first), residual and tolerance (residual and scale evaluated in float64)."""
        wide = self.wide()
        z64 = z.detach().to(torch.float64)
        Az, scale = wide.matvec_and_scale(z64)
        res = (Az - wide.k).abs()
        tol = check_rtol(z.dtype, z.shape[-1]) * (scale + wide.k.abs()) + self.floor()
        res, tol = torch.broadcast_tensors(res, tol)
        excess = torch.where(res > tol, res / tol.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
        flat = int(excess.flatten().argmax())
        where = torch.unravel_index(torch.tensor(flat), excess.shape)
        index = tuple(int(i) for i in where)
        return (f"row {index[-1]} (index {index} over (*sample, *batch, row)) has |(A z - k)_i| = "
                f"{res[index].item():.3e} > its tolerance {tol[index].item():.3e} = rtol (|A||z| + |k|)_i + "
                "eps^2 (|A| sigma)_i")


def _check_scale(c: Tensor) -> None:
    if not bool((torch.isfinite(c) & (c > 0)).all()):
        raise NotPSDError(
            f"the covariance's scales must be finite and not all zero; got a largest entry in "
            f"[{c.min().item():.3e}, {c.max().item():.3e}]."
        )


def _cause(c: Tensor, z: Tensor) -> str:
    """Why refinement could not meet the rows: scales that are not finite or all zero, subnormal scales or values,
    else the conditioning of S."""
    if not bool((torch.isfinite(c) & (c > 0)).all()):
        return (f"the covariance's scales must be finite and not all zero; got a largest entry in "
                f"[{c.min().item():.3e}, {c.max().item():.3e}].")
    tiny = torch.finfo(z.dtype).tiny
    if bool((c < tiny).any()):
        return (f"the covariance's largest standard deviation, {c.min().item():.3e}, is subnormal in {c.dtype} "
                f"(below {tiny:.3e}), so the conditioned values have too few significant bits. Rescale the problem "
                "(measure z in units of the scale) or use float64.")
    return ("A Sigma A^T is too ill-conditioned for this dtype. Use float64, or rescale/remove nearly dependent rows "
            "of A.")
