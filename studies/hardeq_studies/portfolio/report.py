"""Results of the ``portfolio`` study: the results document from the units, Markdown, and the figures."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..figures import save_png
from ..palette import color, linestyle
from ..claims import Claim, claims_section
from ..results import markdown_table, wall_time
from ..stats import paired_wilcoxon
from . import bounds
from .classical import CLASSICAL

__all__ = ["summarise", "significance", "document", "claims", "render_markdown", "plot_cumulative",
           "plot_weights", "WEIGHT_EDGES"]

#: per-run metrics of every method (means over the test windows; max for the sum residual)
RUN_METRICS = ("test_sharpe", "ann_return", "ann_vol", "short_share", "max_sum_residual")
#: the paper's Table 7 claims tested here: (claim, the method ours is compared with)
CLAIMS = (("ours beats StemGNN's softmax head", "StemGNN"), ("ours beats KKT-hPINN", "StemGNN-KKThPINN"),
          ("ours beats the constraint layer (CL)", "StemGNN-CL"))
#: significance level of the claims' verdicts
ALPHA = 0.05
#: below this largest ``N |w_ours - P(mu)|`` (a thousandth of the equal weight) ours's head counts as the
#: KKT projection of its own mean (degenerate)
DEGENERATE_NW = 1e-3
#: colours of this study's methods: the shared palette's colour where a method has a counterpart there
#: (KKT-hPINN, CL, ours), distinct fixed colours for the others (the palette's hash colours collide here)
COLORS = {"StemGNN": "#7f7f7f", "StemGNN-KKThPINN": color("KKT-hPINN"), "StemGNN-CL": color("CL"),
          "ours": color("ours"), "ours-pathwise": "#e377c2", "equal-weight": "#000000", "Markowitz": "#8c564b",
          "min-variance": "#bcbd22"}


def _wall(doc: dict[str, Any], seconds: float | None) -> str:
    """The run's wall time in seconds with its label (:func:`hardeq_studies.results.wall_time`)."""
    total, label = wall_time(doc, seconds)
    return f"{total:.0f} s ({label})" if total is not None else "not recorded"


def _color(method: str) -> str:
    return COLORS.get(method) or color(method)


def _style(method: str) -> str:
    return ":" if method in CLASSICAL else linestyle(method)


#: histogram edges of N * w (weights in units of the equal weight)
WEIGHT_EDGES = [float(x) for x in np.linspace(-10, 20, 121)]


def _per_run(unit: dict[str, Any]) -> dict[str, float]:
    t = unit["test"]
    out = {"test_sharpe": float(t["sharpe"].mean()), "ann_return": float(t["ann_return"].mean()),
           "ann_vol": float(t["ann_vol"].mean()), "short_share": float(t["short_share"].mean()),
           "max_sum_residual": float(t["sum_residual"].max())}
    if "var_cv" in t:
        out.update(var_cv=float(t["var_cv"].mean()), var_ratio=float(t["var_ratio"].mean()),
                   max_gap_to_projection=float(t["gap_to_projection"].max()))
    return out


def _chained(unit: dict[str, Any], starts: np.ndarray, horizon: int) -> list[float]:
    """Compounded return over the test period of the windows that start every ``horizon`` days from the first
    test decision (consecutive, non-overlapping holding periods), ``(k H,)``."""
    pick = [i for i in range(len(starts)) if (starts[i] - starts[0]) % horizon == 0]
    wealth, out = 1.0, []
    for i in pick:
        c = unit["test"]["cum_return"][i].to(torch.float64)
        out += [float(wealth * (1 + x)) - 1 for x in c]
        wealth *= 1 + float(c[-1])
    return out


def _weights_summary(w: torch.Tensor) -> dict[str, Any]:
    N = w.shape[-1]
    x = (w.to(torch.float64) * N).flatten().numpy()
    hist, _ = np.histogram(np.clip(x, WEIGHT_EDGES[0], WEIGHT_EDGES[-1]), bins=WEIGHT_EDGES)
    q = np.quantile(x, [0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99])
    return {"counts": hist.tolist(), "quantiles_Nw": q.tolist(), "min_Nw": float(x.min()), "max_Nw": float(x.max()),
            "max_abs_weight": float(np.abs(x).max() / N),
            "gross_leverage": float(w.to(torch.float64).abs().sum(-1).mean())}


