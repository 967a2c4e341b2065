"""Running the ``chemical`` study: every method x seed trained as one batched model per data set, then
evaluated; data sets (or parts of the largest one) in parallel processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..harness import DistContext, TrainConfig, evaluate, run_units, train
from .data import load_dataset
from .models import build_model
from .task import OURS, ChemicalTask

__all__ = ["DTYPES", "run", "run_dataset", "training_units"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _summary(values: Tensor) -> tuple[float, float]:
    v = values.to(torch.float64)
    return float(v.mean()), float(v.std(unbiased=True)) if v.numel() > 1 else 0.0


def _paper(config: Mapping[str, Any], dataset: str, method: str) -> tuple[float | None, float | None]:
    p = config["paper"]
    if method not in p["methods"] or dataset not in p:
        return None, None
    mean, std = p[dataset][p["methods"].index(method)]
    return mean * p["unit"], std * p["unit"]


def make_task(name: str, config: Mapping[str, Any], methods: Sequence[str], num_seeds: int,
              dtype: torch.dtype, device: torch.device):
    """The data set ``name`` and its :class:`ChemicalTask` as the config describes them."""
    data = load_dataset(name, config)
    ours = config["ours"]
    spec = config.get("nonnegative_flows") or {}
    lower = None
    if "lower" in spec and name in spec["lower"]:
        from .bounds import lower_bounds

        lower = lower_bounds(spec["lower"][name], len(spec["lower"][name]))
    task = ChemicalTask(data, methods, num_seeds, pinn_weight=config["pinn_weight"],
                        variance_floor=ours["variance_floor"], beta=ours.get("beta_nll", 0.5),
                        same_init=ours.get("same_init", False),
                        ecnn_dependent=config["datasets"][name]["ecnn_dependent"], dtype=dtype, device=device,
                        lower=lower, chains=int(ours.get("tnll_chains", 4)), sweeps=int(ours.get("tnll_sweeps", 4)))
    return data, task


def run_dataset(name: str, config: Mapping[str, Any], seeds: Sequence[int], *, epochs: int,
                methods: Sequence[str] | None = None, dtype: str | None = None, checkpoint_dir: Path | None = None,
                resume: bool = False, progress: bool = True, callback: Callable[[str, int, dict], None] | None = None,
                ctx: DistContext | None = None, position: int = 0, part: str = "") -> dict[str, Any]:
    """Train every method (x every seed, as one batched model) on data set ``name`` and evaluate it.

    ``part`` names a subset of the methods trained separately (checkpoint ``chemical-NAME-PART.pt``).
    Returns ``{"records", "curves", "per_seed", "seconds", "cpu_seconds"}`` (see :func:`run`).
    """
    ctx = ctx or DistContext()
    methods = list(methods or config["methods"])
    torch_dtype = DTYPES[dtype or config["dtype"]]
    seeds = [int(s) for s in seeds]
    S = len(seeds)
    t0, c0 = time.perf_counter(), time.process_time()
    tc = config["train"]
    train_cfg = TrainConfig(epochs=int(epochs), batch_size=int(tc["batch_size"]), lr=float(tc["lr"]),
                            select_metric=tc["select_metric"], checkpoint_every=int(tc["checkpoint_every"]))
    data, task = make_task(name, config, methods, S, torch_dtype, ctx.device)
    model = build_model(task, data.x.shape[1], seeds, config["model"], dtype=torch_dtype, device=ctx.device)
    member_seeds = task.member_seeds(seeds)
    splits = {s: data.tensors(s, torch_dtype, ctx.device) for s in ("train", "val", "test")}
    label = f"{name}-{part}" if part else name
    ckpt = None if checkpoint_dir is None else Path(checkpoint_dir) / f"chemical-{label}.pt"
    cb = None if callback is None else (lambda epoch, info: callback(name, epoch, info))
    run_id = {"study": "chemical", "dataset": name, "layout": task.layout, "seeds": seeds, "dtype": str(torch_dtype),
              "model": config["model"], "pinn_weight": config["pinn_weight"], "ours": config["ours"],
              "data": config["datasets"][name]}
    if task.lower is not None and "ours-tNLL" in methods:  # the truncation it is trained through
        run_id["tnll_lower"] = [float(v) for v in task.lower]
    result = train(model, task, splits["train"], splits["val"], train_cfg, member_seeds, checkpoint_path=ckpt,
                   resume=resume, progress=progress, desc=label, callback=cb, ctx=ctx, position=position,
                   log_every=int(tc.get("log_every", 0)), run_id=run_id)
    test_best = evaluate(model, task, splits["test"], result.best_state)
    test_last = evaluate(model, task, splits["test"], result.final_state)
    val_best = evaluate(model, task, splits["val"], result.best_state)
    records: list[dict[str, Any]] = []
    per_seed: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    for m in methods:
        sl = task.slices[m]
        metrics = {
            "test_mse": test_best["mse"][sl], "violation": test_best["violation"][sl], "val_mse": val_best["mse"][sl],
            "test_mse_last_epoch": test_last["mse"][sl], "violation_last_epoch": test_last["violation"][sl],
            "best_epoch": result.best_epoch[sl].to(torch.float64),
        }
        if m in OURS:
            metrics["mean_log_variance"] = test_best["log_var"][sl]
        per_seed[m] = {k: [float(v) for v in t.cpu()] for k, t in metrics.items()}
        for metric, values in metrics.items():
            mean, std = _summary(values.cpu())
            rec: dict[str, Any] = {"dataset": name, "method": m, "metric": metric, "mean": mean, "std": std,
                                   "n_seeds": S}
            if metric == "test_mse":
                rec["paper"], rec["paper_std"] = _paper(config, name, m)
            records.append(rec)
        curves[m] = {k.removesuffix("_mse"): [float(v) for v in result.history[k][:, sl].mean(1)]
                     for k in ("train_mse", "val_mse") if k in result.history}
        if m in OURS and "val_log_var" in result.history:
            curves[m]["val_log_var"] = [float(v) for v in result.history["val_log_var"][:, sl].mean(1)]
    nonneg = _nonnegative_flows(config, name, task, model, splits["test"], result.best_state, methods, seeds)
    return {"records": records, "curves": curves, "per_seed": per_seed, "nonnegative_flows": nonneg,
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


def _nonnegative_flows(config: Mapping[str, Any], name: str, task: ChemicalTask, model: torch.nn.Module,
                       test: dict[str, Tensor], state: Mapping[str, Tensor], methods: Sequence[str],
                       seeds: Sequence[int]) -> dict[str, Any]:
    """The non-negative-flows variant (chemical/bounds.py) of the methods of ``config["nonnegative_flows"]``
    trained in this unit: ``{method: {rule: {metric: [per seed]}, "sampler": [per seed]}}`` on the test set at the
    selected parameters (``{}`` when the config has no such entry or none of its methods is here)."""
    spec = config.get("nonnegative_flows")
    chosen = [m for m in (spec or {}).get("methods", []) if m in methods and m in task.ours]
    if not chosen:
        return {}
    from .bounds import evaluate_rules, lower_bounds, nonnegative_rules

    from hardeq import ConstrainedNormal, LinearConstraint

    lower = lower_bounds(spec["lower"][name], task.n)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        outputs = task.ours_outputs(task.forward(model, test))  # (M_ours, N, 2n)
        k = task.constraint_value(test["x"])
        B64, k64 = task.B.to(torch.float64), k.to(torch.float64)
        out: dict[str, Any] = {}
        for m in chosen:
            rows = task._rel(m)
            per = {rule: {metric: [] for metric in ("test_mse", "negative_share", "max_balance_residual")}
                   for rule in ("untruncated", "clip-project", "truncated mean", "truncated mode")}
            samplers: list[dict[str, Any]] = []
            for j, seed in enumerate(seeds):
                o = outputs[rows][j].to(torch.float64)  # the law of task.distribution, in float64
                scale = torch.sqrt(torch.exp(o[:, task.n: 2 * task.n]) + task.variance_floor)
                dist = ConstrainedNormal(o[:, : task.n], scale, validate_args=False,
                                         constraint=LinearConstraint(B64, k64, validate_args=False))
                preds, sampler = nonnegative_rules(dist, lower, B64, k64, draws=int(spec["draws"]),
                                                   chains=int(spec["chains"]), burn_in=int(spec["burn_in"]),
                                                   seed=seed)
                samplers.append(sampler)
                for rule, metrics in evaluate_rules(preds, test["y"], B64, k64, lower).items():
                    for metric, v in metrics.items():
                        per[rule][metric].append(v)
            out[m] = {**per, "sampler": samplers}
    return out


def _worker(name: str, kwargs: dict[str, Any], threads: int) -> dict[str, Any]:
    """Process-pool entry point: one training unit in a fresh process with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    return run_dataset(name, **kwargs)


