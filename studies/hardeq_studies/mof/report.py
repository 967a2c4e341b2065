"""Reporting the mof study from its results document alone: the Table 5 comparison, the ensemble NLLs three
ways, the claims (decided here), paired tests and the neutrality check; the figures are :mod:`.figures`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..claims import Claim, claims_section
from ..results import markdown_table, wall_time
from .evaluate import PAPER_ORDER
from .run import group_settings

__all__ = ["render_markdown", "claims", "claims_table", "convergence_counts", "still_improving", "confound"]


def _num(x: float | None, spec: str) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x))):
        return "–"
    if abs(x) >= 1e5:
        return f"{x:.2e}"
    return f"{x:{spec}}"


def _cell(rec: Mapping[str, Any] | None, spec: str) -> str:
    if rec is None:
        return "–"
    return f"{_num(rec['mean'], spec)} ± {_num(rec['std'], spec)}"


def _paper(rec: Mapping[str, Any] | None, spec: str, metric: str, method: str) -> str:
    if rec is None or rec.get("paper") is None:
        return "–"
    if metric == "nll" and method.startswith("closed-form"):
        return "> 1e7"
    return f"{_num(rec['paper'], spec)} ± {_num(rec.get('paper_std'), spec)}"


def render_markdown(doc: Mapping[str, Any], brief: bool = False) -> str:
    """``mof.md``: tables of MAD and NLL next to the paper's, ensemble NLLs, tests and run facts."""
    idx = {(r["method"], r["metric"]): r for r in doc["records"]}
    methods = [m for m in PAPER_ORDER if (m, "mad") in idx]
    s = doc["config"]["settings"]
    lines = [f"# mof: charge-neutral MOF partial charges (preset `{doc['preset']}`)", "",
             f"{s['splits']} split(s), {_budget_text(s)}.", "", "## Test MAD and NLL (paper Table 5)", "",
             "n = values per row (two initialisations per split for single models, one per split for ensembles "
             "and baselines). Mean ± std (sample std).", ""]
    rows = []
    for m in methods:
        mad, nll = idx.get((m, "mad")), idx.get((m, "nll"))
        rows.append([m, _cell(mad, ".4f"), _paper(mad, ".4f", "mad", m), _cell(nll, ".1f"),
                     _paper(nll if nll is not None else {"paper": None}, ".1f", "nll", m), mad["n_seeds"]])
    lines.append(markdown_table(["method", "MAD (here)", "MAD (paper)", "NLL (here)", "NLL (paper)", "n"], rows))
    if brief:
        return "\n".join(lines)
    lines += ["", "NLL: negative log-density of the DDEC charges of each test MOF's first n - 1 atoms under the "
              "predicted Gaussian (the ICML code's convention; = the density on the plane, "
              "`ConstrainedNormal.log_prob`, minus 0.5 log n), summed per MOF and averaged over MOFs. "
              "Ensembles in this column use the ICML code's covariance (S1 + S2)/4.", ""]
    lines += ["## Claims of the paper", ""] + claims_table(doc)
    lines += ["", "## Training budget", ""] + budget_tables(doc) + [""]
    if s.get("smoothing"):
        lines += ["## Where each model's best step fell", ""] + best_step_table(doc) + [""]
    ens = [m for m in methods if m.endswith("ensemble")]
    if ens:
        lines += ["## Ensemble NLL: the ICML code's (S1 + S2)/4 against the mixture", ""]
        rows = [[m, _cell(idx.get((m, "nll")), ".1f"), _cell(idx.get((m, "nll_moment")), ".1f"),
                 _cell(idx.get((m, "nll_mixture")), ".1f")] for m in ens]
        lines.append(markdown_table(["ensemble", "(S1+S2)/4", "moment-matched (S1+S2)/2 + dd^T/4",
                                     "exact mixture"], rows))
    diag = [m for m in methods if (m, "mean_log_variance") in idx]
    if diag:
        lines += ["", "## Variance head diagnostics (single models)", ""]
        rows = [[m, _cell(idx.get((m, "mean_log_variance")), ".2f"), _cell(idx.get((m, "median_graph_nll")), ".1f"),
                 _cell(idx.get((m, "max_graph_nll")), ".1f"), _cell(idx.get((m, "median_abs_z")), ".3g"),
                 _cell(idx.get((m, "frac_abs_z_gt_10")), ".2g")]
                for m in diag]
        lines.append(markdown_table(["method", "mean log variance of the head", "median per-MOF NLL",
                                     "largest per-MOF NLL", "median abs z", "share of atoms with abs z > 10"], rows))
        lines += ["", "z = (prediction - DDEC) / conditional standard deviation of the atom; a calibrated "
                  "Gaussian has median abs z = 0.674 and essentially no abs z > 10."]
    sig = doc.get("significance") or []
    if sig:
        lines += ["", "## Paired two-sided Wilcoxon signed-rank tests", "",
                  "One pair per split; a single method's value on a split is the mean of its two "
                  "initialisations (`method#0`: the first alone); wins = splits with a < b. An ensemble's MAD "
                  "can never exceed the mean of its two members' MADs (|(p1 + p2)/2 - q| <= (|p1 - q| + "
                  "|p2 - q|)/2 for every atom), so `X ensemble` vs `X` can only come out one way: the claims "
                  "compare an ensemble with its first member instead.", ""]
        rows = [[t["a"], t["b"], t["metric"], t["n"], t["wins"], _num(t["median_diff"], ".4g"),
                 _num(t["p"], ".3g")] for t in sig]
        lines.append(markdown_table(["a", "b", "metric", "n", "wins (a < b)", "median a - b", "p"], rows))
    data = doc.get("data", {})
    lines += ["", "## Checks and facts", "",
              f"- Largest |sum of predicted charges| of any MOF, any method, any split: "
              f"{doc.get('max_abs_prediction_sum', float('nan')):.2e} e.",
              f"- Labels: largest |sum of DDEC charges| of a MOF in the file "
              f"{data.get('max_abs_charge_sum', float('nan')):.2e} e "
              f"(mean {data.get('mean_abs_charge_sum', float('nan')):.1e}); labels are projected onto the plane "
              f"(largest per-atom shift {data.get('max_label_shift', float('nan')):.1e} e).",
              f"- Data: {data.get('num_graphs')} graphs, {data.get('num_atoms')} atoms, "
              f"mean {data.get('atoms_mean', 0):.1f} "
              f"atoms per graph (median {data.get('atoms_median')}, max {data.get('atoms_max')}).",
              f"- Split redraws (rejected shuffles): {doc.get('redraws')}; "
              f"test size (graphs, atoms): {doc.get('test_size')}.",
              f"- Best rounds: {doc.get('best_epoch')}; early-stopped after round: {doc.get('stopped_epoch')} "
              "(0: never).",
              f"- Wall time {_wall(doc)} "
              f"(training in the last leg {doc.get('timing', {}).get('train_s', float('nan')):.0f} s); device "
              f"{doc['environment'].get('device')}, {s.get('jobs')} process(es) x {s.get('threads')} thread(s); "
              f"git {doc['environment'].get('git', '?')[:10]} (dirty: {doc['environment'].get('dirty')}).",
              f"- Command: `{doc.get('command')}`.", ""]
    return "\n".join(lines)


