"""FullCovariance: the shipped conformance suite (hardeq.testing.CovarianceTestCase, float32 and float64
against dense torch.linalg oracles, tolerances stated there), plus its constructor checks and shortcut."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.testing import CovarianceTestCase


class TestFullCovariance(CovarianceTestCase):
    def create(self, batch_shape, dtype, seed):
        n = self.event_size
        X = torch.randn(tuple(batch_shape) + (n, n), dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        L = torch.linalg.cholesky(X @ X.mT / n + 0.5 * torch.eye(n, dtype=torch.float64)).to(dtype)
        return hardeq.FullCovariance(L), L.double() @ L.double().mT


def test_bad_construction():
    with pytest.raises(ValueError, match="square"):
        hardeq.FullCovariance(torch.ones(3, 2))
    with pytest.raises(ValueError, match="lower triangular"):
        hardeq.FullCovariance(torch.ones(3, 3)).check_values()


def test_scale_tril_shortcut_builds_it():
    c = hardeq.SumConstraint(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 2.0]))
    d = hardeq.ConstrainedNormal(torch.zeros(4), scale_tril=torch.eye(4), constraint=c)
    assert isinstance(d.covariance, hardeq.FullCovariance) and d.scale is None
