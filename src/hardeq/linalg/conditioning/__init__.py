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

**The conditioner chooses, checks, refines and escalates.** After each Matheron step the coordinates the
constraint alone determines (:meth:`~hardeq.EqualityConstraint.pinned_values`: a row of ``A`` with one nonzero
:math:`a_{ij}` fixes :math:`z_j = k_i / a_{ij}`) are set to that value exactly, whatever the factor, and the per-row
residual check (:mod:`.residual`) marks the vectors with a row :math:`|(Az-k)_i| > \mathrm{rtol}\,(|A||z| + |k|)_i`;
only those get a refinement step :math:`z \leftarrow z + K(k - Az)` (up to :data:`MAX_REFINEMENT_STEPS`; the map is
a projection, so this changes neither the distribution nor, to first order, the gradient). A vector still failing
makes the conditioner move on to the next step of its plan and keep refining with it; after the last one it raises
:class:`~hardeq.NotPSDError` naming the failing row (index, residual, tolerance). Refinement is needed when
:math:`\hat z` is much larger than :math:`z` (an ``ulp(ẑ)`` error) or when :math:`\varepsilon\kappa(S)` is not small.

**The plan is a value.** :attr:`Conditioner.plan` is a tuple of ``(kind, precision, kappa_max)`` steps (strings,
dtypes and floats; no closures), so a conditioner -- and a :class:`~hardeq.ConstrainedNormal` that has factorised --
pickles and ``torch.save``\ s. Escalating builds the next step's factor and makes it the current
:attr:`~Conditioner.factor` (a new value; a factor is never modified after it is built).
:attr:`~Conditioner.requires_grad` is derived from the inputs, not set from outside.

**Static mode** (``static=True``; chosen by :class:`~hardeq.ConstrainedNormal` with ``validate_args=False``, and in
every mode under ``torch.compile``, a ``torch.func`` transform or CUDA-graph capture): no data-dependent branch and
no host read. The factor is chosen by structure only (grouped, else Cholesky in float64 of the equilibrated Gram
matrix; the null-space form when ``2a > n``, in eager mode, its trust asserted on the device), determined
coordinates are pinned without a branch, every vector gets :data:`STATIC_REFINEMENT_STEPS` refinement steps (one for
float32, two for float64), and every row is then checked on the device with its error deferred
(:meth:`.residual.ResidualCheck.defer`). The per-row criterion holds when :math:`\varepsilon_{64}\kappa(\tilde S)`
is small (up to about 1e12 for float32 vectors, 1e10 for float64); beyond, the deferred check raises. A shared dense
``A`` under per-sample diagonal scales gets :class:`~.static_dense.StaticPairsFactor`, the same float64 factor
written as a few whole-batch calls, with its own sampler and log-density (:mod:`.static_dense`).

Cost: factorisation O(batch n a^2 + batch a^3) (GEMM speed; grouped O(n)); each conditioned vector O(n a) (grouped:
O(n); sparse: O(nnz)) plus the check, one more O(n a) product. :meth:`Conditioner.sample` fuses ``loc + F eps`` and the
Matheron step in place when no gradient is needed.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..._utils import is_tracing
from ...errors import NotPSDError
from .cholesky import CholeskyFactor
from .factor import DeferredFactor, Factor
from .grouped import GroupedFactor
from .nullspace import NullspaceFactor, _operator_requires_grad
from .qr import QRFactor
from .fused_static import STATIC_REFINEMENT_STEPS, sample_static_checked
from .residual import CHECK_RTOL_CAP, ResidualCheck, _cause, _check_scale, check_rtol
from .sparse import SparseCholeskyFactor
from .static_dense import StaticPairsFactor

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
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
#: largest pivot-ratio estimate of kappa accepted by the Cholesky factor, by precision of the factor
KAPPA_MAX = {"working": 1e3, "float64": 1e10}
#: refinement steps of :meth:`Conditioner.deviation` for a float32 distribution (one for float64). Each multiplies
#: the error of the first gain by eps kappa; a float32 factor's gain solves in float32, and with ``loc`` a thousand
#: scales off the plane one step left 6e-3 nats where two give float64's value.
DEVIATION_REFINEMENT_STEPS = 2

#: one step of a plan: (kind, precision of the factor or None, largest accepted kappa or None = accept unchecked)
PlanStep = tuple[str, "torch.dtype | None", "float | None"]

#: the factors :class:`Conditioner` can be forced to use (``method=``)
FORCED_METHODS = ("cholesky", "cholesky64", "grouped", "qr")


