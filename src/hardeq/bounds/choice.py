r"""``method="auto"``: the sampler with the most effective samples per second on a short pilot.

:func:`choose_method` scores each applicable sampler by its **effective samples per modelled second** for the run
asked for (``chains`` chains of a law with ``B`` batch elements and ``n`` coordinates) and returns the best:

* **rejection**, where the acceptance (measured by the caller's pilot, or exact) is at least the threshold: iid draws,
  so ``num`` effective draws for ``num / acceptance`` untruncated ones;
* **gibbs**, where :func:`~hardeq.bounds.gibbs.gibbs_unsupported` is ``None``: :data:`PILOT_BURN` + :data:`PILOT_KEPT`
  sweeps of :data:`PILOT_CHAINS` chains from the chains' start; effective draws per sweep and chain from the lag-1
  autocorrelation (:func:`_per_step`), the median over coordinates and batch elements;
* **hmc**: the same with :data:`HMC_BURN` + :data:`HMC_KEPT` trajectories; its cost follows the event loop's
  steps (:attr:`~hardeq.bounds.hmc.HMCResult.steps`). Its pilot caps the bounces of a trajectory at the most with
  which HMC could still beat the best so far (a capped trajectory is rejected, and its chain stays), so that the pilot
  never runs the thousands of bounces where coordinates press against a wall.

**Modelled seconds, not the clock**, so that the choice is a function of the pilot's draws alone and the same
``generator`` gives the same choice (a timing would not). The model (:func:`seconds`) is a per-step overhead plus a
cost per number in the state, calibrated on the CPU at 1 thread (a 2-core machine at load 2-6: a Gibbs sweep about
1 ms + 0.7 us per chain-coordinate, an HMC event step about 2.5 ms + 0.9 us per chain-coordinate, an untruncated draw
for rejection about 0.3 us per coordinate).

Cost of the pilot: with at most :data:`PILOT_CHAINS` = 4 chains, 24 Gibbs sweeps and, where HMC could win, 12 HMC
trajectories of at most the capped number of bounces each (0.14-0.18 s for both on a 6-coordinate problem); the
draws come from the ``generator``.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from .checks import StartOffPlane
from .gibbs import blocked_gibbs, gibbs_unsupported
from ..linalg.covariance import FullCovariance
from .hmc import exact_hmc
from .target import PlaneTarget

__all__ = ["HMC_BURN", "HMC_KEPT", "PILOT_BURN", "PILOT_CHAINS", "PILOT_KEPT", "PILOT_SEED", "choose_method",
           "seconds"]

#: chains of each pilot (fewer if the run asks for fewer)
PILOT_CHAINS = 4
#: sweeps discarded, then kept, in the Gibbs pilot ...
PILOT_BURN, PILOT_KEPT = 10, 14
#: ... and trajectories in the HMC pilot
HMC_BURN, HMC_KEPT = 4, 8
#: the seed of the Gibbs pilot's partition choices (drawing one from the generator would be a host read; the pilot's
#: 1-D draws still come from the generator)
PILOT_SEED = 0

# the cost model (seconds): per step, and per chain-coordinate per step
_GIBBS = (1.0e-3, 0.7e-6)
_HMC = (2.5e-3, 0.9e-6)
_REJECTION = (1.0e-3, 0.3e-6)


def seconds(method: str, *, numbers: int, steps: float = 1.0, rows: int = 1, width: int = 0,
            dense: int = 0) -> float:
    """Modelled seconds of ``steps`` steps of ``method`` over ``numbers`` chain-coordinates (chains x batch x n;
    for rejection, the untruncated draws x batch x n): ``rows`` constraint rows, ``width`` the augmentation's rank,
    ``dense`` the ``n`` of a full covariance (HMC's covariance column costs O(n) more per coordinate), else 0."""
    if method == "gibbs":
        fixed, per = _GIBBS
        per *= 1.0 + width / 8.0
    elif method == "hmc":
        fixed, per = _HMC
        per *= (1.0 + rows / 8.0) * (1.0 + dense / 16.0)
    else:
        fixed, per = _REJECTION
        per *= 1.0 + rows / 8.0
    return steps * (fixed + per * numbers)


def _jumps(samples: Tensor) -> Tensor:
    """Mean squared jump between consecutive kept draws, per coordinate: ``(draws, chains, *batch, n)`` ->
    ``(*batch, n)``."""
    x = samples.double()
    return (x[1:] - x[:-1]).square().mean(dim=(0, 1))


def _per_step(jumps: Tensor, variance: Tensor) -> Tensor:
    r"""Effective draws per step from the lag-1 autocorrelation :math:`\rho = 1 - J / (2 \sigma^2)` (``J`` the mean
    squared jump, :math:`\sigma^2` the pooled variance of both pilots' draws), as for an AR(1) chain:
    :math:`(1 - \rho) / (1 + \rho)`; the (lower) median over coordinates and batch elements, coordinates that never
    vary left out (NaN where none varies: read as 0). A 0-d float64 tensor, computed on the device (no host read)."""
    rho = (1.0 - jumps / (2.0 * variance)).clamp(0.0, 1.0)
    r = ((1.0 - rho) / (1.0 + rho)).flatten()
    return torch.where(variance.flatten() > 0, r, torch.nan).nanmedian()


def _read(values: list[Tensor]) -> list[float]:
    """The host values of 0-d tensors, in ONE read (a stacked float64 copy); NaN read as 0."""
    out: list[float] = torch.stack([v.reshape(()).to(torch.float64) for v in values]).tolist()
    return [0.0 if math.isnan(v) else v for v in out]


def choose_method(dist: object, lower: Tensor, upper: Tensor, mode: Tensor, *, num: int, chains: int,
                  acceptance: float | Tensor, threshold: float, generator: torch.Generator | None,
                  burn_in: int = 100, thin: int = 1,
                  start_verdict: Tensor | None = None) -> tuple[str, dict[str, float]]:
    """``(method, scores)``: the method with the most effective samples per modelled second (module docstring) and
    each candidate's score (effective draws per modelled second of the run asked for: ``num`` draws from ``chains``
    chains after ``burn_in`` steps, every ``thin``-th kept). ``mode`` ``(*batch, n)`` is the chains' start;
    ``acceptance`` the acceptance of rejection (a number, or a tensor over the batch whose smallest value counts).

    Host reads: one, holding the acceptance, the Gibbs pilot's score and its checks (the Gibbs pilot itself reads
    nothing: its partitions' seed is :data:`PILOT_SEED`, its checks deferred into that read); where the cap lets
    HMC's pilot run, that pilot's own reads and one more for the pooled scores. ``start_verdict`` (a 0-d bool
    tensor, a certificate of ``mode`` computed without a read) is read in the same read; False raises
    :class:`~hardeq.bounds.checks.StartOffPlane` before anything is chosen."""
    target = PlaneTarget.of(dist)
    n, B = target.event_size, max(1, target.batch_shape.numel())
    con, cov = target.constraint, target.covariance
    rows = 1 if con.group_index is not None else con.num_constraints
    part = None if cov.is_diagonal else cov.factor_part()
    width = 0 if cov.is_diagonal else (n if part is None else int(part.shape[-1]))
    dense = n if isinstance(cov, FullCovariance) else 0
    per_chain = max(1, math.ceil(num / chains))
    kept = per_chain / (burn_in + per_chain * thin)            # draws recorded per step: one more step's cost each
    pilot = max(1, min(chains, PILOT_CHAINS))
    start = mode.expand((pilot,) + tuple(mode.shape)).contiguous()
    draws: dict[str, Tensor] = {}
    pending = [acceptance.min() if isinstance(acceptance, Tensor)
               else torch.tensor(float(acceptance), dtype=torch.float64, device=mode.device)]
    if gibbs_unsupported(target) is None:
        checks: list[Tensor] = []
        draws["gibbs"] = blocked_gibbs(target, lower, upper, start, num_samples=PILOT_KEPT, burn_in=PILOT_BURN,
                                       generator=generator, seed=PILOT_SEED, deferred=checks).samples
        z = draws["gibbs"]
        pending += [_per_step(_jumps(z), z.double().flatten(0, 1).var(0)), checks[0]]
    if start_verdict is not None:
        pending.append(start_verdict)
    values = _read(pending)                                    # the one read of the decision
    if start_verdict is not None:
        if not values.pop():
            raise StartOffPlane("choose_method: the start's certificate (start_verdict) is False.")
    if len(values) == 3 and not values[2]:                    # a bad start or a non-finite state: the precise error
        blocked_gibbs(target, lower, upper, start, num_samples=PILOT_KEPT, burn_in=PILOT_BURN, generator=generator)
    scores: dict[str, float] = {}
    if values[0] >= threshold:
        scores["rejection"] = num / seconds("rejection", numbers=int(math.ceil(num / values[0])) * B * n, rows=rows)
    if not draws and not scores:
        return "hmc", scores                                   # the only sampler that applies: no pilot
    sweep = seconds("gibbs", numbers=chains * B * n, width=width, steps=1.0 + kept)
    step = seconds("hmc", numbers=chains * B * n, rows=rows, dense=dense)
    own = {"gibbs": values[1]} if draws else {}
    best = max([scores.get("rejection", 0.0)] + [own[m] * chains / sweep for m in own])
    # the most steps per HMC iteration with which HMC (at most one effective draw per chain and iteration) could
    # win, with a margin of 2 for the pilot's own error
    cap = math.inf if best <= 0 else 2.0 * chains / best / step
    steps = 0.0
    if cap >= 4.0:                                             # else HMC cannot win: no HMC pilot
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            h = exact_hmc(target, lower, upper, start, num_samples=HMC_KEPT, burn_in=HMC_BURN,
                          generator=generator, max_bounces=int(min(cap, 20 * n + 200)), allow_stuck=True)
        draws["hmc"] = h.samples
        steps = h.steps / (HMC_BURN + HMC_KEPT) + kept
    if "hmc" not in draws:                                     # the pooled variance is Gibbs's own: no new read
        for m in own:
            scores[m] = own[m] * chains / sweep
        return max(scores, key=lambda m: scores[m]), scores
    variance = torch.cat([z.double().flatten(0, 1) for z in draws.values()]).var(0)
    names = list(draws)
    pers = _read([_per_step(_jumps(draws[m]), variance) for m in names])
    for m, per in zip(names, pers):
        scores[m] = per * chains / (sweep if m == "gibbs" else step * steps)
    method = max(scores, key=lambda m: scores[m])
    return method, scores
