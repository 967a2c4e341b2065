"""The null-space path of the Conditioner (issue 8: "Use the null-space form when n - a < a").

For a dense constraint with ``n - a < a`` the samples, the gain and the conditional (co)variances go through an
orthonormal basis ``N`` of ``null(A)``; everything is checked against the dense float64 oracle
``hardeq.testing.dense_conditional``.
"""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.linalg.conditioning import Conditioner
from hardeq.linalg.covariance import DiagonalCovariance, FullCovariance, LowRankCovariance
from hardeq.testing import dense_conditional, mc_atol, random_spd

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
STRUCTURES = ["diag", "full", "lowrank"]


def rel_residual(A, k, z):
    z64, A64 = z.double().unsqueeze(-1), A.double()
    res = (A64 @ z64).squeeze(-1) - k.double()
    return (res.abs().amax(-1) / (A64.abs() @ z64.abs()).squeeze(-1).amax(-1)).max().item()


def make_cov(structure, scale, g):
    """A covariance of the given structure whose marginal scales follow ``scale`` (float64, ``(*B, n)``)."""
    n = scale.shape[-1]
    if structure == "diag":
        return DiagonalCovariance(scale)
    if structure == "full":
        L = torch.randn(scale.shape + (n,), generator=g, dtype=torch.float64).tril(-1) * 0.3
        return FullCovariance((L + torch.diag_embed(torch.ones_like(scale))) * scale.unsqueeze(-1))
    W = torch.randn(scale.shape + (2,), generator=g, dtype=torch.float64) * scale.unsqueeze(-1)
    return LowRankCovariance(W, scale)


# ------------------------------------------------------------------------------------ when it is chosen
@pytest.mark.parametrize("structure", STRUCTURES)
def test_chosen_exactly_when_n_minus_a_is_below_a(structure):
    g = torch.Generator().manual_seed(0)
    n = 8
    cov = make_cov(structure, torch.rand(n, generator=g, dtype=torch.float64) + 0.5, g)
    for a in range(1, n):
        con = hardeq.LinearConstraint(torch.randn(a, n, generator=g, dtype=torch.float64),
                                      torch.randn(a, generator=g, dtype=torch.float64))
        c = Conditioner(cov, con)
        assert (c.method == "nullspace") == (n - a < a), (a, c.method)
        dist = hardeq.ConstrainedNormal(torch.zeros(n, dtype=torch.float64), covariance=cov, constraint=con)
        assert (dist.conditioner.method == "nullspace") == (n - a < a)


def test_grouped_stays_grouped_and_forced_methods_are_kept():
    index = torch.tensor([0, 1, 2, 3, 4, 0])  # n = 6, a = 5: n - a < a, but S is diagonal: O(n)
    c = Conditioner(DiagonalCovariance(torch.rand(6) + 0.5), hardeq.SumConstraint(index, torch.randn(5)))
    assert c.method == "grouped"
    L = torch.linalg.cholesky(random_spd(6, dtype=torch.float32))
    c = Conditioner(FullCovariance(L), hardeq.SumConstraint(index, torch.randn(5)))
    assert c.method == "nullspace"  # dense Gram under a full covariance
    assert Conditioner(FullCovariance(L), hardeq.SumConstraint(index, torch.randn(5)), method="qr").method == "qr"


