r"""KL divergence between two :class:`ConstrainedNormal` on the same constraint.

With :math:`d = \bar\mu_q - \bar\mu_p` and :math:`S_\cdot = A\Sigma_\cdot A^\top`:

.. math::
    \mathrm{KL}(q\Vert p) = \tfrac12\big[\mathrm{tr}(\Sigma_p^{-1}\bar\Sigma_q) + d^\top\Sigma_p^{-1}d - (n - a)
    + \log\det\Sigma_p - \log\det S_p - \log\det\Sigma_q + \log\det S_q\big],

where :math:`\mathrm{tr}(\Sigma_p^{-1}\bar\Sigma_q) = \mathrm{tr}(\Sigma_p^{-1}\Sigma_q)
- \mathrm{tr}(S_q^{-1} A\Sigma_q\Sigma_p^{-1}\Sigma_q A^\top)`. Distributions on different affine subspaces
are mutually singular: their KL is ``inf``. When ``q`` and ``p`` describe the same plane with different
``A`` (e.g. rescaled rows), :math:`\tfrac12[\log\det A_pA_p^\top - \log\det A_qA_q^\top]` is added, from the
:math:`-\tfrac12\log\det AA^\top` term of each density.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor
from torch.distributions import register_kl

from ..constraints._cache import no_host_reads
from ..linalg.covariance import trace_inv_mul
from ..linalg.device import profile
from .normal import ConstrainedNormal

_K = TypeVar("_K", bound=Callable[..., Tensor])


def _register_kl(type_p: type, type_q: type) -> Callable[[_K], _K]:
    """torch's ``register_kl``, typed (torch leaves it unannotated)."""
    decorator: Callable[[_K], _K] = register_kl(type_p, type_q)
    return decorator

__all__ = ["kl_constrained_normal"]


@_register_kl(ConstrainedNormal, ConstrainedNormal)
def kl_constrained_normal(q: ConstrainedNormal, p: ConstrainedNormal) -> Tensor:
    """``KL(q || p)``, shape ``broadcast(q.batch_shape, p.batch_shape)``; ``inf`` across subspaces. Without
    validation on either side, and on a device where a read-back synchronises (validated or not:
    :func:`hardeq.linalg.device.profile`), the constraints' caches check their tensors on the device
    (``no_host_reads``)."""
    validated = q._validate_args or p._validate_args
    with no_host_reads(not validated or not profile(q._unbroadcasted_loc.device).host_guards):
        return _kl(q, p)


def _kl(q: ConstrainedNormal, p: ConstrainedNormal) -> Tensor:
    if q.event_shape != p.event_shape:
        raise ValueError(f"event shapes differ: {tuple(q.event_shape)} vs {tuple(p.event_shape)}.")
    batch_shape = torch.broadcast_shapes(q.batch_shape, p.batch_shape)
    mean_q = q._mean  # in the compute dtype (float32 for half-precision inputs)
    if not p.constraint.same_row_space(q.constraint):
        return torch.full(batch_shape, float("inf"), dtype=mean_q.dtype, device=mean_q.device)
    same_plane = p.constraint.check(mean_q)  # does q's subspace coincide with p's?
    cq, cp = q.conditioner, p.conditioner
    A = q.constraint
    n, a = q.event_shape[0], A.num_constraints
    # tr(S_q^-1 A Sigma_q Sigma_p^-1 Sigma_q A^T) = tr(G^T Sigma_p^-1 G), G G^T = Sigma_q A^T S_q^-1 A Sigma_q
    correction = cq.trace_correction(cp.cov)
    trace = trace_inv_mul(cp.cov, cq.cov) - correction
    d = mean_q - p._mean
    kl = 0.5 * (
        trace + cp.cov.inv_quad(d) - (n - a)
        + cp.cov.logdet() - cp.logdet() - cq.cov.logdet() + cq.logdet()
    )
    if p.constraint is not q.constraint:  # the same plane may be written with differently scaled rows
        kl = kl + 0.5 * (p.constraint.logdet_gram_identity() - q.constraint.logdet_gram_identity())
    kl = kl.expand(batch_shape)
    return q._out(torch.where(same_plane, kl, torch.full_like(kl, float("inf"))))
