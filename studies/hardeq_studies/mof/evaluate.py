"""From the units' test outputs to the study's numbers: every method's MAD and NLL per split, the ensembles,
the neutrality check, paired tests, learning curves and a parity sample.

Per split ``s`` (454 test MOFs in the full data set):

* ``Constant``: 0 for every atom; ``Element-mean uniform`` / ``Element-mean variance``: the mean training
  charge of the atom's element, corrected uniformly (orthogonal projection) or with the element's
  training-charge variance (the conditional mean); no training.
* single models (``KKT``, ``variance``, ``CL``, ``closed-form``, ``likelihood``): each of the two
  initialisations is one value (two per split);
* ``* ensemble``: the average of the two predictions; NLL three ways (:mod:`.metrics`): the ICML code's
  ``(S1 + S2)/4`` (``nll``), the exact equal mixture (``nll_mixture``) and its moment-matched Gaussian
  (``nll_moment``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..stats import paired_wilcoxon
from .data import collate, element_means, load_graphs, make_split
from .metrics import (METHODS, ensemble_nll_moment, ensemble_nll_paper, gsum, mixture_nll, predict, single_nll)

__all__ = ["evaluate_all", "significance", "threshold_counts", "PAPER_ORDER"]

#: rows of the table, in the paper's order
PAPER_ORDER = ["Constant", "Element-mean uniform", "Element-mean variance", "CL", "KKT", "variance", "closed-form",
               "likelihood", "CL ensemble", "KKT ensemble", "variance ensemble", "closed-form ensemble",
               "likelihood ensemble"]


def _violation(pred: Tensor, batch: Tensor, G: int) -> float:
    """Largest |sum of the predicted charges| over the split's graphs."""
    return float(gsum(pred, batch, G).abs().max())


