"""The blocked products of ``SparseConstraint`` (many vectors on the CPU: ``A z``, ``|A||z|`` and ``A^T u`` tile by
tile) and what uses them: the sparse Cholesky factor's in-place step, the remembered Gram matrix, the float64 copy.

Small problems exercise every path by shrinking the block sizes (several column blocks, ragged last blocks and
tiles, blocks without entries); each product is compared per row with a dense float64 reference."""

from __future__ import annotations

import warnings

import pytest
import torch

import hardeq
from hardeq.constraints import sparse as sparse_module
from hardeq.constraints import sparse_blocks
from hardeq.linalg.conditioning import Conditioner
from hardeq.linalg.conditioning.sparse import SparseCholeskyFactor

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Blocks of 64 columns, tiles of 3 vectors, blocked from 256 elements on."""
    monkeypatch.setattr(sparse_blocks, "BLOCK_COLUMNS", 64)
    monkeypatch.setattr(sparse_blocks, "BLOCK_VECTORS", 3)
    monkeypatch.setattr(sparse_module, "BLOCKED_MIN_ELEMENTS", 256)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        yield


def _matrix(a=9, n=300, seed=0, empty_row=False):
    """Dense float64 ``(a, n)``: rows scaled over twelve decades, columns 128:192 empty (a block without entries),
    the last block ragged (300 = 4 x 64 + 44); with ``empty_row``, row 3 has no entries."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64) * (torch.rand(a, n, generator=g) < 0.2)
    A[torch.arange(a), torch.arange(a)] = 1.0
    A[:, 128:192] = 0.0
    A = A * torch.logspace(-6, 6, a, dtype=torch.float64).unsqueeze(-1)
    if empty_row:
        A[3] = 0.0
    return A


def _tol(dtype):
    return 50 * torch.finfo(dtype).eps


def _per_row_error(value, reference, size):
    """``max_i |value - reference|_i / size_i`` (``size``: the sum of the magnitudes of the terms of row ``i``)."""
    return float(((value.double() - reference).abs() / size.clamp_min(1e-300)).max())


@DTYPES
@pytest.mark.parametrize("lead", [(7,), (2, 5), (1,)], ids=["batch", "two_dims", "one"])
@pytest.mark.parametrize("empty_row", [False, True], ids=["full_rows", "empty_row"])
def test_blocked_products_match_the_dense_reference_per_row(dtype, lead, empty_row):
    A = _matrix(empty_row=empty_row)
    a, n = A.shape
    con = hardeq.SparseConstraint(A.to(dtype).to_sparse_csr(), torch.zeros(a, dtype=dtype), validate_args=False)
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(lead + (n,), generator=g, dtype=torch.float64) * torch.logspace(-3, 3, n, dtype=torch.float64))
    u = torch.randn(lead + (a,), generator=g, dtype=torch.float64).to(dtype)
    z = z.to(dtype)
    assert con._blocked(z, n) and con._blocked(u, n)  # the blocked path is the one under test
    z64, u64 = z.double(), u.double()
    size = z64.abs() @ A.abs().mT
    Az, scale = con.matvec_and_scale(z)
    assert _per_row_error(Az, z64 @ A.mT, size) <= _tol(dtype)
    assert _per_row_error(con.matvec(z), z64 @ A.mT, size) <= _tol(dtype)
    assert _per_row_error(scale, size, size) <= _tol(dtype)
    Atu = con.rmatvec(u)
    assert Atu.shape == lead + (n,) and Atu.is_contiguous() and Atu.dtype == dtype
    assert _per_row_error(Atu.mT if Atu.dim() > 1 else Atu, (u64 @ A).mT if Atu.dim() > 1 else u64 @ A,
                          (u64.abs() @ A.abs()).mT if Atu.dim() > 1 else u64.abs() @ A.abs()) <= _tol(dtype)
    assert bool((Atu[..., 128:192] == 0).all())  # the block without entries is written, with zeros


