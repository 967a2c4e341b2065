r"""Grouped closed form: the constraint's Gram matrix is diagonal, with an O(n) cross covariance.

The pair registry (:func:`hardeq.constraints.pairs.grouped_structure`) says when this applies: :math:`\Sigma A^\top
= \mathrm{diag}(w)A^\top` for a vector ``w`` and :math:`S = A\,\mathrm{diag}(w)A^\top = \mathrm{diag}(s)`. Both hold
when every column of ``A`` has at most one nonzero (:math:`A_{g(i), i} = a_i`, any value or sign; a coordinate in no
row has :math:`a_i = 0`) and (generic registration) :math:`\Sigma = \mathrm{diag}(\sigma^2)`, with
:math:`w = \sigma^2` and :math:`s_g = \sum_{i \in g} a_i^2\sigma_i^2`; or (registered for
:class:`~hardeq.BlockDiagonalCovariance` and a :class:`~hardeq.SumConstraint`) when every block of :math:`\Sigma`
lies inside one group, with :math:`w_i = (\Sigma\mathbf 1_{g(i)})_i`. (In general: :math:`\Sigma` couples no two
coordinates of different rows of ``A``, the contract of a ``"grouped"`` registration.) Then

.. math::
    Kr = w \odot A^\top(r / s), \qquad
    \bar\Sigma_{ii} = \Sigma_{ii} - w_i^2 a_i^2 / s_{g(i)} = \Sigma_{ii} - \big(w_i (A^\top s^{-1/2})_i\big)^2,
    \qquad \log\det S = \textstyle\sum_g \log s_g,

since :math:`(A^\top s^{-1/2})_i = a_i / \sqrt{s_{g(i)}}` when column ``i`` has one nonzero (0 for a coordinate in
no row, which keeps :math:`\Sigma_{ii}`). Every operation is a product with :math:`A` or :math:`A^\top` and an
elementwise one: O(n) per vector for a :class:`~hardeq.SumConstraint`, O(nnz) for a sparse one. Coordinates the
constraint alone determines (:meth:`~hardeq.EqualityConstraint.pinned_values`, e.g. a group of one) are set to
their value exactly.

**The differentiable step under a diagonal covariance** (:class:`_GroupedStep`) is one autograd node with the
closed-form backward, instead of the dozen nodes of the step written out (each a kernel of a few microseconds on
vectors of 1e4 entries, the size of a batch of graphs). With :math:`v = \sigma^2/c^2`, :math:`s = (A\circ A)v`,
:math:`u = (k - A\hat z)/s` and :math:`z = \hat z + v\odot A^\top u`, an upstream gradient :math:`g` gives, with
:math:`q = A(v\odot g)/s`,

.. math::
    \bar{\hat z} = g - A^\top q, \qquad \bar k = q, \qquad
    \bar v = g\odot A^\top u - (A\circ A)^\top(q\odot u), \qquad \bar\sigma = 2\sigma/c^2\,\bar v,

where :math:`(A\circ A)^\top y = (A^\top\mathbf 1)\odot A^\top y` (one nonzero per column; :math:`A^\top\mathbf 1
= \mathbf 1` for a sum). ``c`` is a constant (the step does not depend on it). At a determined coordinate the
formula gives 0 to round-off for :math:`\hat z` and :math:`\sigma` and :math:`1/a_i` for its row of ``k``; the
first two are set to 0 exactly. Cost: forward 2 products and 3 elementwise passes, backward 3 products and 4 passes
(O(n) for a sum). Differentiable once (a second derivative raises: use ``Conditioner(..., static=True)``, which
writes the step out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..._utils import is_tracing
from ...constraints import pairs
from ...constraints.base import _grouped
from ..covariance import DiagonalCovariance
from .factor import Factor, check_pivots
from .residual import check_rtol

if TYPE_CHECKING:
    from ...constraints import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["GroupedFactor", "GroupedOps", "grouped_rsample"]


def _generic_diagonal(constraint: "EqualityConstraint", cov: "Covariance") -> bool:
    r"""Is the pair a plain :class:`~hardeq.DiagonalCovariance` whose ``"grouped"`` structure is the generic one
    (:math:`w = \sigma^2`, :math:`s = (A\circ A)w`)? A registration for the pair (:func:`~hardeq.register_pair`,
    e.g. one returning ``None`` to turn the O(n) path off) is honoured: the one-node paths are not taken then."""
    if type(cov) is not DiagonalCovariance:
        return False
    return pairs._dispatch("grouped", type(constraint), DiagonalCovariance) is _grouped


class _GroupedStep(torch.autograd.Function):
    r"""The Matheron step :math:`z = \hat z + v\odot A^\top((k - A\hat z)/s)` of a diagonal covariance, with the
    closed-form backward of the module docstring; inputs ``(z_hat, scale, k)`` are differentiable, the factor's
    normalised ``v`` and ``s`` (detached), ``c``, the constraint, :math:`A^\top\mathbf 1` (None for a sum) and the
    determined coordinates (``(mask, values)`` or None) are constants. ``(*sample, *batch, n)``."""

    @staticmethod
    def forward(ctx: Any, z_hat: Tensor, scale: Tensor, k: Tensor, v: Tensor, s: Tensor, c: Tensor,
                con: EqualityConstraint, col: Tensor | None, pinned: tuple[Tensor, Tensor] | None) -> Tensor:
        u = (k - con.matvec(z_hat)) / s
        Atu = con.rmatvec(u)
        z = torch.addcmul(z_hat, v, Atu)
        if pinned is not None:
            z = torch.where(pinned[0], pinned[1], z)
        ctx.con, ctx.col, ctx.mask = con, col, None if pinned is None else pinned[0]
        ctx.shapes = (z_hat.shape, scale.shape, k.shape)
        ctx.save_for_backward(scale, v, s, c, u, Atu)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        scale, v, s, c, u, Atu = ctx.saved_tensors
        con, col, mask = ctx.con, ctx.col, ctx.mask
        z_shape, scale_shape, k_shape = ctx.shapes
        need_z, need_scale, need_k = ctx.needs_input_grad[:3]
        q = con.matvec(v * g) / s
        g_z = g_scale = g_k = None
        if need_z:
            g_z = g - con.rmatvec(q)
            if mask is not None:
                g_z = g_z.masked_fill(mask, 0.0)
            g_z = g_z.sum_to_size(z_shape)
        if need_scale:
            back = con.rmatvec(q * u)
            g_v = g * Atu - (back if col is None else col * back)
            if mask is not None:
                g_v = g_v.masked_fill(mask, 0.0)
            g_scale = (g_v.sum_to_size(scale_shape) * scale).mul_(2 / c.square())
        if need_k:
            g_k = q.sum_to_size(k_shape)
        return g_z, g_scale, g_k, None, None, None, None, None, None


class GroupedOps:
    r"""The operations of the one-node sample (:class:`_GroupedSample`) for one constraint: :math:`Ax`
    (``matvec``), :math:`A^\top u` (``rmatvec``), :math:`(A\circ A)v` (``gram``, the Gram diagonal),
    :math:`|A|x` (``abs_matvec``), and the determined coordinates: ``pin(z, k)`` returns ``z`` with them set to
    their value (in place where it can) and ``unpin(g)`` zeroes a gradient there (in place); both None when nothing
    is determined.

    :meth:`from_constraint` takes them from the constraint's methods (any constraint whose columns have at most one
    nonzero); a :class:`~hardeq.SumConstraint` supplies its own, once per group index (segment sums called
    directly, the groups of one as two short index lists)."""

    __slots__ = ("matvec", "rmatvec", "gram", "abs_matvec", "pin", "unpin")

    def __init__(self, matvec: Callable[[Tensor], Tensor], rmatvec: Callable[[Tensor], Tensor],
                 gram: Callable[[Tensor], Tensor], abs_matvec: Callable[[Tensor], Tensor],
                 pin: Callable[[Tensor, Tensor], Tensor] | None = None,
                 unpin: Callable[[Tensor], Tensor] | None = None) -> None:
        self.matvec, self.rmatvec, self.gram, self.abs_matvec = matvec, rmatvec, gram, abs_matvec
        self.pin, self.unpin = pin, unpin

    @classmethod
    def from_constraint(cls, constraint: "EqualityConstraint") -> "GroupedOps | None":
        """The constraint's own methods, with its :meth:`~hardeq.EqualityConstraint.pinned_values` (their values
        fixed now); None when its Gram matrix under a diagonal covariance is not diagonal."""
        if not constraint.has_diagonal_gram:
            return None

        def gram(v: Tensor) -> Tensor:
            s = constraint.diagonal_gram(v)
            assert s is not None  # (has_diagonal_gram)
            return s

        with torch.no_grad():
            pinned = constraint.pinned_values()
        if pinned is None:
            return cls(constraint.matvec, constraint.rmatvec, gram, constraint.abs_matvec)
        mask, values = pinned

        def pin(z: Tensor, k: Tensor) -> Tensor:
            return torch.where(mask, values, z)

        def unpin(g: Tensor) -> Tensor:
            return g.masked_fill_(mask, 0.0)

        return cls(constraint.matvec, constraint.rmatvec, gram, constraint.abs_matvec, pin, unpin)


class _GroupedSample(torch.autograd.Function):
    r"""The whole reparameterised sample of a diagonal covariance in one node: :math:`\hat z = \mu + \sigma\odot
    \varepsilon`, the Matheron step, the determined coordinates and the per-row check.

    With :math:`v = \sigma^2`, :math:`s = (A\circ A)v`, :math:`u = (k - A\hat z)/s` and :math:`w = A^\top u`:
    :math:`z = \hat z + v\odot w`. For an upstream gradient :math:`g`, with :math:`q = A(v\odot g)/s` and
    :math:`\hat g = g - A^\top q` (0 at a determined coordinate),

    .. math::
        \bar\mu = \hat g, \qquad \bar\sigma = \hat g\odot(\varepsilon + 2\sigma\odot w), \qquad \bar k = q,

    since :math:`\bar v = g\odot w - (A\circ A)^\top(q\odot u)` is :math:`w\odot\hat g` when every column has
    at most one nonzero (:math:`a_i u_{g(i)}(g_i - a_i q_{g(i)})`); so the backward needs no
    :math:`(A\circ A)^\top` product, and :math:`\varepsilon + 2\sigma\odot w` is formed in the forward (when
    ``scale`` needs a gradient). No normalisation pass: :math:`\sigma^2` is used as is, and an :math:`s_g` below
    ``s_min`` (:math:`\sigma^2` near underflow, where the weights lose their precision) is raised to it, so that the
    step misses the row and the check sends the call to the general path (an overflow gives a NaN, which fails too).

    Cost, for ``n`` coordinates per vector: forward 3 products with ``A`` and 1 with :math:`A^\top` (plus the check's
    2 with ``A``), 5 elementwise passes over ``n`` and about 10 over ``a``; backward 1 product with each and 3 passes
    over ``n`` (O(n) for a :class:`~hardeq.SumConstraint`: segment sums and a gather).

    Inputs ``(loc, scale, k)`` are differentiable; ``eps`` (the noise), ``ops`` (:class:`GroupedOps`), ``rtol``,
    ``s_min`` are constants. Returns ``z``; whether every row of every vector passes the check of :mod:`.residual`
    with ``rtol`` (no NaN) is appended to the list ``verdict`` as a Python bool (one read-back of the screened check,
    a second when the screen fails); the caller takes the general path when not. Differentiable once: under
    ``create_graph=True`` the backward is wrapped by ``once_differentiable`` (a second derivative raises)."""

    @staticmethod
    def forward(ctx: Any, loc: Tensor, scale: Tensor, k: Tensor, eps: Tensor, ops: GroupedOps, rtol: float,
                s_min: float, verdict: list[bool]) -> Tensor:
        z_hat = torch.addcmul(loc, scale, eps)
        v = scale * scale
        s = ops.gram(v).clamp_min_(s_min)
        # -w = A^T((A z_hat - k) / s), the a-sized vectors in place (z_hat has the full shape, eps's: so has A z_hat)
        w_neg = ops.rmatvec(ops.matvec(z_hat).sub_(k).div_(s))
        z = z_hat.addcmul_(v, w_neg, value=-1.0)
        if ops.pin is not None:
            z = ops.pin(z, k)
        # the first check of .residual, |(Az - k)_i| <= rtol ((|A||z|)_i + |k_i|), as max_i of the left side minus the
        # right <= 0 (NaN fails), screened: max_i |(Az - k)_i| - rtol (|A||z|)_i <= 0 (one read-back) implies it,
        # and the |k| term is added only when the screen fails (then a second read-back). A failing row goes to the
        # general path, which re-evaluates it in float64 and refines.
        excess = ops.matvec(z).sub_(k).abs_().sub_(ops.abs_matvec(z.abs()), alpha=rtol)
        passed = excess.amax().item() <= 0.0
        verdict.append(passed or excess.sub_(k.abs(), alpha=rtol).amax().item() <= 0.0)
        # the backward's constants, kept on ctx (intermediates: nothing the caller can modify in place); the
        # factor of the scale's gradient, eps + 2 scale w, formed here when it is needed
        ctx.ops, ctx.v, ctx.s = ops, v, s
        ctx.h = torch.addcmul(eps, scale, w_neg, value=-2.0) if ctx.needs_input_grad[1] else None
        ctx.shapes = (loc.shape, scale.shape, k.shape)
        return z

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: a second derivative must raise, not be silently wrong
            return _once_backward(ctx, g)
        ops: GroupedOps = ctx.ops
        loc_shape, scale_shape, k_shape = ctx.shapes
        need_loc, need_scale, need_k = ctx.needs_input_grad[:3]
        q = ops.matvec(ctx.v * g).div_(ctx.s)  # (A (v g)) / s
        g_loc = g_scale = g_k = None
        if need_loc or need_scale:
            g_hat = torch.sub(g, ops.rmatvec(q))
            if ops.unpin is not None:
                g_hat = ops.unpin(g_hat)
            if need_scale:  # g_hat (eps + 2 scale w)
                g_scale = _sum_to(g_hat * ctx.h, scale_shape)
            if need_loc:
                g_loc = _sum_to(g_hat, loc_shape)
        if need_k:
            g_k = _sum_to(q, k_shape)
        return g_loc, g_scale, g_k, None, None, None, None, None


@once_differentiable
def _once_backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
    # (once_differentiable runs this with grad mode off: the backward then computes instead of coming back here)
    return _GroupedSample.backward(ctx, g)


def _sum_to(x: Tensor, shape: torch.Size) -> Tensor:
    """``x`` summed over the dimensions it was broadcast along to ``shape``."""
    return x if x.shape == shape else x.sum_to_size(shape)


def grouped_rsample(cov: "Covariance", constraint: "EqualityConstraint", loc: Tensor, eps: Tensor) -> Tensor | None:
    r"""The pathwise sample :math:`z = \hat z + K(k - A\hat z)`, :math:`\hat z = \mu + \sigma\odot\varepsilon`, of a
    diagonal covariance and a constraint with a diagonal Gram matrix, as one autograd node (:class:`_GroupedSample`),
    without building a :class:`~hardeq.linalg.conditioning.Conditioner`; ``None`` when that does not apply (another
    structure, tracing, a noise that requires grad) or when the result needs more than the one step (a row fails the
    check, a NaN, a Gram pivot at or near 0): the caller then takes the general path, which refines, escalates or
    raises exactly as before. Same value as the general path's (up to the rounding of the check),
    ``(*sample, *batch, n)``.

    Cost: one host synchronisation (the verdict; two when its screen fails); forward 6 products with ``A`` or
    :math:`A^\top` and 5 elementwise passes over ``n``, backward 2 products and 3 passes (O(n) for a
    :class:`~hardeq.SumConstraint`); for a :class:`~hardeq.SumConstraint` no Python beyond one lookup of its
    per-index operations."""
    if type(cov) is not DiagonalCovariance or eps.requires_grad or eps.shape[-1] != cov.event_size:
        return None
    if is_tracing() or not _generic_diagonal(constraint, cov):
        return None
    own = getattr(constraint, "_grouped_ops", None)  # (a SumConstraint's, laid out once per group index)
    ops = own() if own is not None else None
    if ops is None and (ops := GroupedOps.from_constraint(constraint)) is None:
        return None
    key = (eps.dtype, eps.shape[-1])
    limits = _LIMITS.get(key)
    if limits is None:
        info = torch.finfo(eps.dtype)
        limits = _LIMITS[key] = (check_rtol(eps.dtype, eps.shape[-1]), info.tiny / info.eps)
    verdict: list[bool] = []
    scale, k = cov.scale, constraint.k
    if _APPLY is None:
        z: Tensor = _GroupedSample.apply(  # type: ignore[no-untyped-call]  # torch: Function.apply is unannotated
            loc, scale, k, eps, ops, limits[0], limits[1], verdict)
    else:  # (not is_tracing(): no torch.func transform is active, the case where Function.apply unwraps)
        u = _unwrap_if_dead
        z = _APPLY(u(loc), u(scale), u(k), u(eps), ops, limits[0], limits[1], verdict)
    return z if verdict[0] else None


def _c_apply() -> tuple[Callable[..., Tensor] | None, Callable[[Tensor], Tensor]]:
    r"""``_GroupedSample.apply`` without the Python layer of ``torch.autograd.Function.apply`` (a test for
    ``setup_context`` and a generic pass over the arguments: a few microseconds per call, at the size of a batch of
    graphs a percent of the step): the C++ ``apply``, with the dead ``torch.func`` wrappers among the arguments
    unwrapped as that layer does outside a transform. ``(None, identity)`` when this torch lacks either (the public
    ``apply`` is used then)."""
    try:
        from torch._C._functorch import unwrap_if_dead

        apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _GroupedSample)
    except (ImportError, AttributeError, KeyError, TypeError):
        return None, lambda t: t
    return cast("Callable[..., Tensor]", apply), cast("Callable[[Tensor], Tensor]", unwrap_if_dead)


_APPLY, _unwrap_if_dead = _c_apply()


#: ``(dtype, n) -> (rtol, s_min)`` of the one-node sample: the check's tolerance (:func:`.residual.check_rtol`) and
#: the smallest Gram diagonal :math:`s_g = \sum_{i\in g} a_i^2\sigma_i^2` used as is, ``tiny / eps`` of the dtype
#: (a smaller one is raised to it: the step then misses the row and the check sends it to the general path, which
#: normalises by the largest scale; a coordinate whose :math:`a_i^2\sigma_i^2` is subnormal then weighs at most
#: ``eps`` of its group, so the precision its weight lost does not show)
_LIMITS: dict[tuple[torch.dtype, int], tuple[float, float]] = {}


class GroupedFactor(Factor):
    r"""The O(n) factor of a diagonal Gram matrix (see the module docstring).

    Attributes:
        v: the normalised weights :math:`w / c^2` (:math:`\Sigma'A^\top = \mathrm{diag}(v)A^\top`; the
            normalised variances :math:`\sigma^2 / c^2` for a diagonal covariance), ``(*batch, n)``.
        s: normalised diagonal of :math:`S' = S / c^2`, ``(*batch, a)``.
    """

    name = "grouped"
    nullspace_pays = False

    def __init__(self, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor, v: Tensor, s: Tensor,
                 *, checked: bool = True) -> None:
        super().__init__(cov, constraint, c)
        self.v, self.s = v, s
        if checked:
            check_pivots(s, 0.0)
        self._pinned = constraint.pinned_values() if checked else None
        # the one-node step (_GroupedStep) needs v = (scale / c)^2 of a plain diagonal covariance; not when tracing
        self._fused = checked and _generic_diagonal(constraint, cov)
        self._col: Tensor | None = None

    @classmethod
    def build(cls, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor, *,
              checked: bool = True) -> "GroupedFactor | None":
        """The factor, or ``None`` when the pair has no grouped structure (see the module docstring)."""
        if _generic_diagonal(constraint, cov) and constraint.has_diagonal_gram:
            # the generic registration's (v, s), without building the scaled covariance: v = (scale / c)^2
            v = (cast(DiagonalCovariance, cov).scale / c).square()  # (_generic_diagonal: exactly that type)
            s = constraint.diagonal_gram(v)
            return None if s is None else cls(cov, constraint, c, v, s, checked=checked)
        grouped = pairs.grouped_structure(constraint, cov.scaled(c))
        if grouped is None:
            return None
        return cls(cov, constraint, c, grouped.weight, grouped.gram_diagonal, checked=checked)

    def gain(self, residual: Tensor) -> Tensor:
        return self.v * self.constraint.rmatvec(residual / self.s)

    def _pin(self, z: Tensor) -> Tensor:
        if self._pinned is None:
            return z
        mask, values = self._pinned
        return torch.where(mask, values, z)

    def step(self, z: Tensor) -> Tensor:
        con = self.constraint
        if self._fused and torch.is_grad_enabled() and not is_tracing():
            scale = cast(DiagonalCovariance, self.cov).scale  # (_fused: a plain diagonal covariance)
            if z.requires_grad or scale.requires_grad or con.k.requires_grad:
                out: Tensor = _GroupedStep.apply(  # type: ignore[no-untyped-call]  # torch: Function.apply unannotated
                    z, scale, con.k, self.v.detach(), self.s.detach(), self.c, con, self._column_weights(),
                    self._pinned)
                return out
        return self._pin(torch.addcmul(z, self.v, con.rmatvec((con.k - con.matvec(z)) / self.s)))

    def _column_weights(self) -> Tensor | None:
        r""":math:`A^\top\mathbf 1` (the one coefficient of each column), ``(n,)``; None for a sum (all ones)."""
        con = self.constraint
        if con.group_index is not None:
            return None
        if self._col is None:
            with torch.no_grad():
                self._col = con.rmatvec(con.k.new_ones(con.num_constraints))
        return self._col

    def step_(self, z: Tensor) -> Tensor:
        con = self.constraint
        u = (con.k - con.matvec(z)) / self.s
        add = getattr(con, "rmatvec_add_", None)  # z += v A^T u in place, without forming A^T u where it can
        if add is not None and u.shape[:-1] == z.shape[:-1]:
            add(z, u, self.v)
        else:
            z.addcmul_(self.v, con.rmatvec(u))
        if self._pinned is not None:
            mask, values = self._pinned
            z = torch.where(mask, values, z)
        return z

    def whiten(self, residual: Tensor) -> Tensor:
        return residual / self.s.sqrt() / self.c

    def logdet(self) -> Tensor:
        return self.s.log().sum(-1) + 2 * self.s.shape[-1] * self.c.squeeze(-1).log()

    def _weight(self) -> Tensor:
        r""":math:`a_i^2 / s_{g(i)} = (A^\top s^{-1/2})_i^2` (one nonzero per column), 0 for a coordinate in no row."""
        return self.constraint.rmatvec(self.s.rsqrt()).square()

    def _diagonal(self) -> Tensor:
        r""":math:`\mathrm{diag}\,\Sigma' = \mathrm{diag}\,\Sigma / c^2` (``v`` itself for a diagonal covariance)."""
        return self.v if self.cov.is_diagonal else self.cov.scaled(self.c).diagonal()

    def variance(self) -> Tensor:
        v = self.v  # Sigma'_ii - w'_i^2 a_i^2 / s'_g(i), in normalised quantities (no overflow)
        return ((self._diagonal() - v.square() * self._weight()) * self.c.square()).clamp_min(0)

    def gain_factor(self) -> Tensor:
        # G = Sigma A^T S^-1/2 = c Sigma' A^T / sqrt(s')
        cross = self.constraint.cross_covariance(self.cov.scaled(self.c))  # (*batch, n, a)
        return cross / self.s.sqrt().unsqueeze(-2) * self.c.unsqueeze(-1)

    def trace_correction(self, other: "Covariance") -> Tensor:
        if other.is_diagonal:
            # sum_i w_i^2 a_i^2 / (Sigma_p,ii s_g(i)) = sum_i (w_i / Sigma_p,ii) (w'_i a_i^2 / s'_g(i)): scale-free
            ratio = self.v * self._weight()
            return (self.v * self.c.square() / other.variance * ratio).sum(-1)
        if pairs.grouped_structure(self.constraint, other) is not None:
            # Sigma_p^{-1} does not couple rows either: G's columns (w_i a_i / sqrt(s_g) on the coordinates of row g)
            # add up to one n-vector without mixing, and tr(G^T Sigma_p^{-1} G) is one inverse quadratic form
            compact = self.v * self.constraint.rmatvec(self.s.rsqrt()) * self.c
            return other.inv_quad(compact)
        return super().trace_correction(other)
