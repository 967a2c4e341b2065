"""The ``vae-data`` study: observation variants, evaluation and the quick preset through the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from hardeq import ConstrainedNormal
from hardeq_studies.cli import main
from hardeq_studies.vae_data.models import MODELS
from hardeq_studies.vae_data import run as run_mod
from hardeq_studies.vae_data.report import summarise
from hardeq_studies.vae_data.run import (FROZEN_VARIANCE, SAMPLED, _reconstruction_loss, cl_order, cl_pixel, evaluate,
                                         load_config, model_epochs, observation, pixel_sum_constraint,
                                         reconstruction_rl, settings, training_loss, units_of)


def test_observation_variants():
    c = pixel_sum_constraint(100.0)
    mean, log_var = torch.rand(4, 784), torch.full((4, 784), -3.0)
    assert isinstance(observation("ours", mean, log_var, c), ConstrainedNormal)
    assert isinstance(observation("cl+cond", mean, log_var, c), ConstrainedNormal)
    for v in ("cl", "cl-se"):
        cl = observation(v, mean, log_var, c, cl_order(300))
        assert torch.allclose(cl.mean.double().sum(-1), torch.full((4,), 100.0, dtype=torch.float64), atol=1e-3)
        keep = torch.ones(784, dtype=torch.bool)
        keep[300] = False
        assert torch.equal(cl.mean[:, keep], mean[:, keep])  # CL solves for the named pixel only
    for v in ("unconstrained", "unconstrained-se"):
        assert torch.equal(observation(v, mean, log_var, c).mean, mean)
    with pytest.raises(ValueError, match="variant"):
        observation("projection", mean, log_var, c)
    with pytest.raises(ValueError, match="pixel"):
        cl_order(784)


def test_cl_pixel_is_the_most_variable_training_pixel():
    x = torch.zeros(10, 784)
    x[:, 7] = torch.linspace(0, 1, 10)
    x[:, 500] = torch.linspace(0, 0.5, 10)
    assert cl_pixel(x) == 7
    assert cl_order(7)[-1] == 7 and sorted(cl_order(7).tolist()) == list(range(784))
    with pytest.raises(ValueError, match="train_x"):
        cl_pixel(x[0])


def test_sampled_losses_use_constrained_samples_and_reach_the_parameters():
    torch.manual_seed(0)
    c, order = pixel_sum_constraint(100.0), cl_order(10)
    x = torch.rand(3, 784)
    x = x / x.sum(-1, keepdim=True) * 100
    for v in SAMPLED:
        mean = torch.rand(3, 784, requires_grad=True)
        log_var = torch.full((3, 784), -2.0, requires_grad=True)
        loss = _reconstruction_loss(v, observation(v, mean, log_var, c, order), x, c, order)
        assert loss.shape == (3,) and bool(torch.isfinite(loss).all())
        loss.sum().backward()
        assert mean.grad.abs().sum() > 0, v
    # the plain reparameterised sample: E[1/2 ||x~ - x||^2] = 1/2 ||m - x||^2 + 1/2 sum sigma^2
    mean, log_var = torch.rand(1, 784), torch.full((1, 784), -4.0)
    p = observation("unconstrained-se", mean.expand(4000, 784), log_var.expand(4000, 784), c)
    est = _reconstruction_loss("unconstrained-se", p, x[:1], c, None).mean()
    exact = 0.5 * (mean - x[:1]).square().sum() + 0.5 * 784 * torch.exp(torch.tensor(-4.0))
    assert abs(float(est - exact)) < 0.05 * float(exact)


def test_marginal_expectation_leaves_a_shared_variance_untrained():
    """With one variance for all pixels the conditional mean (ME's proxy) does not depend on it: zero gradient;
    pathwise and the plain reparameterised sample feel their noise and push the variance down."""
    torch.manual_seed(0)
    c = pixel_sum_constraint(100.0)
    x = torch.rand(4, 784)
    x = x / x.sum(-1, keepdim=True) * 100
    mean = torch.rand(4, 784)
    for v, zero in (("ours-me", True), ("ours-pathwise", False), ("unconstrained-se", False)):
        nu = torch.zeros(1, requires_grad=True)
        _reconstruction_loss(v, observation(v, mean, nu.expand(4, 784), c), x, c, None).sum().backward()
        assert (abs(float(nu.grad)) < 1e-3) == zero and (zero or float(nu.grad) > 100), (v, float(nu.grad))


def test_homoscedastic_observation_has_one_variance():
    torch.manual_seed(0)
    model = MODELS["vae"](hidden=(32, 32, 16, 8), observation="homoscedastic")
    mean, log_var, kl = model(torch.rand(5, 784))
    assert log_var.shape == (5, 784) and bool((log_var == log_var[0, 0]).all())
    assert abs(float(log_var[0, 0].detach())) < 1e-2  # unit variance at initialisation
    assert sum(p.numel() for p in model.decoder.parameters()) < sum(
        p.numel() for p in MODELS["vae"](hidden=(32, 32, 16, 8)).decoder.parameters()) - 784 * 784
    with pytest.raises(ValueError, match="observation"):
        MODELS["vae"](hidden=(32, 32, 16, 8), observation="full")


def test_units_restrict_the_sampled_variants_to_the_named_models():
    s = settings(load_config(), "cpu")
    units = units_of(s, ["vae", "ladder"], ["unconstrained", "ours", "ours-me", "cl-se"], [0, 1])
    assert ("vae", "ours-me", 0) in units and ("ladder", "ours-me", 0) not in units
    assert ("vae", "cl-se", 1) in units and ("ladder", "cl-se", 1) not in units
    assert units[0][2] == 0 and units[-1][2] == 1  # trials outermost


def test_evaluation_reconstructions_satisfy_the_constraint():
    torch.manual_seed(0)
    model = MODELS["vae"](hidden=(32, 32, 16, 8))
    x = torch.rand(16, 784)
    x = x / x.sum(-1, keepdim=True) * 100
    c = pixel_sum_constraint(100.0)
    out = evaluate(model, "unconstrained", x, c, 8, seed=1, chunk=8, tolerance=1e-3)
    assert set(out) == {"unconstrained", "unconstrained+cond"}
    assert set(evaluate(model, "ours-me", x, c, 2, seed=1, chunk=8, tolerance=1e-3)) == {"ours-me"}
    cl = evaluate(model, "cl-se", x, c, 2, seed=1, chunk=8, tolerance=1e-3, order=cl_order(3))
    assert set(cl) == {"cl-se", "cl-se+cond"} and cl["cl-se"]["rl"] == cl["cl-se+cond"]["rl"]  # CL(m) is on the plane
    assert out["unconstrained+cond"]["violation"] == 0.0 and out["unconstrained"]["violation"] == 1.0
    assert out["unconstrained+cond"]["max_sum_deviation"] < 1e-3
    for v in out:
        assert out[v]["ll"] >= out[v]["elbo"] - 1e-6 and out[v]["ll_unit"] >= out[v]["elbo_unit"] - 1e-6
    # one shared variance: conditioning is the orthogonal projection onto the plane, which x lies on (Pythagoras)
    homo = MODELS["vae"](hidden=(32, 32, 16, 8), observation="homoscedastic")
    both = evaluate(homo, "unconstrained", x, c, 8, seed=1, chunk=8, tolerance=1e-3)
    assert both["unconstrained+cond"]["rl"] < both["unconstrained"]["rl"]
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
    assert ("vae", "ours-pathwise", "ll") in recs and ("vae", "unconstrained-se-frozenvar+cond", "rl") in recs
    gaps = set(doc["test_curves"]["vae"]["gaps"])
    assert gaps >= {"ours-me - unconstrained-se", "ours-me - unconstrained-se-frozenvar"}
    md = (tmp_path / "vae-data.md").read_text()
    assert "## Does the gap still move? (test RL per epoch)" in md
    assert "nan" not in md  # one trial: the paired tests have no p, shown as "-"
    for name in ("vae-data.md", "vae-data_data.png", "vae-data_reconstructions.png", "vae-data_curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert main(["report", "vae-data", "--out", str(tmp_path), "--quiet"]) == 0


def _quick_run(tmp_path, name, resume=False):
    s = settings(load_config(), "quick")
    return run_mod.run(s, [0, 1], 1, models=["vae"], variants=["unconstrained", "cl-se", "ours-me"],
                       checkpoint_path=tmp_path / name, resume=resume, progress=False)


def test_resume_after_an_interruption_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """A quick run stopped after 4 of its 6 units and resumed gives the uninterrupted run's records."""
    config = load_config()
    full = summarise(_quick_run(tmp_path, "a.pt"), config)
    real, calls = run_mod.run_unit, []

    def crash_after_four(*args, **kw):
        if len(calls) == 4:
            raise KeyboardInterrupt("simulated interruption")
        calls.append(args[1:4])
        return real(*args, **kw)

    monkeypatch.setattr(run_mod, "run_unit", crash_after_four)
    with pytest.raises(KeyboardInterrupt):
        _quick_run(tmp_path, "b.pt")
    monkeypatch.setattr(run_mod, "run_unit", lambda *a, **k: calls.append(a[1:4]) or real(*a, **k))
    resumed = summarise(_quick_run(tmp_path, "b.pt", resume=True), config)
    assert calls[4:] == [("vae", "cl-se", 1), ("vae", "ours-me", 1)]  # only the two missing units ran again
    assert resumed["records"] == full["records"] and resumed["per_trial"] == full["per_trial"]
    assert resumed["curves"] == full["curves"]


def test_verdicts_come_from_the_paired_tests_either_way():
    from hardeq_studies.claims import decide
    from hardeq_studies.stats import paired_ttest
    from hardeq_studies.vae_data.report import CLAIMS, claims

    better, worse = paired_ttest([3.0, 3.1, 2.9], [1.0, 1.0, 1.1]), paired_ttest([1.0, 1.0, 1.1], [3.0, 3.1, 2.9])
    noise = paired_ttest([1.0, 2.0, 0.5], [1.5, 0.9, 1.2])

    def doc(t):
        sig = [{"dataset": "vae", "a": a, "b": b, "metric": k, "ttest": t} for _, _, a, b, k in CLAIMS[:1]]
        return {"config": {"trials": [0, 1, 2], "epochs": 10, "paper": {"values": {}, "columns": [],
                                                                         "seconds_per_epoch": {}}},
                "records": [], "significance": sig, "timing": {"ratio_ours_to_unconstrained": {}}}

    def one(t):
        return decide(claims(doc(t), "vae"))[0].verdict

    assert one(better).startswith("reproduced (paired t, n = 3)")  # LL: higher is better
    # against the paper with 3 trials of 10 epochs: not reproduced at this budget, never refuted
    assert one(worse).startswith("not reproduced at this budget (paired t, n = 3; significant the other way, but "
                                 "3 trial(s) (a paired t-test with 2 degree(s) of freedom) of 10 epoch(s)")
    assert one(noise).startswith("undecided (paired t, n = 3; 3 trial(s) of 10 epoch(s)")


def test_frozen_variance_variants_isolate_the_variance_effect():
    """With one shared observation variance: the frozen-variance variants give the variance no gradient, and
    ``ours-pathwise-frozenvar`` takes Marginal Expectation's gradient for the decoder's mean exactly (the
    conditional mean, ME's proxy, does not depend on the variance), from the same forward sample; the learned-
    variance ``ours-pathwise`` does push the variance (a check that the comparison can fail)."""
    c = pixel_sum_constraint(100.0)
    x = torch.rand(4, 784)
    x = x / x.sum(-1, keepdim=True) * 100
    assert set(FROZEN_VARIANCE) <= set(SAMPLED)

    def grads(variant):
        mean = torch.rand(4, 784, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        nu = torch.zeros(1, requires_grad=True)
        torch.manual_seed(7)  # the same forward sample for every variant
        training_loss(variant, mean, nu.expand(4, 784), x, c, None).sum().backward()
        return mean.grad, nu.grad

    g_me, nu_me = grads("ours-me")
    g_fz, nu_fz = grads("ours-pathwise-frozenvar")
    torch.testing.assert_close(g_fz, g_me, rtol=1e-5, atol=1e-5)
    assert nu_fz is None and (nu_me is None or abs(float(nu_me)) < 1e-3)
    _, nu_pw = grads("ours-pathwise")
    assert nu_pw is not None and float(nu_pw) > 100
    g_se, nu_se = grads("unconstrained-se")
    g_sefz, nu_sefz = grads("unconstrained-se-frozenvar")
    torch.testing.assert_close(g_sefz, g_se)  # the same sample; only the variance's gradient is cut
    assert nu_sefz is None and float(nu_se) > 100


def test_cpu_preset_runs_three_models_with_their_own_epochs():
    """The cpu preset: 5 trials; the VAE with every variant for the run's epochs, the Ladder and Graph VAEs with
    the likelihood-trained variants for ``model_epochs``; a bad ``model_epochs`` entry is refused."""
    s = settings(load_config(), "cpu")
    units = units_of(s, s["models"], list(run_mod.VARIANTS), list(range(s["seeds"])))
    assert len(units) == 5 * (len(run_mod.VARIANTS) + 2 * len(run_mod.LIKELIHOOD)) == 75
    assert {v for m, v, _ in units if m != "vae"} == set(run_mod.LIKELIHOOD)
    assert model_epochs(s, "vae", s["epochs"]) == 10
    assert model_epochs(s, "ladder", 10) == 4 == model_epochs(s, "graph", 10)
    with pytest.raises(ValueError, match="model_epochs"):
        model_epochs({"model_epochs": {"vae": 0}}, "vae", 3)


def test_reconstruction_rl_is_the_evaluation_rl_with_one_latent_sample():
    """The per-epoch curve's RL equals :func:`evaluate`'s RL at K = 1 with the same generator seed and chunks
    (an independent code path: the curve would drift from the final table otherwise)."""
    torch.manual_seed(0)
    model = MODELS["vae"](hidden=(32, 32, 16, 8), observation="homoscedastic")
    x = torch.rand(12, 784)
    x = x / x.sum(-1, keepdim=True) * 100
    c = pixel_sum_constraint(100.0)
    for v in ("ours-me", "unconstrained"):
        want = evaluate(model, v, x, c, 1, seed=3, chunk=5, tolerance=1e-3)[v]["rl"]
        assert abs(reconstruction_rl(model, v, x, c, 3, 5) - want) < 1e-4 * max(1.0, abs(want))
    assert model.training  # train mode restored
