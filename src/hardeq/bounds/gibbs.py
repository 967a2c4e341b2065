r"""Random-partition blocked Gibbs sampling of a diagonal Gaussian on the plane :math:`Az = k` truncated to a box.

The target is the law of :math:`z \sim \mathcal N(\mu, \Sigma)` given :math:`Az = k` and :math:`l \le z \le u`,
for a **diagonal** :math:`\Sigma = \mathrm{diag}(v)`. On the plane its density is proportional to the unconditional
one, :math:`\exp(-\tfrac12\sum_i (z_i - \mu_i)^2 / v_i)` times the box's indicator, and the sampler only ever
evaluates that (:math:`\mu` is the user's ``loc``, in float64: no conditional mean, no factorisation).

**One sweep.**

1. A random partition of the coordinates into disjoint blocks :math:`S_1, \dots, S_B`, drawn independently of the
   state (shared by every chain and batch element):

   * a **grouped sum** constraint (``constraint.group_index`` is not ``None``: every coordinate in one row, with
     coefficient 1; :class:`~hardeq.SumConstraint`): blocks are random pairs :math:`(i, j)` inside one group (a
     random permutation of each group, paired in order; the last member of an odd group stays put that sweep),
     with direction :math:`d = e_i - e_j`. A group of one is never moved: the constraint fixes its value;
   * any other constraint with :math:`a \le` :data:`GIBBS_MAX_ROWS` rows and :math:`a n \le`
     :data:`GIBBS_MAX_DENSE_ELEMENTS` entries per batch element of ``A`` (:class:`~hardeq.LinearConstraint`, a
     :class:`~hardeq.SparseConstraint` with few rows: its ``(a, n)`` dense copy is made once): blocks of
     :math:`a + 1` coordinates (a random permutation cut in ``n // (a + 1)`` blocks; the ``n mod (a + 1)`` left
     over stay put that sweep), with :math:`d_b` the unit null vector of :math:`A_{:,S_b}` (``a x (a + 1)``): the
     last column of the complete float64 QR of :math:`A_{:,S_b}^\top`, which lies in the null space whatever the
     rank of the block. A coordinate the constraint determines (zero variance on the plane) gets :math:`d_i = 0`.

   :math:`Ad_b = 0`, so every move stays on the plane. Even sweeps draw the partition uniformly; odd sweeps draw a
   *stratified* one (the coordinates sorted by a score the parameters fix, jittered, then cut in blocks: pressed
   coordinates pair with pressed ones, free with free; see ``_Blocks``). Neither looks at the state.
2. Every block moves along its line, :math:`z \leftarrow z + \sum_b t_b d_b`, with :math:`(t_1, \dots, t_B)` drawn
   from their joint conditional law. Because :math:`\Sigma` is diagonal and the blocks are disjoint, that law
   **factorises**: :math:`t_b \sim \mathcal N(-\beta_b/\alpha_b, 1/\alpha_b)` truncated to the chord
   :math:`[t^-_b, t^+_b]` on which :math:`l \le z + t d_b \le u`, with

   .. math:: \alpha_b = \sum_{i \in S_b} d_i^2 / v_i, \qquad \beta_b = \sum_{i\in S_b} d_i (z_i - \mu_i) / v_i,
             \qquad t^-_b = \max_{i} \tfrac{(l_i \text{ or } u_i) - z_i}{d_i}, \quad t^+_b = \min_i (\dots).

   All blocks, chains and batch elements are drawn at once: a sweep is a handful of vectorised O(n) kernels
   (gathers, one scatter, one batch of 1-D truncated normal draws) plus, for a dense ``A``, one batched QR of
   ``n / (a + 1)`` matrices of size ``(a + 1) x a`` (O(n a^2), shared by the chains).

**What is exact.** For a fixed partition the sweep is an exact Gibbs update of :math:`(t_1, \dots, t_B)` (it leaves
the target invariant); the partition is drawn independently of the state, so a sweep is a mixture of such kernels
and leaves the target invariant too. The chain's stationary law is therefore exactly the truncated conditional; a
draw after finitely many sweeps is distributed as the target only when the start is (use ``burn_in``, several
chains and :attr:`GibbsResult.ess` / :attr:`GibbsResult.rhat`). The 1-D draws are exact in float64
(:func:`truncated_standard_normal`). Feasibility is exact for every draw: each move is clamped into the box,
the state (float64) is re-projected onto the plane every :data:`REPROJECT_EVERY` sweeps (a round-off move:
:math:`z \leftarrow z - VA^\top(AVA^\top)^{-1}(Az - k)`, then clamped), and each recorded draw is
:meth:`~hardeq.linalg.conditioning.Conditioner.condition`-ed in the working dtype and clamped into the box: every
bound met exactly, every row of :math:`Az = k` within the untruncated distribution's per-row tolerance.

**Limits.** Diagonal covariances only (for a low-rank, full or block-diagonal :math:`\Sigma` the blocks'
conditionals do not factorise: use exact HMC, :func:`~hardeq.bounds.exact_hmc`). Mixing is that of a coordinate
sampler: it slows when the box couples coordinates strongly along the plane (a narrow, oblique polytope; or a
block whose chord is pinched by one tight coordinate: large dense blocks, :math:`a` close to
:data:`GIBBS_MAX_ROWS`, are pinched more often), and when scales differ wildly within a group the large
coordinates move mostly when paired with each other. It does *not* slow where coordinates are pressed against a
wall (a mean many standard deviations outside the box), where exact HMC bounces without end.

**Cost per sweep**, per chain and batch element: O(n) for a grouped sum, O(n a) for a dense ``A`` (plus the shared
O(n a^2) QR); the re-projection every :data:`REPROJECT_EVERY` sweeps costs the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .diagnostics import effective_sample_size, split_rhat
from .hmc import MIN_DRAWS_FOR_DIAGNOSTICS, _box, _check_int, _check_start

if TYPE_CHECKING:
    from ..constraints.base import EqualityConstraint
    from ..distributions.normal import ConstrainedNormal

__all__ = ["GIBBS_MAX_DENSE_ELEMENTS", "GIBBS_MAX_ROWS", "GibbsResult", "blocked_gibbs", "gibbs_unsupported",
           "truncated_standard_normal"]

#: largest number of constraint rows a non-grouped constraint may have for the Gibbs sampler (blocks of a + 1)
GIBBS_MAX_ROWS = 64
#: largest ``a * n`` of the dense float64 copy of ``A`` (per batch element of ``A``) the sampler makes (128 MiB)
GIBBS_MAX_DENSE_ELEMENTS = 1 << 24
#: sweeps between two round-off re-projections of the state onto the plane
REPROJECT_EVERY = 64
#: a standardised interval entirely beyond this many standard deviations is drawn by exponential rejection
DEEP_TAIL = 30.0
#: ``width * max(|a|, |b|)`` at or below which an interval is drawn by uniform rejection (acceptance >= e^-0.5)
NARROW = 0.5
#: jitter of the stratified partitions (odd sweeps), as a fraction of the range of the sorted score
STRATA_JITTER = 0.1
#: rounds of the rejection samplers of :func:`truncated_standard_normal` (each accepts with probability >= 0.6)
MAX_ROUNDS = 200
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
        blocks (int): blocks moved per sweep (per chain and batch element).
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


# ---------------------------------------------------------------------------------------------- 1-D draws
def _uniform_open(shape: torch.Size, like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Uniform draws in the open interval (0, 1), float64 (``rand`` is in [0, 1 - 2^-53]: shift by 2^-54)."""
    return torch.rand(shape, dtype=_F64, device=like.device, generator=generator) + 2.0 ** -54


