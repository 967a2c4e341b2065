"""Tests of the ``synthetic`` study (gradient estimators: bias / variance / average error).

The quick run is executed once through the CLI; the sanity facts that must hold whatever the ranking of
the estimators are checked on small dedicated problems, with tolerances derived below.
See Note [Randomized statistical tests] in tests/distributions/test_normal.py (fixed seeds,
``hardeq.testing.mc_atol`` at ``FAILURE_RATE`` per assertion).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types

import pytest
import torch

from hardeq_studies.cli import main
from hardeq.estimators import available_estimators
from hardeq_studies import available, load_study
from hardeq_studies.harness import Interrupted
from hardeq_studies.synthetic import data as SD
from hardeq_studies.synthetic import run as SR
from hardeq_studies.synthetic import task as ST

from study_test_helpers import run_or_fail
from hardeq.testing import mc_atol

S = types.SimpleNamespace(gradient_metrics=ST.gradient_metrics, ground_truth=ST.ground_truth, estimates=ST.estimates,
                          load_config=SD.load_config, _problem=SD.problem)

GAUSSIAN = sorted(set(available_estimators("normal")) | {"constrained_layer_independent"})
POISSON = ["constrained_marginal", "marginal_expectation", "random", "unconstrained_marginal"]
METRICS = ["bias", "variance", "average_error", "bias_ratio", "zero_fraction"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    assert main(["reproduce", "synthetic", "--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "synthetic.json").read_text())


# --------------------------------------------------------------------------------------------- the run
def test_registered():
    assert "synthetic" in available()
    study = load_study("synthetic")
    assert study.name == "synthetic" and study.summary and set(study.presets) == {"quick", "cpu", "paper"}


@pytest.mark.slow
def test_quick_writes_outputs(quick):
    out, doc = quick
    assert doc["study"] == "synthetic" and doc["preset"] == "quick"
    assert {"torch", "device", "git", "dirty"} <= set(doc["environment"])
    cfg = doc["config"]
    assert cfg["dtype"] == "float64" and cfg["n_sets"] >= 2 and cfg["n_estimates"] >= 100
    assert sorted(cfg["gaussian"]["estimators"]) == GAUSSIAN
    assert sorted(cfg["poisson"]["estimators"]) == POISSON
    text = (out / "synthetic.md").read_text()
    assert "hardeq reproduce synthetic --quick" in text
    for name in GAUSSIAN + POISSON:
        assert f"| {name} |" in text
    pngs = sorted(p.name for p in out.glob("synthetic_*.png"))
    assert pngs == [f"synthetic_{f}_{loss}.png" for f in ("gaussian", "poisson") for loss in ("l1", "l2")]
    assert all((out / p).stat().st_size > 10_000 for p in pngs)
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
def test_quick_records_complete(quick):
    _, doc = quick
    cfg = doc["config"]
    keys = {(r["family"], r["case"], r["loss"], r["target"], r["method"], r["metric"]) for r in doc["records"]}
    assert len(keys) == len(doc["records"])  # no duplicates
    expected = set()
    for family, names, cases, targets in (
        ("gaussian", GAUSSIAN, ("sum", "dense"), ("loc", "loc+log_scale")),
        ("poisson", POISSON, ("sum",), ("log_rate",)),
    ):
        for case in cases:
            for loss in ("l1", "l2"):
                for target in targets:
                    for name in names:
                        for metric in METRICS:
                            expected.add((family, case, loss, target, name, metric))
    assert keys == expected
    for r in doc["records"]:
        assert r["method"] == r["estimator"] and r["dataset"] == f"{r['family']}/{r['case']}"
        assert r["n_sets"] == r["n_seeds"] == cfg["n_sets"] and len(r["values"]) == cfg["n_sets"]
        assert "paper" in r and r["paper"] is None
        if r["metric"] in ("bias", "variance", "average_error", "zero_fraction"):
            assert r["n_finite"] == r["n_sets"] and math.isfinite(r["mean"]) and r["std"] >= 0
            lo, hi = 0.0, 2.0  # 1 - cos lies in [0, 2]; so its variance is <= N/(N-1)
            assert all(lo - 1e-12 <= v <= hi + 1e-12 for v in r["values"]), r


@pytest.mark.slow
def test_quick_identities(quick):
    """Facts that hold exactly, whatever the ranking: the gradient w.r.t. the means of the pathwise sample,
    of the conditional mean (marginal_expectation) and of an independent pathwise proxy are all the constant
    Jacobian (I - K A) applied to the same dl/dz, so with shared forward samples they coincide; and the
    constraint layer is affine in its input, so its shared- and independent-noise variants coincide too."""
    _, doc = quick
    idx = {(r["family"], r["case"], r["loss"], r["target"], r["method"], r["metric"]): r for r in doc["records"]}
    for case in ("sum", "dense"):
        for loss in ("l1", "l2"):
            for metric in ("bias", "variance", "average_error"):
                key = ("gaussian", case, loss, "loc")
                ref = idx[key + ("pathwise", metric)]["values"]
                for other in ("marginal_expectation", "constrained_reparam_independent"):
                    assert idx[key + (other, metric)]["values"] == pytest.approx(ref, rel=1e-8, abs=1e-12)
                assert idx[key + ("constrained_layer_independent", metric)]["values"] == pytest.approx(
                    idx[key + ("constrained_layer", metric)]["values"], rel=1e-8, abs=1e-12)


@pytest.mark.slow
def test_quick_random_reference(quick):
    """``random``: average error = mean_i(1 - cos(h_i, h_gt)) concentrates at 1 as N grows. For the ``loc``
    and ``log_rate`` targets h_i ~ N(0, I_d) is isotropic, cos has mean 0 and variance 1/d, so the per-set
    mean lies within 1 +- z / sqrt(d N); for ``loc+log_scale`` (not isotropic) the bound var(cos) <= 1 gives
    1 +- z / sqrt(N). Its cosine bias does NOT shrink with N (the direction of a mean of isotropic vectors is
    uniform for any N): only 0 <= bias <= 2 holds per set."""
    _, doc = quick
    N = doc["config"]["n_estimates"]
    z = 4.5  # two-sided ~7e-6 per set
    for r in doc["records"]:
        if r["method"] != "random":
            continue
        d = doc["config"][r["family"]]["n"]
        if r["metric"] == "average_error":
            tol = z / math.sqrt(N if r["target"] == "loc+log_scale" else d * N)
            assert all(abs(v - 1) < tol for v in r["values"]), r



def test_resume_is_bit_exact(tmp_path):
    """An interrupted run resumed from its block checkpoint gives the uninterrupted run's records."""
    config = S.load_config("quick", n_sets=2, n_estimates=20)
    full = SR.run(config)
    calls = []
    original = SR.run_block

    def flaky(*args, **kwargs):
        calls.append(args[1:4])
        if len(calls) == 3:
            raise Interrupted("simulated crash in block 3")
        return original(*args, **kwargs)

    SR.run_block = flaky
    try:
        with pytest.raises(Interrupted):
            SR.run(config, checkpoint_path=tmp_path / "ck.pt")
    finally:
        SR.run_block = original
    seen = []
    resumed = SR.run(config, checkpoint_path=tmp_path / "ck.pt", resume=True, on_block=lambda k, r: seen.append(k))
    assert seen == [SR.block_key(b) for b in SR.blocks(config)][2:]  # blocks 1 and 2 came from the checkpoint
    assert resumed == full
    with pytest.raises(ValueError, match="different run"):
        SR.run(S.load_config("quick", n_sets=3, n_estimates=20), checkpoint_path=tmp_path / "ck.pt", resume=True)


