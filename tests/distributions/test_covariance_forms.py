"""The constructor forms a torch user expects: a Python-number ``scale`` (as ``torch.distributions.Normal``) and
``covariance_matrix=`` / ``precision_matrix=`` (as ``torch.distributions.MultivariateNormal``), checked against
``MultivariateNormal`` itself and the dense null-space oracle of ``hardeq.testing`` (float64)."""

import math

import pytest
import torch
from torch.distributions import MultivariateNormal

from hardeq import ConstrainedNormal, DiagonalCovariance, LinearConstraint, SumConstraint
from hardeq.testing import dense_conditional, random_spd

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.float64: dict(rtol=1e-10, atol=1e-10)}
#: the same law computed with an unbatched and a batched scale differs by round-off only
SAME = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-13, atol=1e-13)}


def _problem(dtype, n=6, a=2, batch=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, dtype=torch.float64, generator=g)
    k = torch.randn(batch + (a,), dtype=torch.float64, generator=g)
    loc = torch.randn(batch + (n,), dtype=torch.float64, generator=g)
    S = torch.stack([random_spd(n, generator=g) for _ in range(math.prod(batch))]).reshape(batch + (n, n))
    return A, k, loc, S


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.7, 2, "0-dim", "(1,)", "(3, 1)"])
def test_number_and_broadcast_scale_equal_the_full_tensor(dtype, scale):
    A, k, loc, _ = _problem(dtype, batch=(3,))
    c = LinearConstraint(A.to(dtype), k.to(dtype))
    loc = loc.to(dtype)
    values = {"0-dim": torch.tensor(1.3, dtype=dtype), "(1,)": torch.tensor([1.3], dtype=dtype),
              "(3, 1)": torch.tensor([[0.5], [1.0], [2.0]], dtype=dtype)}
    s = values.get(scale, scale)
    full = (s if isinstance(s, torch.Tensor) else torch.tensor(float(s), dtype=dtype)).expand(3, 6)
    d, ref = ConstrainedNormal(loc, s, constraint=c), ConstrainedNormal(loc, full.clone(), constraint=c)
    assert d.batch_shape == ref.batch_shape == (3,) and d.loc.dtype == dtype
    torch.testing.assert_close(d.scale, ref.scale, rtol=0, atol=0)
    torch.testing.assert_close(d.mean, ref.mean, **SAME[dtype])
    torch.testing.assert_close(d.variance, ref.variance, **SAME[dtype])
    z = ref.sample((4,))
    torch.testing.assert_close(d.log_prob(z), ref.log_prob(z), **SAME[dtype])
    torch.testing.assert_close(d.entropy(), ref.entropy(), **SAME[dtype])
    # and against the dense oracle of each batch element
    for b in range(3):
        o = dense_conditional(loc[b], torch.diag(full[b].double() ** 2), A, k[b])
        torch.testing.assert_close(d.mean[b].double(), o.mean, **TOL[dtype])
        torch.testing.assert_close(d.log_prob(z).double()[:, b], o.log_prob(z[:, b].double()), **TOL[dtype])


def test_number_scale_with_cov_factor_and_grouped_constraint():
    loc = torch.randn(5, dtype=torch.float64)
    W = torch.randn(5, 2, dtype=torch.float64)
    c = SumConstraint(torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, -1.0], dtype=torch.float64))
    d = ConstrainedNormal(loc, 0.5, cov_factor=W, constraint=c)
    o = dense_conditional(loc, W @ W.T + 0.25 * torch.eye(5, dtype=torch.float64), c.dense_matrix(), c.k)
    torch.testing.assert_close(d.mean, o.mean)
    torch.testing.assert_close(d.variance, o.covariance.diagonal())


def test_number_scale_gradient_flows_to_loc_only():
    loc = torch.randn(4, dtype=torch.float64, requires_grad=True)
    d = ConstrainedNormal(loc, 1.0, constraint=LinearConstraint(torch.ones(1, 4, dtype=torch.float64),
                                                                torch.ones(1, dtype=torch.float64)))
    d.rsample((3,)).sum().backward()
    assert loc.grad is not None and torch.isfinite(loc.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["covariance_matrix", "precision_matrix"])
def test_matrix_forms_match_multivariate_normal_and_the_dense_oracle(dtype, form):
    """log p(z | Az = k) = log N(z; mu, S) - log N(k; A mu, A S A^T) - 1/2 log det(A A^T) on the plane, with
    both Gaussians evaluated by torch's MultivariateNormal; mean, covariance and entropy from the oracle."""
    A, k, loc, S = _problem(dtype, batch=(2,))
    P = torch.linalg.inv(S)
    arg = S if form == "covariance_matrix" else P
    d = ConstrainedNormal(loc.to(dtype), constraint=LinearConstraint(A.to(dtype), k.to(dtype)),
                          **{form: arg.to(dtype)})
    mvn = MultivariateNormal(loc, **{form: arg})
    assert d.batch_shape == (2,) and d.event_shape == (6,) and d.mean.dtype == dtype
    torch.testing.assert_close(d.scale_tril.double(), mvn.scale_tril, **TOL[dtype])
    z = d.sample((5,))
    assert bool(d.constraint.check(z).all())
    S_a = A @ S @ A.T
    ref = (mvn.log_prob(z.double()) - MultivariateNormal(loc @ A.T, S_a).log_prob(k)
           - 0.5 * torch.logdet(A @ A.T))
    torch.testing.assert_close(d.log_prob(z).double(), ref, **TOL[dtype])
    for b in range(2):
        o = dense_conditional(loc[b], S[b], A, k[b])
        torch.testing.assert_close(d.mean[b].double(), o.mean, **TOL[dtype])
        torch.testing.assert_close(d.covariance_matrix[b].double(), o.covariance, **TOL[dtype])
        torch.testing.assert_close(d.entropy()[b].double(), o.entropy(), **TOL[dtype])


