"""Gradient estimators of the Gaussian family: shared forward pass, backward through the stated proxy."""

from __future__ import annotations

import math

import pytest
import torch

import hardeq
from hardeq.estimators import available_estimators, get_estimator
from hardeq.linalg.conditioning import Conditioner
from hardeq.testing import mc_atol

from ..distributions.cases import make_case

STRUCTURES = ["diag", "full", "lowrank"]
NORMAL = available_estimators("normal")


def _needs_baselines(name):
    if name == "constrained_layer":
        pytest.importorskip("hardeq.baselines")


def _call(name, case, noise, **kwargs):
    return get_estimator(name)(case.dist.conditioner, case.params["loc"], noise, **kwargs)


def test_registry_lists_the_design_estimators():
    for name in ["pathwise", "marginal_expectation", "constrained_marginal", "unconstrained_marginal",
                 "constrained_layer", "random", "constrained_reparam_independent", "constrained_reparam"]:
        assert name in NORMAL
    assert get_estimator("pathwise").exact and not get_estimator("marginal_expectation").exact
    assert get_estimator("constrained_reparam").exact and not get_estimator("constrained_reparam_independent").exact
    with pytest.raises(ValueError, match="unknown estimator"):
        get_estimator("bogus")
    with pytest.raises(TypeError):
        get_estimator(3)


@pytest.mark.parametrize("name", NORMAL)
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("kind", ["linear", "sum"])
def test_forward_is_the_exact_sample(name, structure, kind):
    _needs_baselines(name)
    case = make_case(structure, kind, (2,), n=6, a=2, requires_grad=True)
    noise = torch.randn(3, 2, case.dist.noise_size, dtype=torch.float64)
    exact = case.dist.rsample((3,), noise=noise)
    z = case.dist.rsample((3,), estimator=name, noise=noise)
    torch.testing.assert_close(z, exact, rtol=0, atol=1e-12)
    assert z.requires_grad
    assert bool(case.dist.constraint.check(z).all())


def _density(x, mean, var):
    return torch.exp(-0.5 * (x - mean) ** 2 / var) / torch.sqrt(2 * math.pi * var)


