"""Formatting shared by the ``diffusion`` report's modules: the rows and metrics of a results document, how a
number, a cell and a confidence interval print, the paper's table numbers and values, and the wall time."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ..results import wall_time

__all__ = ["PAPER_TABLES", "paper_table", "METRICS", "STEP_NOTE"]

#: this study's table keys -> the paper's table numbers in its source order (the schedule tables are 9 and 10)
#: this study's table keys -> the paper's table numbers in its source order (the schedule tables are 9 and 10)
PAPER_TABLES = {"3": "3", "4": "4", "6": "9", "7": "10"}


def _wall(doc: Mapping[str, Any], seconds: float | None) -> str:
    """The run's wall time in seconds with its label (:func:`hardeq_studies.results.wall_time`)."""
    total, label = wall_time(doc, seconds)
    return f"{total:.0f} s ({label})" if total is not None else "not recorded"


def paper_table(key: str) -> str:
    """The paper's number of the table this study's key ``key`` reproduces (``"6"`` -> ``"9"``)."""
    return PAPER_TABLES.get(str(key), str(key))


#: the metrics of a row
METRICS = ("violation_rate", "max_residual", "mean_residual", "out_of_range", "violation_rate_u8",
           "max_residual_u8", "max_abs_diff_to_projection", "mean_abs_change", "fid",
           "inception_score", "classifier_fd", "classifier_score", "classifier_confidence")
_METRIC_NAMES = {"violation_rate": "violation rate", "violation_rate_u8": "8-bit violation rate",
                 "residual": "abs(sum - k)", "residual_u8": "8-bit abs(sum - T)",
                 "max_residual": "max |sum - k|", "out_of_range":
                 "pixels outside [0, 1]", "fid": "FID", "classifier_fd": "classifier FD",
                 "classifier_score": "classifier score", "mean_abs_change": "mean |change|"}


def _fmt(x: float | None, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:{spec}}"


def _index(doc: Mapping[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(r["table"], r["method"], r["metric"]): r for r in doc["records"]}


def _cell(rec: Mapping[str, Any] | None, spec: str = ".3g", *, boot: bool = False) -> str:
    if rec is None or rec.get("mean") is None:
        return "–"
    text = _fmt(rec["mean"], spec)
    if rec.get("std") is not None:
        text += f" ± {_fmt(rec['std'], spec)}"
    elif boot and rec.get("bootstrap_std") is not None:
        text += f" ± {_fmt(rec['bootstrap_std'], spec)}"
    return text


def _ci(rec: Mapping[str, Any] | None, spec: str = ".3g") -> str:
    if rec is None or not rec.get("ci95_diff"):
        return "–"
    lo, hi = rec["ci95_diff"]
    return f"[{_fmt(lo, spec)}, {_fmt(hi, spec)}]"


def _paper_entry(doc: Mapping[str, Any], table: str, label: str) -> dict[str, Any]:
    """The paper's values of a row (config ``paper.tables``), ``{}`` when the paper has none."""
    return dict(doc["config"].get("paper", {}).get("tables", {}).get(table, {}).get(label, {}))


def _paper(doc: Mapping[str, Any], table: str, label: str, metric: str, spec: str = ".3f") -> str:
    """The paper's value of ``metric`` for a row, read from the config (so it is printed whether or not this run
    computed the metric); the Inception Score as ``mean ± std`` where the paper gives the std."""
    v = _paper_entry(doc, table, label).get(metric)
    if v is None:
        return "–"
    if isinstance(v, (list, tuple)):
        return _fmt(v[0], spec) + (f" ± {_fmt(v[1], spec)}" if len(v) > 1 and v[1] is not None else "")
    return _fmt(v, spec)


def _rows(doc: Mapping[str, Any], table: str) -> list[str]:
    meta = doc["tables"][table]
    return [v["label"] for v in meta["variants"]] + ["real images (train split)"]


def _sig(doc: Mapping[str, Any], table: str, a: str, b: str, metric: str) -> dict[str, Any] | None:
    for r in doc.get("significance", []):
        if (r["table"], r["a"], r["b"], r["metric"]) == (table, a, b, metric):
            return r
    return None


def _title(meta: Mapping[str, Any]) -> str:
    """A table's title with the paper's table number in its source order (the JSON keeps the study's keys)."""
    return re.sub(r"paper Table (\d+)", lambda m: f"paper Table {paper_table(m.group(1))}", meta["title"])


def _rate(idx: Mapping[tuple[str, str, str], Any], table: str, label: str, metric: str) -> float | None:
    r = idx.get((table, label, metric))
    return None if r is None else r.get("mean")


def _set_metric(doc: Mapping[str, Any], table: str) -> str:
    return "fid" if doc["tables"].get(table, {}).get("fid") else "classifier_fd"


def _exact(rates: Mapping[str, float | None]) -> bool:
    return all(v == 0 for v in rates.values())


#: how the project's conditioned steps differ from a fully specified protocol (said where the results are read)
STEP_NOTE = ("conditioned steps draw an exact sample of N(x0_hat, beta_t I) given the constraint; the paper does not "
             "specify this step variance, so beta_t is this study's choice; every sampler runs with "
             "`clip_sample=False` (no clipping of x0_hat to [-1, 1], unlike standard DDPM), so that the conditioned "
             "output is exact before any clipping")
