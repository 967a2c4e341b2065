"""Study ``chemical`` and the shared training harness (``hardeq.experiments.harness``).

Smoke test of ``hardeq reproduce chemical --quick`` plus the properties the full run relies on: the data and
its balances, per-seed initialisation and shuffling of the vectorised members (against a plain per-seed
loop), the fused baselines (against the library layers), bit-exact resume, and DDP equivalence under
``torchrun`` with two CPU processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from hardeq.cli import main as cli_main
from hardeq.experiments import chemical
from hardeq.experiments.harness import BatchedMLP, Interrupted, Task, TrainConfig, train

DATASETS = ("cstr", "plant", "distillation")
PAPER_METHODS = ("NN", "PINN", "KKT-hPINN", "ECNN", "CL", "ours")
CONSTRAINED = ("KKT-hPINN", "ECNN", "CL", "CL-coord", *chemical.OURS)


# ----------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, rows, nx, ny, a, raw_tol", [
    ("cstr", 1943, 3, 3, 2, 1e-7),
    ("plant", 1541, 4, 5, 1, 1e-5),
    ("distillation", 6482, 5, 10, 2, 1e-7),
])
def test_data_and_balances(name, rows, nx, ny, a, raw_tol):
    config = chemical.load_config()
    d = chemical.load_dataset(name, config)
    assert d.x.shape == (rows, nx) and d.y.shape == (rows, ny) and d.B.shape == (a, ny) and d.A.shape == (a, nx)
    # MaxAbs scaling on the whole file: every column's largest |value| is 1
    np.testing.assert_allclose(np.abs(np.concatenate([d.x, d.y], 1)).max(0), 1.0, rtol=0, atol=1e-15)
    # the balances hold in scaled units with the rescaled coefficients (SOURCE.md: raw residuals below 1e-7
    # for CSTR and distillation and 1e-5 for the plant; rescaling the coefficients keeps the residual's units)
    assert np.abs(d.residual()).max() < raw_tol
    # coefficients: B diag(scale_y), A diag(scale_x)
    np.testing.assert_allclose(d.B, np.asarray(config["datasets"][name]["B"]) * d.scale_y, rtol=1e-15)
    # split in file order, 60/20/20 with the remainder in train (as the reference code)
    n_val = n_test = int(0.2 * rows)
    assert d.splits["train"] == slice(0, rows - 2 * n_val)
    assert d.splits["val"] == slice(rows - 2 * n_val, rows - n_test)
    assert d.splits["test"] == slice(rows - n_test, rows)


# ----------------------------------------------------------------------------------------------------------
# the harness
# ----------------------------------------------------------------------------------------------------------


class _MSETask(Task):
    def loss(self, output, batch):
        return (output - batch["y"]).square().mean(-1)

    def metrics(self, output, batch):
        return {"mse": (output - batch["y"]).square().mean((-2, -1))}


def test_batched_mlp_matches_nn_linear_init():
    net = BatchedMLP(3, (32, 32), [3, 6], seeds=[5, 7])
    for i, (seed, out) in enumerate([(5, 3), (7, 6)]):
        torch.manual_seed(seed)
        ref = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, out))
        x = torch.randn(4, 3)
        assert torch.equal(net.member(i)(x), ref(x))
        torch.testing.assert_close(net(x.expand(2, 4, 3))[i, :, :out], ref(x))  # bmm vs mm: round-off
        assert bool((net(x.expand(2, 4, 3))[i, :, out:] == 0).all())  # padding columns are zero


def test_detached_outputs_do_not_train_the_hidden_layers():
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 2:] = True  # member 1: outputs 2 and 3 are a stop-gradient head
    net = BatchedMLP(3, (8,), 4, seeds=[0, 1], detach_outputs=mask)
    ref = BatchedMLP(3, (8,), 4, seeds=[0, 1])
    x = torch.randn(2, 5, 3)
    assert torch.equal(net(x), ref(x))  # same values
    for cols, hidden_grad in (([0, 1], True), ([2, 3], False)):
        net.zero_grad()
        net(x)[1, :, cols].sum().backward()
        assert bool(net.weight0.grad[1].abs().sum() > 0) == hidden_grad
        assert bool(net.weight1.grad[1, :, cols].abs().sum() > 0)  # the head itself still learns


def test_vectorised_members_equal_a_per_seed_loop():
    """Each member has its own init and its own shuffling: training all at once equals one loop per seed."""
    torch.manual_seed(0)
    N, seeds = 37, [0, 1, 2]
    data = {"x": torch.randn(N, 3, dtype=torch.float64), "y": torch.randn(N, 2, dtype=torch.float64)}
    val = {"x": torch.randn(9, 3, dtype=torch.float64), "y": torch.randn(9, 2, dtype=torch.float64)}
    cfg = TrainConfig(epochs=3, batch_size=8, lr=1e-2)
    net = BatchedMLP(3, (16,), 2, seeds, dtype=torch.float64)
    res = train(net, _MSETask(), data, val, cfg, seeds, progress=False)
    for i, seed in enumerate(seeds):
        first, last = net.reference_layers(seed, 2)
        ref = nn.Sequential(first, nn.ReLU(), last).double()
        opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(seed)
        best, best_state = float("inf"), None
        for _ in range(cfg.epochs):
            perm = torch.randperm(N, generator=gen)
            for j in range(0, N, cfg.batch_size):
                idx = perm[j: j + cfg.batch_size]
                loss = (ref(data["x"][idx]) - data["y"][idx]).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                v = float((ref(val["x"]) - val["y"]).square().mean())
            if v < best:
                best, best_state = v, [p.detach().clone() for p in ref.parameters()]
        got = [res.final_state["weight0"][i].T, res.final_state["bias0"][i, 0],
               res.final_state["weight1"][i].T, res.final_state["bias1"][i, 0]]
        for g, p in zip(got, ref.parameters()):
            torch.testing.assert_close(g, p.detach(), rtol=1e-10, atol=1e-12)
        assert res.best_value[i].item() == pytest.approx(best, rel=1e-10)
        torch.testing.assert_close(res.best_state["weight0"][i].T, best_state[0], rtol=1e-10, atol=1e-12)


def test_fused_baselines_equal_the_library_layers():
    data = chemical.load_dataset("distillation")
    methods = ["NN", "PINN", "KKT-hPINN", "ECNN", "CL", "CL-coord", "ours"]
    kw = dict(pinn_weight=1.0, ecnn_dependent=[0, 1], dtype=torch.float64)
    fused = chemical.ChemicalTask(data, methods, 2, fused_baselines=True, **kw)
    plain = chemical.ChemicalTask(data, methods, 2, fused_baselines=False, **kw)
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


# ----------------------------------------------------------------------------------------------------------
# the study
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("chemical")
    assert cli_main(["reproduce", "chemical", "--quick", "--out", str(out), "--quiet"]) == 0
    return out


def test_quick_structure(quick_run):
    doc = json.loads((quick_run / "chemical.json").read_text())
    assert doc["study"] == "chemical" and doc["preset"] == "quick"
    assert {"torch", "device", "git"} <= set(doc["environment"])
    methods = doc["config"]["methods_run"]
    assert set(PAPER_METHODS) | {"ours-L1", "ours-NLL"} <= set(methods)
    recs = {(r["dataset"], r["method"], r["metric"]): r for r in doc["records"]}
    for d in DATASETS:
        for m in methods:
            for metric in ("test_mse", "violation", "val_mse"):
                r = recs[(d, m, metric)]
                assert {"mean", "std", "n_seeds"} <= set(r) and r["n_seeds"] == 2
                assert np.isfinite(r["mean"]) and np.isfinite(r["std"])
            paper = recs[(d, m, "test_mse")]["paper"]
            assert (paper is not None) == (m in PAPER_METHODS)
    # paper values are stored in natural units (the paper prints x 1e-4)
    assert recs[("cstr", "ours", "test_mse")]["paper"] == pytest.approx(4.31e-4)
    assert recs[("distillation", "PINN", "test_mse")]["paper"] == pytest.approx(40.9e-4)
    md = (quick_run / "chemical.md").read_text()
    assert "Test MSE" in md and "4.31" in md
    for d in DATASETS:
        assert (quick_run / f"chemical.{d}.png").stat().st_size > 1000
    curves = json.loads((quick_run / "chemical.curves.json").read_text())
    assert len(curves["cstr"]["ours"]["train"]) == 3 and len(curves["cstr"]["ours"]["val"]) == 3
    assert not (quick_run / "checkpoints").exists()  # removed after a completed run


def test_quick_violations(quick_run):
    """Hard-constrained methods satisfy the balances to float32 round-off; NN and PINN do not.

    The scaled balances carry coefficients up to ~100 (``B diag(scale_y)``) on outputs of size ~1, so one
    float32 rounding of the prediction alone moves the residual by ~1e-5 at worst; the mean absolute
    violation is ~1e-6. The bound below is 1e3 float32 eps relative to that scale.
    """
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
    config = chemical.load_config()
    config["train"]["checkpoint_every"] = 2
    kw = dict(seeds=[0, 1], epochs=5, methods=["NN", "PINN", "CL", "ours", "ours-L1", "ours-NLL"], dtype="float32")
    full = chemical.run_dataset("plant", config, **kw, checkpoint_dir=tmp_path / "a", progress=False)

    def interrupt(name, epoch, info):
        if epoch == 3:
            raise Interrupted("simulated crash after epoch 3 (last checkpoint: epoch 2)")

    with pytest.raises(Interrupted):
        chemical.run_dataset("plant", config, **kw, checkpoint_dir=tmp_path / "b", progress=False,
                             callback=interrupt)
    assert (tmp_path / "b" / "chemical-plant.pt").exists()
    seen = []
    resumed = chemical.run_dataset("plant", config, **kw, checkpoint_dir=tmp_path / "b", resume=True,
                                   progress=False, callback=lambda n, e, i: seen.append(e))
    assert seen == [3, 4, 5]  # epoch 3 is redone from the epoch-2 checkpoint
    assert _strip(resumed) == _strip(full)  # bit-exact

    # a checkpoint of another run is refused
    with pytest.raises(ValueError, match="different run"):
        chemical.run_dataset("plant", config, **{**kw, "seeds": [0, 2]}, checkpoint_dir=tmp_path / "b",
                             resume=True, progress=False)


def _torchrun_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


@pytest.mark.skipif(not _torchrun_available(), reason="torch.distributed with gloo is not available")
def test_ddp_two_processes_match_single_process(tmp_path):
    """``torchrun --nproc_per_node=2``: each rank takes half of every minibatch, gradients are summed.

    In float64 the only difference to one process is the summation order of the gradient (two partial
    sums plus an all_reduce): ~1e-16 relative per step, a few hundred steps here, so results agree to
    ~1e-13; we allow 1e-9. Violations are round-off (~1e-14) in both and compared against that level.
    """
    args = ["reproduce", "chemical", "--quick", "--datasets", "cstr", "--methods", "NN", "KKT-hPINN", "ECNN",
            "ours", "ours-NLL", "--epochs", "2", "--seeds", "2", "--dtype", "float64", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "hardeq",
           *args, "--out", str(tmp_path / "ddp")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.skip("torchrun did not finish in time (overloaded machine?)")
    if proc.returncode != 0 and ("rendezvous" in proc.stderr.lower() or "gloo" in proc.stderr.lower()
                                 and "connect" in proc.stderr.lower()):
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
        else:
            assert a["mean"] == pytest.approx(b["mean"], rel=1e-9, abs=1e-15), (a, b)
    c_ddp = json.loads((tmp_path / "ddp" / "chemical.curves.json").read_text())
    c_one = json.loads((tmp_path / "single" / "chemical.curves.json").read_text())
    for m in c_one["cstr"]:
        np.testing.assert_allclose(c_ddp["cstr"][m]["train"], c_one["cstr"][m]["train"], rtol=1e-9)
        np.testing.assert_allclose(c_ddp["cstr"][m]["val"], c_one["cstr"][m]["val"], rtol=1e-9)
