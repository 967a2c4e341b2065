"""Conformance suite of the covariance structures against a dense float64 oracle.

In the manner of linear_operator's ``LinearOperatorTestCase``: a structure's test class only says how to
build it (``create``) and what it is densely (``dense``); every method of :class:`hardeq.Covariance` is then
checked against ``torch.linalg`` on the dense matrix. A new structure is one subclass below.
"""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.linalg.covariance import Covariance, register_trace_inv_mul, trace_inv_mul

DT = torch.float64
BATCH = (2, 3)
N = 5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class CovarianceTestCase:
    """Base: subclasses implement ``create(batch_shape, seed) -> (Covariance, dense Sigma)``."""

    def create(self, batch_shape, seed=0) -> tuple[Covariance, torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ the checks
    def test_shapes_and_identity(self):
        cov, S = self.create(BATCH)
        assert cov.event_size == N and cov.batch_shape == torch.Size(BATCH)
        assert cov.dtype == DT and cov.device == S.device
        assert all(isinstance(t, torch.Tensor) for t in cov.tensors())
        torch.testing.assert_close(cov.dense(), S)

    def test_diagonal_and_decomposition(self):
        cov, S = self.create(BATCH)
        torch.testing.assert_close(cov.diagonal(), S.diagonal(dim1=-2, dim2=-1))
        d, V = cov.diag_part(), cov.factor_part()
        rebuilt = torch.zeros_like(S)
        if d is not None:
            rebuilt = rebuilt + torch.diag_embed(d)
        if V is not None:
            rebuilt = rebuilt + V @ V.mT
        torch.testing.assert_close(rebuilt, S)

    def test_square_root(self):
        cov, S = self.create(BATCH)
        eye = torch.eye(cov.noise_size, dtype=DT).expand(BATCH + (cov.noise_size, cov.noise_size))
        F = cov.sqrt_matmul(eye)  # (*batch, n, m)
        torch.testing.assert_close(F @ F.mT, S)
        Y = torch.randn(BATCH + (N, 4), dtype=DT, generator=_gen(1))
        torch.testing.assert_close(cov.sqrt_t_matmul(Y), F.mT @ Y)
        noise = torch.randn((7,) + BATCH + (cov.noise_size,), dtype=DT, generator=_gen(2))
        torch.testing.assert_close(cov.sqrt_matvec(noise), (F @ noise.unsqueeze(-1)).squeeze(-1))

    def test_products_with_sample_dimensions(self):
        cov, S = self.create(BATCH)
        x = torch.randn((4,) + BATCH + (N,), dtype=DT, generator=_gen(3))
        torch.testing.assert_close(cov.matvec(x), (S @ x.unsqueeze(-1)).squeeze(-1))

    def test_inverse_and_logdet(self):
        cov, S = self.create(BATCH)
        Sinv = torch.linalg.inv(S)
        x = torch.randn((4,) + BATCH + (N,), dtype=DT, generator=_gen(5))
        torch.testing.assert_close(cov.inv_matvec(x), (Sinv @ x.unsqueeze(-1)).squeeze(-1))
        torch.testing.assert_close(cov.inv_quad(x), (x * (Sinv @ x.unsqueeze(-1)).squeeze(-1)).sum(-1))
        X = torch.randn(BATCH + (N, 3), dtype=DT, generator=_gen(6))
        torch.testing.assert_close(cov.inv_quad_matrix(X), (X.mT @ Sinv @ X).diagonal(dim1=-2, dim2=-1).sum(-1))
        torch.testing.assert_close(cov.inv_diagonal(), Sinv.diagonal(dim1=-2, dim2=-1))
        torch.testing.assert_close(cov.logdet(), torch.linalg.slogdet(S)[1])

    @pytest.mark.parametrize("other", ["diag", "full", "lowrank"])
    def test_trace_against_every_structure(self, other):
        p, Sp = self.create(BATCH, seed=7)
        q, Sq = CASES[other]().create(BATCH, seed=8)
        expected = (torch.linalg.inv(Sp) @ Sq).diagonal(dim1=-2, dim2=-1).sum(-1)
        torch.testing.assert_close(trace_inv_mul(p, q), expected)

    def test_to_dtype(self):
        cov, S = self.create(BATCH)
        c32 = cov.to(dtype=torch.float32)
        assert type(c32) is type(cov) and c32.dtype == torch.float32
        torch.testing.assert_close(c32.dense(), S.float(), rtol=1e-5, atol=1e-5)
        assert cov.to(dtype=DT) is cov

    def test_check_values_rejects_non_finite(self):
        cov, _ = self.create(())
        bad = [t.clone().contiguous() for t in cov.tensors()]
        bad[0].view(-1)[0] = float("nan")
        with pytest.raises(ValueError, match="finite"):
            type(cov)(*bad).check_values()

    def test_distribution_accepts_the_object(self):
        cov, S = self.create(BATCH)
        A = torch.randn(2, N, dtype=DT, generator=_gen(9))
        k = torch.randn(BATCH + (2,), dtype=DT, generator=_gen(10))
        d = hardeq.ConstrainedNormal(torch.zeros(BATCH + (N,), dtype=DT), covariance=cov,
                                     constraint=hardeq.LinearConstraint(A, k))
        assert d.covariance is cov and d.noise_size == cov.noise_size
        z = d.sample((3,))
        assert bool(d.constraint.check(z).all())
        # conditional covariance Sigma - Sigma A^T S^-1 A Sigma
        SA = S @ A.T
        expected = S - SA @ torch.linalg.solve(A @ SA, SA.mT)
        torch.testing.assert_close(d.covariance_matrix, expected)


class TestDiagonal(CovarianceTestCase):
    def create(self, batch_shape, seed=0):
        scale = 0.5 + torch.rand(tuple(batch_shape) + (N,), dtype=DT, generator=_gen(seed))
        return hardeq.DiagonalCovariance(scale), torch.diag_embed(scale**2)


class TestFull(CovarianceTestCase):
    def create(self, batch_shape, seed=0):
        X = torch.randn(tuple(batch_shape) + (N, N), dtype=DT, generator=_gen(seed))
        S = X @ X.mT / N + 0.5 * torch.eye(N, dtype=DT)
        return hardeq.FullCovariance(torch.linalg.cholesky(S)), S


class TestLowRank(CovarianceTestCase):
    def create(self, batch_shape, seed=0):
        g = _gen(seed)
        W = 0.7 * torch.randn(tuple(batch_shape) + (N, 2), dtype=DT, generator=g)
        scale = 0.5 + torch.rand(tuple(batch_shape) + (N,), dtype=DT, generator=g)
        return hardeq.LowRankCovariance(W, scale), W @ W.mT + torch.diag_embed(scale**2)


CASES = {"diag": TestDiagonal, "full": TestFull, "lowrank": TestLowRank}


# ---------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize("builder, error, match", [
    (lambda: hardeq.DiagonalCovariance([1.0, 2.0]), TypeError, "scale"),
    (lambda: hardeq.DiagonalCovariance(torch.ones(())), ValueError, "scale"),
    (lambda: hardeq.FullCovariance(torch.ones(3, 2)), ValueError, "square"),
    (lambda: hardeq.LowRankCovariance(torch.ones(4, 2), torch.ones(3)), ValueError, "cov_factor"),
    (lambda: hardeq.LowRankCovariance(torch.ones(4, 2), torch.ones(4, dtype=DT)), TypeError, "dtype"),
    (lambda: hardeq.LowRankCovariance(torch.ones(2, 4, 2), torch.ones(3, 4)), ValueError, "broadcast"),
])
def test_bad_construction(builder, error, match):
    with pytest.raises(error, match=match):
        builder()


