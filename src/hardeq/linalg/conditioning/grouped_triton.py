r"""The sync-free sample of a :class:`~hardeq.SumConstraint` (:mod:`.grouped_exact`) as two fused Triton kernels:
one launch for the forward, one for the backward, where the ATen form takes 13 and 6 (and 3 for its finiteness
assertion). Used on a device where Triton runs (:func:`~hardeq.linalg.device.fused_kernels`: a GPU with ``triton``
installed, as every CUDA build of torch has it), for sorted groups (PyG's ``batch`` vector) of at most
:data:`MAX_GROUP` members; everything else takes the ATen form, which computes the same thing.

**The arithmetic is the ATen form's**, one program per group and vector: :math:`v = \sigma^2` and
:math:`\hat z = \mu + \sigma\odot\varepsilon` rounded to the working dtype and held in float64; the group sums
:math:`s` and :math:`r` in float64 (a tree reduction: its error is at most :math:`\lceil\log_2 n_g\rceil` units of
round-off of the absolute sum, below the segment reduction's :math:`n_g`); :math:`t = (k - r)/s`,
:math:`z = \hat z + vt`; the repair puts the group's float64 residual :math:`e = \sum_g z_i - k` on its last member;
one rounding to the working dtype; a group of one is set to its total. So the guarantee of :mod:`.grouped_exact`
holds as stated there (with the smaller ``c``), and the gradients are its closed form: with :math:`q = \sum_g
v_ig_i/s` and :math:`\hat g = g - q` (0 on a group of one), :math:`\bar\mu = \hat g`, :math:`\bar\sigma = \hat g
\odot(\varepsilon + 2\sigma t)`, :math:`\bar k = q`.

**Non-finite values** (a NaN or an infinity in a group's residual) clear a flag with one atomic in each such group
(a finite group writes nothing to it); the flag is asserted on the device (``torch._assert_async``: deferred to the
next synchronisation on a GPU; at once on a CPU, where :class:`~hardeq.NotPSDError` names the first such group from
the residuals the kernel wrote).

A first launch that fails (Triton cannot compile on the machine: no C compiler for its launcher, say) warns once
and leaves the device to the ATen form.

Each kernel is a ``torch.library.custom_op`` (``hardeq::exact_sum_forward``, ``hardeq::exact_sum_backward``), so a
dispatch mode (:func:`hardeq.testing.count_calls`) sees each launch as the one call it is. Cost: forward one pass
reading ``loc``, ``scale``, ``eps`` and writing ``z`` and the scale's gradient factor; backward one pass reading the
incoming gradient, ``scale`` and that factor, writing the gradients. No host read.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..._utils import assert_deferred
from ...errors import NotPSDError
from ..device import fused_kernels

__all__ = ["MAX_GROUP", "fused_sum_rsample"]

#: the largest group one program sums (the block is the next power of two); larger groups take the ATen form
MAX_GROUP = 4096
_FLOATS = (torch.float32, torch.float64)
#: programs of one launch (one per group and vector): a CUDA grid's first axis
_MAX_PROGRAMS = 2**31 - 1
#: (device type, dtype, block) launched once at least: a later failure there is an error, not a missing toolchain
_LAUNCHED: set[tuple[str, torch.dtype, int]] = set()
#: device types whose first launch failed (Triton cannot compile there): the ATen form from then on, with a warning
_UNUSABLE: set[str] = set()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The two Triton kernels (compiled by Triton on first launch for each block size and dtype)."""
    import triton
    import triton.language as tl

    @triton.jit
    def forward(loc_ptr, scale_ptr, eps_ptr, k_ptr, offsets_ptr, z_ptr, h_ptr, sums_ptr, flag_ptr,  # type: ignore[no-untyped-def]
                n, a, rows, loc_rows, scale_rows, k_rows, NEED_H: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # (one axis: a CUDA grid's second axis stops at 65,535)
        g, r = pid % a, pid // a
        start, end = tl.load(offsets_ptr + g), tl.load(offsets_ptr + g + 1)
        idx = start + tl.arange(0, BLOCK)
        inside = idx < end
        sigma = tl.load(scale_ptr + (r % scale_rows) * n + idx, mask=inside, other=0.0)
        eps = tl.load(eps_ptr + r * n + idx, mask=inside, other=0.0)
        mu = tl.load(loc_ptr + (r % loc_rows) * n + idx, mask=inside, other=0.0)
        total = tl.load(k_ptr + (r % k_rows) * a + g).to(tl.float64)
        v = (sigma * sigma).to(tl.float64)  # (rounded to the working dtype, held exactly in float64)
        z_hat = (mu + sigma * eps).to(tl.float64)
        s = tl.sum(v, axis=0)
        t = (total - tl.sum(z_hat, axis=0)) / s
        z = z_hat + v * t
        residual = tl.sum(z, axis=0) - total  # (masked members are 0)
        z = tl.where(idx == end - 1, z - residual, z)
        z = tl.where(end - start == 1, total, z)  # a group of one: its total, exactly
        tl.store(z_ptr + r * n + idx, z.to(z_ptr.dtype.element_ty), mask=inside)
        if NEED_H:  # the factor of the scale's gradient, eps + 2 scale t, rounded once
            h = eps.to(tl.float64) + 2.0 * sigma.to(tl.float64) * t
            tl.store(h_ptr + r * n + idx, h.to(h_ptr.dtype.element_ty), mask=inside)
        tl.store(sums_ptr + r * a + g, s)
        tl.store(sums_ptr + rows * a + r * a + g, residual)
        finite = tl.abs(residual) <= 1.7976931348623157e308  # (float64's largest: false for NaN and infinities)
        tl.atomic_min(flag_ptr, finite.to(tl.int32), mask=finite == 0)  # (only a failing group: no contention)

    @triton.jit
    def backward(grad_ptr, scale_ptr, h_ptr, sums_ptr, offsets_ptr, g_loc_ptr, g_scale_ptr, g_k_ptr,  # type: ignore[no-untyped-def]
                 n, a, grad_row_stride, grad_stride, scale_rows, NEED_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        g, r = pid % a, pid // a
        start, end = tl.load(offsets_ptr + g), tl.load(offsets_ptr + g + 1)
        idx = start + tl.arange(0, BLOCK)
        inside = idx < end
        grad = tl.load(grad_ptr + r * grad_row_stride + idx * grad_stride, mask=inside, other=0.0)
        sigma = tl.load(scale_ptr + (r % scale_rows) * n + idx, mask=inside, other=0.0)
        v = (sigma * sigma).to(tl.float64)
        q = tl.sum(v * grad.to(tl.float64), axis=0) / tl.load(sums_ptr + r * a + g)
        g_hat = (grad.to(tl.float64) - q).to(g_loc_ptr.dtype.element_ty)
        g_hat = tl.where(end - start == 1, 0.0, g_hat).to(g_loc_ptr.dtype.element_ty)
        tl.store(g_loc_ptr + r * n + idx, g_hat, mask=inside)
        if NEED_SCALE:
            h = tl.load(h_ptr + r * n + idx, mask=inside, other=0.0)
            tl.store(g_scale_ptr + r * n + idx, g_hat * h, mask=inside)
        tl.store(g_k_ptr + r * a + g, q.to(g_k_ptr.dtype.element_ty))

    return forward, backward


def _block(largest: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for groups of at most ``largest`` members."""
    block = max(16, 1 << (max(1, largest) - 1).bit_length())
    return block, max(1, min(8, block // 256))


@torch.library.custom_op("hardeq::exact_sum_forward", mutates_args=("flag",))
def _forward(loc: Tensor, scale: Tensor, eps: Tensor, k: Tensor, offsets: Tensor, flag: Tensor, largest: int,
             need_h: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(z, h, sums)``: the sample, the scale's gradient factor (empty without ``need_h``), and the group sums of
    ``v`` and the residuals ``(2, rows, a)`` in float64; ``flag`` (``(1,)`` int32, 1 on entry) is cleared where a
    residual is not finite."""
    rows, n = eps.shape
    a = offsets.shape[0] - 1
    z = torch.empty_like(eps)
    h = torch.empty_like(eps) if need_h else eps.new_empty(0)
    sums = torch.empty((2, rows, a), dtype=torch.float64, device=eps.device)
    block, warps = _block(largest)
    _kernels()[0][(a * rows,)](loc, scale, eps, k, offsets, z, h if need_h else z, sums, flag, n, a, rows,
                             loc.shape[0], scale.shape[0], k.shape[0],
                             NEED_H=need_h, BLOCK=block, num_warps=warps, enable_fp_fusion=True)
    return z, h, sums


@torch.library.custom_op("hardeq::exact_sum_backward", mutates_args=())
def _backward(grad: Tensor, scale: Tensor, h: Tensor, sums: Tensor, offsets: Tensor, largest: int,
              k_dtype: torch.dtype, need_scale: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(g_loc, g_scale, g_k)`` per row (``g_scale`` empty without ``need_scale``)."""
    rows, n = grad.shape
    a = offsets.shape[0] - 1
    g_loc = torch.empty((rows, n), dtype=grad.dtype, device=grad.device)  # (grad may be expanded: stride 0)
    g_scale = torch.empty_like(g_loc) if need_scale else grad.new_empty(0)
    g_k = torch.empty((rows, a), dtype=k_dtype, device=grad.device)
    block, warps = _block(largest)
    _kernels()[1][(a * rows,)](grad, scale, h if need_scale else grad, sums, offsets, g_loc,
                             g_scale if need_scale else g_loc, g_k, n, a, grad.stride(0), grad.stride(1),
                             scale.shape[0],
                             NEED_SCALE=need_scale, BLOCK=block, num_warps=warps,
                             enable_fp_fusion=True)
    return g_loc, g_scale, g_k


def _rows(x: Tensor, lead: torch.Size, size: int) -> Tensor | None:
    """``x`` as ``(P, size)`` rows, row ``r`` of the output reading row ``r % P``: ``x``'s leading shape (without
    leading ones) a suffix of the output's ``lead`` (the broadcast of a batch under sample dimensions), contiguous;
    None otherwise."""
    shape = x.shape
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    batch = tuple(shape[:-1])
    if shape[-1] != size or (batch and tuple(lead[len(lead) - len(batch):]) != batch) or len(batch) > len(lead):
        return None
    return x.reshape(-1, size) if x.is_contiguous() else None


class _FusedExactSumSample(torch.autograd.Function):
    """The sample in one node of two kernels: inputs ``(loc, scale, k)`` differentiable (as laid out by
    :func:`fused_sum_rsample`), ``eps`` ``(rows, n)`` and the layout constants."""

    @staticmethod
    def forward(ctx: Any, loc: Tensor, scale: Tensor, k: Tensor, eps: Tensor, offsets: Tensor, largest: int,
                message: str) -> Tensor:
        need_h = bool(ctx.needs_input_grad[1])
        flag = torch.ones(1, dtype=torch.int32, device=eps.device)  # (a fill: a launch of its own, counted)
        z, h, sums = cast("tuple[Tensor, Tensor, Tensor]", _forward(loc, scale, eps, k, offsets, flag, largest, need_h))
        _assert_finite(flag, sums[1], message)
        ctx.save_for_backward(scale, h, sums[0], offsets)
        ctx.largest, ctx.k_dtype = largest, k.dtype
        ctx.shapes = (loc.shape, scale.shape, k.shape)
        return z

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: a second derivative must raise, not be silently wrong
            return _once_backward(ctx, grad)
        scale, h, s, offsets = ctx.saved_tensors
        need_loc, need_scale, need_k = ctx.needs_input_grad[:3]
        g_loc, g_scale, g_k = cast("tuple[Tensor, Tensor, Tensor]",
                                   _backward(grad, scale, h, s, offsets, ctx.largest, ctx.k_dtype, bool(need_scale)))
        loc_shape, scale_shape, k_shape = ctx.shapes
        return (_sum_rows(g_loc, loc_shape) if need_loc else None,
                _sum_rows(g_scale, scale_shape) if need_scale else None,
                _sum_rows(g_k, k_shape) if need_k else None, None, None, None, None)


@once_differentiable
def _once_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    return _FusedExactSumSample.backward(ctx, grad)


def _sum_rows(x: Tensor, shape: torch.Size) -> Tensor:
    """The per-row gradient ``(rows, m)`` summed over the rows that share each of the input's ``(P, m)`` rows."""
    return x.reshape(shape) if x.numel() == shape.numel() else x.reshape((-1,) + tuple(shape)).sum(0)


def _assert_finite(flag: Tensor, residual: Tensor, message: str) -> None:
    """Deferred: the flag is set (every residual finite); on a CPU a :class:`~hardeq.NotPSDError` naming the first
    group whose residual is not."""
    def named() -> NotPSDError:
        bad = (~torch.isfinite(residual)).any(0).nonzero()
        return NotPSDError(f"{message} First such group: {int(bad[0])} of {residual.shape[-1]}.")

    assert_deferred(flag.reshape(()), message, named)


def fused_sum_rsample(loc: Tensor, scale: Tensor, k: Tensor, eps: Tensor, offsets: Tensor | None,
                      largest: int | None, nonfinite_message: str) -> Tensor | None:
    """The sample of :mod:`.grouped_exact` with the fused kernels, ``(*sample, *batch, n)`` (``eps``'s shape), its
    deferred error on a non-finite value ``nonfinite_message``; None where the kernels do not apply: Triton does not
    run on the device, groups not sorted or larger than :data:`MAX_GROUP`, a dtype other than float32 / float64,
    parameters whose batch shape is not a suffix of the sample's, or more than ``2^31 - 1`` groups and vectors."""
    if offsets is None or largest is None or largest > MAX_GROUP or eps.device.type in _UNUSABLE:
        return None
    if not fused_kernels(eps.device):
        return None
    if eps.dtype not in _FLOATS or not (loc.dtype == scale.dtype == k.dtype == eps.dtype) or not eps.is_contiguous():
        return None
    n, a, lead = eps.shape[-1], offsets.shape[0] - 1, eps.shape[:-1]
    rows = eps.numel() // max(1, n)
    loc_rows, scale_rows, k_rows = _rows(loc, lead, n), _rows(scale, lead, n), _rows(k, lead, a)
    if loc_rows is None or scale_rows is None or k_rows is None or rows == 0 or rows * a >= _MAX_PROGRAMS:
        return None
    config = (eps.device.type, eps.dtype, _block(largest)[0])
    try:
        z: Tensor = _FusedExactSumSample.apply(  # type: ignore[no-untyped-call]  # torch: unannotated
            loc_rows, scale_rows, k_rows, eps.reshape(rows, n), offsets, largest, nonfinite_message)
    except NotPSDError:
        raise
    except Exception as error:  # (a first launch that cannot compile: no C compiler for Triton's launcher, ...)
        if config in _LAUNCHED:
            raise
        _UNUSABLE.add(eps.device.type)
        warnings.warn(f"hardeq: the fused Triton kernels of a SumConstraint's sample could not run on {eps.device} "
                      f"({type(error).__name__}: {error}); the ATen form is used there from now on (the same "
                      "arithmetic in more kernel launches).", RuntimeWarning, stacklevel=2)
        return None
    _LAUNCHED.add(config)
    return z.reshape(eps.shape)
