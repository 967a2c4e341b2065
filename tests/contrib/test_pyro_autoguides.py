"""Pyro's autoguides on a ConstrainedNormal latent: ``biject_to(d.support)`` is the isometry ``y -> z0 + N y`` of
R^(n-a) onto the plane (hardeq.distributions.PlaneTransform), so AutoDelta, AutoNormal and AutoMultivariateNormal
learn ``y`` unconstrained and every value they give lies on the plane.

The model is the sum-to-zero effects model with a closed-form posterior: ``b ~ N(0, tau^2 I) | sum b = 0``,
``y_gj ~ N(b_g, sigma^2)``. The posterior is the unconstrained Gaussian posterior ``N(m, V)`` (``V`` diagonal)
conditioned on the plane: a ConstrainedNormal, whose mean and covariance hardeq computes and which we check here
against the dense formula too. In the coordinates ``y = N^T (b - z0)`` it is ``N(N^T(mean - z0), N^T C N)``:
AutoDelta's MAP is its mean (Gaussian: mode = mean), AutoMultivariateNormal's family contains it (mean and
covariance exact at the optimum), AutoNormal's mean-field optimum has the exact mean and the variances
``1 / diag(precision)`` of the ``y`` coordinates (the KL(q||p) optimum for a Gaussian target).
"""

from __future__ import annotations

import pytest
import torch

pyro = pytest.importorskip("pyro", reason="the Pyro bridge needs pyro-ppl (pip install 'hardeq[pyro]')")

import pyro.distributions as pdist  # noqa: E402
from pyro.infer import SVI, Trace_ELBO  # noqa: E402
from pyro.infer.autoguide import AutoDelta, AutoMultivariateNormal, AutoNormal  # noqa: E402
from pyro.optim import ClippedAdam  # noqa: E402
from torch.distributions import biject_to, transform_to  # noqa: E402

import hardeq  # noqa: E402
from hardeq import SumConstraint  # noqa: E402
from hardeq.contrib.pyro import ConstrainedNormal  # noqa: E402
from hardeq.distributions import PlaneTransform  # noqa: E402

DTYPE = torch.float64
M, TAU, SIGMA = 4, 1.5, 0.7
COUNTS = torch.tensor([3, 5, 2, 6])
GROUP = torch.repeat_interleave(torch.arange(M), COUNTS)


@pytest.fixture(autouse=True)
def _clean_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    true_b = torch.tensor([1.0, -0.4, 0.3, -0.9], dtype=DTYPE)
    return true_b[GROUP] + SIGMA * torch.randn(len(GROUP), generator=g, dtype=DTYPE)


ZERO_SUM = SumConstraint(torch.zeros(M, dtype=torch.long), torch.zeros(1, dtype=DTYPE))


def model(y):
    b = pyro.sample("b", ConstrainedNormal(torch.zeros(M, dtype=DTYPE), TAU, constraint=ZERO_SUM))
    pyro.sample("y", pdist.Normal(b[..., GROUP], SIGMA).to_event(1), obs=y)


def posterior(y) -> hardeq.ConstrainedNormal:
    """The exact posterior: N(m, V) (V = diag(1/(1/tau^2 + n_g/sigma^2)), m = V s/sigma^2) given sum b = 0."""
    V = 1.0 / (1.0 / TAU**2 + COUNTS.to(DTYPE) / SIGMA**2)
    s = torch.zeros(M, dtype=DTYPE).index_add_(0, GROUP, y)
    return hardeq.ConstrainedNormal(V * s / SIGMA**2, V.sqrt(), constraint=ZERO_SUM)


def test_the_posterior_is_the_dense_formula():
    """The reference itself, against the dense conditional: mean m - V 1 (1^T m)/(1^T V 1), covariance
    V - V 1 1^T V / (1^T V 1)."""
    post, y = posterior(data()), data()
    V = 1.0 / (1.0 / TAU**2 + COUNTS.to(DTYPE) / SIGMA**2)
    m = V * torch.zeros(M, dtype=DTYPE).index_add_(0, GROUP, y) / SIGMA**2
    torch.testing.assert_close(post.mean, m - V * m.sum() / V.sum())
    torch.testing.assert_close(post.covariance_matrix, torch.diag(V) - torch.outer(V, V) / V.sum())


def fit(guide, steps: int, lr: float, particles: int) -> None:
    pyro.set_rng_seed(0)
    svi = SVI(model, guide, ClippedAdam({"lr": lr, "lrd": 0.99}),
              Trace_ELBO(num_particles=particles, vectorize_particles=True))
    y = data()
    for _ in range(steps):
        svi.step(y)


