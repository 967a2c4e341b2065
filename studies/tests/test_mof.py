"""Study ``mof``: data, splits, neutrality of every method, the NLLs against dense per-graph references, the
training losses, and ``hardeq reproduce mof --preset quick`` end to end (needs ``hardeq-studies[graphs]``)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from hardeq_studies.cli import main
from hardeq.nn import per_graph_log_prob
from hardeq_studies.mof.data import element_means, load_graphs, make_split
from hardeq_studies.mof.metrics import (METHODS, ensemble_nll_moment, ensemble_nll_paper, gsum, mixture_nll, predict,
                                        single_nll)
from hardeq_studies.mof.task import MofTask

SIZES = [4, 9, 2, 13, 6]


def _ragged(seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    N, G = len(batch), len(SIZES)
    d = torch.float64
    mu = [torch.randn(N, generator=g, dtype=d) for _ in range(2)]
    var = [torch.rand(N, generator=g, dtype=d) + 0.05 for _ in range(2)]
    y = torch.randn(N, generator=g, dtype=d)
    y = y - (gsum(y, batch, G) / torch.tensor(SIZES, dtype=d))[batch]
    return batch, G, mu, var, y


# ------------------------------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def data():
    return load_graphs()


def test_graphs_load_with_neutral_labels(data):
    f = data.facts
    assert (f["num_graphs"], f["num_atoms"], f["num_bonds"]) == (2266, 334103, 399032)
    assert 0 < f["max_abs_charge_sum"] <= 3.2e-5 + 1e-12  # the file's precision (SOURCE.md)
    g = data.graphs[0]
    assert g.x.shape == (g.num_nodes, 74) and bool((g.x.sum(1) == 1).all())
    assert g.edge_index.shape[1] % 2 == 0  # both directions of every bond
    sums = torch.stack([gr.y.sum() for gr in data.graphs])
    assert float(sums.abs().max()) < 1e-13  # projected onto the plane


def test_splits_follow_the_rule_and_do_not_depend_on_how_many_are_drawn(data):
    s1 = make_split(data, 1)
    assert (len(s1["train"]), len(s1["val"]), len(s1["test"])) == (1586, 226, 454)
    assert len(set(s1["train"]) | set(s1["val"]) | set(s1["test"])) == 2266
    seen = set(torch.cat([data.graphs[i].atom_type for i in s1["train"]]).tolist())
    assert set(torch.cat([data.graphs[i].atom_type for i in s1["test"]]).tolist()) <= seen
    assert make_split(data, 1) == s1 and make_split(data, 0)["test"] != s1["test"]
    mean, var = element_means([data.graphs[i] for i in s1["train"]], 1e-6)
    assert mean.shape == var.shape == (74,) and bool((var >= 1e-6).all())


# ---------------------------------------------------------------------------------- methods and metrics
@pytest.mark.parametrize("method", METHODS)
def test_every_method_predicts_neutral_graphs(method):
    batch, G, mu, var, _ = _ragged()
    p = predict(method, 5 + 3 * mu[0], var[0], batch, G)  # far from neutral before the correction
    assert float(gsum(p, batch, G).abs().max()) < 1e-12


def test_methods_differ_as_documented():
    batch, G, mu, var, _ = _ragged()
    last = torch.tensor(SIZES).cumsum(0) - 1
    cl = predict("CL", mu[0], var[0], batch, G)
    keep = torch.ones_like(cl, dtype=torch.bool)
    keep[last] = False
    torch.testing.assert_close(cl[keep], mu[0][keep])  # CL: every atom but the last one of each graph is kept
    kkt = predict("KKT", mu[0], var[0], batch, G)
    counts = torch.tensor(SIZES, dtype=mu[0].dtype)
    torch.testing.assert_close(kkt, mu[0] - (gsum(mu[0], batch, G) / counts)[batch])  # uniform correction
    vw = predict("variance", mu[0], var[0], batch, G)
    torch.testing.assert_close(vw, mu[0] - var[0] * (gsum(mu[0], batch, G) / gsum(var[0], batch, G))[batch])


def _dense_nll(center, cov, y):
    return -torch.distributions.MultivariateNormal(center[:-1], cov[:-1, :-1]).log_prob(y[:-1])


def _condcov(v):
    return torch.diag(v) - torch.outer(v, v) / v.sum()


def test_nlls_match_dense_per_graph_references():
    """The ICML code's evaluation: MultivariateNormal on the first n - 1 atoms of each graph."""
    batch, G, mu, var, y = _ragged(1)
    p1 = predict("variance", mu[0], var[0], batch, G)
    p2 = predict("KKT", mu[1], var[1], batch, G)
    one, paper, moment = [], [], []
    for g in range(G):
        m = batch == g
        C1, C2 = _condcov(var[0][m]), _condcov(var[1][m])
        d = p1[m] - p2[m]
        one.append(_dense_nll(p1[m], C1, y[m]))
        paper.append(_dense_nll((p1[m] + p2[m]) / 2, (C1 + C2) / 4, y[m]))
        moment.append(_dense_nll((p1[m] + p2[m]) / 2, (C1 + C2) / 2 + torch.outer(d, d) / 4, y[m]))
    n1 = single_nll(p1, var[0], y, batch, G)
    torch.testing.assert_close(n1, torch.stack(one))
    torch.testing.assert_close(ensemble_nll_paper(p1, var[0], p2, var[1], y, batch, G), torch.stack(paper))
    torch.testing.assert_close(ensemble_nll_moment(p1, var[0], p2, var[1], y, batch, G), torch.stack(moment))
    # convention: the first n - 1 coordinates = density on the plane times sqrt(n)
    n = torch.tensor(SIZES, dtype=y.dtype)
    torch.testing.assert_close(n1, -per_graph_log_prob(mu[0], var[0], batch, y) - 0.5 * n.log())
    n2 = single_nll(p2, var[1], y, batch, G)
    torch.testing.assert_close(mixture_nll(n1, n2), -torch.log(0.5 * torch.exp(-n1) + 0.5 * torch.exp(-n2)))


