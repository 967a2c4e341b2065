"""final="sample_box": the last step draws a *sample* of the last step's Gaussian given the channel totals and the
pixel box (not the mode of final="box"), in the native samplers and in ConstrainedScheduler inside diffusers'
DDPMPipeline, whose clamp then changes nothing, and which to_uint8_exact keeps exact in 8 bits."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from hardeq.diffusion import (DDIMOptions, DDPMOptions, FlowOptions, box_project, channel_sum_constraint, ddim_sample,
                              ddpm_sample, flow_sample, to_uint8_exact)
from hardeq.diffusion.box import sampled_last_step
from hardeq.testing import assert_exact_per_row

from tests.device import device

from .conftest import gen

BETAS = torch.linspace(1e-4, 0.02, 12, dtype=torch.float64)


def far_model(x, t):
    """A noise predictor whose x0-prediction runs out of [-1, 1] (so that the box binds)."""
    return -0.8 * x - 0.05 * torch.tanh(x.flip(-1))


def _run(sampler, shape, c, dtype, **opts):
    if sampler == "ddpm":
        return ddpm_sample(far_model, shape, DDPMOptions(betas=BETAS, dtype=dtype, **opts), constraint=c,
                           generator=gen(3))
    if sampler == "ddim":
        return ddim_sample(far_model, shape, DDIMOptions(num_steps=4, betas=BETAS, dtype=dtype, **opts),
                           constraint=c, generator=gen(3))
    return flow_sample(lambda x, t: -1.5 * x, shape, FlowOptions(num_steps=4, dtype=dtype, **opts), constraint=c,
                       generator=gen(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampled_last_step_is_exact_in_the_sums_and_the_box(dtype):
    """Both samplers of the truncated law: the first batch accepts often (rejection), the second rarely (a mean
    far outside the box: exact HMC from the mode). Every pixel in the box, every channel total to round-off."""
    x_in = torch.tensor([[[[0.5, -0.2], [0.9, 0.1]], [[-0.6, 0.3], [0.0, -0.9]]]], dtype=dtype).expand(3, -1, -1, -1)
    c = channel_sum_constraint(x_in.shape, [1.2, -1.0], dtype=dtype)
    for x0, std in ((x_in, 0.05), (2.5 * x_in, 0.3)):
        y = sampled_last_step(x0, c, std, (-1.0, 1.0), gen(1))
        assert y.dtype == dtype and y.shape == x0.shape
        assert bool(((y >= -1) & (y <= 1)).all())
        assert_exact_per_row(c.to(dtype=torch.float64), y.reshape(3, -1).to(torch.float64),
                             tol=1e-5 if dtype == torch.float32 else 1e-12)
        assert float((y[0] - y[1]).abs().max()) > 1e-4  # independent draws per image
        mode = box_project(x0, c, std**2, -1.0, 1.0)
        assert float((y - mode).abs().max()) > 1e-4  # a sample, not the mode


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "flow"])
def test_samplers_call_the_sampled_last_step(sampler):
    """final="sample_box" in each native sampler: the output is in the box with exact totals, where the box binds
    (the mode, final="box", has a pixel on a bound), and it is not the mode."""
    shape = (1, 1, 2, 2)
    c = channel_sum_constraint(shape, [3.6])  # 4 pixels in [-1, 1] summing to 3.6: the box binds
    x = _run(sampler, shape, c, torch.float32, final="sample_box", box=(-1.0, 1.0), scale=0.5)
    mode = _run(sampler, shape, c, torch.float32, final="box", box=(-1.0, 1.0), scale=0.5)
    assert float(mode.abs().max()) == 1.0  # the box binds
    assert bool(((x >= -1) & (x <= 1)).all())
    assert_exact_per_row(c.to(dtype=torch.float64), x.reshape(1, -1).to(torch.float64), tol=1e-5)
    assert float((x - mode).abs().max()) > 1e-4


def test_sample_box_is_reproducible_and_random_in_the_conditioning_stream():
    shape = (1, 1, 2, 2)
    c = channel_sum_constraint(shape, [1.0])
    opts = DDIMOptions(num_steps=3, betas=BETAS, final="sample_box", box=(0.0, 1.0), scale=0.3)
    a = ddim_sample(far_model, shape, opts, constraint=c, generator=gen(1), condition_generator=gen(5))
    b = ddim_sample(far_model, shape, opts, constraint=c, generator=gen(1), condition_generator=gen(5))
    d = ddim_sample(far_model, shape, opts, constraint=c, generator=gen(1), condition_generator=gen(6))
    assert torch.equal(a, b)
    assert float((a - d).abs().max()) > 1e-4
    before = torch.random.get_rng_state()
    ddim_sample(far_model, shape, opts, constraint=c, generator=gen(1))
    assert torch.equal(before, torch.random.get_rng_state())  # torch's global stream untouched


def test_sampled_last_step_matches_rejection_from_the_untruncated_conditional():
    """An oracle sharing no code with the library's sampler: iid Gaussians, the orthogonal projection onto the sum
    (the exact conditional for an isotropic covariance) and rejection outside the box. Two-sample KS tests of every
    pixel's marginal and of a pairwise product, 4,000 draws each, at level 1e-3 per test (10 tests)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    x0 = torch.tensor([[[[0.9, 0.1], [-0.2, 0.7]]]], dtype=torch.float64)  # (1, 1, 2, 2)
    k, s, N = 1.2, 0.4, 4000
    c = channel_sum_constraint(x0.shape, [k], dtype=torch.float64)
    draws = torch.stack([sampled_last_step(x0.expand(N // 4, -1, -1, -1), c, s, (-0.5, 1.0), gen(100 + i))
                         for i in range(4)]).reshape(N, 4)
    rng = np.random.default_rng(0)
    ref = []
    mu = x0.flatten().numpy()
    while sum(len(r) for r in ref) < N:
        z = mu + s * rng.standard_normal((20000, 4))
        z = z + (k - z.sum(1, keepdims=True)) / 4
        ref.append(z[((z >= -0.5) & (z <= 1.0)).all(1)])
    ref = np.concatenate(ref)[:N]
    got = draws.numpy()
    assert ((got >= -0.5) & (got <= 1.0)).all() and np.abs(got.sum(1) - k).max() < 1e-12
    pvalues = [scipy_stats.ks_2samp(got[:, i], ref[:, i]).pvalue for i in range(4)]
    pvalues += [scipy_stats.ks_2samp(got[:, i] * got[:, j], ref[:, i] * ref[:, j]).pvalue
                for i, j in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))]
    assert min(pvalues) > 1e-3, pvalues