def run(config: Mapping[str, Any], seeds: Sequence[int], *, epochs: int, datasets: Sequence[str] | None = None,
        methods: Sequence[str] | None = None, dtype: str | None = None, checkpoint_dir: Path | None = None,
        resume: bool = False, progress: bool = True, callback: Callable[[str, int, dict], None] | None = None,
        ctx: DistContext | None = None, jobs: int = 1, threads: int = 1) -> dict[str, Any]:
    """Train and evaluate every method on every data set; prints nothing.

    Args:
        jobs: training units run in parallel processes (``spawn``; costliest first;
            :func:`~hardeq_studies.harness.run_units`: SIGINT / SIGTERM ends every worker). Each unit is
            trained by exactly the same code either way, so results do not depend on ``jobs``. Ignored (1)
            under ``torchrun`` and when a ``callback`` is given.
        threads: intra-op threads of each worker (the per-step tensors are tiny: 1 is fastest).

    Returns:
        ``{"records": [...], "curves": {dataset: {method: {"train": [...], "val": [...]}}},
        "per_seed": {dataset: {method: {metric: [...]}}}, "timing": {unit: s}, "cpu_timing": {unit: s}}``.
    """
    ctx = ctx or DistContext()
    datasets = list(datasets or config["datasets"])
    methods = list(methods or config["methods"])
    kwargs = dict(config=config, seeds=list(seeds), epochs=epochs, dtype=dtype, checkpoint_dir=checkpoint_dir,
                  resume=resume, progress=progress)
    units = training_units(config, datasets, methods, split=jobs > 1 and not ctx.enabled and callback is None)
    jobs = max(1, min(int(jobs), len(units)))
    results: dict[str, dict[str, Any]] = {}
    if jobs == 1 or ctx.enabled or callback is not None:
        for label, (name, part, ms) in units.items():
            results[label] = run_dataset(name, **kwargs, methods=ms, part=part, callback=callback, ctx=ctx)
    else:
        results = run_units(_worker, {label: {"name": name, "kwargs": {**kwargs, "methods": ms, "part": part,
                                                                          "position": i}, "threads": threads}
                                      for i, (label, (name, part, ms)) in enumerate(units.items())},
                            jobs=jobs, desc="chemical", progress=progress)
    out: dict[str, Any] = {"records": [], "curves": {}, "per_seed": {}, "timing": {}, "cpu_timing": {},
                           "nonnegative_flows": {}}
    for name in datasets:
        labels = [label for label, u in units.items() if u[0] == name]
        recs = [r for label in labels for r in results[label]["records"]]
        out["records"] += sorted(recs, key=lambda r: methods.index(r["method"]))  # stable: metric order kept
        for key in ("curves", "per_seed"):
            merged = {m: v for label in labels for m, v in results[label][key].items()}
            out[key][name] = {m: merged[m] for m in methods}
        merged = {m: v for label in labels for m, v in results[label].get("nonnegative_flows", {}).items()}
        if merged:
            out["nonnegative_flows"][name] = {m: merged[m] for m in methods if m in merged}
    for label in units:
        out["timing"][label] = results[label]["seconds"]
        out["cpu_timing"][label] = results[label]["cpu_seconds"]
    return out