def test_ensemble_covariances_by_monte_carlo():
    """(S1 + S2)/4 is the covariance of the average of two *independent* draws; the equal mixture has
    (S1 + S2)/2 + d d^T/4 -- twice as wide, plus the disagreement of the means."""
    g = torch.Generator().manual_seed(0)
    v1, v2 = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64), torch.tensor([1.5, 0.2, 0.7], dtype=torch.float64)
    m1, m2 = torch.tensor([0.3, -0.1, -0.2], dtype=torch.float64), torch.tensor([-0.4, 0.5, -0.1], dtype=torch.float64)
    S1, S2 = _condcov(v1), _condcov(v2)
    L1, L2 = torch.linalg.cholesky(S1 + 1e-12 * torch.eye(3)), torch.linalg.cholesky(S2 + 1e-12 * torch.eye(3))
    K = 400_000
    x1 = m1 + torch.randn(K, 3, generator=g, dtype=torch.float64) @ L1.T
    x2 = m2 + torch.randn(K, 3, generator=g, dtype=torch.float64) @ L2.T
    torch.testing.assert_close(torch.cov(((x1 + x2) / 2).T), (S1 + S2) / 4, atol=0.01, rtol=0)
    pick = torch.rand(K, generator=g) < 0.5
    mix = torch.where(pick[:, None], x1, x2)
    d = m1 - m2
    torch.testing.assert_close(torch.cov(mix.T), (S1 + S2) / 2 + torch.outer(d, d) / 4, atol=0.02, rtol=0)