# ------------------------------------------------------------------------------------ against the oracle
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("batched_A", [False, True])
def test_moments_densities_match_the_dense_oracle_batched(structure, batched_A):
    g = torch.Generator().manual_seed(1)
    B, n, a = 3, 7, 5
    scale = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.3
    cov = make_cov(structure, scale, g)
    A = torch.randn((B,) * batched_A + (a, n), generator=g, dtype=torch.float64)
    k = torch.randn(B, a, generator=g, dtype=torch.float64)
    loc = torch.randn(B, n, generator=g, dtype=torch.float64) * 3
    con = hardeq.LinearConstraint(A, k)
    dist = hardeq.ConstrainedNormal(loc, covariance=cov, constraint=con)
    c = dist.conditioner
    assert c.method == "nullspace"
    z = dist.sample((4,))
    Sig = cov.dense()
    r = torch.randn(2, B, a, generator=g, dtype=torch.float64)
    for b in range(B):
        Ab = A[b] if batched_A else A
        o = dense_conditional(loc[b], Sig[b], Ab, k[b])
        torch.testing.assert_close(dist.mean[b], o.mean)
        torch.testing.assert_close(dist.variance[b], o.covariance.diagonal(), atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(dist.covariance_matrix[b], o.covariance, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(dist.log_prob(z)[:, b], o.log_prob(z[:, b]))
        torch.testing.assert_close(dist.entropy()[b], o.entropy())
        S = Ab @ Sig[b] @ Ab.T
        torch.testing.assert_close(c.logdet()[b], torch.logdet(S))
        torch.testing.assert_close(c.inv_quad(r)[:, b], (r[:, b] * torch.linalg.solve(S, r[:, b].T).T).sum(-1))
        torch.testing.assert_close(c.gain_matvec(r)[:, b], (Sig[b] @ Ab.T @ torch.linalg.solve(S, r[:, b].T)).T)
        G = c.gain_factor()[b]
        torch.testing.assert_close(G @ G.mT, Sig[b] @ Ab.T @ torch.linalg.solve(S, Ab @ Sig[b]))
    assert rel_residual(A, k, z) <= TOL[torch.float64]


def test_kl_matches_the_dense_oracle():
    g = torch.Generator().manual_seed(2)
    n, a = 6, 4
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    k = torch.randn(a, generator=g, dtype=torch.float64)
    con = hardeq.LinearConstraint(A, k)
    covs = [make_cov(s, torch.rand(n, generator=g, dtype=torch.float64) + 0.4, g) for s in ("full", "lowrank")]
    locs = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2)]
    q, p = (hardeq.ConstrainedNormal(m, covariance=cv, constraint=con) for m, cv in zip(locs, covs))
    assert q.conditioner.method == p.conditioner.method == "nullspace"
    oq, op = (dense_conditional(m, cv.dense(), A, k) for m, cv in zip(locs, covs))
    expected = torch.distributions.kl_divergence(oq.t_distribution, op.t_distribution)
    torch.testing.assert_close(torch.distributions.kl_divergence(q, p), expected)


# ------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("batch", [(), (2,)], ids=["unbatched", "batched"])
def test_samples_exact_with_scales_over_eight_decades(dtype, structure, batch):
    g = torch.Generator().manual_seed(3)
    n, a = 12, 8
    scale = 10 ** (8 * torch.rand(batch + (n,), generator=g, dtype=torch.float64) - 4)  # 1e-4 .. 1e4
    cov64 = make_cov(structure, scale, g)
    cov = cov64.to(dtype=dtype)
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    k = torch.randn(batch + (a,), generator=g, dtype=torch.float64) * 10
    loc = torch.randn(batch + (n,), generator=g, dtype=torch.float64) * 1e3
    con = hardeq.LinearConstraint(A.to(dtype), k.to(dtype))
    c = Conditioner(cov, con)
    assert c.method == "nullspace"
    noise = torch.randn((200,) + batch + (cov.noise_size,), generator=g, dtype=dtype)
    z = c.condition(loc.to(dtype) + cov.sqrt_matvec(noise))
    assert c.method == "nullspace"  # no escalation needed
    assert rel_residual(con.A, con.k, z) <= TOL[dtype]
    assert rel_residual(con.A, con.k, c.condition(loc.to(dtype))) <= TOL[dtype]
    assert rel_residual(con.A, con.k, c.sample(loc.to(dtype), (50,))) <= TOL[dtype]
    if dtype == torch.float64:
        mean, Sig = c.condition(loc), cov64.dense()
        for b in range(batch[0] if batch else 1):
            ix = (b,) if batch else ()
            o = dense_conditional(loc[ix], Sig[ix], A, k[ix])
            torch.testing.assert_close(mean[ix], o.mean, rtol=1e-9, atol=1e-9 * o.mean.abs().max())


def _small_float32_case(seed):
    g = torch.Generator().manual_seed(seed)
    n, a = 6, 4
    A, k = torch.randn(a, n, generator=g), torch.randn(a, generator=g)
    c = Conditioner(DiagonalCovariance(torch.rand(n, generator=g) + 0.5), hardeq.LinearConstraint(A, k))
    assert c.method == "nullspace"
    return c, A, k, torch.randn(10, n, generator=g)


