r"""How :meth:`~hardeq.TruncatedConstrainedNormal.log_prob` gets :math:`\log Z` and its gradient: exact with
autograd, or a Monte Carlo value plus the zero-valued surrogate whose gradient is the estimate of
:math:`\nabla\log Z = \mathbb E_{\text{trunc}}[\nabla\log p(z\mid Az=k)]` (:mod:`hardeq.bounds.normaliser`), or in
training mode the surrogate alone on a few sweeps of persistent chains (:mod:`hardeq.bounds.training`). A mixin of
the distribution (:class:`_LogZParts`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..bounds.normaliser import exact_log_normaliser, surrogate
from ..bounds.start import feasible_start
from .truncated_support import _Truncated


class _LogZParts:
    """The normaliser's value and gradient as :meth:`~hardeq.TruncatedConstrainedNormal.log_prob` uses them."""

    def _needs_grad(self: _Truncated) -> bool:
        base = self.base
        return torch.is_grad_enabled() and (base._unbroadcasted_loc.requires_grad
                                            or any(t.requires_grad for t in base.covariance.tensors())
                                            or base.constraint.k.requires_grad)

    def _training_log_z(self: _Truncated, value: Tensor, verdict: Tensor | None = None) -> Tensor:
        """Training mode: no :math:`\\log Z`, only the zero-valued surrogate whose gradient is the persistent chains'
        estimate of :math:`\\nabla\\log Z` (:mod:`hardeq.bounds.training`); ``batch_shape``, compute dtype.
        ``verdict``: the pending certificate of :meth:`_deferred_volume_check` (its point is the chains' fallback
        start), read with the chains' start check (False: :class:`~hardeq.bounds.checks.StartOffPlane`)."""
        chains = self.training
        assert chains is not None
        if not self._needs_grad():
            return torch.zeros(self.batch_shape, dtype=self._lo.dtype, device=self._lo.device)
        self._warn_k()
        base, lo, hi = self.base, self._lo, self._hi
        shape = self.batch_shape + self.event_shape
        rtol = math.sqrt(torch.finfo(lo.dtype).eps)
        with torch.no_grad():
            point = feasible_start(base, lo, hi)
            if point is None:  # the dual start where one was made (certified, or pending with ``verdict``)
                point = self._cache.get("start")
            start = chains.start(shape, lo, hi, lambda z: base.constraint.check(z, rtol=rtol),
                                 base._as_event("value", value), self._compute_mode, point)
            draws = self._chain(start, chains.sweeps, verdict)
            self._certified(verdict, read=False)  # (read with the chains' start check)
        chains.state = draws[-1].detach()
        chains.steps += 1
        return surrogate(self._plane_log_prob(), draws.flatten(0, 1))

    @torch.no_grad()
    def _chain(self: _Truncated, start: Tensor, sweeps: int, verdict: Tensor | None = None) -> Tensor:
        """``sweeps`` states ``(sweeps, chains, *batch, n)`` of blocked Gibbs (exact HMC where Gibbs does not
        apply, stuck chains allowed) from ``start``, in the compute dtype; ``verdict`` as in
        :meth:`_training_log_z`."""
        from ..bounds.gibbs import blocked_gibbs, gibbs_unsupported
        from ..bounds.hmc import exact_hmc

        if gibbs_unsupported(self.base) is None:
            return blocked_gibbs(self.base, self._lo, self._hi, start, num_samples=sweeps, burn_in=0,
                                 start_verdict=verdict).samples
        self._certified(verdict)  # (HMC reads the host anyway)
        return exact_hmc(self.base, self._lo, self._hi, start, num_samples=sweeps, burn_in=0,
                         allow_stuck=True).samples

    def _plane_log_prob(self: _Truncated) -> Callable[[Tensor], Tensor]:
        """The untruncated conditional log-density on the plane with ``k`` detached (the normaliser's surrogate
        carries no gradient to ``k``; :mod:`hardeq.bounds.normaliser`)."""
        base = self.base
        if base.constraint.k.requires_grad:
            con = base.constraint.with_k(base.constraint.k.detach())
            make: Any = type(base)
            base = make(base._unbroadcasted_loc, covariance=base.covariance, constraint=con, validate_args=False)
        return base.log_prob

    def _warn_k(self: _Truncated) -> None:
        if self.base.constraint.k.requires_grad and not self._cache.get("warned_k"):
                self._cache["warned_k"] = True
                warnings.warn("k requires grad, but with n - a > 1 the Monte Carlo normaliser of "
                              "TruncatedConstrainedNormal.log_prob carries no gradient to k (k moves the box's section "
                              "of the plane; the identity grad log Z = E[grad log p] covers loc and the scales only). "
                              "Treat k as data here, or use one free dimension (exact normaliser).", UserWarning,
                              stacklevel=4)

    def _log_z(self: _Truncated) -> Tensor:
        """:math:`\\log Z` for :meth:`log_prob`, compute dtype: exact with autograd, or the MC value plus the
        zero-valued surrogate that carries the gradient estimate."""
        if self._line_exact:
            return exact_log_normaliser(self.base, self._lo, self._hi, self._direction())
        if self.normaliser_exact:
            return self._sum_row()[0]
        log_z = self._mc()[0].to(self._lo.dtype)
        if self._needs_grad():
            self._warn_k()
            if "grad_draws" not in self._cache:
                self._cache["grad_draws"] = self._sample_compute((self.grad_samples,), "auto").samples.detach()
            log_z = log_z + surrogate(self._plane_log_prob(), self._cache["grad_draws"])
        return log_z