@DTYPES
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_rmatvec_add_updates_in_place(dtype, weighted):
    A = _matrix()
    a, n = A.shape
    con = hardeq.SparseConstraint(A.to(dtype).to_sparse_csr(), torch.zeros(a, dtype=dtype))
    g = torch.Generator().manual_seed(2)
    z = torch.randn(8, n, generator=g, dtype=dtype)
    u = torch.randn(8, a, generator=g, dtype=dtype)
    w = torch.rand(n, generator=g, dtype=dtype) + 0.5 if weighted else None
    z0, ptr = z.double().clone(), z.data_ptr()  # (a copy also in float64)
    out = con.rmatvec_add_(z, u, w)
    assert out is z and z.data_ptr() == ptr
    w64 = torch.ones(n, dtype=torch.float64) if w is None else w.double()
    expected = z0 + w64 * (u.double() @ A)
    size = z0.abs() + w64 * (u.double().abs() @ A.abs())
    assert float(((z.double() - expected).abs() / size).max()) <= _tol(dtype)
    # the unblocked fallback (one vector below the threshold) gives the same result
    z1 = z0[:1].to(dtype)
    con.rmatvec_add_(z1, u[:1], w)
    torch.testing.assert_close(z1.double(), expected[:1], rtol=_tol(dtype), atol=_tol(dtype) * float(size.max()))


def test_rmatvec_add_rejects_mismatched_shapes():
    A = _matrix()
    con = hardeq.SparseConstraint(A.to_sparse_csr(), torch.zeros(A.shape[0], dtype=torch.float64))
    with pytest.raises(ValueError, match="same leading shape"):
        con.rmatvec_add_(torch.zeros(4, A.shape[1], dtype=torch.float64), torch.zeros(3, A.shape[0],
                                                                                      dtype=torch.float64))
    with pytest.raises(ValueError, match="weight must have shape"):
        con.rmatvec_add_(torch.zeros(4, A.shape[1], dtype=torch.float64), torch.zeros(4, A.shape[0],
                                                                                      dtype=torch.float64),
                         torch.ones(5, dtype=torch.float64))


def test_transposed_storage_and_gradients_take_the_whole_product():
    A = _matrix()
    a, n = A.shape
    con = hardeq.SparseConstraint(A.to_sparse_csr(), torch.zeros(a, dtype=torch.float64))
    zt = torch.randn(n, 6, dtype=torch.float64)  # samples stored transposed: zt.mT has stride(-1) != 1
    torch.testing.assert_close(con.matvec(zt.mT), zt.mT @ A.mT)
    Az, scale = con.matvec_and_scale(zt.mT)
    torch.testing.assert_close(Az, zt.mT @ A.mT)
    torch.testing.assert_close(scale, zt.mT.abs() @ A.abs().mT)
    z = torch.randn(6, n, dtype=torch.float64, requires_grad=True)
    assert not con._blocked(z, n)
    (grad,) = torch.autograd.grad(con.matvec(z).sum(), z)
    torch.testing.assert_close(grad, A.sum(0).expand(6, n))


@DTYPES
def test_sparse_factor_step_equals_the_whole_product_step(dtype, monkeypatch):
    """The conditioner builds the sparse Cholesky factor; its in-place step (blocked) gives the samples of the
    unblocked step from the same noise, to round-off, and every row of every sample passes the check."""
    A = _matrix(a=6, n=200)
    a, n = A.shape
    g = torch.Generator().manual_seed(3)
    k = torch.randn(a, generator=g, dtype=torch.float64).to(dtype) * 10
    loc = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    scale = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype)

    def sample():
        con = hardeq.SparseConstraint(A.to(dtype).to_sparse_csr(), k)
        dist = hardeq.ConstrainedNormal(loc, scale, constraint=con)
        torch.manual_seed(4)
        z = dist.sample((10,))
        return z, con, dist

    z, con, dist = sample()
    assert isinstance(dist.conditioner.factor, SparseCholeskyFactor)
    assert bool(con.check(z).all())
    monkeypatch.setattr(sparse_module, "BLOCKED_MIN_ELEMENTS", 1 << 62)  # every product whole
    z_whole, _, _ = sample()
    size = z_whole.double().abs().max()
    torch.testing.assert_close(z.double(), z_whole.double(), rtol=0, atol=float(_tol(dtype) * size))


