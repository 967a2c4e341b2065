"""ConstrainedScheduler: exactness, argument checks, its diffusers config (specs, from_config, save / load),
Pipelines: test_pipelines.py; the import without diffusers: test_optional_import.py."""

import json
import sys

import pytest
import torch

pytest.importorskip("diffusers")  # before ConstrainedScheduler, whose module needs it

import hardeq  # noqa: E402
from hardeq.diffusion import (ConstrainedScheduler, ConstrainedSchedulerOutput, EndSpaced, StartEnd,  # noqa: E402
                              StartSpaced, Steps, Uniform, channel_sum_constraint, satisfies_constraint)
from hardeq.diffusion import _scheduler_spec as spec  # noqa: E402

from .conftest import RTOL, assert_exact, gen, toy_eps  # noqa: E402

SHAPE = (3, 2, 4, 4)
TOTALS = [2.0, -3.0]
T = 20


def _run(scheduler, seed=0, dtype=torch.float32, **step_kwargs):
    g = gen(seed)
    x = torch.randn(SHAPE, generator=g, dtype=dtype)
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(toy_eps(x, t.expand(SHAPE[0])), t, x, generator=g, **step_kwargs).prev_sample
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cls, kwargs", [
    ("DDPMScheduler", {}),
    ("DDPMScheduler", {"variance_type": "fixed_large"}),
    ("DDIMScheduler", {"set_alpha_to_one": False}),
    ("DDIMScheduler", {"set_alpha_to_one": True}),
    ("DDIMScheduler", {"set_alpha_to_one": False, "prediction_type": "v_prediction"}),
    ("DDIMScheduler", {"set_alpha_to_one": False, "prediction_type": "sample"}),
    ("DDPMScheduler", {"prediction_type": "v_prediction"}),
])
@pytest.mark.parametrize("schedule", [None, Uniform(2), StartEnd(1, 1), EndSpaced(2, 2)])
def test_wrapper_exact(dtype, cls, kwargs, schedule):
    diffusers = pytest.importorskip("diffusers")
    c = channel_sum_constraint(SHAPE, TOTALS)
    for deterministic in (False, True):
        sch = ConstrainedScheduler(getattr(diffusers, cls)(num_train_timesteps=T, clip_sample=False, **kwargs), c,
                                   schedule, deterministic=deterministic)
        sch.set_timesteps(5)
        x = _run(sch, dtype=dtype, **({"eta": 0.5} if cls == "DDIMScheduler" else {}))
        assert x.dtype == dtype
        assert_exact(x, TOTALS, RTOL[dtype])


def test_wrapper_full_ddpm_loop_and_output_type():
    diffusers = pytest.importorskip("diffusers")
    c = channel_sum_constraint(SHAPE, TOTALS)
    sch = ConstrainedScheduler(diffusers.DDPMScheduler(num_train_timesteps=T, clip_sample=False), c)
    assert len(sch.timesteps) == T and sch.conditioned_steps() == (T - 1,)
    x = _run(sch)
    assert satisfies_constraint(x, c).all()
    x0 = torch.randn(SHAPE)
    out = sch.step(torch.zeros(SHAPE), sch.timesteps[-1], x0)
    assert isinstance(out, ConstrainedSchedulerOutput) and torch.equal(out.prev_sample, out.pred_original_sample)
    prev, pred = sch.step(torch.zeros(SHAPE), sch.timesteps[-1], x0, return_dict=False)
    assert_exact(prev, TOTALS, 1e-5)
    # the base scheduler's sampling interface
    assert sch.scheduler.config.num_train_timesteps == T == len(sch) and sch.init_noise_sigma == 1.0
    assert torch.equal(sch.scale_model_input(x0, 3), x0)
    assert torch.equal(sch.add_noise(x0, x0, torch.tensor([3])), sch.scheduler.add_noise(x0, x0, torch.tensor([3])))
    assert "DDPMScheduler" in repr(sch)


def test_wrapper_schedule_not_including_last_is_not_exact():
    diffusers = pytest.importorskip("diffusers")
    c = channel_sum_constraint(SHAPE, TOTALS)
    sch = ConstrainedScheduler(diffusers.DDIMScheduler(num_train_timesteps=T, clip_sample=False), c, StartSpaced(2, 1))
    sch.set_timesteps(5)
    assert sch.conditioned_steps() == (0, 1)
    assert not satisfies_constraint(_run(sch), c).all()


