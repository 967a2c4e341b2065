"""Gaussians on the plane ``A z = k`` truncated to a box: the exact-HMC sampler and its diagnostics."""

from .diagnostics import effective_sample_size, split_rhat
from .hmc import HMCResult, exact_hmc

__all__ = ["HMCResult", "effective_sample_size", "exact_hmc", "split_rhat"]
