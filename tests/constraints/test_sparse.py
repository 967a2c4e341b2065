"""SparseConstraint (CSR and COO): the conformance suite, the rank check and what must not densify."""

import pytest
import torch

import hardeq
from hardeq.testing import ConstraintTestCase

# torch's notice on building CSR tensors in this file (the library silences its own)
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


def random_sparse(a, n, per_column, seed, dtype):
    """``a x n`` with ``per_column`` random rows per column (the pattern of a flow network's balances)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(a, generator=g)[:per_column] for _ in range(n)], -1)  # (p, n)
    cols = torch.arange(n).expand(per_column, n)
    values = torch.randn(per_column * n, generator=g, dtype=torch.float64)
    A = torch.zeros(a, n, dtype=torch.float64).index_put((rows.flatten(), cols.flatten()), values)
    return A.to(dtype)


class TestSparseCSR(ConstraintTestCase):
    def create(self, batch_shape, dtype, seed):
        A = random_sparse(4, 11, 2, seed, dtype)
        k = torch.randn(batch_shape + (4,), generator=torch.Generator().manual_seed(seed + 1),
                        dtype=torch.float64).to(dtype)
        return hardeq.SparseConstraint(A.to_sparse_csr(), k, validate_args=True), A, k


class TestSparseCOO(ConstraintTestCase):
    def create(self, batch_shape, dtype, seed):
        A = random_sparse(3, 8, 2, seed + 10, dtype)
        k = torch.randn(batch_shape + (3,), generator=torch.Generator().manual_seed(seed + 1),
                        dtype=torch.float64).to(dtype)
        return hardeq.SparseConstraint(A.to_sparse(), k, validate_args=True), A, k


class TestSparseDiagonalGram(ConstraintTestCase):
    """One nonzero per column: A diag(v) A^T is diagonal for every v."""

    def create(self, batch_shape, dtype, seed):
        A = random_sparse(3, 9, 1, seed, dtype)
        k = torch.randn(batch_shape + (3,), generator=torch.Generator().manual_seed(seed + 1),
                        dtype=torch.float64).to(dtype)
        return hardeq.SparseConstraint(A.to_sparse_csr(), k), A, k


def test_diagonal_gram_is_returned_for_one_nonzero_per_column():
    A = random_sparse(3, 9, 1, 0, torch.float64)
    assert hardeq.SparseConstraint(A.to_sparse_csr(), torch.zeros(3, dtype=torch.float64)).diagonal_gram(
        torch.ones(9, dtype=torch.float64)) is not None
    A = random_sparse(3, 9, 2, 0, torch.float64)
    assert hardeq.SparseConstraint(A.to_sparse_csr(), torch.zeros(3, dtype=torch.float64)).diagonal_gram(
        torch.ones(9, dtype=torch.float64)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_deficient_sparse_A_is_rejected(dtype):
    A = random_sparse(3, 10, 2, 0, torch.float64)
    A[2] = 2.0 * A[0] - 1e3 * A[1]
    with pytest.raises(ValueError, match="A must have full row rank 3"):
        hardeq.SparseConstraint(A.to(dtype).to_sparse_csr(), torch.zeros(3, dtype=dtype), validate_args=True)


def test_badly_scaled_sparse_A_is_accepted():
    A = torch.tensor([[1e7, 1e7, 1e7, 0, 0], [0, 0, 1, 1, -1]])
    c = hardeq.SparseConstraint(A.to_sparse_csr(), torch.ones(2), validate_args=True)
    expected = torch.linalg.slogdet(A.double() @ A.double().mT)[1]
    torch.testing.assert_close(c.logdet_gram_identity().double(), expected, rtol=1e-6, atol=0)


def test_bad_inputs():
    with pytest.raises(TypeError, match="sparse"):
        hardeq.SparseConstraint(torch.ones(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match="fewer rows than columns"):
        hardeq.SparseConstraint(torch.eye(3).to_sparse_csr(), torch.ones(3))
    with pytest.raises(ValueError, match="k must have shape"):
        hardeq.SparseConstraint(torch.eye(2, 4).to_sparse_csr(), torch.ones(3))
    A = torch.eye(2, 4)
    A[0, 3] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        hardeq.SparseConstraint(A.to_sparse_csr(), torch.ones(2), validate_args=True)


def test_operator_paths_do_not_densify(monkeypatch):
    """matvec, rmatvec, abs_matvec, the diagonal-covariance Gram, log det, projection and the per-row check
    never materialise the a x n matrix."""
    a, n = 20, 5000
    A = random_sparse(a, n, 2, 1, torch.float64).to_sparse_csr()
    c = hardeq.SparseConstraint(A, torch.randn(3, a, dtype=torch.float64), validate_args=True)

    def refuse(*args, **kwargs):
        raise AssertionError("densified")

    monkeypatch.setattr(hardeq.SparseConstraint, "dense_matrix", refuse)
    z = torch.randn(2, 3, n, dtype=torch.float64)
    c.matvec(z), c.rmatvec(c.k), c.abs_matvec(z.abs()), c.logdet_gram_identity()
    G = c.gram(hardeq.DiagonalCovariance(torch.rand(n, dtype=torch.float64) + 0.5))
    assert G.shape == (a, a)
    assert bool(c.check(c.project(z)).all())
    assert bool(c.check(c.particular_solution()).all())


def test_gram_without_the_pair_matrix(monkeypatch):
    """Above MAX_GRAM_PAIRS the Gram matrix is one sparse-sparse product per batch element: same result."""
    A = random_sparse(5, 30, 3, 2, torch.float64)
    c = hardeq.SparseConstraint(A.to_sparse_csr(), torch.zeros(5, dtype=torch.float64))
    cov = hardeq.DiagonalCovariance(torch.rand(2, 30, dtype=torch.float64) + 0.5)
    expected = (A * cov.variance.unsqueeze(-2)) @ A.mT
    torch.testing.assert_close(c.gram(cov), expected, rtol=1e-12, atol=0)
    monkeypatch.setattr(hardeq.constraints.sparse, "MAX_GRAM_PAIRS", 0)
    fresh = hardeq.SparseConstraint(A.to_sparse_csr(), torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(fresh.gram(cov), expected, rtol=1e-12, atol=0)
    assert fresh._pair_matrix() is None


def test_same_A_tensor_is_prepared_once(monkeypatch):
    A = random_sparse(4, 12, 2, 3, torch.float64).to_sparse_csr()
    c1 = hardeq.SparseConstraint(A, torch.zeros(4, dtype=torch.float64), validate_args=True)
    calls = []
    monkeypatch.setattr(hardeq.constraints.sparse, "_GramFactors",
                        lambda *args: calls.append(1) or (_ for _ in ()).throw(AssertionError("refactorised")))
    c2 = hardeq.SparseConstraint(A, torch.ones(4, dtype=torch.float64), validate_args=True)  # new k, same A
    assert c2.sparse_matrix is c1.sparse_matrix and not calls
    torch.testing.assert_close(c2.logdet_gram_identity(), c1.logdet_gram_identity())


@pytest.mark.parametrize("layout", ["csr", "coo"])
def test_the_per_A_cache_dies_with_A(layout):
    import gc

    from hardeq.constraints import sparse

    dense = random_sparse(3, 9, 2, 4, torch.float64)
    A = dense.to_sparse_csr() if layout == "csr" else dense.to_sparse()
    c = hardeq.SparseConstraint(A, torch.zeros(3, dtype=torch.float64), validate_args=True)
    key = id(A)
    assert key in sparse._PREPARED
    del A, c
    gc.collect()
    assert key not in sparse._PREPARED
