"""The products of ``SparseConstraint`` in every layout they take: with and without gradient, one vector or a batch
of them, against a dense float64 reference (``A^T u`` written column-major without gradient; ``A z`` and
``|A||z|`` from one transposed copy)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hardeq

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])


@pytest.fixture(autouse=True)
def _quiet_sparse_beta():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        yield


def _problem(dtype, a=7, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64) * (torch.rand(a, n, generator=g) < 0.3)
    A[torch.arange(a), torch.arange(a)] = 1.0  # full row rank
    return hardeq.SparseConstraint(A.to(dtype).to_sparse_csr(), torch.randn(a, dtype=dtype)), A


@DTYPES
@pytest.mark.parametrize("lead", [(), (1,), (5,), (3, 4)], ids=["vector", "one", "batch", "two_dims"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_products_match_the_dense_reference(dtype, lead, grad):
    con, A = _problem(dtype)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(lead + (A.shape[1],), generator=g, dtype=dtype).requires_grad_(grad)
    u = torch.randn(lead + (A.shape[0],), generator=g, dtype=dtype).requires_grad_(grad)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    with torch.set_grad_enabled(grad):
        Az, scale = con.matvec_and_scale(z)
        Atu = con.rmatvec(u)
    torch.testing.assert_close(Az.double(), z.double() @ A.mT, **tol)
    torch.testing.assert_close(scale.double(), z.double().abs() @ A.abs().mT, **tol)
    torch.testing.assert_close(con.matvec(z).double(), z.double() @ A.mT, **tol)
    torch.testing.assert_close(Atu.double(), u.double() @ A, **tol)
    assert Atu.shape == lead + (A.shape[1],) and Atu.is_contiguous()
    assert torch.equal(z.detach(), z.detach().clone())  # z itself is left as it was (|z| is taken on a copy)
    if grad:
        (gz,) = torch.autograd.grad(Az.sum() + scale.sum(), z)
        torch.testing.assert_close(gz.double(), (A.sum(0) + A.abs().sum(0) * z.detach().double().sign()).expand_as(gz),
                                   **tol)
        (gu,) = torch.autograd.grad(Atu.sum(), u)
        torch.testing.assert_close(gu.double(), A.sum(1).expand_as(gu), **tol)


def test_matvec_and_scale_leaves_its_input_unchanged():
    con, A = _problem(torch.float32)
    z = torch.randn(6, A.shape[1])
    zt = torch.randn(A.shape[1], 6)  # samples stored transposed: zt.mT's transpose is zt's own storage
    z1 = torch.randn(1, A.shape[1])
    before = (z.clone(), zt.clone(), z1.clone())
    with torch.no_grad():
        for x in (z, zt.mT, z1):
            _, scale = con.matvec_and_scale(x)
            torch.testing.assert_close(scale.double(), x.double().abs() @ A.abs().mT, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(x, y) for x, y in zip((z, zt, z1), before))
