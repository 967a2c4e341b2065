"""The plan of a ``diffusion`` run: a preset's settings (:func:`settings`), the tables with their variants, image
counts and FID rows (:func:`tables_of`), the paired comparisons of each table (:func:`comparisons`) and how the
images of a sampling group split into chunks."""

from __future__ import annotations

import copy
from typing import Any

from .sampling import Variant, ddim_variants, ddpm_variants, parse_schedule

__all__ = ["settings", "tables_of", "comparisons", "TABLE_TITLES", "REAL", "DECIDING"]

TABLE_TITLES = {"3": "DDPM and the constrained last step (paper Table 3)",
                "4": "DDIM and conditioned x0-predictions (paper Table 4)",
                "6": "conditioning schedules of DDIM (paper Table 9)",
                "7": "Start N End N (paper Table 10)"}
REAL = "real images (train split)"
#: the unconstrained samplers, the constrained DDPM step (also as exact 8-bit images: does its noise cost the FID,
#: or the clipping and rounding of it?) and the projections they are compared with: with
#: ``fid.rows = "deciding"`` only these rows (and the headline DDIM schedule, and the real images) get an FID
DECIDING = ("ddpm", "ddpm+ours", "ddpm+ours+u8", "ddpm+project", "ddim", "ddim+project")


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def settings(config: dict[str, Any], preset: str, dataset: str | None = None) -> dict[str, Any]:
    """The protocol of ``preset``: ``config["protocol"]`` overridden by the preset's entries and then by the
    preset's ``datasets[DATASET]`` entries (``dataset``: the preset's when None)."""
    if preset not in config["presets"]:
        raise ValueError(f"preset must be one of {sorted(config['presets'])}, got {preset!r}.")
    p = {k: v for k, v in config["presets"][preset].items() if k not in ("description", "duration")}
    per_dataset = p.pop("datasets", {})
    s = _merge(config["protocol"], p)
    if dataset is not None:
        s["dataset"] = dataset
    s = _merge(s, per_dataset.get(s["dataset"], {}))
    s.setdefault("seeds", 1)
    return s


def tables_of(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The comparisons: per table its variants (baseline first), the number of images ``n`` per noise seed, whether
    the Inception FID is computed (``fid``) and for which rows (``fid_rows``: every row, or with ``fid.rows =
    "deciding"`` the rows that decide the paper's claims, :data:`DECIDING` and the headline schedule)."""
    sm = s["sampling"]
    head = sm["headline"]
    ddpm = ddpm_variants()
    ddim = {v.key: v for v in ddim_variants(sorted({head, *s["tables"]["6"], *s["tables"]["7"]}),
                                            int(sm["ddim_steps"]), head)}
    fid_tables = set(s["fid"]["tables"]) if s["fid"].get("inception") else set()

    def sched(text: str) -> Variant:
        return ddim[f"ddim@{parse_schedule(text)!r}"]

    out = {"3": {"variants": ddpm, "n": int(sm["n_ddpm"])},
           "4": {"variants": [ddim["ddim"], sched(head), ddim[sched(head).key + "+det"],
                              ddim[sched(head).key + "+box"], ddim["ddim+project"], ddim["ddim+project+clip"]],
                 "n": int(sm["n_ddim"])},
           "6": {"variants": [ddim["ddim"], *[sched(t) for t in s["tables"]["6"]]], "n": int(sm["n_sweep"])},
           "7": {"variants": [ddim["ddim"], *[sched(t) for t in s["tables"]["7"]]], "n": int(sm["n_sweep"])}}
    deciding = {*DECIDING, sched(head).key}
    every_row = s["fid"].get("rows", "all") == "all"
    for k, t in out.items():
        t["fid"] = k in fid_tables
        t["title"] = TABLE_TITLES[k]
        t["fid_rows"] = [v.key for v in t["variants"] if t["fid"] and (every_row or v.key in deciding)]
    return out


def comparisons(table: str, variants: list[Variant]) -> dict[str, list[tuple[str, str]]]:
    """The paired comparisons ``(a, b)`` (variant keys; ``a - b``) of a table, per kind: ``"residual"`` (the
    largest channel residual of the float output, paired Wilcoxon over images), ``"residual_u8"`` (the same on
    the saved 8-bit images) and ``"set"`` (FID and classifier FD, paired bootstrap over images). Only pairs
    whose variants are both in the table."""
    keys = {v.key for v in variants}
    head = next((v.key for v in variants if v.key.startswith("ddim@") and v.post is None), None)
    out: dict[str, list[tuple[str, str]]] = {"residual": [], "residual_u8": [], "set": []}
    if table == "3":
        out["residual"] = [("ddpm+ours", "ddpm"), ("ddpm+ours+box", "ddpm")]
        out["residual_u8"] = [("ddpm+ours+box", "ddpm+ours"), ("ddpm+ours+box", "ddpm+project+clip"),
                              ("ddpm+ours+u8", "ddpm+ours")]
        out["set"] = [("ddpm+ours", "ddpm"), ("ddpm+ours+det", "ddpm"), ("ddpm+ours+box", "ddpm"),
                      ("ddpm+ours", "ddpm+project"), ("ddpm+ours+det", "ddpm+project"), ("ddpm+project", "ddpm"),
                      ("ddpm+ours+u8", "ddpm"), ("ddpm+ours+u8", "ddpm+ours")]
    elif table == "4" and head is not None:
        out["residual"] = [(head, "ddim"), (head + "+box", "ddim")]
        out["residual_u8"] = [(head + "+box", head), (head + "+box", "ddim+project+clip")]
        out["set"] = [(head, "ddim"), (head + "+det", "ddim"), (head + "+box", "ddim"), (head, "ddim+project"),
                      (head + "+det", "ddim+project")]
    elif table == "6":  # end placement: End N Space s against Start N Space s
        out["residual"] = [(k.replace("StartSpaced", "EndSpaced"), k) for k in sorted(keys) if "StartSpaced" in k]
    return {kind: [(a, b) for a, b in pairs if a in keys and b in keys] for kind, pairs in out.items()}


def _group_sizes(tables: dict[str, dict[str, Any]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for t in tables.values():
        for v in t["variants"]:
            sizes[v.group] = max(sizes.get(v.group, 0), t["n"])
    return sizes


def _chunks(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - i) for i in range(0, n, chunk)]
