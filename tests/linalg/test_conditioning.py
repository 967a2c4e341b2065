"""The Conditioner's algorithms (grouped / cholesky / cholesky64 / qr), how each is chosen, and the fallbacks.

Every path is checked against the dense float64 oracle ``hardeq.testing.dense_conditional`` (an SVD null-space
basis; no Matheron step, no Gram matrix), and the fallbacks are exercised by inputs that need them.
"""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.errors import NotPSDError
from hardeq.linalg import conditioning, covariance
from hardeq.linalg.conditioning import Conditioner
from hardeq.linalg.covariance import DiagonalCovariance, FullCovariance, LowRankCovariance
from hardeq.testing import dense_conditional, random_spd


def rel_residual(A, k, z):
    z64 = z.double()
    A64 = A.double()
    return ((z64 @ A64.mT - k.double()).abs().amax(-1) / (z64.abs() @ A64.abs().mT).amax(-1)).max().item()


def ill_conditioned(dtype, decades=8.0, dependence=1e-3, seed=0):
    """Scales over ``decades`` decades and two nearly dependent rows (the existing ill-conditioning test)."""
    g = torch.Generator().manual_seed(seed)
    n, a = 12, 3
    scale = torch.logspace(-decades / 2, decades / 2, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    A[2] = A[1] + dependence * torch.randn(n, generator=g, dtype=torch.float64)
    k = torch.randn(a, generator=g, dtype=torch.float64)
    loc = torch.randn(n, generator=g, dtype=torch.float64) * 100
    return loc.to(dtype), scale.to(dtype), A.to(dtype), k.to(dtype)


# ------------------------------------------------------------------------------------ algorithm choice
def test_sum_constraint_with_diagonal_covariance_is_grouped_and_dense_is_cholesky():
    torch.manual_seed(0)
    scale = torch.rand(10) + 0.5
    index = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 2])
    assert Conditioner(DiagonalCovariance(scale), hardeq.SumConstraint(index, torch.randn(3))).method == "grouped"
    L = torch.linalg.cholesky(random_spd(10, dtype=torch.float32))
    c = Conditioner(FullCovariance(L), hardeq.SumConstraint(index, torch.randn(3)))
    assert c.method == "cholesky"
    dense = hardeq.LinearConstraint(torch.randn(3, 10), torch.randn(3))
    assert Conditioner(DiagonalCovariance(scale), dense).method == "cholesky"


def test_diagonal_gram_says_when_the_gram_matrix_is_diagonal():
    index = torch.tensor([0, 1, 1, 2, 2, 2])
    v = torch.arange(1.0, 7.0)
    s = hardeq.SumConstraint(index, torch.zeros(3)).diagonal_gram(v)
    A = hardeq.SumConstraint(index, torch.zeros(3)).dense_matrix()
    torch.testing.assert_close(torch.diag_embed(s), A @ torch.diag(v) @ A.T)
    assert hardeq.LinearConstraint(torch.randn(2, 6), torch.zeros(2)).diagonal_gram(v) is None


def test_ill_conditioned_float32_escalates_to_float64_cholesky_and_is_exact():
    loc, scale, A, k = ill_conditioned(torch.float32, decades=6.0)
    c = Conditioner(DiagonalCovariance(scale), hardeq.LinearConstraint(A, k))
    assert c.method in ("cholesky64", "qr")
    z = c.condition(loc + scale * torch.randn(500, 12))
    assert rel_residual(A, k, z) <= 1e-5


def test_qr_fallback_when_the_cholesky_fails_float64():
    """Scales over 16 decades with nearly dependent rows: kappa(S) > 1e10, so the Gram/Cholesky paths are
    refused and the backward-stable QR path runs; samples and mean are exact, moments match the oracle."""
    loc, scale, A, k = ill_conditioned(torch.float64, decades=16.0, dependence=1e-4)
    c = Conditioner(DiagonalCovariance(scale), hardeq.LinearConstraint(A, k))
    assert c.method == "qr"
    z = c.condition(loc + scale * torch.randn(500, 12, dtype=torch.float64))
    assert rel_residual(A, k, z) <= 1e-12
    assert rel_residual(A, k, c.condition(loc)) <= 1e-12


