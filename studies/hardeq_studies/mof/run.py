"""Running the mof study: training units (split x method group) in parallel processes, each resumable.

A *unit* trains every member of one group (e.g. ``raza``: KKT, variance, CL, two initialisations each) on
one split with the shared harness (members share every graph batch; per-member early stopping on validation
MAD), then evaluates each member's best-validation parameters on the test split and stores the per-atom
``mu`` and ``variance`` (float64). Unit results are saved atomically to ``CKPT/mof-s{split}-{group}.result.pt``
(with the run's fingerprint); the harness checkpoints each unit every ``checkpoint_every`` epochs, so
``--resume`` continues an interrupted unit exactly and skips finished ones.

**Budget** (:func:`schedule`). With ``settings["steps"] = S`` every model of every method takes the same
``S`` optimiser steps, whatever its batch size (Raza's batch of 32 graphs and our 128 see different numbers
of epochs), validated every ``eval_every`` steps (a *round*, the harness's epoch); patience counts rounds.
Without it (the ``paper`` preset) a round is one data epoch of the group's batch size and the budget is
``epochs`` data epochs, as in the paper.

**One configuration for every method** (:func:`group_settings`). A preset's ``uniform`` block
(``{"arch", "batch_size", "lr"}``) replaces each group's own network, batch size and learning rate, so that
every method trains the same network on the same batches for the same number of data epochs: the methods then
differ only in their loss and correction, and each method's ``j``-th model starts from the same initialisation
(:func:`member_seeds`). **Smoothed early stopping**: a preset's ``smoothing`` (``a``) makes
model selection and patience read the exponential moving average of the validation MAD
(:class:`~.task.MofTask`'s ``mad_smooth``) instead of the raw curve; ``steps`` is then the maximum budget.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..harness import (LoaderBatches, MemberList, TrainConfig, atomic_torch_save, fingerprint, load_checkpoint,
                       run_units, train)
from .data import collate, load_graphs, make_split, step_batches
from .models import build_member
from .task import MofTask, unit_methods

__all__ = ["group_settings", "member_seeds", "run_unit", "schedule", "select_metric", "steps_taken", "train_all",
           "unit_plan"]


def group_settings(config: Mapping[str, Any], settings: Mapping[str, Any], group: str) -> dict[str, Any]:
    """Group ``group`` of the config with the preset's ``uniform`` block (``arch``, ``batch_size``, ``lr``) on top."""
    g = dict(config["groups"][group])
    uniform = settings.get("uniform") or {}
    unknown = sorted(set(uniform) - {"arch", "batch_size", "lr"})
    if unknown:
        raise ValueError(f"settings['uniform'] may set arch, batch_size and lr only, got {unknown}.")
    return {**g, **json_copy(uniform)}


def json_copy(obj: Any) -> Any:
    """A deep copy of plain containers."""
    if isinstance(obj, Mapping):
        return {k: json_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_copy(v) for v in obj]
    return obj


def member_seeds(config: Mapping[str, Any], settings: Mapping[str, Any], split: int, group: str) -> list[int]:
    """Initialisation seeds of the unit's members (:func:`~.task.unit_methods` order). With a ``uniform`` block
    every method's ``j``-th ensemble member starts from the same initialisation (seed ``1000 split + j``), so that,
    with the shared batch order of the split, methods differ only in their loss and correction (common random
    numbers for the paired tests); otherwise each group draws its own (``1000 split + 10 group + i``)."""
    g = group_settings(config, settings, group)
    count = len(unit_methods(g))
    if settings.get("uniform"):
        return [1000 * int(split) + i % int(g["ensemble"]) for i in range(count)]
    return [1000 * int(split) + 10 * list(config["groups"]).index(group) + i for i in range(count)]


def select_metric(settings: Mapping[str, Any]) -> str:
    """The validation metric of model selection and early stopping: ``mad_smooth`` with smoothing, else ``mad``."""
    return "mad_smooth" if settings.get("smoothing") else "mad"