def summarise(result: dict[str, Any], methods: list[str], runs: list[int], paper: dict[str, Any],
              universe: str) -> dict[str, Any]:
    """``{"records", "per_run", "curves", "weights", "training"}`` of one universe's ``result`` (an entry of
    :func:`~.run.run`'s ``universes``); the records carry ``dataset = universe``."""
    data = result["data"]
    test = data.splits["test"]
    per_run: dict[str, dict[str, list[float]]] = {}
    curves: dict[str, list[list[float]]] = {}
    weights: dict[str, Any] = {}
    training: dict[str, Any] = {}
    for m in methods:
        units = [result["units"][(m, r)] for r in runs]
        rows = [_per_run(u) for u in units]
        per_run[m] = {k: [row[k] for row in rows] for k in rows[0]}
        curves[m] = [_chained(u, test.start, data.horizon) for u in units]
        weights[m] = _weights_summary(torch.stack([u["weights"] for u in units]))
        training[m] = {"best_epoch": [int(u["best_epoch"]) for u in units],
                       "epochs_run": [int(u["curve"].shape[0]) for u in units],
                       "val_sharpe": [float(u["val_sharpe"]) for u in units],
                       "curves": [u["curve"].tolist() for u in units]}
    for m in CLASSICAL:
        u = result["classical"][m]
        row = _per_run(u)
        per_run[m] = {k: [row[k]] * len(runs) for k in RUN_METRICS}
        curves[m] = [_chained(u, test.start, data.horizon)]
        weights[m] = _weights_summary(u["weights"])
        training[m] = {"val_sharpe": [float(u["val_sharpe"])]}
    records = []
    for m in [*methods, *CLASSICAL]:
        for k in per_run[m]:
            v = np.asarray(per_run[m][k], dtype=np.float64)
            ref = paper["values"].get(m) if k == "test_sharpe" else None
            records.append({"dataset": universe, "method": m, "metric": k,
                            "mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else math.nan,
                            "n_seeds": int(v.size), "paper": ref[0] if ref else None,
                            "paper_std": ref[1] if ref else None, "deterministic": m in CLASSICAL})
    pick = [i for i in range(len(test.start)) if (test.start[i] - test.start[0]) % data.horizon == 0]
    days = [str(data.table.dates[test.start[i] + j]) for i in pick for j in range(data.horizon)]
    return {"records": records, "per_run": per_run, "curves": {"days": days, "methods": curves},
            "weights": weights, "training": training}


def significance(per_run: dict[str, dict[str, list[float]]], methods: list[str],
                 universe: str | None = None) -> list[dict[str, Any]]:
    """Two-sided paired Wilcoxon signed-rank tests of the test Sharpe over runs: every ``ours*`` method against
    every other method (classical ones are constants: a one-sample signed-rank test of the differences)."""
    out = []
    ours = [m for m in methods if m.startswith("ours")]
    for a in ours:
        for b in [m for m in [*methods, *CLASSICAL] if m != a]:
            x, y = per_run[a]["test_sharpe"], per_run[b]["test_sharpe"]
            t = paired_wilcoxon(x, y)
            higher = int(sum(xi > yi for xi, yi in zip(x, y)))
            out.append({"universe": universe, "a": a, "b": b, "metric": "test_sharpe", "n": t["n"],
                        "a_higher": higher, "median_diff": t["median_diff"], "statistic": t["statistic"],
                        "p": t["p"]})
    return out


