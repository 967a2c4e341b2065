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

import torch
from torch import Tensor

__all__ = ["DenseConditional", "dense_conditional", "mc_atol", "FAILURE_RATE", "random_spd"]

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