@pytest.mark.parametrize("name", ["marginal_expectation", "constrained_marginal", "unconstrained_marginal",
                                  "constrained_layer", "constrained_reparam_independent"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_backward_equals_autograd_through_the_proxy(name, structure):
    _needs_baselines(name)
    torch.manual_seed(0)
    case = make_case(structure, "linear", (2,), n=6, a=2, requires_grad=True)
    leaves = [v for v in case.params.values() if v.requires_grad]
    noise = torch.randn(3, 2, case.dist.noise_size, dtype=torch.float64)
    proxy_noise = torch.randn_like(noise)
    weights = torch.randn(3, 2, 6, dtype=torch.float64)
    kwargs = {"proxy_noise": proxy_noise} if name in ("constrained_layer", "constrained_reparam_independent") else {}
    z = _call(name, case, noise, **kwargs)
    got = torch.autograd.grad((weights * z).sum(), leaves, allow_unused=True, retain_graph=True)

    d = case.dist
    zd = z.detach()
    if name == "marginal_expectation":
        proxy = d.mean
    elif name == "constrained_marginal":
        proxy = _density(zd, d.mean, d.variance)
    elif name == "unconstrained_marginal":
        p = case.params  # Sigma_ii, differentiable in the parameters
        if structure == "diag":
            var = p["scale"] ** 2
        elif structure == "full":
            var = p["scale_tril"].square().sum(-1)
        else:
            var = p["cov_factor"].square().sum(-1) + p["scale"] ** 2
        proxy = _density(zd, case.params["loc"], var)
    elif name == "constrained_layer":
        from hardeq.baselines import constraint_layer

        unconstrained = case.params["loc"] + _unconstrained_noise_term(case, proxy_noise)
        proxy = constraint_layer(unconstrained, d.constraint)
    else:
        proxy = d.rsample((3,), noise=proxy_noise)
    expected = torch.autograd.grad((weights * proxy).sum(), leaves, allow_unused=True)
    for g, e in zip(got, expected):
        if e is None:
            assert g is None or torch.all(g == 0)
        else:
            torch.testing.assert_close(g, e)


def _unconstrained_noise_term(case, noise):
    p = case.params
    if "scale_tril" in p:
        return (p["scale_tril"] @ noise.unsqueeze(-1)).squeeze(-1)
    n = p["scale"].shape[-1]
    out = p["scale"] * noise[..., :n]
    if "cov_factor" in p:
        out = out + (p["cov_factor"] @ noise[..., n:].unsqueeze(-1)).squeeze(-1)
    return out


@pytest.mark.parametrize("structure", STRUCTURES)
def test_marginal_expectation_and_pathwise_coincide_for_loc(structure):
    case = make_case(structure, "linear", (4,), n=6, a=3, requires_grad=True)
    loc = case.params["loc"]
    noise = torch.randn(5, 4, case.dist.noise_size, dtype=torch.float64)
    target = torch.randn(4, 6, dtype=torch.float64)
    grads = [torch.autograd.grad(((_call(name, case, noise) - target) ** 2).sum(), loc, retain_graph=True)[0]
             for name in ("pathwise", "marginal_expectation")]
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("structure", STRUCTURES)
def test_pathwise_is_unbiased_for_every_parameter(structure):
    """Note [Randomized statistical tests]: fixed seed, mc_atol at FAILURE_RATE per coordinate."""
    torch.manual_seed(1)
    case = make_case(structure, "linear", (), n=5, a=2, requires_grad=True)
    leaves = {k: v for k, v in case.params.items()}
    y = case.dist.sample()
    closed = torch.autograd.grad(case.dist.expected_l2(y).sum(), list(leaves.values()))
    N = 20_000
    batched = {k: v.detach().expand((N,) + v.shape).clone().requires_grad_(True) for k, v in leaves.items()}
    loc = batched.pop("loc")
    d = hardeq.ConstrainedNormal(loc, constraint=case.dist.constraint, **batched)
    ((d.rsample() - y) ** 2).sum().backward()
    batched["loc"] = loc
    for name, truth in zip(leaves, closed):
        per_sample = batched[name].grad
        if name == "scale_tril":  # only the lower triangle is a parameter
            per_sample, truth = per_sample.tril(), truth.tril()
        assert (per_sample.mean(0) - truth).abs().le(mc_atol(per_sample.std(0), N)).all(), name


def test_random_gives_standard_normal_gradients_of_the_right_shape():
    torch.manual_seed(2)
    case = make_case("lowrank", "linear", (3,), n=6, a=2, requires_grad=True)
    z = case.dist.rsample((2,), estimator="random")
    z.sum().backward()
    for name, leaf in case.params.items():
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape, name
    big = torch.zeros(50_000, 6, dtype=torch.float64, requires_grad=True)
    d = hardeq.ConstrainedNormal(big, torch.ones(6, dtype=torch.float64),
                                 constraint=hardeq.LinearConstraint(torch.ones(1, 6, dtype=torch.float64),
                                                                    torch.zeros(1, dtype=torch.float64)))
    d.rsample(estimator="random").sum().backward()
    g = big.grad.flatten()
    assert abs(g.mean()) < 5 * 1 / math.sqrt(g.numel())
    assert abs(g.std() - 1) < 0.01


def test_estimators_work_on_plain_tensors_without_a_distribution():
    loc = torch.full((4,), 0.25, requires_grad=True)  # feasible: the conditional mean is loc, whatever Sigma
    scale = torch.ones(4, requires_grad=True)
    c = hardeq.SumConstraint(torch.zeros(4, dtype=torch.long), torch.ones(1))
    cond = Conditioner(hardeq.DiagonalCovariance(scale), c)
    z = get_estimator("marginal_expectation")(cond, loc, torch.randn(8, 4))
    assert z.shape == (8, 4) and torch.allclose(z.sum(-1), torch.ones(8))
    z.pow(2).sum().backward()
    assert scale.grad is None or torch.all(scale.grad == 0)
    assert loc.grad is not None


@pytest.mark.parametrize("kind", ["linear", "sum"])
def test_constrained_reparam_is_pathwise_in_value_and_gradient(kind):
    """The shared-noise Constrained Reparametrization: proxy = the forward sample itself, so its value and its
    gradients w.r.t. loc and scale equal pathwise's exactly (float64, no tolerance), for a dense and a sum
    constraint; the independent-noise reading does not (a check that the comparison can fail)."""
    case = make_case("diag", kind, (2,), n=6, a=2, requires_grad=True)
    leaves = [case.params["loc"], case.params["scale"]]
    noise = torch.randn(3, 2, case.dist.noise_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def grads(name, **kwargs):
        z = _call(name, case, noise, **kwargs)
        loss = (weights * z).sum() + (z**2).sum()  # a non-linear loss: dl/dz depends on the sample
        return z, torch.autograd.grad(loss, leaves, retain_graph=True)

    z_ref, g_ref = grads("pathwise")
    z, g = grads("constrained_reparam")
    assert torch.equal(z, z_ref)
    for got, want in zip(g, g_ref):
        assert torch.equal(got, want)
    _, g_ind = grads("constrained_reparam_independent", proxy_noise=torch.randn_like(noise))
    assert not torch.equal(g_ind[1], g_ref[1])


def _dense_conditional(params, A, k):
    """Dense float64 oracle: conditional mean and covariance of N(loc, Sigma) given A z = k, from the raw
    parameters (no library conditioning): K = Sigma A^T (A Sigma A^T)^-1, mean = loc + K (k - A loc),
    cov = Sigma - K A Sigma."""
    if "scale_tril" in params:
        cov = params["scale_tril"] @ params["scale_tril"].mT
    else:
        cov = torch.diag_embed(params["scale"] ** 2)
        if "cov_factor" in params:
            cov = cov + params["cov_factor"] @ params["cov_factor"].mT
    gain = torch.linalg.solve(A @ cov @ A.T, A @ cov).mT
    mean = params["loc"] + gain @ (k - A @ params["loc"])
    return mean, cov - gain @ A @ cov


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("kind", ["linear", "sum"])
def test_constrained_reparam_independent_expected_gradient_by_monte_carlo(structure, kind):
    """Independent-noise Constrained Reparametrization, squared error l = |z - y|^2 (float64): the per-sample
    gradients (N = 20,000, one parameter copy per sample) average to grad |mean - y|^2 of the dense oracle, i.e.
    the exact gradient of E l = |mean - y|^2 + tr(cov) minus grad tr(cov). So it is unbiased w.r.t. loc and k,
    and its bias w.r.t. the scales is -grad tr(cov), which is checked to be many Monte Carlo widths from zero
    (the test would fail for an unbiased estimator). Note [Randomized statistical tests]: fixed seed, mc_atol."""
    torch.manual_seed(5)
    case = make_case(structure, kind, (), n=5, a=2, seed=4)
    y = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    N = 20_000
    single = {name: v.detach().clone().requires_grad_(True) for name, v in case.params.items()}
    single["k"] = case.k.detach().clone().requires_grad_(True)
    batched = {name: v.detach().expand((N,) + v.shape).clone().requires_grad_(True) for name, v in single.items()}
    index = case.A.argmax(0)
    constraint = (hardeq.LinearConstraint(case.A, batched["k"]) if kind == "linear"
                  else hardeq.SumConstraint(index, batched["k"]))
    cov_params = {name: v for name, v in batched.items() if name not in ("loc", "k")}
    d = hardeq.ConstrainedNormal(batched["loc"], constraint=constraint, **cov_params)
    z = d.rsample(estimator="constrained_reparam_independent")
    assert bool(d.constraint.check(z).all())
    ((z - y) ** 2).sum().backward()

    mean, cov = _dense_conditional(single, case.A, single["k"])
    names = list(single)
    stated = torch.autograd.grad(((mean - y) ** 2).sum(), [single[n] for n in names], retain_graph=True,
                                 allow_unused=True)
    trace = torch.autograd.grad(cov.diagonal().sum(), [single[n] for n in names], allow_unused=True)
    biased_somewhere = False
    for name, want, tr in zip(names, stated, trace):
        per_sample = batched[name].grad
        want = torch.zeros_like(single[name]) if want is None else want
        tr = torch.zeros_like(single[name]) if tr is None else tr
        if name == "scale_tril":  # only the lower triangle is a parameter
            per_sample, want, tr = per_sample.tril(), want.tril(), tr.tril()
        atol = mc_atol(per_sample.std(0), N)
        assert (per_sample.mean(0) - want).abs().le(atol).all(), name
        if name in ("loc", "k"):  # the trace of the conditional covariance does not depend on them: unbiased
            assert torch.all(tr.abs() < 1e-12), name
        elif (tr.abs() > 5 * atol).any():  # the bias -grad tr(cov) is resolved by this many samples
            biased_somewhere = True
    assert biased_somewhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constrained_reparam_independent_checks_proxy_noise_and_differs_from_marginal_expectation(dtype):
    """A proxy_noise of the wrong shape or type is refused; with zero proxy noise the proxy is the conditional
    mean, so the gradient equals Marginal Expectation's exactly; with random proxy noise it does not."""
    case = make_case("diag", "sum", (2,), n=6, a=2, dtype=dtype, requires_grad=True)
    noise = torch.randn(3, 2, case.dist.noise_size, dtype=dtype)
    with pytest.raises(ValueError, match="proxy_noise must have the shape of noise"):
        _call("constrained_reparam_independent", case, noise, proxy_noise=noise[0])
    with pytest.raises(TypeError, match="proxy_noise must be a Tensor"):
        _call("constrained_reparam_independent", case, noise, proxy_noise=0.0)
    leaves = [case.params["loc"], case.params["scale"]]
    y = torch.randn(2, 6, dtype=dtype)

    def grads(name, **kwargs):
        z = _call(name, case, noise, **kwargs)
        out = torch.autograd.grad(((z - y) ** 2).sum(), leaves, allow_unused=True, retain_graph=True)
        return [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(out, leaves)]

    g_me = grads("marginal_expectation")
    g_zero = grads("constrained_reparam_independent", proxy_noise=torch.zeros_like(noise))
    for got, want in zip(g_zero, g_me):
        torch.testing.assert_close(got, want)
    g_rand = grads("constrained_reparam_independent", proxy_noise=torch.randn_like(noise))
    assert not torch.allclose(g_rand[1], g_me[1])