def test_refinement_uses_the_residual_of_z():
    """A wrong particular solution z_p: the first step misses the plane; refinement (K applied to the residual
    of z, not a repeat of the step) brings it back without escalating."""
    c, A, k, z_hat = _small_float32_case(4)
    c.factor.zp = c.factor.zp + 1e-3
    z = c.condition(z_hat)
    assert c.method == "nullspace"
    assert rel_residual(A, k, z) <= TOL[torch.float32]


def test_failing_nullspace_map_escalates():
    """A wrong projector (V not in null(A)): refinement cannot help, the conditioner escalates to the next factor."""
    c, A, k, z_hat = _small_float32_case(4)
    c.factor.V = c.factor.V + 0.1
    z = c.condition(z_hat)
    assert c.method in ("cholesky64", "qr")
    assert rel_residual(A, k, z) <= TOL[torch.float32]


# ------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("structure", STRUCTURES)
def test_gradcheck_rsample_log_prob_variance(structure):
    g = torch.Generator().manual_seed(5)
    n, a = 5, 3
    dt = torch.float64
    loc = torch.randn(n, generator=g, dtype=dt).requires_grad_()
    scale = (torch.rand(n, generator=g, dtype=dt) + 0.5).requires_grad_()
    L0 = torch.linalg.cholesky(random_spd(n, generator=g)).requires_grad_()
    W0 = torch.randn(n, 2, generator=g, dtype=dt).requires_grad_()
    k = torch.randn(a, generator=g, dtype=dt).requires_grad_()
    A = torch.randn(a, n, generator=g, dtype=dt)
    m = n + 2 if structure == "lowrank" else n
    noise = torch.randn(3, m, generator=g, dtype=dt)
    x0 = torch.linalg.pinv(A) @ k.detach() + torch.randn(n, generator=g, dtype=dt) * 1e-3  # a fixed point

    def f(loc, k, *params):
        con = hardeq.LinearConstraint(A, k, validate_args=False)
        if structure == "diag":
            dist = hardeq.ConstrainedNormal(loc, params[0], constraint=con, validate_args=False)
        elif structure == "full":
            dist = hardeq.ConstrainedNormal(loc, scale_tril=params[0].tril(), constraint=con, validate_args=False)
        else:
            dist = hardeq.ConstrainedNormal(loc, params[0], cov_factor=params[1], constraint=con,
                                           validate_args=False)
        assert dist.conditioner.method == "nullspace"
        z = dist.rsample((3,), noise=noise)
        return z, dist.log_prob(z), dist.log_prob(x0), dist.variance, dist.mean

    params = {"diag": (scale,), "full": (L0,), "lowrank": (scale, W0)}[structure]
    assert torch.autograd.gradcheck(f, (loc, k) + params)


# ------------------------------------------------------------------------------------ Monte Carlo
def test_sample_covariance_monte_carlo():
    g = torch.Generator().manual_seed(6)
    n, a, N = 5, 3, 20000
    cov = make_cov("full", torch.rand(n, generator=g, dtype=torch.float64) + 0.5, g)
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    k = torch.randn(a, generator=g, dtype=torch.float64)
    loc = torch.randn(n, generator=g, dtype=torch.float64)
    dist = hardeq.ConstrainedNormal(loc, covariance=cov, constraint=hardeq.LinearConstraint(A, k))
    assert dist.conditioner.method == "nullspace"
    o = dense_conditional(loc, cov.dense(), A, k)
    torch.manual_seed(6)
    z = dist.sample((N,))
    d = z - o.mean  # exact mean: each entry of d d^T is an unbiased estimate of the covariance entry
    emp = d.T @ d / N
    C = o.covariance
    # Var[d_i d_j] = C_ii C_jj + C_ij^2 for a Gaussian; Bonferroni over the n(n+1)/2 distinct entries
    iu = torch.triu_indices(n, n)
    sd = (C.diagonal().outer(C.diagonal()) + C.square()).sqrt()[iu[0], iu[1]]
    atol = mc_atol(sd, N)
    assert bool(((emp - C)[iu[0], iu[1]].abs() <= atol).all()), ((emp - C)[iu[0], iu[1]].abs() / atol).max()
    mean_atol = mc_atol(C.diagonal().sqrt(), N)
    assert bool(((z.mean(0) - o.mean).abs() <= mean_atol).all())