def test_residual_check_escalates_when_a_factor_is_accepted_too_eagerly(monkeypatch):
    """Accept any kappa for the float32 Cholesky on an ill-conditioned S: whichever path round-off picks, every
    conditioned vector meets every row. Where the float32 potrf succeeds (LAPACK here: pivot-ratio estimate ~1.7e7,
    so eps32 kappa ~ 2 and the factor is useless), only the residual check stands between its output and the
    user, so the rows being met shows the check caught it; where it fails outright (cuSOLVER, some BLAS), it is
    never accepted."""
    monkeypatch.setitem(conditioning.KAPPA_MAX, "working", float("inf"))
    loc, scale, A, k = ill_conditioned(torch.float32, decades=8.0, dependence=3e-3)
    c = Conditioner(DiagonalCovariance(scale), hardeq.LinearConstraint(A, k))
    assert c.method in ("cholesky", "cholesky64")
    if c.method == "cholesky":
        assert c.factor.kappa < float("inf")
    torch.manual_seed(1)
    z = c.condition(loc + scale * torch.randn(1000, 12))
    z64, A64, k64 = z.double(), A.double(), k.double()  # every row to its own tolerance
    assert bool(((z64 @ A64.mT - k64).abs() <= 1e-5 * (z64.abs() @ A64.abs().mT + k64.abs())).all())


def test_refinement_runs_only_when_the_check_asks(monkeypatch):
    from hardeq.linalg.conditioning.factor import Factor

    calls = []
    original = Factor.refine

    def counting(self, z):
        calls.append(z.shape)
        return original(self, z)

    monkeypatch.setattr(Factor, "refine", counting)
    torch.manual_seed(0)
    A, k = torch.randn(4, 50, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    c = Conditioner(DiagonalCovariance(torch.rand(50, dtype=torch.float64) + 0.5), hardeq.LinearConstraint(A, k))
    c.condition(torch.randn(8, 50, dtype=torch.float64))
    assert calls == []  # well conditioned: one Matheron step, no refinement
    # a member with scale 1e8 in a group with a small total: the first step leaves ulp(z_hat) ~ 1e-8 * 1e8 in
    # that group's sum; the per-row check asks for a step, and the group comes back exact per row
    index = torch.tensor([0, 0, 1, 1])
    k = torch.tensor([0.3755, 1.0])
    c = Conditioner(DiagonalCovariance(torch.tensor([1e8, 1.0, 1.0, 2.0])), hardeq.SumConstraint(index, k))
    z = c.condition(torch.tensor([1e8, 1.0, 0.0, 0.0]) * torch.randn(16, 4))
    assert len(calls) >= 1
    assert rel_residual(c.constraint.dense_matrix(), k, z) <= 1e-5
    # a group of one is pinned to its total by the step itself
    c = Conditioner(DiagonalCovariance(torch.tensor([1e8, 1.0, 2.0])),
                    hardeq.SumConstraint(torch.tensor([0, 1, 1]), torch.tensor([0.3755, 1.0])))
    z = c.condition(torch.tensor([1e8, 0.0, 0.0]) * torch.randn(16, 3))
    assert bool((z[:, 0] == torch.tensor(0.3755)).all())


def test_factorisation_happens_once(monkeypatch):
    count = []
    original = Conditioner._next_factor

    def counting(self, *args, **kwargs):
        count.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Conditioner, "_next_factor", counting)
    torch.manual_seed(0)
    A, k = torch.randn(3, 20), torch.randn(3)
    c = Conditioner(DiagonalCovariance(torch.rand(20) + 0.5), hardeq.LinearConstraint(A, k))
    for _ in range(3):
        c.condition(torch.randn(5, 20))
    c.sample(torch.zeros(20), (7,))
    c.variance(), c.logdet(), c.inv_quad(torch.randn(3)), c.gain_factor(), c.covariance_matrix()
    assert len(count) == 1


# ------------------------------------------------------------------------------------ against the oracle
def _covariances(n, dtype, g):
    scale = (torch.rand(n, generator=g, dtype=torch.float64) + 0.3).to(dtype)
    L = torch.linalg.cholesky(random_spd(n, generator=g)).to(dtype)
    W = torch.randn(n, 2, generator=g, dtype=torch.float64).to(dtype)
    return {"diag": DiagonalCovariance(scale), "full": FullCovariance(L), "lowrank": LowRankCovariance(W, scale)}


