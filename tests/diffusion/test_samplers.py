"""Native samplers without diffusers: exactness, noise streams, options, errors."""

import pickle
from dataclasses import FrozenInstanceError, replace

import pytest
import torch

import hardeq
from hardeq.diffusion import (DDIMOptions, DDPMOptions, EndSpaced, FlowOptions, StartEnd, StartSpaced, Steps, Uniform,
                              channel_sum_constraint, ddim_sample, ddim_timesteps, ddpm_sample, satisfies_constraint)

from .conftest import RTOL, assert_exact, gen, toy_eps

T = 20
SHAPE = (3, 2, 4, 4)
TOTALS = [2.0, -3.0]


def _ddim(constraint=None, schedule=None, dtype=torch.float32, *, generator=None, condition_generator=None,
          noise=None, callback=None, **options):
    opts = DDIMOptions(**(dict(num_steps=5, num_train_timesteps=T, dtype=dtype) | options))
    return ddim_sample(toy_eps, SHAPE, opts, constraint=constraint, schedule=schedule,
                       generator=gen(0) if generator is None else generator, condition_generator=condition_generator,
                       noise=noise, callback=callback)


def _ddpm(constraint=None, schedule=None, dtype=torch.float32, *, generator=None, **options):
    opts = DDPMOptions(**(dict(num_train_timesteps=T, dtype=dtype) | options))
    return ddpm_sample(toy_eps, SHAPE, opts, constraint=constraint, schedule=schedule,
                       generator=gen(0) if generator is None else generator)


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
            out = ddim_sample(rec, SHAPE, DDIMOptions(num_steps=5, eta=0.7, num_train_timesteps=T), constraint=c,
                              schedule=sch, generator=g)
        else:
            out = ddpm_sample(rec, SHAPE, DDPMOptions(num_train_timesteps=T), constraint=c, schedule=sch, generator=g)
        states.append(g.get_state())
        firsts.append(rec.inputs[0])
        outs.append(out)
    for s, f in zip(states[1:], firsts[1:]):
        assert torch.equal(s, states[0])
        assert torch.equal(f, firsts[0])
    # the unconstrained run (schedule=()) is the plain loop, and conditioning changes the output
    assert torch.equal(outs[0], ddim_sample(toy_eps, SHAPE, DDIMOptions(num_steps=5, eta=0.7, num_train_timesteps=T),
                                            generator=gen(123))
                       if sampler == "ddim" else ddpm_sample(toy_eps, SHAPE, DDPMOptions(num_train_timesteps=T),
                                                             generator=gen(123)))
    assert not torch.equal(outs[0], outs[1])


def test_only_first_step_conditioned_shares_initial_noise_and_eta_noise():
    """StartEnd(1, 0) changes x after step 0 only through the conditioned x0: with eta = 1 the runs differ, but the
    per-step noise z_i is the same: x_prev - (deterministic part) agrees between runs."""
    c = channel_sum_constraint(SHAPE, TOTALS)
    runs = []
    for sch in ((), StartEnd(1, 0)):
        rec = _Recorder()
        ddim_sample(rec, SHAPE, DDIMOptions(num_steps=5, eta=1.0, num_train_timesteps=T, dtype=torch.float64),
                    constraint=c, schedule=sch, generator=gen(9))
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
    opts = DDIMOptions(num_steps=5, num_train_timesteps=T)
    torch.manual_seed(5)
    a = ddim_sample(toy_eps, SHAPE, opts, constraint=c)
    torch.manual_seed(5)
    b = ddim_sample(toy_eps, SHAPE, opts, constraint=c)
    assert torch.equal(a, b)
    assert_exact(a, TOTALS, 1e-5)


