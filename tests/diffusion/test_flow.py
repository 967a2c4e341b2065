"""flow_sample: Euler sampling of a rectified-flow velocity model, on the analytic velocity of Gaussian data (where
the Euler map is affine and its output distribution is known exactly), with exact conditioned / boxed last steps,
and parity with diffusers' FlowMatchEulerDiscreteScheduler."""

import math
from dataclasses import replace

import pytest
import torch

from hardeq.diffusion import (FlowOptions, StartEnd, box_project, channel_sum_constraint, flow_sample, flow_sigmas,
                              project_onto)
from hardeq.testing import assert_exact_per_row


MEAN, STD = 0.3, 0.5  # the data: x0 ~ N(MEAN, STD^2) in every pixel, independently


def gen(seed):
    return torch.Generator().manual_seed(seed)


def gaussian_coeffs(t, m=MEAN, s=STD):
    """v(x, t) = E[eps - x0 | x_t = x] = a x + b for x0 ~ N(m, s^2), x_t = (1 - t) x0 + t eps."""
    D = (1 - t) ** 2 * s**2 + t**2
    a = (t - (1 - t) * s**2) / D
    b = -m * (1 + (1 - t) * a)  # v = (t - (1-t) s^2)(x - (1-t) m)/D - m
    return a, b


def gaussian_velocity(x, t):
    tt = (t / 1.0).to(device=x.device, dtype=torch.float64).view(-1, *([1] * (x.dim() - 1)))  # t may be host
    D = (1 - tt) ** 2 * STD**2 + tt**2
    return ((tt - (1 - tt) * STD**2) * (x - (1 - tt) * MEAN) / D - MEAN).to(x.dtype)


def euler_oracle(sig):
    """Mean and variance of the Euler output from x_1 ~ N(0, 1): the map is affine in x at every step."""
    mean, var = 0.0, 1.0
    for t, t_next in zip(sig[:-1], sig[1:]):
        a, b = gaussian_coeffs(t)
        h = t_next - t
        mean, var = mean + h * (a * mean + b), (1 + h * a) ** 2 * var
    return mean, var


def test_velocity_closed_form():
    x = torch.randn(3, 2, 2, 2, generator=gen(0), dtype=torch.float64)
    for t in (0.1, 0.5, 0.9):
        a, b = gaussian_coeffs(t)
        torch.testing.assert_close(gaussian_velocity(x, torch.full((3,), t)), a * x + b)


def test_unconstrained_recovers_the_gaussian():
    """Monte Carlo over 3 * 32 * 16 * 16 = 24,576 iid pixels (seeded): the sample mean and variance match the Euler
    oracle within 5 standard errors (a failure rate below 1e-6 per statistic for a random seed), and the oracle
    tends to N(MEAN, STD^2) at Euler's first order: the variance is 25.8% / 2.92% / 0.296% low at N = 10 / 100 /
    1000 (the mean is exact: it is a fixed point of every step)."""
    N = 100
    sig = flow_sigmas(N)
    mean, var = euler_oracle(sig)
    assert abs(mean - MEAN) < 1e-12 and 0.02 < 1 - var / STD**2 < 0.04
    var1000 = euler_oracle(flow_sigmas(1000))[1]
    assert 0.002 < 1 - var1000 / STD**2 < 0.004  # O(1/N)
    x = flow_sample(gaussian_velocity, (32, 3, 16, 16), FlowOptions(num_steps=N, dtype=torch.float64), generator=gen(1))
    n = x.numel()
    se_mean = math.sqrt(var / n)
    se_var = var * math.sqrt(2 / (n - 1))
    assert abs(float(x.mean()) - mean) < 5 * se_mean
    assert abs(float(x.var()) - var) < 5 * se_var


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("deterministic", [False, True])
def test_constrained_last_step_is_exact(dtype, deterministic):
    shape = (6, 3, 8, 8)
    totals = torch.tensor([0.0, 20.0, -10.0], dtype=torch.float64)
    c = channel_sum_constraint(shape, totals)
    opts = FlowOptions(num_steps=20, dtype=dtype, deterministic=deterministic)
    x = flow_sample(gaussian_velocity, shape, opts, constraint=c, generator=gen(2))
    assert x.dtype == dtype
    assert_exact_per_row(c, x.reshape(6, -1))
    x2 = flow_sample(gaussian_velocity, shape, opts, constraint=c, schedule=StartEnd(3, 2), generator=gen(2))
    assert_exact_per_row(c, x2.reshape(6, -1))