def test_training_losses():
    """closed-form: the per-atom expected L1; likelihood: the exact per-graph NLL, summed and spread over atoms."""
    batch, G, mu, var, y = _ragged(2)

    class B:  # the fields of a PyG Batch the task reads
        pass

    b = B()
    b.y, b.batch, b.num_graphs = y, batch, G
    out = torch.stack([torch.stack([mu[i], var[i]], -1) for i in range(2)] * 2)
    task = MofTask(["closed-form", "likelihood", "KKT", "variance"])
    loss, extra = task.loss(out, b)
    assert loss.shape == extra["mad"].shape == (4, len(y))
    s = var[0].sqrt()
    dm = predict("closed-form", mu[0], var[0], batch, G) - y
    cvar = var[0] - var[0] ** 2 / gsum(var[0], batch, G)[batch]
    el1 = cvar.sqrt() * math.sqrt(2 / math.pi) * torch.exp(-dm**2 / (2 * cvar)) + dm * torch.erf(dm / (2 * cvar).sqrt())
    assert s.shape == el1.shape
    torch.testing.assert_close(loss[0], el1)
    torch.testing.assert_close(loss[1].sum(), -per_graph_log_prob(mu[1], var[1], batch, y).sum())
    torch.testing.assert_close(loss[2], (predict("KKT", mu[0], var[0], batch, G) - y).abs())
    metrics = task.metrics(out, b)
    assert set(metrics) == {"mad", "nll", "log_var"} and metrics["mad"].shape == (4,)
    with pytest.raises(ValueError, match="unknown methods"):
        MofTask(["L2"])


# ------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_reproduce_quick_end_to_end_and_resume(tmp_path):
    out, ck = tmp_path / "out", tmp_path / "ck"
    args = ["reproduce", "mof", "--preset", "quick", "--out", str(out), "--checkpoint-dir", str(ck), "--quiet"]
    assert main(args + ["--keep-checkpoints"]) == 0
    doc = json.loads((out / "mof.json").read_text())
    for name in ("mof.md", "mof_curves.png", "mof_parity.png", "mof.curves.json"):
        assert (out / name).exists(), name
    methods = {r["method"] for r in doc["records"]}
    assert {"Constant", "Element-mean variance", "KKT", "CL", "closed-form", "likelihood",
            "likelihood ensemble", "variance ensemble"} <= methods
    assert doc["max_abs_prediction_sum"] < 1e-10  # every prediction of every method is neutral
    assert all(math.isfinite(r["mean"]) for r in doc["records"] if r["metric"] == "mad")
    md = (out / "mof.md").read_text()
    for heading in ("## Test MAD and NLL (paper Table 5)", "## Claims of the paper", "## Training budget",
                    "## Paired two-sided Wilcoxon"):
        assert heading in md, heading
    # every model of every method took the same optimiser steps (the quick preset's 2; none stops earlier)
    assert {x for v in doc["optimizer_steps"].values() for x in v} == {2}
    assert len(doc["optimizer_steps"]) == 6 and {t["n"] for t in doc["significance"]} == {2}  # 2 splits x 3 groups
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in md.split("## Claims of the paper")[1].split("##")[0]
                .splitlines() if line.startswith("| ") and "verdict" not in line]
    assert len(verdicts) == len(doc["config"]["claims"])
    from hardeq_studies.claims import REFUTED, VERDICTS

    assert all(v.startswith(VERDICTS) and not v.startswith(REFUTED) for v in verdicts)
    # --resume finds every unit finished and reproduces the same numbers without training
    assert main(args + ["--resume"]) == 0
    doc2 = json.loads((out / "mof.json").read_text())
    assert [r["mean"] for r in doc2["records"]] == [r["mean"] for r in doc["records"]]
    assert not list(ck.glob("mof-*.pt"))  # removed after a completed run without --keep-checkpoints


def test_missing_pyg_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_geometric", None)  # import torch_geometric now raises ImportError
    assert main(["reproduce", "mof", "--preset", "quick", "--out", str(tmp_path)]) == 2
    assert 'pip install "hardeq-studies[graphs]"' in capsys.readouterr().err


