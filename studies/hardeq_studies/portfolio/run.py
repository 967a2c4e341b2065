"""Running the ``portfolio`` study: settings of a preset, one training unit (method x run), all units.

Every unit (one universe, one method, one run) is deterministic given its run index: the run seeds the
initial network (the same for every method of a run: ours only adds a log-variance output, drawn from its
own seeded generator), the batch order and the noise. Units are computed universe by universe, run-major,
and checkpointed atomically after each one (:func:`hardeq_studies.harness.run_blocks`), so ``--resume``
continues after the last finished unit.
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
from .task import METHODS, OURS, WeightHead, loss, portfolio_stats, selection_score

__all__ = ["settings", "prepare", "train_unit", "evaluate", "run"]

#: per-window metrics kept for every method
METRICS = ("sharpe", "ann_return", "ann_vol", "short_share", "sum_residual")
#: per-window diagnostics kept for the ours methods (:meth:`WeightHead.diagnostics`)
DIAGNOSTICS = ("var_cv", "var_ratio", "gap_to_projection")


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def settings(config: dict[str, Any], preset: str) -> dict[str, Any]:
    """The protocol of ``preset``: ``config["protocol"]`` overridden by the preset's ``data``/``model``/``train``
    entries, plus its ``seeds``, ``epochs``, ``device`` and ``universes`` (which replace the protocol's).

    ``universes`` maps a universe's name (the records' ``dataset``) to its overrides of ``data`` (e.g. the
    number of stocks); every universe is trained and tested on its own."""
    if preset not in config["presets"]:
        raise ValueError(f"preset must be one of {sorted(config['presets'])}, got {preset!r}.")
    p = config["presets"][preset]
    s = _merge(config["protocol"], {k: p[k] for k in ("data", "model", "train") if k in p})
    s.update({k: copy.deepcopy(p[k]) for k in ("seeds", "epochs", "device", "universes") if k in p})
    if "long_only" in p and "long_only" in s:  # the preset's draws / burn-in of the long-only variant
        s["long_only"] = {**s["long_only"], **p["long_only"]}
    if not isinstance(s.get("universes"), dict) or not s["universes"]:
        raise ValueError(f"preset {preset!r}: universes must be a non-empty mapping name -> data overrides.")
    return s


def prepare(s: dict[str, Any], universe: str) -> PortfolioData:
    """The data of ``universe`` (a key of ``s["universes"]``) under protocol ``s``."""
    if universe not in s["universes"]:
        raise ValueError(f"universe must be one of {list(s['universes'])}, got {universe!r}.")
    d = _merge(s["data"], s["universes"][universe])
    return load_data(d["dataset"], d["periods"], d["window"], d["horizon"], train_stride=d["train_stride"],
                     eval_stride=d["eval_stride"], val_stride=d.get("val_stride"), num_assets=d["num_assets"],
                     asset_seed=d["asset_seed"])


def build_model(s: dict[str, Any], data: PortfolioData, method: str, seed: int) -> StemGNN:
    """The StemGNN of ``method`` for run ``seed``: the same initial network for every method of a run.

    Ours adds a log-variance output ``s`` to the weight head's last layer and a learned per-stock bias of it
    (:class:`~.models.StemGNN`'s ``log_var_bias``), both drawn from a generator seeded with ``10000 + seed``:
    the layer's new row ``U(-b, b)`` with ``b = 1 / sqrt(fan_in)`` (PyTorch's default bound for a linear layer),
    its bias ``model.init_log_var``, and the per-stock bias ``N(0, model.log_var_init_std^2)``. The network's
    features are nearly equal across stocks at initialisation (their std over stocks is about 1e-5), so the
    per-stock bias is what makes the variances differ from the first step (with equal variances the conditional
    mean *is* the KKT projection). The rest of the network, the mean output included, stays identical to the
    other methods' of the run."""
    m = s["model"]
    torch.manual_seed(seed)
    model = StemGNN(data.num_assets, data.window, data.horizon, stacks=m["stacks"], order=m["order"],
                    multi=m["multi"], modes=m["modes"], gru_hidden=m["gru_hidden"], gru_chunk=m["gru_chunk"],
                    dropout=m["dropout"], weight_outputs=1, leaky_slope=m["leaky_slope"])
    if method in OURS:  # add the log-variance output; the mean output keeps the shared initialisation
        old = model.weight_head[-1]
        new = torch.nn.Linear(old.in_features, 2)
        gen = torch.Generator().manual_seed(10000 + seed)
        bound = 1.0 / old.in_features ** 0.5
        with torch.no_grad():
            new.weight[0] = old.weight[0]
            new.bias[0] = old.bias[0]
            new.weight[1] = (2 * torch.rand(old.in_features, generator=gen, dtype=new.weight.dtype) - 1) * bound
            new.bias[1] = float(m["init_log_var"])
            model.weight_head[-1] = new
            model.log_var_bias = torch.nn.Parameter(
                float(m["log_var_init_std"]) * torch.randn(data.num_assets, generator=gen))
    return model