def test_gram_is_remembered_for_equal_variances(monkeypatch):
    A = _matrix()
    a, n = A.shape
    calls = []
    real = sparse_module._gram_diagonal
    monkeypatch.setattr(sparse_module, "_gram_diagonal", lambda c, v: calls.append(1) or real(c, v))
    csr = A.to_sparse_csr()
    variance = torch.rand(n, dtype=torch.float64) + 0.5
    cov = hardeq.DiagonalCovariance(variance.sqrt())
    first = hardeq.SparseConstraint(csr, torch.zeros(a, dtype=torch.float64)).gram(cov)
    second = hardeq.SparseConstraint(csr, torch.ones(a, dtype=torch.float64)).gram(
        hardeq.DiagonalCovariance(variance.sqrt().clone()))  # a new k and equal variances: remembered
    assert len(calls) == 1 and torch.equal(first, second)
    torch.testing.assert_close(first, A @ (variance.unsqueeze(-1) * A.mT))
    second.zero_()  # the caller owns its copy
    third = hardeq.SparseConstraint(csr, torch.zeros(a, dtype=torch.float64)).gram(cov)
    assert len(calls) == 1 and torch.equal(first, third)
    other = variance.clone()
    other[5] *= 2  # other variances: computed anew
    fourth = hardeq.SparseConstraint(csr, torch.zeros(a, dtype=torch.float64)).gram(
        hardeq.DiagonalCovariance(other.sqrt()))
    assert len(calls) == 2
    torch.testing.assert_close(fourth, A @ (other.unsqueeze(-1) * A.mT))
    s = variance.sqrt().clone().requires_grad_(True)  # with gradient: never from the memo
    hardeq.SparseConstraint(csr, torch.zeros(a, dtype=torch.float64)).gram(hardeq.DiagonalCovariance(s)).sum() \
        .backward()
    assert len(calls) == 3 and s.grad is not None


def test_float64_copy_shares_its_caches_per_A():
    A = _matrix()
    csr = A.to(torch.float32).to_sparse_csr()
    con = hardeq.SparseConstraint(csr, torch.zeros(A.shape[0]))
    wide, again = con.to(dtype=torch.float64), hardeq.SparseConstraint(csr, torch.ones(A.shape[0])).to(
        dtype=torch.float64)
    assert wide.dtype == torch.float64 and wide.k.dtype == torch.float64
    assert wide._shared is again._shared and wide._A is again._A
    torch.testing.assert_close(wide.dense_matrix(), A.to(torch.float32).double())
    z = torch.randn(5, A.shape[1], dtype=torch.float64)
    torch.testing.assert_close(wide.matvec(z), z @ A.to(torch.float32).double().mT)
    assert torch.equal(again.k, torch.ones(A.shape[0], dtype=torch.float64))


def test_conditioner_uses_the_sparse_factor_only_for_sparse_constraints():
    A = _matrix(a=4, n=40)
    cov = hardeq.DiagonalCovariance(torch.ones(40, dtype=torch.float64))
    dense = Conditioner(cov, hardeq.LinearConstraint(A, torch.zeros(4, dtype=torch.float64)), method="cholesky")
    sparse = Conditioner(cov, hardeq.SparseConstraint(A.to_sparse_csr(), torch.zeros(4, dtype=torch.float64)),
                         method="cholesky")
    assert type(dense.factor).__name__ == "CholeskyFactor" and isinstance(sparse.factor, SparseCholeskyFactor)