def document(result: dict[str, Any], paper: dict[str, Any]) -> dict[str, Any]:
    """The results document's data part from :func:`~.run.run`'s result: ``universes`` (names, in run order),
    ``records`` (every universe's, ``dataset`` = universe), and per universe ``data``, ``per_run``,
    ``curves``, ``weights``, ``training``; ``significance`` (a list, each test naming its universe)."""
    methods, runs = result["methods"], result["runs"]
    doc: dict[str, Any] = {"universes": list(result["universes"]), "records": [], "significance": [],
                           **{k: {} for k in ("data", "per_run", "curves", "weights", "training")}}
    for u, res in result["universes"].items():
        summary = summarise(res, methods, runs, paper, u)
        doc["records"] += summary["records"]
        doc["significance"] += significance(summary["per_run"], methods, u)
        doc["data"][u] = {**res["data"].describe(), "tickers": res["data"].table.tickers}
        for k in ("per_run", "curves", "weights", "training"):
            doc[k][u] = summary[k]
        long_only = bounds.summarise(res, runs, u)
        if long_only is not None:  # the long-only variant (portfolio/bounds.py)
            doc.setdefault("long_only", {})[u] = long_only
            doc["records"] += long_only["records"]
    return doc


def _fmt(mean: float, std: float, digits: int = 3) -> str:
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _p(p: float | None) -> str:
    return "n/a" if p is None or math.isnan(p) else f"{p:.4f}"


def _degenerate(doc: dict[str, Any], universe: str, method: str = "ours") -> bool | None:
    """Whether ``method``'s evaluated weights equal the KKT projection of its mean in every run of ``universe``
    (largest ``N |w - P(mu)|`` below :data:`DEGENERATE_NW`); ``None`` when it was not run."""
    runs = doc["per_run"][universe].get(method)
    if runs is None or "max_gap_to_projection" not in runs:
        return None
    return max(runs["max_gap_to_projection"]) * doc["data"][universe]["num_assets"] < DEGENERATE_NW


#: how the cpu preset's comparison differs from the paper's in a way that could decide it
PROTOCOL_DIFFERS = ("the universes (50 and 100 stocks, not the paper's 471), StemGNN's size and the test years "
                    "differ from the paper's, whose year, stocks and model size are not fully given")
#: what would decide an undecided claim
BUDGET = "more runs, or the paper preset's full StemGNN and all 471 stocks"


def claims(doc: dict[str, Any]) -> list[Claim]:
    """The claims of :data:`CLAIMS` in every universe: "ours beats X" (a higher test Sharpe) from the paired
    Wilcoxon test of ``ours - X`` over runs."""
    values = doc["config"]["paper"]["values"]
    tests = {(s["universe"], s["a"], s["b"]): s for s in doc["significance"]}
    out = []
    for claim, other in CLAIMS:
        evidence = (f"Table 7: ours {_fmt(*values['ours'], 4)} vs {other} {_fmt(*values[other], 4)} "
                    "(mean ± std, 10 runs)")
        for u in doc["universes"]:
            t = tests.get((u, "ours", other))
            if t is None:
                out.append(Claim(f"{u}: {claim}", evidence, "not run", budget="run both methods"))
                continue
            here = (f"ours higher in {t['a_higher']}/{t['n']} runs, median difference {t['median_diff']:+.3f}")
            if other == "StemGNN-KKThPINN" and _degenerate(doc, u):
                here += ("; ours's evaluated head equals the KKT projection of its mean in every run (variances "
                         "equal): the two differ only in training")
            out.append(Claim(f"{u}: {claim}", evidence, here, test=t, lower_is_better=False,
                             differs=PROTOCOL_DIFFERS, budget=BUDGET))
    return out


def hypotheses(doc: dict[str, Any]) -> list[Claim]:
    """This repository's hypotheses tested in the same run (the long-only variant's "bounds help"), which are in
    the study's Holm family; ``[]`` for a run without them."""
    from ..bounds_claims import as_hypotheses
    from .bounds import claims as bound_claims

    return as_hypotheses(bound_claims(doc)) if doc.get("long_only") else []


def _epochs(values: list[int]) -> str:
    """``epoch:count`` pairs of the selected epochs, ascending."""
    e, c = np.unique(np.asarray(values), return_counts=True)
    return ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(e, c))