def test_sample_box_then_to_uint8_exact_keeps_the_totals_in_8_bits():
    shape, m = (2, 3, 2, 2), 4
    totals01 = torch.tensor([0.25 * m, 0.5 * m, 0.75 * m], dtype=torch.float64)  # integer grey-level totals
    c = channel_sum_constraint(shape, totals01)
    x = ddim_sample(far_model, shape, DDIMOptions(num_steps=3, betas=BETAS, final="sample_box", box=(0.0, 1.0),
                                                  scale=0.3, dtype=torch.float64), constraint=c, generator=gen(2))
    u8 = to_uint8_exact(x, totals01)
    assert u8.dtype == torch.uint8
    expected = torch.round(255 * totals01).to(torch.int64)
    assert torch.equal(u8.sum((-2, -1), dtype=torch.int64), expected.expand(2, 3))
    assert float((u8.to(torch.float64) - 255 * x).abs().max()) < 1


@pytest.mark.parametrize("final", ["box", "sample_box"])
def test_final_options_are_checked(final):
    shape = (1, 1, 2, 2)
    with pytest.raises(ValueError, match=f"final='{final}'.*constraint is None"):
        ddim_sample(far_model, shape, DDIMOptions(num_steps=2, betas=BETAS, final=final))
    from hardeq import LinearConstraint

    dense = LinearConstraint(torch.ones(1, 4), torch.tensor([1.0]))
    with pytest.raises(TypeError, match="grouped-sum"):
        ddim_sample(far_model, shape, DDIMOptions(num_steps=2, betas=BETAS, final=final), constraint=dense)
    with pytest.raises(ValueError, match="sample_box"):
        DDIMOptions(final="sample")
    opts = DDIMOptions(num_steps=2, betas=BETAS, final=final, box=(0.0, 1.0))
    with pytest.raises(ValueError, match="total must lie in"):  # 4 pixels in [0, 1] cannot sum to 5
        ddim_sample(far_model, shape, opts, constraint=channel_sum_constraint(shape, [5.0]))
    assert replace(opts, final=None).final is None


# ------------------------------------------------------------------------------ diffusers: DDPMPipeline
diffusers_B, PIPE_SHAPE = 2, (2, 1, 4, 4)