def default_plan(dtype: torch.dtype, static: bool = False) -> tuple[PlanStep, ...]:
    """The steps a conditioner tries in order (the grouped step, when it applies, is the whole plan)."""
    f64 = torch.float64
    if static:
        return (("grouped", None, None), ("cholesky", f64, None))
    working = (("cholesky", f64, KAPPA_MAX["float64"]),) if dtype == f64 else (
        ("cholesky", dtype, KAPPA_MAX["working"]), ("cholesky", f64, KAPPA_MAX["float64"]))
    return (("grouped", None, None), *working, ("qr", f64, None))


def forced_plan(method: str, dtype: torch.dtype) -> tuple[PlanStep, ...]:
    """The one-step plan of ``method=`` (no escalation, no null-space form)."""
    steps = {"grouped": ("grouped", None, None), "cholesky": ("cholesky", dtype, None),
             "cholesky64": ("cholesky", torch.float64, None), "qr": ("qr", torch.float64, None)}
    if method not in steps:
        raise ValueError(f"method must be one of {sorted(steps)} or None, got {method!r}.")
    return (steps[method],)


def build_factor(step: PlanStep, cov: "Covariance", con: "EqualityConstraint", c: Tensor, *,
                 static: bool = False) -> Factor | None:
    """The factor of one plan step, or ``None`` when it does not apply or is not accurate enough."""
    kind, precision, kappa_max = step
    if kind == "grouped":  # (every grouped pair has a diagonal Gram; asking first skips preparing it for a dense A)
        return GroupedFactor.build(cov, con, c, checked=not static) if con.has_diagonal_gram else None
    if kind == "cholesky":
        assert precision is not None  # (every Cholesky step names its precision)
        # a sparse constraint's factor adds its gain in place, block by block (same factorisation)
        cls = SparseCholeskyFactor if hasattr(con, "rmatvec_add_") else CholeskyFactor
        if kappa_max is None:  # (static: the fused factor of a shared A under per-sample scales, where it applies)
            fused = StaticPairsFactor.build_static(cov, con, c, precision) if static else None
            return fused or cls(cov, con, c, precision, checked=not static)
        return cls.build(cov, con, c, precision, kappa_max)
    if kind == "qr":
        return QRFactor.build(cov, con, c)
    raise ValueError(f"unknown plan step {step!r}.")