def test_unit_resume_equals_uninterrupted(tmp_path):
    """A unit interrupted after its second round and resumed from its checkpoint gives the uninterrupted unit's
    test outputs, histories and step counts bit for bit."""
    from hardeq_studies.harness import Interrupted
    from hardeq_studies.mof.data import load_config
    from hardeq_studies.mof.run import run_unit

    config = load_config()
    settings = {**config["presets"]["quick"], "steps": 5, "eval_every": 1, "patience": {"likelihood": 3}}
    kw = dict(config=config, settings=settings, split=0, group="likelihood", threads=1)
    a = run_unit(**kw, checkpoint_dir=tmp_path / "a", resume=False)

    def crash(rnd, info):
        if rnd == 2:
            raise Interrupted("simulated crash after round 2")

    with pytest.raises(Interrupted):
        run_unit(**kw, checkpoint_dir=tmp_path / "b", resume=False, callback=crash)
    assert not (tmp_path / "b" / "mof-s0-likelihood.result.pt").exists()
    b = run_unit(**kw, checkpoint_dir=tmp_path / "b", resume=True)
    assert torch.equal(a["mu"], b["mu"]) and torch.equal(a["var"], b["var"])
    assert a["steps"] == b["steps"] and a["best_step"] == b["best_step"] and a["plan"] == b["plan"]
    for k in a["history"]:
        torch.testing.assert_close(a["history"][k], b["history"][k], rtol=0, atol=0, equal_nan=True)
    assert a["plan"]["rounds"] == 5 and all(s <= 5 for s in a["steps"])


def test_step_budget_is_equal_across_batch_sizes():
    """Every group takes the same optimiser steps whatever its batch size; the stream of step batches is the
    sequence of data epochs however it is cut into rounds."""
    from hardeq_studies.mof.data import epoch_batches, load_graphs, step_batches
    from hardeq_studies.mof.run import schedule, steps_taken

    budget = {"steps": 45, "eval_every": 20}
    small, large = schedule(budget, 32, 1586), schedule(budget, 128, 1586)
    assert small["steps"] == large["steps"] == 45 and small["rounds"] == large["rounds"] == 3
    assert (small["steps_per_epoch"], large["steps_per_epoch"]) == (50, 13)
    assert schedule({"epochs": 3}, 128, 1586) == {"steps": 39, "round": 13, "rounds": 3, "steps_per_epoch": 13}
    assert steps_taken(small, torch.tensor([0, 1, 3])) == [45, 20, 45]
    graphs = load_graphs(None, 120).graphs[:30]
    stream = step_batches(graphs, 8, 3, 0, 3) + step_batches(graphs, 8, 3, 3, 6)  # rounds of 3 and 6 steps
    epochs = epoch_batches(graphs, 8, 3, 0) + epoch_batches(graphs, 8, 3, 1) + epoch_batches(graphs, 8, 3, 2)
    assert len(stream) == 9 and all(torch.equal(s.y, e.y) for s, e in zip(stream, epochs[:9]))
    with pytest.raises(ValueError, match="steps and eval_every"):
        schedule({"steps": 4, "eval_every": -1}, 8, 30)


