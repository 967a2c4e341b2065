"""The harness loop's features for single models (every study trains through it): batch-level objectives,
minibatches of one model, hooks and their checkpointed state, EMA with warm-up, clipping, per-step schedules,
early stopping on a validation metric, the non-finite check, and the Study template."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from torch import nn

from hardeq_studies.harness import (Hooks, Interrupted, Objective, OnEpoch, ShuffledBatches, TrainConfig,
                                    merge_members, train)


def _data(n: int = 20, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return {"x": x, "y": x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(n, 1, generator=g)}


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))


def _mse(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]).square().mean()  # a batch-level (0-dim) objective


class Recorder(Hooks):
    """Per-step losses and learning rates, per-epoch steps; checkpointed."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.epochs: list[int] = []

    def on_step(self, trainer, loss, extra) -> None:
        self.losses.append(float(loss))
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])

    def on_epoch(self, trainer, metrics) -> None:
        self.epochs.append(trainer.step)

    def state_dict(self):
        return {"losses": list(self.losses), "lrs": list(self.lrs), "epochs": list(self.epochs)}

    def load_state_dict(self, state) -> None:
        self.losses, self.lrs, self.epochs = list(state["losses"]), list(state["lrs"]), list(state["epochs"])


def _hand_loop(epochs: int, *, clip: float, decay: float, warmup: int, wd: float):
    """What a study used to write by hand: shuffled minibatches, Adam, clipping, a per-step warm-up, EMA."""
    model, data = _net(), _data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=wd)
    gen = torch.Generator().manual_seed(5)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, step = [], 0
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(20, generator=gen)
        for idx in perm.split(6):
            for g in opt.param_groups:
                g["lr"] = 1e-2 * min(1.0, (step + 1) / warmup)
            loss = _mse(model, {k: v[idx] for k, v in data.items()})
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            d = min(decay, (1 + step) / (10 + step))
            for k, v in model.state_dict().items():
                ema[k].mul_(d).add_(v.detach(), alpha=1 - d)
            losses.append(float(loss.detach()))
            step += 1
    return model, ema, losses


def _harness_run(epochs: int, *, clip: float, decay: float, warmup: int, wd: float, hooks=None, **kw):
    model = _net()
    config = TrainConfig(epochs, 6, ema_decay=decay, ema_warmup=True, clip_grad_norm=clip, schedule_per_step=True,
                         zero_grad_to_none=True, checkpoint_every=1)
    source = ShuffledBatches(_data(), 6, torch.Generator().manual_seed(5))
    res = train(model, Objective(_mse), source, None, config, [0],
                optimizer=lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=wd),
                scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: min(1.0, (k + 1) / warmup)),
                hooks=hooks, progress=False, **kw)
    return model, res


def test_batch_level_objective_clipping_schedule_and_ema_equal_a_hand_written_loop():
    settings = dict(clip=0.5, decay=0.9, warmup=3, wd=1e-3)
    ref_model, ref_ema, ref_losses = _hand_loop(3, **settings)
    rec = Recorder()
    model, res = _harness_run(3, hooks=rec, **settings)
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    for k, v in ref_ema.items():
        torch.testing.assert_close(res.final_state[k], v, rtol=0, atol=0)
        torch.testing.assert_close(res.best_state[k], v, rtol=0, atol=0)  # no validation: best = final
    assert rec.losses == ref_losses
    # on_step comes after the schedule's step: the rate of the next step
    assert rec.lrs[:3] == pytest.approx([2e-2 / 3, 1e-2, 1e-2]) and rec.epochs == [4, 8, 12]
    assert not any(k.startswith("val_") for k in res.history)


def test_resume_restores_the_hooks_state_and_the_dropout_stream(tmp_path):
    settings = dict(clip=0.5, decay=0.9, warmup=3, wd=0.0)
    full_rec = Recorder()
    _, full = _harness_run(4, hooks=full_rec, **settings)

    def stop(epoch, info):
        if epoch == 2:
            raise Interrupted

    path = tmp_path / "run.pt"
    with pytest.raises(Interrupted):
        _harness_run(4, hooks=Recorder(), checkpoint_path=path, callback=stop, **settings)
    rec = Recorder()
    _, resumed = _harness_run(4, hooks=rec, checkpoint_path=path, resume=True, **settings)
    assert resumed.epochs_run == 2
    assert rec.losses == full_rec.losses and rec.lrs == full_rec.lrs and rec.epochs == full_rec.epochs
    for k, v in full.final_state.items():
        torch.testing.assert_close(resumed.final_state[k], v, rtol=0, atol=0)


