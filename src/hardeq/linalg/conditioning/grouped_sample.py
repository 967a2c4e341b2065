r"""The one-node reparameterised sample of a diagonal covariance under a constraint whose Gram matrix is diagonal
(:func:`grouped_rsample`, :class:`_GroupedSample`), and the operations it needs (:class:`GroupedOps`).

The closed forms are those of :mod:`.grouped` (whose module docstring derives them): with :math:`v = \sigma^2`,
:math:`s = (A\circ A)v`, the Matheron step is :math:`z = \hat z + v\odot A^\top((k - A\hat z)/s)`, O(n) for a
:class:`~hardeq.SumConstraint`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..._utils import is_tracing
from ...constraints import pairs  # (the module hardeq.constraints.pairs)
from ...constraints.base import _grouped
from ..covariance import DiagonalCovariance
from ...constraints._cache import host_reads_allowed
from .grouped_exact import exact_sum_rsample
from .residual import ResidualCheck, check_rtol

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["GroupedOps", "grouped_rsample"]

def _generic_diagonal(constraint: "EqualityConstraint", cov: "Covariance") -> bool:
    r"""Is the pair a plain :class:`~hardeq.DiagonalCovariance` whose ``"grouped"`` structure is the generic one
    (:math:`w = \sigma^2`, :math:`s = (A\circ A)w`)? A registration for the pair (:func:`~hardeq.register_pair`,
    e.g. one returning ``None`` to turn the O(n) path off) is honoured: the one-node paths are not taken then."""
    if type(cov) is not DiagonalCovariance:
        return False
    return pairs._dispatch("grouped", type(constraint), DiagonalCovariance) is _grouped


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
        if verdict is _DEFERRED:  # no check on the host to ask for it: one refinement step, always (a projection)
            refinement = ops.rmatvec(ops.matvec(z).sub_(k).div_(s))
            z.addcmul_(v, refinement, value=-1.0)
            w_neg = w_neg + refinement
            if ops.pin is not None:
                z = ops.pin(z, k)
        # the first check of .residual, |(Az - k)_i| <= rtol ((|A||z|)_i + |k_i|), as max_i of the left side minus the
        # right <= 0 (NaN fails), screened: max_i |(Az - k)_i| - rtol (|A||z|)_i <= 0 (one read-back) implies it,
        # and the |k| term is added only when the screen fails (then a second read-back). A failing row goes to the
        # general path, which re-evaluates it in float64 and refines.
        if verdict is not _DEFERRED:  # (without host reads the caller checks z in float64 on the device)
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
    ``(*sample, *batch, n)``. Without host reads (:func:`~hardeq.constraints._cache.no_host_reads`:
    ``validate_args=False``) a :class:`~hardeq.SumConstraint` takes :func:`.grouped_exact.exact_sum_rsample` (the
    step in float64 and a repair, exact by construction, nothing to check); for another constraint the step is
    followed by one refinement step, always, and the per-row check runs in float64 on the device
    (:meth:`~.residual.ResidualCheck.defer`): a failing row raises, deferred (``torch._assert_async``; on the CPU at
    once): scales whose squares underflow the dtype (:math:`\sigma^2` subnormal) are then an error, not a detour
    through the normalised general path.

    Cost: one host synchronisation (the verdict; two when its screen fails; none without host reads); forward 6
    products with ``A`` or :math:`A^\top` and 5 elementwise passes over ``n``, backward 2 products and 3 passes (O(n)
    for a :class:`~hardeq.SumConstraint`); for a :class:`~hardeq.SumConstraint` no Python beyond one lookup of its
    per-index operations."""
    if type(cov) is not DiagonalCovariance or eps.requires_grad or eps.shape[-1] != cov.event_size:
        return None
    if is_tracing() or not _generic_diagonal(constraint, cov):
        return None
    if not host_reads_allowed():  # a SumConstraint's sync-free sample: exact by construction, no check to defer
        exact = getattr(constraint, "_exact_sum_ops", None)
        exact_ops = exact() if exact is not None else None
        if exact_ops is not None:
            return exact_sum_rsample(loc, cov.scale, constraint.k, eps, exact_ops)
    own = getattr(constraint, "_grouped_ops", None)  # (a SumConstraint's, laid out once per group index)
    ops = own() if own is not None else None
    if ops is None and (ops := GroupedOps.from_constraint(constraint)) is None:
        return None
    key = (eps.dtype, eps.shape[-1])
    limits = _LIMITS.get(key)
    if limits is None:
        info = torch.finfo(eps.dtype)
        limits = _LIMITS[key] = (check_rtol(eps.dtype, eps.shape[-1]), info.tiny / info.eps)
    verdict: list[bool] = [] if host_reads_allowed() else _DEFERRED
    scale, k = cov.scale, constraint.k
    if _APPLY is None:
        z: Tensor = _GroupedSample.apply(  # type: ignore[no-untyped-call]  # torch: Function.apply is unannotated
            loc, scale, k, eps, ops, limits[0], limits[1], verdict)
    else:  # (not is_tracing(): no torch.func transform is active, the case where Function.apply unwraps)
        u = _unwrap_if_dead
        z = _APPLY(u(loc), u(scale), u(k), u(eps), ops, limits[0], limits[1], verdict)
    if verdict is _DEFERRED:  # the per-row check in float64 on the device, its error deferred
        return ResidualCheck(constraint, cov).defer(z)
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
#: the ``verdict`` of a sample without host reads (inside :func:`~hardeq.constraints._cache.no_host_reads`): the
#: check runs on the device and its error is deferred (``torch._assert_async``), with no fallback to the general path
_DEFERRED: list[bool] = []


#: ``(dtype, n) -> (rtol, s_min)`` of the one-node sample: the check's tolerance (:func:`.residual.check_rtol`) and
#: the smallest Gram diagonal :math:`s_g = \sum_{i\in g} a_i^2\sigma_i^2` used as is, ``tiny / eps`` of the dtype
#: (a smaller one is raised to it: the step then misses the row and the check sends it to the general path, which
#: normalises by the largest scale; a coordinate whose :math:`a_i^2\sigma_i^2` is subnormal then weighs at most
#: ``eps`` of its group, so the precision its weight lost does not show)
_LIMITS: dict[tuple[torch.dtype, int], tuple[float, float]] = {}
