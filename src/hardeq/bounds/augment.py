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
* :class:`~hardeq.linalg.block_diagonal.BlockDiagonalCovariance`: :math:`D` = its diagonal, and one ``u_g`` of size
  ``r`` per group (the precision is block diagonal: ``G`` Cholesky factors of ``r x r``; O(n r^2));
* :class:`~hardeq.linalg.covariance.FullCovariance` (the user's ``n x n``): :math:`D = \tfrac12\lambda_{\min}(C)\,
  \mathrm{diag}\,\Sigma` with :math:`C` the correlation matrix, and :math:`V` from the eigendecomposition of
  :math:`\Sigma - D` (O(n^3) once, O(n^2) per sweep and chain).
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


def augmentation_unsupported(cov: Covariance) -> str | None:
    """Why :func:`augmentation` cannot split ``cov`` (a sentence), or ``None`` when it can (or when ``cov`` is
    diagonal and needs none). O(1)."""
    if cov.is_diagonal or isinstance(cov, BlockDiagonalCovariance):
        return None
    n = cov.event_size
    batch = max(1, cov.batch_shape.numel())
    if isinstance(cov, FullCovariance) or cov.diag_part() is not None:
        width = n if cov.diag_part() is None else int(cov.factor_part().shape[-1])  # type: ignore[union-attr]
        if n * width * batch <= MAX_FACTOR_ELEMENTS:
            return None
        return (f"the Gibbs sampler's augmentation Sigma = D + V V^T would form a dense factor of {n} x {width} per "
                f"batch element ({batch}), over its limit of {MAX_FACTOR_ELEMENTS} entries")
    return (f"the Gibbs sampler needs a covariance with a diagonal part, Sigma = D + V V^T (diagonal, low-rank, "
            f"block-diagonal or full), got {type(cov).__name__}")


@dataclass
class Augmentation:
    r""":math:`\Sigma = D + VV^\top` split for the Gibbs sampler, float64, detached.

    Attributes:
        diag (Tensor): :math:`D`, ``(*batch, n)``.
        factor (Tensor): :math:`V`, ``(*batch, n, r)``: the whole factor (``index`` is ``None``) or, per coordinate,
            the ``r`` entries of its group's block (``index`` given: :math:`V_{i, (g, j)} = W_{ij}[h(i) = g]`).
        index (Tensor | None): group of each coordinate ``(n,)`` (block-diagonal), else ``None`` (one group).
        groups (int): number of groups ``G``.
        chol (Tensor): Cholesky factor of :math:`P = I + V^\top D^{-1} V`, ``(*batch, G, r, r)``.
    """

    diag: Tensor
    factor: Tensor
    index: Tensor | None
    groups: int
    chol: Tensor

    def _group_sum(self, x: Tensor) -> Tensor:
        """``(..., n, r) -> (..., G, r)``: sums over the coordinates of each group (``index`` given)."""
        assert self.index is not None
        shape = x.shape[:-2] + (self.groups,) + x.shape[-1:]
        return torch.zeros(shape, dtype=x.dtype, device=x.device).index_add_(-2, self.index, x)

    def draw(self, z: Tensor, mu: Tensor, generator: torch.Generator | None) -> Tensor:
        r"""One draw of :math:`u \mid z` mapped back, :math:`\mu + Vu`: ``z`` ``(C, *batch, n)`` float64 ->
        ``(C, *batch, n)``. Cost O(n r) (plus O(G r^2)) per chain and batch element."""
        w = (z - mu) / self.diag                                                  # (C, *batch, n)
        if self.index is None:
            rhs = w.unsqueeze(-2) @ self.factor                                   # (C, *batch, 1, r)
        else:
            rhs = self._group_sum(w.unsqueeze(-1) * self.factor)                  # (C, *batch, G, r)
        mean = torch.cholesky_solve(rhs.unsqueeze(-1), self.chol.expand(rhs.shape + self.chol.shape[-1:]))
        noise = torch.randn(rhs.shape, dtype=_F64, device=z.device, generator=generator).unsqueeze(-1)
        lt = self.chol.mT.expand(mean.shape[:-1] + self.chol.shape[-1:])
        u = (mean + torch.linalg.solve_triangular(lt, noise, upper=True)).squeeze(-1)   # (C, *batch, G, r)
        shift: Tensor = ((self.factor @ u.mT).squeeze(-1) if self.index is None
                         else (self.factor * u.index_select(-2, self.index)).sum(-1))
        return mu + shift


def augmentation(cov: Covariance, batch: torch.Size, n: int) -> Augmentation:
    """The split of ``cov`` (module docstring), broadcast to ``batch``; ``ValueError`` where
    :func:`augmentation_unsupported` says why not."""
    reason = augmentation_unsupported(cov)
    if reason is not None:
        raise ValueError(reason)
    index: Tensor | None = None
    groups = 1
    with torch.no_grad():
        if isinstance(cov, BlockDiagonalCovariance):
            diag = cov.scale.detach().to(_F64).square()
            factor = cov.cov_factor.detach().to(_F64)
            index, groups = cov.index, cov.num_groups
        elif cov.diag_part() is not None:
            diag = cov.diag_part().detach().to(_F64)  # type: ignore[union-attr]
            factor = cov.factor_part().detach().to(_F64)  # type: ignore[union-attr]
        else:
            sigma = cov.dense().detach().to(_F64)
            sd = sigma.diagonal(0, -2, -1).sqrt()
            corr = sigma / (sd.unsqueeze(-1) * sd.unsqueeze(-2))
            lam_min = torch.linalg.eigvalsh(corr)[..., :1].clamp_min(0.0)
            diag = 0.5 * lam_min * sd.square()
            evals, evecs = torch.linalg.eigh(sigma - torch.diag_embed(diag))
            factor = evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)
        diag = diag.expand(batch + (n,))
        factor = factor.expand(batch + factor.shape[-2:])
        r = factor.shape[-1]
        scaled = factor / diag.unsqueeze(-1)
        if index is None:
            prec = factor.mT @ scaled                                              # (*batch, r, r)
            prec = prec.unsqueeze(-3)                                              # (*batch, 1, r, r)
        else:
            outer = scaled.unsqueeze(-1) * factor.unsqueeze(-2)                    # (*batch, n, r, r)
            prec = torch.zeros(batch + (groups, r, r), dtype=_F64, device=factor.device).index_add_(-3, index, outer)
        prec = prec + torch.eye(r, dtype=_F64, device=factor.device)
        chol = torch.linalg.cholesky(prec)
    return Augmentation(diag=diag, factor=factor, index=index, groups=groups, chol=chol)