def _reject(lo: Tensor, hi: Tensor, propose: str, generator: torch.Generator | None, max_rounds: int) -> Tensor:
    r"""Exact draws of the standard normal on ``[lo, hi]`` (1-D tensors) by rejection (Robert 1995).

    ``propose="uniform"``: uniform on the interval, accepted with probability
    :math:`\exp(-(x^2 - c^2)/2)` (:math:`c`: the point of the interval nearest 0); for narrow intervals.
    ``propose="exponential"``: for ``lo >= DEEP_TAIL``, the translated exponential of rate
    :math:`\lambda = (lo + \sqrt{lo^2 + 4})/2` truncated to the interval (drawn by its inverse CDF), accepted with
    probability :math:`\exp(-(x - \lambda)^2/2)`. Only the pending draws are redrawn each round."""
    out = torch.empty_like(lo)
    pending = torch.arange(lo.numel(), device=lo.device)
    if propose == "uniform":
        near = torch.where(hi < 0, hi, torch.where(lo > 0, lo, torch.zeros_like(lo)))
    else:
        rate = 0.5 * (lo + torch.sqrt(lo * lo + 4.0))
        span = torch.expm1(-rate * (hi - lo))                # -(1 - e^{-rate (hi - lo)}); -1 for hi = inf
    for _ in range(max_rounds):
        if pending.numel() == 0:
            return out
        u = _uniform_open(pending.shape, lo, generator)
        w = _uniform_open(pending.shape, lo, generator)
        a, b = lo[pending], hi[pending]
        if propose == "uniform":
            x = torch.minimum(a + u * (b - a), b)
            c = near[pending]
            log_accept = -0.5 * (x - c) * (x + c)
        else:
            r = rate[pending]
            x = torch.minimum(a - torch.log1p(u * span[pending]) / r, b)
            log_accept = -0.5 * (x - r) ** 2
        ok = torch.log(w) <= log_accept
        out[pending[ok]] = x[ok]
        pending = pending[~ok]
    if pending.numel() == 0:
        return out
    worst = int(pending[0])
    raise RuntimeError(f"truncated_standard_normal: {pending.numel()} draws were still rejected after {max_rounds} "
                       f"rounds of the {propose} proposal (each accepts with probability >= 0.6), e.g. the interval "
                       f"[{float(lo[worst]):.17g}, {float(hi[worst]):.17g}]; this signals a non-finite or corrupted "
                       "input.")


