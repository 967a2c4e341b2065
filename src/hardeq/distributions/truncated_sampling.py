r"""Sampling of :class:`~hardeq.TruncatedConstrainedNormal`: the method choice (``"auto"``: the pilots of
:func:`hardeq.bounds.choice.choose_method`) and the dispatch to rejection, blocked Gibbs or exact HMC, started at a
feasible point built without a host read (a grouped sum or one row) or else the mode, with auto's fallback from a
stuck HMC chain to Gibbs. A mixin of the distribution (:class:`_SamplingParts`);
:meth:`~hardeq.TruncatedConstrainedNormal.sample_with_info` documents the arguments and costs."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..bounds.rejection import AUTO_THRESHOLD, rejection_sample
from ..bounds.result import TruncatedSamples
from .normal_checks import _sample_shape
from .truncated_support import _Truncated

#: methods of :meth:`TruncatedConstrainedNormal.sample_with_info`
METHODS = ("auto", "rejection", "gibbs", "hmc")


class _SamplingParts:
    """The sampling machinery of :class:`~hardeq.TruncatedConstrainedNormal`."""

    @torch.no_grad()
    def _sample_compute(self: _Truncated, sample_shape: object, method: str, **kwargs: Any) -> TruncatedSamples:
        """:meth:`_draw`, again from the exact mode where the chains' sync-free start (rows that share coordinates:
        :func:`hardeq.bounds.start_dual.dual_start`) failed the samplers' start check: only then are the mode's host
        reads paid (and its error names an empty polytope)."""
        from ..bounds.checks import StartOffPlane

        try:
            return _SamplingParts._draw(self, sample_shape, method, **kwargs)
        except StartOffPlane:
            if not self._start_is_approximate():
                raise
            self._start_from_mode()
            return _SamplingParts._draw(self, sample_shape, method, **kwargs)

    def _certified(self: _Truncated, verdict: Tensor | None, read: bool = True) -> None:
        """Record a certificate of :meth:`_deferred_volume_check` as passed (after reading it, unless a sampler
        read it already); a False one raises :class:`~hardeq.bounds.checks.StartOffPlane`."""
        if verdict is None:
            return
        if read and not bool(verdict):
            from ..bounds.checks import StartOffPlane

            raise StartOffPlane("the chains' sync-free start is not a certified interior point of the polytope.")
        self._cache["volume"] = True

    def _draw(self: _Truncated, sample_shape: object, method: str, *, chains: int | None = None,
              burn_in: int = 100, thin: int = 1, travel_time: tuple[float, float] | None = None,
              threshold: float = AUTO_THRESHOLD,
              max_draws: int | None = None, generator: torch.Generator | None = None) -> TruncatedSamples:
        sample_shape = _sample_shape(sample_shape)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        verdict = self._deferred_volume_check()  # (None, or a certificate read with the samplers' first read)
        num = sample_shape.numel()
        batch, n = self.batch_shape, self.event_shape[0]
        from ..bounds.gibbs import blocked_gibbs, gibbs_unsupported

        auto = method == "auto"
        if auto:
            # with a generator the pilots draw from it too (not cached), so that the method chosen is reproducible
            acc = self.acceptance if generator is None or self._line_exact else \
                self._count_in_box(self.pilot_samples, generator)[2]
            from ..bounds.choice import choose_method

            method = choose_method(self.base, self._lo, self._hi, self._chain_start(), num=max(num, 1),
                                   chains=chains if chains is not None else max(num, 1),
                                   acceptance=acc, threshold=threshold, generator=generator,
                                   burn_in=burn_in, thin=thin, start_verdict=verdict)[0]
            self._certified(verdict, read=False)  # (read with the decision)
            verdict = None
        elif method == "gibbs":
            reason = gibbs_unsupported(self.base)
            if reason is not None:
                raise ValueError(reason)
            if travel_time is not None:
                raise ValueError(f"travel_time is an HMC control; method='gibbs' takes none, got {travel_time!r}.")
        if method != "gibbs":  # rejection and HMC read the host anyway: the certificate too, now
            self._certified(verdict)
            verdict = None
        if method == "rejection":
            z, acc = rejection_sample(self.base, self._lo, self._hi, num, max_draws=max_draws, generator=generator)
            ess = torch.full(batch + (n,), float(num), dtype=torch.float64, device=z.device)
            return TruncatedSamples(z.reshape(sample_shape + batch + (n,)), "rejection", acc, ess, None)
        from ..bounds import ChainStuck
        from ..bounds.hmc import exact_hmc

        if chains is None:
            chains = max(num, 1)
        if isinstance(chains, bool) or not isinstance(chains, int) or chains < 1:
            raise ValueError(f"chains must be a positive int, got {chains!r}.")
        per_chain = max(1, math.ceil(num / chains))
        start = self._chain_start().expand((chains,) + batch + (n,))
        if method == "gibbs":
            res_g = blocked_gibbs(self.base, self._lo, self._hi, start, num_samples=per_chain, burn_in=burn_in,
                                  thin=thin, generator=generator, start_verdict=verdict)
            self._certified(verdict, read=False)  # (read with the start's check)
            samples, ess, rhat = res_g.samples, res_g.ess, res_g.rhat
        else:
            kwargs: dict[str, Any] = {} if travel_time is None else {"travel_time": travel_time}
            try:
                res = exact_hmc(self.base, self._lo, self._hi, start, num_samples=per_chain, burn_in=burn_in,
                                thin=thin, generator=generator, **kwargs)
            except ChainStuck:
                if not auto or gibbs_unsupported(self.base) is not None:
                    raise
                method = "gibbs"                               # auto's HMC could not move: Gibbs (no bounces) can
                res_g = blocked_gibbs(self.base, self._lo, self._hi, start, num_samples=per_chain, burn_in=burn_in,
                                      thin=thin, generator=generator)
                samples, ess, rhat = res_g.samples, res_g.ess, res_g.rhat
            else:
                samples, ess, rhat = res.samples, res.ess, res.rhat
        z = samples.reshape((per_chain * chains,) + batch + (n,))[:num]
        z = torch.minimum(torch.maximum(z.to(self._lo.dtype), self._lo), self._hi)
        return TruncatedSamples(z.reshape(sample_shape + batch + (n,)), method, None, ess, rhat)
