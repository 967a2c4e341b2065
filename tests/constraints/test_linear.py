"""LinearConstraint: the conformance suite, the rank check (row-scaling invariant) and the per-A cache."""

import pytest
import torch

import hardeq
from hardeq.testing import ConstraintTestCase


class TestLinearConstraint(ConstraintTestCase):
    """A batched dense A (one per batch element) with rows of very different sizes."""

    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        a, n = 3, 7
        A = torch.randn(batch_shape + (a, n), generator=g, dtype=torch.float64)
        A = A * torch.tensor([1.0, 1e3, 1e-2], dtype=torch.float64).unsqueeze(-1)  # badly scaled rows
        k = torch.randn(batch_shape + (a,), generator=g, dtype=torch.float64)
        A, k = A.to(dtype), k.to(dtype)
        return hardeq.LinearConstraint(A, k, validate_args=True), A, k


class TestSharedLinearConstraint(ConstraintTestCase):
    """One A shared by a batch of right-hand sides."""

    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        A = torch.randn(2, 6, generator=g, dtype=torch.float64).to(dtype)
        k = torch.randn(batch_shape + (2,), generator=g, dtype=torch.float64).to(dtype)
        return hardeq.LinearConstraint(A, k), A, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_badly_scaled_full_rank_A_is_accepted(dtype):
    # rows 1e7 apart in size: an unnormalised rank test (singular values 1.7e7 and 1.4) called this rank 1
    A = torch.tensor([[1e7, 1e7, 1e7, 0, 0], [0, 0, 1, 1, -1]], dtype=dtype)
    c = hardeq.LinearConstraint(A, torch.ones(2, dtype=dtype), validate_args=True)
    expected = torch.linalg.slogdet(A.double() @ A.double().mT)[1]
    torch.testing.assert_close(c.logdet_gram_identity().double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_deficient_A_is_rejected(dtype):
    B = torch.randn(2, 6, dtype=torch.float64)
    A = torch.cat([B, (B[:1] * 3e4 - B[1:] * 2.0)], 0).to(dtype)  # third row in the span of the first two
    with pytest.raises(ValueError, match=r"A must have full row rank 3 .*lies within .*expected more than"):
        hardeq.LinearConstraint(A, torch.ones(3, dtype=dtype), validate_args=True)
    hardeq.LinearConstraint(A, torch.ones(3, dtype=dtype), validate_args=False)  # unchecked: allowed


def test_zero_row_is_rejected():
    A = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="full row rank 2"):
        hardeq.LinearConstraint(A, torch.ones(2), validate_args=True)


def _count_qr(monkeypatch):
    calls = []
    qr = torch.linalg.qr

    def counting_qr(*args, **kwargs):
        calls.append(1)
        return qr(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "qr", counting_qr)
    return calls


def test_validation_is_remembered_per_A_tensor(monkeypatch):
    calls = _count_qr(monkeypatch)
    A = torch.randn(4, 9)
    c1 = hardeq.LinearConstraint(A, torch.randn(4), validate_args=True)
    assert len(calls) == 1
    c1.logdet_gram_identity()
    c2 = hardeq.LinearConstraint(A, torch.randn(4), validate_args=True)  # the per-step pattern: same A, new k
    c2.logdet_gram_identity()
    c2.with_k(torch.randn(3, 4)).expand((2, 3)).logdet_gram_identity()
    assert len(calls) == 1, "a second LinearConstraint on the same A tensor ran another QR"
    A.mul_(2.0)  # an in-place change of A invalidates the verdict and the factors
    c3 = hardeq.LinearConstraint(A, torch.randn(4), validate_args=True)
    assert len(calls) == 2
    torch.testing.assert_close(c3.logdet_gram_identity(),
                               c1.logdet_gram_identity() + 4 * 2 * torch.log(torch.tensor(2.0)))


def test_cached_log_det_is_not_stale_for_an_equal_but_different_tensor(monkeypatch):
    A = torch.randn(2, 5, dtype=torch.float64)
    first = hardeq.LinearConstraint(A, torch.zeros(2, dtype=torch.float64)).logdet_gram_identity()
    B = 3 * A  # a different tensor object: its own factors
    second = hardeq.LinearConstraint(B, torch.zeros(2, dtype=torch.float64)).logdet_gram_identity()
    torch.testing.assert_close(second, first + 2 * 2 * torch.log(torch.tensor(3.0, dtype=torch.float64)))


def test_log_det_is_differentiable_in_A():
    A = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    k = torch.zeros(2, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda A: hardeq.LinearConstraint(A, k).logdet_gram_identity(), (A,))
    assert torch.autograd.gradcheck(lambda A: hardeq.LinearConstraint(A, k + 1).particular_solution(), (A,))


def test_float32_log_det_near_square():
    # a = n - 1: the float64 QR keeps the digits a float32 factorisation loses
    torch.manual_seed(0)
    A = torch.randn(59, 60)
    expected = torch.linalg.slogdet(A.double() @ A.double().mT)[1]
    out = hardeq.LinearConstraint(A, torch.zeros(59)).logdet_gram_identity()
    assert abs(float(out) - float(expected)) <= 1e-5 * abs(float(expected))


def test_expand_and_with_k_of_a_batched_A_share_the_factors(monkeypatch):
    A = torch.randn(2, 3, 8, dtype=torch.float64)
    c = hardeq.LinearConstraint(A, torch.randn(2, 3, dtype=torch.float64))
    e = c.expand((4, 2)).with_k(torch.randn(4, 2, 3, dtype=torch.float64))
    calls = _count_qr(monkeypatch)
    e.logdet_gram_identity(), c.logdet_gram_identity(), e.particular_solution(), c.project(torch.randn(2, 8).double())
    # R was computed when c was validated (tests run with validation on); Q is formed once, on first use
    assert len(calls) == 1, "expand/with_k recomputed the factors of a batched A"


def test_the_per_A_cache_dies_with_A():
    import gc

    from hardeq.constraints import linear

    A = torch.randn(3, 7)
    hardeq.LinearConstraint(A, torch.zeros(3), validate_args=True)
    key = id(A)
    assert key in linear._FACTORS
    del A
    gc.collect()
    assert key not in linear._FACTORS