def test_early_stopping_on_a_validation_metric_keeps_the_best_epoch():
    """Maximise a score by minimising its negative; patience 1 stops after the first epoch without improvement."""
    scores = iter([1.0, 3.0, 2.0, 5.0])
    seen = []

    def metrics(model, batch, generator):
        value = next(scores)
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"neg_score": torch.tensor(-value, dtype=torch.float64)}

    model = _net()
    config = TrainConfig(4, 5, select_metric="neg_score", patience=1)
    res = train(model, Objective(_mse, metrics), ShuffledBatches(_data(), 5, torch.Generator().manual_seed(0)),
                [_data(8, seed=1)], config, [0], progress=False)
    assert res.epochs_run == 3 and int(res.best_epoch[0]) == 2 and float(res.best_value[0]) == -3.0
    assert int(res.stopped_epoch[0]) == 3
    for k, v in seen[1].items():
        torch.testing.assert_close(res.best_state[k], v, rtol=0, atol=0)


def test_per_item_losses_average_into_train_loss_and_on_epoch_sees_it():
    data = _data()
    curve = []

    def per_item(model, batch):
        return (model(batch["x"]) - batch["y"]).square().squeeze(-1)  # (b,)

    model = _net()
    source = ShuffledBatches(data, 8, torch.Generator().manual_seed(1))
    train(model, Objective(per_item), source, None, TrainConfig(2, 8), [0], progress=False,
          hooks=OnEpoch(lambda tr, m: curve.append(float(m["train_loss"][0]))))
    assert len(curve) == 2 and all(math.isfinite(c) for c in curve)


def test_nonfinite_loss_raises_naming_the_run():
    def bad(model, batch):
        return model(batch["x"]).sum() * math.nan

    with pytest.raises(FloatingPointError, match=r"unit A, epoch 1: non-finite loss at step 0"):
        train(_net(), Objective(bad), ShuffledBatches(_data(), 4, torch.Generator()), None,
              TrainConfig(1, 4, raise_nonfinite=True), [0], progress=False, desc="unit A")


def test_shuffled_batches_drop_last_max_steps_and_redraw_order():
    data = {"x": torch.arange(10.0)}
    calls = []

    def redraw(d, g):
        calls.append(g.get_state().clone())
        return d

    gen = torch.Generator().manual_seed(3)
    src = ShuffledBatches(data, 4, gen, redraw=redraw, drop_last=True, max_steps=3)
    first = [b["x"] for b, n in src.epoch(0)]
    second = [b["x"] for b, n in src.epoch(1)]
    assert [len(b) for b in first] == [4, 4] and [len(b) for b in second] == [4]
    ref = torch.Generator().manual_seed(3)
    perm = torch.randperm(10, generator=ref)
    assert torch.equal(calls[0], ref.get_state())  # the redraw comes after the epoch's permutation
    assert torch.equal(torch.cat(first), perm[:8].float())
    assert len(list(ShuffledBatches({"x": torch.zeros(3)}, 4, gen, drop_last=True).epoch(0))) == 1  # N < B


def test_merge_members_of_a_single_plain_module_takes_whole_states():
    bn = nn.BatchNorm1d(2)  # has a 0-dim buffer
    a = {k: v.clone() for k, v in bn.state_dict().items()}
    b = {k: v + 1 for k, v in a.items()}
    taken = merge_members(bn, a, b, torch.tensor([True]))
    kept = merge_members(bn, a, b, torch.tensor([False]))
    for k in a:
        assert torch.equal(taken[k], b[k]) and torch.equal(kept[k], a[k]) and taken[k].shape == a[k].shape
        assert taken[k].data_ptr() != b[k].data_ptr()  # copies, not aliases of live parameters


def test_study_template_writes_the_document_and_removes_checkpoints(tmp_path):
    from hardeq_studies.contract import Study

    class Tiny(Study):
        def execute(self, run):
            run.checkpoint_dir.mkdir(parents=True)
            run.checkpoint.write_bytes(b"x")
            return {"value": len(run.trials) * run.epochs}

        def document(self, run, result, wall):
            return {"config": run.settings, "records": [{"metric": "value", "mean": result["value"]}],
                    "device": run.device}

        def markdown(self, doc, out):
            return f"value {doc['records'][0]['mean']}\n"

    presets = {p: {"seeds": 2, "epochs": 3, "description": "", "duration": ""} for p in ("quick", "cpu", "paper")}
    study = Tiny("tiny", {"summary": "a tiny study", "presets": presets})
    args = argparse.Namespace(preset="quick", seeds=None, epochs=5, out=tmp_path, resume=False, device=None,
                              quiet=True)
    doc = study.run(args)
    assert doc["records"][0]["mean"] == 10 and doc["command"] == "hardeq reproduce tiny --preset quick"
    assert json.loads((tmp_path / "tiny.json").read_text())["records"] == doc["records"]
    assert not (tmp_path / "checkpoints").exists()
    assert study.report(doc, tmp_path, quiet=True) == [tmp_path / "tiny.md"]
    assert (tmp_path / "tiny.md").read_text() == "value 10\n"
