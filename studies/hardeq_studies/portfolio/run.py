"""Running the ``portfolio`` study: settings of a preset, one training unit (method x run), all units.

Every unit (one method, one run) is deterministic given its run index: the run seeds the initial network
(the same for every method of a run: ours only adds a log-variance output whose weights start at 0), the
batch order and the noise. Units are computed run-major and checkpointed atomically after each one
(:func:`hardeq_studies.harness.run_blocks`), so ``--resume`` continues after the last finished unit.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..harness import Hooks, Objective, ShuffledBatches, TrainConfig, run_blocks, train
from .classical import CLASSICAL, classical_weights
from .data import PortfolioData, load_data
from .models import StemGNN
from .task import METHODS, OURS, WeightHead, loss, portfolio_stats

__all__ = ["settings", "prepare", "train_unit", "evaluate", "run"]

#: per-window metrics kept for every method
METRICS = ("sharpe", "ann_return", "ann_vol", "short_share", "sum_residual")


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def settings(config: dict[str, Any], preset: str) -> dict[str, Any]:
    """The protocol of ``preset``: ``config["protocol"]`` overridden by the preset's ``data``/``model``/``train``
    entries, plus its ``seeds``, ``epochs`` and ``device``."""
    if preset not in config["presets"]:
        raise ValueError(f"preset must be one of {sorted(config['presets'])}, got {preset!r}.")
    p = config["presets"][preset]
    s = _merge(config["protocol"], {k: p[k] for k in ("data", "model", "train") if k in p})
    s.update({k: p[k] for k in ("seeds", "epochs", "device") if k in p})
    return s


def prepare(s: dict[str, Any]) -> PortfolioData:
    """The data of protocol ``s``."""
    d = s["data"]
    return load_data(d["dataset"], d["periods"], d["window"], d["horizon"], train_stride=d["train_stride"],
                     eval_stride=d["eval_stride"], val_stride=d.get("val_stride"), num_assets=d["num_assets"],
                     asset_seed=d["asset_seed"])


def build_model(s: dict[str, Any], data: PortfolioData, method: str, seed: int) -> StemGNN:
    """The StemGNN of ``method`` for run ``seed``: the same initial network for every method of a run."""
    m = s["model"]
    torch.manual_seed(seed)
    model = StemGNN(data.num_assets, data.window, data.horizon, stacks=m["stacks"], order=m["order"],
                    multi=m["multi"], modes=m["modes"], gru_hidden=m["gru_hidden"], gru_chunk=m["gru_chunk"],
                    dropout=m["dropout"], weight_outputs=1, leaky_slope=m["leaky_slope"])
    if method in OURS:  # add the log-variance output; the mean output keeps the shared initialisation
        old = model.weight_head[-1]
        new = torch.nn.Linear(old.in_features, 2)
        with torch.no_grad():
            new.weight.zero_()
            new.weight[0] = old.weight[0]
            new.bias[0] = old.bias[0]
            new.bias[1] = float(m["init_log_var"])
        model.weight_head[-1] = new
    return model


@torch.no_grad()
def evaluate(model: StemGNN, head: WeightHead, split: dict[str, Tensor], *, rf: float, days: int,
             batch_size: int = 64) -> tuple[Tensor, dict[str, Tensor]]:
    """Weights ``(K, N)`` of every window of ``split`` (ours: conditional mean) and their per-window metrics.

    The network runs in its own precision; the weight head (softmax, projection, constraint layer, or the
    conditional mean) is applied to its outputs in float64, so every weight vector sums to 1 to float64
    round-off."""
    model.eval()
    ws = []
    for i in range(0, split["inputs"].shape[0], batch_size):
        _, raw = model(split["inputs"][i: i + batch_size] - 1)
        ws.append(head.weights(raw.to(torch.float64)))
    w = torch.cat(ws)
    return w, portfolio_stats(w, split["returns"].to(torch.float64), rf=rf, days=days)


def train_unit(s: dict[str, Any], data: PortfolioData, tensors: dict[str, dict[str, Tensor]], method: str,
               run: int, *, epochs: int, device: torch.device) -> dict[str, Any]:
    """Train ``method`` in run ``run`` with early stopping on the validation Sharpe; evaluate on the test windows.

    Returns a checkpointable dict: ``test`` (per-window metrics, float64 tensors), ``weights`` (test weights
    ``(K, N)``, float32), ``curve`` (per epoch: train loss, train MSE, train Sharpe, val Sharpe), ``best_epoch``
    (1-based), ``val_sharpe``, ``seconds``."""
    t0 = time.perf_counter()
    tr = s["train"]
    seed = int(s["seed_base"]) + run
    model = build_model(s, data, method, seed).to(device)
    head = WeightHead(method, data.num_assets, variance_floor=tr["variance_floor"], mc_samples=tr["mc_samples"])
    rf, days = float(s["rf"]), int(s["days"])

    def objective(model: StemGNN, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        forecast, raw = model(batch["inputs"] - 1)
        value, info = loss(head, forecast, raw, batch["future"], batch["returns"], w_pred=tr["w_pred"],
                           w_sharpe=tr["w_sharpe"], rf=rf, days=days)
        return value, {k: torch.tensor(v, dtype=torch.float64) for k, v in info.items()}

    def val_metrics(model: StemGNN, split: dict[str, Tensor], generator: Any) -> dict[str, Tensor]:
        return {"neg_sharpe": -evaluate(model, head, split, rf=rf, days=days)[1]["sharpe"].mean()}

    train_split = {k: tensors["train"][k] for k in ("inputs", "future", "returns")}
    source = ShuffledBatches(train_split, int(tr["batch_size"]), torch.Generator().manual_seed(seed))
    curve = _Curve(source.batches_per_epoch())
    config = TrainConfig(epochs, int(tr["batch_size"]), select_metric="neg_sharpe", patience=int(tr["patience"]),
                         clip_grad_norm=float(tr["clip_grad_norm"]), zero_grad_to_none=True)
    res = train(model, Objective(objective, val_metrics), source, [tensors["val"]], config, [seed],
                optimizer=lambda params: torch.optim.Adam(params, lr=tr["lr"], weight_decay=tr["weight_decay"]),
                hooks=curve, progress=False, desc=f"portfolio {method} run {run}")
    model.load_state_dict(res.best_state)
    w, stats = evaluate(model, head, tensors["test"], rf=rf, days=days)
    return {"test": {k: stats[k] for k in (*METRICS, "cum_return")}, "weights": w.to(torch.float32),
            "curve": torch.tensor(curve.rows, dtype=torch.float64), "best_epoch": int(res.best_epoch[0]),
            "val_sharpe": -float(res.best_value[0]),
            "seconds": time.perf_counter() - t0}


class _Curve(Hooks):
    """Per epoch: the mean over its batches of the training loss, MSE and Sharpe, and the validation Sharpe."""

    def __init__(self, batches: int) -> None:
        self.batches, self.rows, self.totals = batches, [], [0.0, 0.0, 0.0]

    def on_step(self, trainer: Any, loss: Tensor, extra: dict[str, Tensor]) -> None:
        for i, value in enumerate((loss, extra["mse"], extra["sharpe"])):
            self.totals[i] += float(value) / self.batches

    def on_epoch(self, trainer: Any, metrics: dict[str, Tensor]) -> None:
        self.rows.append([*self.totals, -float(metrics["val_neg_sharpe"][0])])
        self.totals = [0.0, 0.0, 0.0]


def classical_unit(s: dict[str, Any], tensors: dict[str, dict[str, Tensor]]) -> dict[str, Any]:
    """Weights and per-window test metrics of every classical allocation (deterministic), and its mean
    validation Sharpe (``val_sharpe``, on the validation windows the trained methods are selected on)."""
    t0 = time.perf_counter()
    test, val = tensors["test"], tensors["val"]
    out: dict[str, Any] = {}
    for m in CLASSICAL:
        w = classical_weights(m, test["past_returns"].to(torch.float64), rf=s["rf"], days=s["days"])
        stats = portfolio_stats(w, test["returns"].to(torch.float64), rf=s["rf"], days=s["days"])
        wv = classical_weights(m, val["past_returns"].to(torch.float64), rf=s["rf"], days=s["days"])
        vstats = portfolio_stats(wv, val["returns"].to(torch.float64), rf=s["rf"], days=s["days"])
        out[m] = {"test": {k: stats[k] for k in (*METRICS, "cum_return")}, "weights": w.to(torch.float32),
                  "val_sharpe": float(vstats["sharpe"].mean())}
    out["seconds"] = time.perf_counter() - t0
    return out


def run(s: dict[str, Any], runs: Sequence[int], *, epochs: int, methods: Sequence[str] | None = None,
        checkpoint_path: Path | None = None, resume: bool = False, device: str | torch.device = "cpu",
        progress: bool = True, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """All units of protocol ``s``: the classical allocations, then every (run, method), run-major.

    Returns ``{"data": PortfolioData, "classical": {...}, "units": {(method, run): unit}, "timing": {...}}``."""
    methods = list(methods or METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; available: {list(METHODS)}.")
    device = torch.device(device)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    data = prepare(s)
    tensors = {k: {kk: vv.to(device) for kk, vv in w.tensors(torch.float32).items()} for k, w in data.splits.items()}
    cpu_tensors = {k: w.tensors(torch.float32) for k, w in data.splits.items()}
    blocks: dict[str, Callable[[], Any]] = {"classical": lambda: classical_unit(s, cpu_tensors)}
    for r in runs:
        for m in methods:
            blocks[f"run{r}/{m}"] = (lambda m=m, r=r: _to_cpu(train_unit(s, data, tensors, m, r, epochs=epochs,
                                                                        device=device)))
    t0 = time.perf_counter()
    done = [0]

    def on_block(key: str, res: dict[str, Any]) -> None:
        done[0] += 1
        if progress:
            extra = ""
            if key != "classical":
                extra = (f" test Sharpe {float(res['test']['sharpe'].mean()):.3f}, val {res['val_sharpe']:.3f} "
                         f"(epoch {res['best_epoch']}/{len(res['curve'])})")
            log(f"[portfolio] {done[0]}/{len(blocks)} {key}: {res['seconds']:.1f} s{extra}; "
                f"elapsed {time.perf_counter() - t0:.0f} s")

    run_id = {"settings": s, "runs": list(runs), "epochs": epochs, "methods": methods}
    res = run_blocks(blocks, checkpoint_path=checkpoint_path, resume=resume, run_id=run_id, on_block=on_block)
    units = {(m, r): res[f"run{r}/{m}"] for r in runs for m in methods}
    seconds = {m: sum(units[(m, r)]["seconds"] for r in runs) for m in methods}
    return {"data": data, "classical": res["classical"], "units": units, "methods": methods, "runs": list(runs),
            "timing": {"train_s_per_method": seconds, "classical_s": res["classical"]["seconds"]}}


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj
