r"""The normaliser :math:`Z = P(l \le z \le u \mid Az = k)` of :class:`~hardeq.TruncatedConstrainedNormal`: the
volume check that comes first, the exact line normaliser's direction, the sum-row normaliser, and the Monte Carlo
fraction of untruncated draws in the box with its subset-simulation fallback. A mixin of the distribution
(:class:`_NormaliserParts`); the public :attr:`~hardeq.TruncatedConstrainedNormal.log_normaliser`,
:attr:`~hardeq.TruncatedConstrainedNormal.log_normaliser_stderr` and
:attr:`~hardeq.TruncatedConstrainedNormal.acceptance` read it."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from ..bounds.mode import ModeNotFound, truncated_mode
from ..errors import NumericalWarning
from ..bounds.augment import split_is_structural
from ..bounds.gibbs import gibbs_unsupported
from ..bounds.normaliser import STDERR_INFLATION, StalledLevels, null_direction, subset_log_normaliser
from ..bounds.rejection import ROUND_ELEMENTS
from ..bounds.sum_normaliser import SumRowLayout, sum_row_layout, sum_row_log_normaliser
from ..bounds.mode_base import accept_rtol
from ..bounds.start_dual import dual_start
from ..bounds.volume import check_volume, shrunk_box
from .truncated_support import _Truncated

#: a batch element whose untruncated draws put fewer than this many in the box gets the subset-simulation
#: normaliser (:func:`~hardeq.bounds.normaliser.subset_log_normaliser`): the plain fraction's relative error would
#: exceed 1/8 (and with none inside it has no value at all)
SUBSET_BELOW_IN_BOX = 64
#: kernel moves per level of the subset-simulation normaliser
SUBSET_ITERATIONS = 4
#: how far (in nats) below what subset simulation's levels resolve an upper bound on log Z must lie before the
#: normaliser refuses at once (:meth:`_NormaliserParts._refuse_beyond_the_levels`)
BEYOND_LEVELS_MARGIN = 50.0
#: levels of subset simulation (each :data:`SUBSET_ITERATIONS` kernel moves of the whole population) from which a
#: normaliser that is provably that far in the tail warns before it starts: it will take minutes
SLOW_LEVELS = 100


class _NormaliserParts:
    """The normaliser's machinery of :class:`~hardeq.TruncatedConstrainedNormal` (cached in its ``_cache``)."""

    def _check_volume(self: _Truncated) -> None:
        """With two or more rows (not a grouped sum) and ``n - a >= 2``, whether a combination of rows and bounds
        leaves the polytope without volume or empty (:func:`~hardeq.bounds.volume.check_volume`): once, before
        anything that needs the density (the normaliser, :meth:`log_prob`, the samplers); :attr:`mode` does not
        need it and works on a face too."""
        if "volume" in self._cache:
            return
        base = self.base
        con = base.constraint
        if self._volume_in_question():
            def second_opinion(lo: Tensor, hi: Tensor) -> bool:
                try:
                    truncated_mode(base, lo.to(self._lo.dtype), hi.to(self._lo.dtype))
                except ModeNotFound:
                    return False
                return True

            with torch.no_grad():
                check_volume(con, base._unbroadcasted_loc, base.covariance.variance, self._lo, self._hi,
                             base.conditioner.variance(), self._lo.dtype, second_opinion)
        self._cache["volume"] = True

    def _volume_in_question(self: _Truncated) -> bool:
        """Can a combination of rows and bounds leave the polytope without volume (two or more rows that are not
        a grouped sum, ``n - a >= 2``), which no row-by-row check sees?"""
        con = self.base.constraint
        return self.free_dim >= 2 and con.group_index is None and con.num_constraints >= 2

    def _deferred_volume_check(self: _Truncated) -> Tensor | None:
        """The samplers' form of :meth:`_check_volume`, without a host read: where the volume is in question and not
        yet certified, a point of the plane strictly inside the box (the shrunk box of
        :func:`~hardeq.bounds.volume.shrunk_box`, by :func:`~hardeq.bounds.start_dual.dual_start`) becomes the
        chains' start, and its certificate (every row within the mode's acceptance) is returned as a 0-d bool tensor
        for the samplers to read with their own check. None where nothing is pending. False there makes sampling
        run the full check (its precise error) and start from the exact mode."""
        if "volume" in self._cache or not self._volume_in_question():
            return None
        base = self.base
        lo_in, hi_in = shrunk_box(self._lo, self._hi, base.covariance.variance, base.conditioner.variance(),
                                  self._lo.dtype)
        point, met = dual_start(base, lo_in, hi_in, rtol=accept_rtol(self._lo.dtype))
        inside = torch.minimum(torch.maximum(point.to(self._lo.dtype), self._lo), self._hi)
        self._cache["start"] = inside
        return met.all()

    def _sum_layout(self: _Truncated) -> SumRowLayout | None:
        """:func:`~hardeq.bounds.sum_normaliser.sum_row_layout` of the base law (computed once)."""
        if "sum_layout" not in self._cache:
            self._cache["sum_layout"] = sum_row_layout(self.base) if self.free_dim >= 2 else None
        layout: SumRowLayout | None = self._cache["sum_layout"]
        return layout

    def _sum_row(self: _Truncated) -> tuple[Tensor, Tensor]:
        """``(log Z, error)`` of one sum row (:mod:`hardeq.bounds.sum_normaliser`), compute dtype, differentiable
        (cached when no gradient is needed); the Monte Carlo normaliser where the grid failed (an extreme tilt)."""
        needs = self._needs_grad()
        if not needs and "sum_row" in self._cache:
            cached: tuple[Tensor, Tensor] = self._cache["sum_row"]
            return cached
        layout = self._sum_layout()
        assert layout is not None
        self._check_volume()
        log_z, error = sum_row_log_normaliser(self.base, self._lo, self._hi, layout)
        bad = ~(torch.isfinite(error) & torch.isfinite(log_z))
        if bool(bad.any()):
            mc, stderr, _ = self._mc()
            log_z, error = torch.where(bad, mc, log_z), torch.where(bad, stderr, error)
        out = (log_z.to(self._lo.dtype), error.to(self._lo.dtype))
        if not needs:
            self._cache["sum_row"] = (out[0].detach(), out[1].detach())
        return out

    def _direction(self: _Truncated) -> Tensor:
        """The unit null vector of ``A`` (``n - a == 1``), computed once."""
        if "direction" not in self._cache:
            self._cache["direction"] = null_direction(self.base.constraint).detach()
        direction: Tensor = self._cache["direction"]
        return direction

    @torch.no_grad()
    def _count_in_box(self: _Truncated, num: int,
                      generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """MC normaliser from ``num`` untruncated draws, in chunks that bound memory."""
        B, n = self.batch_shape.numel(), self.event_shape[0]
        chunk = max(1, ROUND_ELEMENTS // max(1, B * n))
        inside = torch.zeros(self.batch_shape, dtype=torch.float64, device=self._lo.device)
        cond, loc = self.base.conditioner, self.base._unbroadcasted_loc
        done = 0
        while done < num:
            m = min(chunk, num - done)
            z = cond.sample(loc, (m,), generator=generator)
            inside += ((z >= self._lo) & (z <= self._hi)).all(-1).to(torch.float64).sum(0)
            done += m
        acc = inside / num
        stderr = torch.where(acc > 0, ((1 - acc) / (num * acc.clamp_min(1e-300))).sqrt(),
                             torch.full_like(acc, float("inf")))
        return acc.log(), stderr, acc

    def _mc(self: _Truncated) -> tuple[Tensor, Tensor, Tensor]:
        """``(log Z, stderr, acceptance)``: the untruncated draws' fraction in the box, replaced by subset
        simulation in the batch elements where fewer than :data:`SUBSET_BELOW_IN_BOX` of them fell inside."""
        if "mc" not in self._cache:
            self._check_volume()
            log_z, stderr, acc = self._count_in_box(self.normaliser_samples)
            rare = acc * self.normaliser_samples < SUBSET_BELOW_IN_BOX
            if bool(rare.any()):
                self._refuse_beyond_the_levels(rare)
                gibbs = gibbs_unsupported(self.base) is None and split_is_structural(self.base.covariance)
                try:
                    log_s, se_s = self._subset("gibbs" if gibbs else "hmc")
                except StalledLevels:
                    if not gibbs:
                        raise
                    log_s, se_s = self._subset("hmc")
                log_z, stderr = torch.where(rare, log_s, log_z), torch.where(rare, se_s, stderr)
            self._cache["mc"] = (log_z, stderr, acc)
        mc: tuple[Tensor, Tensor, Tensor] = self._cache["mc"]
        return mc

    def _refuse_beyond_the_levels(self: _Truncated, rare: Tensor) -> None:
        r"""Refuse at once, before subset simulation, a batch element whose normaliser is provably beyond the
        levels it can take. With ``d`` the Mahalanobis distance on the plane from the conditional mean to the
        polytope (reached at the :attr:`mode`: :math:`d^2/2 = \log p(\text{mean}) - \log p(\text{mode})`), the
        supporting half-space at the mode contains the polytope, so :math:`\log Z \le \log\Phi(-d)`. Where that
        is more than :data:`BEYOND_LEVELS_MARGIN` below the ``MAX_LEVELS * log(1/4)`` (about -1386) the levels
        resolve, each level's fraction being at least 1/4, the estimate could only be wrong by that much or run
        out of levels, after minutes (measured: over 9 CPU minutes at ``log Z`` near -12,000 before its error).
        Skipped where the mode is not found (the volume check has already passed)."""
        from ..bounds.normaliser import MAX_LEVELS

        try:
            mode = self._compute_mode()
        except ModeNotFound:
            return
        with torch.no_grad():
            gap = (self.base.log_prob(self.base.mean.detach()) - self.base.log_prob(mode)).to(torch.float64)
            d = (2.0 * gap).clamp_min(0.0).sqrt()
            bound = torch.special.log_ndtr(-d)
        limit = MAX_LEVELS * math.log(0.25)
        beyond = rare & (bound < limit - BEYOND_LEVELS_MARGIN)
        slow = rare & ~beyond & (bound < SLOW_LEVELS * math.log(0.25))
        if bool(slow.any()):
            where = tuple(int(i) for i in slow.nonzero()[0]) if slow.dim() else ()
            levels = math.ceil(float(bound[where]) / math.log(0.25))
            warnings.warn(NumericalWarning(
                f"the normaliser of batch element {where} is far in the tail: log Z <= {float(bound[where]):.6g} "
                f"({float(d[where]):.4g} standard deviations from the mean on the plane to the box), so subset "
                f"simulation needs at least {levels} levels, each {SUBSET_ITERATIONS} kernel moves of its whole "
                "population: expect minutes (measured: 230 levels took 225 s for 10 coordinates under a full "
                "covariance, each level slower than the last). Moving the model's mean closer to the box makes it fast; training's "
                "gradient does not need log Z."), stacklevel=4)
        if bool(beyond.any()):
            where = tuple(int(i) for i in beyond.nonzero()[0]) if beyond.dim() else ()
            raise RuntimeError(
                f"the normaliser of batch element {where} is beyond what subset simulation resolves: log Z <= "
                f"{float(bound[where]):.6g} (the Gaussian tail beyond the supporting hyperplane at the mode, "
                f"{float(d[where]):.4g} standard deviations from the mean on the plane), below the about "
                f"{limit:.6g} that its {MAX_LEVELS} levels reach. The model's mean is very far from the box: move it "
                "closer (or widen the bounds) before asking for log Z or log_prob's value; training's gradient "
                "does not need it.")

    def _subset(self: _Truncated, method: str) -> tuple[Tensor, Tensor]:
        """``(log Z, stderr)`` by subset simulation with ``method``'s kernel (``"gibbs"`` or ``"hmc"``).

        Blocked Gibbs is the kernel where the covariance's diagonal part is its own (diagonal, low-rank,
        block-diagonal: :func:`~hardeq.bounds.augment.split_is_structural`), exact HMC under a full covariance.
        Augmented Gibbs mixes at a rate set by the diagonal's share of the covariance, and a full covariance's
        computed share, ``lambda_min(C) / 2``, is as small as its conditioning makes it; a slowly mixing kernel
        does worse here than widen the error: each level keeps the lowest quarter of a population that barely
        moves, so the levels creep towards the box while ``log Z`` falls by ``log 4`` per level. Measured on a
        full covariance (``cond(L)`` 1e5, 28 coordinates): Gibbs ran out of its 1,000 levels ("below -1386"),
        HMC gives -20.7 +- 0.3 in 11 s. A Gibbs population that stalls
        (:class:`~hardeq.bounds.normaliser.StalledLevels`; measured on a dominant low-rank factor, float32, 29
        coordinates) is started again under HMC (there -47.2 +- 0.5). Low-rank and block covariances keep Gibbs:
        HMC took over 150 s per estimate on a 25-coordinate low-rank case that Gibbs estimates in about 10 s,
        where Gibbs's own error is documented (docs/bounds.md)."""
        with torch.no_grad():
            # (one free dimension under Gibbs: every move an exact draw of the segment, no inflation)
            exact_moves = self.free_dim == 1 and method == "gibbs"
            log_s, se_s, _ = subset_log_normaliser(self.base, self._lo, self._hi,
                                                   lambda lo, hi, start, steps: self._kernel(lo, hi, start, steps,
                                                                                             method),
                                                   num=max(64, self.normaliser_samples // 4),
                                                   iterations=SUBSET_ITERATIONS,
                                                   inflation=1.0 if exact_moves else STDERR_INFLATION)
        return log_s, se_s

    def _kernel(self: _Truncated, lower: Tensor, upper: Tensor, start: Tensor, steps: int, method: str) -> Tensor:
        """``steps`` moves of blocked Gibbs (``method == "gibbs"``) or exact HMC for the law truncated to
        ``[lower, upper]``, from ``start`` ``(chains, *batch, n)``; the states after them (subset simulation's
        kernel)."""
        from ..bounds.gibbs import blocked_gibbs
        from ..bounds.hmc import exact_hmc

        if method == "gibbs":
            return blocked_gibbs(self.base, lower, upper, start, num_samples=1, burn_in=steps - 1).samples[0]
        return exact_hmc(self.base, lower, upper, start, num_samples=1, burn_in=steps - 1, allow_stuck=True).samples[0]