def unit_plan(config: Mapping[str, Any], settings: Mapping[str, Any]) -> list[tuple[int, str]]:
    """Units ``(split, group)``, costliest group first within each split (for a balanced process pool)."""
    cost = {g: float(v.get("relative_cost", 1.0)) for g, v in config["groups"].items()}
    if settings.get("uniform"):  # one network and batch for all: a unit costs in proportion to its models
        cost = {g: float(len(unit_methods(v))) for g, v in config["groups"].items()}
    groups = sorted(settings.get("groups") or config["groups"], key=lambda g: -cost[g])
    return [(s, g) for s in range(int(settings["splits"])) for g in groups]


def schedule(settings: Mapping[str, Any], batch_size: int, num_train: int) -> dict[str, int]:
    """The unit's budget: ``{"steps"`` (optimiser steps per model), ``"round"`` (steps between validations),
    ``"rounds"`` (the harness's epochs), ``"steps_per_epoch"`` (batches in one pass over ``num_train`` graphs)}``.

    ``settings["steps"]`` set: ``S`` steps in rounds of ``eval_every`` (the last round shorter); else
    ``settings["epochs"]`` data epochs, one round each.
    """
    per_epoch = -(-int(num_train) // int(batch_size))
    if settings.get("steps"):
        total, every = int(settings["steps"]), int(settings.get("eval_every") or per_epoch)
        if total < 1 or every < 1:
            raise ValueError(f"steps and eval_every must be positive, got {total} and {every}.")
        return {"steps": total, "round": every, "rounds": -(-total // every), "steps_per_epoch": per_epoch}
    epochs = int(settings["epochs"])
    return {"steps": epochs * per_epoch, "round": per_epoch, "rounds": epochs, "steps_per_epoch": per_epoch}


def steps_taken(plan: Mapping[str, int], rounds: Tensor) -> list[int]:
    """Optimiser steps after each member's ``rounds`` (``(M,)`` 1-based round counts; 0 means the whole budget)."""
    return [int(plan["steps"]) if int(r) == 0 else min(int(r) * int(plan["round"]), int(plan["steps"]))
            for r in rounds]


def _unit_id(config: Mapping[str, Any], settings: Mapping[str, Any], split: int, group: str) -> dict[str, Any]:
    g = group_settings(config, settings, group)
    budget = ({"steps": int(settings["steps"]), "eval_every": settings.get("eval_every")} if settings.get("steps")
              else {"epochs": int(settings["epochs"])})
    return {"study": "mof", "split": split, "group": group, "methods": unit_methods(g), "arch": g["arch"],
            "batch_size": g["batch_size"], "lr": g["lr"], "patience": _patience(settings, group, g),
            **budget, "graphs": settings.get("graphs"), "split_rule": config["split"],
            "dtype": "float32 network, float64 head",
            **({"smoothing": float(settings["smoothing"])} if settings.get("smoothing") else {})}


def _patience(settings: Mapping[str, Any], group: str, g: Mapping[str, Any]) -> int:
    p = settings.get("patience")
    return int(p[group]) if isinstance(p, Mapping) else int(g["patience"])


def run_unit(config: Mapping[str, Any], settings: Mapping[str, Any], split: int, group: str, *,
             checkpoint_dir: Path, resume: bool, device: str = "cpu", threads: int | None = None,
             progress: bool = False, callback=None) -> dict[str, Any]:
    """Train and test one unit (see the module docstring); returns its result (plain containers, tensors).

    ``callback(round, info)`` is passed to the harness's ``train`` (called after every round; it may raise
    :class:`~hardeq_studies.harness.Interrupted`, which the resume test uses to simulate a crash)."""
    if threads:
        torch.set_num_threads(int(threads))
    dev = torch.device(device)
    run_id = _unit_id(config, settings, split, group)
    result_path = Path(checkpoint_dir) / f"mof-s{split}-{group}.result.pt"
    if resume and result_path.exists():
        done = load_checkpoint(result_path)
        if done.get("fingerprint") == fingerprint(run_id):
            return done
    t0 = time.perf_counter()
    data = load_graphs(None, settings.get("graphs"))
    split_ix = make_split(data, split, tuple(config["split"]["fractions"]), base_seed=int(config["split"]["base_seed"]))
    train_graphs = [data.graphs[i] for i in split_ix["train"]]
    val_batch = collate([data.graphs[i] for i in split_ix["val"]]).to(dev)
    test_batch = collate([data.graphs[i] for i in split_ix["test"]]).to(dev)
    g = group_settings(config, settings, group)
    methods = unit_methods(g)
    seeds = member_seeds(config, settings, split, group)
    model = MemberList([build_member(g["arch"], s) for s in seeds], per_member_inputs=False).to(dev)
    bs = int(g["batch_size"])
    plan = schedule(settings, bs, len(train_graphs))

    def make(rnd: int, ctx) -> list:
        first = rnd * plan["round"]
        count = min(plan["round"], plan["steps"] - first)
        return [b.to(dev) for b in step_batches(train_graphs, bs, split, first, count)]

    source = LoaderBatches(make, None, batch_size_of=lambda b: int(b.num_nodes), num_samples=len(train_graphs))
    cfg = TrainConfig(epochs=plan["rounds"], batch_size=bs, lr=float(g["lr"]), select_metric=select_metric(settings),
                      patience=_patience(settings, group, g), checkpoint_every=int(settings.get("checkpoint_every", 1)))
    task = MofTask(methods, smoothing=settings.get("smoothing"))
    res = train(model, task, source, [val_batch], cfg, seeds, checkpoint_path=Path(checkpoint_dir) /
                f"mof-s{split}-{group}.pt", resume=resume, run_id=run_id, progress=progress, desc=f"s{split}-{group}",
                log_every=1 if progress else 0, callback=callback, hooks=[task.state_hook()])
    model.load_state_dict(res.best_state)
    model.eval()
    with torch.no_grad():
        out = model(test_batch).cpu()  # (M, N, 2)
    out_doc = {
        "fingerprint": fingerprint(run_id), "split": split, "group": group, "methods": methods, "seeds": seeds,
        "mu": out[..., 0].clone(), "var": out[..., 1].clone(),
        "best_epoch": res.best_epoch, "stopped_epoch": res.stopped_epoch, "plan": plan,
        "steps": steps_taken(plan, res.stopped_epoch), "best_step": steps_taken(plan, res.best_epoch),
        "history": {k: v for k, v in res.history.items()}, "redraws": split_ix["redraws"],
        "seconds": time.perf_counter() - t0,
    }
    atomic_torch_save(out_doc, result_path)
    return out_doc


def _worker(kwargs: dict[str, Any]) -> dict[str, Any]:
    return run_unit(**kwargs)


def train_all(config: Mapping[str, Any], settings: Mapping[str, Any], *, checkpoint_dir: Path, resume: bool,
              device: str, jobs: int, threads: int, progress: bool) -> dict[tuple[int, str], dict[str, Any]]:
    """Run every unit (``jobs`` spawned processes on the CPU, else in this process); ``{(split, group): result}``."""
    plan = unit_plan(config, settings)
    common = dict(config=dict(config), settings=dict(settings), checkpoint_dir=Path(checkpoint_dir), resume=resume,
                  device=device, threads=threads, progress=progress)
    if jobs <= 1 or device != "cpu":
        out = {}
        for s, g in plan:
            out[(s, g)] = run_unit(**common, split=s, group=g)
            if progress:
                print(f"[mof] unit s{s}-{g} done in {out[(s, g)]['seconds']:.0f} s", flush=True)
        return out
    def done(key: Any, result: dict[str, Any]) -> None:
        if progress:
            print(f"[mof] unit s{key[0]}-{key[1]} done in {result['seconds']:.0f} s", flush=True)

    # spawned workers that all end on SIGINT / SIGTERM (hardeq_studies.harness.run_units)
    return run_units(_worker, {(s, g): {"kwargs": {**common, "split": s, "group": g}} for s, g in plan}, jobs=jobs,
                     desc="mof", progress=progress, on_done=done)