def _requires_grad(covariance: "Covariance", constraint: "EqualityConstraint") -> bool:
    """Does any input of the conditioner require grad (covariance tensors, ``k`` or the operator)?"""
    return (any(t.requires_grad for t in covariance.tensors()) or constraint.k.requires_grad
            or _operator_requires_grad(constraint))


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
        plan (tuple): the ``(kind, precision, kappa_max)`` steps, in order; :attr:`stage` indexes the current one.
        requires_grad (bool): whether a covariance tensor, ``k`` or the operator requires grad (derived from the
            inputs at construction).

    Raises:
        TypeError: if the covariance and the constraint are not both float32 or both float64 (half precision is
            computed in float32 by :class:`~hardeq.ConstrainedNormal`).
        ValueError: if the constraint has no rows (``a = 0``: there is nothing to condition on; use
            ``torch.distributions.MultivariateNormal`` for the unconstrained law), or the event sizes differ.
        NotPSDError: if :math:`S` is numerically singular (rows of ``A`` dependent under :math:`\Sigma`), or the
            scales are not finite and positive; when conditioning, if a row cannot be met (the message names the
            row, its residual and tolerance, and says when the covariance is subnormal in its dtype).
    """

    def __init__(self, covariance: "Covariance", constraint: "EqualityConstraint", *, static: bool = False,
                 method: str | None = None) -> None:
        if covariance.event_size != constraint.event_size:
            raise ValueError(
                f"covariance has event size {covariance.event_size} but the constraint acts on vectors of size "
                f"{constraint.event_size}."
            )
        if constraint.num_constraints == 0:
            raise ValueError(
                f"constraint must have at least one row (a >= 1), got a = 0 rows on vectors of size "
                f"{constraint.event_size}: there is nothing to condition on. Use "
                "torch.distributions.MultivariateNormal (or Normal) for the unconstrained law."
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
        self.requires_grad = _requires_grad(covariance, constraint)
        self.c = covariance.max_abs_sqrt()
        if not static:
            _check_scale(self.c)
        self._check = ResidualCheck(constraint, covariance)
        self._normalised_wide: "Covariance | None" = None  # Sigma / c^2 in float64, made on first log_prob
        # determined coordinates, pinned after every step (in static mode without a host read: a remembered
        # verdict, or the mask formed always)
        self._pinned = constraint.pinned_values_static() if static else constraint.pinned_values()
        self.plan: tuple[PlanStep, ...] = default_plan(self.dtype, static) if method is None else forced_plan(
            method, self.dtype)
        self.stage = -1
        # (the null-space form, for the near-square constraints it applies to, 2a > n: in eager mode; a static one
        # marks the batch elements it cannot trust on the device instead of reading a verdict)
        self.factor = self._next_factor(wrap_nullspace=method is None and not (static and is_tracing()))

    # ================================================================== choosing
    def _next_factor(self, wrap_nullspace: bool = False) -> Factor:
        """The factor of the next applicable step of the plan after :attr:`stage` (see :meth:`_factor_from`)."""
        return self._factor_from(self.stage + 1, wrap_nullspace)

    def _factor_from(self, start: int, wrap_nullspace: bool = False) -> Factor:
        """The factor of the first applicable step of the plan from ``start`` on (with ``wrap_nullspace``, the
        null-space form around it where that form applies); sets :attr:`stage` to its step (never back). A grouped
        factor, when it applies, ends the plan."""
        for stage in range(start, len(self.plan)):
            step = self.plan[stage]
            if wrap_nullspace and step[0] == "cholesky":
                # the null-space form needs no factor of S (O(a^2 n), a dozen kernels) but for a KL: the first that
                # applies from here on, made when asked for
                deferred = DeferredFactor(partial(self._factor_from, stage), self.cov, self.constraint, self.c)
                self.stage = stage
                return NullspaceFactor.build(deferred, static=self.static) or deferred.get()
            factor = build_factor(step, self.cov, self.constraint, self.c, static=self.static)
            if factor is None:
                continue
            self.stage = max(self.stage, stage)
            if step[0] == "grouped":
                self.plan, self.stage = (step,), 0
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
    def _pin(self, z: Tensor) -> Tensor:
        """``z`` with the determined coordinates set to their values exactly (a no-op when there are none)."""
        if self._pinned is None:
            return z
        mask, values = self._pinned
        return torch.where(mask, values.to(z.dtype), z)

    def condition(self, z_hat: Tensor) -> Tensor:
        r""":math:`z = \hat z + K(k - A\hat z)`, refined until every row passes the check; ``(*sample, *batch, n)``.
        Differentiable."""
        return self._refined(self._pin(self.factor.step(z_hat)))

    def _refined(self, z: Tensor, in_place: bool = False) -> Tensor:
        """``z`` refined and checked (see :meth:`condition`); ``in_place``: ``z`` is a buffer the caller owns and
        needs no gradient for, which static mode's refinement steps update in place (:meth:`Factor.refine_`)."""
        if self.static:
            for _ in range(STATIC_REFINEMENT_STEPS.get(z.dtype, 1)):
                z = self._pin(self.factor.refine_(z) if in_place else self.factor.refine(z))
            return self._check.defer(z, lambda z: _cause(self.c, z))
        while True:
            for _ in range(MAX_REFINEMENT_STEPS):
                bad = self._check.failing(z, self.method)
                if bad is None:
                    return z
                z = torch.where(bad.unsqueeze(-1), self._pin(self.factor.refine(z)), z)
            bad = self._check.failing(z, self.method)
            if bad is None:
                return z
            if self.stage + 1 >= len(self.plan):
                raise NotPSDError(
                    f"the conditioned vector misses A z = k after {MAX_REFINEMENT_STEPS} refinement steps (method "
                    f"{self.method!r}, dtype {z.dtype}): {self._check.describe(z)}; {_cause(self.c, z)}"
                )
            self.factor = self._next_factor()

    @torch.no_grad()
    def sample(self, loc: Tensor, sample_shape: torch.Size | tuple[int, ...] = (), noise: Tensor | None = None,
               generator: torch.Generator | None = None) -> Tensor:
        r"""Exact conditional samples ``condition(loc + F eps)`` without gradient, on one ``(*sample, *batch, n)``
        buffer. ``noise`` (shape ``(*sample_shape, *batch, noise_size)``) defaults to fresh ``randn``."""
        if self.static and noise is None and self._pinned is None and not is_tracing():
            done_static = sample_static_checked(self.factor, self._check, lambda z: _cause(self.c, z), loc,
                                                torch.Size(sample_shape), generator)
            if done_static is not None:  # (drawn, refined and checked chunk by chunk)
                return done_static
        fused = None if noise is not None or self.static or self._pinned is not None else getattr(
            self.factor, "sample_fused", None)
        done = fused and fused(loc, torch.Size(sample_shape), generator, check_rtol(loc.dtype, loc.shape[-1]))
        if done:  # drawn, stepped and checked chunk by chunk; only a failing row needs the loop below
            return done[0] if done[1] else self._refined(done[0])
        batch = torch.broadcast_shapes(loc.shape[:-1], self.cov.batch_shape, self.constraint.batch_shape)
        if noise is None:
            shape = torch.Size(sample_shape) + batch + (self.cov.noise_size,)
            noise = torch.randn(shape, dtype=loc.dtype, device=loc.device, generator=generator)
            z = self.cov.reparameterize_(noise, loc)
        else:
            z = loc + self.cov.sqrt_matvec(noise)
        if (self.static and is_tracing()) or not z.is_contiguous():
            return self.condition(z)
        return self._refined(self._pin(self.factor.step_(z)), in_place=self.static)

    def deviation(self, value: Tensor, loc: Tensor, loc_residual: Tensor) -> Tensor:
        r""":math:`z - \bar\mu = (z - \mu) - Kr` (``r = k - A\mu``: ``loc_residual``) for ``value`` :math:`= z`
        and ``loc`` :math:`= \mu`, accurate to the rounding of the result even far from the plane; float64,
        ``(*sample, *batch, n)``. Differentiable.

        The gain :math:`Kr` carries the factor's error (:math:`\varepsilon\kappa` relative, e.g. 1e-4 for a
        float32 Cholesky factor), which is not small next to the scale of a coordinate when :math:`\mu` is far from
        the plane; the gains here end with a float64 product (:meth:`~.factor.Factor.gain_wide`). Every correction
        lies in :math:`\mathrm{range}(\Sigma A^\top)`, and the exact deviation is the
        one vector :math:`x = (z - \mu) - \Sigma A^\top y` with :math:`Ax = Az - k`, so
        :data:`DEVIATION_REFINEMENT_STEPS` step(s) :math:`x \leftarrow x - K(Ax - (Az - k))`, with :math:`x`,
        :math:`Ax` and :math:`Az - k` in float64, remove it (for a point of the plane, :math:`Az - k` is round-off).
        Cost: O(n a) per vector and step (O(nnz) for a sparse constraint)."""
        wide = torch.float64
        con = self._check.wide()
        z = value.to(wide)
        target = con.matvec(z) - con.k
        x = (z - loc.to(wide)) - self.factor.gain_wide(loc_residual)
        for _ in range(1 if self.dtype == wide else DEVIATION_REFINEMENT_STEPS):  # float64: eps64 kappa after one
            x = x - self.factor.gain_wide((con.matvec(x) - target).to(self.dtype))
        return x

    def inv_quad_covariance(self, x: Tensor) -> Tensor:
        r""":math:`x^\top\Sigma^{-1}x` (shape ``(*sample, *batch)``, in the working dtype) evaluated in float64 as
        :math:`(x/c)^\top\Sigma'^{-1}(x/c)` with the normalised :math:`\Sigma' = \Sigma / c^2`: variances that
        under- or overflow the dtype (a scale of 1e-20 in float32 has a variance of 1e-40) do not, and a triangular
        solve with a factor whose scales span five decades keeps its accuracy (in float32 it loses
        :math:`\varepsilon_{32}\kappa(L)`, 1e-2 nats). Cost: that of ``inv_quad`` in float64 (O(n) diagonal,
        O(n^2) full, O(n r) low rank), plus a float64 copy of the covariance's tensors."""
        wide = torch.float64
        c = self.c.to(wide)
        if self._normalised_wide is None:  # kept: its own factorisation (e.g. a low-rank capacitance) is done once
            self._normalised_wide = (self.cov if self.cov.dtype == wide else self.cov.to(dtype=wide)).scaled(c)
        return self._normalised_wide.inv_quad(x.to(wide) / c).to(self.dtype)

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
        r"""Conditional marginal variances, ``(*batch, n)``; exactly 0 at the determined coordinates (the factor's
        formula leaves round-off there, whose square root, the standard deviation, is not small: 6e-4 in
        float32)."""
        variance = self.factor.variance()
        if self._pinned is None:
            return variance
        return variance.masked_fill(self._pinned[0], 0.0)

    def covariance_matrix(self) -> Tensor:
        r"""Dense conditional covariance :math:`\Sigma - KA\Sigma`, ``(*batch, n, n)``; the rows and columns of
        the determined coordinates exactly 0."""
        matrix = self.factor.covariance_matrix()
        if self._pinned is None:
            return matrix
        mask = self._pinned[0]
        return matrix.masked_fill(mask.unsqueeze(-1) | mask.unsqueeze(-2), 0.0)

    def gain_factor(self) -> Tensor:
        r""":math:`G` with :math:`GG^\top = \Sigma A^\top S^{-1}A\Sigma`, ``(*batch, n, a)``."""
        return self.factor.gain_factor()

    def trace_correction(self, other: "Covariance") -> Tensor:
        r""":math:`\mathrm{tr}(G^\top\Sigma_p^{-1}G)`, shape ``(*batch)``."""
        return self.factor.trace_correction(other)

    def __repr__(self) -> str:
        return f"Conditioner(method={self.method!r}, static={self.static}, {self.factor!r})"