def _split_eval(config: Mapping[str, Any], settings: Mapping[str, Any], split: int,
                units: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    data = load_graphs(None, settings.get("graphs"))
    ix = make_split(data, split, tuple(config["split"]["fractions"]), base_seed=int(config["split"]["base_seed"]))
    test = collate([data.graphs[i] for i in ix["test"]])
    y, batch, G = test.y.to(torch.float64), test.batch, int(test.num_graphs)
    em, ev = element_means([data.graphs[i] for i in ix["train"]], float(config["element_variance_floor"]))
    vals: dict[str, dict[str, list[float]]] = {}
    viol: dict[str, float] = {}
    preds: dict[str, Tensor] = {}

    def add(name: str, metric: str, value: float) -> None:
        vals.setdefault(name, {}).setdefault(metric, []).append(float(value))

    zero = torch.zeros_like(y)
    add("Constant", "mad", (zero - y).abs().mean())
    mu_e, var_e = em[test.atom_type], ev[test.atom_type]
    for name, kind in (("Element-mean uniform", "KKT"), ("Element-mean variance", "variance")):
        p = predict(kind, mu_e, var_e, batch, G)
        add(name, "mad", (p - y).abs().mean())
        viol[name] = _violation(p, batch, G)
        preds[name] = p
    members: dict[str, list[tuple[Tensor, Tensor, Tensor]]] = {m: [] for m in METHODS}
    for res in units.values():
        for i, m in enumerate(res["methods"]):
            mu, var = res["mu"][i].to(torch.float64), res["var"][i].to(torch.float64)
            p = predict(m, mu, var, batch, G)
            members[m].append((p, var, single_nll(p, var, y, batch, G)))
    for m, lst in members.items():
        if not lst:
            continue
        for j, (p, var, nll) in enumerate(lst):
            add(m, "mad", (p - y).abs().mean())
            add(m, "nll", nll.mean())
            add(m, "median_graph_nll", nll.median())
            add(m, "mean_log_variance", var.log().mean())
            add(m, "max_graph_nll", nll.max())
            cond_var = var - var**2 / gsum(var, batch, G)[batch]  # conditional variance of each atom
            keep = cond_var > 0
            z = ((p - y)[keep] / cond_var[keep].sqrt()).abs()
            add(m, "median_abs_z", z.median())  # 0.674 for a calibrated Gaussian
            add(m, "frac_abs_z_gt_10", (z > 10).double().mean())
            viol[f"{m} #{j}"] = _violation(p, batch, G)
        preds[m] = lst[0][0]
        if len(lst) >= 2:
            (p1, v1, n1), (p2, v2, n2) = lst[0], lst[1]
            p = (p1 + p2) / 2
            e = f"{m} ensemble"
            add(e, "mad", (p - y).abs().mean())
            add(e, "nll", ensemble_nll_paper(p1, v1, p2, v2, y, batch, G).mean())
            add(e, "nll_mixture", mixture_nll(n1, n2).mean())
            add(e, "nll_moment", ensemble_nll_moment(p1, v1, p2, v2, y, batch, G).mean())
            viol[e] = _violation(p, batch, G)
            preds[e] = p
    return {"values": vals, "violation": viol, "preds": preds, "y": y, "redraws": ix["redraws"],
            "test_atoms": int(y.numel()), "test_graphs": G}


def _nan_to_none(x: float) -> float | None:
    return None if (x is None or (isinstance(x, float) and math.isnan(x))) else x


def _curves(units: Mapping[tuple[int, str], Mapping[str, Any]]) -> dict[str, dict[str, list]]:
    """Per method: each history key averaged over its members and splits (NaN-aware; None after all stopped)."""
    acc: dict[str, dict[str, list[Tensor]]] = {}
    for res in units.values():
        for k, h in res["history"].items():
            for i, m in enumerate(res["methods"]):
                acc.setdefault(m, {}).setdefault(k, []).append(h[:, i])
    out: dict[str, dict[str, list]] = {}
    for m, d in acc.items():
        out[m] = {k: [_nan_to_none(float(v)) for v in torch.stack(v, 1).nanmean(1)] for k, v in d.items()}
    return out


def _model_curves(units: Mapping[tuple[int, str], Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per unit ``s{split}-{group}``: its members' methods and every validation curve per member (``(M, rounds)``
    lists; None after a member stopped), so that a figure can show each model's curve and its best step."""
    out = {}
    for (s, g), res in units.items():
        curves = {k: [[_nan_to_none(float(v)) for v in h[:, i]] for i in range(h.shape[1])]
                  for k, h in res["history"].items() if k.startswith("val_")}
        out[f"s{s}-{g}"] = {"methods": list(res["methods"]), "round": int(res["plan"]["round"]),
                            "steps_per_epoch": int(res["plan"]["steps_per_epoch"]),
                            "best_step": [int(x) for x in res["best_step"]], **curves}
    return out


def evaluate_all(config: Mapping[str, Any], settings: Mapping[str, Any],
                 units: Mapping[tuple[int, str], Mapping[str, Any]], *, parity_atoms: int = 2000) -> dict[str, Any]:
    """Records, per-split values, the largest neutrality violation, curves and a parity sample (split 0)."""
    splits = sorted({s for s, _ in units})
    per_split = {s: _split_eval(config, settings, s, {g: r for (s2, g), r in units.items() if s2 == s}) for s in splits}
    values: dict[str, dict[str, list[float]]] = {}
    for s in splits:
        for name, d in per_split[s]["values"].items():
            for metric, v in d.items():
                values.setdefault(name, {}).setdefault(metric, []).extend(v)
    paper = config["paper"]
    records = []
    for name in PAPER_ORDER + sorted(set(values) - set(PAPER_ORDER)):
        if name not in values:
            continue
        for metric, v in values[name].items():
            t = torch.tensor(v, dtype=torch.float64)
            rec = {"dataset": "mof", "method": name, "metric": metric, "mean": float(t.mean()),
                   "std": float(t.std()) if t.numel() > 1 else 0.0, "n_seeds": int(t.numel()),
                   "median": float(t.median())}
            pv = paper.get(name, {}).get(metric)
            if pv is not None:
                rec["paper"], rec["paper_std"] = pv
            records.append(rec)
    viol = max(max(per_split[s]["violation"].values()) for s in splits)
    g = torch.Generator().manual_seed(0)
    p0 = per_split[splits[0]]
    pick = torch.randperm(p0["y"].numel(), generator=g)[:parity_atoms]
    parity = {"split": splits[0], "ddec": [round(float(v), 5) for v in p0["y"][pick]],
              "pred": {m: [round(float(v), 5) for v in p0["preds"][m][pick]]
                       for m in ("Element-mean variance", "KKT", "variance", "closed-form", "likelihood")
                       if m in p0["preds"]},
              "mad_full_split": {m: float((p - p0["y"]).abs().mean()) for m, p in p0["preds"].items()}}
    return {"records": records, "per_split": {str(s): per_split[s]["values"] for s in splits},
            "max_abs_prediction_sum": viol,
            "violations": {str(s): per_split[s]["violation"] for s in splits},
            "redraws": {str(s): per_split[s]["redraws"] for s in splits},
            "test_size": {str(s): [per_split[s]["test_graphs"], per_split[s]["test_atoms"]] for s in splits},
            "curves": _curves(units), "model_curves": _model_curves(units), "parity": parity,
            "best_epoch": {f"s{s}-{g2}": [int(x) for x in r["best_epoch"]] for (s, g2), r in units.items()},
            "stopped_epoch": {f"s{s}-{g2}": [int(x) for x in r["stopped_epoch"]] for (s, g2), r in units.items()},
            "optimizer_steps": {f"s{s}-{g2}": [int(x) for x in r["steps"]] for (s, g2), r in units.items()},
            "best_step": {f"s{s}-{g2}": [int(x) for x in r["best_step"]] for (s, g2), r in units.items()},
            "plan": {g2: dict(r["plan"]) for (s, g2), r in units.items()},
            "unit_methods": {g2: list(r["methods"]) for (s, g2), r in units.items()},
            "unit_seconds": {f"s{s}-{g2}": float(r["seconds"]) for (s, g2), r in units.items()}}


def _split_value(vals: Mapping[str, Mapping[str, list[float]]], name: str, metric: str) -> float | None:
    """One split's value of ``name``: the mean over its initialisations, or initialisation ``k`` for
    ``"method#k"``; ``None`` when the split lacks it."""
    method, _, k = name.partition("#")
    v = vals.get(method, {}).get(metric)
    if not v or (k and int(k) >= len(v)):
        return None
    return float(v[int(k)]) if k else sum(v) / len(v)


def significance(per_split: Mapping[str, Mapping[str, Mapping[str, list[float]]]],
                 pairs: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """Paired two-sided Wilcoxon tests ``(a, b, metric)`` over the splits: one pair per split, a single
    method's value being the mean of its initialisations on that split (the two models of a split share
    their data, so they are not independent pairs) or, for ``"method#k"``, its initialisation ``k`` alone;
    ``wins`` counts splits with ``a < b``."""
    out = []
    for a, b, metric in pairs:
        xa, xb = [], []
        for vals in per_split.values():
            va, vb = _split_value(vals, a, metric), _split_value(vals, b, metric)
            if va is not None and vb is not None:
                xa.append(va)
                xb.append(vb)
        if not xa:
            continue
        out.append({"a": a, "b": b, "metric": metric, **paired_wilcoxon(xa, xb)})
    return out


def threshold_counts(per_split: Mapping[str, Mapping[str, Mapping[str, list[float]]]], name: str, metric: str,
                     value: float) -> dict[str, Any]:
    """How many splits have ``name``'s ``metric`` (mean over initialisations) above ``value``."""
    xs = [x for x in (_split_value(v, name, metric) for v in per_split.values()) if x is not None]
    return {"a": name, "metric": metric, "threshold": value, "n": len(xs), "above": sum(x > value for x in xs),
            "median": statistics.median(xs) if xs else None}
