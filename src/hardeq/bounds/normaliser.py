r"""The normaliser :math:`Z = P(l \le z \le u \mid Az = k)` of the truncated density, and its gradient.

The truncated density on the plane is :math:`p(z \mid Az = k)\,\mathbf 1[l \le z \le u] / Z`, so
:math:`\log p_{\text{trunc}}(z) = \log p(z \mid Az = k) - \log Z`.

**Exact, one free dimension** (``n - a == 1``). The plane is a line and the conditional covariance has rank one,
:math:`\bar\Sigma = ww^\top` with :math:`w = d / \sqrt{d^\top\Sigma^{-1}d}` (``d`` the unit null vector of ``A``):
:math:`z = \bar\mu + \varepsilon w`, :math:`\varepsilon \sim \mathcal N(0, 1)`. The box is the interval
:math:`\alpha \le \varepsilon \le \beta` with :math:`\alpha = \max_i \min(t^l_i, t^u_i)`,
:math:`\beta = \min_i \max(t^l_i, t^u_i)`, :math:`t_i = (\text{bound}_i - \bar\mu_i)/w_i` over the coordinates
with :math:`w_i \ne 0` (the others must hold :math:`l_i \le \bar\mu_i \le u_i`), and

.. math::
    \log Z = \log(\Phi(\beta) - \Phi(\alpha)),

computed from ``torch.special.log_ndtr`` without cancellation (:func:`log_diff_ndtr`), differentiable in
:math:`\bar\mu` and :math:`w`, hence in ``loc``, the scales and ``k`` (autograd; exact gradient).

**Monte Carlo, more free dimensions.** :math:`\hat Z = N_{\text{in}}/N` over ``N`` exact draws of the untruncated
conditional; ``log_normaliser`` is :math:`\log\hat Z` and ``log_normaliser_stderr`` its delta-method standard
error :math:`\sqrt{(1 - \hat Z)/(N\hat Z)}` (relative error of :math:`\hat Z`); :math:`\log\hat Z` is biased low by
about half its variance. Its gradient comes from the identity

.. math::
    \nabla\log Z = \mathbb E_{\text{trunc}}[\nabla\log p(z\mid Az = k)]

(differentiate :math:`Z = \int_{\text{box}} p`; valid for ``loc`` and the scales, which do not move the plane),
estimated with draws :math:`z_s` of the truncated law by the surrogate
:math:`\frac1S\sum_s \log p(z_s) - \mathrm{stopgrad}(\cdot)` (:func:`surrogate`), whose value is zero and whose
gradient is the sample mean. Its variance is :math:`\mathrm{Var}_{\text{trunc}}[\nabla\log p(z)]/S_{\text{eff}}`
per component: ``S`` for rejection draws (iid), the effective sample size for HMC draws. ``k`` moves the plane and
with it the box's section; its part of :math:`\nabla\log Z` is a flux through the section's boundary that the
identity does not contain, so on this path the normaliser carries no gradient to ``k`` (the numerator's gradient
to ``k`` is zero on the plane as for :class:`~hardeq.ConstrainedNormal`): use the exact path (one free dimension)
or treat ``k`` as data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .target import PlaneTarget

if TYPE_CHECKING:
    from ..constraints import EqualityConstraint

__all__ = ["log_diff_ndtr", "null_direction", "line_bounds", "line_interval", "exact_log_normaliser",
           "mc_log_normaliser",
           "surrogate", "subset_log_normaliser", "StalledLevels"]


def _log1mexp(x: Tensor) -> Tensor:
    r""":math:`\log(1 - e^x)` for :math:`x \le 0`, accurate on both sides of :math:`-\log 2`."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def log_diff_ndtr(a: Tensor, b: Tensor) -> Tensor:
    r""":math:`\log(\Phi(b) - \Phi(a))` for :math:`a < b` (``-inf`` where :math:`a \ge b`), without cancellation:
    :math:`\log\Phi(b) + \log(1 - e^{\log\Phi(a) - \log\Phi(b)})` when :math:`a + b \le 0`, else the same on
    :math:`(-b, -a)` (symmetry), so both tails keep their relative accuracy. Differentiable.

    Examples:
        >>> from hardeq.bounds import log_diff_ndtr
        >>> a, b = torch.tensor([-1.0, 10.0], dtype=torch.float64), torch.tensor([1.0, 11.0], dtype=torch.float64)
        >>> log_diff_ndtr(a, b)  # the far tail stays finite (Phi(11) - Phi(10) is 0 in float64 subtraction)
        tensor([ -0.3817, -53.2313], dtype=torch.float64)
    """
    flip = (a + b) > 0
    lo = torch.where(flip, -b, a)
    hi = torch.where(flip, -a, b)
    empty = lo >= hi
    hi_safe = torch.where(empty, lo + 1, hi)
    la, lb = torch.special.log_ndtr(lo), torch.special.log_ndtr(hi_safe)
    out = lb + _log1mexp((la - lb).clamp_max(0))
    return torch.where(empty, torch.full_like(out, -float("inf")), out)


