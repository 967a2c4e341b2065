r"""KL divergence between two :class:`ConstrainedNormal` on the same constraint.

With :math:`d = \bar\mu_q - \bar\mu_p` and :math:`S_\cdot = A\Sigma_\cdot A^\top`:

.. math::
    \mathrm{KL}(q\Vert p) = \tfrac12\big[\mathrm{tr}(\Sigma_p^{-1}\bar\Sigma_q) + d^\top\Sigma_p^{-1}d - (n - a)
    + \log\det\Sigma_p - \log\det S_p - \log\det\Sigma_q + \log\det S_q\big],

where :math:`\mathrm{tr}(\Sigma_p^{-1}\bar\Sigma_q) = \mathrm{tr}(\Sigma_p^{-1}\Sigma_q)
- \mathrm{tr}(S_q^{-1} A\Sigma_q\Sigma_p^{-1}\Sigma_q A^\top)`. Distributions on different affine subspaces
are mutually singular: their KL is ``inf``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import register_kl

from ..constraints import EqualityConstraint, LinearConstraint, SumConstraint
from ..linalg.covariance import DiagonalCovariance
from .normal import ConstrainedNormal

__all__ = ["kl_constrained_normal"]


def _same_directions(p: EqualityConstraint, q: EqualityConstraint) -> bool:
    """Do ``p`` and ``q`` constrain the same directions (equal row spaces of ``A``)?"""
    if p is q:
        return True
    if p.num_constraints != q.num_constraints or p.event_size != q.event_size:
        return False
    if isinstance(p, SumConstraint) and isinstance(q, SumConstraint):
        return bool(torch.equal(p.index, q.index))
    Ap, Aq = p.dense_matrix(), q.dense_matrix()
    if isinstance(p, LinearConstraint) and isinstance(q, LinearConstraint) and Ap.shape == Aq.shape \
            and bool(torch.equal(Ap, Aq)):
        return True
    Ap, Aq = torch.broadcast_tensors(Ap, Aq)
    rank = torch.linalg.matrix_rank(torch.cat([Ap, Aq], dim=-2))
    return bool((rank == p.num_constraints).all())


@register_kl(ConstrainedNormal, ConstrainedNormal)
def kl_constrained_normal(q: ConstrainedNormal, p: ConstrainedNormal) -> Tensor:
    """``KL(q || p)``, shape ``broadcast(q.batch_shape, p.batch_shape)``; ``inf`` across subspaces."""
    if q.event_shape != p.event_shape:
        raise ValueError(f"event shapes differ: {tuple(q.event_shape)} vs {tuple(p.event_shape)}.")
    batch_shape = torch.broadcast_shapes(q.batch_shape, p.batch_shape)
    mean_q = q.mean
    if not _same_directions(p.constraint, q.constraint):
        return torch.full(batch_shape, float("inf"), dtype=mean_q.dtype, device=mean_q.device)
    same_plane = p.constraint.check(mean_q)  # does q's subspace coincide with p's?
    cq, cp = q._conditioner, p._conditioner
    A = q.constraint
    n, a = q.event_shape[0], A.num_constraints
    if isinstance(cq.cov, DiagonalCovariance) and isinstance(cp.cov, DiagonalCovariance):
        # A Sigma_q Sigma_p^{-1} Sigma_q A^T = A diag(dq^2 / dp) A^T
        cross = A.gram(cq.cov.variance.square() / cp.cov.variance)
        correction = cq.gram.trace_inv(cross)
    else:
        Gq_t = cq.cov.right_apply(A.dense_matrix())  # A Sigma_q, (*batch, a, n)
        X = cp.cov.inv_matvec(Gq_t.movedim(-2, 0)).movedim(0, -2)  # (Sigma_p^{-1} Sigma_q A^T)^T
        V = cq.gram.whiten_matrix(Gq_t)
        W = cq.gram.whiten_matrix(X)
        correction = (V * W).sum((-2, -1))
    trace = cp.cov.trace_inv_mul(cq.cov) - correction
    d = mean_q - p.mean
    kl = 0.5 * (
        trace + cp.cov.inv_quad(d) - (n - a)
        + cp.cov.logdet() - cp.gram.logdet() - cq.cov.logdet() + cq.gram.logdet()
    )
    kl = kl.expand(batch_shape)
    return torch.where(same_plane, kl, torch.full_like(kl, float("inf")))