def truncated_standard_normal(lower: Tensor, upper: Tensor, *, generator: torch.Generator | None = None,
                              max_rounds: int = MAX_ROUNDS) -> Tensor:
    r"""Exact draws of :math:`\mathcal N(0, 1)` truncated to ``[lower, upper]``, elementwise, in float64.

    Robust in the tails and for narrow intervals. Each interval is first reflected, if needed, so that
    :math:`a + b \le 0` (its mass lies on the lower side); then

    * a **narrow** interval, :math:`(b - a)\max(|a|, |b|) \le` :data:`NARROW` (including a single point
      :math:`a = b`, drawn as itself): uniform proposal with rejection (acceptance at least :math:`e^{-1/2}`);
    * an interval **beyond** :data:`DEEP_TAIL` standard deviations (:math:`b < -30`): Robert's (1995) exponential
      proposal with rejection (acceptance above 0.99 there), exact at any depth (tested at 1e3 sd);
    * otherwise the **inverse CDF** in log space: with :math:`\ell_a = \log\Phi(a)`, :math:`\ell_b = \log\Phi(b)`
      (``torch.special.log_ndtr``) and :math:`U \sim \mathcal U(0, 1)`,
      :math:`x = \Phi^{-1}\big(\exp(\ell_b + \log(1 + (1 - U)(e^{\ell_a - \ell_b} - 1)))\big)`
      (``ndtri``, ``log1p``, ``expm1``), clamped into :math:`[a, b]` against round-off.

    Args:
        lower, upper (Tensor): broadcastable real tensors, ``lower <= upper``, infinite entries allowed (but not
            ``lower = upper = ±inf``).
        generator: for the uniform draws.
        max_rounds (int): rounds of the rejection samplers before a ``RuntimeError`` (each accepts with probability
            at least 0.6, so the default 200 is never reached with finite inputs).

    Returns:
        Tensor: the draws, float64, of the broadcast shape; every one in ``[lower, upper]``.

    Raises:
        TypeError: non-tensor or non-floating inputs. ValueError: nan, ``lower > upper``, or an empty interval at
        infinity. RuntimeError: a rejection sampler exceeded ``max_rounds``.

    Cost: O(1) per element (a few transcendental functions; the rejection samplers touch only their elements).

    Examples:
        >>> from hardeq.bounds.gibbs import truncated_standard_normal
        >>> x = truncated_standard_normal(torch.tensor([40.0, -1.0, 3.0]), torch.tensor([math.inf, 1.0, 3.0]),
        ...                               generator=torch.Generator().manual_seed(0))
        >>> bool(x[0] >= 40.0 and x[0] < 40.2), bool(abs(x[1]) <= 1.0), float(x[2])
        (True, True, 3.0)
    """
    for name, value in (("lower", lower), ("upper", upper)):
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                            f"{type(value).__name__ if not isinstance(value, Tensor) else value.dtype}.")
    max_rounds = _check_int("max_rounds", max_rounds, 1)
    a, b = torch.broadcast_tensors(lower.detach().to(_F64), upper.detach().to(_F64))
    if bool((torch.isnan(a) | torch.isnan(b)).any()):
        raise ValueError("lower and upper must not contain nan.")
    bad = (a > b) | (a == math.inf) | (b == -math.inf)
    if bool(bad.any()):
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise ValueError(f"truncated_standard_normal needs lower <= upper with a finite point in between; at index {i} "
                         f"the interval is [{float(a[i]):.6g}, {float(b[i]):.6g}].")
    return _draw(a, b, generator, max_rounds)