def _data_lines(doc: dict[str, Any]) -> list[str]:
    rows = []
    for u in doc["universes"]:
        d = doc["data"][u]
        rows += [[u, d["num_assets"], s, " .. ".join(d[s]["period"]), d[s]["trading_days"], d[s]["windows"],
                  f"{d[s]['first_decision']} .. {d[s]['last_decision']}", d[s]["first_input_day"],
                  d[s]["last_held_day"]] for s in ("train", "val", "test")]
    return [markdown_table(["universe", "stocks", "split", "period", "trading days", "windows", "decisions",
                            "first input day", "last held day"], rows)]


def _sharpe_lines(doc: dict[str, Any], methods: list[str]) -> list[str]:
    rec = {(r["dataset"], r["method"], r["metric"]): r for r in doc["records"]}
    rows = []
    for m in methods:
        row = [m]
        for u in doc["universes"]:
            r = rec[(u, m, "test_sharpe")]
            row.append(f"{r['mean']:.3f}" if m in CLASSICAL else _fmt(r["mean"], r["std"]))
        ref = doc["config"]["paper"]["values"].get(m)
        rows.append(row + [_fmt(ref[0], ref[1], 4) if ref else "-"])
    return [markdown_table(["method", *doc["universes"], "paper (Table 7)"], rows)]


def _other_lines(doc: dict[str, Any], methods: list[str]) -> list[str]:
    rec = {(r["dataset"], r["method"], r["metric"]): r for r in doc["records"]}
    rows = []
    for u in doc["universes"]:
        for m in methods:
            w = doc["weights"][u][m]
            rows.append([u, m] + [_fmt(rec[(u, m, k)]["mean"], math.nan if m in CLASSICAL else rec[(u, m, k)]["std"])
                                  for k in ("ann_return", "ann_vol", "short_share")]
                        + [f"{max(doc['per_run'][u][m]['max_sum_residual']):.1e}", f"{w['gross_leverage']:.2f}",
                           f"{w['max_abs_weight']:.3f}"])
    return [markdown_table(["universe", "method", "annualised return", "annualised volatility",
                            "share of short weights", "max abs(sum(w) - 1)", "gross leverage sum abs(w)",
                            "max abs(w)"], rows)]


def _variance_lines(doc: dict[str, Any], ours: list[str]) -> list[str]:
    rows, notes = [], []
    for u in doc["universes"]:
        N = doc["data"][u]["num_assets"]
        for m in ours:
            r = doc["per_run"][u][m]
            gap = np.asarray(r["max_gap_to_projection"])
            rows.append([u, m, _fmt(float(np.mean(r["var_cv"])), float(np.std(r["var_cv"], ddof=1))
                                    if len(gap) > 1 else math.nan),
                         f"{np.mean(r['var_ratio']):.3g} ({np.min(r['var_ratio']):.3g} .. "
                         f"{np.max(r['var_ratio']):.3g})",
                         f"{gap.min():.2e} .. {gap.max():.2e}", f"{N * gap.min():.3g} .. {N * gap.max():.3g}"])
        if "ours" in ours:
            notes.append(f"* {u}: {_degeneracy_note(doc, u)}")
    return [markdown_table(["universe", "method", "variance CV over stocks (mean ± std over runs)",
                            "variance max/min (mean over runs; range)", "max abs(w - P(mu)) (range over runs)",
                            "N max abs(w - P(mu)) (range over runs)"], rows), *notes]


def _degeneracy_note(doc: dict[str, Any], universe: str) -> str:
    """Whether ours's evaluated weights differ from the KKT projection of its mean in ``universe``, in words."""
    N = doc["data"][universe]["num_assets"]
    gaps = [N * g for g in doc["per_run"][universe]["ours"]["max_gap_to_projection"]]
    differ = sum(g >= DEGENERATE_NW for g in gaps)
    if differ == 0:
        return (f"**ours degenerates here**: in all {len(gaps)} runs its variances are (nearly) equal and its "
                f"evaluated weights are the KKT projection of its mean (largest N abs(w - P(mu)) below "
                f"{DEGENERATE_NW:g}); ours and KKT-hPINN then differ only in how they were trained.")
    return (f"ours's evaluated weights differ from the KKT projection of its own mean (largest N abs(w - P(mu)) "
            f"at least {DEGENERATE_NW:g}) in {differ} of {len(gaps)} runs, so ours vs KKT-hPINN can come out either "
            "way there.")


