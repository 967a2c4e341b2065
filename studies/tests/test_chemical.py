"""Study ``chemical``: the data and its balances, the task's methods (fused baselines, one initialisation
for every method of a seed, the variance variants), the quick run through the CLI, bit-exact resume and DDP
equivalence under ``torchrun`` with two CPU processes."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from hardeq_studies.cli import main as cli_main
from hardeq_studies.chemical.data import load_config, load_dataset
from hardeq_studies.chemical.models import build_model
from hardeq_studies.chemical.report import significance
from hardeq_studies.chemical.run import make_task, run_dataset, training_units
from hardeq_studies.chemical.task import OURS, ChemicalTask
from hardeq_studies.harness import Interrupted
from hardeq_studies.stats import paired_wilcoxon

from study_test_helpers import run_or_fail

DATASETS = ("cstr", "plant", "distillation")
PAPER_METHODS = ("NN", "PINN", "KKT-hPINN", "ECNN", "CL", "ours")
CONSTRAINED = ("KKT-hPINN", "ECNN", "CL", "CL-coord", *OURS)


@pytest.mark.parametrize("name, rows, nx, ny, a, raw_tol", [
    ("cstr", 1943, 3, 3, 2, 1e-7),
    ("plant", 1541, 4, 5, 1, 1e-5),
    ("distillation", 6482, 5, 10, 2, 1e-7),
])
def test_data_and_balances(name, rows, nx, ny, a, raw_tol):
    config = load_config()
    d = load_dataset(name, config)
    assert d.x.shape == (rows, nx) and d.y.shape == (rows, ny) and d.B.shape == (a, ny) and d.A.shape == (a, nx)
    np.testing.assert_allclose(np.abs(np.concatenate([d.x, d.y], 1)).max(0), 1.0, rtol=0, atol=1e-15)
    assert np.abs(d.residual()).max() < raw_tol
    np.testing.assert_allclose(d.B, np.asarray(config["datasets"][name]["B"]) * d.scale_y, rtol=1e-15)
    n_val = n_test = int(0.2 * rows)
    assert d.splits["train"] == slice(0, rows - 2 * n_val)
    assert d.splits["val"] == slice(rows - 2 * n_val, rows - n_test)
    assert d.splits["test"] == slice(rows - n_test, rows)


def test_fused_baselines_equal_the_library_layers():
    data = load_dataset("distillation")
    methods = ["NN", "PINN", "KKT-hPINN", "ECNN", "CL", "CL-coord", "ours"]
    kw = dict(pinn_weight=1.0, ecnn_dependent=[0, 1], dtype=torch.float64)
    fused = ChemicalTask(data, methods, 2, fused_baselines=True, **kw)
    plain = ChemicalTask(data, methods, 2, fused_baselines=False, **kw)
    torch.manual_seed(0)
    out = torch.randn(fused.num_members, 5, max(fused.out_sizes), dtype=torch.float64, requires_grad=True)
    batch = {k: v[:5].expand(fused.num_members, 5, -1) for k, v in data.tensors("train", torch.float64).items()}
    l1, aux1 = fused.loss(out, batch)
    (g1,) = torch.autograd.grad(l1.sum(), out)
    l2, aux2 = plain.loss(out, batch)
    (g2,) = torch.autograd.grad(l2.sum(), out)
    torch.testing.assert_close(l1, l2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(aux1["mse"], aux2["mse"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def _members(methods, same_init=True):
    config = load_config()
    config["ours"]["same_init"] = same_init
    data, task = make_task("cstr", config, methods, 2, torch.float64, torch.device("cpu"))
    model = build_model(task, data.x.shape[1], [0, 1], config["model"], dtype=torch.float64, device="cpu")
    x = data.tensors("train", torch.float64)["x"][:7]
    return task, model, x


def test_every_method_of_a_seed_starts_from_the_same_network():
    task, model, x = _members(["NN", "KKT-hPINN", "ours", "ours-NLL", "ours-NLL-sepnet", "ours-bNLL"])
    out = model(x)
    n = task.n
    ref = out[task.slices["NN"], :, :n]
    for m in ("KKT-hPINN", "ours", "ours-NLL", "ours-NLL-sepnet", "ours-bNLL"):
        assert torch.equal(out[task.slices[m], :, :n], ref), m
    ours = task.ours_outputs(out)
    rel = {m: task._rel(m) for m in task.ours}
    # the separate variance network starts as the shared head's copy: same means and variances at init
    assert torch.equal(ours[rel["ours-NLL-sepnet"]], ours[rel["ours-NLL"]])
    # before the fix the ours* mean head got the biases that nn.Linear(h, 2n) draws
    task_old, model_old, _ = _members(["NN", "ours"], same_init=False)
    old = model_old(x)
    assert not torch.equal(old[task_old.slices["ours"], :, :n], old[task_old.slices["NN"], :, :n])


def test_variance_variants_cut_the_link_to_the_shared_features():
    task, model, x = _members(["ours-NLL", "ours-NLL-sepnet", "ours-NLL-homvar", "ours-bNLL"])
    data = load_dataset("cstr")
    batch = {k: v[:8].expand(task.num_members, 8, -1) for k, v in data.tensors("train", torch.float64).items()}
    loss, extra = task.loss(model(batch["x"]), batch)
    n, sl = task.n, task.slices
    # only the variance network's log-variances: zero gradient through the NLL of the other members' rows
    var_rows = sl["ours-NLL-sepnet/var"]
    model.zero_grad()
    loss[sl["ours-NLL-sepnet"]].sum().backward(retain_graph=True)
    assert bool((model.weight2.grad[sl["ours-NLL-sepnet"], :, n:] == 0).all())  # its own head: unused
    assert bool(model.weight0.grad[var_rows].abs().sum() > 0)  # the variance network learns
    assert bool((loss[var_rows] == 0).all())
    assert torch.equal(extra["mse"][var_rows], extra["mse"][sl["ours-NLL-sepnet"]])
    # one learned variance per output: the log-variance is the bias alone, the same for every input
    out = task.ours_outputs(model(x))
    homvar = out[task._rel("ours-NLL-homvar"), :, n:]
    assert torch.equal(homvar, homvar[:, :1].expand_as(homvar))
    # beta-NLL: the weight is stopgrad(geometric-mean plane variance)^beta
    k = task.constraint_value(x)
    dist = task.distribution(out, k)
    w = task._beta_weight(dist)
    a = task.a
    B = torch.as_tensor(data.B)
    Q, _ = torch.linalg.qr(B.T, mode="complete")
    U = Q[:, a:]
    var = out[0, 0, n:].exp() + task.variance_floor
    plane = torch.linalg.inv(U.T @ torch.diag(1 / var) @ U)
    torch.testing.assert_close(w[0, 0], torch.exp(task.beta * torch.logdet(plane) / (n - a)), rtol=1e-10, atol=0)
    assert not w.requires_grad


def test_training_units_split_the_largest_data_set():
    config = load_config()
    units = training_units(config, DATASETS, config["methods"], split=True)
    ours = [m for m in config["methods"] if m in OURS]
    parts = [u[2] for label, u in units.items() if label.startswith("distillation-ours")]
    assert sorted(sum(parts, [])) == sorted(ours) and all(len(p) <= 4 for p in parts)
    assert units["distillation-baselines"][2] == [m for m in config["methods"] if m not in OURS]


# ----------------------------------------------------------------------------------------------------------
# the study through the CLI
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("chemical")
    assert cli_main(["reproduce", "chemical", "--quick", "--out", str(out), "--quiet"]) == 0
    return out


@pytest.mark.slow
def test_quick_structure(quick_run):
    doc = json.loads((quick_run / "chemical.json").read_text())
    assert doc["study"] == "chemical" and doc["preset"] == "quick"
    assert {"torch", "device", "git", "dirty"} <= set(doc["environment"])
    methods = doc["config"]["methods_run"]
    assert set(PAPER_METHODS) | {"ours-NLL-sepnet", "ours-bNLL", "ours-NLL-homvar"} <= set(methods)
    recs = {(r["dataset"], r["method"], r["metric"]): r for r in doc["records"]}
    for r in doc["records"]:
        assert {"dataset", "method", "metric", "mean", "std", "n_seeds", "paper"} <= set(r)
    for d in DATASETS:
        for m in methods:
            for metric in ("test_mse", "violation", "val_mse"):
                r = recs[(d, m, metric)]
                assert r["n_seeds"] == 2 and np.isfinite(r["mean"]) and np.isfinite(r["std"])
            paper = recs[(d, m, "test_mse")]["paper"]
            assert (paper is not None) == (m in PAPER_METHODS)
    assert recs[("cstr", "ours", "test_mse")]["paper"] == pytest.approx(4.31e-4)  # natural units
    assert recs[("distillation", "PINN", "test_mse")]["paper"] == pytest.approx(40.9e-4)
    md = (quick_run / "chemical.md").read_text()
    assert "Test MSE" in md and "4.31" in md and "Wilcoxon" in md
    for d in DATASETS:
        assert (quick_run / f"chemical.{d}.png").stat().st_size > 1000
    curves = json.loads((quick_run / "chemical.curves.json").read_text())
    assert len(curves["cstr"]["ours"]["train"]) == 3 and len(curves["cstr"]["ours"]["val"]) == 3
    assert not (quick_run / "checkpoints").exists()
    # the non-negative-flows variant (chemical/bounds.py): flows >= 0 and exact balances for every bounded rule
    part = doc["nonnegative_flows"]
    assert (part["config"]["draws"], part["config"]["chains"], part["config"]["burn_in"]) == (8, 2, 5)  # quick's
    for d in DATASETS:
        for m in ("ours-NLL", "ours-tNLL"):  # ours-tNLL: trained through the truncated likelihood
            rules = part["per_seed"][d][m]
            for rule in ("clip-project", "truncated mean", "truncated mode"):
                assert max(rules[rule]["negative_share"]) == 0.0
                assert max(rules[rule]["max_balance_residual"]) < 1e-9
                assert len(rules[rule]["test_mse"]) == 2
            assert [s["method"] in ("rejection", "gibbs") for s in rules["sampler"]] == [True, True]
        assert sum(t["claim"].startswith("training through the bounds") for t in part["significance"][d]) == 2
    assert "## Non-negative flows: do the bounds help?" in md and "the truncated mean was sampled by" in md
    assert md.count(": training through the bounds: ours-tNLL's truncated") == 2 * len(DATASETS)


@pytest.mark.slow
def test_paired_tests_are_computed_from_the_per_seed_values(quick_run):
    doc = json.loads((quick_run / "chemical.json").read_text())
    rows = {(r["dataset"], r["method"]): r for r in doc["significance"]}
    assert set(m for _, m in rows) == {m for m in doc["config"]["methods_run"] if m.startswith("ours")}
    for (d, m), r in rows.items():
        expected = paired_wilcoxon(doc["per_seed"][d][m]["test_mse"], doc["per_seed"][d]["KKT-hPINN"]["test_mse"])
        assert r["p"] == pytest.approx(expected["p"], nan_ok=True) and r["wins"] == expected["wins"]
    assert significance(doc["per_seed"], ["ours"]) == [r for r in doc["significance"] if r["method"] == "ours"]
    md = (quick_run / "chemical.md").read_text()
    r = rows[("cstr", "ours")]
    assert f"{r['wins']}/{r['n']}, p = {r['p']:.2g}" in md


@pytest.mark.slow
def test_quick_violations(quick_run):
    """Hard-constrained methods satisfy the balances to float32 round-off; NN and PINN do not (bound:
    1e3 float32 eps times the scaled coefficients' size, ~100)."""
    doc = json.loads((quick_run / "chemical.json").read_text())
    assert doc["config"]["dtype_run"] == "float32"
    for r in doc["records"]:
        if r["metric"] != "violation":
            continue
        if r["method"] in CONSTRAINED:
            assert r["mean"] < 1e3 * torch.finfo(torch.float32).eps * 100, r
        else:
            assert r["mean"] > 1e-3, r


def _strip(result):
    return {k: result[k] for k in ("records", "curves", "per_seed")}


def test_resume_equals_uninterrupted(tmp_path):
    config = load_config()
    config["train"]["checkpoint_every"] = 2
    kw = dict(seeds=[0, 1], epochs=5, methods=["NN", "PINN", "CL", "ours", "ours-NLL-sepnet", "ours-bNLL",
                                              "ours-NLL-homvar"], dtype="float32")
    full = run_dataset("plant", config, **kw, checkpoint_dir=tmp_path / "a", progress=False)

    def interrupt(name, epoch, info):
        if epoch == 3:
            raise Interrupted("simulated crash after epoch 3 (last checkpoint: epoch 2)")

    with pytest.raises(Interrupted):
        run_dataset("plant", config, **kw, checkpoint_dir=tmp_path / "b", progress=False, callback=interrupt)
    assert (tmp_path / "b" / "chemical-plant.pt").exists()
    seen = []
    resumed = run_dataset("plant", config, **kw, checkpoint_dir=tmp_path / "b", resume=True, progress=False,
                          callback=lambda n, e, i: seen.append(e))
    assert seen == [3, 4, 5]
    assert _strip(resumed) == _strip(full)  # bit-exact
    with pytest.raises(ValueError, match="different run"):
        run_dataset("plant", config, **{**kw, "seeds": [0, 2]}, checkpoint_dir=tmp_path / "b", resume=True,
                    progress=False)


@pytest.mark.slow
@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_ddp_two_processes_match_single_process(tmp_path):
    """``torchrun --nproc_per_node=2``: each rank takes half of every minibatch, gradients are summed. In
    float64 the only difference to one process is the summation order (~1e-13 after a few hundred steps);
    we allow 1e-9. Violations are round-off (~1e-14) in both."""
    args = ["reproduce", "chemical", "--quick", "--datasets", "cstr", "--methods", "NN", "KKT-hPINN", "ECNN",
            "ours", "ours-NLL", "ours-NLL-sepnet", "--epochs", "2", "--seeds", "2", "--dtype", "float64", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "hardeq_studies",
           *args, "--out", str(tmp_path / "ddp")]
    proc = run_or_fail(cmd, timeout=600, env=env, cwd=tmp_path)
    if proc.returncode != 0 and "rendezvous" in proc.stderr.lower():
        pytest.skip(f"torchrun could not start its process group here: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cli_main([*args, "--out", str(tmp_path / "single")]) == 0
    ddp = json.loads((tmp_path / "ddp" / "chemical.json").read_text())
    one = json.loads((tmp_path / "single" / "chemical.json").read_text())
    assert ddp["config"]["world_size"] == 2 and one["config"]["world_size"] == 1
    assert len(ddp["records"]) == len(one["records"])
    for a, b in zip(ddp["records"], one["records"]):
        assert (a["method"], a["metric"]) == (b["method"], b["metric"])
        if a["metric"].startswith("violation") and a["method"] in CONSTRAINED:
            assert a["mean"] < 1e-12 and b["mean"] < 1e-12
        elif a["metric"] == "max_balance_residual":  # the bounded variants' balance residual: round-off only,
            assert a["mean"] < 1e-10 and b["mean"] < 1e-10  # whose last bits depend on the reduction order
        else:
            assert a["mean"] == pytest.approx(b["mean"], rel=1e-9, abs=1e-15), (a, b)
    c_ddp = json.loads((tmp_path / "ddp" / "chemical.curves.json").read_text())
    c_one = json.loads((tmp_path / "single" / "chemical.curves.json").read_text())
    for m in c_one["cstr"]:
        np.testing.assert_allclose(c_ddp["cstr"][m]["train"], c_one["cstr"][m]["train"], rtol=1e-9)
        np.testing.assert_allclose(c_ddp["cstr"][m]["val"], c_one["cstr"][m]["val"], rtol=1e-9)