def _draw(a: Tensor, b: Tensor, generator: torch.Generator | None, max_rounds: int) -> Tensor:
    """:func:`truncated_standard_normal` on float64 tensors of one shape, without the argument checks."""
    shape = a.shape
    a, b = a.reshape(-1), b.reshape(-1)
    flip = (a + b) > 0                                       # nan for (-inf, inf): no flip
    lo, hi = torch.where(flip, -b, a), torch.where(flip, -a, b)   # now lo + hi <= 0, so lo <= 0 and |lo| >= |hi|
    narrow = (hi - lo) * (-lo) <= NARROW                     # nan (inf * 0 cannot occur: lo < hi there) -> False
    narrow |= lo == hi
    deep = ~narrow & (hi < -DEEP_TAIL)
    # inverse CDF for every element (the others are overwritten below)
    u = _uniform_open(lo.shape, lo, generator)
    l_lo, l_hi = torch.special.log_ndtr(lo), torch.special.log_ndtr(hi)
    log_p = l_hi + torch.log1p((1.0 - u) * torch.expm1(l_lo - l_hi))
    x = torch.special.ndtri(torch.exp(log_p))
    x = torch.minimum(torch.maximum(x, lo), hi)
    if bool(narrow.any()):
        idx = narrow.nonzero().squeeze(-1)
        x[idx] = _reject(lo[idx], hi[idx], "uniform", generator, max_rounds)
    if bool(deep.any()):
        idx = deep.nonzero().squeeze(-1)
        x[idx] = -_reject(-hi[idx], -lo[idx], "exponential", generator, max_rounds)
    x = torch.where(flip, -x, x)
    return torch.minimum(torch.maximum(x, a), b).reshape(shape)


# ---------------------------------------------------------------------------------------------- the blocks
def gibbs_unsupported(dist: ConstrainedNormal) -> str | None:
    """Why :func:`blocked_gibbs` cannot sample ``dist`` (a sentence naming ``method="hmc"``), or ``None`` when it
    can: a diagonal covariance and a grouped-sum constraint, or any constraint with at most :data:`GIBBS_MAX_ROWS`
    rows and :data:`GIBBS_MAX_DENSE_ELEMENTS` entries (per batch element of ``A``) for its dense copy. O(1).

    Examples:
        >>> from hardeq.bounds import gibbs_unsupported
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([1.0]))
        >>> print(gibbs_unsupported(ConstrainedNormal(torch.zeros(3), 1.0, constraint=total)))
        None
        >>> full = ConstrainedNormal(torch.zeros(3), scale_tril=torch.eye(3), constraint=total)
        >>> gibbs_unsupported(full)[:56]
        "method='gibbs' needs a diagonal covariance (the blocks' "
    """
    cov = dist.covariance
    if not cov.is_diagonal:
        return (f"method='gibbs' needs a diagonal covariance (the blocks' conditional laws factorise only then), got "
                f"{type(cov).__name__}; use method='hmc' (exact HMC works with every covariance).")
    con = dist.constraint
    if con.group_index is not None:
        return None
    a, n = con.num_constraints, con.event_size
    if a > GIBBS_MAX_ROWS or a * n > GIBBS_MAX_DENSE_ELEMENTS:
        return (f"method='gibbs' moves blocks of a + 1 coordinates along null vectors of a dense copy of A, which it "
                f"allows for a <= {GIBBS_MAX_ROWS} rows and a * n <= {GIBBS_MAX_DENSE_ELEMENTS} entries; got "
                f"{type(con).__name__} with a = {a}, n = {n}; use method='hmc'.")
    return None


