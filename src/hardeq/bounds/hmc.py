r"""Exact Hamiltonian Monte Carlo for a Gaussian on the plane :math:`Az = k` truncated to a box.

The target is the law of :math:`z \sim \mathcal N(\mu, \Sigma)` given :math:`Az = k` and
:math:`l \le z \le u`: on the plane, the conditional Gaussian :math:`\mathcal N(\bar\mu, \bar\Sigma)`
(:math:`\bar\mu = \mu + K(k - A\mu)`, :math:`\bar\Sigma = (I - KA)\Sigma`, :math:`K = \Sigma A^\top S^{-1}`,
:math:`S = A\Sigma A^\top`; rank :math:`n - a`) restricted to the box. The sampler is Pakman and Paninski's (2014)
exact HMC, run on the plane without ever forming :math:`\bar\Sigma`:

* **Trajectory.** In whitened null-space coordinates :math:`z = \bar\mu + Fw` (:math:`FF^\top = \bar\Sigma`) the
  Hamiltonian :math:`\tfrac12|w|^2 + \tfrac12|p|^2` has the solution :math:`w(t) = w_0\cos t + p_0\sin t`. Mapped
  back with :math:`F`, the deviation :math:`x = z - \bar\mu` moves as :math:`x(t) = x_0\cos t + v_0\sin t`,
  :math:`v(t) = v_0\cos t - x_0\sin t`, where the velocity :math:`v_0 = Fp_0`, :math:`p_0 \sim \mathcal N(0, I)`,
  is a centred draw of the untruncated conditional: :math:`v_0 = (I - KA)\Sigma^{1/2}\varepsilon`
  (:math:`\mathrm{cov} = \bar\Sigma`; it lies in the plane, :math:`Av_0 = 0`).
* **Wall times.** Coordinate :math:`i` moves as :math:`x_i(t) = R_i\cos(t - \varphi_i)` with
  :math:`R_i = |(x_{0i}, v_{0i})|`, :math:`\varphi_i = \mathrm{atan2}(v_{0i}, x_{0i})`. It crosses a wall
  :math:`x_i = c` (:math:`c = l_i - \bar\mu_i` or :math:`u_i - \bar\mu_i`) iff :math:`R_i \ge |c|`; going down at
  :math:`t = \varphi_i + \alpha` (the lower wall) and up at :math:`t = \varphi_i - \alpha` (the upper wall), modulo
  :math:`2\pi`, with :math:`\alpha = \arccos(c/R_i) = \mathrm{atan2}(\sqrt{R_i^2 - c^2}, c)` and
  :math:`R_i^2 - c^2 = (x_{0i} - c)(x_{0i} + c) + v_{0i}^2` (accurate next to the wall, where :math:`\arccos`
  is not).
* **Reflection.** At the earliest wall :math:`i` over all coordinates the velocity is reflected on the wall's
  normal in the metric of the plane: with :math:`w_i = \bar\Sigma e_i = (I - KA)\Sigma e_i` (the normal
  :math:`e_i` mapped to the plane by the conditioner's gain),
  :math:`v \leftarrow v - 2\,(v_i / w_{ii})\,w_i`, so :math:`v_i \leftarrow -v_i`, :math:`Av` stays 0 and the
  energy :math:`v^\top\bar\Sigma^+v` is kept. :math:`w_i` is one column of :math:`\Sigma` (one covariance
  product with :math:`e_i`: O(n) diagonal, O(n r) low rank, O(n^2) full, per block for block-diagonal) and one
  application of :math:`I - KA` (O(n) grouped sums, O(n a) dense, O(nnz) sparse); :math:`n \times n` is never
  formed.
* **Round-off.** After each bounce the position and the velocity are projected back onto the plane
  (:math:`x \leftarrow (I - KA)x`, likewise :math:`v`; twice in float32, as iterative refinement), the hit
  coordinate is set exactly to its bound and the reflected velocity component exactly to :math:`-v_i` (a move along
  :math:`w_i`, which stays in the plane). A wall just hit is excluded for :math:`t < 64\varepsilon`
  (grazing hits); a coordinate found at or beyond a wall and moving out of the box is reflected at once.
* **Corners.** A start on several walls at once (a vertex or an edge of the polytope: the mode usually is one)
  can need many zero-time reflections before the velocity points into the box: a billiard in the tangent cone,
  finite in exact arithmetic but long when the cone is narrow (about :math:`\pi/\theta` reflections for a wedge
  of angle :math:`\theta`, and scale ratios make :math:`\theta` small). After ``2 n + 8`` consecutive
  zero-time reflections the velocity of that trajectory is redrawn (:attr:`HMCResult.corner_refreshes` counts
  them). A trajectory meets a corner only from such a start (an event of probability zero under the target), so
  the stationary law is unchanged.
* **Capped trajectories.** A coordinate that sits on a wall its Gaussian pulls it into hops off that wall every
  :math:`2|v_\perp|/g` (:math:`v_\perp` its velocity across the wall, :math:`g` the pull): the number of bounces of
  a trajectory is proportional to :math:`1/|v_\perp|`, whose expectation is infinite under a Gaussian velocity.
  The portfolio study's long-only variant met this (the mean 6 standard deviations below 0 in 38 of 50
  coordinates: over 15,000 bounces in one trajectory). A trajectory that reaches ``max_bounces`` is therefore
  **rejected**: its chain stays where the iteration started. This keeps the stationary law exact: the exact
  flow is reversible, so a trajectory and its time reversal have the same number of bounces, and the move restricted
  to the trajectories under the cap is still a measure-preserving involution (and the identity elsewhere).
  :attr:`HMCResult.capped` counts them; a chain whose trajectories are mostly capped mixes slowly, which
  :attr:`HMCResult.ess` and :attr:`HMCResult.rhat` show, and a warning names the fraction when it exceeds 1%.
  Each recorded draw is :meth:`~hardeq.linalg.conditioning.Conditioner.condition`-ed (every row of
  :math:`Az = k` within the untruncated distribution's per-row tolerance) and clamped into the box, a round-off
  move: **every draw is exactly feasible**.
* **Iterations.** Each iteration draws a fresh velocity and a travel time uniform in ``travel_time`` (random, so
  that no trajectory is periodic), and moves every chain and batch element at once: each step of the event loop
  advances every trajectory to the earlier of its next wall and its end, and reflects those that hit.

**What is exact.** The chain's stationary law is exactly the truncated conditional (the moves are reversible and
volume-preserving Hamiltonian flows with a Gibbs refresh of the velocity); a draw after finitely many iterations is
distributed exactly as the target only when the start is (Pakman and Paninski 2014). Use ``burn_in``, several
chains and the diagnostics (:attr:`HMCResult.ess`, :attr:`HMCResult.rhat`). Feasibility, by contrast, is exact
for every draw.

**Cost per bounce**, per chain and batch element: O(n) for the wall times (a few transcendental functions per
coordinate), plus the normal :math:`w_i` and the projections of :math:`x` and :math:`v`: O(n) for a grouped-sum
constraint with a diagonal covariance, O(n a) for a dense ``A``, O(nnz) sparse, plus the covariance column
(O(n^2) for a full covariance). The event loop runs until the chain with the most bounces has finished, so chains
and batch elements with few bounces idle in lock-step with the busiest one.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import _box, _check_int, _check_start
from .diagnostics import effective_sample_size, split_rhat
from .hmc_plane import _hit_times, _Plane
from .target import PlaneTarget

__all__ = ["ChainStuck", "HMCResult", "exact_hmc", "MIN_DRAWS_FOR_DIAGNOSTICS"]


class ChainStuck(RuntimeError):
    """A chain of :func:`exact_hmc` never moved: every one of its trajectories reached ``max_bounces`` and was
    rejected, so its draws would all be copies of its start. The message names the batch element and the thin
    direction (the coordinate whose width in the box is smallest against its conditional standard deviation).
    ``method="gibbs"`` (blocked Gibbs has no bounces) moves there.

    Examples:
        >>> from hardeq.bounds import exact_hmc
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([1.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total)
        >>> lo, hi = torch.full((3,), 0.3, dtype=torch.float64), torch.full((3,), 0.4, dtype=torch.float64)
        >>> exact_hmc(d, lo, hi, torch.full((2, 3), 1 / 3, dtype=torch.float64), num_samples=1, burn_in=2,
        ...           max_bounces=1, generator=torch.Generator().manual_seed(0))  # every trajectory capped
        Traceback (most recent call last):
            ...
        hardeq.bounds.hmc.ChainStuck: exact_hmc: chain 0 of batch element () never moved: all 3 of its ...
    """

#: fewer draws per chain than this and :attr:`HMCResult.ess` / :attr:`HMCResult.rhat` are ``nan`` (not estimable)
MIN_DRAWS_FOR_DIAGNOSTICS = 4


@dataclass
class HMCResult:
    """What :func:`exact_hmc` returns.

    Attributes:
        samples (Tensor): ``(num_samples, chains, *batch, n)``: every entry in ``[lower, upper]`` exactly and
            every row of ``A z = k`` within the untruncated distribution's per-row tolerance.
        bounces (int): the total number of wall hits over all chains, batch elements and iterations (burn-in
            included).
        ess (Tensor): effective sample size of each coordinate over all chains, ``(*batch, n)`` float64
            (:func:`~hardeq.bounds.diagnostics.effective_sample_size`); ``nan`` with fewer than
            :data:`MIN_DRAWS_FOR_DIAGNOSTICS` draws per chain.
        rhat (Tensor): split :math:`\\hat R` of each coordinate, ``(*batch, n)`` float64
            (:func:`~hardeq.bounds.diagnostics.split_rhat`); ``nan`` likewise.
        trajectories (int): the number of trajectories run (chains x batch elements x iterations);
            ``bounces / trajectories`` is the mean number of bounces per trajectory.
        corner_refreshes (int): velocities redrawn in a corner (see the module docstring; 0 unless a chain
            started on several walls at once).
        method (str): ``"hmc"``.
        capped (int): trajectories rejected because they reached ``max_bounces`` (their chains kept their
            position for that iteration; see the module docstring).
        steps (int): steps of the event loop over all iterations (each advances every chain to its next wall or
            its end: about the most bounces of a chain per iteration, plus one); what the cost follows.

    Examples:
        >>> from hardeq.bounds import exact_hmc
        >>> total = SumConstraint(torch.zeros(2, dtype=torch.long), torch.tensor([1.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(2, dtype=torch.float64), 1.0, constraint=total)
        >>> start = torch.full((2, 2), 0.5, dtype=torch.float64)  # 2 chains on the plane, inside the box
        >>> res = exact_hmc(d, 0.0, 1.0, start, num_samples=10, burn_in=5, generator=torch.Generator().manual_seed(0))
        >>> res.method, res.samples.shape, res.ess.shape, res.trajectories  # 2 chains x 15 iterations
        ('hmc', torch.Size([10, 2, 2]), torch.Size([2]), 30)
    """

    samples: Tensor
    bounces: int
    ess: Tensor
    rhat: Tensor
    trajectories: int = 0
    corner_refreshes: int = 0
    method: str = "hmc"
    capped: int = 0
    steps: int = 0


def exact_hmc(dist: object, lower: Tensor, upper: Tensor, start: Tensor, *, num_samples: int,
              burn_in: int = 100,
              thin: int = 1, travel_time: tuple[float, float] = (math.pi / 8, math.pi / 2),
              generator: torch.Generator | None = None, max_bounces: int | None = None,
              allow_stuck: bool = False) -> HMCResult:
    r"""Exact HMC draws of ``dist`` (:math:`z \mid Az = k`) truncated to ``lower <= z <= upper``.

    See the module docstring for the method, what is exact (the stationary law; every draw is feasible) and the
    cost per bounce. Runs ``burn_in + num_samples * thin`` iterations of all chains and batch elements at once and
    keeps every ``thin``-th after the burn-in. No gradient flows through the draws.

    Args:
        dist (ConstrainedNormal | PlaneTarget): the untruncated conditional law, batch shape ``B``, event size
            ``n`` (:class:`~hardeq.bounds.target.PlaneTarget`).
        lower, upper: bounds broadcastable to ``B + (n,)`` (tensors, numbers or ``None``), ``-inf`` / ``+inf``
            where unbounded; a value that the working dtype cannot represent is rounded inward.
        start (Tensor): ``(chains, *B, n)``, feasible: inside the box and on the plane (each row of
            :math:`Az = k` to within :math:`\sqrt\varepsilon` relative; it is projected onto the plane, a
            round-off move). E.g. the mode, or rejection draws.
        num_samples (int): draws kept per chain (>= 1).
        burn_in (int): iterations discarded first (>= 0).
        thin (int): keep every ``thin``-th iteration after the burn-in (>= 1).
        travel_time: ``(t_min, t_max)``, ``0 < t_min <= t_max``: each trajectory runs for a time uniform in it
            (:math:`\pi/2` is a quarter period: an unbounded Gaussian trajectory then draws independently).
        generator: for the velocities and travel times.
        max_bounces (int, optional): bounces allowed in one trajectory; a trajectory that reaches it is rejected
            (its chain keeps its position for that iteration), which keeps the stationary law exact (module
            docstring) and bounds the cost of an iteration. A trajectory of time :math:`\pi/2` rarely needs more
            than a few bounces per coordinate near a wall. Default ``20 n + 200``.
        allow_stuck (bool): return chains that never moved (every trajectory capped) instead of raising
            :class:`ChainStuck` (for a caller that only needs an invariant kernel, as subset simulation does).

    Returns:
        HMCResult: ``samples`` ``(num_samples, chains, *B, n)`` in the working dtype of ``dist`` (float32 for
        half-precision inputs), ``bounces``, ``trajectories``, ``ess`` and ``rhat`` ``(*B, n)``, ``method="hmc"``.

    Raises:
        TypeError: ``dist`` is not a ConstrainedNormal, or an argument has the wrong type.
        ValueError: shapes that do not match, ``lower > upper`` somewhere, a start outside the box (the message
            gives the number of entries and the worst one) or off the plane, a bad ``travel_time``.
        RuntimeError: the state became non-finite (e.g. inf bounds on both sides of a coordinate with a
            non-finite mean).
        ChainStuck (a ``RuntimeError``): some chain never moved (every trajectory capped; a polytope far thinner than
            the conditional standard deviation), unless ``allow_stuck``.

    Warns:
        RuntimeWarning: more than 1% of the trajectories were capped at ``max_bounces`` (slow mixing).

    Examples:
        >>> from hardeq.bounds import exact_hmc, truncated_mode
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64), 1.0, constraint=total)
        >>> lower, upper = torch.zeros(3, dtype=torch.float64), torch.full((3,), 1.5, dtype=torch.float64)
        >>> start = truncated_mode(d, lower, upper).expand(4, 3)  # 4 chains, all at the mode
        >>> res = exact_hmc(d, lower, upper, start, num_samples=50, burn_in=20,
        ...                 generator=torch.Generator().manual_seed(0))
        >>> z = res.samples
        >>> z.shape, bool(((z >= 0) & (z <= 1.5)).all()), bool(total.check(z).all())
        (torch.Size([50, 4, 3]), True, True)
    """
    target = PlaneTarget.of(dist)
    num_samples = _check_int("num_samples", num_samples, 1)
    burn_in = _check_int("burn_in", burn_in, 0)
    thin = _check_int("thin", thin, 1)
    try:
        t_min, t_max = (float(t) for t in travel_time)
    except (TypeError, ValueError):
        raise TypeError(f"travel_time must be a pair of numbers (t_min, t_max), got {travel_time!r}.") from None
    if not (0.0 < t_min <= t_max < math.inf):
        raise ValueError(f"travel_time must satisfy 0 < t_min <= t_max < inf, got ({t_min}, {t_max}).")

    plane = _Plane(target)
    dtype, mean = plane.dtype, plane.mean
    shape, device = mean.shape, mean.device
    n = shape[-1]
    lo, hi = _box(lower, upper, shape, dtype, device)
    if max_bounces is None:
        max_bounces = 20 * n + 200
    max_bounces = _check_int("max_bounces", max_bounces, 1)

    z0 = _check_start(start, shape, lo, hi, plane.constraint, dtype, device)

    S = start.shape[:-1]                                   # (chains, *batch): one trajectory each
    x = plane.project(z0 - mean)
    lo_x, hi_x = (lo - mean).expand(x.shape), (hi - mean).expand(x.shape)
    movable = ~plane.frozen.expand(x.shape)
    movable_lo, movable_hi = movable & torch.isfinite(lo_x), movable & torch.isfinite(hi_x)
    window = 64 * torch.finfo(dtype).eps
    corner_limit = 2 * n + 8
    total_bounces, total_capped, total_steps, draws = 0, 0, 0, []
    refreshes = torch.zeros((), dtype=torch.long, device=device)  # (read once, at the end)
    moved = torch.zeros(start.shape[:-1], dtype=torch.bool, device=device)   # a trajectory of the chain was kept
    iterations = burn_in + num_samples * thin
    for iteration in range(iterations):
        v = plane.velocity(S, generator)
        remaining = t_min + (t_max - t_min) * torch.rand(S, dtype=dtype, device=device, generator=generator)
        last = torch.full(S, -1, dtype=torch.long, device=device)      # wall just hit: i (lower) or n + i (upper)
        active = torch.ones(S, dtype=torch.bool, device=device)
        count = torch.zeros(S, dtype=torch.long, device=device)
        stuck = torch.zeros(S, dtype=torch.long, device=device)   # consecutive zero-time bounces (in a corner)
        x_start = x
        capped = torch.zeros(S, dtype=torch.bool, device=device)  # reached max_bounces: rejected, back to x_start
        while True:
            total_steps += 1
            t_lo, t_hi = _hit_times(x, v, lo_x, hi_x, movable_lo, movable_hi)
            times = torch.cat([t_lo, t_hi], dim=-1)                    # (*S, 2n)
            recent = last.clamp_min(0).unsqueeze(-1)
            grazing = (last >= 0).unsqueeze(-1) & (times.gather(-1, recent) < window)
            times = times.scatter(-1, recent, torch.where(grazing, math.inf, times.gather(-1, recent)))
            wall = times.argmin(-1)
            t_hit = times.gather(-1, wall.unsqueeze(-1)).squeeze(-1)
            hit = active & (t_hit < remaining)
            dt = torch.where(hit, t_hit, torch.where(active, remaining, 0.0)).unsqueeze(-1)
            c, s = torch.cos(dt), torch.sin(dt)
            x, v = x * c + v * s, v * c - x * s
            remaining = remaining - dt.squeeze(-1)
            count += hit
            over = hit & (count >= max_bounces)
            stuck = torch.where(hit & ~over & (t_hit < window), stuck + 1, 0)
            corner = stuck > corner_limit
            # the event's one host read: any bounce left, any trajectory capped, any chain in a corner
            any_hit, any_over, any_corner = torch.stack([hit.any(), over.any(), corner.any()]).tolist()
            if not any_hit:
                break
            if any_over:  # rejected: stop these trajectories; they return to x_start below
                capped = capped | over
                hit = hit & ~over
            j = wall % n
            is_upper = wall >= n
            jj = j.unsqueeze(-1)
            # one projection of the stacked position, velocity and Sigma e_j: (I - KA) [x, v, Sigma e_j]
            x_new, v_proj, w = plane.project(torch.stack([x, v, plane.column(j)]))
            w_j = w.gather(-1, jj)
            v_j = v_proj.gather(-1, jj)
            v_new = v_proj - (2.0 * v_j / w_j) * w
            v_new = v_new + ((-v_j - v_new.gather(-1, jj)) / w_j) * w       # v_j -> -v_j exactly, in the plane
            bound = torch.where(is_upper.unsqueeze(-1), hi_x.gather(-1, jj), lo_x.gather(-1, jj))
            x_new = x_new.scatter(-1, jj, bound)
            keep = hit.unsqueeze(-1)
            x, v = torch.where(keep, x_new, x), torch.where(keep, v_new, v)
            last = torch.where(hit, wall, -1)
            active = hit
            if any_corner:  # a start on several walls: refresh the velocity (see the module docstring)
                v = torch.where(corner.unsqueeze(-1), plane.velocity(S, generator), v)
                stuck = stuck.masked_fill(corner, 0)
                last = last.masked_fill(corner, -1)
                refreshes = refreshes + corner.sum()
        moved |= ~capped
        x = torch.where(capped.unsqueeze(-1), x_start, x)
        # the iteration's one host read: the bounces, the capped trajectories, the state's finiteness
        bounces, n_capped, finite = torch.stack([count.sum(), capped.sum(), torch.isfinite(x).all()]).tolist()
        total_bounces, total_capped = total_bounces + int(bounces), total_capped + int(n_capped)
        if not finite:
            raise RuntimeError(f"exact_hmc: the state became non-finite at iteration {iteration}; check that loc, "
                               "the covariance and the bounds are finite where they matter.")
        if iteration >= burn_in and (iteration - burn_in) % thin == thin - 1:
            z = plane.cond.condition(mean + x)
            draws.append(torch.maximum(torch.minimum(z, hi), lo))
    if not allow_stuck and not bool(moved.all()):
        _raise_stuck(moved, plane, lo, hi, iterations, max_bounces)
    samples = torch.stack(draws)
    if num_samples >= MIN_DRAWS_FOR_DIAGNOSTICS:
        ess, rhat = effective_sample_size(samples), split_rhat(samples)
    else:
        ess = torch.full(shape, math.nan, dtype=torch.float64, device=device)
        rhat = ess.clone()
    trajectories = iterations * S.numel()
    total_refreshes = int(refreshes)
    if total_capped > 0.01 * trajectories:
        warnings.warn(f"exact_hmc: {total_capped} of {trajectories} trajectories ({total_capped / trajectories:.1%}) "
                      f"reached max_bounces = {max_bounces} and were rejected; the chains mix slowly (check ess and "
                      "rhat), e.g. where the mean lies far outside the box in many coordinates.", RuntimeWarning,
                      stacklevel=2)
    return HMCResult(samples=samples, bounces=total_bounces, ess=ess, rhat=rhat, trajectories=trajectories,
                     corner_refreshes=total_refreshes, method="hmc", capped=total_capped, steps=total_steps)


def _raise_stuck(moved: Tensor, plane: _Plane, lo: Tensor, hi: Tensor, iterations: int, max_bounces: int) -> None:
    """:class:`ChainStuck` for the first chain that never moved, naming why for its batch element: the thin
    direction (the coordinate narrowest against its conditional standard deviation) when one is under a standard
    deviation wide, else the coordinate pressed hardest against a wall (its conditional mean beyond it)."""
    index = tuple(int(i) for i in (~moved).nonzero()[0])
    chain, element = index[0], index[1:]
    sd = plane.cond.variance().detach().expand(lo.shape).clamp_min(0.0).sqrt()[element]
    frozen = plane.frozen[element]
    ratio = torch.where(frozen, math.inf, (hi[element] - lo[element]) / sd)
    i = int(ratio.argmin())
    head = (f"exact_hmc: chain {chain} of batch element {element} never moved: all {iterations} of its trajectories "
            f"reached max_bounces = {max_bounces} and were rejected, so its draws would be copies of its start. ")
    if float(ratio[i]) < 1.0:
        why = (f"The polytope is thin against the conditional standard deviations: coordinate {i} has width "
               f"{float(hi[element][i] - lo[element][i]):.3g} in the box against a conditional standard deviation of "
               f"{float(sd[i]):.3g} (ratio {float(ratio[i]):.3g}). ")
    else:
        mean = plane.mean[element]
        press = torch.where(frozen, -math.inf, torch.maximum(lo[element] - mean, mean - hi[element]) / sd)
        j = int(press.argmax())
        why = (f"No direction is thin (the narrowest, coordinate {i}, is {float(ratio[i]):.3g} standard deviations "
               f"wide); the trajectories bounce without end on walls their mean lies beyond: coordinate {j}'s "
               f"conditional mean is {float(press[j]):.3g} standard deviations outside the box. ")
    raise ChainStuck(head + why + "Use method='gibbs' (no bounces), or method='auto'.")
