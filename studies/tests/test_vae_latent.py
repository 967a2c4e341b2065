"""The ``vae-latent`` study: constraints, the model, evaluation, and the quick preset through the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from hardeq_studies.cli import main
from hardeq_studies import available, load_study
from hardeq_studies.vae_latent.run import VAE, build_constraint, evaluate, load_config, settings


def test_discovered_under_its_hyphenated_name():
    assert "vae-latent" in available() and "vae-data" in available()
    assert load_study("vae-latent").name == "vae-latent"


def test_constraints_of_the_config():
    s = settings(load_config(), "quick")
    c_sum = build_constraint("sum", s["constraints"]["sum"], 20)
    c_dense = build_constraint("dense", s["constraints"]["dense"], 20)
    assert c_sum.num_constraints == 1 and c_dense.num_constraints == 3
    assert torch.equal(c_dense.dense_matrix(), build_constraint("dense", s["constraints"]["dense"], 20).dense_matrix())
    with pytest.raises(ValueError, match="unknown kind"):
        build_constraint("x", {"kind": "box"}, 20)


def test_evaluation_is_common_noise_and_importance_sampling_tightens():
    torch.manual_seed(0)
    c = build_constraint("dense", {"kind": "dense", "rows": 3, "seed": 1}, 20)
    model = VAE(20, [64, 32], c)
    x = torch.bernoulli(torch.rand(64, 784))
    a = evaluate(model, x, 16, seed=3, chunk=32)
    b = evaluate(model, x, 16, seed=3, chunk=32)
    assert a == b  # own RNG stream: the same noise every time
    assert a["nll"] <= a["nelbo"] + 1e-6  # log mean exp >= mean of the log-weights
    assert a["max_latent_residual"] < 1e-4


@pytest.mark.slow
def test_quick_preset_end_to_end_through_the_cli(tmp_path):
    assert main(["reproduce", "vae-latent", "--preset", "quick", "--out", str(tmp_path), "--quiet"]) == 0
    doc = json.loads((tmp_path / "vae-latent.json").read_text())
    methods = set(doc["config"]["methods_run"])
    assert {"marginal_expectation", "pathwise", "random", "unconstrained", "constrained_layer"} <= methods
    for c in ("sum", "dense"):
        recs = {(r["method"], r["metric"]): r for r in doc["records"] if r["dataset"] == c}
        for m in methods - {"unconstrained"}:
            assert recs[(m, "max_latent_residual")]["mean"] < 1e-4, (c, m)
            assert recs[(m, "nll")]["mean"] <= recs[(m, "nelbo")]["mean"] + 1e-6
    for name in ("vae-latent.md", "vae-latent.png", "vae-latent_curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert main(["report", "vae-latent", "--out", str(tmp_path), "--quiet"]) == 0


@pytest.mark.slow
def test_resume_reuses_finished_units(tmp_path):
    args = ["reproduce", "vae-latent", "--preset", "quick", "--out", str(tmp_path), "--quiet",
            "--methods", "pathwise", "unconstrained", "--constraints", "sum", "--keep-checkpoints"]
    assert main(args) == 0
    first = json.loads((tmp_path / "vae-latent.json").read_text())["records"]
    assert main([*args, "--resume"]) == 0
    again = json.loads((tmp_path / "vae-latent.json").read_text())["records"]
    assert first == again
    assert main([*args[:-1], "--epochs", "2", "--resume"]) == 2  # a checkpoint of another run is refused
