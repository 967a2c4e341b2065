"""The shared training harness (``hardeq_studies.harness``), tested directly on toy tasks: members,
data sources, optimiser and scheduler factories, early stopping, EMA, batched evaluation with its own
random stream, atomic checkpoints and a bit-exact resume."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hardeq_studies.harness import (BatchedMLP, Interrupted, LoaderBatches, MemberList, Task, TrainConfig,
                                    atomic_torch_save, evaluate, load_checkpoint, run_blocks, train)


class MSETask(Task):
    def loss(self, output, batch):
        return (output - batch["y"]).square().mean(-1), {"mse": (output - batch["y"]).square().mean(-1)}

    def metrics(self, output, batch, generator=None):
        return {"mse": (output - batch["y"]).square().mean((-2, -1))}


class NoisyTask(MSETask):
    """A stochastic metric drawn from the evaluation stream."""

    def metrics(self, output, batch, generator=None):
        out = super().metrics(output, batch)
        out["noise"] = torch.rand(output.shape[0], generator=generator, dtype=output.dtype)
        return out


def _data(N=37, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(N, 3, generator=g, dtype=dtype), "y": torch.randn(N, 2, generator=g, dtype=dtype)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ members
def test_batched_mlp_matches_nn_linear_init():
    net = BatchedMLP(3, (32, 32), [3, 6], seeds=[5, 7])
    for i, (seed, out) in enumerate([(5, 3), (7, 6)]):
        torch.manual_seed(seed)
        ref = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, out))
        x = torch.randn(4, 3)
        assert torch.equal(net.member(i)(x), ref(x))
        torch.testing.assert_close(net(x.expand(2, 4, 3))[i, :, :out], ref(x))  # bmm vs mm: round-off
        assert bool((net(x.expand(2, 4, 3))[i, :, out:] == 0).all())  # padding columns are zero


def test_base_out_features_share_the_first_outputs():
    """A member with extra outputs starts with exactly the outputs of the narrower network of its seed."""
    net = BatchedMLP(3, (8,), [2, 4, 4], seeds=[3, 3, 3], base_out_features=[2, 2, 4])
    x = torch.randn(5, 3)
    out = net(x)
    assert torch.equal(out[1, :, :2], out[0, :, :2])  # same first outputs as the 2-output network
    assert not torch.equal(out[2, :, :2], out[0, :, :2])  # nn.Linear(8, 4) draws other biases
    assert torch.equal(out[1, :, 2:], out[2, :, 2:])  # the extra outputs are the wide network's
    with pytest.raises(ValueError, match="base_out_features"):
        BatchedMLP(3, (8,), [2], seeds=[0], base_out_features=[3])


def test_detached_and_bias_only_outputs():
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 2:] = True
    net = BatchedMLP(3, (8,), 4, seeds=[0, 1], detach_outputs=mask)
    ref = BatchedMLP(3, (8,), 4, seeds=[0, 1])
    x = torch.randn(2, 5, 3)
    assert torch.equal(net(x), ref(x))
    for cols, hidden_grad in (([0, 1], True), ([2, 3], False)):
        net.zero_grad()
        net(x)[1, :, cols].sum().backward()
        assert bool(net.weight0.grad[1].abs().sum() > 0) == hidden_grad
        assert bool(net.weight1.grad[1, :, cols].abs().sum() > 0)
    const = BatchedMLP(3, (8,), 4, seeds=[0, 1], bias_only_outputs=mask)
    out = const(x)
    assert torch.equal(out[1, :, 2:], const.bias1[1, :, 2:].expand(5, 2))  # the same for every input
    out[1, :, 2:].sum().backward()
    assert bool((const.weight1.grad[1, :, 2:] == 0).all()) and bool((const.weight0.grad == 0).all())


def _loop_reference(seed, data, val, cfg, lr):
    first, last = BatchedMLP(3, (16,), 2, [seed]).reference_layers(seed, 2)
    ref = nn.Sequential(first, nn.ReLU(), last).double()
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    N = data["x"].shape[0]
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
    return ref, best, best_state


def test_vectorised_members_equal_a_per_seed_loop():
    """Each member has its own init and its own shuffling: training all at once equals one loop per seed."""
    seeds = [0, 1, 2]
    data, val = _data(), _data(9, seed=1)
    cfg = TrainConfig(epochs=3, batch_size=8, lr=1e-2)
    net = BatchedMLP(3, (16,), 2, seeds, dtype=torch.float64)
    res = train(net, MSETask(), data, val, cfg, seeds, progress=False)
    for i, seed in enumerate(seeds):
        ref, best, best_state = _loop_reference(seed, data, val, cfg, 1e-2)
        got = [res.final_state["weight0"][i].T, res.final_state["bias0"][i, 0],
               res.final_state["weight1"][i].T, res.final_state["bias1"][i, 0]]
        for g, p in zip(got, ref.parameters()):
            torch.testing.assert_close(g, p.detach(), rtol=1e-10, atol=1e-12)
        assert res.best_value[i].item() == pytest.approx(best, rel=1e-10)
        torch.testing.assert_close(res.best_state["weight0"][i].T, best_state[0], rtol=1e-10, atol=1e-12)


def test_member_list_plain_loop_equals_the_vectorised_model():
    """Models that cannot be vectorised train as a MemberList (a Python loop) to the same result."""
    seeds = [0, 1]
    data, val = _data(), _data(9, seed=1)
    cfg = TrainConfig(epochs=2, batch_size=8, lr=1e-2)
    batched = BatchedMLP(3, (16,), 2, seeds, dtype=torch.float64)
    members = MemberList([batched.member(i) for i in range(2)])
    r1 = train(batched, MSETask(), data, val, cfg, seeds, progress=False)
    r2 = train(members, MSETask(), data, val, cfg, seeds, progress=False)
    torch.testing.assert_close(r1.best_value, r2.best_value, rtol=1e-10, atol=0)
    torch.testing.assert_close(r2.final_state["members.1.2.weight"], r1.final_state["weight1"][1].T,
                               rtol=1e-10, atol=1e-12)
    assert torch.equal(r1.best_epoch, r2.best_epoch)


def test_member_list_merge_copies_the_live_parameters():
    """A best state merged from the live state_dict must not follow the parameters as training goes on (it did:
    MemberList's merge returned the live tensors, so 'best-validation' states were the latest ones)."""
    members = MemberList([nn.Linear(2, 1), nn.Linear(2, 1)])
    live = {k: v.detach() for k, v in members.state_dict().items()}
    before = {k: v.clone() for k, v in live.items()}
    best = members.merge_members({k: torch.zeros_like(v) for k, v in live.items()}, live, torch.tensor([True, False]))
    with torch.no_grad():
        for q in members.parameters():
            q.add_(1.0)
    for k, v in best.items():
        expect = before[k] if k.startswith("members.0.") else torch.zeros_like(v)
        assert torch.equal(v, expect), k


# ------------------------------------------------------------------------------------------------ features
def test_early_stopping_freezes_each_member_with_its_own_patience():
    """Member 1 learns with lr 0 (it never improves after epoch 1) and stops after `patience` more epochs;
    its parameters stay frozen while member 0 trains on (validated on its training data with a small step, so
    it keeps improving)."""
    seeds = [0, 1]
    data = val = _data()
    net = BatchedMLP(3, (16,), 2, seeds, dtype=torch.float64)
    init = {k: v.clone() for k, v in net.state_dict().items()}
    cfg = TrainConfig(epochs=8, batch_size=8, patience=2)

    def optimizer(params):  # per-member learning rates through a gradient hook: member 1 gets lr 0
        for p in params:
            p.register_hook(lambda g: g * torch.tensor([1.0, 0.0], dtype=g.dtype).view(-1, *[1] * (g.dim() - 1)))
        return torch.optim.SGD(params, lr=0.01)

    res = train(net, MSETask(), data, val, cfg, seeds, optimizer=optimizer, progress=False)
    assert res.stopped_epoch.tolist() == [0, 3] and res.best_epoch[1] == 1
    assert torch.isnan(res.history["val_mse"][3:, 1]).all() and not torch.isnan(res.history["val_mse"][:, 0]).any()
    assert torch.equal(res.final_state["weight0"][1], init["weight0"][1])
    assert not torch.equal(res.final_state["weight0"][0], init["weight0"][0])


def test_all_members_stopped_ends_training():
    net = BatchedMLP(3, (4,), 2, [0], dtype=torch.float64)
    cfg = TrainConfig(epochs=50, batch_size=8, patience=1)
    res = train(net, MSETask(), _data(), _data(9, 1), cfg, [0], optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                progress=False)
    assert res.epochs_run == 2 and res.stopped_epoch.tolist() == [2]


def test_ema_of_weights():
    """With EMA the returned and evaluated states are the running average of the weights after each step."""
    data, val = _data(16), _data(9, 1)
    cfg = TrainConfig(epochs=2, batch_size=8, lr=1e-2, ema_decay=0.5)
    net = BatchedMLP(3, (4,), 2, [0], dtype=torch.float64)
    ema = {k: v.clone() for k, v in net.state_dict().items()}
    ref = BatchedMLP(3, (4,), 2, [0], dtype=torch.float64)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        perm = torch.randperm(16, generator=gen)
        for j in range(0, 16, 8):
            idx = perm[j: j + 8].unsqueeze(0)
            loss = (ref(data["x"][idx]) - data["y"][idx]).square().mean(-1).sum() / 8
            opt.zero_grad()
            loss.backward()
            opt.step()
            for k, v in ref.state_dict().items():
                ema[k] = 0.5 * ema[k] + 0.5 * v
    res = train(net, MSETask(), data, val, cfg, [0], progress=False)
    for k in ema:
        torch.testing.assert_close(res.final_state[k], ema[k], rtol=1e-12, atol=1e-14)
    ema_mse = evaluate(net, MSETask(), val, ema)["mse"]
    torch.testing.assert_close(res.history["val_mse"][-1], ema_mse, rtol=1e-12, atol=0)


def test_batched_evaluation_and_its_random_stream():
    net = BatchedMLP(3, (4,), 2, [0, 1], dtype=torch.float64)
    val = _data(23, 1)
    whole = evaluate(net, MSETask(), val)["mse"]
    chunks = evaluate(net, MSETask(), val, batch_size=5)["mse"]
    torch.testing.assert_close(chunks, whole, rtol=1e-12, atol=0)
    as_iterable = evaluate(net, MSETask(), [{k: v[i: i + 7] for k, v in val.items()} for i in range(0, 23, 7)])
    torch.testing.assert_close(as_iterable["mse"], whole, rtol=1e-12, atol=0)
    # the evaluation draws from its own stream: training's random numbers are untouched
    cfg = TrainConfig(epochs=2, batch_size=8, eval_seed=5)
    a = train(BatchedMLP(3, (4,), 2, [0], dtype=torch.float64), NoisyTask(), _data(), val, cfg, [0], progress=False)
    torch.manual_seed(123)
    b = train(BatchedMLP(3, (4,), 2, [0], dtype=torch.float64), NoisyTask(), _data(), val, cfg, [0], progress=False)
    assert torch.equal(a.history["val_noise"], b.history["val_noise"])  # independent of the global RNG
    assert a.history["val_noise"][0, 0] != a.history["val_noise"][1, 0]  # a fresh draw per epoch


def _loader(data, batch):
    def make(epoch, ctx):
        g = torch.Generator().manual_seed(1000 + epoch)  # shuffling derived from the epoch: resumable
        perm = torch.randperm(data["x"].shape[0], generator=g)
        return [{k: v[perm[i: i + batch]] for k, v in data.items()} for i in range(0, len(perm), batch)]
    return make


@pytest.mark.parametrize("source", ["memory", "loader"])
def test_resume_is_bit_exact_with_optimizer_scheduler_and_ema(tmp_path, source):
    data, val = _data(), _data(9, 1)
    cfg = TrainConfig(epochs=5, batch_size=8, checkpoint_every=2, ema_decay=0.9, patience=3)
    seeds = [0, 1]

    def run(path, **kw):
        net = BatchedMLP(3, (8,), 2, seeds, dtype=torch.float64)
        train_data = data if source == "memory" else LoaderBatches(_loader(data, 8), ctx=_ctx())
        return train(net, MSETask(), train_data, val, cfg, seeds, checkpoint_path=path, progress=False,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                     scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), **kw)

    full = run(tmp_path / "a.pt")

    def crash(epoch, info):
        if epoch == 3:
            raise Interrupted("simulated crash")

    with pytest.raises(Interrupted):
        run(tmp_path / "b.pt", callback=crash)
    assert load_checkpoint(tmp_path / "b.pt")["epoch"] == 2
    resumed = run(tmp_path / "b.pt", resume=True)
    assert resumed.epochs_run == 3
    assert _same(resumed.best_state, full.best_state) and _same(resumed.final_state, full.final_state)
    assert _same(resumed.history, full.history) and torch.equal(resumed.best_epoch, full.best_epoch)
    with pytest.raises(ValueError, match="different run"):
        net = BatchedMLP(3, (8,), 2, [0, 2], dtype=torch.float64)
        train(net, MSETask(), data, val, cfg, [0, 2], checkpoint_path=tmp_path / "b.pt", resume=True,
              progress=False)