def test_entropy_of_many_constraints_in_float32_has_no_cancellation():
    """n = 60, a = 59: log det Sigma and log det S nearly cancel; the null-space factor's float64
    -log det(N^T Sigma^-1 N) keeps float32 entropies within 1e-5 of float64 (the three log-determinants summed in
    float32 were off by 2e-4)."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        n, a = 60, 59
        A = torch.randn(a, n, generator=g, dtype=torch.float64)
        scale = torch.rand(n, generator=g, dtype=torch.float64) * 3 + 0.1
        loc, k = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(a, generator=g, dtype=torch.float64)
        ref = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k)).entropy()
        d32 = hardeq.ConstrainedNormal(loc.float(), scale.float(),
                                       constraint=hardeq.LinearConstraint(A.float(), k.float()))
        assert d32.conditioner.method == "nullspace"
        assert abs(d32.entropy().double() - ref).item() < 1e-5


# ------------------------------------------------------------------------------------ static: no host read
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_static_build_reads_nothing_and_matches_the_checked_form(structure, dtype):
    """``validate_args=False`` with the GPU's choices: the near-square form is built and used without a host read;
    its samples meet every row, and its moments and density equal the checked conditioner's (same factor)."""
    from hardeq.linalg.device import forced
    from hardeq.testing import count_calls

    g = torch.Generator().manual_seed(5)
    B, n, a = 3, 10, 7
    scale = 10 ** (6 * torch.rand(B, n, generator=g, dtype=torch.float64) - 3)
    cov = make_cov(structure, scale, g).to(dtype=dtype)
    A = torch.randn(a, n, generator=g, dtype=dtype)
    k, loc = torch.randn(B, a, generator=g, dtype=dtype), torch.randn(B, n, generator=g, dtype=dtype) * 100
    checked = hardeq.ConstrainedNormal(loc, covariance=cov, constraint=hardeq.LinearConstraint(A, k))
    z = checked.sample((20,))

    def fresh():
        con = hardeq.LinearConstraint(A, k, validate_args=False)
        return hardeq.ConstrainedNormal(loc, covariance=cov, constraint=con, validate_args=False)

    with forced("gpu"):
        fresh().sample()  # (first use of A: its decomposition is cached)
        with count_calls() as count:
            d = fresh()
            zs = d.sample((20,))
            lp = d.log_prob(z)
        assert d.conditioner.static and d.conditioner.method == "nullspace"
    assert count.host_reads == 0, count.host_read_names
    assert count.by_name["linalg_qr"] == 0  # (the complete QR of A^T is made once per A tensor, not per call)
    assert rel_residual(A, k, zs) <= TOL[dtype]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lp, checked.log_prob(z), **tol)
    torch.testing.assert_close(d.variance, checked.variance, **tol)


def test_static_build_defers_an_error_where_the_checked_form_falls_back(monkeypatch):
    """M' not numerically positive definite: the checked conditioner falls back to the base factor; the static one
    cannot branch, so it raises (at once on a CPU; deferred on a GPU), and never samples a wrong law."""
    from hardeq.errors import NotPSDError
    from hardeq.linalg.device import forced

    g = torch.Generator().manual_seed(6)
    n, a = 6, 4
    A, k = torch.randn(a, n, generator=g, dtype=torch.float64), torch.randn(a, generator=g, dtype=torch.float64)
    scale = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    real = torch.linalg.cholesky_ex

    def failing(M, *args, **kwargs):  # the factor of M' (p x p, p = n - a) reports failure; every other one is real
        L, info = real(M, *args, **kwargs)
        return (L, torch.ones_like(info)) if M.shape[-1] == n - a else (L, info)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", failing)
    loc = torch.zeros(n, dtype=torch.float64)
    checked = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k))
    assert checked.conditioner.method != "nullspace"
    assert rel_residual(A, k, checked.sample((5,))) <= TOL[torch.float64]
    with forced("gpu"), pytest.raises(NotPSDError, match=r"null-space form .* cannot be trusted"):
        con = hardeq.LinearConstraint(A, k, validate_args=False)
        hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False).sample()