def test_wrapper_streams():
    """The derived conditioning stream does not draw from the step generator: its state after a constrained loop
    equals that after the plain loop (DDIM, eta > 0: one draw per step)."""
    diffusers = pytest.importorskip("diffusers")
    c = channel_sum_constraint(SHAPE, TOTALS)
    states = []
    for constraint in (None, c):
        sch = ConstrainedScheduler(diffusers.DDIMScheduler(num_train_timesteps=T, clip_sample=False), constraint,
                                   Uniform(5) if constraint is not None else None)
        sch.set_timesteps(5)
        g = gen(0)
        x = torch.randn(SHAPE, generator=g)
        for t in sch.timesteps:
            x = sch.step(toy_eps(x, t.expand(3)), t, x, eta=1.0, generator=g).prev_sample
        states.append(g.get_state())
    assert torch.equal(states[0], states[1])


@pytest.mark.parametrize("kwargs, match", [
    ({}, "clip_sample=True .*clip_sample=False"),
    ({"clip_sample": False, "thresholding": True}, "thresholding=True"),
    ({"clip_sample": False, "variance_type": "learned_range"}, "variance_type='learned_range'"),
])
def test_unsupported_configs_raise(kwargs, match):
    diffusers = pytest.importorskip("diffusers")
    with pytest.raises(ValueError, match=match):
        ConstrainedScheduler(diffusers.DDPMScheduler(num_train_timesteps=T, **kwargs),
                             channel_sum_constraint(SHAPE, TOTALS))


def test_clip_sample_default_of_ddim_raises():
    diffusers = pytest.importorskip("diffusers")
    with pytest.raises(ValueError, match="breaks the constraint"):
        ConstrainedScheduler(diffusers.DDIMScheduler(), channel_sum_constraint(SHAPE, TOTALS))


def test_bad_arguments():
    diffusers = pytest.importorskip("diffusers")
    c = channel_sum_constraint(SHAPE, TOTALS)
    with pytest.raises(TypeError, match="DDPMScheduler or diffusers.DDIMScheduler"):
        ConstrainedScheduler(diffusers.EulerDiscreteScheduler(), c)
    with pytest.raises(TypeError, match="constraint must be"):
        ConstrainedScheduler(diffusers.DDIMScheduler(clip_sample=False), torch.ones(2))
    with pytest.raises(TypeError, match="schedule must be"):
        ConstrainedScheduler(diffusers.DDIMScheduler(clip_sample=False), c, "last")
    sch = ConstrainedScheduler(diffusers.DDIMScheduler(num_train_timesteps=T, clip_sample=False), c)
    sch.set_timesteps(5)
    with pytest.raises(ValueError, match="not in scheduler.timesteps"):
        sch.step(torch.zeros(SHAPE), 7, torch.zeros(SHAPE))
    with pytest.raises(ValueError, match="flatten to n = 18"):
        sch.step(torch.zeros(3, 2, 3, 3), sch.timesteps[-1], torch.zeros(3, 2, 3, 3))
    sch = ConstrainedScheduler(diffusers.DDIMScheduler(num_train_timesteps=T, clip_sample=False), c, Uniform(6))
    sch.set_timesteps(5)
    with pytest.raises(ValueError, match="num_steps = 5"):
        sch.conditioned_steps()


def test_missing_diffusers(monkeypatch):
    """The scheduler says how to install diffusers when it is missing (its module is imported on first access)."""
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers -> ImportError
    monkeypatch.delitem(sys.modules, "hardeq.diffusion.scheduler", raising=False)
    import hardeq.diffusion as hd

    with pytest.raises(ImportError, match='pip install "hardeq\\[diffusion\\]"'):
        hd.ConstrainedScheduler(object(), None)


# ---------------------------------------------------------------------------------------------- the config
@pytest.mark.parametrize("constraint, kind", [
    (channel_sum_constraint(SHAPE, TOTALS), "channel_sum"),
    (channel_sum_constraint(SHAPE, torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.1]], dtype=torch.float64)),
     "channel_sum"),
    (hardeq.SumConstraint(torch.arange(32) % 3, torch.tensor([1.0, 2.0, 3.0])), "sum"),
    (hardeq.LinearConstraint(torch.randn(2, 32, generator=gen(1)), torch.tensor([0.5, -0.25])), "linear"),
])
def test_constraint_spec_round_trip(constraint, kind):
    """JSON spec -> the same type, values and dtype, bit for bit."""

    s = json.loads(json.dumps(spec.constraint_spec(constraint)))
    assert s["kind"] == kind
    back = spec.constraint_from_spec(s)
    assert type(back) is type(constraint) and back.k.dtype == constraint.k.dtype
    assert torch.equal(back.k, constraint.k)
    if isinstance(constraint, hardeq.SumConstraint):
        assert torch.equal(back.index, constraint.index)
    else:
        assert torch.equal(back.A, constraint.A)