def _training_lines(doc: dict[str, Any], methods: list[str]) -> list[str]:
    rows = []
    for u in doc["universes"]:
        tr = doc["training"][u]
        rows += [[u, m, _epochs(tr[m]["best_epoch"]), f"{np.median(tr[m]['epochs_run']):.0f}",
                  f"{np.mean(tr[m]['val_sharpe']):.3f}"] for m in methods]
        rows += [[u, m, "-", "-", f"{tr[m]['val_sharpe'][0]:.3f}"] for m in CLASSICAL if m in tr]
    return [markdown_table(["universe", "method", "selected epoch: runs", "epochs run (median)",
                            "smoothed val Sharpe at the selected epoch (mean over runs)"], rows)]


def render_markdown(doc: dict[str, Any]) -> str:
    """``portfolio.md``: setup, the Table 7 comparison per universe, the claims, the other metrics, the paired
    tests, the variance diagnostics of ours and the selected epochs."""
    cfg = doc["config"]
    trained = cfg["methods_run"]
    methods = [*trained, *CLASSICAL]
    ours = [m for m in trained if m.startswith("ours")]
    d0 = doc["data"][doc["universes"][0]]
    t = doc.get("timing", {})
    tr = cfg["train"]
    lines = [f"# portfolio ({doc['preset']} preset)", "",
             f"Command: `{doc.get('command', '')}`; wall time {_wall(doc, t.get('total_s'))}; "
             f"git {doc['environment'].get('git', '?')[:10]} (dirty: {doc['environment'].get('dirty')}); "
             f"device {doc['environment'].get('device')}.", "",
             f"Data: `{cfg['data']['dataset']}`, universes {', '.join(doc['universes'])}; window {d0['window']}, "
             f"horizon {d0['horizon']} trading days. Periods (a window belongs to the period holding all its held "
             "days):", "", *_data_lines(doc)]
    n_runs = len(cfg["runs"])
    lines += ["", "## Test Sharpe ratio", "",
              f"Mean ± std over {n_runs} runs, one column per universe, the paper's Table 7 beside it. Per run: the "
              "mean over the test windows of the annualised Sharpe ratio of the realised daily returns over each "
              "window's horizon (rf 0.03). Classical allocations are deterministic (std 0).", "",
              *_sharpe_lines(doc, methods)]
    lines += ["", claims_section(claims(doc), family=hypotheses(doc), family_where="in the long-only section",
                                 intro=("Two-sided paired Wilcoxon signed-rank tests of the test Sharpe over the "
                                        f"{n_runs} runs of each universe.")).rstrip("\n")]
    if ours:
        lines += ["", "## Does ours differ from the KKT projection?", "",
                  "Per test window, the per-stock variances `v = (exp(s) + floor) / N^2` of ours's head: their "
                  "coefficient of variation (std / mean over stocks) and max/min ratio, averaged over windows; and "
                  "the largest distance of the evaluated weights (the conditional mean "
                  "`mu + v (1 - sum mu) / sum v`) from the KKT projection `P(mu) = mu + (1 - sum mu) / N` of the "
                  "same mean, over windows and stocks. Equal variances make the two identical.", "",
                  *_variance_lines(doc, ours)]
    lines += ["", "## Other test metrics (means over windows, then mean ± std over runs)", "",
              *_other_lines(doc, methods)]
    lines += ["", "## Paired tests over runs (test Sharpe; two-sided Wilcoxon signed-rank, scipy)", "",
              "`a higher`: runs in which the first method's Sharpe is higher. Against a classical allocation "
              "(a constant) this is a one-sample signed-rank test of the differences.", ""]
    rows = [[s["universe"], s["a"], s["b"], f"{s['a_higher']}/{s['n']}", f"{s['median_diff']:+.3f}", _p(s["p"])]
            for s in doc["significance"]]
    lines.append(markdown_table(["universe", "a", "b", "a higher", "median(a - b)", "p"], rows))
    lines += ["", "## Training and model selection", "",
              f"At most {cfg['epochs']} epochs. After every epoch the mean validation Sharpe (ours: at the "
              f"conditional mean); from epoch {tr['min_epochs']} on, the epoch with the highest mean of the last "
              f"{tr['smooth']} validation Sharpe ratios so far is selected; training stops {tr['patience']} epochs "
              "after the last improvement (both capped at the epochs run). `selected epoch: runs` lists "
              "epoch:number of runs. The classical allocations on the same validation windows for reference.", "",
              *_training_lines(doc, trained)]
    lines += bounds.markdown(doc, family=claims(doc))
    lines += ["", "Figures: `portfolio_cumulative.png` (test-period cumulative return of the windows starting every "
              "horizon days, held in sequence; mean over runs, band = ±1 std over runs; one panel per universe), "
              "`portfolio_weights.png` (distribution of N w over runs, windows and stocks, per universe).", ""]
    return "\n".join(lines)


