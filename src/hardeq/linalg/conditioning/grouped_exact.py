r"""The sync-free one-node sample of a :class:`~hardeq.SumConstraint` under a diagonal covariance
(:func:`exact_sum_rsample`, :class:`_ExactSumSample`), exact per group by construction, with no host read.

The path without host reads (``validate_args=False`` on a GPU profile) cannot branch on a check, so it computes so
that no check is needed: the step in float64, then one repair that always runs.

With :math:`\hat z = \mu + \sigma\odot\varepsilon` and :math:`v = \sigma^2` (both rounded to the working dtype),
the group sums :math:`r = A\hat z` and :math:`s = Av` are taken in float64 (one segment reduction over the two
stacked), :math:`t = (k - r)/s` and :math:`z = \hat z + v\odot A^\top t` too. The repair then puts each group's
float64 residual :math:`e = Az - k` on one member (the last): :math:`z_j \leftarrow z_j - e_{g(j)}`, and the result
is rounded to the working dtype once.

**What is guaranteed.** For a group ``g``, with :math:`u_{64} = 2^{-53}`, ``u`` the unit round-off of the working
dtype and ``c`` the group sum's error in units of :math:`u_{64}` (at most :math:`n_g \le 1024` for a segment
reduction, about :math:`1024 + \log_2 n` for the two-level summation), the rounding to the working dtype adds at
most :math:`u\sum_g|z_i|` to the residual; the repaired float64 residual is at most :math:`(c + 2)u_{64}
(\sum_g|z_i| + |e_g|)` (the group sum and the one subtraction), and :math:`|e_g|`, the float64 step's error, is
:math:`O(c\,u_{64})(\sum_g|\hat z_i| + |k_g|)`. Hence

.. math::
    |(Az - k)_g| \le \big(u + (c + 2)u_{64}\big)\textstyle\sum_g|z_i|
    + O\big((c\,u_{64})^2\big)\big(\sum_g|\hat z_i| + |k_g|\big),

within the per-row tolerance (:math:`10^{-5}\sum_g|z_i|` in float32, :math:`10^{-12}\sum_g|z_i|` in float64)
unless the sample is about :math:`10^{-20}` times smaller than the unconditioned draw :math:`\hat z` (total
cancellation short of exact zeros, which the repair makes exact anyway). A group of one is set to its total
(exact; its gradient is 0 for ``loc`` and ``scale``).
A non-finite result (NaN or infinite inputs, or :math:`\sigma^2` overflowing or underflowing the dtype) raises
:class:`~hardeq.NotPSDError` naming the group, deferred (``torch._assert_async``: at once on the CPU, at the
next synchronisation on a GPU).

**Gradients** (the closed form of :mod:`.grouped_sample`): with :math:`q = A(v\odot g)/s` and :math:`\hat g = g -
A^\top q` (0 at a group of one), :math:`\bar\mu = \hat g`, :math:`\bar\sigma = \hat g\odot(\varepsilon +
2\sigma\odot A^\top t)` and :math:`\bar k = q`; the repair (a rounding correction) is a constant.

Cost, for ``n`` coordinates per vector: forward 2 group sums and 1 gather of float64 vectors, 4 passes over ``n``
(:math:`\hat z`, ``v``, ``z``, the factor of the scale's gradient), 1 scatter of ``a`` values, 1 rounding, and 4
passes over ``a``; backward 1 group sum, 1 gather and 3 passes over ``n``. No host read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..._utils import assert_deferred
from ...errors import NotPSDError
from ..device import fused_kernels

__all__ = ["ExactSumOps", "exact_sum_rsample"]

#: the deferred error of a non-finite sample
NONFINITE_MESSAGE = ("hardeq: a sample of a SumConstraint is not finite (NaN or infinite loc, scale or total, or a "
                     "scale whose square overflows or underflows the dtype); its group cannot meet its total.")


class ExactSumOps:
    r"""What the sync-free sample needs of one group index with ``a`` groups (laid out once per index by
    :class:`~hardeq.SumConstraint`): ``sum``, the group sums along the last dimension (one segment reduction for
    sorted groups of at most :data:`~hardeq.ops.group_sum.SUM_CHUNK` members, else the two-level summation of
    :class:`~hardeq.ops.GroupSum`: in float64 their error is at most about ``1050`` units of round-off of the
    group's absolute sum), the index for the gather, the member of each group that takes the repair (``last``,
    ``(a,)``), the groups of one (``members``, ``groups``: two index lists, or None) and, for a sorted index, its
    group offsets and largest group (``sorted``: the layout of :mod:`.grouped_triton`'s kernels)."""

    __slots__ = ("a", "groups", "index", "last", "members", "sorted", "sum")

    def __init__(self, index: Tensor, a: int, sum: Callable[[Tensor], Tensor], last: Tensor,
                 members: Tensor | None, groups: Tensor | None, *, sorted: tuple[Tensor, int] | None = None) -> None:
        self.index, self.a, self.sum, self.last = index, a, sum, last
        self.members, self.groups = members, groups
        self.sorted = sorted  # a sorted index's offsets (a + 1,) and largest group: the fused kernels' layout

    def gather(self, u: Tensor) -> Tensor:
        r""":math:`A^\top u`, ``(*, a) -> (*, n)``."""
        return u.index_select(-1, self.index)


class _ExactSumSample(torch.autograd.Function):
    """The sample of the module docstring in one node. Inputs ``(loc, scale, k)`` are differentiable; ``eps`` and
    ``ops`` (:class:`ExactSumOps`) are constants. Returns ``z`` of ``eps``'s shape and dtype."""

    @staticmethod
    def forward(ctx: Any, loc: Tensor, scale: Tensor, k: Tensor, eps: Tensor, ops: ExactSumOps) -> Tensor:
        shape, wide = eps.shape, torch.float64
        if scale.shape == shape:  # v and z_hat stacked: one group sum for both
            buf = torch.empty((2,) + shape, dtype=wide, device=eps.device)
            v, z_hat = buf[0], buf[1]
            torch.mul(scale, scale, out=v)  # (rounded to the dtype, held exactly in float64)
            torch.addcmul(loc, scale, eps, out=z_hat)
            sums = ops.sum(buf)
            s, r = sums[0], sums[1]
        else:
            v = torch.mul(scale, scale, out=torch.empty(scale.shape, dtype=wide, device=eps.device))
            z_hat = torch.addcmul(loc, scale, eps, out=torch.empty(shape, dtype=wide, device=eps.device))
            s, r = ops.sum(v), ops.sum(z_hat)
        t = torch.sub(k, r).div_(s)  # (k - A z_hat) / s, float64
        w = ops.gather(t)
        z_wide = torch.addcmul(z_hat, v, w)
        # the repair: each group's float64 residual onto its last member (then the group sums to k to u64)
        residual = torch.sub(ops.sum(z_wide), k)
        z_wide.index_add_(-1, ops.last, residual, alpha=-1.0)
        z = z_wide.to(eps.dtype)
        if ops.members is not None and ops.groups is not None:  # a group of one: its total, exactly
            z.index_copy_(-1, ops.members, k.index_select(-1, ops.groups).expand(shape[:-1] + ops.members.shape))
        _assert_finite(residual, ops)
        ctx.ops, ctx.shapes = ops, (loc.shape, scale.shape, k.shape, k.dtype)
        # the factor of the scale's gradient, eps + 2 scale A^T t, in the working dtype
        h = torch.addcmul(eps, scale, w, value=2.0, out=torch.empty_like(eps)) if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(v, s, h)
        return z

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: a second derivative must raise, not be silently wrong
            return _once_backward(ctx, g)
        v, s, h = ctx.saved_tensors
        ops: ExactSumOps = ctx.ops
        loc_shape, scale_shape, k_shape, k_dtype = ctx.shapes
        need_loc, need_scale, need_k = ctx.needs_input_grad[:3]
        q = ops.sum(torch.mul(v, g)).div_(s)  # A (v g) / s, float64
        g_loc = g_scale = g_k = None
        if need_loc or need_scale:
            g_hat = torch.sub(g, ops.gather(q), out=torch.empty(g.shape, dtype=g.dtype, device=g.device))
            if ops.members is not None:
                g_hat.index_fill_(-1, ops.members, 0.0)
            if need_scale:
                g_scale = _sum_to(g_hat * h, scale_shape)
            if need_loc:
                g_loc = _sum_to(g_hat, loc_shape)
        if need_k:
            g_k = _sum_to(q.to(k_dtype), k_shape)
        return g_loc, g_scale, g_k, None, None


@once_differentiable
def _once_backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
    return _ExactSumSample.backward(ctx, g)


def _sum_to(x: Tensor, shape: torch.Size) -> Tensor:
    return x if x.shape == shape else x.sum_to_size(shape)


def _assert_finite(residual: Tensor, ops: ExactSumOps) -> None:
    """Deferred: every group's residual is finite (a NaN or an infinity anywhere in a group makes it so). On the
    CPU the failure is raised at once, as :class:`~hardeq.NotPSDError` naming the first failing group."""
    finite = torch.linalg.vector_norm(residual, float("inf")) < float("inf")  # (NaN propagates: fails too)

    def named() -> NotPSDError:
        bad = (~torch.isfinite(residual)).reshape(-1, residual.shape[-1]).any(0).nonzero()
        return NotPSDError(f"{NONFINITE_MESSAGE} First such group: {int(bad[0])} of {ops.a}.")

    assert_deferred(finite, NONFINITE_MESSAGE, named)


def exact_sum_rsample(loc: Tensor, scale: Tensor, k: Tensor, eps: Tensor, ops: ExactSumOps) -> Tensor:
    """The sample of the module docstring, ``(*sample, *batch, n)`` (``eps``'s shape), differentiable once in
    ``loc``, ``scale`` and ``k``. No host read. Where Triton runs (a GPU; :func:`~hardeq.linalg.device.fused_kernels`)
    and the index is sorted, the same arithmetic in two fused kernels (:mod:`.grouped_triton`)."""
    if ops.sorted is not None and fused_kernels(eps.device):
        from .grouped_triton import fused_sum_rsample

        fused = fused_sum_rsample(loc, scale, k, eps, *ops.sorted, NONFINITE_MESSAGE)
        if fused is not None:
            return fused
    out: Tensor = _ExactSumSample.apply(loc, scale, k, eps, ops)  # type: ignore[no-untyped-call]  # torch: unannotated
    return out