class _Blocks:
    """The random partition of one sweep and the blocks' directions, for one constraint (no n x n matrix).

    Even sweeps draw a uniformly random partition; odd sweeps a *stratified* one: the coordinates sorted by a score
    fixed by the parameters (never by the state), with a random jitter of :data:`STRATA_JITTER` of the range, then
    cut in blocks, so that coordinates alike in that score share blocks. The score is, for a grouped sum, how far the
    mean lies outside the box in standard deviations (pressed coordinates pair with pressed ones, free with free:
    the free ones then meet every other sweep however few they are); for a dense ``A``, the norm of the coordinate's
    column (a column much larger than its block's moves little along the block's null vector). Either choice is
    independent of the state, so each sweep still leaves the target invariant."""

    def __init__(self, constraint: EqualityConstraint, frozen: Tensor | None, device: torch.device,
                 pressure: Tensor) -> None:
        n = constraint.event_size
        self.n, self.device = n, device
        index = constraint.group_index
        self.grouped = index is not None
        if index is not None:
            sizes = constraint.group_sizes
            assert sizes is not None  # (declared with group_index)
            self.single = sizes.numel() == 1
            self.key = index.to(device=device, dtype=_F64)
            sorted_groups = index.sort().values.to(device)
            sizes = sizes.to(device)
            starts = torch.cumsum(sizes, 0) - sizes
            pos = torch.arange(n, device=device) - starts[sorted_groups]
            #: sorted positions that open a pair (the next sorted position is its partner, in the same group)
            self.first = ((pos % 2 == 0) & (pos + 1 < sizes[sorted_groups])).nonzero().squeeze(-1)
            self.size, self.count = 2, int(self.first.numel())
            self.direction: Tensor = torch.tensor([1.0, -1.0], dtype=_F64, device=device)
            score = pressure
        else:
            self.A = constraint.dense_rows().detach().to(device=device, dtype=_F64)        # (*bA, a, n)
            self.size = constraint.num_constraints + 1
            self.count = n // self.size
            self.frozen = frozen if frozen is not None and bool(frozen.any()) else None
            score = self.A.norm(dim=-2).reshape(-1, n).mean(0)
        flat = score.reshape(-1, n)
        if bool((flat == flat[0]).all()):                               # one partition for the whole batch
            score = flat[0]
        rank = torch.argsort(torch.argsort(score, dim=-1, stable=True), dim=-1).to(_F64) / n
        #: stratified sort key without its jitter, in [0, 1) within a group: ``(n,)`` or ``(*batch, n)``
        self.rank = rank / (1.0 + STRATA_JITTER)

    def draw(self, generator: torch.Generator | None, sweep: int) -> tuple[Tensor, Tensor]:
        """``(blocks, directions)``: ``(B, s)`` or ``(*batch, B, s)`` coordinate indices (shared or per batch
        element) and their directions, ``(s,)`` or ``(*batch, B, s)`` float64 (unit null vectors of
        ``A[:, S_b]``)."""
        shape = self.rank.shape
        if sweep % 2 == 1:
            jitter = torch.rand(shape, dtype=_F64, device=self.device, generator=generator)
            key = self.rank + jitter * (STRATA_JITTER / (1.0 + STRATA_JITTER))
            perm = torch.argsort(key + self.key if self.grouped else key, dim=-1)
        elif self.grouped and not self.single:
            perm = torch.argsort(self.key + torch.rand(self.n, dtype=_F64, device=self.device, generator=generator))
        else:
            perm = torch.randperm(self.n, device=self.device, generator=generator)
        if self.grouped:
            blocks = torch.stack([perm[..., self.first], perm[..., self.first + 1]], dim=-1)
            return blocks, self.direction
        blocks = perm[: self.count * self.size].view(self.count, self.size)
        sub = self.A[..., blocks].movedim(-3, -2)                        # (*bA, B, a, s)
        q = torch.linalg.qr(sub.mT, mode="complete")[0]                  # (*bA, B, s, s)
        d = q[..., -1]                                                   # (*bA, B, s): A[:, S_b] d = 0
        if self.frozen is not None:
            d = d.masked_fill(self.frozen[..., blocks], 0.0)
        return blocks, d