def basis():
    """The isometry the guides use, and the posterior in its coordinates: mean N^T(mean - z0), covariance N^T C N."""
    post = posterior(data())
    t = biject_to(post.support)
    assert isinstance(t, PlaneTransform)
    eye = torch.eye(M - 1, dtype=DTYPE)
    N = t(eye) - t(torch.zeros(M - 1, dtype=DTYPE))  # (M - 1, M): the rows are N's columns
    return post, t, N.mT, t.inv(post.mean), N @ post.covariance_matrix @ N.mT


def test_auto_delta_finds_the_posterior_mode_on_the_plane():
    guide = AutoDelta(model)
    fit(guide, steps=150, lr=0.1, particles=1)  # no sampling noise: a deterministic gradient
    post = posterior(data())
    b = guide.median(data())["b"].detach()
    assert abs(b.sum().item()) <= 1e-12 * b.abs().sum().item()
    # the MAP of a Gaussian is its mean; Adam (the rate decayed to 0.1 * 0.99**150 = 0.02) settles within 1e-3
    torch.testing.assert_close(b, post.mean, atol=1e-3 * post.stddev.min().item(), rtol=0)


@pytest.mark.parametrize("autoguide", [AutoDelta, AutoNormal, AutoMultivariateNormal])
def test_each_autoguide_trains_and_stays_on_the_plane(autoguide):
    """A few SVI steps with each autoguide: no error, the loss falls, every value the guide gives is on the plane
    (the analytic posterior is checked below)."""
    pyro.set_rng_seed(0)
    guide = autoguide(model)
    svi = SVI(model, guide, ClippedAdam({"lr": 0.05}), Trace_ELBO(num_particles=8, vectorize_particles=True))
    losses = [svi.step(data()) for _ in range(30)]
    assert sum(losses[-5:]) < sum(losses[:5])
    draws = torch.stack([guide(data())["b"].detach() for _ in range(10)])
    assert bool(ZERO_SUM.check(draws).all())


@pytest.mark.slow
@pytest.mark.parametrize("autoguide", [AutoNormal, AutoMultivariateNormal])
def test_gaussian_autoguides_recover_the_analytic_posterior(autoguide):
    guide = autoguide(model)
    fit(guide, steps=400, lr=0.05, particles=32)
    post, t, N, mean_y, cov_y = basis()
    # the guide's values: every draw on the plane
    draws = torch.stack([guide(data())["b"].detach() for _ in range(50)])
    assert bool(ZERO_SUM.check(draws).all())
    if autoguide is AutoNormal:
        loc_y, scale_y = guide.locs.b.detach(), guide.scales.b.detach()
        var_y = 1.0 / torch.linalg.inv(cov_y).diagonal()  # the mean-field optimum
        cov_fit = torch.diag(scale_y.square())
    else:
        loc_y, L = guide.loc.detach(), guide.scale_tril.detach() * guide.scale.detach().unsqueeze(-1)
        cov_fit = L @ L.mT
        var_y = cov_y.diagonal()
    # Monte Carlo gradients (32 particles, the rate decayed to 0.05 * 0.99**400 = 9e-4): the last iterates carry
    # SGD noise of a few percent of a posterior standard deviation
    sd_y = cov_y.diagonal().sqrt()
    assert ((loc_y - mean_y).abs() / sd_y).max() < 0.1
    torch.testing.assert_close(t(loc_y), post.mean, atol=0.1 * post.stddev.min().item(), rtol=0)
    torch.testing.assert_close(cov_fit.diagonal(), var_y, rtol=0.15, atol=0)
    if autoguide is AutoMultivariateNormal:  # the whole covariance, in the plane's coordinates and in b's
        corr = cov_fit / torch.outer(sd_y, sd_y)
        torch.testing.assert_close(corr, cov_y / torch.outer(sd_y, sd_y), atol=0.1, rtol=0)
        torch.testing.assert_close(N @ cov_fit @ N.mT, post.covariance_matrix, atol=0.15 * post.variance.max().item(),
                                   rtol=0)


def test_pyro_param_with_the_support_as_its_constraint():
    """``pyro.param(..., constraint=d.support)`` (what AutoDelta does) keeps the parameter on the plane under
    gradient steps: the optimiser moves the unconstrained y."""
    c = SumConstraint(torch.tensor([0, 0, 0, 1, 1, 2]), torch.tensor([1.0, -2.0, 0.5], dtype=DTYPE))
    d = ConstrainedNormal(torch.zeros(6, dtype=DTYPE), 1.0, constraint=c)
    target = torch.tensor([3.0, 0.0, -1.0, 2.0, 2.0, 7.0], dtype=DTYPE)
    p = pyro.param("w", d.mean.clone(), constraint=d.support)
    optimiser = torch.optim.Adam([pyro.get_param_store().get_param("w").unconstrained()], lr=0.1)
    for _ in range(300):
        optimiser.zero_grad()
        p = pyro.param("w")
        (p - target).square().sum().backward()
        optimiser.step()
    p = pyro.param("w").detach()
    assert bool(c.check(p).all())
    torch.testing.assert_close(p, c.project(target), atol=1e-6, rtol=0)  # the nearest point of the plane


