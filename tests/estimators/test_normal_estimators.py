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
