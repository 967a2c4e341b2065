r"""Conditioning a Gaussian on a linear equality constraint (Matheron's rule), without forming ``n x n``.

With :math:`S = A\Sigma A^\top` and the gain :math:`K = \Sigma A^\top S^{-1}`, the Matheron map

.. math::
    z = \hat z + K(k - A\hat z)

sends :math:`\hat z \sim \mathcal N(\mu, \Sigma)` to an exact sample of :math:`z \mid Az = k` and :math:`\mu` to the
conditional mean. Everything here is about computing it *to round-off, per constraint row*, and fast.

**One algorithm, one factor object** (:class:`~.factor.Factor`: gain, whiten, inv_quad, logdet, conditional
variance), tried in this order:

1. :class:`~.grouped.GroupedFactor`: the constraint's Gram matrix is diagonal under a diagonal covariance
   (a :class:`~hardeq.SumConstraint`): O(n) closed forms.
2. :class:`~.cholesky.CholeskyFactor` in the working precision, accepted when the pivot ratio of the equilibrated
   Gram matrix says :math:`\kappa \le 10^3` in float32 (:math:`10^{10}` in float64);
3. the same in float64 for a float32 input, accepted when :math:`\kappa \le 10^{10}`;
4. :class:`~.qr.QRFactor`, backward stable, in float64 (raises :class:`~hardeq.NotPSDError` when singular).

A dense constraint with ``n - a < a`` is then wrapped in :class:`~.nullspace.NullspaceFactor` (O(n (n - a)) per
vector, cancellation-free variances).

**The conditioner chooses, checks, refines and escalates.** After each Matheron step the per-row residual check
(:mod:`.residual`) marks the vectors with a row :math:`|(Az-k)_i| > \mathrm{rtol}\,(|A||z|)_i`; only those get a
refinement step :math:`z \leftarrow z + K(k - Az)` (up to :data:`MAX_REFINEMENT_STEPS`; the map is a projection, so
this changes neither the distribution nor, to first order, the gradient). A vector still failing makes the
conditioner move on to the next factor of the list and keep refining with it; after the last one it raises
:class:`~hardeq.NotPSDError`. Refinement is needed when :math:`\hat z` is much larger than :math:`z` (an
``ulp(ẑ)`` error: a group of one with scale 1e8 must return its total) or when :math:`\varepsilon\kappa(S)` is not
small.

**Static mode** (``static=True``; chosen automatically by :class:`~hardeq.ConstrainedNormal` with
``validate_args=False`` under ``torch.compile`` or a ``torch.func`` transform): no data-dependent branch. The factor
is chosen by structure only (grouped, else Cholesky in float64 of the equilibrated Gram matrix), nothing is checked,
and every vector gets :data:`STATIC_REFINEMENT_STEPS` refinement steps. Accuracy: the per-row criterion holds for
well-conditioned problems (:math:`\varepsilon_{64}\kappa(\tilde S) \ll 1`, scales within about eight decades); groups of
one come back within one ulp of their total rather than exactly.

Cost: factorisation O(batch n a^2 + batch a^3) (GEMM speed; grouped O(n)); each conditioned vector O(n a) (grouped:
O(n); sparse: O(nnz)) plus the check, one more O(n a) product. :meth:`Conditioner.sample` fuses ``loc + F eps`` and the
Matheron step in place when no gradient is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ..._utils import is_tracing
from ...errors import NotPSDError
from .cholesky import CholeskyFactor
from .factor import Factor
from .grouped import GroupedFactor
from .nullspace import NullspaceFactor
from .qr import QRFactor
from .residual import CHECK_RTOL_CAP, ResidualCheck, check_rtol

if TYPE_CHECKING:
    from ...constraints import EqualityConstraint
    from ..covariance import Covariance

__all__ = [
    "CHECK_RTOL_CAP",
    "Conditioner",
    "Factor",
    "MAX_REFINEMENT_STEPS",
    "STATIC_REFINEMENT_STEPS",
    "check_rtol",
    "is_tracing",
]

#: refinement steps allowed per factor before escalating to the next one
MAX_REFINEMENT_STEPS = 3
#: refinement steps every vector gets in static mode
STATIC_REFINEMENT_STEPS = 1
#: largest pivot-ratio estimate of kappa accepted by the Cholesky factor, by precision of the factor
KAPPA_MAX = {"working": 1e3, "float64": 1e10}


class Conditioner:
    r""":math:`\mathcal N(\mu, \Sigma)` given :math:`Az = k`: everything that does not depend on :math:`\mu`.

    Args:
        covariance: the structure of :math:`\Sigma` (batch shape ``B_s``).
        constraint: the constraint (batch shape ``B_c``); results broadcast over ``B_s`` and ``B_c``.
        static: no data-dependent branches (see the module docstring).
        method: force one factor (``"grouped"``, ``"cholesky"``, ``"cholesky64"`` or ``"qr"``; no null-space form,
            no escalation): for tests and for comparing algorithms. ``None`` (default) chooses.

    Attributes:
        factor (Factor): the current factorisation; :attr:`method` is its name.

    Raises:
        TypeError: if the covariance and the constraint are not both float32 or both float64 (half precision is
            computed in float32 by :class:`~hardeq.ConstrainedNormal`).
        NotPSDError: if :math:`S` is numerically singular (rows of ``A`` dependent under :math:`\Sigma`), or the
            scales are not finite and positive.
    """

    def __init__(self, covariance: "Covariance", constraint: "EqualityConstraint", *, static: bool = False,
                 method: str | None = None) -> None:
        if covariance.event_size != constraint.event_size:
            raise ValueError(
                f"covariance has event size {covariance.event_size} but the constraint acts on vectors of size "
                f"{constraint.event_size}."
            )
        if constraint.dtype not in (torch.float32, torch.float64) or covariance.dtype != constraint.dtype:
            raise TypeError(
                f"the covariance ({covariance.dtype}) and the constraint ({constraint.dtype}) must share dtype float32 "
                "or float64; the conditioner does not factorise in half precision. ConstrainedNormal computes "
                "float16/bfloat16 inputs in float32 for you; here, pass covariance.to(dtype=torch.float32) and "
                "constraint.to(dtype=torch.float32)."
            )
        self.cov = covariance
        self.constraint = constraint
        self.dtype = constraint.dtype
        self.static = static
        self.requires_grad = False
        self.c = covariance.max_abs_sqrt()
        if not static:
            _check_scale(self.c)
        self._check = ResidualCheck(constraint)
        self._candidates = self._plan() if method is None else [self._forced(method)]
        self._wrap_nullspace = method is None and not static
        self.factor = self._next_factor()

    # ================================================================== choosing
    def _plan(self) -> list[Callable[[], Factor | None]]:
        """The factors to try, in order (each returns ``None`` when it does not apply or is not accurate enough)."""
        cov, con, c = self.cov, self.constraint, self.c
        if self.static:
            grouped = GroupedFactor.build(cov, con, c, checked=False)
            if grouped is not None:
                return [lambda: grouped]
            return [lambda: CholeskyFactor(cov, con, c, torch.float64, checked=False)]
        grouped = GroupedFactor.build(cov, con, c)
        if grouped is not None:
            return [lambda: grouped]
        plan: list[Callable[[], Factor | None]] = []
        if self.dtype == torch.float64:
            plan.append(lambda: CholeskyFactor.build(cov, con, c, torch.float64, KAPPA_MAX["float64"]))
        else:
            plan.append(lambda: CholeskyFactor.build(cov, con, c, self.dtype, KAPPA_MAX["working"]))
            plan.append(lambda: CholeskyFactor.build(cov, con, c, torch.float64, KAPPA_MAX["float64"]))
        plan.append(lambda: QRFactor.build(cov, con, c))
        return plan

    def _forced(self, method: str) -> Callable[[], Factor | None]:
        cov, con, c = self.cov, self.constraint, self.c
        builders = {
            "grouped": lambda: GroupedFactor.build(cov, con, c),
            "cholesky": lambda: CholeskyFactor(cov, con, c, self.dtype),
            "cholesky64": lambda: CholeskyFactor(cov, con, c, torch.float64),
            "qr": lambda: QRFactor(cov, con, c),
        }
        if method not in builders:
            raise ValueError(f"method must be one of {sorted(builders)} or None, got {method!r}.")
        return builders[method]

    def _next_factor(self) -> Factor:
        """Build the next applicable factor of the plan (the null-space form around the first one)."""
        while self._candidates:
            factor = self._candidates.pop(0)()
            if factor is not None:
                if self._wrap_nullspace:
                    self._wrap_nullspace = False
                    factor = NullspaceFactor.build(factor) or factor
                return factor
        raise NotPSDError(
            f"no factorisation of A Sigma A^T meets A z = k to round-off in {self.dtype} "
            f"(last tried: {getattr(self, 'factor', None)!r}); A Sigma A^T is too ill-conditioned for this dtype. "
            "Use float64, or rescale/remove nearly dependent rows of A."
        )

    @property
    def method(self) -> str:
        """Name of the current factor: ``"grouped"``, ``"cholesky"``, ``"cholesky64"``, ``"qr"`` or ``"nullspace"``."""
        return self.factor.name

    # ================================================================== conditioning
    def condition(self, z_hat: Tensor) -> Tensor:
        r""":math:`z = \hat z + K(k - A\hat z)`, refined until every row passes the check; ``(*sample, *batch, n)``.
        Differentiable."""
        return self._refined(self.factor.step(z_hat))

    def _refined(self, z: Tensor) -> Tensor:
        if self.static:
            for _ in range(STATIC_REFINEMENT_STEPS):
                z = self.factor.refine(z)
            return z
        while True:
            for _ in range(MAX_REFINEMENT_STEPS):
                bad = self._check.failing(z, self.method)
                if bad is None:
                    return z
                z = torch.where(bad.unsqueeze(-1), self.factor.refine(z), z)
            bad = self._check.failing(z, self.method)
            if bad is None:
                return z
            if not self._candidates:
                res = self.constraint.residual(z).abs().amax()
                raise NotPSDError(
                    f"the conditioned vector misses A z = k by {res.item():.3e} after {MAX_REFINEMENT_STEPS} "
                    f"refinement steps (method {self.method!r}, dtype {z.dtype}); A Sigma A^T is too ill-conditioned "
                    "for this dtype. Use float64, or rescale/remove nearly dependent rows of A."
                )
            self.factor = self._next_factor()

    @torch.no_grad()
    def sample(self, loc: Tensor, sample_shape: torch.Size | tuple = (), noise: Tensor | None = None,
               generator: torch.Generator | None = None) -> Tensor:
        r"""Exact conditional samples ``condition(loc + F eps)`` without gradient, on one ``(*sample, *batch, n)``
        buffer. ``noise`` (shape ``(*sample_shape, *batch, noise_size)``) defaults to fresh ``randn``."""
        batch = torch.broadcast_shapes(loc.shape[:-1], self.cov.batch_shape, self.constraint.batch_shape)
        if noise is None:
            shape = torch.Size(sample_shape) + batch + (self.cov.noise_size,)
            noise = torch.randn(shape, dtype=loc.dtype, device=loc.device, generator=generator)
            z = self.cov.reparameterize_(noise, loc)
        else:
            z = loc + self.cov.sqrt_matvec(noise)
        if self.static or not z.is_contiguous():
            return self.condition(z)
        return self._refined(self.factor.step_(z))

    # ================================================================== delegated to the factor
    def gain_matvec(self, residual: Tensor) -> Tensor:
        r""":math:`Kr = \Sigma A^\top S^{-1}r` for ``r`` of shape ``(*sample, *batch, a)``."""
        return self.factor.gain(residual)

    def whiten(self, residual: Tensor) -> Tensor:
        r""":math:`L^{-1}r` with :math:`LL^\top = S`."""
        return self.factor.whiten(residual)

    def inv_quad(self, residual: Tensor) -> Tensor:
        r""":math:`r^\top S^{-1}r`, shape ``(*sample, *batch)``."""
        return self.factor.inv_quad(residual)

    def logdet(self) -> Tensor:
        r""":math:`\log\det S`, shape ``(*batch)``."""
        return self.factor.logdet()

    def plane_logdet(self) -> Tensor:
        r""":math:`\log\det\Sigma - \log\det S + \log\det(AA^\top)`, shape ``(*batch)`` (the density's log-volume
        term on the plane)."""
        return self.factor.plane_logdet()

    def variance(self) -> Tensor:
        r"""Conditional marginal variances, ``(*batch, n)``."""
        return self.factor.variance()

    def covariance_matrix(self) -> Tensor:
        r"""Dense conditional covariance :math:`\Sigma - KA\Sigma`, ``(*batch, n, n)``."""
        return self.factor.covariance_matrix()

    def gain_factor(self) -> Tensor:
        r""":math:`G` with :math:`GG^\top = \Sigma A^\top S^{-1}A\Sigma`, ``(*batch, n, a)``."""
        return self.factor.gain_factor()

    def trace_correction(self, other: "Covariance") -> Tensor:
        r""":math:`\mathrm{tr}(G^\top\Sigma_p^{-1}G)`, shape ``(*batch)``."""
        return self.factor.trace_correction(other)

    def __repr__(self) -> str:
        return f"Conditioner(method={self.method!r}, static={self.static}, {self.factor!r})"


def _check_scale(c: Tensor) -> None:
    if not bool((torch.isfinite(c) & (c > 0)).all()):
        raise NotPSDError(
            f"the covariance's scales must be finite and not all zero; got a largest entry in "
            f"[{c.min().item():.3e}, {c.max().item():.3e}]."
        )
