r"""Data augmentation that gives blocked Gibbs any covariance with a diagonal part: :math:`\Sigma = D + VV^\top`.

Write :math:`z = \mu + Vu + D^{1/2}\varepsilon` with :math:`u \sim \mathcal N(0, I_p)`,
:math:`\varepsilon \sim \mathcal N(0, I_n)`, :math:`D` diagonal and positive. The joint density on the plane and the
box,

.. math::
    p(z, u) \propto \mathcal N(u; 0, I)\,\mathcal N(z; \mu + Vu, D)\,\mathbf 1[Az = k]\,\mathbf 1[l \le z \le u],

has the target as its :math:`z`-marginal, pointwise: :math:`\int\mathcal N(u; 0, I)\mathcal N(z; \mu + Vu, D)\,du
= \mathcal N(z; \mu, \Sigma)`. Its two conditionals are

* :math:`u \mid z`: Gaussian, unconstrained, precision :math:`P = I + V^\top D^{-1}V` (``p x p``), mean
  :math:`P^{-1}V^\top D^{-1}(z - \mu)` (:meth:`Augmentation.draw`);
* :math:`z \mid u`: the *diagonal* truncated law :math:`\mathcal N(\mu + Vu, D)` on the plane and the box, which one
  sweep of :func:`~hardeq.bounds.gibbs.blocked_gibbs`'s diagonal kernel leaves invariant.

Alternating them is an exact Gibbs sampler of the joint, hence of the target; no ``n x n`` matrix is formed unless
the user gave one. Where :math:`D` is small against :math:`VV^\top` (strong correlations) ``u`` is nearly fixed by
``z`` and the chain mixes slowly: read ``ess``.

The splits (:func:`augmentation`):

* :class:`~hardeq.linalg.covariance.LowRankCovariance`: :math:`D` = its diagonal, :math:`V` = its factor (O(n r)
  per sweep and chain, plus an ``r x r`` Cholesky once);
* :class:`~hardeq.linalg.block_diagonal.BlockDiagonalCovariance`: :math:`D` = its diagonal, and :math:`V` its factor
  spread over ``G r`` columns (row ``i`` in its group's ``r``; formed when ``n G r`` and ``(G r)^2`` per batch element
  stay within :data:`MAX_FACTOR_ELEMENTS`);
* :class:`~hardeq.linalg.covariance.FullCovariance` (the user's ``n x n``): :math:`D = \tfrac12\lambda_{\min}(C)\,
  \mathrm{diag}\,\Sigma` with :math:`C` the correlation matrix, and :math:`V` from the eigendecomposition of
  :math:`\Sigma - D` (O(n^3) once, O(n^2) per sweep and chain).

The sweep never forms :math:`Vu`: it needs only each block's share :math:`\sum_{i\in b} d_i V_i u / v_i` (one batched
product with the pool's :math:`W_b`, :class:`~hardeq.bounds.partition.Pool`), and :math:`u` itself is one batched
product :math:`u = (z - \mu) G + \xi` with :math:`G = D^{-1} V P^{-1}` and :math:`\xi = \varepsilon L^{-1}` (rows),
:math:`P = LL^\top`, whose noise is drawn for many sweeps at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..linalg.block_diagonal import BlockDiagonalCovariance
from ..linalg.covariance import Covariance, FullCovariance

__all__ = ["Augmentation", "augmentation", "augmentation_unsupported"]

_F64 = torch.float64
#: the most entries of a dense float64 factor ``V`` (``n x p`` per batch element) the augmentation forms
MAX_FACTOR_ELEMENTS = 1 << 24


def _width(cov: Covariance) -> int:
    """Columns of the dense factor ``V`` of the split."""
    if isinstance(cov, BlockDiagonalCovariance):
        return cov.num_groups * int(cov.cov_factor.shape[-1])
    part = cov.factor_part()
    return cov.event_size if part is None else int(part.shape[-1])


def split_is_structural(cov: Covariance) -> bool:
    """True where the split's ``D`` is the structure's own diagonal (diagonal, low-rank, block-diagonal), False
    where it is computed from a dense ``Sigma`` (a full covariance: ``D = lambda_min(C) / 2 diag(Sigma)``, which an
    ill-conditioned ``Sigma`` makes arbitrarily small, and the chain with it). O(1)."""
    return cov.is_diagonal or isinstance(cov, BlockDiagonalCovariance) or cov.diag_part() is not None


def augmentation_unsupported(cov: Covariance) -> str | None:
    """Why :func:`augmentation` cannot split ``cov`` (a sentence), or ``None`` when it can (or when ``cov`` is
    diagonal and needs none). O(1)."""
    if cov.is_diagonal:
        return None
    n = cov.event_size
    batch = max(1, cov.batch_shape.numel())
    if isinstance(cov, (FullCovariance, BlockDiagonalCovariance)) or cov.diag_part() is not None:
        width = _width(cov)
        if max(n, width) * width * batch <= MAX_FACTOR_ELEMENTS:
            return None
        return (f"the Gibbs sampler's augmentation Sigma = D + V V^T would form a dense factor of {n} x {width} per "
                f"batch element ({batch}), over its limit of {MAX_FACTOR_ELEMENTS} entries")
    return (f"the Gibbs sampler needs a covariance with a diagonal part, Sigma = D + V V^T (diagonal, low-rank, "
            f"block-diagonal or full), got {type(cov).__name__}")


@dataclass
class Augmentation:
    r""":math:`\Sigma = D + VV^\top` split for the Gibbs sampler, float64, detached, over the flattened batch ``B``.

    Attributes:
        diag (Tensor): :math:`D`, ``(B, n)``.
        factor (Tensor): :math:`V`, ``(1 or B, n, r)``.
        gain (Tensor): :math:`G = D^{-1} V P^{-1}`, ``(B, n, r)``: the mean of :math:`u \mid z` is
            :math:`(z - \mu) G` (rows), with :math:`P = I + V^\top D^{-1} V = LL^\top`.
        noise (Tensor): :math:`L^{-1}`, ``(B, r, r)``: :math:`\varepsilon L^{-1}` (rows) has covariance :math:`P^{-1}`.
    """

    diag: Tensor
    factor: Tensor
    gain: Tensor
    noise: Tensor

    def bias(self, mu: Tensor, eps: Tensor) -> Tensor:
        r""":math:`\varepsilon L^{-1} - \mu G` for standard normal ``eps`` ``(S, B, C, r)`` and ``mu`` ``(B, n)``:
        what :math:`u = zG + \text{bias}` adds for ``S`` sweeps at once."""
        return eps @ self.noise.unsqueeze(0) - (mu.unsqueeze(-2) @ self.gain).unsqueeze(0)


def augmentation(cov: Covariance, batch: torch.Size, n: int) -> Augmentation:
    """The split of ``cov`` (module docstring), broadcast to ``batch`` and flattened to ``B = prod(batch)`` (at
    least 1); ``ValueError`` where :func:`augmentation_unsupported` says why not."""
    reason = augmentation_unsupported(cov)
    if reason is not None:
        raise ValueError(reason)
    with torch.no_grad():
        if isinstance(cov, BlockDiagonalCovariance):
            diag = cov.scale.detach().to(_F64).square()
            W = cov.cov_factor.detach().to(_F64)                                   # (*b, n, r)
            r, G = W.shape[-1], cov.num_groups
            cols = (cov.index.unsqueeze(-1) * r + torch.arange(r, device=W.device)).expand(W.shape)
            factor = torch.zeros(W.shape[:-1] + (G * r,), dtype=_F64, device=W.device).scatter(-1, cols, W)
        elif cov.diag_part() is not None:
            diag = cov.diag_part().detach().to(_F64)  # type: ignore[union-attr]
            factor = cov.factor_part().detach().to(_F64)  # type: ignore[union-attr]
        else:
            # formed in float64 from the structure's own factor (a float32 L L^T of an ill-conditioned L can lose
            # definiteness); an eigenvalue at round-off is floored at n eps64, which moves Sigma by round-off only
            sigma = cov.to(dtype=_F64).dense().detach()
            sd = sigma.diagonal(0, -2, -1).sqrt()
            corr = sigma / (sd.unsqueeze(-1) * sd.unsqueeze(-2))
            lam_min = torch.linalg.eigvalsh(corr)[..., :1].clamp_min(n * torch.finfo(_F64).eps)
            diag = 0.5 * lam_min * sd.square()
            evals, evecs = torch.linalg.eigh(sigma - torch.diag_embed(diag))
            factor = evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)
        B = max(1, batch.numel())
        r = factor.shape[-1]
        diag = diag.expand(batch + (n,)).reshape(B, n)
        factor = factor.expand(batch + factor.shape[-2:]).reshape(B, n, r)
        scaled = factor / diag.unsqueeze(-1)
        chol = torch.linalg.cholesky(factor.mT @ scaled + torch.eye(r, dtype=_F64, device=factor.device))
        eye = torch.eye(r, dtype=_F64, device=factor.device).expand(B, r, r)
        linv = torch.linalg.solve_triangular(chol, eye, upper=False)                # L^{-1}
        gain = torch.cholesky_solve(scaled.mT, chol).mT.contiguous()               # D^{-1} V P^{-1}
    return Augmentation(diag=diag.contiguous(), factor=factor.contiguous(), gain=gain, noise=linv)