@pytest.mark.parametrize("schedule", [None, Uniform(3), StartEnd(2, 1), StartSpaced(2, 2), EndSpaced(2, 1),
                                      Steps((0, -1))])
def test_schedule_spec_round_trip(schedule):
    assert spec.schedule_from_spec(spec.schedule_spec(schedule)) == schedule


@pytest.mark.parametrize("bad, error, match", [
    ({"kind": "channel_sum", "channels": 2, "totals": [1.0, 2.0]}, ValueError, "missing \\['event_size'\\]"),
    ({"kind": "channel_sum", "channels": 3, "event_size": 32, "totals": [1.0] * 3}, ValueError, "divisible"),
    ({"kind": "channel_sum", "channels": 2, "event_size": 32, "totals": [1.0] * 3}, ValueError, "shape \\(C,\\)"),
    ({"kind": "polygon"}, ValueError, "unknown constraint spec kind 'polygon'"),
    ({"kind": "channel_sum", "channels": 2, "event_size": 32, "totals": [1.0, 2.0], "dtype": "int8"}, ValueError,
     "dtype must be one of"),
])
def test_malformed_constraint_specs(bad, error, match):
    with pytest.raises(error, match=match):
        spec.constraint_from_spec(bad)
    with pytest.raises(ValueError, match="unknown schedule kind 'Sometimes'"):
        spec.schedule_from_spec({"kind": "Sometimes"})


def test_config_follows_assignments_and_from_config():
    diffusers = pytest.importorskip("diffusers")
    sch = ConstrainedScheduler(diffusers.DDIMScheduler(num_train_timesteps=T, clip_sample=False), None)
    assert sch.config.constraint is None and sch.config.schedule is None
    sch.constraint = channel_sum_constraint(SHAPE, TOTALS)
    sch.schedule = [0, -1]
    sch.scale, sch.deterministic = 0.25, True
    assert sch.config.constraint["totals"] == TOTALS and sch.config.schedule == {"kind": "Steps", "indices": [0, -1]}
    assert sch.config.scale == 0.25 and sch.config.deterministic is True
    again = ConstrainedScheduler.from_config(sch.config)
    assert dict(again.config) == dict(sch.config) and again.schedule == Steps((0, -1))
    # built from the config alone: the same samples as the original for the same seeds
    sch.set_timesteps(5)
    again.set_timesteps(5)
    assert torch.equal(_run(sch), _run(again))
    # a spec dict in the constructor, as a hand-written config would give it
    by_spec = ConstrainedScheduler(dict(sch.config)["base_scheduler"], sch.config.constraint,
                                   {"kind": "Uniform", "n": 2})
    assert type(by_spec.scheduler) is diffusers.DDIMScheduler and by_spec.schedule == Uniform(2)


def test_unsaved_entries_refuse_to_save(tmp_path):
    """A tensor scale runs but has no JSON spec: save_pretrained raises naming it; from_pretrained takes it back."""
    diffusers = pytest.importorskip("diffusers")
    c = channel_sum_constraint(SHAPE, TOTALS)
    sch = ConstrainedScheduler(diffusers.DDPMScheduler(num_train_timesteps=T, clip_sample=False), c,
                               scale=torch.full((1, 2, 1, 1), 0.1))
    assert sch.config.scale["kind"] == "unsaved"
    with pytest.raises(ValueError, match=r"scale \(Tensor\) cannot be written as JSON"):
        sch.save_pretrained(tmp_path)
    sch.scale = 0.1
    sch.save_pretrained(tmp_path)
    back = ConstrainedScheduler.from_pretrained(tmp_path, scale=torch.full((1, 2, 1, 1), 0.2))
    assert isinstance(back.scale, torch.Tensor)
    with pytest.raises(ValueError, match="was not saved"):
        ConstrainedScheduler.from_config({**dict(sch.config), "scale": spec.unsaved(torch.ones(1))})


def test_base_scheduler_spec_errors():
    pytest.importorskip("diffusers")
    with pytest.raises(ValueError, match="base_scheduler must be"):
        ConstrainedScheduler({"class_name": "EulerDiscreteScheduler", "config": {}})
    with pytest.raises(TypeError, match="needs a base scheduler"):
        ConstrainedScheduler()
    with pytest.raises(ValueError, match="clip_sample=True"):  # a spec is checked like an instance
        ConstrainedScheduler({"class_name": "DDIMScheduler", "config": {}})