def _claims_doc(batch_b: int, hidden_b: int, best: int):
    """A minimal results document: groups "a" (method A) and "b" (method B), one significant test B < A."""
    groups = {"a": {"methods": ["A"], "batch_size": 32, "arch": {"embedding": 10, "hidden": 30}},
              "b": {"methods": ["B"], "batch_size": batch_b, "arch": {"embedding": 10, "hidden": hidden_b}}}
    plan = {"a": {"steps": 200, "round": 20, "steps_per_epoch": 50},
            "b": {"steps": 200, "round": 20, "steps_per_epoch": 50 * 32 // batch_b}}
    tests = [{"a": "B", "b": "A", "metric": "mad", "n": 10, "wins": 10, "median_diff": -0.01, "p": 0.002},
             {"a": "A", "b": "B", "metric": "mad", "n": 10, "wins": 0, "median_diff": 0.01, "p": 0.002}]
    claims = [{"claim": "B beats A", "evidence": "x", "a": "B", "b": "A", "metric": "mad", "expect": "a < b"},
              {"claim": "A beats B", "evidence": "x", "a": "A", "b": "B", "metric": "mad", "expect": "a < b"}]
    return {"config": {"groups": groups, "claims": claims, "claims_budget": "more steps, up to 3000 epochs",
                       "settings": {"steps": 200}},
            "plan": plan, "best_step": {"s0-a": [best], "s0-b": [best]}, "significance": tests,
            "records": [{"method": m, "metric": "mad", "mean": 0.05, "std": 0.01} for m in "AB"]}


def test_claims_across_confounded_groups_are_never_reproduced_or_refuted():
    from hardeq_studies.claims import decide
    from hardeq_studies.mof.report import claims, confound

    # models still improving (best step at the budget's end): every MAD verdict is undecided, with the counts
    doc = _claims_doc(batch_b=128, hidden_b=50, best=200)
    for d in decide(claims(doc)):
        assert d.verdict.startswith("undecided: still improving (of 2 models, 2 have their best validation step in "
                                    "the last 10% of the 200-step budget, 2 at its last step and 0 before its last "
                                    "quarter")
    doc = _claims_doc(batch_b=128, hidden_b=50, best=120)
    assert "B: batch 128, embedding 10 / hidden 50, 16.7 data epochs" in confound(doc)
    win, loss = (d.verdict for d in decide(claims(doc)))
    assert win.startswith("undecided (Wilcoxon, n = 10; significant the paper's way, but the confound")
    assert loss.startswith("not reproduced at this budget (Wilcoxon, n = 10; significant the other way, but every "
                           "model gets 200 optimiser steps, far short of 3000 epochs; the method groups differ")
    # the same batch and network for both groups: no confound, so a significant win is reproduced
    doc = _claims_doc(batch_b=32, hidden_b=30, best=120)
    assert confound(doc) == ""
    win, loss = (d.verdict for d in decide(claims(doc)))
    assert win == "reproduced (Wilcoxon, n = 10)"
    assert loss == "not reproduced at this budget (Wilcoxon, n = 10; significant the other way, but every model " \
                   "gets 200 optimiser steps, far short of 3000 epochs)"
    # groups configured apart but trained with the preset's one network and batch (``uniform``): no confound
    doc = _claims_doc(batch_b=128, hidden_b=50, best=120)
    doc["plan"]["b"]["steps_per_epoch"] = 50
    doc["config"]["settings"]["uniform"] = {"arch": {"embedding": 10, "hidden": 30}, "batch_size": 32}
    assert confound(doc) == ""


def test_convergence_counts_and_the_protocol_matched_refutation():
    """The counts behind "undecided: still improving" (last 10%, last step, before the last quarter of the budget),
    the 75% rule, and CL vs Constant refuted (protocol-matched) even while the models improve: more training only
    lowers CL's MAD, away from the paper's claim."""
    from hardeq_studies.claims import decide
    from hardeq_studies.mof.report import claims, convergence_counts, still_improving

    doc = _claims_doc(batch_b=32, hidden_b=30, best=200)
    doc["best_step"] = {"s0-a": [200, 180, 179, 149], "s0-b": [10, 100, 140, 150]}
    assert convergence_counts(doc) == {"total": 8, "last_tenth": 2, "at_end": 1, "before_last_quarter": 4}
    assert "4 before its last quarter" in still_improving(doc)
    doc["best_step"]["s0-a"] = [10, 10, 10, 149]  # 7 of 8 before the last quarter: converged
    assert still_improving(doc) == ""
    doc["best_step"]["s0-a"] = [200] * 4
    doc["config"]["groups"]["a"]["methods"] = ["CL", "Constant"]
    doc["significance"].append({"a": "CL", "b": "Constant", "metric": "mad", "n": 10, "wins": 10,
                                "median_diff": -0.28, "p": 0.002})
    doc["config"]["claims"].append({"claim": "CL is no more accurate than predicting 0", "evidence": "x", "a": "CL",
                                    "b": "Constant", "metric": "mad", "expect": "a > b"})
    doc["records"] += [{"method": m, "metric": "mad", "mean": 0.05, "std": 0.01} for m in ("CL", "Constant")]
    verdicts = [d.verdict for d in decide(claims(doc))]
    assert verdicts[0].startswith("undecided: still improving")
    assert verdicts[2].startswith("refuted (protocol-matched): Wilcoxon, n = 10; significant the other way; CL is")


def test_uniform_settings_give_every_group_the_same_network_and_batch():
    """A preset's ``uniform`` block replaces every group's network, batch size and learning rate (the losses and
    the ensemble stay the group's); an unknown key is refused; without it each group keeps its own."""
    from hardeq_studies.mof.data import load_config
    from hardeq_studies.mof.models import build_member
    from hardeq_studies.mof.run import _unit_id, group_settings, member_seeds, unit_plan

    config = load_config()
    uniform = {"arch": {"embedding": 10, "hidden": 30, "steps": 4}, "batch_size": 32, "lr": 0.005}
    settings = {"splits": 2, "steps": 10, "eval_every": 5, "uniform": uniform}
    for g in config["groups"]:
        gs = group_settings(config, settings, g)
        assert gs["arch"] == uniform["arch"] and gs["batch_size"] == 32
        assert gs["methods"] == config["groups"][g]["methods"]
        assert _unit_id(config, settings, 0, g)["batch_size"] == 32
    own = config["groups"]["likelihood"]["batch_size"]
    assert group_settings(config, {"steps": 10}, "likelihood")["batch_size"] == own
    assert unit_plan(config, settings)[0] == (0, "raza")  # six models: the costliest unit first
    # every method's j-th model starts from the same initialisation (KKT, KKT, variance, variance, CL, CL)
    assert member_seeds(config, settings, 3, "raza") == [3000, 3001] * 3
    assert member_seeds(config, settings, 3, "likelihood") == [3000, 3001]
    torch.testing.assert_close(build_member(uniform["arch"], 3000).state_dict(),
                               build_member(uniform["arch"], 3000).state_dict(), rtol=0, atol=0)
    assert len(set(member_seeds(config, {"steps": 10}, 3, "raza") + member_seeds(config, {"steps": 10}, 3,
                                                                               "likelihood"))) == 8
    with pytest.raises(ValueError, match="uniform"):
        group_settings(config, {"uniform": {"patience": 3}}, "raza")


def test_smoothed_validation_mad_is_an_exponential_average_that_survives_a_checkpoint(data):
    """``mad_smooth`` from ``metrics`` is s_1 = m_1, s_r = (1 - a) s_{r-1} + a m_r per member; the state hook hands
    the average through a checkpoint, so a restored task continues it; a smoothing outside (0, 1] is refused."""
    from hardeq_studies.mof.data import collate
    from hardeq_studies.mof.task import MofTask

    batch = collate(data.graphs[:4])
    n = int(batch.num_nodes)
    g = torch.Generator().manual_seed(0)
    out = torch.stack([torch.randn(2, n, generator=g, dtype=torch.float64),
                       torch.rand(2, n, generator=g, dtype=torch.float64) + 0.1], -1)  # (M, N, 2)
    task = MofTask(["KKT", "variance"], smoothing=0.5)
    first = task.metrics(out, batch)
    torch.testing.assert_close(first["mad_smooth"], first["mad"])
    moved = out.clone()
    moved[..., 0] += 0.3
    second = task.metrics(moved, batch)
    torch.testing.assert_close(second["mad_smooth"], 0.5 * first["mad"] + 0.5 * second["mad"])
    restored = MofTask(["KKT", "variance"], smoothing=0.5)
    restored.state_hook().load_state_dict(task.state_hook().state_dict())
    third, again = task.metrics(out, batch), restored.metrics(out, batch)
    torch.testing.assert_close(again["mad_smooth"], third["mad_smooth"], rtol=0, atol=0)
    torch.testing.assert_close(third["mad_smooth"], 0.5 * second["mad_smooth"] + 0.5 * first["mad"])
    assert "mad_smooth" not in MofTask(["KKT"]).metrics(out[:1], batch)
    for bad in (0, 1.5, "0.3"):
        with pytest.raises(ValueError, match="smoothing"):
            MofTask(["KKT"], smoothing=bad)