@pytest.mark.parametrize("force", [None, "cholesky64", "qr"])
@pytest.mark.parametrize("structure", ["diag", "full", "lowrank"])
@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_moments_match_the_dense_oracle_on_every_path(structure, kind, force):
    g = torch.Generator().manual_seed(3)
    n, a = 7, 3
    cov = _covariances(n, torch.float64, g)[structure]
    k = torch.randn(a, generator=g, dtype=torch.float64)
    if kind == "dense":
        con = hardeq.LinearConstraint(torch.randn(a, n, generator=g, dtype=torch.float64), k)
    else:
        con = hardeq.SumConstraint(torch.tensor([0, 1, 1, 2, 2, 2, 0]), k)
    c = Conditioner(cov, con, method=force)
    assert force is None or c.method == force or (force, c.method) == ("cholesky64", "cholesky")  # float64 input
    loc = torch.randn(n, generator=g, dtype=torch.float64)
    A = con.dense_matrix()
    oracle = dense_conditional(loc, cov.dense(), A, k)
    torch.testing.assert_close(c.condition(loc), oracle.mean)
    torch.testing.assert_close(c.covariance_matrix(), oracle.covariance, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(c.variance(), oracle.covariance.diagonal(), atol=1e-12, rtol=1e-10)
    S = A @ cov.dense() @ A.T
    torch.testing.assert_close(c.logdet(), torch.logdet(S))
    r = torch.randn(4, a, generator=g, dtype=torch.float64)
    torch.testing.assert_close(c.inv_quad(r), (r * torch.linalg.solve(S, r.T).T).sum(-1))
    torch.testing.assert_close(c.gain_matvec(r), (cov.dense() @ A.T @ torch.linalg.solve(S, r.T)).T)
    G = c.gain_factor()
    torch.testing.assert_close(G @ G.mT, cov.dense() @ A.T @ torch.linalg.solve(S, A @ cov.dense()))


@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_per_sample_diagonal_batch_matches_unbatched_and_keeps_no_n_by_a_tensor_per_sample(kind):
    torch.manual_seed(0)
    B, n, a = 5, 40, 6
    scale = torch.rand(B, n, dtype=torch.float64) + 0.2
    k = torch.randn(B, a, dtype=torch.float64)
    if kind == "dense":
        con = hardeq.LinearConstraint(torch.randn(a, n, dtype=torch.float64), k)
    else:
        con = hardeq.SumConstraint(torch.arange(n) % a, k)
    c = Conditioner(DiagonalCovariance(scale), con)
    big = [name for name, v in vars(c).items() if isinstance(v, torch.Tensor) and v.numel() >= B * n * a]
    assert big == [], big
    loc = torch.randn(B, n, dtype=torch.float64)
    z_hat = loc + scale * torch.randn(3, B, n, dtype=torch.float64)
    z = c.condition(z_hat)
    for b in range(B):
        cb = Conditioner(DiagonalCovariance(scale[b]), con.with_k(k[b]) if kind == "dense" else
                         hardeq.SumConstraint(con.index, k[b]))
        torch.testing.assert_close(z[:, b], cb.condition(z_hat[:, b]))
        torch.testing.assert_close(c.variance()[b], cb.variance())
        torch.testing.assert_close(c.logdet()[b], cb.logdet())


def test_product_and_chunked_gram_agree(monkeypatch):
    torch.manual_seed(0)
    A, v = torch.randn(5, 30, dtype=torch.float64), torch.rand(4, 30, dtype=torch.float64)
    ref = A @ torch.diag_embed(v) @ A.T
    cov = DiagonalCovariance(v.sqrt())
    torch.testing.assert_close(cov.sandwich(A), ref)
    monkeypatch.setattr(hardeq.ops.gram_pairs, "PAIR_ELEMS", 0)
    monkeypatch.setattr(covariance, "_CHUNK_ELEMS", 5 * 30)  # one batch element per chunk
    torch.testing.assert_close(cov.sandwich(A), ref)


@pytest.mark.parametrize("shared", [True, False])
def test_fused_sample_equals_condition_of_the_same_noise(shared):
    torch.manual_seed(0)
    n, a = 30, 4
    B = () if shared else (3,)
    scale = torch.rand(B + (n,), dtype=torch.float64) + 0.5
    loc = torch.randn(B + (n,), dtype=torch.float64)
    con = hardeq.LinearConstraint(torch.randn(a, n, dtype=torch.float64), torch.randn(B + (a,), dtype=torch.float64))
    c = Conditioner(DiagonalCovariance(scale), con)
    noise = torch.randn((6,) + B + (n,), dtype=torch.float64)
    torch.testing.assert_close(c.sample(loc, noise=noise.clone()), c.condition(loc + scale * noise))
    z = c.sample(loc, (6,))
    assert z.shape == (6,) + B + (n,) and rel_residual(con.A, con.k, z) <= 1e-12


# ------------------------------------------------------------------------------------ extreme scales
@pytest.mark.parametrize("scale_value", [1e-20, 1e-40, 1e20])
@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_extreme_scales_in_float32_work_or_raise_precisely(scale_value, kind):
    """The gain is invariant to a global rescaling of Sigma; the factorisation normalises by the largest
    scale, so 1e-20 (S ~ 1e-40 would underflow) and 1e-40 (a float32 subnormal) give exact samples."""
    torch.manual_seed(0)
    n, a = 10, 3
    scale = (torch.rand(n) + 0.5) * scale_value
    k = torch.randn(a)
    con = (hardeq.LinearConstraint(torch.randn(a, n), k) if kind == "dense"
           else hardeq.SumConstraint(torch.arange(n) % a, k))
    try:
        c = Conditioner(DiagonalCovariance(scale), con)
        z = c.condition(torch.randn(n) + scale * torch.randn(100, n))
    except NotPSDError as e:  # a precise error is acceptable, a silent NaN is not
        # (a CPU that flushes subnormals to zero holds 1e-40 as 0: then the scales are all zero, and it says so)
        assert "dtype" in str(e) or (bool((scale == 0).all()) and "not all zero" in str(e))
        return
    assert bool(torch.isfinite(z).all())
    assert rel_residual(con.dense_matrix(), k, z) <= 1e-5
    A64 = con.dense_matrix().double()
    S64 = A64 @ torch.diag(scale.double().square()) @ A64.T
    torch.testing.assert_close(c.logdet().double(), torch.logdet(S64), rtol=1e-5, atol=1e-3)


def test_non_finite_input_raises_precisely():
    A, k = torch.randn(2, 5), torch.randn(2)
    c = Conditioner(DiagonalCovariance(torch.ones(5)), hardeq.LinearConstraint(A, k))
    with pytest.raises(NotPSDError, match="NaN/inf"):
        c.condition(torch.tensor([1.0, float("nan"), 0.0, 0.0, 0.0]))
    with pytest.raises(NotPSDError):
        Conditioner(DiagonalCovariance(torch.tensor([1.0, float("inf"), 1.0, 1.0, 1.0])),
                    hardeq.LinearConstraint(A, k))


# ------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("path", ["cholesky", "qr", "grouped", "full", "per-sample"])
def test_condition_gradcheck(path):
    torch.manual_seed(0)
    n, a = 6, 2
    dt = torch.float64
    loc = torch.randn(n, dtype=dt, requires_grad=True)
    scale = (torch.rand(n, dtype=dt) + 0.5).requires_grad_()
    k = torch.randn(a, dtype=dt, requires_grad=True)
    A = torch.randn(a, n, dtype=dt)
    noise = torch.randn(3, n, dtype=dt)
    L0 = torch.linalg.cholesky(random_spd(n)).requires_grad_()
    if path == "per-sample":  # batched scales and k with a shared A: the product-matrix Gram
        scale = (torch.rand(2, n, dtype=dt) + 0.5).requires_grad_()
        k = torch.randn(2, a, dtype=dt, requires_grad=True)
        noise = torch.randn(3, 2, n, dtype=dt)

    def f(loc, scale, k, L):
        if path == "grouped":
            con = hardeq.SumConstraint(torch.tensor([0, 0, 1, 1, 1, 0]), k)
        else:
            con = hardeq.LinearConstraint(A, k, validate_args=False)
        cov = FullCovariance(L.tril()) if path == "full" else DiagonalCovariance(scale)
        c = Conditioner(cov, con, method="qr" if path == "qr" else None)
        return c.condition(loc + cov.sqrt_matvec(noise)), c.variance(), c.logdet()

    assert torch.autograd.gradcheck(f, (loc, scale, k, L0))



@pytest.mark.parametrize("kind", ["dense", "grouped"])
@pytest.mark.parametrize("structure", ["diag", "full", "lowrank"])
def test_fused_sample_every_structure(structure, kind):
    g = torch.Generator().manual_seed(5)
    n, a = 9, 3
    cov = _covariances(n, torch.float64, g)[structure]
    k = torch.randn(a, generator=g, dtype=torch.float64)
    con = (hardeq.LinearConstraint(torch.randn(a, n, generator=g, dtype=torch.float64), k) if kind == "dense"
           else hardeq.SumConstraint(torch.arange(n) % a, k))
    c = Conditioner(cov, con)
    loc = torch.randn(n, generator=g, dtype=torch.float64)
    noise = torch.randn(5, cov.noise_size, generator=g, dtype=torch.float64)
    torch.testing.assert_close(c.sample(loc, noise=noise), c.condition(loc + cov.sqrt_matvec(noise)))
    assert rel_residual(con.dense_matrix(), k, c.sample(loc, (20,))) <= 1e-12


def float32_singular_gram():
    r"""Two rows whose Gram matrix is singular once rounded to float32, on any IEEE machine, and regular in float64.

    ``A = [[1, 1, 1, 1, 0], [1, 1, 1, 1, 2^-13]]`` with unit scales: :math:`S = [[4, 4], [4, 4 + 2^{-26}]]`. Every
    product is exact, and every partial sum of :math:`S_{22}` that holds a 1 rounds :math:`2^{-26}` away (half an
    ulp of 1 is :math:`2^{-24}`), in any order, with or without FMA or a wider accumulator rounded back: the float32
    :math:`S` is ``[[4, 4], [4, 4]]``, its equilibrated form (``d = 2``, exact) is all ones, and Cholesky meets a
    zero pivot (:math:`1 - 1\cdot 1`, exact). Even from the float64 :math:`S` rounded to float32, the correlation
    :math:`1 - 2^{-29}` rounds to 1. In float64 :math:`\kappa(\tilde S) \approx 2^{30}`, within float64's limit."""
    A = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 2.0 ** -13]])
    k = torch.tensor([0.0, 2.0 ** -13])  # the plane: z_5 = 1, z_1 + ... + z_4 = 0
    return torch.zeros(5), torch.ones(5), A, k