@pytest.mark.parametrize("form", ["covariance_matrix", "precision_matrix"])
def test_matrix_forms_gradcheck(form):
    A, k, loc, _ = _problem(torch.float64, n=4, a=1)
    X = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    c = LinearConstraint(A, k)
    z = ConstrainedNormal(loc, 1.0, constraint=c).sample((2,))

    def fn(X, loc):
        M = X @ X.mT + torch.eye(4, dtype=X.dtype)
        d = ConstrainedNormal(loc, constraint=c, **{form: M})
        return d.log_prob(z), d.mean, d.entropy()

    assert torch.autograd.gradcheck(fn, (X, loc.clone().requires_grad_()))


def test_matrix_forms_never_form_the_inverse_and_agree_with_each_other():
    A, k, loc, S = _problem(torch.float64, n=7, a=3)
    c = LinearConstraint(A, k)
    d1 = ConstrainedNormal(loc, covariance_matrix=S, constraint=c)
    d2 = ConstrainedNormal(loc, precision_matrix=torch.linalg.inv(S), constraint=c)
    d3 = ConstrainedNormal(loc, scale_tril=torch.linalg.cholesky(S), constraint=c)
    for d in (d1, d2):
        torch.testing.assert_close(d.scale_tril, d3.scale_tril)
        torch.testing.assert_close(d.variance, d3.variance)
    assert torch.equal(d2.scale_tril, d2.scale_tril.tril()) and bool((d2.scale_tril.diagonal() > 0).all())


S4 = random_spd(4, generator=torch.Generator().manual_seed(1))
BAD = [
    (dict(scale=1.0, covariance_matrix=S4), ValueError, r"pass exactly one of .* got scale and covariance_matrix"),
    (dict(covariance_matrix=S4, precision_matrix=S4), ValueError,
     r"got covariance_matrix and precision_matrix"),
    (dict(scale_tril=torch.eye(4, dtype=torch.float64), precision_matrix=S4), ValueError,
     r"got scale_tril and precision_matrix"),
    (dict(), ValueError, r"one of scale, scale_tril / covariance_matrix / precision_matrix, or covariance must be"),
    (dict(cov_factor=torch.ones(4, 1, dtype=torch.float64)), ValueError, r"cov_factor needs scale too"),
    (dict(covariance_matrix=torch.eye(3, dtype=torch.float64)), ValueError,
     r"covariance_matrix must have shape \(\.\.\., n, n\) with n = loc.shape\[-1\] = 4, got \(3, 3\)"),
    (dict(covariance_matrix=-S4), ValueError, r"covariance_matrix must be positive definite.*order 1"),
    (dict(precision_matrix=torch.stack([S4, S4 - 10 * torch.eye(4, dtype=torch.float64)])), ValueError,
     r"precision_matrix must be positive definite, but its Cholesky factorisation fails at batch index \(1,\)"),
    (dict(covariance_matrix=S4 + torch.triu(torch.ones(4, 4, dtype=torch.float64), 1)), ValueError,
     r"covariance_matrix \(shape \(4, 4\)\) must be symmetric"),
    (dict(covariance=DiagonalCovariance(torch.ones(4, dtype=torch.float64)), precision_matrix=S4), ValueError,
     r"pass covariance= alone.*got covariance and precision_matrix"),
    (dict(covariance_matrix=S4.float()), TypeError, r"covariance_matrix has dtype torch.float32 but loc"),
    (dict(precision_matrix=S4.long()), TypeError, r"precision_matrix must be a floating-point tensor"),
    (dict(scale=True), TypeError, r"scale must be a torch.Tensor, got bool"),
    (dict(scale=torch.ones(3, dtype=torch.float64)), ValueError,
     r"^scale must have shape \(\.\.\., n\) .* got \(3,\); a number, or a tensor whose last dimension is 1"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD, ids=[m for _, _, m in BAD])
def test_covariance_arguments_errors(kwargs, error, match):
    c = LinearConstraint(torch.ones(1, 4, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
    with pytest.raises(error, match=match):
        ConstrainedNormal(torch.zeros(4, dtype=torch.float64), constraint=c, validate_args=True, **kwargs)


def test_negative_number_scale_is_rejected_when_validated():
    c = LinearConstraint(torch.ones(1, 4), torch.ones(1))
    with pytest.raises(ValueError, match="scale .* must be positive"):
        ConstrainedNormal(torch.zeros(4), -1.0, constraint=c, validate_args=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["covariance_matrix", "precision_matrix"])
def test_matrix_forms_in_half_precision_compute_in_float32(dtype, form):
    A, k, loc, S = _problem(torch.float64)
    arg = S if form == "covariance_matrix" else torch.linalg.inv(S)
    d = ConstrainedNormal(loc.to(dtype), constraint=LinearConstraint(A.to(dtype), k.to(dtype)),
                          **{form: arg.to(dtype)})
    A32, k32 = A.to(dtype).float(), k.to(dtype).float()
    ref = ConstrainedNormal(loc.to(dtype).float(), constraint=LinearConstraint(A32, k32),
                            **{form: arg.to(dtype).float()})
    assert d.mean.dtype == dtype and d.sample((2,)).dtype == dtype
    torch.testing.assert_close(d.mean, ref.mean.to(dtype))
