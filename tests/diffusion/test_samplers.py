"""Native samplers without diffusers: exactness, noise streams, options, errors."""

import pytest
import torch

import hardeq
from hardeq.diffusion import (EndSpaced, StartEnd, StartSpaced, Steps, Uniform, channel_sum_constraint, ddim_sample,
                              ddim_timesteps, ddpm_sample, satisfies_constraint)

from .conftest import RTOL, assert_exact, gen, toy_eps

T = 20
SHAPE = (3, 2, 4, 4)
TOTALS = [2.0, -3.0]


def _ddim(constraint=None, schedule=None, dtype=torch.float32, **kw):
    kw = dict(num_train_timesteps=T, generator=gen(0), dtype=dtype) | kw
    return ddim_sample(toy_eps, SHAPE, 5, constraint, schedule, **kw)


def _ddpm(constraint=None, schedule=None, dtype=torch.float32, **kw):
    kw = dict(num_train_timesteps=T, generator=gen(0), dtype=dtype) | kw
    return ddpm_sample(toy_eps, SHAPE, constraint, schedule, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("deterministic", [False, True])
def test_ddpm_last_step_exact(dtype, deterministic):
    c = channel_sum_constraint(SHAPE, TOTALS)
    x = _ddpm(c, dtype=dtype, deterministic=deterministic)
    assert x.shape == SHAPE and x.dtype == dtype
    assert_exact(x, TOTALS, RTOL[dtype])
    assert satisfies_constraint(x, c).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("schedule", [None, Uniform(1), Uniform(3), Uniform(5), StartEnd(2, 1), StartEnd(0, 2),
                                      EndSpaced(3, 2), StartSpaced(5, 1), Steps((1, -1))])
@pytest.mark.parametrize("eta, set_alpha_to_one", [(0.0, True), (0.0, False), (1.0, False)])
def test_ddim_schedules_with_last_step_exact(dtype, schedule, eta, set_alpha_to_one):
    c = channel_sum_constraint(SHAPE, TOTALS)
    for deterministic in (False, True):
        x = _ddim(c, schedule, dtype, eta=eta, set_alpha_to_one=set_alpha_to_one, deterministic=deterministic)
        assert_exact(x, TOTALS, RTOL[dtype])


def test_schedule_without_last_step_steers_but_is_not_required_exact():
    c = channel_sum_constraint(SHAPE, TOTALS)
    free = _ddim(dtype=torch.float64)
    steered = _ddim(c, StartSpaced(2, 1), torch.float64)
    assert not torch.equal(free, steered)
    assert not satisfies_constraint(free, c).any()


def test_final_step_returns_conditioned_x0_with_set_alpha_to_one_false():
    """With set_alpha_to_one=False the plain last DDIM update rescales x0 by sqrt(abar_0): the sampler must return
    the conditioned x0 itself (the callback sees the same tensor as x and x0_hat)."""
    c = channel_sum_constraint(SHAPE, TOTALS)
    seen = []
    x = _ddim(c, dtype=torch.float64, set_alpha_to_one=False, callback=lambda i, t, xp, x0: seen.append((xp, x0)))
    assert len(seen) == 5 and torch.equal(seen[-1][0], seen[-1][1]) and torch.equal(x, seen[-1][1])
    assert_exact(x, TOTALS, 1e-12)


def test_per_image_totals_and_dense_constraint():
    totals = torch.randn(3, 2, generator=gen(4), dtype=torch.float64) * 4
    c = channel_sum_constraint(SHAPE, totals)
    assert_exact(_ddim(c, Uniform(2), torch.float64), totals, 1e-12)
    A = torch.randn(2, 32, dtype=torch.float64, generator=gen(5))
    k = torch.tensor([1.0, -1.0], dtype=torch.float64)
    x = _ddim(hardeq.LinearConstraint(A, k), dtype=torch.float64)
    torch.testing.assert_close(x.reshape(3, 32) @ A.T, k.expand(3, 2), rtol=0, atol=1e-11)
    x = _ddpm(hardeq.LinearConstraint(A.float(), k.float()), dtype=torch.float32)
    torch.testing.assert_close(x.reshape(3, 32).double() @ A.T, k.expand(3, 2), rtol=0, atol=1e-4)


class _Recorder:
    """Wraps the toy model, recording its inputs (the first is x_T)."""

    def __init__(self):
        self.inputs = []

    def __call__(self, x, t):
        self.inputs.append(x.clone())
        return toy_eps(x, t)


@pytest.mark.parametrize("sampler", ["ddim", "ddpm"])
def test_main_stream_untouched_by_conditioning(sampler):
    """A constrained and an unconstrained run from one seed see the same x_T and draw the same per-step noise
    (same number of draws from the main generator); the conditioning noise comes from another stream."""
    c = channel_sum_constraint(SHAPE, TOTALS)
    schedules = [(), StartEnd(1, 0), Uniform(3), None, EndSpaced(2, 2)]
    states, firsts, outs = [], [], []
    for sch in schedules:
        g, rec = gen(123), _Recorder()
        if sampler == "ddim":
            out = ddim_sample(rec, SHAPE, 5, c, sch, eta=0.7, num_train_timesteps=T, generator=g)
        else:
            out = ddpm_sample(rec, SHAPE, c, sch, num_train_timesteps=T, generator=g)
        states.append(g.get_state())
        firsts.append(rec.inputs[0])
        outs.append(out)
    for s, f in zip(states[1:], firsts[1:]):
        assert torch.equal(s, states[0])
        assert torch.equal(f, firsts[0])
    # the unconstrained run (schedule=()) is the plain loop, and conditioning changes the output
    assert torch.equal(outs[0], ddim_sample(toy_eps, SHAPE, 5, eta=0.7, num_train_timesteps=T, generator=gen(123))
                       if sampler == "ddim" else ddpm_sample(toy_eps, SHAPE, num_train_timesteps=T, generator=gen(123)))
    assert not torch.equal(outs[0], outs[1])


def test_only_first_step_conditioned_shares_initial_noise_and_eta_noise():
    """StartEnd(1, 0) changes x after step 0 only through the conditioned x0: with eta = 1 the runs differ, but the
    per-step noise z_i is the same: x_prev - (deterministic part) agrees between runs."""
    c = channel_sum_constraint(SHAPE, TOTALS)
    runs = []
    for sch in ((), StartEnd(1, 0)):
        rec = _Recorder()
        ddim_sample(rec, SHAPE, 5, c, sch, eta=1.0, num_train_timesteps=T, generator=gen(9), dtype=torch.float64)
        runs.append(rec.inputs)
    assert torch.equal(runs[0][0], runs[1][0])
    assert not torch.equal(runs[0][1], runs[1][1])


def test_reproducible_and_condition_generator_used():
    c = channel_sum_constraint(SHAPE, TOTALS)
    a, b = _ddim(c, Uniform(2)), _ddim(c, Uniform(2))
    assert torch.equal(a, b)
    a = _ddim(c, Uniform(2), condition_generator=gen(1))
    b = _ddim(c, Uniform(2), condition_generator=gen(2))
    assert not torch.equal(a, b)
    # deterministic conditioning does not use the conditioning stream
    a = _ddim(c, Uniform(2), deterministic=True, condition_generator=gen(1))
    b = _ddim(c, Uniform(2), deterministic=True, condition_generator=gen(2))
    assert torch.equal(a, b)


def test_global_rng_reproducible_without_generator():
    c = channel_sum_constraint(SHAPE, TOTALS)
    torch.manual_seed(5)
    a = ddim_sample(toy_eps, SHAPE, 5, c, num_train_timesteps=T)
    torch.manual_seed(5)
    b = ddim_sample(toy_eps, SHAPE, 5, c, num_train_timesteps=T)
    assert torch.equal(a, b)
    assert_exact(a, TOTALS, 1e-5)


def test_explicit_noise_and_callback():
    x_T = torch.randn(SHAPE, generator=gen(3), dtype=torch.float64)
    a = ddim_sample(toy_eps, SHAPE, 5, num_train_timesteps=T, noise=x_T)
    b = ddim_sample(toy_eps, SHAPE, 5, num_train_timesteps=T, generator=gen(3), dtype=torch.float64)
    assert a.dtype == torch.float64 and torch.equal(a, b)
    calls = []
    ddim_sample(toy_eps, SHAPE, 5, num_train_timesteps=T, noise=x_T, callback=lambda i, t, x, x0: calls.append((i, t)))
    assert calls == list(enumerate(ddim_timesteps(T, 5)))


def test_post_baselines():
    c = channel_sum_constraint(SHAPE, [6.0, -6.0])
    free = _ddim()
    projected = _ddim(c, (), post="project")
    assert_exact(projected, [6.0, -6.0], 1e-5)
    assert not torch.equal(free, projected)
    clipped = _ddim(c, (), post="project_clip", clip_range=(-0.5, 0.5))
    assert clipped.abs().max() <= 0.5
    assert not satisfies_constraint(clipped, c).all()
    torch.testing.assert_close(_ddim(post="clip"), free.clamp(-1, 1))
    torch.testing.assert_close(_ddpm(post=lambda x: 2 * x), 2 * _ddpm())


def test_tqdm_progress(capsys):
    pytest.importorskip("tqdm")
    _ddim(progress=True)
    assert "DDIM" in capsys.readouterr().err


def test_timesteps():
    assert ddim_timesteps(1000, 5) == (800, 600, 400, 200, 0)
    assert ddim_timesteps(1000, 5, "trailing") == (999, 799, 599, 399, 199)
    assert ddim_timesteps(1000, 5, "linspace") == (999, 749, 500, 250, 0)
    assert ddim_timesteps(50, 10, steps_offset=1) == (46, 41, 36, 31, 26, 21, 16, 11, 6, 1)
    x = ddim_sample(toy_eps, SHAPE, 3, num_train_timesteps=T, timesteps=[15, 7, 0], generator=gen(0))
    assert x.shape == SHAPE


@pytest.mark.parametrize("call, exc, match", [
    (lambda c: _ddim(None, Uniform(2)), ValueError, "constraint is None"),
    (lambda c: _ddim(c, Uniform(6)), ValueError, "num_steps = 5"),
    (lambda c: _ddim(channel_sum_constraint((2, 5, 5), [0.0, 1.0])), ValueError, "flatten to n = 32"),
    (lambda c: _ddim(torch.ones(3)), TypeError, "constraint must be a hardeq.EqualityConstraint"),
    (lambda c: _ddim(c, post="projection"), ValueError, "post must be None"),
    (lambda c: _ddim(post="project"), ValueError, "constraint is None"),
    (lambda c: _ddim(c, eta=-1.0), ValueError, "eta must be"),
    (lambda c: _ddim(c, timestep_spacing="cosine"), ValueError, "timestep_spacing must be one of"),
    (lambda c: _ddim(c, timesteps=[3, 5, 1, 0, 2]), ValueError, "strictly decreasing"),
    (lambda c: _ddim(c, generator=0), TypeError, "generator must be a torch.Generator"),
    (lambda c: _ddim(c, noise=torch.zeros(2, 2)), ValueError, "noise \\(x_T\\) must have shape"),
    (lambda c: ddim_sample(toy_eps, SHAPE, 0), ValueError, "num_steps must be an int"),
    (lambda c: ddim_sample(toy_eps, (3, 2.5), 5), ValueError, "shape must be a tuple"),
    (lambda c: ddim_sample(lambda x, t: x[:, :1], SHAPE, 5), ValueError, "shape of x_t"),
    (lambda c: ddim_sample(lambda x, t: "eps", SHAPE, 5), TypeError, "predicted noise as a tensor"),
    (lambda c: ddim_sample("model", SHAPE, 5), TypeError, "model must be callable"),
    (lambda c: _ddpm(c, variance_type="learned"), ValueError, "variance_type must be"),
    (lambda c: _ddpm(c, betas=torch.tensor([0.5, 1.5])), ValueError, "betas must lie in"),
    (lambda c: _ddpm(c, beta_schedule="cosine"), ValueError, "beta_schedule must be one of"),
    (lambda c: _ddpm(c, num_train_timesteps=0), ValueError, "num_train_timesteps must be"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(channel_sum_constraint(SHAPE, TOTALS))
