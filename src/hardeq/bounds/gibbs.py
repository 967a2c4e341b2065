r"""Random-partition blocked Gibbs sampling of a Gaussian on the plane :math:`Az = k` truncated to a box.

Any covariance with a diagonal part, :math:`\Sigma = D + VV^\top` (low-rank, block-diagonal, full), is reduced to the
diagonal case below by data augmentation (:mod:`hardeq.bounds.augment`): each sweep first draws
:math:`u \mid z` (Gaussian) and then runs the diagonal sweep for :math:`\mathcal N(\mu + Vu, D)`; the rest of this
docstring describes that diagonal sweep.

The target is the law of :math:`z \sim \mathcal N(\mu, \Sigma)` given :math:`Az = k` and :math:`l \le z \le u`,
for a **diagonal** :math:`\Sigma = \mathrm{diag}(v)`. On the plane its density is proportional to the unconditional
one, :math:`\exp(-\tfrac12\sum_i (z_i - \mu_i)^2 / v_i)` times the box's indicator, and the sampler only ever
evaluates that (:math:`\mu` is the user's ``loc``, in float64: no conditional mean, no factorisation).

**One sweep.**

1. One partition of the coordinates into disjoint blocks :math:`S_1, \dots, S_B`, drawn independently of the state:
   entry ``k`` (uniform) of a pool of :math:`K` partitions drawn once per call with the generator
   (:class:`~hardeq.bounds.partition.Pool`: even entries uniformly random, odd entries *stratified*, coordinates
   alike in a score the parameters fix sharing blocks: pressed coordinates pair with pressed ones, free with free):

   * a **grouped sum** constraint (``constraint.group_index`` is not ``None``: every coordinate in one row, with
     coefficient 1; :class:`~hardeq.SumConstraint`): pairs :math:`(i, j)` of a random order of each group, direction
     :math:`d = e_i - e_j`; a pair that straddles two groups stays put (so a group of one never moves: the
     constraint fixes its value);
   * any other constraint with :math:`a \le` :data:`GIBBS_MAX_ROWS` rows and :math:`a n \le`
     :data:`GIBBS_MAX_DENSE_ELEMENTS` entries per batch element of ``A`` (:class:`~hardeq.LinearConstraint`, a
     :class:`~hardeq.SparseConstraint` with few rows: its ``(a, n)`` dense copy is made once): blocks of
     :math:`a + 1` coordinates (the ``n mod (a + 1)`` left over stay put), with :math:`d_b` the unit null vector of
     :math:`A_{:,S_b}` (``a x (a + 1)``, from one batched QR at setup), which lies in the null space whatever the
     rank of the block. A coordinate the constraint determines (zero variance on the plane) gets :math:`d_i = 0`.

   :math:`Ad_b = 0`, so every move stays on the plane. No sort, permutation or QR runs per sweep.
2. Every block moves along its line, :math:`z \leftarrow z + \sum_b t_b d_b`, with :math:`(t_1, \dots, t_B)` drawn
   from their joint conditional law. Because :math:`\Sigma` is diagonal and the blocks are disjoint, that law
   **factorises**: :math:`t_b \sim \mathcal N(-\beta_b/\alpha_b, 1/\alpha_b)` truncated to the chord
   :math:`[t^-_b, t^+_b]` on which :math:`l \le z + t d_b \le u`, with

   .. math:: \alpha_b = \sum_{i \in S_b} d_i^2 / v_i, \qquad \beta_b = \sum_{i\in S_b} d_i (z_i - \mu_i) / v_i,
             \qquad t^-_b = \max_{i} \tfrac{(l_i \text{ or } u_i) - z_i}{d_i}, \quad t^+_b = \min_i (\dots).

   All blocks, chains and batch elements are drawn at once by one fixed sequence of about 30 whole-batch kernels
   (:func:`hardeq.bounds.sweep.sweep`: a gather, the chord and :math:`\beta` in one pass, the exact 1-D draw, one
   scatter), with no Python per block and no host read; each sweep takes a view of one pool entry, and the uniforms are
   drawn for :data:`CHUNK_SWEEPS` sweeps at once.

**What is exact.** For a fixed partition the sweep is an exact Gibbs update of :math:`(t_1, \dots, t_B)` (it leaves
the target invariant); the partition is drawn independently of the state, so a sweep is a mixture of such kernels
and leaves the target invariant too. The chain's stationary law is therefore exactly the truncated conditional; a
draw after finitely many sweeps is distributed as the target only when the start is (use ``burn_in``, several
chains and :attr:`GibbsResult.ess` / :attr:`GibbsResult.rhat`). The 1-D draws are exact in float64
(the inverse CDF; beyond 35 standard deviations a Metropolis-Hastings step with a Rayleigh proposal, exact in
law: :mod:`hardeq.bounds.sweep`). Feasibility is exact for every draw: each move is clamped into the box,
the state (float64) is re-projected onto the plane every :data:`REPROJECT_EVERY` sweeps (a round-off move:
:math:`z \leftarrow z - VA^\top(AVA^\top)^{-1}(Az - k)`, then clamped), and each recorded draw is projected twice
more, cast to the working dtype and clamped into the box: every bound met exactly, every row of :math:`Az = k` within
the untruncated distribution's per-row tolerance.

**Limits.** A covariance must have a diagonal part (:func:`~hardeq.bounds.augment.augmentation_unsupported`);
through the augmentation the chain mixes more slowly where :math:`D` is small against :math:`VV^\top`. Mixing is
that of a coordinate sampler: it slows when the box couples coordinates strongly along the plane (a narrow, oblique
polytope; or a block whose chord is pinched by one tight coordinate: large dense blocks, :math:`a` close to
:data:`GIBBS_MAX_ROWS`, are pinched more often), and when scales differ wildly within a group the large
coordinates move mostly when paired with each other. It does *not* slow where coordinates are pressed against a
wall (a mean many standard deviations outside the box), where exact HMC bounces without end.

**Cost per sweep**, per chain and batch element: O(n) (O(n r) with an augmentation of rank ``r``), in at most 40
ATen calls (32-35 measured) whatever ``n``; the re-projection every :data:`REPROJECT_EVERY` sweeps costs O(n a).
**Host reads**: two per call (one batched check of the bounds and the start, one of the final state's finiteness),
none per sweep. **Setup**: the pool, ``K`` sorts of ``n`` keys and, for a dense ``A``, one batched QR of
``K n / (a + 1)`` small matrices; about ``K B n (11 + r / (a + 1))`` float64 numbers.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .augment import augmentation, augmentation_unsupported
from .diagnostics import ess_unchecked, rhat_unchecked
from .checks import StartOffPlane, _box, _check_int, _check_start
from .hmc import MIN_DRAWS_FOR_DIAGNOSTICS
from .partition import Pool, Projector
from .sweep import Constants
from .sweep import sweep as one_sweep
from .target import PlaneTarget
from .truncnorm import truncated_standard_normal

if TYPE_CHECKING:
    from ..constraints.base import EqualityConstraint

__all__ = ["GIBBS_MAX_DENSE_ELEMENTS", "GIBBS_MAX_ROWS", "GibbsResult", "blocked_gibbs", "gibbs_unsupported",
           "truncated_standard_normal"]

#: largest number of constraint rows a non-grouped constraint may have for the Gibbs sampler (blocks of a + 1)
GIBBS_MAX_ROWS = 64
#: largest ``a * n`` of the dense float64 copy of ``A`` (per batch element of ``A``) the sampler makes (128 MiB)
GIBBS_MAX_DENSE_ELEMENTS = 1 << 24
#: sweeps between two round-off re-projections of the state onto the plane
REPROJECT_EVERY = 64
#: sweeps whose uniforms are drawn at once ...
CHUNK_SWEEPS = 16
#: ... within this many float64 entries
CHUNK_ELEMENTS = 1 << 22
_F64 = torch.float64


@dataclass
class GibbsResult:
    """What :func:`blocked_gibbs` returns.

    Attributes:
        samples (Tensor): ``(num_samples, chains, *batch, n)`` in the working dtype of the distribution: every entry
            in ``[lower, upper]`` exactly and every row of ``A z = k`` within the untruncated per-row tolerance.
        ess (Tensor): effective sample size of each coordinate over all chains, ``(*batch, n)`` float64;
            ``nan`` with fewer than :data:`~hardeq.bounds.hmc.MIN_DRAWS_FOR_DIAGNOSTICS` draws per chain.
        rhat (Tensor): split :math:`\\hat R` of each coordinate, ``(*batch, n)`` float64; ``nan`` likewise.
        sweeps (int): sweeps run per chain (burn-in included).
        block_size (int): coordinates per block (2 for a grouped sum, ``a + 1`` otherwise).
        blocks (int): block slots per sweep (per chain and batch element): ``n // block_size`` (for a grouped sum,
            a pair that straddles two groups stays put).
        method (str): ``"gibbs"``.

    Examples:
        >>> from hardeq.bounds import blocked_gibbs
        >>> total = SumConstraint(torch.zeros(4, dtype=torch.long), torch.tensor([1.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(4, dtype=torch.float64), 1.0, constraint=total)
        >>> start = torch.full((3, 4), 0.25, dtype=torch.float64)  # 3 chains on the plane, inside the box
        >>> res = blocked_gibbs(d, 0.0, 1.0, start, num_samples=10, burn_in=5,
        ...                     generator=torch.Generator().manual_seed(0))
        >>> res.method, res.samples.shape, res.ess.shape, res.sweeps, res.block_size, res.blocks
        ('gibbs', torch.Size([10, 3, 4]), torch.Size([4]), 15, 2, 2)
    """

    samples: Tensor
    ess: Tensor
    rhat: Tensor
    sweeps: int
    block_size: int
    blocks: int
    method: str = "gibbs"


# ---------------------------------------------------------------------------------------------- the blocks
def gibbs_unsupported(dist: object) -> str | None:
    """Why :func:`blocked_gibbs` cannot sample ``dist`` (a sentence naming ``method="hmc"``), or ``None`` when it
    can: a covariance with a diagonal part (:func:`~hardeq.bounds.augment.augmentation_unsupported`: diagonal,
    low-rank, block-diagonal or full) and a grouped-sum constraint, or any constraint with at most
    :data:`GIBBS_MAX_ROWS` rows and :data:`GIBBS_MAX_DENSE_ELEMENTS` entries (per batch element of ``A``) for its
    dense copy. O(1).

    Examples:
        >>> from hardeq.bounds import gibbs_unsupported
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([1.0]))
        >>> print(gibbs_unsupported(ConstrainedNormal(torch.zeros(3), 1.0, constraint=total)))
        None
        >>> full = ConstrainedNormal(torch.zeros(3), scale_tril=torch.eye(3), constraint=total)
        >>> print(gibbs_unsupported(full))  # through the augmentation Sigma = D + V V^T
        None
    """
    target = PlaneTarget.of(dist)
    reason = augmentation_unsupported(target.covariance)
    if reason is not None:
        return f"method='gibbs': {reason}; use method='hmc' (exact HMC works with every covariance)."
    con = target.constraint
    if con.group_index is not None:
        return None
    a, n = con.num_constraints, con.event_size
    if a > GIBBS_MAX_ROWS or a * n > GIBBS_MAX_DENSE_ELEMENTS:
        return (f"method='gibbs' moves blocks of a + 1 coordinates along null vectors of a dense copy of A, which it "
                f"allows for a <= {GIBBS_MAX_ROWS} rows and a * n <= {GIBBS_MAX_DENSE_ELEMENTS} entries; got "
                f"{type(con).__name__} with a = {a}, n = {n}; use method='hmc'.")
    return None


def _diagnostics(samples: Tensor) -> tuple[Tensor, Tensor]:
    """ESS and split R-hat of ``samples`` ``(draws, chains, *event)``, ``(*event)`` each, computed over chunks of the
    flattened event so that the FFTs of the autocovariances stay near 2^23 numbers (64 MiB) at a time."""
    flat = samples.detach().to(_F64).flatten(2)               # finite: blocked_gibbs checked its state
    step = max(1, (1 << 23) // (samples.shape[0] * samples.shape[1]))
    parts = [(ess_unchecked(flat[..., i: i + step]), rhat_unchecked(flat[..., i: i + step]))
             for i in range(0, flat.shape[-1], step)]
    ess = torch.cat([p[0] for p in parts]).reshape(samples.shape[2:])
    rhat = torch.cat([p[1] for p in parts]).reshape(samples.shape[2:])
    return ess, rhat


@torch.no_grad()
def blocked_gibbs(dist: object, lower: Tensor | float | None, upper: Tensor | float | None,
                  start: Tensor, *, num_samples: int, burn_in: int = 100, thin: int = 1,
                  generator: torch.Generator | None = None, seed: int | None = None,
                  deferred: list[Tensor] | None = None, start_verdict: Tensor | None = None) -> GibbsResult:
    r"""Random-partition blocked Gibbs draws of ``dist`` (:math:`z \mid Az = k`) truncated to
    ``lower <= z <= upper``.

    See the module docstring for the move, what is exact (the stationary law; every draw is feasible), the limits
    and the cost. Runs ``burn_in + num_samples * thin`` sweeps of all chains and batch elements at once and keeps
    every ``thin``-th after the burn-in. No gradient flows through the draws.

    Args:
        dist (ConstrainedNormal | PlaneTarget): the untruncated conditional law, batch shape ``B``, event size
            ``n``, with a covariance with a diagonal part (diagonal; low-rank, block-diagonal or full through the
            augmentation).
        lower, upper: bounds broadcastable to ``B + (n,)`` (tensors, numbers or ``None``), ``-inf`` / ``+inf``
            where unbounded; a value that the working dtype cannot represent is rounded inward.
        start (Tensor): ``(chains, *B, n)``, feasible: inside the box and on the plane (each row of
            :math:`Az = k` to within :math:`\sqrt\varepsilon` relative; it is projected onto the plane, a
            round-off move). E.g. the mode, or rejection draws.
        num_samples (int): draws kept per chain (>= 1).
        burn_in (int): sweeps discarded first (>= 0).
        thin (int): keep every ``thin``-th sweep after the burn-in (>= 1).
        generator: for the partitions and the 1-D draws.
        seed (int | None): the seed of the partitions' choices (a Python stream); default drawn from
            ``generator`` (read on the host with the start's check).
        deferred (list | None): with ``seed`` given, the run makes no host read: the start's check and the
            state's finiteness are appended to this list as one 0-d bool tensor (True: fine) instead of read, and
            the caller reads it (rerunning without ``deferred`` raises the precise error). A pilot's form.
        start_verdict (Tensor | None): a 0-d bool tensor read with the start's check (no read of its own): a
            certificate the caller computed with the start, e.g. that it lies strictly inside the box
            (:class:`~hardeq.TruncatedConstrainedNormal`'s sync-free start); False raises
            :class:`~hardeq.bounds.checks.StartOffPlane`.

    Returns:
        GibbsResult: ``samples`` ``(num_samples, chains, *B, n)`` in the working dtype of ``dist`` (float32 for
        half-precision inputs), ``ess`` and ``rhat`` ``(*B, n)``, ``sweeps``, ``block_size``, ``blocks``,
        ``method="gibbs"``.

    Raises:
        TypeError: ``dist`` is not a ConstrainedNormal, or an argument has the wrong type.
        ValueError: a covariance or a constraint the sampler cannot handle (the message names
            ``method='hmc'``; :func:`gibbs_unsupported`), shapes that do not match, ``lower > upper`` somewhere,
            a start outside the box or off the plane.
        RuntimeError: the state became non-finite, or a 1-D rejection sampler exceeded its rounds.

    Examples:
        >>> from hardeq.bounds import blocked_gibbs, truncated_mode
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([1.0], dtype=torch.float64))
        >>> loc = torch.tensor([-3.0, -3.0, 0.5], dtype=torch.float64)       # two coordinates pressed against 0
        >>> d = ConstrainedNormal(loc, 0.5, constraint=total)
        >>> lower, upper = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        >>> start = truncated_mode(d, lower, upper).expand(4, 3)             # 4 chains, all at the mode
        >>> res = blocked_gibbs(d, lower, upper, start, num_samples=50, burn_in=20,
        ...                     generator=torch.Generator().manual_seed(0))
        >>> z = res.samples
        >>> z.shape, bool(((z >= 0) & (z <= 1)).all()), bool(total.check(z).all())
        (torch.Size([50, 4, 3]), True, True)
    """
    target = PlaneTarget.of(dist)
    reason = gibbs_unsupported(target)
    if reason is not None:
        raise ValueError(reason)
    num_samples = _check_int("num_samples", num_samples, 1)
    burn_in = _check_int("burn_in", burn_in, 0)
    thin = _check_int("thin", thin, 1)

    cond = target.conditioner
    dtype = cond.dtype
    shape = target.shape
    device = target.loc.device
    lo, hi = _box(lower, upper, shape, dtype, device, read=False)
    constraint = cond.constraint
    z0 = _check_start(start, shape, lo, hi, constraint, dtype, device, read=False)
    lo64, hi64 = lo.to(_F64), hi.to(_F64)
    mu = target.loc.detach().to(_F64).expand(shape)
    marginal = cond.cov.variance.detach().to(_F64).expand(shape)
    chains, n = z0.shape[0], shape[-1]
    B = max(1, target.batch_shape.numel())
    aug = None if cond.cov.is_diagonal else augmentation(cond.cov, target.batch_shape, n)
    var = marginal if aug is None else aug.diag.view(shape)
    frozen = None
    A = None
    if constraint.group_index is None:  # coordinates the constraint determines: no motion (d_i = 0)
        eps = torch.finfo(dtype).eps
        frozen = cond.variance().detach().expand(shape) <= 16 * eps * cond.cov.variance.detach().expand(shape)
        frozen = frozen.reshape(B, n)
        rows = constraint.dense_rows().detach().to(device=device, dtype=_F64)
        A = rows.reshape(1, *rows.shape[-2:]) if rows.dim() == 2 else \
            rows.expand(target.batch_shape + rows.shape[-2:]).reshape(B, *rows.shape[-2:])
    pressure = (torch.maximum(lo64 - mu, mu - hi64).clamp_min(0.0) / marginal.sqrt()).nan_to_num(0.0)
    def flat(t: Tensor) -> Tensor:
        return t.reshape(B, n)

    sweeps = burn_in + num_samples * thin
    pool = Pool(constraint, A, frozen, flat(pressure), flat(var), flat(mu), flat(lo64), flat(hi64), aug, generator,
                work=sweeps * chains)
    project = Projector(constraint, var)
    z = project(z0.to(_F64), lo64, hi64)
    # the one host read before the sweeps: the start and the bounds checked, the projected start finite, and the
    # seed of the partitions' choices (a Python stream: each sweep takes a view of one pool entry)
    fine = _all_fine(start, dtype, constraint, lo, hi, z)
    if start_verdict is not None:
        fine = fine & start_verdict
    defer = deferred is not None and seed is not None
    if not defer:
        drawn = torch.randint(0, 2 ** 62, (), device=device, generator=generator) if seed is None else fine.long()
        ok, seed_value = torch.stack([fine.long(), drawn]).tolist()
        if not ok:
            _raise_if_bad(lower, upper, start, shape, dtype, device, constraint, start_verdict)
        seed = seed_value if seed is None else seed
    choices = random.Random(seed)
    zb = z.reshape(chains, B, n).transpose(0, 1).contiguous()          # (B, C, n)

    consts = Constants(device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    samples = torch.empty((num_samples,) + z.shape, dtype=dtype, device=device)
    r = 0 if aug is None else aug.factor.shape[-1]
    Bk = pool.count
    chunk = max(1, min(CHUNK_SWEEPS, CHUNK_ELEMENTS // max(1, B * chains * (2 * Bk + r))))
    scale = torch.tensor([1.0, math.sqrt(2.0)], dtype=_F64, device=device)
    for first in range(0, sweeps, chunk):
        m = min(chunk, sweeps - first)
        c_unif = (torch.rand((m, B, chains, Bk, 2), dtype=_F64, device=device, generator=generator)
                  + 2.0 ** -54) * scale
        c_bias = None
        if aug is not None:
            eps_u = torch.randn((m, B, chains, r), dtype=_F64, device=device, generator=generator)
            c_bias = aug.bias(flat(mu), eps_u)
        for j in range(m):
            sweep = first + j
            k = choices.randrange(pool.K)                              # independent of the state
            zb = one_sweep(zb, pool.index[k], pool.slots[k], pool.roots[k], c_unif[j], consts,
                           None if c_bias is None else c_bias[j], None if aug is None else aug.gain,
                           None if pool.shares is None else pool.shares[k])
            record = sweep >= burn_in and (sweep - burn_in) % thin == thin - 1
            if sweep % REPROJECT_EVERY == REPROJECT_EVERY - 1 or record:
                z = project(zb.transpose(0, 1).reshape(z.shape), lo64, hi64)
                finite = finite & torch.isfinite(z).all()              # read once, after the last sweep
                zb = z.reshape(chains, B, n).transpose(0, 1).contiguous()
            if record:
                out = project(z, lo64, hi64).to(dtype)
                samples[(sweep - burn_in) // thin] = torch.maximum(torch.minimum(out, hi), lo)
    if defer:
        assert deferred is not None
        deferred.append(fine & finite)
    elif not bool(finite):
        raise RuntimeError("blocked_gibbs: the state became non-finite; check that loc, the covariance and the bounds "
                           "are finite where they matter.")
    if num_samples >= MIN_DRAWS_FOR_DIAGNOSTICS:
        ess, rhat = _diagnostics(samples)
    else:
        ess = torch.full(shape, math.nan, dtype=torch.float64, device=device)
        rhat = ess.clone()
    return GibbsResult(samples=samples, ess=ess, rhat=rhat, sweeps=sweeps, block_size=pool.size, blocks=pool.count)


def _all_fine(start: Tensor, dtype: torch.dtype, constraint: EqualityConstraint, lo: Tensor, hi: Tensor,
              z: Tensor) -> Tensor:
    """Whether the bounds (no nan, ``lo <= hi``), the start (in the box, on the plane) and the projected start
    (finite) are all fine: one boolean tensor, read with the seed."""
    z0 = start.detach().to(dtype)
    return ((lo <= hi).all() & ((z0 >= lo) & (z0 <= hi)).all()
            & constraint.check(z0, rtol=math.sqrt(torch.finfo(dtype).eps)).all() & torch.isfinite(z).all())


def _raise_if_bad(lower: object, upper: object, start: Tensor, shape: torch.Size, dtype: torch.dtype,
                  device: torch.device, constraint: EqualityConstraint, start_verdict: Tensor | None = None) -> None:
    """The checks that name the fault :func:`_all_fine` (and the caller's ``start_verdict``) found (they read
    more)."""
    lo, hi = _box(lower, upper, shape, dtype, device)
    _check_start(start, shape, lo, hi, constraint, dtype, device)
    if start_verdict is not None and not bool(start_verdict):
        raise StartOffPlane("blocked_gibbs: the start's certificate (start_verdict) is False.")
    raise RuntimeError("blocked_gibbs: the start is not finite after projection onto the plane.")