@pytest.fixture(scope="module")
def small_unet():
    """A randomly initialised 1-channel 4x4 ``diffusers.UNet2DModel`` (16 pixels: the truncated sampler's cost
    grows with the pixels that sit on a bound)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=4, in_channels=1, out_channels=1, block_out_channels=(8, 16), layers_per_block=1,
        norm_num_groups=4, down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )
    return unet.eval()


def _pipeline(unet, final, totals):
    diffusers = pytest.importorskip("diffusers")
    from hardeq.diffusion import ConstrainedScheduler

    base = diffusers.DDPMScheduler(num_train_timesteps=10, clip_sample=False)
    cs = ConstrainedScheduler(base, channel_sum_constraint(PIPE_SHAPE, totals), final=final, scale=1.0)
    pipe = diffusers.DDPMPipeline(unet, cs)
    pipe.set_progress_bar_config(disable=True)
    return pipe, cs


def _images(pipe, seed=0):
    out = pipe(batch_size=diffusers_B, generator=gen(seed), num_inference_steps=4, output_type="np").images
    images = torch.from_numpy(np.ascontiguousarray(out)).permute(0, 3, 1, 2)  # NCHW in [0, 1], on the host
    return images.to(device=device(), dtype=torch.float64)


def test_ddpm_pipeline_with_sample_box_returns_images_that_meet_the_totals(small_unet, tmp_path):
    """The pipeline clamps (x / 2 + 0.5) to [0, 1]; an exact sample with pixels outside [-1, 1] then misses its
    channel totals, a sample in the box keeps them (in [0, 1] units, (k + m) / 2), and so do its 8-bit images."""
    m = 16
    totals = [-0.25 * m]  # model space [-1, 1]: (k + m) / 2 = 6 in [0, 1] units, 1530 grey levels
    totals01 = torch.tensor([(t + m) / 2 for t in totals], dtype=torch.float64)
    pipe, cs = _pipeline(small_unet, None, totals)
    miss = (_images(pipe).sum((-2, -1)) - totals01).abs().max()
    assert float(miss) > 1e-2  # today: the clamp breaks the exact sample's totals
    cs.final = "sample_box"
    images = _images(pipe)
    assert images.min() >= 0 and images.max() <= 1
    err = (images.sum((-2, -1)) - totals01).abs()
    assert float(err.max()) <= 1e-5 * m  # float32 images: round-off of (x / 2 + 0.5) only
    u8 = to_uint8_exact(images, totals01)
    assert torch.equal(u8.sum((-2, -1), dtype=torch.int64),
                       torch.round(255 * totals01).to(torch.int64).expand(diffusers_B, 1))
    assert torch.equal(_images(pipe), images)  # the conditioning stream is derived from the pipeline's generator
    # the config records final and box, and a saved pipeline keeps them
    assert cs.config.final == "sample_box" and list(cs.config.box) == [-1.0, 1.0]
    pipe.save_pretrained(tmp_path)
    diffusers = pytest.importorskip("diffusers")
    loaded = diffusers.DDPMPipeline.from_pretrained(tmp_path).to(device())  # it loads onto the CPU
    assert loaded.scheduler.final == "sample_box" and loaded.scheduler.box == (-1.0, 1.0)
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(_images(loaded), images)


def test_scheduler_final_box_is_the_mode_and_options_are_checked(small_unet):
    m = 16
    totals = [-0.25 * m]
    pipe, cs = _pipeline(small_unet, "box", totals)
    images = _images(pipe)
    totals01 = torch.tensor([(t + m) / 2 for t in totals], dtype=torch.float64)
    assert float((images.sum((-2, -1)) - totals01).abs().max()) <= 1e-5 * m
    with pytest.raises(ValueError, match="final must be one of"):
        cs.final = "clip"
    with pytest.raises(ValueError, match="box"):
        cs.box = (1.0, -1.0)
    assert "final='box'" in repr(cs)


def test_box_project_is_the_mode_of_the_truncated_law():
    """box_project(x, c, v, lo, hi) == ConstrainedNormal(x, sqrt v, c).truncate(lo, hi).mode: the documented
    special case."""
    from hardeq import ConstrainedNormal

    x = torch.randn(3, 2, 4, 4, generator=gen(4), dtype=torch.float64) * 1.5
    v = torch.rand(3, 2, 4, 4, generator=gen(5), dtype=torch.float64) + 0.1
    c = channel_sum_constraint(x.shape, [4.0, -3.0], dtype=torch.float64)
    expected = box_project(x, c, v, -1.0, 1.0).reshape(3, -1)
    mode = ConstrainedNormal(x.reshape(3, -1), v.reshape(3, -1).sqrt(), constraint=c).truncate(-1.0, 1.0).mode
    torch.testing.assert_close(mode, expected, atol=1e-10, rtol=0)