def test_explicit_noise_and_callback():
    x_T = torch.randn(SHAPE, generator=gen(3), dtype=torch.float64)
    opts = DDIMOptions(num_steps=5, num_train_timesteps=T)
    a = ddim_sample(toy_eps, SHAPE, opts, noise=x_T)
    b = ddim_sample(toy_eps, SHAPE, replace(opts, dtype=torch.float64), generator=gen(3))
    assert a.dtype == torch.float64 and torch.equal(a, b)
    calls = []
    ddim_sample(toy_eps, SHAPE, opts, noise=x_T, callback=lambda i, t, x, x0: calls.append((i, t)))
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
    calls = []
    x = ddim_sample(toy_eps, SHAPE, DDIMOptions(num_train_timesteps=T, timesteps=[15, 7, 0]), generator=gen(0),
                    callback=lambda i, t, x, x0: calls.append(t))
    assert x.shape == SHAPE and calls == [15, 7, 0]


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
    (lambda c: _ddim(num_steps=0), ValueError, "DDIMOptions: num_steps must be >= 1, got 0"),
    (lambda c: _ddim(num_steps=2.5), TypeError, "DDIMOptions: num_steps must be an int"),
    (lambda c: _ddim(num_steps=30), ValueError, "num_steps must be an int in \\[1, num_train_timesteps = 20\\]"),
    (lambda c: DDIMOptions(num_train_timesteps=20), ValueError, "got 50. \\(num_steps defaults to 50\\)"),
    (lambda c: _ddim(c, timesteps=[3, 1]), ValueError, "timesteps must be num_steps = 5"),
    (lambda c: _ddim(c, timesteps="30"), TypeError, "timesteps must be a sequence of ints"),
    (lambda c: ddim_sample(toy_eps, (3, 2.5)), ValueError, "shape must be a tuple"),
    (lambda c: ddim_sample(lambda x, t: x[:, :1], SHAPE, num_steps=5), ValueError, "shape of x_t"),
    (lambda c: ddim_sample(lambda x, t: "eps", SHAPE, num_steps=5), TypeError, "predicted noise as a tensor"),
    (lambda c: ddim_sample("model", SHAPE), TypeError, "model must be callable"),
    (lambda c: _ddim(c, final="mode"), ValueError, "DDIMOptions: final must be None"),
    (lambda c: _ddim(c, box=(1.0, -1.0)), ValueError, "DDIMOptions: box must be a pair"),
    (lambda c: _ddim(c, clip_range=(0.0,)), ValueError, "DDIMOptions: clip_range must be a pair"),
    (lambda c: _ddim(c, scale=-0.1), ValueError, "DDIMOptions: scale must be positive"),
    (lambda c: _ddim(c, scale=torch.tensor([1])), TypeError, "DDIMOptions: scale must be a floating tensor"),
    (lambda c: _ddim(c, deterministic=1), TypeError, "DDIMOptions: deterministic must be a bool"),
    (lambda c: _ddim(c, dtype=torch.int64), TypeError, "DDIMOptions: dtype must be None or a floating"),
    (lambda c: _ddim(c, device="gpu0"), ValueError, "DDIMOptions: device 'gpu0' is not a torch device"),
    (lambda c: _ddim(c, steps_offset=-1), ValueError, "DDIMOptions: steps_offset must be >= 0"),
    (lambda c: _ddpm(c, variance_type="learned"), ValueError, "variance_type must be"),
    (lambda c: _ddpm(c, betas=torch.tensor([0.5, 1.5])), ValueError, "betas must lie in"),
    (lambda c: _ddpm(c, beta_schedule="cosine"), ValueError, "beta_schedule must be one of"),
    (lambda c: _ddpm(c, num_train_timesteps=0), ValueError, "num_train_timesteps must be"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(channel_sum_constraint(SHAPE, TOTALS))


# ------------------------------------------------------------------------------------------- the options objects
def test_keyword_overrides_equal_the_options_object():
    """``ddim_sample(model, shape, num_steps=5, eta=0.7)`` builds ``DDIMOptions(num_steps=5, eta=0.7)``; overrides
    replace the fields of a given options object; the two spellings return the same samples."""
    c = channel_sum_constraint(SHAPE, TOTALS)
    opts = DDIMOptions(num_steps=5, eta=0.7, num_train_timesteps=T, dtype=torch.float64)
    a = ddim_sample(toy_eps, SHAPE, opts, constraint=c, schedule=Uniform(2), generator=gen(1))
    b = ddim_sample(toy_eps, SHAPE, constraint=c, schedule=Uniform(2), generator=gen(1), num_steps=5, eta=0.7,
                    num_train_timesteps=T, dtype=torch.float64)
    assert torch.equal(a, b)
    c2 = ddim_sample(toy_eps, SHAPE, replace(opts, eta=0.0), constraint=c, schedule=Uniform(2), generator=gen(1))
    d2 = ddim_sample(toy_eps, SHAPE, opts, constraint=c, schedule=Uniform(2), generator=gen(1), eta=0.0)
    assert torch.equal(c2, d2) and not torch.equal(a, c2)
    e = ddpm_sample(toy_eps, SHAPE, DDPMOptions(num_train_timesteps=T, variance_type="fixed_large"), constraint=c,
                    generator=gen(2))
    f = ddpm_sample(toy_eps, SHAPE, constraint=c, generator=gen(2), num_train_timesteps=T, variance_type="fixed_large")
    assert torch.equal(e, f)


def test_options_defaults_are_diffusers():
    """The defaults are diffusers' (DDIMScheduler / DDPMScheduler and their pipelines): 1000 linear betas from 1e-4
    to 0.02, 50 DDIM steps with "leading" spacing, eta 0, alpha after the last step 1, "fixed_small"."""
    o = DDIMOptions()
    assert o.steps() == 50 and o.eta == 0.0 and o.set_alpha_to_one and o.timestep_spacing == "leading"
    assert o.inference_timesteps() == tuple(range(980, -1, -20))
    betas = o.train_betas()
    assert betas.shape == (1000,) and betas.dtype == torch.float64
    torch.testing.assert_close(betas, torch.linspace(1e-4, 0.02, 1000, dtype=torch.float32).double(), rtol=0, atol=0)
    assert DDPMOptions().variance_type == "fixed_small" and torch.equal(DDPMOptions().train_betas(), betas)
    assert FlowOptions().time_grid() == tuple(1.0 - j / 50 for j in range(50)) + (0.0,)
    assert DDIMOptions(timesteps=(9, 4, 0)).steps() == 3


def test_options_are_frozen_values():
    """Frozen, keyword-only, compared by value (tensors by ``torch.equal``), picklable, checked on ``replace``."""
    betas = torch.linspace(1e-4, 0.02, 10)
    a, b = DDIMOptions(num_steps=5, betas=betas), DDIMOptions(num_steps=5, betas=betas.clone())
    assert a == b and a != replace(a, eta=0.5) and a != DDIMOptions(num_steps=5, betas=2 * betas)
    assert DDPMOptions() != DDIMOptions() and DDIMOptions() == DDIMOptions(num_steps=None)
    assert a.betas.dtype == torch.float64  # checked and kept as float64, as the loops use them
    with pytest.raises(FrozenInstanceError):
        a.eta = 1.0
    with pytest.raises(TypeError):
        DDIMOptions(5)  # keyword-only
    with pytest.raises(ValueError, match="eta must be non-negative"):
        replace(a, eta=-1.0)
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)


@pytest.mark.parametrize("call, match", [
    (lambda: ddim_sample(toy_eps, SHAPE, 5), "options must be a DDIMOptions .* DDIMOptions\\(num_steps=5\\)"),
    (lambda: ddim_sample(toy_eps, SHAPE, DDPMOptions()), "options must be a DDIMOptions .* got DDPMOptions"),
    (lambda: ddpm_sample(toy_eps, SHAPE, DDIMOptions()), "options must be a DDPMOptions .* got DDIMOptions"),
    (lambda: ddim_sample(toy_eps, SHAPE, contraint=None), "unexpected keyword argument\\(s\\) \\['contraint'\\]"),
    (lambda: ddpm_sample(toy_eps, SHAPE, DDPMOptions(), eta=0.0), "\\['eta'\\]: its call arguments are"),
])
def test_options_type_and_unknown_keywords(call, match):
    with pytest.raises(TypeError, match=match):
        call()
