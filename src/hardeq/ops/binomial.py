r"""Binomial and multinomial arithmetic for the Poisson/multinomial family: log-pmfs in Loader's saddle-point form
(:func:`binomial_log_pmf`, :func:`multinomial_log_pmf`), the cdf (:func:`binomial_cdf`), differentiable in the
probability, and exact binomial draws at any count up to :math:`2^{53}` (:func:`binomial_sample`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .group_sum import group_sum

__all__ = ["binomial_log_pmf", "binomial_cdf", "binomial_sample", "multinomial_log_pmf", "BINOMIAL_CHUNK",
           "MAX_EXACT_COUNT", "CDF_MAX_TERMS"]


def _stirlerr(m: Tensor) -> Tensor:
    r"""Stirling's error :math:`\delta(m) = \log m! - (m + \tfrac12)\log m + m - \tfrac12\log 2\pi`, float64,
    ``m >= 1``: ``lgamma`` directly up to 15 (terms below 50, no harmful cancellation), the series
    :math:`\tfrac1{12m} - \tfrac1{360m^3} + \tfrac1{1260m^5} - \tfrac1{1680m^7} + \tfrac1{1188m^9}` above
    (truncation below :math:`10^{-16}`)."""
    small = m <= 15
    ms = torch.where(small, m, torch.full_like(m, 1.0))
    ml = torch.where(small, torch.full_like(m, 16.0), m)
    direct = torch.lgamma(ms + 1) - (ms + 0.5) * torch.log(ms) + ms - 0.5 * math.log(2 * math.pi)
    r = 1 / ml
    r2 = r * r
    series = r * (1 / 12 - r2 * (1 / 360 - r2 * (1 / 1260 - r2 * (1 / 1680 - r2 / 1188))))
    return torch.where(small, direct, series)


def _bd0(x: Tensor, mean: Tensor) -> Tensor:
    r""":math:`x \log(x / M) + M - x \ge 0` (Loader's deviance term), float64, ``x > 0``, ``M > 0``: as
    :math:`x\,\mathrm{log1p}(u) - (x - M)`, :math:`u = (x - M)/M`, for :math:`|u| < 1/2` (absolute error
    :math:`\sim\varepsilon |x - M|` instead of :math:`\varepsilon M`), directly otherwise."""
    d = x - mean
    u = d / mean
    near = u.abs() < 0.5
    u_near = torch.where(near, u, torch.zeros_like(u))
    ratio = torch.where(near, torch.ones_like(x), x / mean)
    return torch.where(near, x * torch.log1p(u_near) - d, x * torch.log(ratio) - d)


def binomial_log_pmf(value: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
    r"""Binomial log-pmf :math:`\log\binom{k}{x} + x\log p + (k - x)\log(1 - p)`, broadcast.

    Valid for integer ``0 <= value <= total_count`` and ``0 <= probs <= 1``. The point masses at
    ``probs`` 0 and 1 are handled separately so that neither the value nor the gradient w.r.t. ``probs``
    produces NaN (``0 * log 0`` is avoided rather than masked). Computed in float64 and returned in the dtype
    of ``probs``, in Loader's saddle-point form (as R's ``dbinom``): for :math:`0 < x < k`

    .. math::
        \log b(x; k, p) = \delta(k) - \delta(x) - \delta(k - x) - \mathrm{bd0}(x, kp) - \mathrm{bd0}(k - x,
        k(1 - p)) + \tfrac12 \log\frac{k}{2\pi x (k - x)}

    (:func:`_stirlerr`, :func:`_bd0`), whose terms are :math:`O(\log k)` and :math:`O((x - kp)^2 / k)`: no
    ``lgamma(k + 1)`` of size :math:`k\log k` to cancel, so it stays accurate to about
    :math:`10^{-15}` relative at :math:`k = 10^{12}` (the ``lgamma`` form loses :math:`k \log k \cdot
    \varepsilon \approx 10^{-2}`). :math:`x = 0`: :math:`k \log(1 - p)`; :math:`x = k`: :math:`k \log p`.
    """
    dtype = probs.dtype
    probs = probs.to(torch.float64)
    interior = (probs > 0) & (probs < 1)
    p = torch.where(interior, probs, torch.full_like(probs, 0.5))
    x, k, p = torch.broadcast_tensors(value.to(torch.float64), total_count.to(torch.float64), p)
    inner = (x > 0) & (x < k)
    xs = torch.where(inner, x, torch.ones_like(x))
    ks = torch.where(inner, k, torch.full_like(k, 2.0))
    rest = ks - xs
    saddle = (
        _stirlerr(ks) - _stirlerr(xs) - _stirlerr(rest)
        - _bd0(xs, ks * p) - _bd0(rest, ks * (1 - p))
        + 0.5 * torch.log(ks / (2 * math.pi * xs * rest))
    )
    edge = torch.where(x == 0, k * torch.log1p(-p), k * torch.log(p))  # x = 0 or x = k
    out = torch.where(inner, saddle, edge)
    point = k * (probs >= 1)  # the atom of a degenerate binomial: k when p = 1, 0 when p = 0
    degenerate = torch.where(x == point, 0.0, float("-inf")).to(out.dtype)
    return torch.where(interior, out, degenerate).to(dtype)


def multinomial_log_pmf(value: Tensor, probs: Tensor, index: Tensor | None, total: Tensor) -> Tensor:
    r"""Log-pmf of a product of multinomials (one per group), in Loader's saddle-point form, float64:

    .. math::
        \log \frac{k!}{\prod_i z_i!}\prod_i p_i^{z_i}
        = \delta(k) + \tfrac12\log 2\pi k - \sum_{i : z_i \ge 1}\big(\delta(z_i) + \tfrac12\log 2\pi z_i\big)
          - \sum_i \mathrm{bd0}(z_i, k p_i)

    per group with :math:`k \ge 1` (0 for :math:`k = 0`), using :math:`\sum_i z_i = k` and
    :math:`\sum_i p_i = 1`, with :math:`\mathrm{bd0}(0, M) = M` (:func:`_stirlerr`, :func:`_bd0`). Every term
    is :math:`O(\log k)` or :math:`O((z_i - k p_i)^2 / k)`, so it is accurate to about :math:`10^{-13}` at
    :math:`k = 10^{12}`, where ``lgamma(k + 1)`` alone carries an error of :math:`4 \cdot 10^{-3}`.

    Args:
        value (Tensor): counts ``(*, n)``; assumed non-negative integers with the group sums ``total``
            (the caller masks the rest: here they give finite garbage, never NaN).
        probs (Tensor): ``(*, n)``, positive, summing to 1 per group; differentiable.
        index (LongTensor or None): group of every coordinate, ``(n,)``; None for one group.
        total (Tensor): ``(*, a)`` (``(*, 1)`` without ``index``).

    Returns:
        Tensor: ``(*)``, float64. Cost: O(n).
    """
    z = value.to(torch.float64).clamp(min=0)
    p = probs.to(torch.float64)
    k = total.to(torch.float64)
    num_groups = k.shape[-1]
    kc = k if index is None else k.index_select(-1, index)  # the total of every coordinate's group
    pos = z >= 1
    mean = kc * p
    live = pos & (kc >= 1)
    zs = torch.where(live, z, torch.ones_like(z))
    ms = torch.where(live, mean, torch.ones_like(mean))
    coord = torch.where(live, _stirlerr(zs) + 0.5 * torch.log(2 * math.pi * zs) + _bd0(zs, ms), mean)
    ks = torch.where(k >= 1, k, torch.ones_like(k))
    group = torch.where(k >= 1, _stirlerr(ks) + 0.5 * torch.log(2 * math.pi * ks), torch.zeros_like(k))
    coord_sum = coord.sum(-1) if index is None else group_sum(coord, index, num_groups).sum(-1)
    return group.sum(-1) - coord_sum


#: Largest count handed to one ``torch.binomial`` call by :func:`binomial_sample` (see there).
BINOMIAL_CHUNK = 2**40

#: Largest count that float64 holds exactly (and :func:`binomial_sample` accepts).
MAX_EXACT_COUNT = 2**53


def binomial_sample(count: Tensor, probs: Tensor, generator: torch.Generator | None = None, *,
                    num_chunks: int | None = None) -> Tensor:
    r"""Exact draws :math:`Z \sim \mathrm{Bin}(k, p)`, broadcast over ``count`` and ``probs``, in float64.

    ``torch.binomial`` (inversion for :math:`k\min(p, 1-p) < 10`, BTRS rejection otherwise) is exact in
    distribution for moderate counts, but BTRS evaluates log-ratios of quantities of size ``k`` in float64,
    so its acceptance test carries an error of order :math:`k \varepsilon`: measured (10^6 draws per
    point), it is indistinguishable from :math:`\mathrm{Bin}(k, p)` up to :math:`k = 2^{47}` and biased from
    :math:`2^{49}` on (mean off by 5 standard errors at :math:`k = 2^{49}, p = 10^{-6}`; 11 at :math:`2^{53}`).
    So counts above :data:`BINOMIAL_CHUNK` (:math:`2^{40}`, error :math:`\le 10^{-4}` in the log acceptance
    ratio) are drawn as sums of independent binomials of chunks of at most :math:`2^{40}` trials, using
    :math:`\mathrm{Bin}(k_1 + k_2, p) = \mathrm{Bin}(k_1, p) + \mathrm{Bin}(k_2, p)`.

    Args:
        count (Tensor): :math:`k`, non-negative integers at most :math:`2^{53}` (float or integer dtype).
        probs (Tensor): :math:`p \in [0, 1]`.
        generator (torch.Generator, optional): the random stream.
        num_chunks (int, optional): :math:`\lceil \max k / 2^{40}\rceil` (or more) when the caller knows a bound on
            the counts; default: read from ``count`` (one host read).

    Returns:
        Tensor: float64, the broadcast shape; every entry an integer in ``[0, count]``.

    Cost: O(N) time and memory for N entries, times :math:`\lceil \max k / 2^{40}\rceil` (one pass per chunk).
    """
    count, probs = torch.broadcast_tensors(count.to(torch.float64), probs.to(torch.float64))
    count, probs = count.contiguous(), probs.contiguous()
    if count.numel() == 0:
        return torch.zeros_like(count)
    if num_chunks is None:
        num_chunks = int(-(-count.max().item() // BINOMIAL_CHUNK))
    if num_chunks <= 1:
        return torch.binomial(count, probs, generator=generator)
    out = torch.binomial(count.clamp(max=BINOMIAL_CHUNK), probs, generator=generator)  # the first chunk
    big = (count > BINOMIAL_CHUNK).reshape(-1).nonzero().squeeze(-1)  # only these need more chunks
    rest, big_probs = count.reshape(-1)[big] - BINOMIAL_CHUNK, probs.reshape(-1)[big]
    extra = torch.zeros_like(rest)
    for c in range(num_chunks - 1):  # loop over chunks of trials, not over entries
        chunk = (rest - c * BINOMIAL_CHUNK).clamp_(0, BINOMIAL_CHUNK)
        extra += torch.binomial(chunk, big_probs, generator=generator)
    return out.view(-1).index_add_(0, big, extra).view(count.shape)


#: Largest number of pmf terms held in memory at once by the cdf's cumulative sum.
_CDF_CHUNK_ELEMENTS = 2**20

#: Largest number of pmf terms (summed over all entries) one cdf evaluation may take; beyond, ValueError.
CDF_MAX_TERMS = 2**22


def _binomial_cdf_window(value: Tensor, total_count: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    r"""The pmf terms that matter for :math:`F(x; k, p)`: ``lo`` (first) and ``last`` (= ``min(x, hi)``).

    By Bernstein's inequality :math:`P(|Z - kp| \ge t) \le \exp(-t^2 / (2(v + t/3)))`, :math:`v = kp(1-p)`.
    Below :math:`kp - t_{lo}` (exponent 745) the whole lower tail is below the smallest float64,
    :math:`2^{-1074}`, so those terms add nothing; above :math:`kp + t_{hi}` (exponent 40) the upper tail is
    below :math:`2^{-57}`, so :math:`F` rounds to 1 there. The window is :math:`O(\sqrt{v} + 1)` terms wide,
    instead of :math:`x + 1`.
    """
    mean = total_count * probs
    v = mean * (1 - probs)

    def width(c: float) -> Tensor:  # the t solving t^2 = 2 c (v + t / 3)
        return (2 * c / 3 + torch.sqrt((2 * c / 3) ** 2 + 8 * c * v)) / 2

    lo = torch.floor(mean - width(745.0) - 1).clamp(min=0)
    hi = torch.ceil(mean + width(40.0) + 1)
    return lo, torch.minimum(value, hi)


def _binomial_cdf_forward(value: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
    r""":math:`F(x; k, p) = \sum_{m=0}^{x} b(m; k, p)` for broadcast tensors with integer ``0 <= x <= k``.

    Summed in float64 over the window ``m = lo .. min(x, hi)`` of :func:`_binomial_cdf_window` (the terms
    outside it are below :math:`2^{-1074}` in all, or :math:`F` rounds to 1), in chunks of at most
    ``_CDF_CHUNK_ELEMENTS`` pmf values. Cost: O(N W) time and O(min(N W, 2^20)) memory for N entries,
    :math:`W \le \min(x + 1, 48\sqrt{kp(1-p)} + 800)` the widest window.

    Raises:
        ValueError: ``N W`` above :data:`CDF_MAX_TERMS` (at :math:`k = 10^{12}, p = 1/2` one entry takes
            :math:`3.4 \cdot 10^7` terms).
    """
    out = torch.zeros(probs.shape, dtype=torch.float64, device=probs.device)
    if probs.numel() == 0:
        return out.to(probs.dtype)
    x = value.detach().to(torch.float64)
    k = total_count.detach().to(torch.float64)
    p = probs.detach().to(torch.float64)
    lo, last = _binomial_cdf_window(x, k, p)
    num_terms = max(int((last - lo).max().item()) + 1, 1)
    if num_terms * probs.numel() > CDF_MAX_TERMS:
        raise ValueError(
            f"the binomial cdf (used by ConstrainedPoisson.expected_l1 / binomial_expected_l1) would sum "
            f"{num_terms} pmf terms for each of {probs.numel()} entries, above the bound CDF_MAX_TERMS = "
            f"{CDF_MAX_TERMS} (hardeq.ops); the largest total is k = {k.max().item():.6g}. The window is about "
            "48 sqrt(k p (1 - p)) terms wide: use expected_l2, or fewer entries per call."
        )
    lo, last = lo.unsqueeze(-1), last.unsqueeze(-1)
    k, p = k.unsqueeze(-1), p.unsqueeze(-1)
    block = max(1, _CDF_CHUNK_ELEMENTS // probs.numel())
    for start in range(0, num_terms, block):  # loop over chunks of m, not over coordinates
        m = lo + torch.arange(start, min(num_terms, start + block), dtype=torch.float64, device=probs.device)
        pmf = binomial_log_pmf(torch.minimum(m, k), k, p).exp()  # shape: (*N, block)
        out += pmf.masked_fill(m > last, 0.0).sum(-1)
    return out.clamp_(0.0, 1.0).to(probs.dtype)


class _BinomialCDF(torch.autograd.Function):
    r""":math:`F(x; k, p)`, differentiable in ``p`` only: :math:`\partial_p F = -k\, b(x; k - 1, p)`.

    Inputs are broadcast tensors of one shape with integer ``0 <= x <= k - 1`` and ``0 < p < 1`` (the caller
    keeps the degenerate cases out, so that the backward never evaluates ``b`` outside its support). The
    backward is written with differentiable ops on the saved ``p``, so double backward works.
    """

    @staticmethod
    def forward(ctx: Any, value: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
        ctx.save_for_backward(value, total_count, probs)
        return _binomial_cdf_forward(value, total_count, probs)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, None, Tensor | None]:
        value, total_count, probs = ctx.saved_tensors
        grad_probs = None
        if ctx.needs_input_grad[2]:
            density = binomial_log_pmf(value, total_count - 1, probs).exp()
            grad_probs = -grad_output * total_count * density
        return None, None, grad_probs


def binomial_cdf(value: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
    r"""Binomial cdf :math:`F(x; k, p) = P(Z \le x)` for :math:`Z \sim \mathrm{Bin}(k, p)`, differentiable in
    ``probs`` with :math:`\partial_p F(x; k, p) = -k\, b(x; k - 1, p)`.

    Args:
        value (Tensor): :math:`x`, any real (``F`` is evaluated at :math:`\lfloor x\rfloor`).
        total_count (Tensor): :math:`k`, non-negative integer valued.
        probs (Tensor): :math:`p \in [0, 1]`.

    Returns:
        Tensor: broadcast shape of the inputs, dtype of ``probs``.

    Cost: a float64 sum of the pmf values in a window of width :math:`W \le \min(x + 1, 48\sqrt{kp(1-p)} +
    800)` around the mean (the rest is below :math:`2^{-1074}`, or :math:`F` rounds to 1): O(N W) time for N
    entries, memory bounded by chunks of 2^20 terms. Accurate to round-off in absolute terms (not in relative
    terms deep in the upper tail, where :math:`1 - F` is tiny).

    Raises:
        ValueError: when ``N W`` exceeds :data:`CDF_MAX_TERMS` (:math:`2^{28}`): e.g. more than 8 entries at
            :math:`k = 10^{12}, p = 1/2`.
    """
    x, k, p = torch.broadcast_tensors(
        torch.floor(value.detach()).to(probs.dtype), total_count.to(probs.dtype), probs
    )
    return _cdf_with_edges(x, k, p)


def _cdf_with_edges(j: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """``F(j; k, p)`` for integer ``j`` of any sign, broadcast inputs; degenerate ``p`` in {0, 1} allowed."""
    interior = (p > 0) & (p < 1)
    inside = (j >= 0) & (j < k) & interior  # the only entries needing the sum (and a gradient)
    one = torch.ones_like(p)
    j_s = torch.where(inside, j, torch.zeros_like(j))
    k_s = torch.where(inside, k, one)
    p_s = torch.where(inside, p, 0.5 * one)
    F: Tensor = _BinomialCDF.apply(j_s, k_s, p_s)  # type: ignore[no-untyped-call]  # torch: apply unannotated
    # outside: j < 0 -> 0; j >= k -> 1; p = 0 (Z = 0) -> [j >= 0]; p = 1 (Z = k) -> [j >= k]
    atom = k * (p >= 1)
    edge = (j >= torch.where(interior, torch.where(j < 0, one, k), atom)).to(p.dtype)
    return torch.where(inside, F, edge)