class _Projector:
    r"""The float64 round-off move :math:`z \leftarrow z - VA^\top(AVA^\top)^{-1}(Az - k)` (then clamped)."""

    def __init__(self, constraint: EqualityConstraint, variance: Tensor, blocks: _Blocks) -> None:
        self.con = constraint.to(dtype=_F64)
        self.v = variance
        self.grouped = blocks.grouped
        if self.grouped:
            self.gram = self.con.matvec(variance)                        # (*batch, a): per-group sums of v
        else:
            A = blocks.A
            gram = (A * variance.unsqueeze(-2)) @ A.mT                   # (*batch, a, a)
            self.chol = torch.linalg.cholesky(gram)

    def __call__(self, z: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
        r = self.con.matvec(z) - self.con.k                              # (C, *batch, a)
        if self.grouped:
            y = r / self.gram
        else:
            y = torch.cholesky_solve(r.unsqueeze(-1), self.chol).squeeze(-1)
        z = z - self.v * self.con.rmatvec(y)
        return torch.minimum(torch.maximum(z, lo), hi)


def _diagnostics(samples: Tensor) -> tuple[Tensor, Tensor]:
    """ESS and split R-hat of ``samples`` ``(draws, chains, *event)``, ``(*event)`` each, computed over chunks of the
    flattened event so that the FFTs of the autocovariances stay near 2^23 numbers (64 MiB) at a time."""
    flat = samples.flatten(2)
    step = max(1, (1 << 23) // (samples.shape[0] * samples.shape[1]))
    parts = [(effective_sample_size(flat[..., i: i + step]), split_rhat(flat[..., i: i + step]))
             for i in range(0, flat.shape[-1], step)]
    ess = torch.cat([p[0] for p in parts]).reshape(samples.shape[2:])
    rhat = torch.cat([p[1] for p in parts]).reshape(samples.shape[2:])
    return ess, rhat


@torch.no_grad()
def blocked_gibbs(dist: ConstrainedNormal, lower: Tensor | float | None, upper: Tensor | float | None,
                  start: Tensor, *, num_samples: int, burn_in: int = 100, thin: int = 1,
                  generator: torch.Generator | None = None) -> GibbsResult:
    r"""Random-partition blocked Gibbs draws of ``dist`` (:math:`z \mid Az = k`, diagonal covariance) truncated to
    ``lower <= z <= upper``.

    See the module docstring for the move, what is exact (the stationary law; every draw is feasible), the limits
    and the cost. Runs ``burn_in + num_samples * thin`` sweeps of all chains and batch elements at once and keeps
    every ``thin``-th after the burn-in. No gradient flows through the draws.

    Args:
        dist (ConstrainedNormal): the untruncated conditional law, batch shape ``B``, event size ``n``, with a
            diagonal covariance (``dist.covariance.is_diagonal``).
        lower, upper: bounds broadcastable to ``B + (n,)`` (tensors, numbers or ``None``), ``-inf`` / ``+inf``
            where unbounded; a value that the working dtype cannot represent is rounded inward.
        start (Tensor): ``(chains, *B, n)``, feasible: inside the box and on the plane (each row of
            :math:`Az = k` to within :math:`\sqrt\varepsilon` relative; it is projected onto the plane, a
            round-off move). E.g. the mode, or rejection draws.
        num_samples (int): draws kept per chain (>= 1).
        burn_in (int): sweeps discarded first (>= 0).
        thin (int): keep every ``thin``-th sweep after the burn-in (>= 1).
        generator: for the partitions and the 1-D draws.

    Returns:
        GibbsResult: ``samples`` ``(num_samples, chains, *B, n)`` in the working dtype of ``dist`` (float32 for
        half-precision inputs), ``ess`` and ``rhat`` ``(*B, n)``, ``sweeps``, ``block_size``, ``blocks``,
        ``method="gibbs"``.

    Raises:
        TypeError: ``dist`` is not a ConstrainedNormal, or an argument has the wrong type.
        ValueError: a covariance that is not diagonal or a constraint the sampler cannot handle (the message names
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
    from ..distributions.normal import ConstrainedNormal

    if not isinstance(dist, ConstrainedNormal):
        raise TypeError(f"dist must be a hardeq.ConstrainedNormal, got {type(dist).__name__}.")
    reason = gibbs_unsupported(dist)
    if reason is not None:
        raise ValueError(reason)
    num_samples = _check_int("num_samples", num_samples, 1)
    burn_in = _check_int("burn_in", burn_in, 0)
    thin = _check_int("thin", thin, 1)

    cond = dist.conditioner
    dtype = cond.dtype
    shape = dist.batch_shape + dist.event_shape
    device = dist._unbroadcasted_loc.device
    lo, hi = _box(lower, upper, shape, dtype, device)
    constraint = cond.constraint
    z = _check_start(start, shape, lo, hi, constraint, dtype, device).to(_F64)
    lo64, hi64 = lo.to(_F64), hi.to(_F64)
    mu = dist._unbroadcasted_loc.detach().to(_F64).expand(shape)
    var = cond.cov.variance.detach().to(_F64).expand(shape)
    frozen = None
    if constraint.group_index is None:  # coordinates the constraint determines: no motion (d_i = 0)
        eps = torch.finfo(dtype).eps
        frozen = cond.variance().detach().expand(shape) <= 16 * eps * cond.cov.variance.detach().expand(shape)
    pressure = (torch.maximum(lo64 - mu, mu - hi64).clamp_min(0.0) / var.sqrt()).nan_to_num(0.0)
    blocks_of = _Blocks(constraint, frozen, device, pressure)
    project = _Projector(constraint, var, blocks_of)
    z = project(z, lo64, hi64)
    if not bool(torch.isfinite(z).all()):
        raise RuntimeError("blocked_gibbs: the start is not finite after projection onto the plane.")

    sweeps = burn_in + num_samples * thin
    samples = torch.empty((num_samples,) + z.shape, dtype=dtype, device=device)
    for sweep in range(sweeps):
        blocks, d = blocks_of.draw(generator, sweep)                     # ([*batch,] Bk, s); (s,) or (*batch, Bk, s)
        if blocks.dim() == 2:                                            # one partition for the batch
            x = z[..., blocks]                                           # (C, *batch, Bk, s)
            m_b, v_b, lo_b, hi_b = mu[..., blocks], var[..., blocks], lo64[..., blocks], hi64[..., blocks]
        else:                                                            # one per batch element
            idx = blocks.flatten(-2)
            wide = idx.expand(z.shape[:-1] + idx.shape[-1:])
            x = z.gather(-1, wide).view(z.shape[:-1] + blocks.shape[-2:])
            m_b, v_b, lo_b, hi_b = (t.gather(-1, idx).view(blocks.shape) for t in (mu, var, lo64, hi64))
        dv = d / v_b                                                     # (*batch, Bk, s)
        alpha = (d * dv).sum(-1)                                         # (*batch, Bk)
        beta = ((x - m_b) * dv).sum(-1)                                  # (C, *batch, Bk)
        up, down = d > 0, d < 0
        q_lo, q_hi = (lo_b - x) / d, (hi_b - x) / d
        t_lo = torch.where(up, q_lo, torch.where(down, q_hi, -math.inf)).amax(-1).clamp_max(0.0)
        t_hi = torch.where(up, q_hi, torch.where(down, q_lo, math.inf)).amin(-1).clamp_min(0.0)
        moving = alpha > 0
        root = torch.where(moving, alpha, 1.0).sqrt()
        centre = torch.where(moving, -beta / root.square(), 0.0)
        a_std = torch.where(moving, (t_lo - centre) * root, 0.0)
        b_std = torch.where(moving, (t_hi - centre) * root, 0.0)
        step = centre + _draw(a_std, b_std, generator, MAX_ROUNDS) / root
        step = torch.where(moving, torch.minimum(torch.maximum(step, t_lo), t_hi), 0.0)
        moved = torch.minimum(torch.maximum(x + step.unsqueeze(-1) * d, lo_b), hi_b)
        z = z.index_copy(-1, blocks.reshape(-1), moved.flatten(-2)) if blocks.dim() == 2 else z.scatter(
            -1, wide, moved.flatten(-2))
        record = sweep >= burn_in and (sweep - burn_in) % thin == thin - 1
        if sweep % REPROJECT_EVERY == REPROJECT_EVERY - 1 or record:
            z = project(z, lo64, hi64)
            if sweep % REPROJECT_EVERY == REPROJECT_EVERY - 1 and not bool(torch.isfinite(z).all()):
                raise RuntimeError(f"blocked_gibbs: the state became non-finite at sweep {sweep}; check that loc, "
                                   "the covariance and the bounds are finite where they matter.")
        if record:
            out = cond.condition(z.to(dtype))
            samples[(sweep - burn_in) // thin] = torch.maximum(torch.minimum(out, hi), lo)
    if num_samples >= MIN_DRAWS_FOR_DIAGNOSTICS:
        ess, rhat = _diagnostics(samples)
    else:
        ess = torch.full(shape, math.nan, dtype=torch.float64, device=device)
        rhat = ess.clone()
    return GibbsResult(samples=samples, ess=ess, rhat=rhat, sweeps=sweeps, block_size=blocks_of.size,
                       blocks=blocks_of.count)
