"""ConstrainedScheduler inside diffusers' own DDPMPipeline / DDIMPipeline, and save / load round trips (alone and
inside a pipeline), with a tiny random UNet2DModel (2 channels, 8x8)."""

import json

import pytest
import torch

from hardeq.testing import assert_exact_per_row

diffusers = pytest.importorskip("diffusers")

from hardeq.diffusion import ConstrainedScheduler, StartEnd, Uniform, channel_sum_constraint  # noqa: E402

from tests.device import device  # noqa: E402

from .conftest import gen  # noqa: E402

B, SHAPE = 3, (3, 2, 8, 8)
TOTALS = [4.0, -6.0]
T = 10


def _constrained(base="DDPMScheduler", schedule=None, **kwargs):
    base = getattr(diffusers, base)(num_train_timesteps=T, clip_sample=False, **kwargs)
    schedule = Uniform(2) if schedule is None else schedule
    return ConstrainedScheduler(base, channel_sum_constraint(SHAPE, TOTALS), schedule)


def _record_last(scheduler):
    """Record the ``prev_sample`` of each ``scheduler.step`` call (the pipeline returns a clamped copy)."""
    seen = []
    step = scheduler.step

    def recording(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.append(out.prev_sample if kwargs.get("return_dict", True) else out[0])
        return out

    scheduler.step = recording
    return seen


def _run(pipe, steps=4, seed=0, **kwargs):
    pipe.set_progress_bar_config(disable=True)
    return pipe(batch_size=B, generator=gen(seed), num_inference_steps=steps, output_type="np", **kwargs).images


def _check_pipeline_output(images, x):
    """Per-channel totals exact per row on the scheduler's last sample, and the pipeline's images are that sample
    as ``(x / 2 + 0.5).clamp(0, 1)`` in NHWC."""
    assert_exact_per_row(channel_sum_constraint(SHAPE, TOTALS, dtype=torch.float64), x.reshape(B, -1))
    expected = (x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    assert images.shape == expected.shape
    assert abs(images - expected).max() <= 1e-6


@pytest.mark.parametrize("base", ["DDPMScheduler", "DDIMScheduler"])
def test_ddpm_pipeline_keeps_it_and_is_exact(tiny_unet, base):
    """DDPMPipeline(unet, cs) keeps the scheduler; with a DDIM base it runs DDIM (eta = 0)."""
    cs = _constrained(base)
    pipe = diffusers.DDPMPipeline(tiny_unet, cs)
    assert pipe.scheduler is cs
    seen = _record_last(cs)
    images = _run(pipe)
    assert len(seen) == 4  # num_inference_steps
    _check_pipeline_output(images, seen[-1])
    cs.constraint = None  # the check can fail: the unconstrained pipeline misses the totals
    with pytest.raises(AssertionError, match="not met to round-off"):
        _check_pipeline_output(_run(pipe), seen[-1])


def test_ddim_pipeline_construction_raises_naming_the_fix(tiny_unet):
    """DDIMPipeline.__init__ rebuilds its scheduler by DDIMScheduler.from_config(scheduler.config): loud, never a
    silent drop of the constraint."""
    cs = _constrained("DDIMScheduler")
    with pytest.raises(TypeError, match=r"silently drop.*pipe.scheduler = cs"):
        diffusers.DDIMPipeline(tiny_unet, cs)
    with pytest.raises(TypeError, match="ConstrainedScheduler"):
        diffusers.DDIMScheduler.from_config(cs.config)


def test_ddim_pipeline_with_scheduler_set_after_construction(tiny_unet):
    cs = _constrained("DDIMScheduler", schedule=StartEnd(1, 1), set_alpha_to_one=False)
    pipe = diffusers.DDIMPipeline(tiny_unet, cs.scheduler)
    pipe.scheduler = cs
    assert pipe.scheduler is cs
    seen = _record_last(cs)
    images = _run(pipe, eta=0.5)
    assert len(seen) == 4
    _check_pipeline_output(images, seen[-1])


def _same_scheduler(a, b):
    assert type(a) is type(b) is ConstrainedScheduler
    assert dict(a.config) == dict(b.config)
    assert type(a.scheduler) is type(b.scheduler)
    assert {k: v for k, v in a.scheduler.config.items() if not k.startswith("_")} == \
        {k: v for k, v in b.scheduler.config.items() if not k.startswith("_")}
    ca, cb = a.constraint, b.constraint
    assert type(ca) is type(cb) and torch.equal(ca.index, cb.index) and torch.equal(ca.k, cb.k)
    assert ca.k.dtype == cb.k.dtype
    assert a.schedule == b.schedule and a.scale == b.scale and a.deterministic == b.deterministic


def test_save_load_alone(tmp_path):
    cs = _constrained("DDIMScheduler", schedule=StartEnd(1, 1), set_alpha_to_one=False)
    cs.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "scheduler_config.json").read_text())
    assert saved["_class_name"] == "ConstrainedScheduler"
    assert saved["constraint"] == {"kind": "channel_sum", "channels": 2, "event_size": 128, "totals": TOTALS,
                                   "dtype": "float32"}
    assert saved["schedule"] == {"kind": "StartEnd", "start": 1, "end": 1}
    assert saved["base_scheduler"]["class_name"] == "DDIMScheduler"
    assert saved["base_scheduler"]["config"]["set_alpha_to_one"] is False
    loaded = ConstrainedScheduler.from_pretrained(tmp_path)
    _same_scheduler(cs, loaded)
    assert ConstrainedScheduler.from_pretrained(tmp_path, deterministic=True).deterministic  # kwargs override


def test_save_load_in_ddpm_pipeline(tiny_unet, tmp_path):
    cs = _constrained("DDPMScheduler", schedule=Uniform(3))
    pipe = diffusers.DDPMPipeline(tiny_unet, cs)
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["scheduler"] == ["hardeq.diffusion.scheduler", "ConstrainedScheduler"]
    loaded = diffusers.DDPMPipeline.from_pretrained(tmp_path).to(device())  # it loads onto the CPU
    _same_scheduler(cs, loaded.scheduler)
    seen = _record_last(loaded.scheduler)
    images = _run(loaded, steps=T)
    _check_pipeline_output(images, seen[-1])
    assert (images == _run(pipe, steps=T)).all()  # same weights, seeds and constraint: the same images


def test_save_load_in_ddim_pipeline(tiny_unet, tmp_path):
    """A saved DDIMPipeline holding the constrained scheduler: plain from_pretrained raises (DDIMPipeline.__init__
    again); the recipe of the error message restores it."""
    cs = _constrained("DDIMScheduler")
    pipe = diffusers.DDIMPipeline(tiny_unet, cs.scheduler)
    pipe.scheduler = cs
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["scheduler"] == ["hardeq.diffusion.scheduler",
                                                                                   "ConstrainedScheduler"]
    with pytest.raises(TypeError, match="subfolder='scheduler'"):
        diffusers.DDIMPipeline.from_pretrained(tmp_path)
    loaded_cs = ConstrainedScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    loaded = diffusers.DDIMPipeline.from_pretrained(tmp_path, scheduler=loaded_cs.scheduler).to(device())
    loaded.scheduler = loaded_cs
    _same_scheduler(cs, loaded.scheduler)
    seen = _record_last(loaded_cs)
    _check_pipeline_output(_run(loaded), seen[-1])