def null_direction(constraint: EqualityConstraint) -> Tensor:
    """The unit vector spanning :math:`\\mathrm{null}(A)` when ``n - a == 1``, ``(*batch_A, n)`` float64 (from the
    constraint's float64 complete QR; its sign is arbitrary)."""
    basis: Tensor = constraint.orthonormal_decomposition()[2]
    return basis[..., 0]


def _standardized(bound: Tensor, mean: Tensor, w: Tensor) -> Tensor:
    """``(bound - mean) / w``, ``+-inf`` where the bound is infinite, computed so that its gradient stays finite there
    (a direct ``(inf - mean) / w`` has an infinite derivative in ``w``, which the min / max that follow turn into
    ``0 * inf = NaN`` in the scales' gradient)."""
    finite = torch.isfinite(bound)
    t = (torch.where(finite, bound, torch.zeros_like(bound)) - mean) / w
    return torch.where(finite, t, torch.sign(bound) * torch.sign(w) * float("inf"))


def line_bounds(dist: object, lower: Tensor, upper: Tensor, direction: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    r"""For ``n - a == 1``: each coordinate's standardized interval on the line, ``(lows, highs, moves, pinned_out,
    mean, w)``: ``lows``, ``highs`` ``(*batch, n)`` (``-inf`` / ``+inf`` where the coordinate does not move along
    the line), ``moves`` ``(*batch, n)`` where it does, ``pinned_out`` ``(*batch)`` where a coordinate that does not
    move lies outside its bounds, ``mean``, ``w`` ``(*batch, n)`` (:func:`line_interval`)."""
    target = PlaneTarget.of(dist)
    mean = target.mean
    dtype = mean.dtype
    d = (null_direction(target.constraint) if direction is None else direction).to(dtype)
    batch = target.batch_shape
    n = target.event_size
    d = d.expand(batch + (n,))
    w = d / target.covariance.inv_quad(d).clamp_min(torch.finfo(dtype).tiny).sqrt().unsqueeze(-1)
    w = w.expand(batch + (n,))
    zero = d.abs() <= 64 * torch.finfo(torch.float64).eps
    w_safe = torch.where(zero, torch.ones_like(w), w)
    t_lo, t_hi = _standardized(lower, mean, w_safe), _standardized(upper, mean, w_safe)
    inf = torch.full_like(t_lo, float("inf"))
    lows = torch.where(zero, -inf, torch.minimum(t_lo, t_hi))
    highs = torch.where(zero, inf, torch.maximum(t_lo, t_hi))
    pinned_out = (zero & ((mean < lower) | (mean > upper))).any(-1)
    return lows, highs, ~zero, pinned_out, mean, w


def line_interval(dist: object, lower: Tensor, upper: Tensor, direction: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""For ``n - a == 1``: ``(alpha, beta, mean, w)`` with the box = :math:`\{\bar\mu + \varepsilon w : \alpha \le
    \varepsilon \le \beta\}` (module docstring); ``alpha``, ``beta`` ``(*batch)``, ``mean``, ``w`` ``(*batch, n)``, in
    the compute dtype, differentiable in the parameters. A coordinate with :math:`w_i = 0` (the constraint determines
    it) outside its bounds gives an empty interval (``alpha = +inf``). ``direction``: :func:`null_direction`, if the
    caller has it (an O(n^2) QR otherwise)."""
    lows, highs, _, pinned_out, mean, w = line_bounds(dist, lower, upper, direction)
    alpha, beta = lows.amax(-1), highs.amin(-1)
    alpha = torch.where(pinned_out, torch.full_like(alpha, float("inf")), alpha)
    return alpha, beta, mean, w


def exact_log_normaliser(dist: object, lower: Tensor, upper: Tensor,
                         direction: Tensor | None = None) -> Tensor:
    r""":math:`\log P(\text{box}\mid\text{plane}) = \log(\Phi(\beta) - \Phi(\alpha))` for ``n - a == 1``, ``(*batch)``,
    differentiable (module docstring). ``ValueError`` when the interval is empty or a point (no volume).

    Examples:
        >>> import math
        >>> from hardeq.bounds import exact_log_normaliser
        >>> zero_sum = SumConstraint(torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(2, dtype=torch.float64), 1.0, constraint=zero_sum)  # z = (t, -t)
        >>> log_z = exact_log_normaliser(d, -torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        >>> round(float(log_z), 4), round(math.log(math.erf(1.0)), 4)  # t ~ N(0, 1/2): log P(|t| <= 1)
        (-0.1711, -0.1711)
    """
    alpha, beta, _, _ = line_interval(dist, lower, upper, direction)
    bad = ~(alpha < beta)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
        a_, b_ = float(alpha[idx]), float(beta[idx])
        what = "empty" if not a_ <= b_ else "a single point"
        raise ValueError(f"the polytope {{A z = k}} ∩ [lower, upper] of batch element {idx} is {what}: the plane is a "
                         f"line (n - a = 1) and the box cuts it to the standardized interval [{a_:.6g}, {b_:.6g}]. "
                         "Widen the bounds or change k.")
    return log_diff_ndtr(alpha, beta)


@torch.no_grad()
def mc_log_normaliser(draws: Tensor, lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""From ``N`` untruncated draws ``(N, *batch, n)``: ``(log_Z, stderr, acceptance)``, each ``(*batch)``;
    :math:`\hat Z` = fraction in the box, stderr :math:`\sqrt{(1-\hat Z)/(N\hat Z)}` (``inf`` where no draw is
    in).

    Examples:
        >>> from hardeq.bounds import mc_log_normaliser
        >>> draws = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # 4 untruncated draws of n = 1
        >>> log_z, stderr, acceptance = mc_log_normaliser(draws, torch.zeros(1), torch.full((1,), 1.5))
        >>> round(float(log_z.exp()), 4), round(float(stderr), 4), round(float(acceptance), 4)  # 2 of 4 in the box
        (0.5, 0.5, 0.5)
    """
    N = draws.shape[0]
    inside = ((draws >= lower) & (draws <= upper)).all(-1)
    acc = inside.to(torch.float64).mean(0)
    log_z = acc.log()
    stderr = torch.where(acc > 0, ((1 - acc) / (N * acc.clamp_min(1e-300))).sqrt(),
                         torch.full_like(acc, float("inf")))
    return log_z, stderr, acc


def surrogate(log_prob: Callable[[Tensor], Tensor], draws: Tensor) -> Tensor:
    r""":math:`\frac1S\sum_s \log p(z_s \mid Az = k) - \mathrm{stopgrad}(\cdot)`, ``(*batch)``: zero in value, with
    gradient the Monte Carlo estimate of :math:`\nabla\log Z` w.r.t. ``loc`` and the scales (``draws``
    ``(S, *batch, n)`` of the truncated law, detached; module docstring for its variance). ``log_prob``: the
    untruncated conditional log-density on the plane (the caller detaches ``k`` from it)."""
    lp = log_prob(draws.detach()).mean(0)
    out: Tensor = lp - lp.detach()
    return out


#: the factor on the clustered standard error of :func:`subset_log_normaliser` (the levels' errors are positively
#: correlated, which the sum of per-level variances ignores): calibrated on products of three lines with exact log Z
#: of -19 to -219, 40 seeds each, where the clustered error's z-scores had a standard deviation of 1.35 to 1.5
STDERR_INFLATION = 1.5
#: the adaptive levels :func:`subset_log_normaliser` may take before it gives up (keep 1/4 per level: log Z down
#: to about -1386)
MAX_LEVELS = 1000
#: consecutive levels without progress (the keep-quantile of the score not below the last level's) after which
#: :func:`subset_log_normaliser` stops with :class:`StalledLevels`
STALL_LEVELS = 3


class StalledLevels(RuntimeError):
    """Subset simulation made no progress for :data:`STALL_LEVELS` levels in a row: the kernel stopped moving the
    population, which collapsed onto copies of one draw. ``element`` names the batch element, ``tau`` the widening
    its levels were stuck at, ``bound`` the bound on its ``log Z`` they had reached."""

    def __init__(self, message: str, element: tuple[int, ...], tau: float, bound: float) -> None:
        super().__init__(message)
        self.element, self.tau, self.bound = element, tau, bound

Kernel = Callable[[Tensor, Tensor, Tensor, int], Tensor]


@torch.no_grad()
def subset_log_normaliser(dist: object, lower: Tensor, upper: Tensor, kernel: Kernel, *, num: int,
                          iterations: int = 4, keep: float = 0.25, inflation: float = STDERR_INFLATION,
                          generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
    r""":math:`\log Z = \log P(l \le z \le u \mid Az = k)` by subset simulation, for boxes too unlikely for
    :func:`mc_log_normaliser` (few or no untruncated draws inside). Returns ``(log_Z, stderr, levels)``, each
    ``(*batch)``.

    The box is reached through nested boxes :math:`B(\tau) = \{l - \tau s \le z \le u + \tau s\}` (``s`` the
    conditional standard deviations on the plane; :math:`B(\infty)` is the plane, :math:`B(0)` the box), so

    .. math::
        Z = \prod_j P(B(\tau_j) \mid B(\tau_{j-1})),\qquad \tau_0 = \infty > \tau_1 > \dots > \tau_J = 0.

    Level 0 is ``num`` exact untruncated draws. At each level the score
    :math:`g(z) = \max_i \max((l_i - z_i)/s_i, (z_i - u_i)/s_i, 0)` (:math:`z \in B(\tau) \iff g(z) \le \tau`) of
    the population picks :math:`\tau_j` as its ``keep``-quantile (0 once that many are inside the box), the
    fraction :math:`\hat p_j` of the population with :math:`g \le \tau_j` estimates the level's factor, and the
    population is refilled to ``num`` by resampling the kept draws and moving each by ``iterations`` steps of
    ``kernel``, which must leave the law truncated to :math:`B(\tau_j)` invariant (exact HMC or blocked Gibbs with
    the enlarged box): kept draws of an exact population are exact draws of the next level, so each level's
    population stays in its law. Batch elements run their levels side by side; one that reached the box keeps
    factor 1.

    Error: each level's :math:`\mathrm{Var}(\hat p_j)` is estimated with the population clustered by the seed each
    draw was moved from, :math:`\sum_c (\sum_{i \in c} (I_i - \hat p_j))^2 / N^2` (level 0's draws are
    independent: the binomial :math:`\hat p_j(1 - \hat p_j)/N`), since draws of one seed are correlated; ``stderr``
    is ``inflation`` (default :data:`STDERR_INFLATION`) times :math:`\sqrt{\sum_j \mathrm{Var}(\hat p_j)/\hat p_j^2}`,
    the factor for the correlation between levels that the sum ignores, calibrated against exact normalisers (the
    z-scores' standard deviation went from 1.7-1.9 with the plain binomial sum to 1.35-1.5 clustered, hence 1.5;
    docs/bounds.md). A kernel whose every move is an exact independent draw of the level's law (blocked Gibbs with
    one free dimension: each sweep draws the whole segment) leaves no such correlation: its caller passes 1.
    The adaptive levels bias :math:`\log\hat Z` by :math:`O(J/N)` (Au & Beck 2001; Cérou et al. 2012).

    Cost: ``J`` levels of ``num x iterations`` kernel steps, :math:`J \approx \log Z / \log(\text{keep})`.

    Args:
        dist (ConstrainedNormal): the untruncated conditional, batch ``B``, event ``n``.
        lower, upper (Tensor): the box, ``B + (n,)`` in the distribution's compute dtype (infinite entries
            allowed).
        kernel: ``kernel(lo, hi, start, iterations) -> states``: ``start`` ``(num, *B, n)`` inside ``[lo, hi]``
            (``lo``, ``hi``: ``B + (n,)``) and on the plane; returns the states after ``iterations`` steps of a
            kernel invariant for ``dist`` truncated to ``[lo, hi]``, same shape, feasible.
        num (int): population size (>= 4).
        iterations (int): kernel steps per level (>= 1).
        keep (float): the fraction kept per level, in ``(0, 1)``.
        generator: for the resampling (the kernel has its own).

    A level whose keep-quantile is not below the last level's made no progress: with a kernel that moves, at least
    three quarters of the population would have to sit exactly on the last level's boundary, which has
    probability 0. :data:`STALL_LEVELS` such levels in a row mean the kernel has stopped moving the population
    (it collapsed onto copies of one draw), and the estimate stops there rather than running out of levels.

    Raises:
        RuntimeError: more than :data:`MAX_LEVELS` levels (``log Z`` below about ``MAX_LEVELS * log(keep)``,
            -1386 at ``keep = 0.25``), naming the batch element and the bound on its ``log Z`` reached.
        StalledLevels: :data:`STALL_LEVELS` levels in a row without progress (a kernel that does not move).

    Examples:
        >>> from hardeq.bounds import exact_hmc, subset_log_normaliser
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([0.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total)
        >>> lo, hi = torch.full((3,), -0.05, dtype=torch.float64), torch.full((3,), 0.05, dtype=torch.float64)
        >>> def kernel(a, b, start, steps):
        ...     return exact_hmc(d, a, b, start, num_samples=1, burn_in=steps - 1,
        ...                      generator=torch.Generator().manual_seed(1)).samples[0]
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> log_z, stderr, levels = subset_log_normaliser(d, lo, hi, kernel, num=400)
        >>> bool(abs(log_z - (-6.167)) < 4 * stderr), int(levels) >= 3   # P(box) = 0.0021 (4e6 plain draws)
        (True, True)
    """
    if isinstance(num, bool) or not isinstance(num, int) or num < 4:
        raise ValueError(f"num must be an int >= 4, got {num!r}.")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive int, got {iterations!r}.")
    if not isinstance(keep, float) or not 0.0 < keep < 1.0:
        raise ValueError(f"keep must be a float in (0, 1), got {keep!r}.")
    target = PlaneTarget.of(dist)
    batch = target.batch_shape
    cond, loc = target.conditioner, target.loc
    z = cond.sample(loc, (num,)).to(lower.dtype).expand((num,) + target.shape).contiguous()
    scale = target.plane_variance().detach().to(lower.dtype).sqrt()
    tiny = torch.finfo(lower.dtype).tiny
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).clamp_min(tiny)

    def score(x: Tensor) -> Tensor:  # (num, *B): the smallest tau with x in B(tau)
        out = torch.maximum((lower - x) / scale, (x - upper) / scale).amax(-1)
        return out.clamp_min(0.0)

    def box_at(tau_: Tensor) -> tuple[Tensor, Tensor]:  # B(tau): the box itself where tau = 0
        t = tau_[..., None]
        zero = t == 0
        return (torch.where(zero, lower, lower - t * scale), torch.where(zero, upper, upper + t * scale))

    log_z = torch.zeros(batch, dtype=torch.float64, device=lower.device)
    var = torch.zeros_like(log_z)
    levels = torch.zeros(batch, dtype=torch.long, device=lower.device)
    done = torch.zeros(batch, dtype=torch.bool, device=lower.device)
    tau = torch.full(batch, math.inf, dtype=lower.dtype, device=lower.device)
    parent = torch.arange(num, device=lower.device).expand(max(1, batch.numel()), num)  # each draw's seed
    stalled = torch.zeros(batch, dtype=torch.long, device=lower.device)   # consecutive levels without progress
    for _ in range(MAX_LEVELS):
        g = score(z)                                               # (num, *B)
        q = torch.quantile(g.to(torch.float64).flatten(1), keep, dim=0).reshape(batch).to(lower.dtype) \
            if batch else torch.quantile(g.to(torch.float64), keep).to(lower.dtype)
        new_tau = torch.where(done, torch.zeros_like(tau), torch.minimum(q.clamp_min(0.0), tau))
        # the score's division and the level's box B(tau) = [l - tau s, u + tau s] can disagree by round-off: a draw
        # passing either test is kept, and the kept seeds are clamped into the box (a round-off move), where the
        # kernel checks that its start lies
        level_lo, level_hi = box_at(new_tau)
        inside = ((z >= level_lo) & (z <= level_hi)).all(-1) | (g <= new_tau)     # (num, *B)
        p = inside.to(torch.float64).mean(0)
        log_z = torch.where(done, log_z, log_z + p.log())
        # the variance of p_hat with the draws clustered by the seed they were moved from (level 0: singletons, the
        # binomial (1 - p) / (p N) of log p_hat): draws of one seed are correlated, which the binomial ignores
        dev = (inside.to(torch.float64) - p).reshape(num, -1).T                      # (B_flat, num)
        sums = torch.zeros_like(dev).scatter_add_(1, parent, dev)
        level_var = (sums.square().sum(1) / num ** 2).reshape(batch) / p.square()
        var = torch.where(done, var, var + level_var)
        levels = torch.where(done, levels, levels + 1)
        stalled = torch.where(~done & (new_tau >= tau) & torch.isfinite(tau), stalled + 1, torch.zeros_like(stalled))
        done = done | (new_tau == 0)
        tau = new_tau
        finished, stuck = torch.stack([done.all(), (stalled >= STALL_LEVELS).any()]).tolist()  # one host read
        if finished:
            return log_z, inflation * var.sqrt(), levels
        if stuck:
            raise _stalled(stalled >= STALL_LEVELS, log_z, tau, batch)
        # refill: resample the kept draws of each batch element, then move them within B(tau)
        weights = inside.to(torch.float64).flatten(1).T if batch else inside.to(torch.float64)[None]
        idx = torch.multinomial(weights, num, replacement=True, generator=generator)  # (B_flat, num)
        parent = idx
        flat = z.reshape(num, -1, z.shape[-1])
        seeds = flat.gather(0, idx.T[..., None].expand(num, -1, z.shape[-1])).reshape(z.shape)
        seeds = torch.minimum(torch.maximum(seeds, level_lo), level_hi)
        z = kernel(level_lo, level_hi, seeds, iterations)
    raise RuntimeError(_unreached_message(done, log_z, tau, batch, keep))


def _stalled(stuck: Tensor, log_z: Tensor, tau: Tensor, batch: torch.Size) -> StalledLevels:
    """The :class:`StalledLevels` of the first stuck batch element."""
    flat = int(stuck.reshape(-1).nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), batch)) if len(batch) else ()
    bound, width = float(log_z.reshape(-1)[flat]), float(tau.reshape(-1)[flat])
    return StalledLevels(
        f"subset_log_normaliser: the levels of batch element {index} made no progress for {STALL_LEVELS} levels in a "
        f"row, stuck at the box widened by {width:.3g} conditional standard deviations (log P(box | plane) <= "
        f"{bound:.6g} so far): the kernel stopped moving the population, which collapsed onto copies of one draw. "
        "Its estimate would say nothing; a kernel that mixes on this law is needed.", index, width, bound)


def _unreached_message(done: Tensor, log_z: Tensor, tau: Tensor, batch: torch.Size, keep: float) -> str:
    """The error of :func:`subset_log_normaliser` when :data:`MAX_LEVELS` levels did not reach the box: the first
    batch element left, the upper bound on its ``log Z`` that the levels reached (the probability of the last
    widened box), and how far that box still was from the box."""
    flat = int((~done).reshape(-1).nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), batch)) if len(batch) else ()
    bound, width = float(log_z.reshape(-1)[flat]), float(tau.reshape(-1)[flat])
    return (f"subset_log_normaliser: the box was not reached in {MAX_LEVELS} levels of keep = {keep} for batch "
            f"element {index}: log P(box | plane) is below {bound:.6g} (the last level's box was still the box widened "
            f"by {width:.3g} conditional standard deviations on each side); {MAX_LEVELS} levels resolve log P down to "
            f"about {MAX_LEVELS * math.log(keep):.6g}. The model's mean is very far from "
            "the box: move it closer (or widen the bounds) before asking for log Z or log_prob's value.")
