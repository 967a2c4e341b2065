r"""Test helpers shipped with the package: dense oracles, Monte Carlo tolerances, random factories.

The oracle is independent of the library's formulas: it parameterises the affine subspace
:math:`\{Az = k\}` as :math:`z = z_0 + N t` with an orthonormal null-space basis :math:`N` (from an SVD) and
the minimum-norm solution :math:`z_0 = A^+ k`, and restricts the unconstrained Gaussian density to it.
Restricted to the plane, :math:`\log\mathcal N(z_0 + Nt; \mu, \Sigma)` is a quadratic in :math:`t` with
precision :math:`M = N^\top\Sigma^{-1}N`; normalising it over :math:`t` (Lebesgue measure on the plane,
since :math:`N` is orthonormal) gives the conditional density, mean, covariance, entropy and KL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import Tensor

__all__ = ["DenseConditional", "dense_conditional", "mc_atol", "FAILURE_RATE", "random_spd",
           "sum_conditioned_truncated_means"]

#: per statistical assertion; with ~200 of them a spurious red run has probability ~2%
FAILURE_RATE = 1e-4


def mc_atol(stddev: Tensor, num_samples: int, failure_rate: float = FAILURE_RATE) -> Tensor:
    """Two-sided z-interval half-width for a sample mean, Bonferroni-corrected over ``stddev.numel()``.

    Examples:
        >>> from hardeq.testing import mc_atol
        >>> mc_atol(torch.ones(1), 10_000)  # 3.89 standard errors: a sample mean misses by more with probability 1e-4
        tensor([0.0389])
    """
    from scipy.stats import norm

    z = float(norm.isf(failure_rate / (2 * max(stddev.numel(), 1))))
    return z * stddev / math.sqrt(num_samples) + 1e-8


@dataclass
class DenseConditional:
    """The conditional Gaussian in null-space coordinates (unbatched, float64).

    Examples:
        >>> from hardeq.testing import dense_conditional
        >>> oracle = dense_conditional(torch.zeros(3), torch.eye(3), torch.ones(1, 3), torch.tensor([3.0]))
        >>> type(oracle).__name__, oracle.basis.shape, oracle.t_cov.shape  # z = z0 + N t, t in R^(n - a)
        ('DenseConditional', torch.Size([3, 2]), torch.Size([2, 2]))
        >>> oracle.mean, round(float(oracle.entropy()), 4)
        (tensor([1., 1., 1.], dtype=torch.float64), 2.8379)
    """

    z0: Tensor  # (n,) point on the plane
    basis: Tensor  # (n, n - a) orthonormal null-space basis N
    t_mean: Tensor  # (n - a,)
    t_cov: Tensor  # (n - a, n - a) = M^{-1}

    @property
    def mean(self) -> Tensor:
        return self.z0 + self.basis @ self.t_mean

    @property
    def covariance(self) -> Tensor:
        return self.basis @ self.t_cov @ self.basis.T

    @property
    def t_distribution(self) -> torch.distributions.MultivariateNormal:
        return torch.distributions.MultivariateNormal(self.t_mean, covariance_matrix=self.t_cov)

    def coordinates(self, z: Tensor) -> Tensor:
        return (z - self.z0) @ self.basis

    def log_prob(self, z: Tensor) -> Tensor:
        log_p: Tensor = self.t_distribution.log_prob(self.coordinates(z))
        return log_p

    def entropy(self) -> Tensor:
        h: Tensor = self.t_distribution.entropy()
        return h


def dense_conditional(loc: Tensor, covariance: Tensor, A: Tensor, k: Tensor) -> DenseConditional:
    """Oracle for :math:`\\mathcal N(\\mu, \\Sigma)` given :math:`Az = k` (all unbatched, computed in float64).

    Two oracles built on the same ``A`` (the same call to ``torch.linalg.svd``) share ``z0`` and ``basis``,
    so their ``t``-space distributions can be compared directly (KL).

    Examples:
        >>> from hardeq.testing import dense_conditional
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total)
        >>> oracle = dense_conditional(torch.zeros(3), torch.eye(3), torch.ones(1, 3), torch.tensor([3.0]))
        >>> torch.allclose(d.mean, oracle.mean), torch.allclose(d.covariance_matrix, oracle.covariance)
        (True, True)
    """
    loc, covariance, A, k = (x.detach().double() for x in (loc, covariance, A, k))
    a, n = A.shape
    U, S, Vh = torch.linalg.svd(A)
    basis = Vh[a:].T  # (n, n - a)
    z0 = torch.linalg.pinv(A) @ k
    P = torch.linalg.inv(covariance)
    M = basis.T @ P @ basis
    c = z0 - loc
    b = basis.T @ P @ c
    t_cov = torch.linalg.inv(M)
    t_cov = 0.5 * (t_cov + t_cov.T)
    return DenseConditional(z0, basis, -t_cov @ b, t_cov)


def random_spd(n: int, *, dtype: torch.dtype = torch.float64, generator: torch.Generator | None = None) -> Tensor:
    """A random, well-conditioned SPD matrix (``n x n``).

    Examples:
        >>> from hardeq.testing import random_spd
        >>> S = random_spd(3, generator=torch.Generator().manual_seed(0))
        >>> S.shape, S.dtype, torch.equal(S, S.T), bool((torch.linalg.eigvalsh(S) > 0).all())
        (torch.Size([3, 3]), torch.float64, True, True)
    """
    X = torch.randn(n, n, dtype=dtype, generator=generator)
    return X @ X.T / n + 0.5 * torch.eye(n, dtype=dtype)


def sum_conditioned_truncated_means(loc: ArrayLike, sd: ArrayLike, total: float, lower: float, upper: float,
                                    h: float) -> np.ndarray:
    r"""``E[z_i]`` of independent :math:`z_i \sim \mathcal N(\mu_i, \sigma_i^2)` truncated to ``[lower, upper]`` and
    conditioned on :math:`\sum_i z_i = ` ``total``: the law of a diagonal Gaussian on the plane of one sum
    constraint, restricted to a box (an oracle for truncated samplers that shares no code with them).

    Each :math:`z_i` is discretised to the midpoints of cells of width ``h`` on ``[lower, upper]`` (cell masses from
    normal CDF differences); the law of the sum of the others is the convolution of their cell masses, done by FFT
    in log-magnitude / phase form so that products of many small transforms do not underflow. The result is exact
    up to the grid (about ``h``) and the FFT's round-off.

    Args:
        loc, sd: ``(n,)`` numpy arrays of the untruncated means and standard deviations.
        total: the sum; ``lower``, ``upper``: the box (the same for every coordinate); ``h``: the grid step.

    Returns:
        ``(n,)`` float64 numpy array of the conditional means.

    Cost: ``O(n^2 C log C)`` for ``C = (upper - lower) / h`` cells. Needs scipy.

    Examples:
        >>> import numpy as np
        >>> loc, sd = np.array([0.3, 0.5]), np.array([0.2, 0.2])
        >>> [round(float(m), 4) for m in sum_conditioned_truncated_means(loc, sd, 1.0, -2.0, 3.0, 1e-3)]
        [0.4, 0.6]
        >>> [round(float(m), 4) for m in sum_conditioned_truncated_means(loc, sd, 1.0, 0.0, 1.0, 1e-3)]
        [0.401, 0.599]

        A box far wider than the law gives the linear conditional mean ``loc + sd^2 (1 - sum loc) / sum sd^2``;
        ``[0, 1]`` pushes the first coordinate, nearer its lower bound, up.
    """
    from scipy import stats

    loc, sd = np.asarray(loc, dtype=np.float64), np.asarray(sd, dtype=np.float64)
    cells = int(round((upper - lower) / h))
    edges = lower + h * np.arange(cells + 1)
    mids = edges[:-1] + h / 2
    masses = np.diff(stats.norm.cdf((edges[None, :] - loc[:, None]) / sd[:, None]), axis=1)
    masses /= masses.sum(1, keepdims=True)
    n = len(loc)
    target = int(round((total - n * (lower + h / 2)) / h))  # the sum of the n cell indices
    size = 1 << int(math.ceil(math.log2(2 * (target + cells))))  # sums past size alias: their mass is negligible
    f = np.fft.rfft(masses, size, axis=1)
    log_f = np.log(np.abs(f) + 1e-300)
    total_log = log_f.sum(0)
    phase = np.angle(f).sum(0)
    means = np.empty(n)
    rest = target - np.arange(cells)
    inside = (rest >= 0) & (rest < size)
    for i in range(n):
        others = np.fft.irfft(np.exp(total_log - log_f[i] + 1j * (phase - np.angle(f[i]))), size)
        weight = np.where(inside, masses[i] * others[np.clip(rest, 0, size - 1)], 0.0).clip(min=0.0)
        means[i] = (weight * mids).sum() / weight.sum()
    return means
