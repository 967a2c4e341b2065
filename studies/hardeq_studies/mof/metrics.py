r"""Test metrics of the mof study: predictions of every method, MAD, and exact per-graph NLLs (vectorised).

**NLL convention.** As in the ICML 2025 code: for each test MOF with ``n`` atoms, the negative log-density
of the DDEC charges of its first ``n - 1`` atoms (the last one is fixed by neutrality) under the predicted
Gaussian, summed per graph and *averaged over graphs*. It equals the density on the plane
(:meth:`hardeq.ConstrainedNormal.log_prob`, :func:`hardeq.nn.per_graph_log_prob`) times the Jacobian
:math:`\sqrt n`: ``nll = -log_prob_plane - 0.5 log n``.

Every predictive covariance here is a diagonal plus a signed low-rank term,
:math:`C = \mathrm{diag}(d) + \sum_k s_k u_k u_k^\top` (:math:`s_k = \pm 1`; e.g. the conditional
covariance :math:`D - v v^\top / V`), so :func:`lowrank_nll` evaluates it for all graphs at once with the
matrix determinant lemma and Woodbury on the first ``n - 1`` coordinates (``(G, r, r)`` systems, r <= 3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from hardeq.baselines import constraint_layer, kkt_projection
from hardeq import SumConstraint
from hardeq.nn import graph_normal

__all__ = ["predict", "gsum", "lowrank_nll", "single_nll", "ensemble_nll_paper", "ensemble_nll_moment",
           "mixture_nll", "conditional_factor", "METHODS"]

#: trained methods: name -> how the prediction is formed from (mu, variance)
METHODS = ("KKT", "variance", "CL", "closed-form", "likelihood")


def gsum(x: Tensor, batch: Tensor, G: int) -> Tensor:
    """Per-graph sums of ``x`` ``(..., N)`` -> ``(..., G)``."""
    return x.new_zeros(x.shape[:-1] + (G,)).index_add_(-1, batch, x)


def predict(method: str, mu: Tensor, var: Tensor, batch: Tensor, G: int) -> Tensor:
    """The charge prediction ``(N,)`` of ``method`` from per-atom ``mu`` and ``var`` (each ``(N,)``).

    ``KKT``: the orthogonal projection (uniform correction); ``CL``: the constraint layer (the last atom of each
    graph is minus the sum of the others); ``variance``, ``closed-form``, ``likelihood``: the conditional mean
    of :math:`\\mathcal N(\\mu, \\mathrm{diag}\\,v)` given neutrality (= Raza et al.'s variance-weighted
    correction). All sum to 0 per graph to round-off.
    """
    c = SumConstraint(batch, mu.new_zeros(G), validate_args=False)
    if method == "KKT":
        return kkt_projection(mu, c)
    if method == "CL":
        return constraint_layer(mu, c)
    if method in ("variance", "closed-form", "likelihood"):
        return graph_normal(mu, var, batch, num_graphs=G, validate_args=False).mean
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}.")


def conditional_factor(var: Tensor, batch: Tensor, G: int) -> Tensor:
    """``u = v / sqrt(V_g)``: the conditional covariance of the diagonal Gaussian is ``diag(v) - u u^T``."""
    return var / gsum(var, batch, G).sqrt()[batch]


def lowrank_nll(center: Tensor, d: Tensor, factors: Sequence[Tensor], signs: Sequence[float], value: Tensor,
                batch: Tensor, G: int) -> Tensor:
    r"""Per-graph NLL ``(G,)`` of ``value`` under :math:`\mathcal N(\text{center}, \mathrm{diag}(d) +
    \sum_k s_k u_k u_k^\top)` on the first ``n - 1`` coordinates of each graph (atoms sorted by graph).

    .. math::

        \mathrm{NLL}_g = \tfrac12\big[(n_g - 1)\log 2\pi + \textstyle\sum_i \log d_i + \log\det(I + S W)
                         + \sum_i e_i^2/d_i - b^\top (S^{-1} + W)^{-1} b\big],

    with :math:`W = U^\top D^{-1} U`, :math:`b = U^\top D^{-1} e`, :math:`e = \text{value} - \text{center}`,
    all sums over the graph's first ``n_g - 1`` atoms. Args: ``center, d, value, u_k``: ``(N,)`` float64.
    """
    N = value.shape[0]
    keep = torch.ones(N, dtype=torch.bool, device=value.device)
    counts = torch.bincount(batch, minlength=G)
    keep[counts.cumsum(0) - 1] = False  # the last atom of every graph
    w = keep.to(value.dtype)
    e = (value - center) * w
    dinv = w / d
    U = torch.stack(list(factors), 0)  # (r, N)
    r = U.shape[0]
    S = torch.tensor(list(signs), dtype=value.dtype, device=value.device)
    W = gsum(U[:, None, :] * U[None, :, :] * dinv, batch, G).permute(2, 0, 1)  # (G, r, r)
    b = gsum(U * (e * dinv), batch, G).T  # (G, r)
    eye = torch.eye(r, dtype=value.dtype, device=value.device)
    logdet_small = torch.linalg.slogdet(eye + S[:, None] * W)  # det(I + S W)
    inner = torch.diag(1.0 / S) + W
    quad_small = (b * torch.linalg.solve(inner, b.unsqueeze(-1)).squeeze(-1)).sum(-1)
    logd = gsum(torch.where(keep, d.log(), torch.zeros_like(d)), batch, G)
    quad = gsum(e * e * dinv, batch, G) - quad_small
    return 0.5 * ((counts - 1) * math.log(2 * math.pi) + logd + logdet_small.logabsdet + quad)


def single_nll(center: Tensor, var: Tensor, value: Tensor, batch: Tensor, G: int) -> Tensor:
    """NLL ``(G,)`` of one model: centre ``center`` (its prediction), covariance the conditional covariance
    ``diag(v) - v v^T / V`` of its variance head (the ICML code's evaluation for every method)."""
    return lowrank_nll(center, var, [conditional_factor(var, batch, G)], [-1.0], value, batch, G)


def ensemble_nll_paper(c1: Tensor, v1: Tensor, c2: Tensor, v2: Tensor, value: Tensor, batch: Tensor, G: int) -> Tensor:
    """The ICML code's ensemble NLL: centre ``(c1 + c2)/2``, covariance ``(S1 + S2)/4`` -- the covariance of
    the average of two *independent* draws from the two models."""
    u1, u2 = conditional_factor(v1, batch, G) / 2, conditional_factor(v2, batch, G) / 2
    return lowrank_nll((c1 + c2) / 2, (v1 + v2) / 4, [u1, u2], [-1.0, -1.0], value, batch, G)


def ensemble_nll_moment(c1: Tensor, v1: Tensor, c2: Tensor, v2: Tensor, value: Tensor, batch: Tensor, G: int
                        ) -> Tensor:
    """NLL of the moment-matched Gaussian of the equal mixture: centre ``(c1 + c2)/2``, covariance
    ``(S1 + S2)/2 + (c1 - c2)(c1 - c2)^T / 4``."""
    s = 0.5 ** 0.5
    u1, u2 = conditional_factor(v1, batch, G) * s, conditional_factor(v2, batch, G) * s
    return lowrank_nll((c1 + c2) / 2, (v1 + v2) / 2, [u1, u2, (c1 - c2) / 2], [-1.0, -1.0, 1.0], value, batch, G)


def mixture_nll(nll1: Tensor, nll2: Tensor) -> Tensor:
    """Exact NLL ``(G,)`` of the equal mixture of the two models' predictive densities (a deep ensemble)."""
    return -(torch.logaddexp(-nll1, -nll2) - math.log(2.0))