@pytest.mark.parametrize("problem", ["float32_singular", "ill_conditioned"])
def test_a_failed_factorisation_is_never_accepted(monkeypatch, problem):
    """Even with no limit on the condition number, a factorisation that fails (a non-positive pivot: the estimate is
    infinite) is passed over for the next step of the plan, never used. What holds whichever path round-off picks:
    the accepted factor has a finite kappa estimate and a finite log-determinant, and every conditioned vector
    meets every row to the float32 tolerance. Where the float32 Gram matrix is singular on every IEEE machine
    (:func:`float32_singular_gram`), the float32 Cholesky cannot be the one accepted."""
    monkeypatch.setitem(conditioning.KAPPA_MAX, "working", float("inf"))
    if problem == "float32_singular":
        loc, scale, A, k = float32_singular_gram()
    else:  # float32 potrf fails on some CPUs and not on others: either way the checks below hold
        loc, scale, A, k = ill_conditioned(torch.float32, decades=8.0, dependence=1e-3)
    c = Conditioner(DiagonalCovariance(scale), hardeq.LinearConstraint(A, k))
    factor = getattr(c.factor, "base", c.factor)  # (the null-space form wraps a factor of S)
    assert factor.name in ("cholesky", "cholesky64", "qr")
    if problem == "float32_singular":
        assert factor.name in ("cholesky64", "qr")
    if factor.name != "qr":
        assert factor.kappa < float("inf")
    assert bool(torch.isfinite(c.logdet()).all())
    torch.manual_seed(1)
    z = c.condition(loc + scale * torch.randn(100, A.shape[-1]))
    z64, A64, k64 = z.double(), A.double(), k.double()  # every row to its own tolerance
    assert bool(((z64 @ A64.mT - k64).abs() <= 1e-5 * (z64.abs() @ A64.abs().mT + k64.abs())).all())