def test_transform_to_is_biject_to():
    d = ConstrainedNormal(torch.zeros(M, dtype=DTYPE), 1.0, constraint=ZERO_SUM)
    assert transform_to(d.support) == biject_to(d.support)


def test_an_autoguide_on_a_truncated_latent_says_to_write_the_guide():
    """A box on the plane has no bijection: the error names the support and the fix (a hand-written guide)."""
    box = ConstrainedNormal(torch.zeros(3, dtype=DTYPE), 1.0,
                            constraint=SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1, dtype=DTYPE)))

    def truncated_model():
        pyro.sample("w", box.truncate(0.0, 1.0))

    with pytest.raises(NotImplementedError, match=r"TruncatedConstrainedNormal.*Write the guide by hand"):
        AutoNormal(truncated_model)()


@pytest.mark.parametrize("kind", ["sum", "linear", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plane_transform_is_an_isometry_onto_the_plane(kind, dtype):
    """The map is onto the plane (every row to the dtype's per-row tolerance), inverts exactly on it, has
    orthonormal columns (J^T J = I: log-det 0 is right) and its columns lie in null(A); batched in k and A."""
    g = torch.Generator().manual_seed(3)
    if kind == "sum":
        c = SumConstraint(torch.tensor([2, 0, 0, 1, 0, 1, 3, 0]), torch.randn(5, 4, generator=g, dtype=torch.float64))
    elif kind == "linear":
        c = hardeq.LinearConstraint(torch.randn(3, 8, generator=g, dtype=torch.float64),
                                    torch.randn(5, 3, generator=g, dtype=torch.float64))
    else:
        c = hardeq.LinearConstraint(torch.randn(5, 3, 8, generator=g, dtype=torch.float64),
                                    torch.randn(5, 3, generator=g, dtype=torch.float64))
    c = c.to(dtype=dtype)
    n, a = c.event_size, c.num_constraints
    t = biject_to(ConstrainedNormal(torch.zeros(n, dtype=dtype), 1.0, constraint=c).support)
    assert t.forward_shape((7, 5, n - a)) == (7, 5, n) and t.inverse_shape((7, 5, n)) == (7, 5, n - a)
    y = torch.randn(7, 5, n - a, generator=g, dtype=torch.float64).to(dtype) * 10
    z = t(y)
    assert z.shape == (7, 5, n) and bool(c.check(z).all())
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(t.inv(z), y, atol=tol * 10 * y.abs().max().item(), rtol=0)
    assert t.log_abs_det_jacobian(y, z).shape == (7, 5) and bool((t.log_abs_det_jacobian(y, z) == 0).all())
    y0 = torch.zeros(5, n - a, dtype=torch.float64)
    t64 = biject_to(ConstrainedNormal(torch.zeros(n, dtype=torch.float64), 1.0,
                                      constraint=c.to(dtype=torch.float64)).support)
    J = torch.autograd.functional.jacobian(t64, y0)  # (5, n, 5, n - a): block-diagonal over the batch
    J = torch.stack([J[b, :, b, :] for b in range(5)])
    torch.testing.assert_close(J.mT @ J, torch.eye(n - a, dtype=torch.float64).expand(5, -1, -1), atol=1e-12, rtol=0)
    A = c.to(dtype=torch.float64).dense_matrix()
    assert (A @ J).abs().max() <= 1e-12


@pytest.mark.parametrize("autoguide", [AutoDelta, AutoNormal, AutoMultivariateNormal])
def test_autoguides_in_a_plate_with_a_total_per_row(autoguide):
    """Per-row totals (k of shape (3, 1)) under pyro.plate: each row of every guide value sums to its own total."""
    pyro.set_rng_seed(1)
    totals = torch.tensor([[1.0], [2.0], [-3.0]], dtype=DTYPE)
    c = SumConstraint(torch.zeros(4, dtype=torch.long), totals)
    obs = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=DTYPE)

    def rows_model():
        with pyro.plate("rows", 3):
            b = pyro.sample("b", ConstrainedNormal(torch.zeros(4, dtype=DTYPE), 1.0, constraint=c))
            pyro.sample("y", pdist.Normal(b, 0.5).to_event(1), obs=obs)

    guide = autoguide(rows_model)
    svi = SVI(rows_model, guide, ClippedAdam({"lr": 0.05}), Trace_ELBO())
    for _ in range(10):
        svi.step()
    b = guide()["b"].detach()
    assert b.shape == (3, 4) and bool(c.check(b).all())
    torch.testing.assert_close(b.sum(-1), totals[:, 0], rtol=0, atol=1e-12 * 4)