def _ctx():
    from hardeq_studies.harness import DistContext

    return DistContext()


def test_train_config_rejects_bad_values():
    for kw, match in (({"epochs": 0}, "epochs"), ({"batch_size": 0}, "batch_size"), ({"patience": 0}, "patience"),
                      ({"ema_decay": 1.0}, "ema_decay")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**{"epochs": 1, "batch_size": 1, **kw})


def test_atomic_save_and_run_blocks(tmp_path):
    path = tmp_path / "ck.pt"
    atomic_torch_save({"a": torch.arange(3)}, path)
    assert torch.equal(load_checkpoint(path)["a"], torch.arange(3))
    assert not list(tmp_path.glob("*.tmp"))
    calls = []

    def block(key):
        def compute():
            calls.append(key)
            if key == "c" and len(calls) == 3:
                raise Interrupted
            return [{"key": key, "value": 1.5}]
        return compute

    blocks = {k: block(k) for k in "abc"}
    with pytest.raises(Interrupted):
        run_blocks(blocks, checkpoint_path=path, resume=False, run_id={"x": 1})
    out = run_blocks(blocks, checkpoint_path=path, resume=True, run_id={"x": 1})
    assert calls == ["a", "b", "c", "c"] and out["a"] == [{"key": "a", "value": 1.5}] and list(out) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="different run"):
        run_blocks(blocks, checkpoint_path=path, resume=True, run_id={"x": 2})
