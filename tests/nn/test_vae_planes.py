"""Per-example planes in the VAE latent (a conditional VAE) against the dense float64 oracle, and the flattening
hint of the observation layer for image-shaped data."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import kl_divergence

from hardeq import ConstrainedNormal, LinearConstraint, SumConstraint
from hardeq.nn import ConstrainedGaussianLatent, ConstrainedGaussianObservation
from hardeq.testing import dense_conditional

DTYPES = [torch.float32, torch.float64]
B, N = 5, 6


def _layer(dtype, constraint=None, seed=0):
    torch.manual_seed(seed)
    return ConstrainedGaussianLatent(7, N, constraint, prior_scale=0.8).to(dtype)


def _oracle_kl(q: ConstrainedNormal, prior_scale: float, A: torch.Tensor, k: torch.Tensor, b: int) -> torch.Tensor:
    """KL(q_b || p_b) from two dense oracles on the same A (they share the null-space basis)."""
    A64, k64 = A.double(), k.double()
    oq = dense_conditional(q.loc[b], torch.diag(q.scale[b].double() ** 2), A64, k64)
    op = dense_conditional(torch.zeros(N, dtype=torch.float64), prior_scale**2 * torch.eye(N, dtype=torch.float64),
                           A64, k64)
    return kl_divergence(oq.t_distribution, op.t_distribution)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_example_right_hand_sides_sample_exactly_and_kl_matches_the_oracle(dtype):
    g = torch.Generator().manual_seed(1)
    A = torch.randn(2, N, dtype=torch.float64, generator=g)
    layer = _layer(dtype, LinearConstraint(A.to(dtype), torch.zeros(2, dtype=dtype)))
    k = torch.randn(B, 2, dtype=torch.float64, generator=g) * 3
    feats = torch.randn(B, 7, dtype=dtype)
    q = layer(feats, constraint_value=k.to(dtype))
    assert q.batch_shape == (B,)
    z = q.rsample((64,))
    # every sample on its own example's plane, to the float32 / float64 per-row criterion
    assert bool(q.constraint.check(z).all())
    eps = {torch.float32: 2e-5, torch.float64: 1e-12}[dtype]
    row_scale = 1 + (z.abs().double() @ A.abs().T) + k.abs()
    assert bool(((z.double() @ A.T - k).abs() <= eps * row_scale).all())
    kl = layer.kl(q)
    prior = layer.prior(q)
    assert kl.shape == (B,) and prior.batch_shape == (B,) and kl.dtype == dtype
    tol = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-9, atol=1e-9)}[dtype]
    for b in range(B):
        torch.testing.assert_close(kl[b].double(), _oracle_kl(q, 0.8, A, k[b], b), **tol)
        op = dense_conditional(torch.zeros(N, dtype=torch.float64), 0.64 * torch.eye(N, dtype=torch.float64), A, k[b])
        torch.testing.assert_close(prior.log_prob(z)[:, b].double(), op.log_prob(z[:, b].double()), **tol)


def test_per_example_sum_planes_with_a_number_a_column_and_the_docstring_form():
    layer = _layer(torch.float64, SumConstraint(torch.tensor([0, 0, 0, 1, 1, 1]), torch.zeros(2, dtype=torch.float64)))
    feats = torch.randn(B, 7, dtype=torch.float64)
    column = torch.arange(float(B)).unsqueeze(-1)
    for k, want in [(2.0, torch.full((B, 2), 2.0)), (torch.arange(B).unsqueeze(-1), column.expand(B, 2))]:
        q = layer(feats, constraint_value=k)
        sums = q.constraint.matvec(q.sample((3,)))
        torch.testing.assert_close(sums, want.double().expand(3, B, 2), rtol=0, atol=1e-12)
        assert bool((layer.kl(q) >= 0).all())


def test_per_call_constraint_with_a_batched_matrix_and_a_batched_layer_constraint():
    g = torch.Generator().manual_seed(2)
    A = torch.randn(B, 3, N, dtype=torch.float64, generator=g)
    k = torch.randn(B, 3, dtype=torch.float64, generator=g)
    layer = _layer(torch.float64)  # an unconstrained layer can still take a plane per call
    feats = torch.randn(B, 7, dtype=torch.float64)
    q = layer(feats, constraint=LinearConstraint(A, k))
    kl = layer.kl(q)
    for b in range(B):
        torch.testing.assert_close(kl[b], _oracle_kl(q, 0.8, A[b], k[b], b), rtol=1e-9, atol=1e-9)
    # the same planes fixed at construction, batch shape (B,)
    fixed = _layer(torch.float64, LinearConstraint(A, k))
    fixed.load_state_dict(layer.state_dict())
    torch.testing.assert_close(fixed.kl(fixed(feats)), kl)


def test_kl_gradcheck_in_k():
    layer = _layer(torch.float64, SumConstraint(torch.zeros(N, dtype=torch.long), torch.zeros(1, dtype=torch.float64)))
    feats = torch.randn(3, 7, dtype=torch.float64)
    k = torch.randn(3, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda k: layer.kl(layer(feats, constraint_value=k)), (k,))


def test_per_example_planes_errors():
    layer = _layer(torch.float32, SumConstraint(torch.zeros(N, dtype=torch.long), torch.zeros(1)))
    feats = torch.randn(B, 7)
    with pytest.raises(ValueError, match=r"batch shape \(3,\) .* does not broadcast with the features' .*\(5,\)"):
        layer(feats, constraint_value=torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"constraint_value must have shape \(\.\.\., 1\).*got \(5,\).*unsqueeze"):
        layer(feats, constraint_value=torch.ones(B))
    with pytest.raises(ValueError, match="not both"):
        layer(feats, constraint_value=torch.ones(B, 1), constraint=SumConstraint(torch.zeros(N, dtype=torch.long),
                                                                                  torch.ones(1)))
    with pytest.raises(ValueError, match="needs a layer built with a constraint"):
        _layer(torch.float32)(feats, constraint_value=1.0)
    with pytest.raises(ValueError, match="latent_features"):
        layer(feats, constraint=SumConstraint(torch.zeros(N + 1, dtype=torch.long), torch.ones(1)))
    with pytest.raises(ValueError, match="posterior's planes"):
        layer.prior(layer(feats), constraint_value=1.0)


@pytest.mark.parametrize("shape, start", [((16, 1, 28, 28), 1), ((16, 28, 28), 1), ((2, 16, 784, 1), 2)])
@pytest.mark.parametrize("condition", [True, False])
def test_observation_image_shaped_input_names_the_shape_and_the_flatten(shape, start, condition):
    obs = ConstrainedGaussianObservation(SumConstraint(torch.zeros(784, dtype=torch.long), torch.ones(1)))
    x = torch.rand(shape)
    shown = str(shape).replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=rf"with n = 784 .* got {shown} .*mean\.flatten\({start}\)"):
        obs(x, x, condition=condition)
    p = obs(x.flatten(start), x.flatten(start), condition=condition)  # the hint works as written
    assert p.event_shape == (784,)


def test_observation_wrong_size_without_a_matching_suffix_still_hints():
    obs = ConstrainedGaussianObservation(SumConstraint(torch.zeros(784, dtype=torch.long), torch.ones(1)))
    with pytest.raises(ValueError, match=r"got \(16, 30, 30\) \(last dimension 30\); flatten .*x\.flatten\(1\)"):
        obs(torch.rand(16, 30, 30), torch.rand(16, 30, 30))
