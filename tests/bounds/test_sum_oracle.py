"""``hardeq.testing.sum_conditioned_truncated_means`` (the FFT oracle of the Gibbs tests) against closed forms."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from hardeq.testing import sum_conditioned_truncated_means


@pytest.mark.parametrize("loc", [(0.3, 0.5), (-0.05, 0.9), (0.7, 0.7)])
def test_two_coordinates_match_the_truncated_normal_of_their_difference(loc):
    """n = 2, z1 + z2 = 1, both in [0, 1]: z1 = (1 + d) / 2 with d = z1 - z2 ~ N(mu1 - mu2, 2 sd^2) given the sum,
    truncated so that z1 in [0, 1], i.e. z1 ~ N((1 + mu1 - mu2) / 2, sd^2 / 2) truncated to [0, 1]."""
    sd = np.array([0.2, 0.2])
    mean = (1 + loc[0] - loc[1]) / 2
    s = sd[0] / np.sqrt(2)
    exact = stats.truncnorm.mean((0 - mean) / s, (1 - mean) / s, loc=mean, scale=s)
    got = sum_conditioned_truncated_means(np.array(loc), sd, 1.0, 0.0, 1.0, 1e-4)
    assert got[0] == pytest.approx(exact, abs=1e-6)  # the midpoint grid errs by O(h^2)
    assert got.sum() == pytest.approx(1.0, abs=1e-6)


def test_untruncated_limit_is_the_conditioned_gaussian_mean():
    """A box far wider than the law: E[z | sum z = t] = mu + sd^2 (t - sum mu) / sum sd^2 (the linear conditional)."""
    loc, sd = np.array([0.2, 0.4, 0.1, 0.3]), np.array([0.05, 0.1, 0.08, 0.06])
    exact = loc + sd**2 * (1.0 - loc.sum()) / (sd**2).sum()
    got = sum_conditioned_truncated_means(loc, sd, 1.0, -1.0, 2.0, 2e-4)
    assert np.abs(got - exact).max() < 1e-6
