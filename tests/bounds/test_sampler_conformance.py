"""Every shipped sampler of the truncated law runs the conformance suite hardeq.testing.sampler_case."""

from __future__ import annotations

import warnings



from hardeq.bounds import blocked_gibbs, exact_hmc, rejection_sample, truncated_mode
from hardeq.testing.sampler_case import SamplerTestCase


def _start(target, lower, upper, num):
    return truncated_mode(target, lower, upper).expand((num,) + tuple(target.shape)).contiguous()


class TestRejection(SamplerTestCase):
    def draw(self, target, lower, upper, num, generator):
        return rejection_sample(target, lower, upper, num, generator=generator)[0]


class TestBlockedGibbs(SamplerTestCase):
    def draw(self, target, lower, upper, num, generator):
        start = _start(target, lower, upper, num)
        return blocked_gibbs(target, lower, upper, start, num_samples=1, burn_in=300, generator=generator).samples[0]


class TestExactHMC(SamplerTestCase):
    def draw(self, target, lower, upper, num, generator):
        start = _start(target, lower, upper, num)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # capped trajectories near the mode's corner
            return exact_hmc(target, lower, upper, start, num_samples=1, burn_in=30, generator=generator).samples[0]