def test_positive_scale_is_checked():
    with pytest.raises(ValueError, match="scale .* positive"):
        hardeq.DiagonalCovariance(torch.tensor([1.0, -1.0])).check_values()
    with pytest.raises(ValueError, match="lower triangular"):
        hardeq.FullCovariance(torch.ones(3, 3)).check_values()


def test_shortcuts_build_the_same_object():
    loc, scale = torch.zeros(4), torch.ones(4)
    c = hardeq.SumConstraint(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 2.0]))
    d = hardeq.ConstrainedNormal(loc, scale, constraint=c)
    assert isinstance(d.covariance, hardeq.DiagonalCovariance) and d.covariance.scale is scale
    d = hardeq.ConstrainedNormal(loc, scale, cov_factor=torch.ones(4, 1), constraint=c)
    assert isinstance(d.covariance, hardeq.LowRankCovariance) and d.scale_tril is None
    d = hardeq.ConstrainedNormal(loc, scale_tril=torch.eye(4), constraint=c)
    assert isinstance(d.covariance, hardeq.FullCovariance) and d.scale is None
    with pytest.raises(ValueError, match="covariance= alone"):
        hardeq.ConstrainedNormal(loc, scale, covariance=hardeq.DiagonalCovariance(scale), constraint=c)
    with pytest.raises(TypeError, match="covariance must be"):
        hardeq.ConstrainedNormal(loc, covariance=scale, constraint=c)


def test_trace_dispatch_prefers_the_most_specific_registration():
    class Scaled(hardeq.DiagonalCovariance):
        pass

    p = Scaled(torch.full((3,), 2.0, dtype=DT))
    q = hardeq.DiagonalCovariance(torch.ones(3, dtype=DT))
    torch.testing.assert_close(trace_inv_mul(p, q), torch.tensor(0.75, dtype=DT))  # inherited (Diagonal, *)
    calls = []

    @register_trace_inv_mul(Scaled, hardeq.DiagonalCovariance)
    def _special(p_, q_):
        calls.append(1)
        return (q_.variance / p_.variance).sum(-1)

    torch.testing.assert_close(trace_inv_mul(p, q), torch.tensor(0.75, dtype=DT))
    assert calls == [1]


def test_trace_inv_mul_rejects_unregistered_types():
    q = hardeq.DiagonalCovariance(torch.ones(3, dtype=DT))
    with pytest.raises(TypeError, match=r"p: Tensor, q: DiagonalCovariance"):
        trace_inv_mul(torch.eye(3, dtype=DT), q)