def training_units(config: Mapping[str, Any], datasets: Sequence[str], methods: Sequence[str], split: bool
                   ) -> dict[str, tuple[str, str, list[str]]]:
    """Training units ``label -> (data set, part, methods)``, costliest first.

    Without ``split`` one unit per data set. With it (parallel jobs), the data set with the most training
    steps is split into its baseline block and its ``ours*`` block, the latter in groups of at most four
    variants: members are independent, so this only changes which process trains them (the records are the
    same), and it balances two workers (distillation alone has 65% of all steps).
    """
    from .task import SEPARATE

    steps = {name: load_dataset(name, config).splits["train"].stop for name in datasets}
    units = {name: (name, "", list(methods)) for name in datasets}
    plain = [m for m in methods if m not in OURS]
    ours = [m for m in methods if m in OURS]
    if split and plain and ours and datasets:
        big = max(datasets, key=steps.__getitem__)
        del units[big]
        units[f"{big}-baselines"] = (big, "baselines", plain)
        groups = max(1, -(-len(ours) // 4))
        size = -(-len(ours) // groups)
        for g in range(groups):
            part = "ours" if groups == 1 else f"ours{g + 1}"
            units[f"{big}-{part}"] = (big, part, ours[g * size: (g + 1) * size])

    def cost(u: tuple[str, str, list[str]]) -> float:  # measured CPU ms per step, roughly
        has_plain = any(m not in OURS for m in u[2])
        num_ours = sum(m in OURS for m in u[2]) + 0.5 * sum(m in SEPARATE for m in u[2])
        return steps[u[0]] * (0.5 + 1.2 * has_plain + 0.6 * num_ours)

    return dict(sorted(units.items(), key=lambda kv: -cost(kv[1])))
