"""The bounded variants of two studies (fast parts): the clip-then-project baselines, the rules' metrics, and the
reports' "do the bounds help?" sections (absent from a document without the variant, so committed results
regenerate unchanged)."""

from __future__ import annotations

import math

import pytest
import torch

from hardeq import ConstrainedNormal, LinearConstraint
from hardeq_studies.chemical import bounds as chem
from hardeq_studies.claims import VERDICTS
from hardeq_studies.portfolio import bounds as port
from hardeq_studies.portfolio.classical import project_simplex


def test_portfolio_clip_then_project_is_long_only_and_sums_to_one():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 7, generator=g, dtype=torch.float64) * 0.4 + 1 / 7
    out = port.clip_then_project(w)
    assert bool(((out >= 0) & (out <= 1)).all())
    assert float((out.sum(-1) - 1).abs().max()) < 1e-13
    inside = ((w >= 0) & (w <= 1)).all(-1) & ((w.sum(-1) - 1).abs() < 1e-15)
    torch.testing.assert_close(out[inside], w[inside])  # feasible weights are kept
    # with only the lower bound active it is the Euclidean projection onto the simplex (Michelot's iteration)
    x = torch.tensor([[-1.0, 0.6, 0.6], [0.2, 0.3, 0.9]], dtype=torch.float64)
    ref = torch.stack([project_simplex(r) for r in x])
    torch.testing.assert_close(port.clip_then_project(x), ref)
    with pytest.raises(ValueError, match="cannot sum to"):
        port.clip_then_project(w, total=8.0)


def test_chemical_clip_then_project_keeps_the_balances_and_the_bounds():
    B = torch.tensor([[0.0, -1.0, 1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    y = torch.randn(100, 3, generator=g, dtype=torch.float64) * 0.3 + 0.2
    k = torch.stack([y[:, 2] - y[:, 1], -y[:, 0] - y[:, 1]], -1).abs() * torch.tensor([1.0, -1.0],
                                                                                        dtype=torch.float64)
    lower = chem.lower_bounds([0, 0, 0], 3)
    out = chem.clip_then_project(y, B, k, lower)
    feasible = (chem.clip_then_project(out, B, k, lower) - out).abs().max()
    assert bool((out >= 0).all()) and float(feasible) < 1e-9
    assert float((out @ B.T - k).abs().max()) < 1e-10
    assert torch.equal(chem.lower_bounds([0, None], 2), torch.tensor([0.0, -math.inf], dtype=torch.float64))
    with pytest.raises(ValueError, match="expected 3 lower bounds"):
        chem.lower_bounds([0, 0], 3)


def test_chemical_rules_on_a_small_law():
    """Every rule meets the balances; the bounded ones keep the flows >= 0; the untruncated mean may not."""
    B = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    k = torch.tensor([[1.0], [0.5]], dtype=torch.float64)
    loc = torch.tensor([[1.2, -0.3, 0.1], [0.3, 0.3, -0.1]], dtype=torch.float64)
    dist = ConstrainedNormal(loc, 0.2, constraint=LinearConstraint(B, k))
    lower = chem.lower_bounds([0, 0, None], 3)
    preds, sampler = chem.nonnegative_rules(dist, lower, B, k, draws=8, chains=2, burn_in=5, seed=0)
    assert sampler["method"] in ("rejection", "gibbs") and sampler["min_ess"] > 0
    y = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.2, 0.1]], dtype=torch.float64)
    stats = chem.evaluate_rules(preds, y, B, k, lower)
    assert stats["untruncated"]["negative_share"] > 0
    for rule in chem.RULES:
        assert stats[rule]["max_balance_residual"] < 1e-9, rule
        if rule != "untruncated":
            assert stats[rule]["negative_share"] == 0.0, rule


def _portfolio_doc(sharpe_mean):
    per_run = {rule: {k: [0.0] * 6 for k in port.METRICS} for rule in port.RULES}
    for rule in port.RULES:
        per_run[rule]["test_sharpe"] = [1.0 + 0.01 * i for i in range(6)]
    per_run["ours truncated mean"]["test_sharpe"] = [sharpe_mean + 0.01 * i for i in range(6)]
    units = {("ours", r): {"long_only": {rule: {k: per_run[rule][k][r] for k in port.METRICS}
                                         for rule in port.RULES},
                           "long_only_sampler": {"method": "gibbs" if r else "rejection",
                                                 "min_ess": 40.0 + r if r else 128.0,
                                                 "max_rhat": 1.01 + 0.01 * r if r else None}}
             for r in range(6)}
    part = port.summarise({"units": units}, list(range(6)), "u")
    return {"long_only": {"u": part}, "config": {"long_only": {"draws": 4, "chains": 2, "burn_in": 5}}}


