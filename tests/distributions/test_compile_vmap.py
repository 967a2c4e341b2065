"""ConstrainedNormal under ``torch.compile`` and ``torch.func.vmap`` (diagonal covariance, ``validate_args=False``).

* ``torch.compile(fn, fullgraph=True, backend="eager")`` (dynamo traces without a graph break) of a function that
  builds the distribution (constraint built outside or inside it; ``SumConstraint`` and ``LinearConstraint``)
  and returns ``rsample(noise=eps)`` and ``log_prob(z)``. A compiled graph runs a static scheme (a fixed number
  of refinement steps), so its promise is the per-row criterion (``hardeq.testing.exactness``: tol 1e-5
  float32, 1e-12 float64, for these well-conditioned problems) and agreement with eager to ``rtol`` 1e-5
  (float32) / 1e-10 (float64), with ``atol`` that ``rtol`` times the problem's scale (entries near zero).
  The default inductor backend is checked once (``slow``).
* ``vmap`` over ``loc`` (``in_dims=0``) of ``mean``, ``rsample(noise=...)`` and ``log_prob`` equals the batched eager
  result to the same tolerances.

Deterministic (fixed seeds).
"""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.testing import assert_exact_per_row

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
KINDS = pytest.mark.parametrize("kind", ["sum", "dense"])
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}
B, N = 4, 10
INDEX = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])


def problem(kind: str, dtype: torch.dtype):
    """``(loc, scale, A or index, k, eps, z)``: a well-conditioned batch of ``B`` problems in ``dtype``."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    loc, scale = randn(B, N), (0.5 + torch.rand(B, N, generator=g, dtype=torch.float64)).to(dtype)
    k, eps, z = randn(B, 3), randn(2, B, N), randn(B, N)
    return loc, scale, (INDEX if kind == "sum" else randn(3, N)), k, eps, z


def constraint(kind, A_or_index, k):
    if kind == "sum":
        return hardeq.SumConstraint(A_or_index, k, validate_args=False)
    return hardeq.LinearConstraint(A_or_index, k, validate_args=False)


def sample_and_density(loc, scale, con, eps, z):
    d = hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False)
    return d.rsample((2,), noise=eps), d.log_prob(z)


def assert_agrees(actual, expected, dtype, what):
    atol = RTOL[dtype] * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=RTOL[dtype], atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _check_compiled(kind, dtype, backend, inside):
    loc, scale, A_or_index, k, eps, z = problem(kind, dtype)
    con = constraint(kind, A_or_index, k)
    z = hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False).rsample(noise=z)  # on the plane
    if inside:
        def fn(loc, scale, A_or_index, k, eps, z):
            return sample_and_density(loc, scale, constraint(kind, A_or_index, k), eps, z)
        args = (loc, scale, A_or_index, k, eps, z)
    else:
        def fn(loc, scale, eps, z):
            return sample_and_density(loc, scale, con, eps, z)
        args = (loc, scale, eps, z)
    sample, log_prob = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    eager_sample, eager_log_prob = fn(*args)
    assert_exact_per_row(con, sample, msg="compiled rsample")
    assert_agrees(sample, eager_sample, dtype, "compiled rsample vs eager")
    assert_agrees(log_prob, eager_log_prob, dtype, "compiled log_prob vs eager")


@pytest.mark.parametrize("inside", [False, True], ids=["constraint-outside", "constraint-inside"])
@KINDS
@DTYPES
def test_compiles_without_graph_breaks(dtype, kind, inside):
    _check_compiled(kind, dtype, "eager", inside)


@pytest.mark.slow
@KINDS
def test_compiles_with_inductor(kind):
    _check_compiled(kind, torch.float32, "inductor", inside=False)


@KINDS
@DTYPES
def test_vmap_over_loc_equals_the_batched_distribution(dtype, kind):
    loc, scale, A_or_index, k, eps, z = problem(kind, dtype)
    scale, k, eps = scale[0], k[0], eps[0]  # shared by the mapped problems; loc, noise and z are mapped
    con = constraint(kind, A_or_index, k)
    batched = hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False)

    def one(loc_i, eps_i, z_i):
        d = hardeq.ConstrainedNormal(loc_i, scale, constraint=con, validate_args=False)
        return d.mean, d.rsample(noise=eps_i), d.log_prob(z_i)

    noise = eps.expand(B, N).clone()
    mean, sample, log_prob = torch.func.vmap(one, in_dims=0)(loc, noise, z)
    assert_agrees(mean, batched.mean, dtype, "vmap mean")
    assert_agrees(sample, batched.rsample(noise=noise), dtype, "vmap rsample")
    assert_agrees(log_prob, batched.log_prob(z), dtype, "vmap log_prob")