def _panels(doc: dict[str, Any], height: float = 4.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(doc["universes"])
    fig, axes = plt.subplots(1, n, figsize=(7 * n, height), squeeze=False)
    return plt, fig, list(axes[0])


def plot_cumulative(doc: dict[str, Any], out: Path) -> Path:
    """``portfolio_cumulative.png``: chained non-overlapping test windows, mean over runs with a ±1 std band,
    one panel per universe."""
    plt, fig, axes = _panels(doc)
    for ax, u in zip(axes, doc["universes"]):
        days = np.array(doc["curves"][u]["days"], dtype="datetime64[D]")
        for m, runs in doc["curves"][u]["methods"].items():
            y = np.asarray(runs, dtype=np.float64) * 100
            ax.plot(days, y.mean(0), color=_color(m), ls=_style(m), lw=1.6 if m.startswith("ours") else 1.1,
                    label=m)
            if y.shape[0] > 1:
                sd = y.std(0, ddof=1)
                ax.fill_between(days, y.mean(0) - sd, y.mean(0) + sd, color=_color(m), alpha=0.12, lw=0)
        ax.set_ylabel("cumulative return (%)")
        ax.set_xlabel("date (test period)")
        ax.set_title(f"{u}: test windows of {doc['data'][u]['horizon']} days in sequence ({doc['preset']})",
                     fontsize=9)
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)  # off the data
        ax.grid(alpha=0.3)
        for label in ax.get_xticklabels():
            label.set_rotation(30)
            label.set_ha("right")
    fig.set_figheight(fig.get_figheight() + 0.9)
    fig.tight_layout()
    path = Path(out) / "portfolio_cumulative.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_weights(doc: dict[str, Any], out: Path) -> Path:
    """``portfolio_weights.png``: histogram of ``N w`` per method (log counts), one panel per universe; 1 is the
    equal weight."""
    plt, fig, axes = _panels(doc)
    edges = np.asarray(WEIGHT_EDGES)
    for ax, u in zip(axes, doc["universes"]):
        for m, s in doc["weights"][u].items():
            c = np.asarray(s["counts"], dtype=np.float64)
            if c.sum() == 0:
                continue
            ax.stairs(c / c.sum(), edges, color=_color(m), ls=_style(m),
                      label=f"{m} ({s['min_Nw']:.1f}..{s['max_Nw']:.1f})")
        ax.axvline(0, color="k", lw=0.6)
        ax.axvline(1, color="k", lw=0.6, ls=":")
        ax.set_yscale("log")
        ax.set_title(u, fontsize=9)
        ax.set_xlabel("N x weight (1 = equal weight; values beyond the axis are counted at its ends)")
        ax.set_ylabel("fraction of weights (log scale)")
        # below the panel, off the data (the range of N x weight of each method in brackets)
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.set_figheight(fig.get_figheight() + 1.2)
    fig.tight_layout()
    path = Path(out) / "portfolio_weights.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path