def test_portfolio_bounds_section_decides_with_the_claims_vocabulary():
    doc = _portfolio_doc(1.5)  # the truncated mean better in all 6 runs: Wilcoxon p = 2 / 2^6 = 0.03
    text = "\n".join(port.markdown(doc))
    assert "## Long-only variant: do the bounds help?" in text and "not claims of the paper" in text
    rows = [line for line in text.splitlines() if line.startswith("| u: ")]
    assert len(rows) == 3
    verdicts = [row.rstrip(" |").rsplit(" | ", 1)[1] for row in rows]
    assert all(any(v.startswith(w) for w in VERDICTS) for v in verdicts)
    assert verdicts[0].startswith("undecided")  # p = 0.031 raw, Holm over 3 tests: 0.094
    assert port.markdown({"config": {}}) == []  # a document without the variant: nothing added
    assert ("- u: the truncated mean was sampled by blocked Gibbs in 5/6 runs, rejection in 1/6 runs (smallest "
            "effective sample size 41.0; largest split R-hat 1.060, over every window and weight).") in text
    assert "2 blocked-Gibbs chains from the mode, each after 5 sweeps" in text
    recs = doc["long_only"]["u"]["records"]
    assert {r["method"] for r in recs} == {f"long-only: {r}" for r in port.RULES}


def test_chemical_bounds_section_and_records():
    per_seed = {"cstr": {"ours-NLL": {rule: {"test_mse": [0.1, 0.2, 0.3], "negative_share": [0.0] * 3,
                                             "max_balance_residual": [1e-15] * 3} for rule in chem.RULES}}}
    per_seed["cstr"]["ours-NLL"]["truncated mean"]["test_mse"] = [0.05, 0.1, 0.2]
    per_seed["cstr"]["ours-NLL"]["sampler"] = [{"method": "gibbs", "min_ess": 30.5 + i, "max_rhat": 1.02}
                                               for i in range(3)]
    part = chem.summarise(per_seed["cstr"], "cstr")
    assert all(r["paper"] is None and r["variant"] == "nonnegative flows" for r in part["records"])
    doc = {"nonnegative_flows": {"config": {"draws": 4, "burn_in": 5, "lower": {"cstr": [0, 0, 0]}},
                                 "per_seed": per_seed, "significance": {"cstr": part["significance"]}}}
    text = "\n".join(chem.markdown(doc))
    assert "## Non-negative flows: do the bounds help?" in text and "cstr [1, 2, 3]" in text
    assert "lower in 3/3 seeds" in text
    assert ("- cstr, ours-NLL: the truncated mean was sampled by blocked Gibbs in 3/3 seeds (smallest effective "
            "sample size 30.5; largest split R-hat 1.020, over every test point and flow).") in text
    assert "- Split R-hat compares chains of only a few draws each" in text
    assert chem.markdown({}) == []


# ------------------------------------------------------------------ the networks trained through the bounds
def test_portfolio_trained_rules_enter_the_table_and_the_family():
    """With a :data:`port.TRAINED` unit per run the table gains its two rules and the family its two claims (paired
    by run with ours's rules); without it (a committed document) nothing changes."""
    base = _portfolio_doc(1.5)["long_only"]["u"]
    assert set(base["per_run"]) == set(port.RULES) and len(base["significance"]) == 3
    units = {("ours", r): {"long_only": {rule: {k: base["per_run"][rule][k][r] for k in port.METRICS}
                                         for rule in port.RULES}} for r in range(6)}
    for r in range(6):  # the trained network's own rules: its truncated mean better than ours's in every run
        units[(port.TRAINED, r)] = {"long_only": {rule: {k: (2.0 + 0.01 * r if k == "test_sharpe" else 0.0)
                                                         for k in port.METRICS} for rule in port.RULES},
                                    "best_epoch": 3, "val_sharpe": 1.0, "seconds": 10.0 + r}
    part = port.summarise({"units": units}, list(range(6)), "u")
    assert set(part["per_run"]) == set(port.RULES) | set(port.TRAINED_RULES)
    assert len(part["significance"]) == 5 and part["trained"]["best_epoch"] == [3] * 6
    doc = {"long_only": {"u": part}, "config": {"long_only": {"draws": 4, "chains": 2, "burn_in": 5,
                                                              "trained": {"chains": 4, "sweeps": 4}}}}
    text = "\n".join(port.markdown(doc))
    rows = [line for line in text.splitlines() if line.startswith("| u: ")]
    assert len(rows) == 5 and sum("training through the bounds" in row for row in rows) == 2
    assert "| u | ours-truncated truncated mean | 2.025 ± 0.019 |" in text
    assert "(4 chains x 4 sweeps per step" in text and "Training time per run: u 12 s (selected epochs 3" in text


