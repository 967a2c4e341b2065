"""A first use under ``torch.no_grad()`` must not freeze a cache that later gradients flow through.

Regression: ``DiagonalCovariance.variance`` (and ``LowRankCovariance.capacitance_tril``) were cached on first
use. ``rsample(estimator="marginal_expectation")`` draws its forward sample under ``no_grad`` first, so with a
batched dense ``A`` (where the Cholesky factor applies the gain through ``Sigma A^T`` rather than a product
formed at construction) the cached variance had no graph and the conditional mean's gradient with respect to
the scales was wrong by O(1). The dense float64 oracle below differentiates
``mu + Sigma A^T (A Sigma A^T)^{-1} (k - A mu)`` directly.
"""

from __future__ import annotations

import pytest
import torch

import hardeq

BATCH = [(), (3,), (3, 4)]


def _oracle_mean(loc, cov_dense, A, k):
    K = cov_dense @ A.mT @ torch.linalg.inv(A @ cov_dense @ A.mT)
    return loc + (K @ (k - (A @ loc.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)).squeeze(-1)


def _covariance(kind, batch, n, g):
    if kind == "diagonal":
        raw = (0.5 * torch.randn(*batch, n, generator=g, dtype=torch.float64)).requires_grad_()
        return (raw,), lambda p: hardeq.DiagonalCovariance(p[0].exp()), lambda p: torch.diag_embed(p[0].exp() ** 2)
    if kind == "lowrank":
        W = (0.5 * torch.randn(*batch, n, 2, generator=g, dtype=torch.float64)).requires_grad_()
        raw = (0.5 * torch.randn(*batch, n, generator=g, dtype=torch.float64)).requires_grad_()
        return ((W, raw), lambda p: hardeq.LowRankCovariance(p[0], p[1].exp()),
                lambda p: p[0] @ p[0].mT + torch.diag_embed(p[1].exp() ** 2))
    M = torch.randn(*batch, n, n, generator=g, dtype=torch.float64)
    tril = (torch.tril(M, -1) * 0.3 + torch.diag_embed(torch.rand(*batch, n, generator=g, dtype=torch.float64) + 0.5))
    tril = tril.requires_grad_()
    return (tril,), lambda p: hardeq.FullCovariance(p[0]), lambda p: p[0] @ p[0].mT


def _a_shape(layout, batch, a, n):
    """The constraint's batch layout: one shared ``A``, one per element, or broadcast along the last batch dim."""
    if layout == "shared":
        return (a, n)
    if layout == "full":
        return (*batch, a, n)
    return (*batch[:-1], 1, a, n)


#: (layout of A, batch shape); broadcasting needs a batch dimension
LAYOUTS = [(layout, batch) for layout in ("shared", "full", "broadcast") for batch in BATCH
           if batch or layout != "broadcast"]


@pytest.mark.parametrize(("layout", "batch"), LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["diagonal", "lowrank", "full"])
@pytest.mark.parametrize("estimator", ["marginal_expectation", "pathwise", "constrained_reparam"])
def test_gradients_survive_a_no_grad_first_use(kind, layout, batch, estimator):
    g = torch.Generator().manual_seed(7)
    n, a = 10, 3
    A = torch.randn(*_a_shape(layout, batch, a, n), generator=g, dtype=torch.float64)
    k = torch.randn(*batch, a, generator=g, dtype=torch.float64)
    loc = torch.randn(*batch, n, generator=g, dtype=torch.float64, requires_grad=True)
    params, make, dense = _covariance(kind, batch, n, g)
    w = torch.randn(*batch, n, generator=g, dtype=torch.float64)
    noise = torch.zeros(*batch, n if kind != "lowrank" else n + 2, dtype=torch.float64)

    dist = hardeq.ConstrainedNormal(loc, covariance=make(params),
                                    constraint=hardeq.LinearConstraint(A, k, validate_args=False))
    with torch.no_grad():
        dist.sample()  # first use of every cache under no_grad
        dist.rsample(estimator=estimator, noise=noise)
    z = dist.rsample(estimator=estimator, noise=noise)  # zero noise: the sample is the conditional mean
    got = torch.autograd.grad((z * w).sum(), (loc, *params))
    want = torch.autograd.grad((_oracle_mean(loc, dense(params), A, k) * w).sum(), (loc, *params))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)


def test_diagonal_variance_cache_recomputes_only_when_a_graph_is_missing():
    scale = torch.tensor([1.0, 2.0], requires_grad=True)
    cov = hardeq.DiagonalCovariance(scale)
    with torch.no_grad():
        frozen = cov.variance
    assert frozen.grad_fn is None
    live = cov.variance
    assert live.grad_fn is not None and cov.variance is live  # recomputed once, then cached
    plain = hardeq.DiagonalCovariance(torch.tensor([1.0, 2.0]))
    with torch.no_grad():
        first = plain.variance
    assert plain.variance is first  # nothing requires grad: the no_grad result stays cached
