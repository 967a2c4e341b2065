"""Tests of ConstrainedNormal against independent references.

Note [Randomized statistical tests]: Monte Carlo assertions use a fixed seed and a tolerance from
``hardeq.testing.mc_atol`` at ``FAILURE_RATE = 1e-4`` per assertion (Bonferroni over coordinates). After an RNG
change a test may need its seed bumped once; say so in the commit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hardeq
from hardeq.testing import dense_conditional, mc_atol

from .cases import all_cases, make_case

DTYPES = [torch.float32, torch.float64]


def _oracles(case):
    """Dense null-space oracles for every batch element of a case."""
    batch_shape = case.dist.batch_shape
    out = {}
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in batch_shape]).reshape(-1, len(batch_shape)) \
            if len(batch_shape) else [()]:
        idx = tuple(int(i) for i in idx)
        A = case.A if case.A.dim() == 2 else case.A[idx]
        out[idx] = dense_conditional(case.loc[idx], case.cov[idx], A, case.k[idx])
    return out


# ---------------------------------------------------------------------------------------------- constraint

@pytest.mark.parametrize("structure, kind", all_cases())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 3)], ids=str)
def test_samples_satisfy_constraint(structure, kind, dtype, batch_shape):
    case = make_case(structure, kind, batch_shape, n=7, a=3, dtype=dtype)
    for z in (case.dist.sample((50,)), case.dist.rsample((50,)), case.dist.mean):
        assert z.dtype == dtype
        assert bool(case.dist.constraint.check(z).all())
        assert bool(case.dist.support.check(z).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ill_conditioned_scales_and_nearly_dependent_rows(dtype):
    torch.manual_seed(0)
    n, a = 12, 3
    scale = torch.logspace(-4, 4, n, dtype=torch.float64)[torch.randperm(n)].to(dtype)
    A = torch.randn(a, n, dtype=torch.float64)
    A[2] = A[1] + 1e-3 * torch.randn(n, dtype=torch.float64)  # nearly dependent rows
    A = A.to(dtype)
    k = torch.randn(a, dtype=dtype)
    d = hardeq.ConstrainedNormal(torch.randn(n, dtype=dtype) * 100, scale,
                                 constraint=hardeq.LinearConstraint(A, k))
    z = d.sample((1000,))
    assert torch.isfinite(z).all()
    assert bool(d.constraint.check(z).all()), d.constraint.residual(z).abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_is_round_off_relative_to_the_terms_when_scales_are_tiny(dtype):
    """Per-sample scales down to 1e-5 (a learned variance collapsing): the refinement step keeps
    |A z - k| within a few eps of |A||z| + |k|, coordinate by coordinate."""
    torch.manual_seed(0)
    A = torch.tensor([[0.0, -1.0, 1.0, 0.5], [-1.0, -1.0, 0.0, 2.0]], dtype=dtype)
    loc, k = torch.rand(256, 4, dtype=dtype), torch.randn(256, 2, dtype=dtype)
    scale = 10 ** torch.empty(256, 4, dtype=dtype).uniform_(-5, 0)
    d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k))
    eps = torch.finfo(dtype).eps
    for z in (d.mean, d.sample((4,))):
        size = z.abs() @ A.abs().T + k.abs()
        assert bool((d.constraint.residual(z).abs() <= 16 * eps * (1 + size)).all())


def test_sum_constraint_is_accurate_at_large_n_in_float32():
    """A sequential scatter-add of 1e6 float32 terms drifts by ~1e-4 relative; the two-level sum must not."""
    torch.manual_seed(0)
    n = 1_000_000
    c = hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.zeros(1))
    z = hardeq.ConstrainedNormal(torch.ones(n), torch.rand(n) + 0.5, constraint=c).sample((4,))
    assert bool(c.check(z).all())
    assert (c.residual(z).abs() / z.abs().sum(-1, keepdim=True)).max() < 1e-6


def test_large_n_small_a_sum_and_dense():
    torch.manual_seed(0)
    n = 2_000_000
    loc, scale = torch.randn(n), torch.rand(n) + 0.1
    dense = hardeq.LinearConstraint(torch.randn(3, n), torch.randn(3), validate_args=False)
    grouped = hardeq.SumConstraint(torch.randint(0, 3, (n,)), torch.randn(3))
    for c in (dense, grouped):
        z = hardeq.ConstrainedNormal(loc, scale, constraint=c, validate_args=False).sample()
        assert bool(c.check(z))


# ---------------------------------------------------------------------------------------------- oracles

@pytest.mark.parametrize("structure, kind", all_cases())
@pytest.mark.parametrize("batch_shape", [(), (2,)], ids=str)
def test_moments_log_prob_entropy_match_dense_oracle(structure, kind, batch_shape):
    case = make_case(structure, kind, batch_shape, n=6, a=2)
    d = case.dist
    z = d.sample((4,))
    log_prob = d.log_prob(z)
    assert log_prob.shape == (4,) + tuple(batch_shape)
    for idx, oracle in _oracles(case).items():
        torch.testing.assert_close(d.mean[idx], oracle.mean)
        torch.testing.assert_close(d.covariance_matrix[idx], oracle.covariance)
        torch.testing.assert_close(d.variance[idx], oracle.covariance.diagonal())
        torch.testing.assert_close(d.entropy()[idx], oracle.entropy())
        torch.testing.assert_close(log_prob[(slice(None),) + idx], oracle.log_prob(z[(slice(None),) + idx]))


@pytest.mark.parametrize("sq, sp", [("diag", "diag"), ("full", "diag"), ("diag", "lowrank"),
                                    ("lowrank", "full"), ("full", "full"), ("lowrank", "lowrank")])
@pytest.mark.parametrize("kind", ["linear", "sum"])
def test_kl_matches_dense_oracle(sq, sp, kind):
    q = make_case(sq, kind, (2,), n=6, a=2, seed=1)
    p = make_case(sp, kind, (2,), n=6, a=2, seed=2)
    # same constraint: rebuild p on q's constraint object
    p_dist = hardeq.ConstrainedNormal(p.params["loc"], constraint=q.dist.constraint,
                                      **{k: v for k, v in p.params.items() if k != "loc"})
    kl = torch.distributions.kl_divergence(q.dist, p_dist)
    assert kl.shape == (2,)
    for i in range(2):
        oq = dense_conditional(q.loc[i], q.cov[i], q.A, q.k[i])
        op = dense_conditional(p.loc[i], p.cov[i], q.A, q.k[i])
        expected = torch.distributions.kl_divergence(oq.t_distribution, op.t_distribution)
        torch.testing.assert_close(kl[i], expected)
    torch.testing.assert_close(torch.distributions.kl_divergence(q.dist, q.dist), torch.zeros(2, dtype=kl.dtype),
                               atol=1e-10, rtol=0)


def test_kl_across_subspaces_is_infinite():
    c = make_case("diag", "linear", (), n=5, a=2)
    shifted = hardeq.ConstrainedNormal(c.loc, c.params["scale"],
                                       constraint=hardeq.LinearConstraint(c.A, c.k + 1.0))
    assert torch.isinf(torch.distributions.kl_divergence(c.dist, shifted))
    other_A = hardeq.LinearConstraint(torch.randn(2, 5, dtype=torch.float64), c.k)
    assert torch.isinf(torch.distributions.kl_divergence(
        c.dist, hardeq.ConstrainedNormal(c.loc, c.params["scale"], constraint=other_A)))
    # the same plane described by scaled rows is the same subspace
    same = hardeq.ConstrainedNormal(c.loc, c.params["scale"], constraint=hardeq.LinearConstraint(2 * c.A, 2 * c.k))
    assert torch.distributions.kl_divergence(c.dist, same).abs() < 1e-10


def test_log_prob_is_normalised_on_the_plane():
    """A 1-D plane in R^2 (z1 + z2 = 1): integrate the density numerically along it."""
    d = hardeq.ConstrainedNormal(torch.tensor([0.3, -0.2], dtype=torch.float64),
                                 torch.tensor([0.7, 1.3], dtype=torch.float64),
                                 constraint=hardeq.LinearConstraint(torch.ones(1, 2, dtype=torch.float64),
                                                                    torch.ones(1, dtype=torch.float64)))
    s = torch.linspace(-15, 15, 20001, dtype=torch.float64)  # arc length along the plane
    direction = torch.tensor([1.0, -1.0], dtype=torch.float64) / math.sqrt(2)
    z = torch.tensor([0.5, 0.5], dtype=torch.float64) + s[:, None] * direction
    integral = torch.trapezoid(d.log_prob(z).exp(), s)
    torch.testing.assert_close(integral, torch.tensor(1.0, dtype=torch.float64), atol=1e-8, rtol=0)


# ---------------------------------------------------------------------------------------------- structure

@pytest.mark.parametrize("structure", ["diag", "full", "lowrank"])
def test_sum_constraint_equals_dense_equivalent(structure):
    case = make_case(structure, "sum", (3,), n=8, a=3)
    d = case.dist
    dense = hardeq.ConstrainedNormal(case.params["loc"], constraint=hardeq.LinearConstraint(case.A, case.k),
                                     **{k: v for k, v in case.params.items() if k != "loc"})
    noise = torch.randn((5,) + d.batch_shape + (d.noise_size,), dtype=torch.float64)
    torch.testing.assert_close(d.rsample((5,), noise=noise), dense.rsample((5,), noise=noise))
    for attr in ("mean", "variance", "covariance_matrix"):
        torch.testing.assert_close(getattr(d, attr), getattr(dense, attr))
    z = d.sample((4,))
    torch.testing.assert_close(d.log_prob(z), dense.log_prob(z))
    torch.testing.assert_close(d.entropy(), dense.entropy())


@pytest.mark.parametrize("kind", ["linear", "sum"])
def test_covariance_structures_agree(kind):
    case = make_case("lowrank", kind, (2,), n=6, a=2)
    lowrank = case.dist
    full = hardeq.ConstrainedNormal(case.loc, scale_tril=torch.linalg.cholesky(case.cov),
                                    constraint=lowrank.constraint)
    for attr in ("mean", "variance", "covariance_matrix"):
        torch.testing.assert_close(getattr(lowrank, attr), getattr(full, attr))
    z = lowrank.sample((3,))
    torch.testing.assert_close(lowrank.log_prob(z), full.log_prob(z))
    torch.testing.assert_close(lowrank.entropy(), full.entropy())
    diag_case = make_case("diag", kind, (2,), n=6, a=2)
    as_full = hardeq.ConstrainedNormal(diag_case.loc, scale_tril=torch.diag_embed(diag_case.params["scale"]),
                                       constraint=diag_case.dist.constraint)
    as_lowrank = hardeq.ConstrainedNormal(diag_case.loc, diag_case.params["scale"],
                                          cov_factor=torch.zeros(2, 6, 1, dtype=torch.float64),
                                          constraint=diag_case.dist.constraint)
    for other in (as_full, as_lowrank):
        torch.testing.assert_close(diag_case.dist.mean, other.mean)
        torch.testing.assert_close(diag_case.dist.variance, other.variance)
        torch.testing.assert_close(diag_case.dist.entropy(), other.entropy())


# ---------------------------------------------------------------------------------------------- Monte Carlo

@pytest.mark.parametrize("structure, kind", all_cases())
def test_monte_carlo_moments_and_expected_losses(structure, kind):
    torch.manual_seed(0)
    case = make_case(structure, kind, (2,), n=6, a=2)
    d, N = case.dist, 40_000
    z = d.sample((N,))
    assert (z.mean(0) - d.mean).abs().le(mc_atol(d.stddev, N)).all()
    sq = (z - d.mean) ** 2
    assert (sq.mean(0) - d.variance).abs().le(mc_atol(sq.std(0), N)).all()
    y = d.sample()  # a feasible target
    for loss, closed in ((lambda e: e.abs(), d.expected_l1(y)), (lambda e: e.square(), d.expected_l2(y))):
        samples = loss(z - y)
        assert (samples.mean(0) - closed).abs().le(mc_atol(samples.std(0), N)).all()


def test_monte_carlo_kl():
    torch.manual_seed(1)
    q = make_case("diag", "linear", (), n=5, a=2, seed=3).dist
    p_case = make_case("full", "linear", (), n=5, a=2, seed=4)
    p = hardeq.ConstrainedNormal(p_case.loc, scale_tril=p_case.params["scale_tril"], constraint=q.constraint)
    N = 100_000
    z = q.sample((N,))
    ratio = q.log_prob(z) - p.log_prob(z)
    kl = torch.distributions.kl_divergence(q, p)
    assert (ratio.mean() - kl).abs() <= mc_atol(ratio.std(), N)


def test_monte_carlo_unconstrained_conditioning():
    """Rejection-style reference: condition N(mu, Sigma) on a thin slab |A z - k| < h, compare moments."""
    torch.manual_seed(2)
    loc = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    scale = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    A = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    k = torch.tensor([1.0], dtype=torch.float64)
    z = loc + scale * torch.randn(2_000_000, 3, dtype=torch.float64)
    kept = z[((z @ A.T - k).abs() < 0.01).squeeze(-1)]
    d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k))
    N = kept.shape[0]
    assert N > 2000
    # the slab adds O(h^2) bias, far below the Monte Carlo tolerance at this N
    assert (kept.mean(0) - d.mean).abs().le(mc_atol(d.stddev, N) + 1e-3).all()


# ---------------------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("structure, kind", all_cases())
def test_gradcheck_rsample_log_prob_losses(structure, kind):
    case = make_case(structure, kind, (2,), n=5, a=2, requires_grad=True)
    names = [k for k in ("loc", "scale", "scale_tril", "cov_factor") if k in case.params]
    inputs = tuple(case.params[k] for k in names)
    k_value = case.k.clone().requires_grad_(True)
    constraint = case.dist.constraint
    noise = torch.randn((3, 2, case.dist.noise_size), dtype=torch.float64)
    y = case.dist.sample()

    def build(*args):
        *params, k = args
        kwargs = dict(zip(names, params))
        if "scale_tril" in kwargs:
            kwargs["scale_tril"] = kwargs["scale_tril"].tril()
        c = constraint.with_k(k)
        loc = kwargs.pop("loc")
        return hardeq.ConstrainedNormal(loc, constraint=c, validate_args=False, **kwargs)

    assert torch.autograd.gradcheck(lambda *a: build(*a).rsample((3,), noise=noise), inputs + (k_value,))
    assert torch.autograd.gradcheck(lambda *a: build(*a).expected_l2(y), inputs + (k_value,))
    assert torch.autograd.gradcheck(lambda *a: build(*a).expected_l1(y), inputs + (k_value,))
    z = case.dist.sample((2,))
    assert torch.autograd.gradcheck(lambda *a: build(*a[:-1], case.k).log_prob(z), inputs + (k_value,))
    assert torch.autograd.gradcheck(lambda *a: build(*a[:-1], case.k).entropy(), inputs + (k_value,))


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_gradcheck_kl(structure):
    q = make_case(structure, "linear", (2,), n=5, a=2, seed=5, requires_grad=True)
    p = make_case("diag", "linear", (2,), n=5, a=2, seed=6)
    names = [k for k in ("loc", "scale", "scale_tril") if k in q.params]

    def kl(*params):
        kwargs = dict(zip(names, params))
        if "scale_tril" in kwargs:
            kwargs["scale_tril"] = kwargs["scale_tril"].tril()
        loc = kwargs.pop("loc")
        qd = hardeq.ConstrainedNormal(loc, constraint=q.dist.constraint, **kwargs)
        pd = hardeq.ConstrainedNormal(p.loc, p.params["scale"], constraint=q.dist.constraint)
        return torch.distributions.kl_divergence(qd, pd)

    assert torch.autograd.gradcheck(kl, tuple(q.params[k] for k in names))


def test_pathwise_gradient_is_unbiased_for_expected_l2():
    torch.manual_seed(3)
    case = make_case("diag", "linear", (), n=6, a=2, requires_grad=True)
    loc, scale = case.params["loc"], case.params["scale"]
    y = case.dist.sample()
    closed = torch.autograd.grad(case.dist.expected_l2(y).sum(), (loc, scale))
    N = 20_000
    loc_b = loc.detach().expand(N, 6).clone().requires_grad_(True)
    scale_b = scale.detach().expand(N, 6).clone().requires_grad_(True)
    d = hardeq.ConstrainedNormal(loc_b, scale_b, constraint=case.dist.constraint)
    ((d.rsample() - y) ** 2).sum().backward()
    for per_sample, truth in ((loc_b.grad, closed[0]), (scale_b.grad, closed[1])):
        assert (per_sample.mean(0) - truth).abs().le(mc_atol(per_sample.std(0), N)).all()


def test_expected_l1_finite_when_variance_is_zero():
    # group 1 has a single coordinate: its conditional variance is exactly 0
    c = hardeq.SumConstraint(torch.tensor([0, 0, 0, 1]), torch.tensor([1.0, 2.0], dtype=torch.float64))
    loc = torch.randn(4, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(4, dtype=torch.float64).add(0.5).requires_grad_(True)
    d = hardeq.ConstrainedNormal(loc, scale, constraint=c)
    assert d.variance[3] == 0
    y = torch.tensor([0.2, 0.3, 0.5, 1.5], dtype=torch.float64)
    l1 = d.expected_l1(y)
    torch.testing.assert_close(l1[3], torch.tensor(0.5, dtype=torch.float64))
    grads = torch.autograd.grad(l1.sum() + d.expected_l2(y).sum(), (loc, scale))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.autograd.gradcheck(lambda lo, sc: hardeq.ConstrainedNormal(lo, sc, constraint=c).expected_l1(y),
                                    (loc, scale))


def test_sample_has_no_grad_and_rsample_has():
    case = make_case("diag", "linear", (), requires_grad=True)
    assert not case.dist.sample().requires_grad
    assert case.dist.rsample().requires_grad


# ---------------------------------------------------------------------------------------------- API

def test_shapes_expand_repr_and_support():
    case = make_case("diag", "linear", (3,), n=5, a=2)
    d = case.dist
    assert d.batch_shape == (3,) and d.event_shape == (5,)
    assert d.sample((4,)).shape == (4, 3, 5)
    assert d.log_prob(d.sample((4,))).shape == (4, 3)
    e = d.expand((2, 3))
    assert e.batch_shape == (2, 3) and e.sample().shape == (2, 3, 5)
    torch.testing.assert_close(e.mean[1], d.mean)
    assert "ConstrainedNormal(n=5" in repr(d)
    assert d.support.event_dim == 1
    assert d.has_rsample


def test_per_sample_k_broadcasts_with_shared_A():
    A = torch.randn(2, 5, dtype=torch.float64)
    k = torch.randn(7, 2, dtype=torch.float64)
    d = hardeq.ConstrainedNormal(torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64),
                                 constraint=hardeq.LinearConstraint(A, k))
    assert d.batch_shape == (7,)
    torch.testing.assert_close(d.mean @ A.T, k)


def test_unknown_estimator_and_bad_noise():
    d = make_case().dist
    with pytest.raises(ValueError, match="unknown estimator 'nope'"):
        d.rsample(estimator="nope")
    with pytest.raises(ValueError, match="noise must have shape"):
        d.rsample((2,), noise=torch.randn(3, 5, dtype=torch.float64))


def test_log_prob_off_the_plane_raises_under_validation():
    d = make_case().dist
    with pytest.raises(ValueError):
        d.log_prob(torch.zeros(5, dtype=torch.float64) + 100)


@pytest.mark.parametrize("builder, error, match", [
    (lambda: hardeq.LinearConstraint(torch.randn(3), torch.randn(1)), ValueError, "A must have at least 2"),
    (lambda: hardeq.LinearConstraint(torch.randn(2, 4), torch.randn(3)), ValueError, r"k must have shape"),
    (lambda: hardeq.LinearConstraint(torch.randn(4, 4), torch.randn(4)), ValueError, "fewer rows than columns"),
    (lambda: hardeq.LinearConstraint(torch.ones(2, 4), torch.randn(2)), ValueError, "full row rank 2"),
    (lambda: hardeq.LinearConstraint(torch.randn(2, 4), torch.randn(2, dtype=torch.float64)), TypeError, "dtype"),
    (lambda: hardeq.LinearConstraint(torch.randn(2, 4).long(), torch.randn(2)), TypeError, "floating-point"),
    (lambda: hardeq.LinearConstraint(torch.full((2, 4), float("nan")), torch.randn(2)), ValueError, "NaN"),
    (lambda: hardeq.SumConstraint(torch.tensor([0.0, 1.0]), torch.randn(2)), TypeError, "torch.long"),
    (lambda: hardeq.SumConstraint(torch.tensor([0, 3, 1]), torch.randn(2)), ValueError, r"in \[0, a\)"),
    (lambda: hardeq.SumConstraint(torch.tensor([0, 0, 0]), torch.randn(2)), ValueError, "empty"),
    (lambda: hardeq.SumConstraint(torch.tensor([0, 1]), torch.randn(2)), ValueError, "fewer groups"),
])
def test_constraint_bad_input(builder, error, match):
    with pytest.raises(error, match=match):
        builder()


def _c(n=4, dtype=torch.float32):
    return hardeq.LinearConstraint(torch.randn(2, n, dtype=dtype), torch.randn(2, dtype=dtype))


@pytest.mark.parametrize("builder, error, match", [
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), torch.ones(3), constraint=_c()), ValueError, "scale must have"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), torch.ones(4), constraint=_c(5)), ValueError, "size 5"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), -torch.ones(4), constraint=_c()), ValueError, "positive"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), torch.full((4,), float("inf")), constraint=_c()),
     ValueError, "finite"),
    (lambda: hardeq.ConstrainedNormal(torch.full((4,), float("nan")), torch.ones(4), constraint=_c()),
     ValueError, "loc"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), torch.ones(4, dtype=torch.float64), constraint=_c()),
     TypeError, "dtype"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), constraint=_c()), ValueError, "one of scale"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), torch.ones(4), scale_tril=torch.eye(4), constraint=_c()),
     ValueError, "exactly one of .* got scale and scale_tril"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), scale_tril=torch.eye(3), constraint=_c()), ValueError,
     r"\(\.\.\., n, n\)"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), scale_tril=-torch.eye(4), constraint=_c()), ValueError,
     "lower triangular"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(4), torch.ones(4), constraint="A"), TypeError, "constraint"),
    (lambda: hardeq.ConstrainedNormal(torch.zeros(3, 4), torch.ones(2, 4), constraint=_c()), ValueError,
     "do not broadcast"),
])
def test_distribution_bad_input(builder, error, match):
    with pytest.raises(error, match=match):
        builder()


@pytest.mark.parametrize("validate,kind,match", [(True, "cpu", "not numerically positive definite"),
                                                 (False, "cpu", "not numerically positive definite"),
                                                 (True, "gpu", "misses a row of A z = k.*row 0"),
                                                 (False, "gpu", "misses a row of A z = k.*row 0")])
@pytest.mark.parametrize("n", [3, 5])
def test_numerically_singular_gram_raises_precise_error(validate, kind, match, n):
    """The checked path refuses the factorisation (a CPU profile, where a read-back costs nothing); the sync-free
    one (a GPU profile, validated or not: validation checks the inputs, in one host read) checks the rows on the
    device and raises (at once on the CPU) naming the row. With ``2a > n`` (n = 3) the sync-free null-space form
    finds the rank deficiency first, on the device, and says so."""
    from hardeq.linalg.device import forced

    if kind == "gpu" and n == 3:
        match = "null-space form .* cannot be trusted.*rank deficient"
    A = torch.zeros(2, n)
    A[:, :2] = torch.tensor([[1.0, 1.0], [1.0, 1.0 + 1e-9]])  # (equal rows in float32)
    c = hardeq.LinearConstraint(A, torch.zeros(2), validate_args=False)
    d = hardeq.ConstrainedNormal(torch.zeros(n), torch.ones(n), constraint=c, validate_args=validate)
    with forced(kind), pytest.raises(hardeq.NotPSDError, match=match):
        d.sample()


# ---------------------------------------------------------------------------------------------- properties

@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    n=st.integers(2, 9),
    a_frac=st.floats(0.0, 0.99),
    structure=st.sampled_from(["diag", "full", "lowrank"]),
    kind=st.sampled_from(["linear", "sum"]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_property_shapes_and_feasibility(batch, n, a_frac, structure, kind, dtype, seed):
    a = max(1, min(n - 1, int(a_frac * n)))
    case = make_case(structure, kind, tuple(batch), n=n, a=a, dtype=dtype, seed=seed)
    d = case.dist
    z = d.rsample((2,))
    assert z.shape == (2,) + tuple(batch) + (n,)
    assert bool(d.constraint.check(z).all())
    assert d.variance.shape == tuple(batch) + (n,) and bool((d.variance >= 0).all())
    assert d.log_prob(z).shape == (2,) + tuple(batch)
    assert torch.isfinite(d.entropy()).all()