def test_portfolio_targets_and_truncated_nll():
    """The targets are long-only and sum to one; the training loss is the truncated law's unnormalised NLL (its value
    the untruncated log-density's), differentiable, advancing the persistent chains."""
    from hardeq_studies.portfolio.task import WeightHead

    gen = torch.Generator().manual_seed(0)
    returns = 0.01 * torch.randn(4, 30, 6, generator=gen) + 0.001
    y = port.long_only_targets(returns, rf=0.03, days=252)
    assert y.shape == (4, 6) and bool((y >= 0).all() and (y <= 1).all())
    assert float((y.sum(-1) - 1).abs().max()) < 1e-12
    head = WeightHead("ours", 6)
    raw = torch.randn(4, 6, 2, generator=gen, dtype=torch.float64).requires_grad_()
    state = {"num_chains": 2, "sweeps": 2}
    loss = port.truncated_nll(head, raw, y, state)
    chains = state["chains"]
    assert (chains.chains, chains.sweeps) == (2, 2)
    expected = -head.distribution(raw.detach()).log_prob(y).mean() / 6
    torch.testing.assert_close(loss.detach(), expected)
    loss.backward()
    assert bool(torch.isfinite(raw.grad).all()) and float(raw.grad.abs().sum()) > 0 and chains.steps == 1
    mode = port.truncated_mode_weights(head, raw.detach())
    assert bool((mode >= 0).all()) and float((mode.sum(-1) - 1).abs().max()) < 1e-12


def test_chemical_trained_claims_pair_the_two_networks():
    rules = {rule: {"test_mse": [0.1, 0.2, 0.3], "negative_share": [0.0] * 3, "max_balance_residual": [1e-15] * 3}
             for rule in chem.RULES}
    trained = {rule: {**v, "test_mse": [0.05, 0.1, 0.2]} for rule, v in rules.items()}
    part_seed = {"ours-NLL": rules, "ours-tNLL": trained}
    part = chem.summarise(part_seed, "cstr")
    assert len(part["significance"]) == 3 + 3 + 2
    doc = {"nonnegative_flows": {"config": {"draws": 4, "burn_in": 5, "lower": {"cstr": [0, 0, 0]}},
                                 "per_seed": {"cstr": part_seed}, "significance": {"cstr": part["significance"]}}}
    claims = chem.claims(doc)
    trained_rows = [c for c in claims if "training through the bounds" in c.claim]
    assert len(trained_rows) == 2 and all("lower in 3/3 seeds" in c.here for c in trained_rows)
    assert "`ours-tNLL` is trained *through* the bounds" in "\n".join(chem.markdown(doc))


def test_chemical_task_trains_through_the_truncation():
    from hardeq_studies.chemical.data import load_config
    from hardeq_studies.chemical.models import build_model
    from hardeq_studies.chemical.run import make_task
    from hardeq_studies.chemical.task import ChemicalTask

    config = load_config()
    data, task = make_task("plant", config, ["ours-NLL", "ours-tNLL"], 2, torch.float64, torch.device("cpu"))
    assert task.lower is not None and bool((task.lower == 0).all())
    model = build_model(task, data.x.shape[1], [0, 1], config["model"], dtype=torch.float64, device="cpu")
    tr = data.tensors("train", torch.float64)
    batch = {"x": tr["x"][:8], "y": tr["y"][:8].expand(task.num_members, 8, -1)}
    loss, _ = task.loss(model(batch["x"]), batch)
    assert loss.shape == (4, 8) and bool(torch.isfinite(loss).all())
    loss.mean(-1).sum().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    assert task.chains.steps == 1 and (task.chains.chains, task.chains.sweeps) == (4, 4)
    with pytest.raises(ValueError, match="needs the lower bounds"):
        ChemicalTask(data, ["ours-tNLL"], 2, pinn_weight=1.0, ecnn_dependent=[0], dtype=torch.float64)
