r"""The exact final step *in the box*: the conditional mode of the last step's Gaussian under grouped sum
constraints and the pixel range.

Given the last step's Gaussian :math:`\mathcal N(\mu, \mathrm{diag}(v))` over a flattened image and grouped sum
constraints (each channel of each image sums to :math:`k_c`), :func:`box_project` returns

.. math::
    x^\star = \arg\min_x \sum_i \frac{(x_i - \mu_i)^2}{v_i}
    \quad\text{s.t.}\quad \sum_{i \in c} x_i = k_c \ \text{for every group } c, \qquad lo \le x_i \le hi,

the projection of :math:`\mu` in the covariance metric onto :math:`\{Ax = k\} \cap [lo, hi]^n`; it is the *mode*
of the Gaussian conditioned on :math:`Ax = k` and truncated to the box. For an isotropic :math:`v` it is the
Euclidean projection (the value of :math:`v` does not matter then).

**Algorithm** (exact, per group, O(n log n), vectorised over images and groups). The KKT conditions give
:math:`x_i(\lambda) = \mathrm{clip}(\mu_i + \lambda v_i, lo, hi)` for the group's multiplier :math:`\lambda`, and
:math:`g(\lambda) = \sum_i x_i(\lambda)` is continuous, piecewise linear and non-decreasing, with breakpoints
:math:`a_i = (lo - \mu_i)/v_i` (pixel ``i`` leaves the lower bound; slope :math:`+v_i`) and
:math:`b_i = (hi - \mu_i)/v_i` (it reaches the upper bound; slope :math:`-v_i`). With the ``2m`` breakpoints
:math:`p_j` of a group sorted and :math:`d_j = \pm v_i` their slope changes,

.. math::
    g(p_j) = m\,lo + S_j p_j - \sum_{l \le j} d_l p_l, \qquad S_j = \sum_{l \le j} d_l,

(cumulative sums), so the segment where :math:`g` crosses :math:`k` is found by counting the breakpoints with
:math:`g(p_j) < k`, and on it :math:`\lambda = p_j + (k - g(p_j)) / S_j` exactly. One Newton step on the active
set (pixels strictly inside the box) then removes the round-off of the cumulative sums, all in float64; the
result is cast to the input's dtype and clamped to ``[lo, hi]``. This is the grouped-sum, diagonal-covariance case of
the mode of :class:`hardeq.TruncatedConstrainedNormal` (:func:`hardeq.bounds.mode.grouped_box_mode`), which
:func:`box_project` calls.

**Feasibility.** A group of :math:`m` pixels can sum to :math:`k` inside the box iff
:math:`m\,lo \le k \le m\,hi`; otherwise :func:`box_project` raises ``ValueError`` (totals beyond the limits by
no more than the exactness tolerance, 1e-5 relative for float32 / 1e-12 for float64, are accepted: every pixel
is then at the limit).

**What it does to the distribution.** It replaces the last step's *sample* by the *mode* of the last step's
Gaussian given the constraint and the box: deterministic, like ``deterministic=True`` of the unboxed conditioned
step (to which it reduces when no pixel hits the box). It is the special case "diagonal covariance, grouped
sums" of :attr:`TruncatedConstrainedNormal.mode <hardeq.TruncatedConstrainedNormal.mode>`:
``box_project(x, c, v, lo, hi)`` equals
``ConstrainedNormal(x.flatten(1), v.sqrt(), constraint=c).truncate(lo, hi).mode`` (docs/bounds.md).

**A sample instead of the mode.** ``final="sample_box"`` of the samplers and of
:class:`~hardeq.diffusion.ConstrainedScheduler` draws a *sample* of the truncated conditional
:math:`\mathcal N(\mu, \mathrm{diag}(v)) \mid Ax = k,\ x \in [lo, hi]^n` (:func:`sampled_last_step`: rejection
where it accepts often enough, else exact Hamiltonian Monte Carlo on the plane; every draw is exactly feasible).
Either output quantises to 8 bits with the channel totals kept exactly by
:func:`~hardeq.diffusion.to_uint8_exact`.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from ..bounds.mode import grouped_box_mode
from ..constraints import EqualityConstraint, SumConstraint
from .image_constraints import channel_sum_constraint, check_image_constraint

__all__ = ["box_project", "box_feasible", "sampled_last_step"]


def _grouped(constraint: object) -> bool:
    """Is ``constraint`` a grouped-sum constraint (it has a ``group_index``)?"""
    return isinstance(constraint, EqualityConstraint) and constraint.group_index is not None


def _as_sum_constraint(constraint: object, x: Tensor) -> SumConstraint:
    if isinstance(constraint, Tensor) or isinstance(constraint, (list, tuple)):
        if x.dim() != 4:
            raise ValueError(f"box_project: totals need images of shape (B, C, H, W), got {tuple(x.shape)}; pass a "
                             f"hardeq.SumConstraint for other layouts.")
        constraint = channel_sum_constraint(x.shape, constraint)
    if not _grouped(constraint):
        raise TypeError(f"box_project: constraint must be a grouped-sum constraint such as hardeq.SumConstraint (e.g. "
                        f"channel_sum_constraint) or a "
                        f"tensor of channel totals (C,) / (B, C), got {type(constraint).__name__}; a general "
                        f"LinearConstraint has no O(n log n) box projection (use a QP solver).")
    # (a grouped-sum constraint: group_index and group_sizes are set, as on a SumConstraint)
    return cast(SumConstraint, check_image_constraint(constraint, x, owner="box_project"))


def _flat_variance(variance: float | Tensor, x: Tensor) -> Tensor:
    """Variances as ``(B, n)`` float64 (a broadcast view where possible)."""
    B, n = x.shape[0], math.prod(x.shape[1:])
    if isinstance(variance, bool) or not isinstance(variance, (int, float, Tensor)):
        raise TypeError(f"box_project: variance must be a positive float or a tensor of variances, got "
                        f"{type(variance).__name__}.")
    if not isinstance(variance, Tensor):
        variance = torch.tensor(float(variance))
    v: Tensor | None
    v = variance.to(device=x.device, dtype=torch.float64)
    try:
        v = torch.broadcast_to(v, x.shape) if v.dim() <= x.dim() else None
    except RuntimeError:
        v = None
    if v is None:
        raise ValueError(f"box_project: variance of shape {tuple(variance.shape)} does not broadcast to the images' "
                         f"shape {tuple(x.shape)}.")
    if not bool((torch.isfinite(v) & (v > 0)).all()):
        raise ValueError("box_project: variance must hold positive finite values (a zero variance pins a pixel; "
                         "the projection in that metric is undefined).")
    return v.reshape(B, n)


def _check_box(lo: float, hi: float) -> tuple[float, float]:
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"box_project: the box must be finite with lo < hi, got (lo, hi) = ({lo}, {hi}).")
    return lo, hi


def box_feasible(constraint: SumConstraint, lo: float, hi: float, *, rtol: float = 0.0) -> Tensor:
    r"""Boolean ``(*batch, a)``: can group ``c`` (``m_c`` members) sum to :math:`k_c` inside ``[lo, hi]``, i.e.
    :math:`m_c lo \le k_c \le m_c hi` (up to ``rtol`` times :math:`m_c \max(|lo|, |hi|)`)?"""
    m = constraint.group_sizes.to(torch.float64)
    k = constraint.k.to(torch.float64)
    slack = rtol * m * max(abs(lo), abs(hi))
    return (k >= m * lo - slack) & (k <= m * hi + slack)


def box_project(x: Tensor, constraint: SumConstraint | Tensor, variance: float | Tensor = 1.0,
                lo: float = -1.0, hi: float = 1.0) -> Tensor:
    r"""The projection of ``x`` in the metric :math:`\mathrm{diag}(v)^{-1}` onto
    :math:`\{\text{group sums} = k\} \cap [lo, hi]^n`: the mode of :math:`\mathcal N(x, \mathrm{diag}(v))`
    conditioned on the sums and truncated to the box (module docstring for the algorithm).

    Args:
        x (Tensor): the last step's mean (e.g. a sampler's pre-clamp output, or its :math:`\hat x_0`), shape
            ``(B, C, H, W)`` (any ``(B, *image_shape)`` with a ``SumConstraint``), float32 or float64.
        constraint (SumConstraint | Tensor): grouped sums on the flattened images (batch shape ``()`` or
            ``(B,)``), e.g. :func:`channel_sum_constraint`; or the channel totals ``(C,)`` / ``(B, C)`` directly.
            The totals are in the space of ``x`` and ``[lo, hi]`` (for a ``[0, 1]`` box: the sum of ``[0, 1]``
            pixel values).
        variance (float | Tensor): the diagonal variances :math:`v > 0`: a float (isotropic: the Euclidean
            projection) or a tensor broadcastable to ``x`` (per image, channel or pixel).
        lo, hi (float): the box, e.g. ``(-1, 1)`` (a model's space) or ``(0, 1)``; should be representable in
            ``x``'s dtype (``0``, ``±1`` are).

    Returns:
        Tensor: same shape and dtype as ``x``; every group meets :math:`|\sum x - k| \le tol \sum |x|`
        (``tol`` 1e-5 float32, 1e-12 float64) and every pixel lies in ``[lo, hi]`` (``lo <= x <= hi`` holds in
        ``x``'s dtype, no epsilon outside). Not differentiable (a piecewise-linear map; use it on outputs).

    Raises:
        ValueError: a total outside :math:`[m\,lo, m\,hi]` (it names the first offending image and group), a
            non-positive variance, or ``lo >= hi``.

    Cost: two sorts of ``2n`` breakpoints per image and a few cumulative sums, in float64.

    Example:
        >>> x = torch.tensor([[[[0.9, 0.8], [0.1, -0.5]]]])      # one image, one channel, sum 1.3
        >>> y = box_project(x, torch.tensor([3.0]), lo=-1.0, hi=1.0)
        >>> [round(v, 6) for v in y.flatten().tolist()]        # lambda = 0.7; the two bright pixels hit 1
        [1.0, 1.0, 0.8, 0.2]
        >>> float(y.sum())
        3.0
    """
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise TypeError(f"box_project: x must be a floating tensor of shape (B, C, H, W), got "
                        f"{type(x).__name__ if not isinstance(x, Tensor) else (x.dtype, tuple(x.shape))}.")
    lo, hi = _check_box(lo, hi)
    con = _as_sum_constraint(constraint, x).to(dtype=torch.float64)
    B, n = x.shape[0], math.prod(x.shape[1:])
    tol = 1e-12 if x.dtype == torch.float64 else 1e-5
    ok = box_feasible(con, lo, hi, rtol=tol).expand(B, con.num_constraints)
    if not bool(ok.all()):
        b, c = (int(i) for i in (~ok).nonzero()[0])
        k_bc = float(con.k.expand(B, -1)[b, c])
        m = int(con.group_sizes[c])
        raise ValueError(f"box_project: group {c} of image {b} has {m} pixels in [{lo}, {hi}], so its total must lie "
                         f"in [{m * lo}, {m * hi}], got {k_bc}. Rescale the totals to the box's space (for [0, 1] "
                         f"pixels: k01 = (k + m) / 2 from [-1, 1]) or widen the box.")
    mu = x.detach().reshape(B, n).to(torch.float64)
    v = _flat_variance(variance, x)
    index = con.group_index  # (n,) group ids
    a = con.num_constraints
    k = con.k.expand(B, a)
    counts = con.group_sizes.to(torch.float64)  # (a,)
    # the mode of the truncated conditional (hardeq.bounds.mode): breakpoint search, then the exact solve on the
    # identified active set
    lo_t = torch.full_like(mu, lo)
    hi_t = torch.full_like(mu, hi)
    y, _ = grouped_box_mode(mu, v.expand(B, n), lo_t, hi_t, index, con.group_sizes, k)
    # totals at a limit of the box (up to the tolerance): every pixel of the group at that limit, exactly
    k_i = k.gather(1, index.expand(B, n))
    m_i = counts[index]
    y = torch.where(k_i >= m_i * hi, torch.full_like(y, hi), torch.where(k_i <= m_i * lo, torch.full_like(y, lo), y))
    return y.to(x.dtype).clamp(lo, hi).reshape(x.shape)


FINAL_OPTIONS = (None, "box", "sample_box")


def boxed_last_step(x0: Tensor, constraint: SumConstraint | Tensor, std: float | Tensor,
                    box: tuple[float, float]) -> Tensor:
    r"""The samplers' ``final="box"`` step: :func:`box_project` of the last step's prediction ``x0`` in the metric of
    its Gaussian, :math:`\mathrm{diag}(\mathrm{std}^2)`: the conditional mode in the box, not a sample."""
    return box_project(x0, constraint, std * std, *box)


def sampled_last_step(x0: Tensor, constraint: SumConstraint, std: float | Tensor, box: tuple[float, float],
                      generator: torch.Generator | None = None) -> Tensor:
    r"""The samplers' ``final="sample_box"`` step: one *sample* per image of the last step's Gaussian
    :math:`\mathcal N(\hat x_0, \mathrm{diag}(\mathrm{std}^2))` given the group sums and the box ``[lo, hi]``.

    The law is ``ConstrainedNormal(x0.flatten(1), std, constraint=c).truncate(lo, hi)``
    (:class:`~hardeq.TruncatedConstrainedNormal`); its sampler (rejection from the untruncated conditional when
    that accepts often enough, else exact HMC on the plane started from the mode) is named in docs/bounds.md.
    Every returned pixel is in ``[lo, hi]`` (``>=`` / ``<=`` in ``x0``'s dtype) and every group sum meets the
    per-row tolerance of the untruncated conditional. The draws come from ``generator`` (the conditioning stream):
    a seed is taken from it and the sampler runs under :func:`torch.random.fork_rng`, so torch's global stream is
    left as it was and a seeded generator gives the same images.

    Args:
        x0: ``(B, *image_shape)``, the last step's unconditioned prediction :math:`\hat x_0`.
        constraint: grouped sums on the flattened images (``SumConstraint``, batch shape ``()`` or ``(B,)``).
        std: the standard deviation, a float or a tensor broadcastable to ``x0``.
        box: ``(lo, hi)``.
        generator: the conditioning stream (default: torch's global one).

    Raises:
        ValueError: a group total outside :math:`[m\,lo, m\,hi]` (the polytope is empty; the truncated law's
            message names the group), or a non-positive ``std``.

    Cost: O(pixels) per HMC bounce for grouped sums (docs/bounds.md), plus the mode's sort to start the chains.
    """
    lo, hi = _check_box(*box)
    # (check_final: a grouped-sum constraint, group_sizes set as on a SumConstraint)
    con = cast(SumConstraint, check_image_constraint(constraint, x0, owner="final='sample_box'"))
    B = x0.shape[0]
    flat = x0.detach().reshape(B, -1)
    v = _flat_variance(std * std if isinstance(std, Tensor) else float(std) ** 2, x0)  # checks std > 0
    ok = box_feasible(con.to(dtype=torch.float64), lo, hi, rtol=1e-12 if x0.dtype == torch.float64 else 1e-5)
    ok = ok.expand(B, con.num_constraints)
    if not bool(ok.all()):
        b, c = (int(i) for i in (~ok).nonzero()[0])
        m = int(con.group_sizes[c])
        raise ValueError(f"final='sample_box': group {c} of image {b} has {m} pixels in [{lo}, {hi}], so its total "
                         f"must lie in [{m * lo}, {m * hi}], got {float(con.k.expand(B, -1)[b, c])}.")
    from ..distributions.normal import ConstrainedNormal

    dist = ConstrainedNormal(flat, v.sqrt().to(flat.dtype), constraint=con, validate_args=False).truncate(lo, hi)
    devices = [x0.device] if x0.device.type == "cuda" else []
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device if generator is not None
                             else "cpu"))
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        y = dist.sample()
    return y.to(x0.dtype).clamp(lo, hi).reshape(x0.shape)


def final_step(final: str, x0: Tensor, constraint: EqualityConstraint, std: float | Tensor, box: tuple[float, float],
               generator: torch.Generator | None = None) -> Tensor:
    """The last step of ``final="box"`` (:func:`boxed_last_step`, the mode) or ``"sample_box"``
    (:func:`sampled_last_step`, a sample)."""
    grouped = cast(SumConstraint, constraint)  # (check_final: a grouped-sum constraint)
    if final == "sample_box":
        return sampled_last_step(x0, grouped, std, box, generator)
    return boxed_last_step(x0, grouped, std, box)


def check_final(final: object, box: object, constraint: object) -> tuple[float, float] | None:
    """Validate a sampler's ``final=`` / ``box=`` options; return ``(lo, hi)`` for ``final="box"`` or
    ``"sample_box"``, else ``None``."""
    if final not in FINAL_OPTIONS:
        raise ValueError(f"final must be None (the last step as the schedule says), 'box' (the conditional mode in "
                         f"the box, box_project) or 'sample_box' (a sample of the conditional truncated to the box), "
                         f"got {final!r}.")
    if final is None:
        return None
    if constraint is None:
        raise ValueError(f"final={final!r} conditions on the constraint and the box, but constraint is None.")
    if not _grouped(constraint):
        raise TypeError(f"final={final!r} needs a grouped-sum constraint such as hardeq.SumConstraint (e.g. "
                        f"channel_sum_constraint), got "
                        f"{type(constraint).__name__}.")
    if not isinstance(box, (tuple, list)) or len(box) != 2:
        raise ValueError(f"box must be a pair (lo, hi) such as (-1.0, 1.0) or (0.0, 1.0), got {box!r}.")
    return _check_box(*box)
