"""Without a constraint the native samplers and the wrapper are diffusers' own loops (same noise, same output).

diffusers keeps its schedule (alphas_cumprod) in float32 and forms the step coefficients from it in float32; the
native samplers form them in float64 from the same betas. With diffusers' schedule tensors switched to float64
the outputs agree to the last bit; with the stock float32 ones to float32 round-off of those coefficients.
"""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")  # before ConstrainedScheduler, whose module needs it

from hardeq.diffusion import (ConstrainedScheduler, DDIMOptions, DDPMOptions, Uniform,  # noqa: E402
                              channel_sum_constraint, ddim_sample, ddpm_sample)
from hardeq.diffusion.noise_schedule import alphas_cumprod, make_betas  # noqa: E402

from tests.device import device  # noqa: E402

from .conftest import assert_exact, gen  # noqa: E402

#: the same UNet called twice on the same input gives the same bits on the CPU; on a GPU its convolutions may
#: pick other algorithms between calls (float32 round-off), so the two loops agree to float32 round-off there
BITWISE = device().type == "cpu"

T = 20
SHAPE = (2, 2, 8, 8)


def _loop(unet, scheduler, seed, **step_kwargs):
    g = gen(seed)
    x = torch.randn(SHAPE, generator=g)
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(unet(x, t).sample, t, x, generator=g, **step_kwargs).prev_sample
    return x


def _float64_schedule(scheduler):
    scheduler.alphas_cumprod = alphas_cumprod(make_betas(T))
    scheduler.one = torch.tensor(1.0, dtype=torch.float64)
    if hasattr(scheduler, "final_alpha_cumprod"):
        final = scheduler.config.set_alpha_to_one
        scheduler.final_alpha_cumprod = torch.tensor(1.0, dtype=torch.float64) if final else \
            scheduler.alphas_cumprod[0]
    return scheduler


@pytest.mark.parametrize("float64_schedule", [True, False])
def test_ddpm_matches_diffusers(tiny_unet, float64_schedule):
    sch = diffusers.DDPMScheduler(num_train_timesteps=T, clip_sample=False)
    if float64_schedule:
        _float64_schedule(sch)
    ref = _loop(tiny_unet, sch, 1)
    opts = DDPMOptions(num_train_timesteps=T)
    out = ddpm_sample(tiny_unet, SHAPE, opts, generator=gen(1))
    if float64_schedule and BITWISE:
        assert torch.equal(out, ref)
    elif float64_schedule:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # an empty schedule with a constraint is the unconstrained loop too
    c = channel_sum_constraint(SHAPE, [1.0, 2.0])
    assert torch.equal(ddpm_sample(tiny_unet, SHAPE, opts, constraint=c, schedule=(), generator=gen(1)), out)


@pytest.mark.parametrize("eta, set_alpha_to_one, spacing", [(0.0, True, "leading"), (0.0, False, "leading"),
                                                             (1.0, True, "trailing"), (0.5, False, "leading")])
@pytest.mark.parametrize("float64_schedule", [True, False])
def test_ddim_matches_diffusers(tiny_unet, eta, set_alpha_to_one, spacing, float64_schedule):
    sch = diffusers.DDIMScheduler(num_train_timesteps=T, clip_sample=False, set_alpha_to_one=set_alpha_to_one,
                                  timestep_spacing=spacing)
    sch.set_timesteps(5)
    if float64_schedule:
        _float64_schedule(sch)
    ref = _loop(tiny_unet, sch, 2, eta=eta)
    opts = DDIMOptions(num_steps=5, num_train_timesteps=T, eta=eta, set_alpha_to_one=set_alpha_to_one,
                       timestep_spacing=spacing)
    out = ddim_sample(tiny_unet, SHAPE, opts, generator=gen(2))
    if float64_schedule:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6 if BITWISE else 1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", ["DDPMScheduler", "DDIMScheduler"])
def test_wrapper_without_constraint_is_diffusers(tiny_unet, cls):
    make = getattr(diffusers, cls)
    plain, wrapped = make(num_train_timesteps=T, clip_sample=False), make(num_train_timesteps=T, clip_sample=False)
    for s in (plain, wrapped):
        if cls == "DDIMScheduler":
            s.set_timesteps(5)
    w = ConstrainedScheduler(wrapped, None)
    assert torch.equal(_loop(tiny_unet, w, 3), _loop(tiny_unet, plain, 3))
    # with a constraint and an empty schedule too
    c = channel_sum_constraint(SHAPE, [1.0, 2.0])
    assert torch.equal(_loop(tiny_unet, ConstrainedScheduler(wrapped, c, ()), 3), _loop(tiny_unet, plain, 3))


@pytest.mark.parametrize("cls, kwargs, schedule", [
    ("DDPMScheduler", {}, None),
    ("DDPMScheduler", {}, Uniform(3)),
    ("DDIMScheduler", {"set_alpha_to_one": False}, Uniform(3)),
    ("DDIMScheduler", {"set_alpha_to_one": True}, None),
])
def test_wrapper_matches_native_constrained(tiny_unet, cls, kwargs, schedule):
    """The wrapper around diffusers and the native sampler give the same constrained samples for the same main and
    conditioning seeds (up to diffusers' float32 coefficients), and both are exact."""
    c = channel_sum_constraint(SHAPE, [3.0, -2.0])
    sch = ConstrainedScheduler(getattr(diffusers, cls)(num_train_timesteps=T, clip_sample=False, **kwargs), c,
                               schedule, condition_generator=gen(7))
    if cls == "DDIMScheduler":
        sch.set_timesteps(5)
        native = ddim_sample(tiny_unet, SHAPE, DDIMOptions(num_steps=5, num_train_timesteps=T, **kwargs), constraint=c,
                             schedule=schedule, generator=gen(4), condition_generator=gen(7))
    else:
        native = ddpm_sample(tiny_unet, SHAPE, DDPMOptions(num_train_timesteps=T), constraint=c, schedule=schedule,
                             generator=gen(4), condition_generator=gen(7))
    wrapped = _loop(tiny_unet, sch, 4)
    assert_exact(wrapped, [3.0, -2.0], 1e-5)
    assert_exact(native, [3.0, -2.0], 1e-5)
    torch.testing.assert_close(wrapped, native, rtol=1e-4, atol=1e-4)