def _static_near_square(scale, A, k, loc):
    con = hardeq.LinearConstraint(A, k, validate_args=False)
    return hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False)


def test_a_static_form_makes_its_base_factor_only_for_a_kl_and_once():
    """The static null-space form samples, and gives the density, entropy and moments, without its base factor of S
    (O(a^2 n), about a dozen kernels); a KL makes it on first use, once, and equals the checked conditioner's (which
    built its own eagerly)."""
    from hardeq.linalg.conditioning.factor import DeferredFactor
    from hardeq.linalg.device import forced
    from hardeq.testing import count_calls

    g = torch.Generator().manual_seed(8)
    B, n, a = 4, 40, 30
    A, k = torch.randn(a, n, generator=g, dtype=torch.float64), torch.randn(B, a, generator=g, dtype=torch.float64)
    scale, loc = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.5, torch.randn(B, n, generator=g,
                                                                                         dtype=torch.float64)
    checked = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k))
    other = hardeq.ConstrainedNormal(loc.flip(-1), scale.flip(-1), constraint=hardeq.LinearConstraint(A, k))
    z = checked.sample((6,))
    with forced("gpu"):
        _static_near_square(scale, A, k, loc).sample()  # (the decomposition of A is cached at first use)
        d = _static_near_square(scale, A, k, loc)
        factor = d.conditioner.factor
        assert factor.name == "nullspace" and isinstance(factor._base, DeferredFactor)
        with count_calls() as count:
            zs = d.sample((6,))
        lp, entropy, variance = d.log_prob(z), d.entropy(), d.variance
        assert not factor._base.made and count.by_name["linalg_cholesky_ex"] == 0
        assert rel_residual(A, k, zs) <= TOL[torch.float64]
        kl = torch.distributions.kl_divergence(d, other)
        assert factor._base.made
        made = factor.base
        torch.testing.assert_close(torch.distributions.kl_divergence(d, other), kl)
        assert factor.base is made
    tol = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(checked, other), **tol)
    torch.testing.assert_close(lp, checked.log_prob(z), **tol)
    torch.testing.assert_close(entropy, checked.entropy(), **tol)
    torch.testing.assert_close(variance, checked.variance, **tol)


@pytest.mark.parametrize("built_with_grad", [True, False])
def test_the_deferred_base_factor_keeps_the_grad_mode_of_the_construction(built_with_grad):
    """Made later, the base factor is the one an eager construction would have made: with a graph to the scales
    when the conditioner was built with gradients on (even if the KL that makes it runs under ``no_grad``), without
    one when it was built under ``no_grad``; the KL's gradient matches the checked form's."""
    from hardeq.linalg.conditioning.factor import DeferredFactor
    from hardeq.linalg.device import forced

    g = torch.Generator().manual_seed(9)
    n, a = 12, 9
    A, k = torch.randn(a, n, generator=g, dtype=torch.float64), torch.randn(a, generator=g, dtype=torch.float64)
    scale = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    loc = torch.randn(n, generator=g, dtype=torch.float64)
    other = hardeq.ConstrainedNormal(loc.flip(-1), scale.detach().flip(-1), constraint=hardeq.LinearConstraint(A, k))
    with torch.set_grad_enabled(built_with_grad):
        conditioner = Conditioner(DiagonalCovariance(scale), hardeq.LinearConstraint(A, k, validate_args=False),
                                  static=True)
    assert conditioner.method == "nullspace"
    with torch.no_grad():
        conditioner.logdet()  # (the base factor is made here, under no_grad)
    assert conditioner.factor.base.L.requires_grad == built_with_grad
    if built_with_grad:  # (a distribution builds its conditioner with gradients on where a parameter needs them)
        with forced("gpu"):
            d = _static_near_square(scale, A, k, loc)
            assert isinstance(d.conditioner.factor._base, DeferredFactor)
            with torch.no_grad():
                torch.distributions.kl_divergence(d, other)
            (grad,) = torch.autograd.grad(torch.distributions.kl_divergence(d, other), scale)
        checked = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k))
        (expected,) = torch.autograd.grad(torch.distributions.kl_divergence(checked, other), scale)
        torch.testing.assert_close(grad, expected, rtol=1e-8, atol=1e-10)