@pytest.mark.slow
def test_run_with_namespace_and_overrides(tmp_path):
    study = load_study("synthetic")
    args = argparse.Namespace(preset="quick", seeds=2, epochs=None, out=tmp_path, resume=False, estimates=50,
                              quiet=True, device=None,
                              command_line="hardeq reproduce synthetic --seeds 2 --estimates 50")
    doc = study.run(args)
    study.report(doc, tmp_path, quiet=True)
    assert doc["config"]["n_sets"] == 2 and doc["config"]["n_estimates"] == 50
    assert json.loads((tmp_path / "synthetic.json").read_text())["records"] == json.loads(json.dumps(doc["records"]))
    assert "--seeds 2 --estimates 50" in (tmp_path / "synthetic.md").read_text()
    with pytest.raises(ValueError, match="--epochs does not apply"):
        study.run(argparse.Namespace(**{**vars(args), "epochs": 3}))


@pytest.mark.slow
@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_ddp_two_processes_match_single_process(tmp_path):
    """``torchrun --nproc_per_node=2``: the blocks are shared out over the ranks and gathered; every block
    is seeded from its key, so the records equal the single-process run's exactly."""
    args = ["reproduce", "synthetic", "--quick", "--seeds", "2", "--estimates", "50", "--quiet"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "hardeq_studies",
           *args, "--out", str(tmp_path / "ddp")]
    proc = run_or_fail(cmd, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0 and "rendezvous" in proc.stderr.lower():
        pytest.skip(f"torchrun could not start its process group here: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    ddp = json.loads((tmp_path / "ddp" / "synthetic.json").read_text())
    one = json.loads((tmp_path / "one" / "synthetic.json").read_text())
    assert ddp["timing"]["world_size"] == 2
    assert ddp["records"] == one["records"]


# ------------------------------------------------------------------------------------------ metrics
def test_gradient_metrics_definitions():
    torch.manual_seed(0)
    g = torch.randn(3, 5, dtype=torch.float64)
    h = g.unsqueeze(1).expand(3, 4, 5).clone()
    m = S.gradient_metrics(h, g)
    for name in ("bias", "variance", "average_error", "bias_ratio", "zero_fraction"):
        assert torch.allclose(m[name], torch.zeros(3, dtype=torch.float64), atol=1e-12), name
    # opposite direction: bias 2, average error 2; zero estimates count as cos = 0 and are reported
    m = S.gradient_metrics(-h, g)
    assert torch.allclose(m["bias"], torch.full((3,), 2.0, dtype=torch.float64))
    assert torch.allclose(m["average_error"], torch.full((3,), 2.0, dtype=torch.float64))
    assert torch.isinf(m["bias_ratio"]).all()  # a constant, wrong estimate
    h0 = h.clone()
    h0[:, :2] = 0
    m = S.gradient_metrics(h0, g)
    assert torch.allclose(m["zero_fraction"], torch.full((3,), 0.5, dtype=torch.float64))
    assert torch.allclose(m["average_error"], torch.full((3,), 0.5, dtype=torch.float64))
    # hand-computed variance of 1 - cos(h_i, mean)
    h = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64)
    m = S.gradient_metrics(h, torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    c = 1 / math.sqrt(2)
    assert m["bias"].item() == pytest.approx(1 - c)
    assert m["average_error"].item() == pytest.approx(0.5)
    assert m["variance"].item() == pytest.approx(0.0, abs=1e-12)  # both at 45 degrees from the mean
    with pytest.raises(ValueError, match="sets, N, d"):
        S.gradient_metrics(h[0], torch.zeros(1, 2))


# --------------------------------------------------------------------------- estimators, checked directly
@pytest.mark.parametrize("case", ["sum", "dense"])
@pytest.mark.parametrize("loss", ["l1", "l2"])
def test_pathwise_mean_converges_to_ground_truth(case, loss):
    """The pathwise estimator is unbiased: with N = 10,000 its mean lies within a Monte Carlo tolerance of
    h_gt (every coordinate, both targets), and its cosine bias, which is O(1/N) for an unbiased estimator,
    shrinks markedly from N = 100 to N = 10,000 (expected factor 100; 10 required)."""
    config = S.load_config("quick")
    torch.manual_seed(1)
    problem = S._problem(config, "gaussian", case, 3, seed=123)
    truth = S.ground_truth(problem, loss)
    spec = ("pathwise", "pathwise", None)
    small = S.estimates(problem, loss, spec, 100)
    large = S.estimates(problem, loss, spec, 10_000)
    for target, h in large.items():
        mean = h.mean(1)
        atol = mc_atol(h.std(1), h.shape[1])
        assert (mean - truth[target]).abs().le(atol).all(), target
        bias_small = S.gradient_metrics(small[target], truth[target])["bias"].mean()
        bias_large = S.gradient_metrics(h, truth[target])["bias"].mean()
        assert bias_large < bias_small / 10, (target, bias_small, bias_large)
        ratio = S.gradient_metrics(h, truth[target])["bias_ratio"]
        assert ratio.mean() < 6, ratio  # about 1 when unbiased (a weighted chi-square over its mean)


def test_marginal_expectation_is_biased_for_log_scales():
    """Negative control (documents the power of the checks above): marginal_expectation's gradient w.r.t.
    the log-scales misses the variance term of the expected loss, so its mean is far outside the Monte Carlo
    tolerance around h_gt for the L2 loss, whose true log-scale gradient has the extra 2 var_bar term."""
    config = S.load_config("quick")
    torch.manual_seed(2)
    problem = S._problem(config, "gaussian", "sum", 2, seed=7)
    truth = S.ground_truth(problem, "l2")["loc+log_scale"]
    h = S.estimates(problem, "l2", ("marginal_expectation", "marginal_expectation", None), 10_000)["loc+log_scale"]
    assert not (h.mean(1) - truth).abs().le(mc_atol(h.std(1), h.shape[1])).all()
    assert (S.gradient_metrics(h, truth)["bias_ratio"] > 50).all()


def test_random_bias_centred_on_one():
    """``random``: per set, 1 - bias = cos(mean_i h_i, h_gt) with mean_i h_i isotropic in d = n dims (loc
    target), so cos has mean 0 and variance 1/d whatever N. Over S sets the mean bias is 1 +- 1/sqrt(d S):
    with S = 200, d = 10, 5 standard deviations are 0.11."""
    config = S.load_config("quick")
    torch.manual_seed(3)
    problem = S._problem(config, "gaussian", "dense", 200, seed=11)
    truth = S.ground_truth(problem, "l2")["loc"]
    h = S.estimates(problem, "l2", ("random", "random", None), 50)["loc"]
    bias = S.gradient_metrics(h, truth)["bias"]
    assert abs(bias.mean().item() - 1) < 5 / math.sqrt(10 * 200)


def test_poisson_problem_targets_are_valid():
    config = S.load_config("quick")
    problem = S._problem(config, "poisson", "sum", 5, seed=0)
    y = problem.y
    assert (y >= 0).all() and (y == y.round()).all()
    assert (y.sum(-1) == config["poisson"]["total"]).all()
    gaussian = S._problem(config, "gaussian", "dense", 5, seed=0)
    A, k = gaussian.constraint_data["A"], gaussian.constraint_data["k"]
    assert torch.allclose((A @ gaussian.y.unsqueeze(-1)).squeeze(-1), k)
    assert gaussian.y.dtype == torch.float64
