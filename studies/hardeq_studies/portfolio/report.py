"""Results of the ``portfolio`` study: the results document from the units, Markdown, and the figures."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..figures import save_png
from ..palette import color, linestyle
from ..results import markdown_table
from ..stats import paired_wilcoxon
from .classical import CLASSICAL

__all__ = ["summarise", "significance", "render_markdown", "plot_cumulative", "plot_weights", "WEIGHT_EDGES"]

#: per-run metrics of every method (means over the test windows; max for the sum residual)
RUN_METRICS = ("test_sharpe", "ann_return", "ann_vol", "short_share", "max_sum_residual")
#: colours of this study's methods: the shared palette's colour where a method has a counterpart there
#: (KKT-hPINN, CL, ours), distinct fixed colours for the others (the palette's hash colours collide here)
COLORS = {"StemGNN": "#7f7f7f", "StemGNN-KKThPINN": color("KKT-hPINN"), "StemGNN-CL": color("CL"),
          "ours": color("ours"), "ours-pathwise": "#e377c2", "equal-weight": "#000000", "Markowitz": "#8c564b",
          "min-variance": "#bcbd22"}


def _color(method: str) -> str:
    return COLORS.get(method) or color(method)


def _style(method: str) -> str:
    return ":" if method in CLASSICAL else linestyle(method)


#: histogram edges of N * w (weights in units of the equal weight)
WEIGHT_EDGES = [float(x) for x in np.linspace(-10, 20, 121)]


def _per_run(unit: dict[str, Any]) -> dict[str, float]:
    t = unit["test"]
    return {"test_sharpe": float(t["sharpe"].mean()), "ann_return": float(t["ann_return"].mean()),
            "ann_vol": float(t["ann_vol"].mean()), "short_share": float(t["short_share"].mean()),
            "max_sum_residual": float(t["sum_residual"].max())}


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


def summarise(result: dict[str, Any], paper: dict[str, Any]) -> dict[str, Any]:
    """``{"records", "per_run", "curves", "weights", "training", "data"}`` of the results document."""
    data, runs, methods = result["data"], result["runs"], result["methods"]
    test = data.splits["test"]
    per_run: dict[str, dict[str, list[float]]] = {}
    curves: dict[str, list[list[float]]] = {}
    weights: dict[str, Any] = {}
    training: dict[str, Any] = {}
    for m in methods:
        units = [result["units"][(m, r)] for r in runs]
        rows = [_per_run(u) for u in units]
        per_run[m] = {k: [row[k] for row in rows] for k in RUN_METRICS}
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
        for k in RUN_METRICS:
            v = np.asarray(per_run[m][k], dtype=np.float64)
            ref = paper["values"].get(m) if k == "test_sharpe" else None
            records.append({"dataset": data.describe()["test"]["period"][0][:4], "method": m, "metric": k,
                            "mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else math.nan,
                            "n_seeds": int(v.size), "paper": ref[0] if ref else None,
                            "paper_std": ref[1] if ref else None, "deterministic": m in CLASSICAL})
    pick = [i for i in range(len(test.start)) if (test.start[i] - test.start[0]) % data.horizon == 0]
    days = [str(data.table.dates[test.start[i] + j]) for i in pick for j in range(data.horizon)]
    return {"records": records, "per_run": per_run, "curves": {"days": days, "methods": curves},
            "weights": weights, "training": training}


def significance(per_run: dict[str, dict[str, list[float]]], methods: list[str]) -> list[dict[str, Any]]:
    """Two-sided paired Wilcoxon signed-rank tests of the test Sharpe over runs: every ``ours*`` method against
    every other method (classical ones are constants: a one-sample signed-rank test of the differences)."""
    out = []
    ours = [m for m in methods if m.startswith("ours")]
    for a in ours:
        for b in [m for m in [*methods, *CLASSICAL] if m != a]:
            x, y = per_run[a]["test_sharpe"], per_run[b]["test_sharpe"]
            t = paired_wilcoxon(x, y)
            higher = int(sum(xi > yi for xi, yi in zip(x, y)))
            out.append({"a": a, "b": b, "metric": "test_sharpe", "n": t["n"], "a_higher": higher,
                        "median_diff": t["median_diff"], "statistic": t["statistic"], "p": t["p"]})
    return out


def _fmt(mean: float, std: float, digits: int = 3) -> str:
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def render_markdown(doc: dict[str, Any]) -> str:
    """``portfolio.md``: setup, the Table 9 comparison, the other metrics, the paired tests."""
    cfg = doc["config"]
    rec = {(r["method"], r["metric"]): r for r in doc["records"]}
    methods = [*cfg["methods_run"], *CLASSICAL]
    d = doc["data"]
    t = doc.get("timing", {})
    lines = [f"# portfolio ({doc['preset']} preset)", "",
             f"Command: `{doc.get('command', '')}`; wall time {t.get('total_s', float('nan')):.0f} s; "
             f"git {doc['environment'].get('git', '?')[:10]} (dirty: {doc['environment'].get('dirty')}); "
             f"device {doc['environment'].get('device')}.", "",
             f"Data: `{cfg['data']['dataset']}`, {d['num_assets']} stocks; window {d['window']}, horizon "
             f"{d['horizon']} trading days. Periods (a window belongs to the period holding all its held days):", ""]
    lines.append(markdown_table(
        ["split", "period", "trading days", "windows", "decisions", "first input day", "last held day"],
        [[s, " .. ".join(d[s]["period"]), d[s]["trading_days"], d[s]["windows"],
          f"{d[s]['first_decision']} .. {d[s]['last_decision']}", d[s]["first_input_day"], d[s]["last_held_day"]]
         for s in ("train", "val", "test")]))
    n_runs = len(cfg["runs"])
    lines += ["", f"## Test Sharpe ratio (mean ± std over {n_runs} runs; the paper's Table 9 beside it)", "",
              "Per run: the mean over the test windows of the annualised Sharpe ratio of the realised daily "
              "returns over each window's horizon (rf 0.03). Classical allocations are deterministic (std 0).", ""]
    rows = []
    for m in methods:
        r = rec[(m, "test_sharpe")]
        paper = _fmt(r["paper"], r["paper_std"], 4) if r.get("paper") is not None else "-"
        rows.append([m, _fmt(r["mean"], r["std"]) if m not in CLASSICAL else f"{r['mean']:.3f}", paper])
    lines.append(markdown_table(["method", "this run", "paper (Table 9)"], rows))
    lines += ["", "## Other test metrics (means over windows, then mean ± std over runs)", ""]
    rows = []
    for m in methods:
        rows.append([m] + [_fmt(rec[(m, k)]["mean"], rec[(m, k)]["std"] if m not in CLASSICAL else math.nan)
                           for k in ("ann_return", "ann_vol", "short_share")]
                    + [f"{max(doc['per_run'][m]['max_sum_residual']):.1e}",
                       f"{doc['weights'][m]['gross_leverage']:.2f}", f"{doc['weights'][m]['max_abs_weight']:.3f}"])
    lines.append(markdown_table(["method", "annualised return", "annualised volatility", "share of short weights",
                                 "max abs(sum(w) - 1)", "gross leverage sum abs(w)", "max abs(w)"], rows))
    lines += ["", "## Paired tests over runs (test Sharpe; two-sided Wilcoxon signed-rank, scipy)", "",
              "`a higher`: runs in which the first method's Sharpe is higher. Against a classical allocation "
              "(a constant) this is a one-sample signed-rank test of the differences.", ""]
    rows = [[s["a"], s["b"], f"{s['a_higher']}/{s['n']}", f"{s['median_diff']:+.3f}",
             "n/a" if s["p"] is None or math.isnan(s["p"]) else f"{s['p']:.4f}"] for s in doc["significance"]]
    lines.append(markdown_table(["a", "b", "a higher", "median(a - b)", "p"], rows))
    tr = doc["training"]
    lines += ["", "## Training and validation", "",
              f"Early stopping on the validation Sharpe (the conditional mean for ours), at most {cfg['epochs']} "
              f"epochs, patience {cfg['train']['patience']}. The classical allocations on the same validation "
              "windows for reference.", ""]
    rows = [[m, f"{np.median(tr[m]['best_epoch']):.0f}", f"{np.median(tr[m]['epochs_run']):.0f}",
             f"{np.mean(tr[m]['val_sharpe']):.3f}"] for m in cfg["methods_run"]]
    rows += [[m, "-", "-", f"{tr[m]['val_sharpe'][0]:.3f}"] for m in CLASSICAL if m in tr]
    lines.append(markdown_table(["method", "best epoch (median)", "epochs run (median)",
                                 "val Sharpe at the selected epoch (mean over runs)"], rows))
    lines += ["", "Figures: `portfolio_cumulative.png` (test-period cumulative return of the windows starting every "
              "horizon days, held in sequence; mean over runs, band = ±1 std over runs), `portfolio_weights.png` "
              "(distribution of N w over runs, windows and stocks).", ""]
    return "\n".join(lines)


def plot_cumulative(doc: dict[str, Any], out: Path) -> Path:
    """``portfolio_cumulative.png``: chained non-overlapping test windows, mean over runs with a ±1 std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    days = np.array(doc["curves"]["days"], dtype="datetime64[D]")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m, runs in doc["curves"]["methods"].items():
        y = np.asarray(runs, dtype=np.float64) * 100
        ax.plot(days, y.mean(0), color=_color(m), ls=_style(m), lw=1.6 if m.startswith("ours") else 1.1, label=m)
        if y.shape[0] > 1:
            sd = y.std(0, ddof=1)
            ax.fill_between(days, y.mean(0) - sd, y.mean(0) + sd, color=_color(m), alpha=0.12, lw=0)
    ax.set_ylabel("cumulative return (%)")
    ax.set_title(f"test period, windows of {doc['data']['horizon']} days held in sequence ({doc['preset']})")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    path = Path(out) / "portfolio_cumulative.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_weights(doc: dict[str, Any], out: Path) -> Path:
    """``portfolio_weights.png``: histogram of ``N w`` per method (log counts); 1 is the equal weight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = np.asarray(WEIGHT_EDGES)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m, s in doc["weights"].items():
        c = np.asarray(s["counts"], dtype=np.float64)
        if c.sum() == 0:
            continue
        ax.stairs(c / c.sum(), edges, color=_color(m), ls=_style(m),
                  label=f"{m} ({s['min_Nw']:.1f}..{s['max_Nw']:.1f})")
    ax.axvline(0, color="k", lw=0.6)
    ax.axvline(1, color="k", lw=0.6, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("N x weight (1 = equal weight; values beyond the axis are counted at its ends)")
    ax.set_ylabel("fraction of weights")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(out) / "portfolio_weights.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path