@torch.no_grad()
def evaluate(model: StemGNN, head: WeightHead, split: dict[str, Tensor], *, rf: float, days: int,
             batch_size: int = 64) -> tuple[Tensor, dict[str, Tensor]]:
    """Weights ``(K, N)`` of every window of ``split`` (ours: conditional mean) and their per-window metrics
    (for ours also :meth:`WeightHead.diagnostics`: variance dispersion and distance to the KKT projection).

    The network runs in its own precision; the weight head (softmax, projection, constraint layer, or the
    conditional mean) is applied to its outputs in float64, so every weight vector sums to 1 to float64
    round-off."""
    model.eval()
    raws = []
    for i in range(0, split["inputs"].shape[0], batch_size):
        raws.append(model(split["inputs"][i: i + batch_size] - 1)[1].to(torch.float64))
    raw = torch.cat(raws)
    w = head.weights(raw)
    stats = portfolio_stats(w, split["returns"].to(torch.float64), rf=rf, days=days)
    if head.method in OURS:
        stats.update(head.diagnostics(raw))
    return w, stats


def train_unit(s: dict[str, Any], data: PortfolioData, tensors: dict[str, dict[str, Tensor]], method: str,
               run: int, *, epochs: int, device: torch.device) -> dict[str, Any]:
    """Train ``method`` in run ``run``, select an epoch on the validation Sharpe, evaluate on the test windows.

    Model selection (:func:`selection_options`, :func:`~.task.selection_score`): after every epoch the mean
    validation Sharpe is recorded; from epoch ``min_epochs`` on, the epoch whose trailing mean of the last
    ``smooth`` validation Sharpe ratios is the highest so far is kept; training stops ``patience`` epochs after
    the last improvement (``patience > min_epochs - 1``, so never before ``min_epochs``).

    Returns a checkpointable dict: ``test`` (per-window metrics, float64 tensors), ``weights`` (test weights
    ``(K, N)``, float32), ``curve`` (per epoch: train loss, train MSE, train Sharpe, val Sharpe), ``best_epoch``
    (1-based, the selected epoch), ``val_sharpe`` (its smoothed validation Sharpe), ``seconds``.

    ``method`` :data:`~.bounds.TRAINED` (the long-only variant's network trained through the truncated likelihood,
    portfolio/bounds.py) starts from ``ours``'s initialisation, selects on the validation Sharpe of its truncated
    mode and returns only ``long_only`` (its rules), ``long_only_sampler``, ``curve``, ``best_epoch``,
    ``val_sharpe`` and ``seconds``."""
    from .bounds import TRAINED

    t0 = time.perf_counter()
    tr = s["train"]
    seed = int(s["seed_base"]) + run
    trained = method == TRAINED
    base = "ours" if trained else method
    model = build_model(s, data, base, seed).to(device)
    head = WeightHead(base, data.num_assets, variance_floor=tr["variance_floor"], mc_samples=tr["mc_samples"])
    rf, days = float(s["rf"]), int(s["days"])
    if trained:
        from .bounds import long_only_targets, truncated_mode_weights, truncated_nll

        cfg = s["long_only"]["trained"]
        chains: dict[str, Any] = {"num_chains": int(cfg["chains"]), "sweeps": int(cfg["sweeps"])}

    def objective(model: StemGNN, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        forecast, raw = model(batch["inputs"] - 1)
        if trained:
            mse = (forecast - (batch["future"] - 1)).square().mean()
            nll = truncated_nll(head, raw, batch["target"], chains)
            value = float(tr["w_pred"]) * mse + nll.to(mse.dtype)
            with torch.no_grad():
                sr = portfolio_stats(head.weights(raw.detach().to(torch.float64)),
                                     batch["returns"].to(torch.float64), rf=rf, days=days)["sharpe"].mean()
            info = {"mse": float(mse.detach()), "sharpe": float(sr)}
        else:
            value, info = loss(head, forecast, raw, batch["future"], batch["returns"], w_pred=tr["w_pred"],
                               w_sharpe=tr["w_sharpe"], rf=rf, days=days)
        return value, {k: torch.tensor(v, dtype=torch.float64) for k, v in info.items()}

    min_epochs, smooth = selection_options(tr, epochs)
    history: list[float] = []

    def val_metrics(model: StemGNN, split: dict[str, Tensor], generator: Any) -> dict[str, Tensor]:
        if trained:
            from .bounds import test_outputs

            w = truncated_mode_weights(head, test_outputs(model, split["inputs"]))
            history.append(float(portfolio_stats(w, split["returns"].to(torch.float64), rf=rf,
                                                 days=days)["sharpe"].mean()))
        else:
            history.append(float(evaluate(model, head, split, rf=rf, days=days)[1]["sharpe"].mean()))
        return {"neg_sharpe": torch.tensor(-history[-1], dtype=torch.float64),
                "select": torch.tensor(selection_score(history, min_epochs, smooth), dtype=torch.float64)}

    train_split = {k: tensors["train"][k] for k in ("inputs", "future", "returns")}
    if trained:
        train_split["target"] = long_only_targets(train_split["returns"], rf=rf, days=days).to(
            device=train_split["returns"].device, dtype=train_split["returns"].dtype)
    source = ShuffledBatches(train_split, int(tr["batch_size"]), torch.Generator().manual_seed(seed))
    curve = _Curve(source.batches_per_epoch())
    config = TrainConfig(epochs, int(tr["batch_size"]), select_metric="select", patience=int(tr["patience"]),
                         clip_grad_norm=float(tr["clip_grad_norm"]), zero_grad_to_none=True)
    res = train(model, Objective(objective, val_metrics), source, [tensors["val"]], config, [seed],
                optimizer=lambda params: torch.optim.Adam(params, lr=tr["lr"], weight_decay=tr["weight_decay"]),
                hooks=curve, progress=False, desc=f"portfolio {method} run {run}")
    model.load_state_dict(res.best_state)
    if trained:  # the long-only rules of this network only (portfolio/bounds.py)
        from .bounds import long_only_stats, long_only_weights, test_outputs

        lo = s["long_only"]
        rules, sampler = long_only_weights(head, test_outputs(model, tensors["test"]["inputs"]), draws=int(lo["draws"]),
                                           chains=int(lo["chains"]), burn_in=int(lo["burn_in"]), seed=seed)
        return {"long_only": long_only_stats(rules, tensors["test"]["returns"], rf=rf, days=days),
                "long_only_sampler": sampler, "curve": torch.tensor(curve.rows, dtype=torch.float64),
                "best_epoch": int(res.best_epoch[0]), "val_sharpe": -float(res.best_value[0]),
                "seconds": time.perf_counter() - t0}
    w, stats = evaluate(model, head, tensors["test"], rf=rf, days=days)
    keep = (*METRICS, *DIAGNOSTICS, "cum_return") if method in OURS else (*METRICS, "cum_return")
    out = {"test": {k: stats[k] for k in keep}, "weights": w.to(torch.float32),
           "curve": torch.tensor(curve.rows, dtype=torch.float64), "best_epoch": int(res.best_epoch[0]),
           "val_sharpe": -float(res.best_value[0])}
    if method == "ours" and s.get("long_only"):  # the long-only decision rules on the same trained network
        from .bounds import long_only_stats, long_only_weights, test_outputs

        raw = test_outputs(model, tensors["test"]["inputs"])
        lo = s["long_only"]
        rules, sampler = long_only_weights(head, raw, draws=int(lo["draws"]), chains=int(lo["chains"]),
                                           burn_in=int(lo["burn_in"]), seed=seed)
        out["long_only"] = long_only_stats(rules, tensors["test"]["returns"], rf=rf, days=days)
        out["long_only_sampler"] = sampler
    return {**out, "seconds": time.perf_counter() - t0}


def selection_options(train: dict[str, Any], epochs: int) -> tuple[int, int]:
    """``(min_epochs, smooth)`` of the selection rule for a run of at most ``epochs`` epochs: the configured
    values, capped at ``epochs`` (so a short smoke run still selects its last epoch). Raises ``ValueError``
    unless ``1 <= smooth <= min_epochs <= patience``."""
    min_epochs, smooth, patience = int(train["min_epochs"]), int(train["smooth"]), int(train["patience"])
    if not 1 <= smooth <= min_epochs <= patience:
        raise ValueError(f"train settings: need 1 <= smooth <= min_epochs <= patience, got smooth={smooth}, "
                         f"min_epochs={min_epochs}, patience={patience}.")
    min_epochs = min(min_epochs, int(epochs))
    return min_epochs, min(smooth, min_epochs)


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
    """All units of protocol ``s``: per universe, the classical allocations, then every (run, method),
    run-major.

    Returns ``{"universes": {name: {"data": PortfolioData, "classical": {...}, "units": {(method, run): unit},
    "timing": {...}}}, "methods", "runs"}``."""
    methods = list(methods or METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; available: {list(METHODS)}.")
    device = torch.device(device)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    datas = {u: prepare(s, u) for u in s["universes"]}
    blocks: dict[str, Callable[[], Any]] = {}
    for u, data in datas.items():
        blocks.update(_universe_blocks(s, u, data, runs, methods, epochs, device))
    t0 = time.perf_counter()
    done = [0]

    def on_block(key: str, res: dict[str, Any]) -> None:
        done[0] += 1
        if progress:
            extra = ""
            if "test" in res:
                extra = (f" test Sharpe {float(res['test']['sharpe'].mean()):.3f}, val {res['val_sharpe']:.3f} "
                         f"(epoch {res['best_epoch']}/{len(res['curve'])})")
            log(f"[portfolio] {done[0]}/{len(blocks)} {key}: {res['seconds']:.1f} s{extra}; "
                f"elapsed {time.perf_counter() - t0:.0f} s")

    run_id = {"settings": s, "runs": list(runs), "epochs": epochs, "methods": methods}
    res = run_blocks(blocks, checkpoint_path=checkpoint_path, resume=resume, run_id=run_id, on_block=on_block)
    from .bounds import TRAINED

    out = {}
    for u, data in datas.items():
        units = {(m, r): res[f"{u}/run{r}/{m}"] for r in runs for m in methods}
        seconds = {m: sum(units[(m, r)]["seconds"] for r in runs) for m in methods}
        if all(f"{u}/run{r}/{TRAINED}" in res for r in runs):  # the long-only variant's trained network
            units.update({(TRAINED, r): res[f"{u}/run{r}/{TRAINED}"] for r in runs})
            seconds[TRAINED] = sum(units[(TRAINED, r)]["seconds"] for r in runs)
        out[u] = {"data": data, "classical": res[f"{u}/classical"], "units": units,
                  "timing": {"train_s_per_method": seconds, "classical_s": res[f"{u}/classical"]["seconds"]}}
    return {"universes": out, "methods": methods, "runs": list(runs)}


def _universe_blocks(s: dict[str, Any], universe: str, data: PortfolioData, runs: Sequence[int],
                     methods: Sequence[str], epochs: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    """The checkpointable units of one universe, keyed ``UNIVERSE/classical`` and ``UNIVERSE/runR/METHOD``."""
    tensors = {k: {kk: vv.to(device) for kk, vv in w.tensors(torch.float32).items()} for k, w in data.splits.items()}
    cpu_tensors = {k: w.tensors(torch.float32) for k, w in data.splits.items()}
    blocks: dict[str, Callable[[], Any]] = {f"{universe}/classical": lambda: classical_unit(s, cpu_tensors)}
    from .bounds import TRAINED

    with_trained = "ours" in methods and bool((s.get("long_only") or {}).get("trained"))
    for r in runs:
        for m in [*methods, *([TRAINED] if with_trained else [])]:
            blocks[f"{universe}/run{r}/{m}"] = (lambda m=m, r=r: _to_cpu(train_unit(s, data, tensors, m, r,
                                                                                   epochs=epochs, device=device)))
    return blocks


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj
