"""The ``vae-data`` study: observation variants, evaluation and the quick preset through the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from hardeq import ConstrainedNormal
from hardeq_studies.cli import main
from hardeq_studies.vae_data.models import MODELS
from hardeq_studies.vae_data.run import evaluate, load_config, observation, pixel_sum_constraint, settings, units_of


def test_observation_variants():
    c = pixel_sum_constraint(100.0)
    mean, log_var = torch.rand(4, 784), torch.full((4, 784), -3.0)
    assert isinstance(observation("ours", mean, log_var, c), ConstrainedNormal)
    cl = observation("cl", mean, log_var, c)
    assert torch.allclose(cl.mean.double().sum(-1), torch.full((4,), 100.0, dtype=torch.float64), atol=1e-3)
    assert torch.equal(cl.mean[:, :-1], mean[:, :-1])  # CL solves for the last pixel only
    unc = observation("unconstrained", mean, log_var, c)
    assert torch.equal(unc.mean, mean)
    with pytest.raises(ValueError, match="variant"):
        observation("projection", mean, log_var, c)


def test_units_restrict_the_sampled_variants_to_the_named_models():
    s = settings(load_config(), "cpu")
    units = units_of(s, ["vae", "ladder"], ["unconstrained", "ours", "ours-me"], [0, 1])
    assert ("vae", "ours-me", 0) in units and ("ladder", "ours-me", 0) not in units
    assert units[0][2] == 0 and units[-1][2] == 1  # trials outermost


def test_evaluation_reconstructions_satisfy_the_constraint():
    torch.manual_seed(0)
    model = MODELS["vae"](hidden=(32, 32, 16, 8))
    x = torch.rand(16, 784)
    x = x / x.sum(-1, keepdim=True) * 100
    c = pixel_sum_constraint(100.0)
    out = evaluate(model, "unconstrained", x, c, 8, seed=1, chunk=8, tolerance=1e-3)
    assert set(out) == {"unconstrained", "unconstrained+cond"}
    assert out["unconstrained+cond"]["violation"] == 0.0 and out["unconstrained"]["violation"] == 1.0
    assert out["unconstrained+cond"]["max_sum_deviation"] < 1e-3
    assert out["unconstrained+cond"]["ll"] >= out["unconstrained+cond"]["elbo"] - 1e-6
    again = evaluate(model, "unconstrained", x, c, 8, seed=1, chunk=8, tolerance=1e-3)
    assert again["unconstrained"]["ll"] == out["unconstrained"]["ll"]


@pytest.mark.slow
def test_quick_preset_end_to_end_through_the_cli(tmp_path):
    assert main(["reproduce", "vae-data", "--preset", "quick", "--out", str(tmp_path), "--quiet",
                 "--models", "vae", "ladder"]) == 0
    doc = json.loads((tmp_path / "vae-data.json").read_text())
    recs = {(r["dataset"], r["method"], r["metric"]): r for r in doc["records"]}
    for model in ("vae", "ladder"):
        for v in ("ours", "unconstrained+cond", "cl"):
            assert recs[(model, v, "violation")]["mean"] == 0.0
            assert recs[(model, v, "max_sum_deviation")]["mean"] < 1e-3
        assert recs[(model, "unconstrained", "violation")]["mean"] > 0.5
        assert recs[(model, "ours", "ll")]["paper"] is not None
    assert ("vae", "ours-pathwise", "ll") in recs
    for name in ("vae-data.md", "vae-data_data.png", "vae-data_reconstructions.png", "vae-data_curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert main(["report", "vae-data", "--out", str(tmp_path), "--quiet"]) == 0
