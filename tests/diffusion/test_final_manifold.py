"""``final=`` with a nonlinear constraint: the last step sampled on (or projected onto) the manifold h(x) = k."""

import math

import pytest
import torch

from hardeq import NonlinearConstraint
from hardeq.diffusion import channel_sum_constraint, ddim_sample, ddpm_sample, flow_sample
from hardeq.manifold import ManifoldError

from .conftest import toy_eps

SHAPE = (3, 2, 4, 4)  # B, C, H, W: n = 32, m = 16 pixels per channel
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
SAMPLERS = {
    "ddpm": (ddpm_sample, dict(num_train_timesteps=12)),
    "ddim": (ddim_sample, dict(num_train_timesteps=50, num_steps=4)),
    "flow": (flow_sample, dict(num_steps=4)),
}


def channel_energy(z):
    """Per-channel sum of squares of a flattened (B, C*H*W) image: C rows, a sphere per channel."""
    return (z.unflatten(-1, (SHAPE[1], -1)) ** 2).sum(-1)


def mass_energy(z):
    """Burgers-like invariants of the whole image: (sum z, sum z^2 / 2), a sphere cut by a plane."""
    return torch.stack([z.sum(-1), 0.5 * (z * z).sum(-1)], -1)


def channel_sums(z):
    """Affine: the channel sums (the linear channel_sum_constraint written as h)."""
    return z.unflatten(-1, (SHAPE[1], -1)).sum(-1)


def energy_constraint(dtype):
    k = torch.tensor([[10.0, 20.0], [16.0, 4.0], [30.0, 12.0]], dtype=dtype)  # a different k per image
    return NonlinearConstraint(channel_energy, k), lambda z: (channel_energy(z), 2 * channel_energy(z),
                                                              2 * channel_energy(z))


def mass_energy_constraint(dtype):
    k = torch.tensor([[2.0, 9.0], [-3.0, 12.0], [0.0, 5.0]], dtype=dtype)
    sq = lambda z: (z * z).sum(-1)  # noqa: E731
    return NonlinearConstraint(mass_energy, k), lambda z: (mass_energy(z), torch.stack([z.abs().sum(-1), sq(z)], -1),
                                                           torch.stack([z.sum(-1), sq(z)], -1))


def assert_rows_meet(x, con, terms):
    """Every row of every image: |h_i - k_i| <= tol * ((|J||z|)_i + |h_i - (Jz)_i| + |k_i|), the per-row scale
    written out by hand for these h (``terms(z)`` = (h, |J||z|, Jz))."""
    z = x.reshape(x.shape[0], -1)
    value, abs_jz, jz = terms(z)
    res = (value - con.k).abs()
    scale = abs_jz + (value - jz).abs() + con.k.abs()
    assert bool((res <= TOL[x.dtype] * scale).all()), (res / scale).max()


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("make", [energy_constraint, mass_energy_constraint])
@pytest.mark.parametrize("deterministic", [False, True])
def test_every_sampler_ends_on_the_manifold(name, dtype, make, deterministic):
    sample, opts = SAMPLERS[name]
    con, jz_abs = make(dtype)
    x = sample(toy_eps, SHAPE, final=con, dtype=dtype, deterministic=deterministic,
               generator=torch.Generator().manual_seed(3), **opts)
    assert x.shape == SHAPE and x.dtype == dtype and bool(torch.isfinite(x).all())
    assert_rows_meet(x, con, jz_abs)
    assert bool(con.check(x.reshape(SHAPE[0], -1)).all())


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deterministic_final_is_the_radial_projection_of_the_last_prediction(name, dtype):
    """On a sphere per channel the Euclidean projection is x0 * sqrt(k / |x0|^2); the unconstrained loop returns the
    last prediction x0 itself (its last update has coefficients 1 and 0), so the projected last step must equal
    its radial rescaling."""
    sample, opts = SAMPLERS[name]
    con, _ = energy_constraint(dtype)
    x0 = sample(toy_eps, SHAPE, dtype=dtype, generator=torch.Generator().manual_seed(5), **opts)
    x = sample(toy_eps, SHAPE, final=con, deterministic=True, dtype=dtype,
               generator=torch.Generator().manual_seed(5), **opts)
    c = x0.flatten(2)
    expected = (c * (con.k / (c * c).sum(-1)).sqrt().unsqueeze(-1)).reshape(SHAPE)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(x, expected, rtol=64 * eps, atol=64 * eps * float(expected.abs().max()))


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("deterministic", [False, True])
def test_affine_h_gives_the_linear_final_images(name, dtype, deterministic):
    """h = the channel sums, as a NonlinearConstraint, against the linear conditioned last step with the same
    generator: the linearised draw is Matheron's with the same noise, the mode is the projection."""
    sample, opts = SAMPLERS[name]
    k = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-4.0, 0.0]], dtype=dtype)
    linear = channel_sum_constraint(SHAPE, k)
    x_lin = sample(toy_eps, SHAPE, constraint=linear, dtype=dtype, deterministic=deterministic,
                   generator=torch.Generator().manual_seed(7), **opts)
    x_nl = sample(toy_eps, SHAPE, final=NonlinearConstraint(channel_sums, k), dtype=dtype,
                  deterministic=deterministic, generator=torch.Generator().manual_seed(7), **opts)
    eps = torch.finfo(dtype).eps
    size = float(x_lin.abs().max())
    torch.testing.assert_close(x_nl, x_lin, rtol=0.0, atol=256 * eps * size)


