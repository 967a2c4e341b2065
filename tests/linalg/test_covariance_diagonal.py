"""DiagonalCovariance: the shipped conformance suite (hardeq.testing.CovarianceTestCase, float32 and float64
against dense torch.linalg oracles, tolerances stated there), plus its constructor checks and shortcut."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.testing import CovarianceTestCase


class TestDiagonalCovariance(CovarianceTestCase):
    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        scale = (0.5 + torch.rand(tuple(batch_shape) + (self.event_size,), dtype=torch.float64, generator=g))
        scale = scale.to(dtype)
        return hardeq.DiagonalCovariance(scale), torch.diag_embed(scale.double() ** 2)


@pytest.mark.parametrize("scale, error, match", [
    ([1.0, 2.0], TypeError, "scale"),
    (torch.ones(()), ValueError, "scale"),
])
def test_bad_construction(scale, error, match):
    with pytest.raises(error, match=match):
        hardeq.DiagonalCovariance(scale)


def test_positive_scale_is_checked():
    with pytest.raises(ValueError, match="scale .* positive"):
        hardeq.DiagonalCovariance(torch.tensor([1.0, -1.0])).check_values()


def test_scale_shortcut_builds_it():
    scale = torch.ones(4)
    c = hardeq.SumConstraint(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 2.0]))
    d = hardeq.ConstrainedNormal(torch.zeros(4), scale, constraint=c)
    assert isinstance(d.covariance, hardeq.DiagonalCovariance) and d.covariance.scale is scale
    with pytest.raises(ValueError, match="covariance= alone"):
        hardeq.ConstrainedNormal(torch.zeros(4), scale, covariance=hardeq.DiagonalCovariance(scale), constraint=c)
    with pytest.raises(TypeError, match="covariance must be"):
        hardeq.ConstrainedNormal(torch.zeros(4), covariance=scale, constraint=c)
