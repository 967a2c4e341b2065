"""The COO form a ``SparseConstraint`` computes with under ``torch.compile`` (``hardeq.constraints.sparse_traced``):
every product against a dense float64 oracle of ``A``, and a compiled sample with no graph break, exact per row."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.constraints import sparse as sparse_module
from hardeq.testing import assert_exact_per_row

pytestmark = pytest.mark.filterwarnings("ignore:.*[Ss]parse CSR.*:UserWarning")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])


def _matrix(kind: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    a, n = 5, 23
    A = torch.zeros(a, n, dtype=torch.float64)
    for j in range(n):  # "diagonal": one nonzero per column (a diagonal Gram); "flow": one or two
        rows = [j % a] if kind == "diagonal" or j % 3 else [j % a, (j + 2) % a]
        A[rows, j] = torch.randn(len(rows), generator=g, dtype=torch.float64)
    A[3] = 0.0
    A[3, 7] = 2.5  # a row with one nonzero: it determines coordinate 7
    return A.to(dtype)


@pytest.mark.parametrize("kind", ["flow", "diagonal"])
@DTYPES
def test_the_coo_form_gives_the_dense_products(kind, dtype):
    g = torch.Generator().manual_seed(0)
    A = _matrix(kind, dtype, g)
    k = torch.randn(2, 5, generator=g, dtype=dtype)
    con = hardeq.SparseConstraint(A.to_sparse_csr(), k)
    t = con._traced
    z = torch.randn(3, 2, 23, generator=g, dtype=dtype)
    u = torch.randn(3, 2, 5, generator=g, dtype=dtype)
    v = torch.rand(2, 23, generator=g, dtype=dtype) + 0.5
    A64, tol = A.double(), 1e-5 if dtype == torch.float32 else 1e-12
    for got, want in [(t.matvec(z), z.double() @ A64.T),
                      (t.matvec(z.abs(), absolute=True), z.double().abs() @ A64.abs().T),
                      (t.rmatvec(u), u.double() @ A64), (t.dense(), A64),
                      (t.logdet_gram_identity(), torch.logdet(A64 @ A64.T))]:
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if kind == "diagonal":
        torch.testing.assert_close(t.diagonal_gram_of(v).double(), (A64.square() @ v.double().T).T, rtol=tol, atol=tol)
    else:
        want = torch.einsum("in,bn,jn->bij", A64, v.double(), A64)
        torch.testing.assert_close(t.gram(v).double(), want, rtol=tol, atol=tol)
    mask, values = t.pinned(k)
    assert mask.nonzero().flatten().tolist() == [7]
    torch.testing.assert_close(values[:, 7], k[:, 3] / 2.5)
    assert t.to(torch.float64).val.dtype == torch.float64


def test_a_traced_gram_beyond_the_pair_budget_is_refused(monkeypatch):
    monkeypatch.setattr(sparse_module, "TRACED_MAX_PAIRS", 0)
    A = _matrix("flow", torch.float64, torch.Generator().manual_seed(0))
    con = hardeq.SparseConstraint(A.clone().to_sparse_csr(), torch.zeros(5, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="TRACED_MAX_PAIRS"):
        con._traced.gram(torch.ones(23, dtype=torch.float64))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# (the flow kind's Gram matrix is also compiled by tests/test_compiled_training_step.py: slow here)
@pytest.mark.parametrize("kind", [pytest.param("flow", marks=pytest.mark.slow), "diagonal"])
@DTYPES
def test_a_compiled_sample_has_no_graph_break_and_is_exact(kind, dtype, fresh_dynamo):
    g = torch.Generator().manual_seed(1)
    A = _matrix(kind, dtype, g)
    con = hardeq.SparseConstraint(A.to_sparse_csr(), torch.zeros(5, dtype=dtype))
    loc, scale = torch.randn(2, 23, generator=g, dtype=dtype), torch.rand(2, 23, generator=g, dtype=dtype) + 0.5
    k, eps = torch.randn(2, 5, generator=g, dtype=dtype), torch.randn(2, 23, generator=g, dtype=dtype)

    def draw(loc, scale, k, eps):
        d = hardeq.ConstrainedNormal(loc, scale, constraint=con.with_k(k))
        return d.rsample(noise=eps), d.log_prob(d.mean)

    z, lp = torch.compile(draw, fullgraph=True, backend="aot_eager")(loc, scale, k, eps)
    z_eager, lp_eager = draw(loc, scale, k, eps)
    assert_exact_per_row(con.with_k(k), z)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(z, z_eager, rtol=tol, atol=tol * float(z_eager.abs().max()))
    torch.testing.assert_close(lp, lp_eager, rtol=tol, atol=tol * float(lp_eager.abs().max()))
