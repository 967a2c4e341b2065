"""LowRankCovariance: the shipped conformance suite (hardeq.testing.CovarianceTestCase, float32 and float64
against dense torch.linalg oracles, tolerances stated there), plus its constructor checks and shortcut."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.testing import CovarianceTestCase


class TestLowRankCovariance(CovarianceTestCase):
    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        shape = tuple(batch_shape) + (self.event_size,)
        W = (0.7 * torch.randn(shape + (2,), dtype=torch.float64, generator=g)).to(dtype)
        scale = (0.5 + torch.rand(shape, dtype=torch.float64, generator=g)).to(dtype)
        return hardeq.LowRankCovariance(W, scale), W.double() @ W.double().mT + torch.diag_embed(scale.double() ** 2)


class TestLowRankCovarianceSharedFactor(CovarianceTestCase):
    """``W`` shared by the batch (2-D), ``scale`` batched: the parameters' batch shapes broadcast."""

    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        W = (0.7 * torch.randn(self.event_size, 2, dtype=torch.float64, generator=g)).to(dtype)
        scale = (0.5 + torch.rand(tuple(batch_shape) + (self.event_size,), dtype=torch.float64, generator=g))
        scale = scale.to(dtype)
        return hardeq.LowRankCovariance(W, scale), W.double() @ W.double().mT + torch.diag_embed(scale.double() ** 2)


@pytest.mark.parametrize("cov_factor, scale, error, match", [
    (torch.ones(4, 2), torch.ones(3), ValueError, "cov_factor"),
    (torch.ones(4, 2), torch.ones(4, dtype=torch.float64), TypeError, "dtype"),
    (torch.ones(2, 4, 2), torch.ones(3, 4), ValueError, "broadcast"),
])
def test_bad_construction(cov_factor, scale, error, match):
    with pytest.raises(error, match=match):
        hardeq.LowRankCovariance(cov_factor, scale)


def test_cov_factor_shortcut_builds_it():
    c = hardeq.SumConstraint(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 2.0]))
    d = hardeq.ConstrainedNormal(torch.zeros(4), torch.ones(4), cov_factor=torch.ones(4, 1), constraint=c)
    assert isinstance(d.covariance, hardeq.LowRankCovariance) and d.scale_tril is None