def _wall(doc: Mapping[str, Any]) -> str:
    seconds, label = wall_time(doc, doc.get("timing", {}).get("total_s"))
    return f"{seconds if seconds is not None else float('nan'):.0f} s ({label})"


def _budget_text(settings: Mapping[str, Any]) -> str:
    if settings.get("steps") and settings.get("smoothing"):
        u = settings.get("uniform") or {}
        same = (f"the same network (E {u['arch']['embedding']}, H {u['arch']['hidden']}, T {u['arch']['steps']}) and "
                f"batch of {u['batch_size']} graphs for every method, " if u.get("arch") and u.get("batch_size")
                else "")
        return (f"{same}at most {settings['steps']} optimiser steps per model, validated every "
                f"{settings.get('eval_every')} steps, early stopping on the smoothed validation MAD")
    if settings.get("steps"):
        return (f"{settings['steps']} optimiser steps per model for every method, validated every "
                f"{settings.get('eval_every')} steps")
    return f"at most {settings.get('epochs')} epochs per model"


def _group_of(doc: Mapping[str, Any], method: str) -> str | None:
    base = method.split("#")[0].removesuffix(" ensemble")
    return next((g for g, meta in doc["config"]["groups"].items() if base in meta["methods"]), None)


def best_step_summary(doc: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(at_end, late, total)``: of every model trained, how many had their best validation MAD at the last
    step of the budget, and how many at one of the last two validations."""
    plans = doc.get("plan", {})
    at_end = late = total = 0
    for key, best in doc.get("best_step", {}).items():
        plan = plans.get(key.split("-", 1)[1], {})
        budget, every = plan.get("steps"), plan.get("round")
        for b in best:
            total += 1
            at_end += budget is not None and b >= budget
            late += budget is not None and every is not None and b >= budget - every
    return at_end, late, total


def convergence_counts(doc: Mapping[str, Any]) -> dict[str, int]:
    """Of every model trained: ``total``; ``last_tenth`` with its best validation step in the last 10% of its
    step budget; ``at_end`` at the budget's last step; ``before_last_quarter`` before the budget's last quarter."""
    plans = doc.get("plan", {})
    out = {"total": 0, "last_tenth": 0, "at_end": 0, "before_last_quarter": 0}
    for key, best in doc.get("best_step", {}).items():
        budget = plans.get(key.split("-", 1)[1], {}).get("steps")
        if budget is None:
            continue
        for b in best:
            out["total"] += 1
            out["last_tenth"] += b >= 0.9 * budget
            out["at_end"] += b >= budget
            out["before_last_quarter"] += b < 0.75 * budget
    return out


#: how many of 100 models must have their best validation step before the last quarter of the budget for the
#: MAD comparisons to be read as converged (the rest: "undecided: still improving")
CONVERGED_SHARE = 0.75


def still_improving(doc: Mapping[str, Any]) -> str:
    """Why the run's MAD comparisons cannot be read (its models were still improving when training stopped: fewer
    than :data:`CONVERGED_SHARE` of them have their best validation step before the budget's last quarter),
    with the counts; "" when they converged."""
    n = convergence_counts(doc)
    if not n["total"] or n["before_last_quarter"] >= CONVERGED_SHARE * n["total"]:
        return ""
    steps = doc["config"].get("settings", {}).get("steps")
    return (f"of {n['total']} models, {n['last_tenth']} have their best validation step in the last 10% of the "
            f"{steps}-step budget, {n['at_end']} at its last step and {n['before_last_quarter']} before its last "
            f"quarter; a budget long enough that at least {CONVERGED_SHARE:.0%} stop improving before the last "
            "quarter decides it")


#: comparisons whose protocol matches the paper's on what decides them, with the reason
MATCHED = {("CL", "Constant", "mad"): (
    "CL is Raza et al.'s constraint layer on their network, data and the paper's 10 splits, and the constant "
    "predictor does not train: more training can only lower CL's MAD further from the paper's 0.327, so no budget "
    "moves this toward the claim")}


def confound(doc: Mapping[str, Any]) -> str:
    """What differs between the method groups of this run besides the method (batch size, network, data epochs
    in the step budget), read from the document; "" when every group has the same batch, network and budget."""
    cfg = doc["config"]
    # each group as it trained: the preset's ``uniform`` block (one network and batch for all) over the group's own
    groups = {g: group_settings(cfg, cfg.get("settings", {}), g) for g in cfg["groups"]}
    plans = doc.get("plan", {})
    facts = {g: (meta["batch_size"], meta["arch"].get("embedding"), meta["arch"].get("hidden"),
                 plans.get(g, {}).get("steps", 0) / max(plans.get(g, {}).get("steps_per_epoch", 1), 1))
             for g, meta in groups.items()}
    if len({f[:3] for f in facts.values()}) == 1 and len({round(f[3], 1) for f in facts.values()}) == 1:
        return ""
    return "the method groups differ in more than the method: " + "; ".join(
        f"{'/'.join(groups[g]['methods'])}: batch {b}, embedding {e} / hidden {h}, {ep:.1f} data epochs"
        for g, (b, e, h, ep) in facts.items())


def claims(doc: Mapping[str, Any]) -> list[Claim]:
    """Each claim of ``config["claims"]`` as a :class:`~hardeq_studies.claims.Claim`: the paired Wilcoxon test
    over splits, what differs from the paper's protocol (the step budget, models still improving) and, for a
    comparison across method groups, the confound of batch size, network and data epochs."""
    cfg = doc["config"]
    idx = {(r["method"], r["metric"]): r for r in doc["records"]}
    budget = str(cfg.get("claims_budget", "a larger budget"))
    at_end, late, total = best_step_summary(doc)
    s = cfg.get("settings", {})
    differs = (f"every model gets {s.get('steps')} optimiser steps, far short of {budget.split('up to ')[-1]}"
               + (f", and {at_end} of {total} models have their best validation at the last step: still improving"
                  if at_end else "")) if s.get("steps") else f"the budget is smaller than the paper's ({budget})"
    mixed = confound(doc)
    improving = still_improving(doc)
    out = []
    for c in cfg.get("claims", []):
        a, metric = c["a"], c["metric"]
        spec = ".4f" if metric == "mad" else ".1f"
        if "b" not in c:  # a threshold
            t = next((t for t in doc.get("thresholds", []) if t["a"] == a and t["metric"] == metric), None)
            if t is None or not t["n"]:
                out.append(Claim(c["claim"], c["evidence"], "–", budget=f"not run; {budget}"))
                continue
            here = (f"{a} {metric} {_cell(idx.get((a, metric)), spec)}; above {t['threshold']:.0e} on "
                    f"{t['above']}/{t['n']} splits")
            out.append(Claim(c["claim"], c["evidence"], here, outcome="for" if t["above"] == t["n"] else "against",
                             differs=differs))
            continue
        b = c["b"]
        test = next((t for t in doc.get("significance", []) if (t["a"], t["b"], t["metric"]) == (a, b, metric)),
                    None)
        if test is None:
            out.append(Claim(c["claim"], c["evidence"], "–", budget=f"not run; {budget}"))
            continue
        b_text = "its first model" if "#" in b else _cell(idx.get((b, metric)), spec)
        here = (f"{_cell(idx.get((a, metric)), spec)} vs {b_text}; a < b on {test['wins']}/{test['n']} splits, "
                f"median a - b {_num(test['median_diff'], '.4g')}")
        across = mixed and _group_of(doc, a) != _group_of(doc, b)
        matched = MATCHED.get((a, b, metric), "")
        out.append(Claim(c["claim"], c["evidence"], here, test=test, lower_is_better="<" in c["expect"],
                         matches_paper=bool(matched) and not across, matched=matched if not across else "",
                         improving=improving if metric == "mad" and not matched else "",
                         differs=differs + (f"; {mixed}" if across else ""),
                         favours=(f"the confound ({a}'s group sees more data per step and has a larger network)"
                                  if across else ""),
                         budget=budget))
    return out


def claims_table(doc: Mapping[str, Any]) -> list[str]:
    """The ``Claims of the paper`` lines (without the heading): how the groups' protocols differ, and each
    claim of ``config["claims"]`` with its raw and Holm-adjusted p and its verdict."""
    at_end, late, total = best_step_summary(doc)
    mixed = confound(doc)
    intro = ("Paired two-sided Wilcoxon signed-rank tests over splits; a = the first method named, b = the second; "
             "values here are mean ± std over the row's values (see the table above). `X#0`: the first "
             f"initialisation alone. {at_end} of {total} models have their best validation MAD at the last step of "
             f"the budget and {late} of {total} at one of the last two validations"
             + (": the models are still improving." if at_end else ".")
             + (f" **Confound:** {mixed}; a comparison across groups therefore cannot be reproduced or refuted by "
                "this run." if mixed else ""))
    text = claims_section(claims(doc), intro=intro)
    return text.split("\n", 2)[2].splitlines()


def _uniform(doc: Mapping[str, Any], group: str, key: str) -> Any:
    """``key`` (``batch_size``, ``arch``, ``lr``) of ``group`` as trained: the preset's ``uniform`` value if any."""
    uniform = doc["config"].get("settings", {}).get("uniform") or {}
    return uniform.get(key, doc["config"]["groups"][group][key])


def best_step_table(doc: Mapping[str, Any]) -> list[str]:
    """The lines of ``Where each model's best step fell``: per method, over every model of every split, how many
    stopped early (the smoothed validation MAD flat for ``patience`` validations), the optimiser step of the best
    smoothed validation MAD (median and range) and how many models had their best step within the last
    ``patience`` validations of the maximum budget (still improving when the budget ran out)."""
    plans, methods = doc.get("plan", {}), doc.get("unit_methods", {})
    settings = doc["config"].get("settings", {})
    rows = []
    for g, plan in plans.items():
        patience = settings.get("patience")
        patience = int(patience[g]) if isinstance(patience, Mapping) else int(doc["config"]["groups"][g]["patience"])
        window = patience * int(plan["round"])
        for m in dict.fromkeys(methods.get(g, [])):
            ix = [i for i, x in enumerate(methods[g]) if x == m]
            steps, best = [], []
            for key, st in doc.get("optimizer_steps", {}).items():
                if key.endswith(f"-{g}"):
                    steps += [st[i] for i in ix]
                    best += [doc["best_step"][key][i] for i in ix]
            if not steps:
                continue
            budget = int(plan["steps"])
            late = sum(b > budget - window for b in best)
            srt = sorted(best)
            median = (srt[(len(srt) - 1) // 2] + srt[len(srt) // 2]) / 2
            rows.append([m, len(steps), budget, f"{sum(x < budget for x in steps)}/{len(steps)}",
                         f"{median:g} [{srt[0]}, {srt[-1]}]", f"{median / plan['steps_per_epoch']:.1f}",
                         f"{late}/{len(best)}"])
    return [f"Early stopping reads the exponential moving average of the validation MAD (weight "
            f"{settings.get('smoothing')} on each new validation); a model stops when it has not improved for "
            "`patience` validations, and keeps the parameters of its best smoothed validation. `late`: models whose "
            "best step lies within the last `patience` validations of the maximum budget, i.e. still improving "
            "when the budget ran out.", "",
            markdown_table(["method", "models", "maximum steps", "stopped early", "best step: median [range]",
                            "best step in data epochs (median)", "late"], rows)]


def budget_tables(doc: Mapping[str, Any]) -> list[str]:
    """The ``Training budget`` lines: per method group its plan, and per split and method the optimiser steps
    each model took and the step of its best validation MAD (``steps (best)``; fewer steps = stopped early)."""
    plans, methods = doc.get("plan", {}), doc.get("unit_methods", {})
    groups = doc["config"]["groups"]
    rows = []
    for g, plan in plans.items():
        steps = [x for k, v in doc.get("optimizer_steps", {}).items() if k.endswith(f"-{g}") for x in v]
        stopped = sum(x < plan["steps"] for x in steps)
        rows.append([g, ", ".join(groups[g]["methods"]), _uniform(doc, g, "batch_size"), plan["steps_per_epoch"],
                     plan["steps"], f"{plan['steps'] / plan['steps_per_epoch']:.1f}", plan["round"],
                     f"{stopped}/{len(steps)}"])
    out = [markdown_table(["group", "methods", "batch (graphs)", "steps per data epoch", "step budget per model",
                           "data epochs in the budget", "steps between validations", "models stopped early"], rows),
           "", "Per split: optimiser steps each model took (the step of its best validation MAD), both "
           "initialisations of each method.", ""]
    names = [m for g in plans for m in dict.fromkeys(methods.get(g, []))]
    splits = sorted({int(k.split("-")[0][1:]) for k in doc.get("optimizer_steps", {})})
    table = []
    for s in splits:
        row = [s]
        for m in names:
            g = next(g for g in plans if m in methods.get(g, []))
            key = f"s{s}-{g}"
            ix = [i for i, x in enumerate(methods[g]) if x == m]
            st, bs = doc["optimizer_steps"].get(key), doc["best_step"].get(key)
            row.append("–" if st is None else ", ".join(f"{st[i]} ({bs[i]})" for i in ix))
        table.append(row)
    out.append(markdown_table(["split"] + names, table))
    return out