def test_deterministic_last_step_is_the_projection_of_the_plain_output():
    shape = (4, 3, 4, 4)
    c = channel_sum_constraint(shape, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    opts = FlowOptions(num_steps=10, dtype=torch.float64)
    plain = flow_sample(gaussian_velocity, shape, opts, generator=gen(3))
    det = flow_sample(gaussian_velocity, shape, opts, constraint=c, generator=gen(3), deterministic=True)
    torch.testing.assert_close(det, project_onto(c, plain), atol=1e-12, rtol=0)


def test_sampled_last_step_has_the_conditional_covariance():
    """x0 = mu + s z projected per channel: the conditioned noise has variance s^2 (1 - 1/m) per pixel, s the
    step length. 64 images x 3 channels x 64 pixels; the variance estimate within 5 standard errors."""
    shape = (64, 3, 8, 8)
    N = 10
    c = channel_sum_constraint(shape, torch.zeros(3, dtype=torch.float64))
    opts = FlowOptions(num_steps=N, dtype=torch.float64)
    det = flow_sample(gaussian_velocity, shape, replace(opts, deterministic=True), constraint=c, generator=gen(4))
    smp = flow_sample(gaussian_velocity, shape, opts, constraint=c, generator=gen(4), condition_generator=gen(5))
    d = smp - det
    s2 = (1 / N) ** 2 * (1 - 1 / 64)
    n = d.numel()
    assert abs(float(d.pow(2).mean()) - s2) < 5 * s2 * math.sqrt(2 / n)


@pytest.mark.parametrize("box", [(-1.0, 1.0), (0.0, 1.0)])
def test_final_box(box):
    shape = (5, 3, 6, 6)
    lo, hi = box
    m = 36
    totals = torch.tensor([lo + 0.9 * (hi - lo), lo + 0.5 * (hi - lo), lo + 0.05 * (hi - lo)],
                          dtype=torch.float64) * m
    c = channel_sum_constraint(shape, totals)
    plain = flow_sample(gaussian_velocity, shape, FlowOptions(num_steps=10), generator=gen(6))
    x = flow_sample(gaussian_velocity, shape, FlowOptions(num_steps=10, final="box", box=box), constraint=c,
                    generator=gen(6))
    assert float(plain.max()) > hi or float(plain.min()) < lo
    assert_exact_per_row(c, x.reshape(5, -1))
    assert bool((x >= lo).all()) and bool((x <= hi).all())
    torch.testing.assert_close(x, box_project(plain, totals, 1.0, lo, hi), atol=1e-6, rtol=0)


def test_argument_checks():
    calls = []
    flow_sample(gaussian_velocity, (1, 1, 2, 2), callback=lambda i, t, x, x0: calls.append(t))  # default: 50 steps
    assert calls == list(flow_sigmas(50)[:-1])
    with pytest.raises(ValueError, match="FlowOptions: sigmas must be .* ending with 0"):
        flow_sample(gaussian_velocity, (1, 1, 2, 2), sigmas=[1.0, 0.5])
    with pytest.raises(ValueError, match="FlowOptions: num_steps = 3 but sigmas has 3 values"):
        flow_sample(gaussian_velocity, (1, 1, 2, 2), FlowOptions(num_steps=3, sigmas=[1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="FlowOptions: time_scale must be positive"):
        FlowOptions(time_scale=0.0)
    with pytest.raises(TypeError, match="options must be a FlowOptions .* FlowOptions\\(num_steps=2\\)"):
        flow_sample(gaussian_velocity, (1, 1, 2, 2), 2)
    with pytest.raises(ValueError, match="velocity"):
        flow_sample(lambda x, t: x[:, :1], (1, 2, 2, 2), FlowOptions(num_steps=2))
    assert FlowOptions(sigmas=torch.tensor([1.0, 0.5, 0.0])).time_grid() == (1.0, 0.5, 0.0)


def test_diffusers_flow_match_euler_parity():
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    sched.set_timesteps(8)
    seen = []

    def model(x, t):
        seen.append(t.reshape(-1)[0].item())
        return gaussian_velocity(x, t / 1000)

    shape = (2, 3, 4, 4)
    x = torch.randn(shape, generator=gen(7))
    ref = x.clone()
    for t in sched.timesteps:
        ref = sched.step(model(ref, t.expand(shape[0])), t, ref).prev_sample
    ref_times, seen[:] = list(seen), []
    out = flow_sample(model, shape, FlowOptions(sigmas=sched.sigmas, time_scale=1000), noise=x)
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(ref_times), rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