def test_per_pixel_scale_and_a_shared_k():
    """A tensor scale (per pixel) and one k for the whole batch."""
    con = NonlinearConstraint(mass_energy, torch.tensor([1.0, 8.0], dtype=torch.float64))
    scale = torch.linspace(0.05, 0.2, 16, dtype=torch.float64).reshape(1, 1, 4, 4)
    x = ddim_sample(toy_eps, SHAPE, final=con, scale=scale, dtype=torch.float64, num_train_timesteps=50,
                    num_steps=3, generator=torch.Generator().manual_seed(1))
    assert bool(con.check(x.reshape(SHAPE[0], -1)).all())
    torch.testing.assert_close(x.flatten(1).sum(-1), torch.ones(SHAPE[0], dtype=torch.float64), rtol=0, atol=1e-11)


def test_no_point_on_the_manifold_is_a_precise_error():
    """k = -1 for a sum of squares: no point; the error names the element and the row, no hang."""
    k = torch.tensor([[4.0, 4.0], [4.0, -1.0], [4.0, 4.0]], dtype=torch.float64)
    with pytest.raises(ManifoldError, match=r"row 1"):
        flow_sample(toy_eps, SHAPE, final=NonlinearConstraint(channel_energy, k), dtype=torch.float64, num_steps=2,
                    generator=torch.Generator().manual_seed(0))


def test_bad_final_objects_are_refused():
    with pytest.raises(ValueError, match="last_step"):
        flow_sample(toy_eps, SHAPE, final="manifold", num_steps=2)

    class Wrong:
        def last_step(self, loc, scale, noise):
            return loc[:, :3]

    with pytest.raises(ValueError, match=r"last_step must return the flattened images' shape \(3, 32\)"):
        flow_sample(toy_eps, SHAPE, final=Wrong(), num_steps=2)
    con = NonlinearConstraint(channel_energy, torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32 or float64"):
        flow_sample(toy_eps, SHAPE, final=con, num_steps=2, dtype=torch.bfloat16)


def _run_scheduler(cs, dtype, seed=0):
    cs.set_timesteps(4)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g, dtype=dtype)
    for t in cs.timesteps:
        x = cs.step(toy_eps(x, t.reshape(1).expand(SHAPE[0])), t, x, generator=g).prev_sample
    return x


@pytest.mark.parametrize("base", ["DDIMScheduler", "DDPMScheduler"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scheduler_final_on_the_manifold(base, dtype, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from hardeq.diffusion import ConstrainedScheduler

    con, jz_abs = mass_energy_constraint(dtype)
    cs = ConstrainedScheduler(getattr(diffusers, base)(num_train_timesteps=50, clip_sample=False), None, final=con)
    x = _run_scheduler(cs, dtype)
    assert x.dtype == dtype
    assert_rows_meet(x, con, jz_abs)
    cs.deterministic = True
    assert_rows_meet(_run_scheduler(cs, dtype), con, jz_abs)
    with pytest.raises(ValueError, match="final"):
        cs.save_pretrained(tmp_path)
    # an affine h: the linear conditioned last step's images
    k = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-4.0, 0.0]], dtype=dtype)
    lin = ConstrainedScheduler(getattr(diffusers, base)(num_train_timesteps=50, clip_sample=False),
                               channel_sum_constraint(SHAPE, k))
    aff = ConstrainedScheduler(getattr(diffusers, base)(num_train_timesteps=50, clip_sample=False), None,
                               final=NonlinearConstraint(channel_sums, k))
    x_lin, x_aff = _run_scheduler(lin, dtype, 2), _run_scheduler(aff, dtype, 2)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(x_aff, x_lin, rtol=0.0, atol=256 * eps * float(x_lin.abs().max()))
    assert math.isfinite(float(x_aff.sum()))


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_linear_constraint_on_earlier_steps_and_the_manifold_last(name):
    """constraint= conditions the scheduled steps before the last; final= finishes on the manifold."""
    from hardeq.diffusion import Uniform

    sample, opts = SAMPLERS[name]
    con, terms = energy_constraint(torch.float64)
    linear = channel_sum_constraint(SHAPE, torch.tensor([1.0, -1.0], dtype=torch.float64))
    seen = []
    x = sample(toy_eps, SHAPE, constraint=linear, schedule=Uniform(2), final=con, dtype=torch.float64,
               generator=torch.Generator().manual_seed(4), callback=lambda i, t, x, x0: seen.append(i), **opts)
    assert_rows_meet(x, con, terms)
    assert len(seen) >= 2


def test_projected_last_step_does_not_depend_on_the_rest_of_the_batch():
    con, _ = energy_constraint(torch.float64)
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    full = flow_sample(toy_eps, SHAPE, final=con, deterministic=True, noise=noise, num_steps=3)
    one = flow_sample(toy_eps, (1,) + SHAPE[1:], final=NonlinearConstraint(channel_energy, con.k[1:2]),
                      deterministic=True, noise=noise[1:2], num_steps=3)
    torch.testing.assert_close(one[0], full[1], rtol=0, atol=1e-13)


def test_scheduler_with_a_linear_constraint_and_a_manifold_final_step():
    diffusers = pytest.importorskip("diffusers")
    from hardeq.diffusion import ConstrainedScheduler, Uniform

    con, terms = energy_constraint(torch.float64)
    linear = channel_sum_constraint(SHAPE, torch.tensor([1.0, -1.0], dtype=torch.float64))
    cs = ConstrainedScheduler(diffusers.DDIMScheduler(num_train_timesteps=50, clip_sample=False), linear, Uniform(2),
                              final=con)
    assert_rows_meet(_run_scheduler(cs, torch.float64), con, terms)
    assert "NonlinearConstraint" in repr(cs)
    with pytest.raises(ValueError, match="last_step"):
        cs.final = "manifold"
