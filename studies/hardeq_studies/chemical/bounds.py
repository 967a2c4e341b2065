r"""The non-negative-flows variant of the ``chemical`` study: mass balances *and* flows :math:`\ge 0`.

Every output of CSTR and of the plant is a molar flow, and so are six of the ten outputs of the distillation
column (the four others are energies, which are signed); the data never has a negative flow. The ``ours*``
models predict the Gaussian :math:`\mathcal N(\mu(x), \mathrm{diag}\,v(x))` conditioned on the balances
:math:`By = b - Ax` (:meth:`~.task.ChemicalTask.distribution`), whose mean can have a negative flow. Three ways
to predict non-negative flows that meet the balances exactly, from the *same trained network of the same seed*
(the comparison is paired by seed and differs only in the prediction rule):

=========================  =============================================================================
untruncated                the conditional mean (the study's prediction; flows may be negative)
clip-project               the baseline: project orthogonally onto :math:`By = k`, clip the flows at 0,
                           repeat until both hold to round-off (:func:`clip_then_project`)
truncated mean             :math:`E[y \mid By = k,\ y_{\text{flows}} \ge 0]`, the mean of ``draws`` draws of
                           ``ConstrainedNormal.truncate(lower)`` (rejection, or blocked-Gibbs / exact-HMC
                           chains from the mode after ``burn_in`` iterations; docs/bounds.md): a Monte Carlo estimate
truncated mode             the mode of that truncated law: the projection of :math:`\mu` onto the plane and the
                           bounds in the metric :math:`\mathrm{diag}(v)^{-1}`
=========================  =============================================================================

``ours-tNLL`` (chemical/task.py) is the network *trained* through the truncated likelihood of these bounds; its rules
are compared with ``ours-NLL``'s (trained by the untruncated NLL) seed by seed (:data:`TRAINED_CLAIMS`).

Lower bounds are in the scaled units of the study (max-abs scaling has no shift, so 0 stays 0). Per seed the
variant records the test MSE of each rule, the share of negative flows, and the largest balance residual (to show
that every rule is exact in the balances).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["RULES", "METRICS", "lower_bounds", "clip_then_project", "nonnegative_rules", "evaluate_rules",
           "summarise", "claims", "markdown"]

#: the prediction rules, in table order (the first is the untruncated reference)
RULES = ("untruncated", "clip-project", "truncated mean", "truncated mode")
#: per-seed metrics of every rule
METRICS = ("test_mse", "negative_share", "max_balance_residual")


def lower_bounds(spec: Sequence[float | None], n: int) -> Tensor:
    """``(n,)`` float64 lower bounds from the config's list (``null`` -> ``-inf``: a signed output)."""
    if len(spec) != n:
        raise ValueError(f"nonnegative_flows: expected {n} lower bounds (one per output, null for none), got "
                         f"{len(spec)}.")
    return torch.tensor([-math.inf if b is None else float(b) for b in spec], dtype=torch.float64)


def clip_then_project(y: Tensor, B: Tensor, k: Tensor, lower: Tensor, *, max_iter: int = 20000,
                      rtol: float = 1e-12) -> Tensor:
    r"""Alternate the orthogonal projection onto :math:`By = k` and clipping at ``lower`` (float64), ending with
    the clip.

    Each sweep is :math:`y \leftarrow \max(y + B^+(k - By),\ l)`. Alternating projections between two closed convex
    sets with a common point converge to a point of their intersection (von Neumann / Bregman; not in general the
    nearest one, which is why this is a baseline, not the mode). The sweeps stop when every row of :math:`By = k`
    holds to ``rtol (1 + |B||y| + |k|)`` after the clip; the bounds hold exactly.

    Args:
        y: ``(..., n)``; B: ``(a, n)``; k: ``(..., a)``; lower: ``(n,)`` (``-inf`` where unbounded).

    Returns:
        ``(..., n)`` float64 with ``y >= lower``; after ``max_iter`` sweeps the last iterate (its balance residual is
        what the report shows).
    """
    B = B.to(torch.float64)
    k = k.to(torch.float64)
    pinv = torch.linalg.pinv(B)  # (n, a)
    x = torch.maximum(y.detach().to(torch.float64), lower)
    for _ in range(max_iter):
        r = k - x @ B.T
        if bool((r.abs() <= rtol * (1 + x.abs() @ B.abs().T + k.abs())).all()):
            break
        x = torch.maximum(x + r @ pinv.T, lower)
    return x


def nonnegative_rules(dist, lower: Tensor, B: Tensor, k: Tensor, *, draws: int, chains: int, burn_in: int,
                      seed: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The predictions ``(..., n)`` (float64) of every rule of :data:`RULES` for the conditional law ``dist`` (a
    ``ConstrainedNormal`` with batch ``(...)``), and how the truncated mean was sampled: it averages ``draws``
    draws (rejection, or ``chains`` blocked-Gibbs / exact-HMC chains from the mode after ``burn_in`` iterations)
    taken under a forked RNG seeded with ``seed``; the record is
    :func:`hardeq_studies.truncated_mean.truncated_mean`'s."""
    from ..truncated_mean import truncated_mean

    mean = dist.mean.to(torch.float64)
    truncated = dist.truncate(lower.to(dist.mean.dtype), None)
    tmean, sampler = truncated_mean(truncated, draws=draws, chains=chains, burn_in=burn_in, seed=seed)
    return ({"untruncated": mean, "clip-project": clip_then_project(mean, B, k, lower),
             "truncated mean": tmean.to(torch.float64), "truncated mode": truncated.mode.to(torch.float64)}, sampler)


def evaluate_rules(preds: Mapping[str, Tensor], y: Tensor, B: Tensor, k: Tensor, lower: Tensor) -> dict[str, Any]:
    """Per rule: ``test_mse`` (mean over samples and outputs), ``negative_share`` (fraction of the bounded
    outputs below their bound) and ``max_balance_residual`` (:math:`\\max |By - k|`, scaled units)."""
    bounded = torch.isfinite(lower)
    y = y.to(torch.float64)
    out = {}
    for rule, p in preds.items():
        below = (p < lower)[..., bounded]
        out[rule] = {"test_mse": float((p - y).square().mean()),
                     "negative_share": float(below.to(torch.float64).mean()) if below.numel() else 0.0,
                     "max_balance_residual": float((p @ B.to(torch.float64).T - k.to(torch.float64)).abs().max())}
    return out


# ---------------------------------------------------------------------------------------------- the report
#: the hypotheses tested over seeds: (claim, the rule that should be better, the rule it is compared with)
CLAIMS = (("bounds help: the truncated mean beats the untruncated mean", "truncated mean", "untruncated"),
          ("the truncated mean beats clip-then-project", "truncated mean", "clip-project"),
          ("the truncated mode beats clip-then-project", "truncated mode", "clip-project"))
#: how this comparison differs from a decisive one
DIFFERS = "the bounds enter only at prediction (the networks are trained untruncated), and seeds are few"
#: training through the bounds against training without them: (claim, method, reference method, rule), per seed
TRAINED_CLAIMS = (("training through the bounds: ours-tNLL's truncated mean beats ours-NLL's", "ours-tNLL",
                   "ours-NLL", "truncated mean"),
                  ("training through the bounds: ours-tNLL's truncated mode beats ours-NLL's", "ours-tNLL",
                   "ours-NLL", "truncated mode"))
#: how that comparison differs from a decisive one
DIFFERS_TRAINED = "its gradient is persistent-chain (biased, a few sweeps per step), and seeds are few"


def summarise(part: Mapping[str, Mapping[str, Any]], dataset: str) -> dict[str, Any]:
    """Records and paired tests of one data set's variant: ``part`` is ``{method: {rule: {metric: [per
    seed]}}}`` (and ``"sampler"``: the truncated mean's sampler record per seed); the records carry
    ``method = "nonneg: METHOD RULE"`` and ``variant = "nonnegative flows"``."""
    from ..stats import paired_wilcoxon

    records, tests = [], []
    for m, rules in part.items():
        for rule in RULES:
            for metric in METRICS:
                v = torch.tensor(rules[rule][metric], dtype=torch.float64)
                records.append({"dataset": dataset, "method": f"nonneg: {m} {rule}", "metric": metric,
                                "mean": float(v.mean()), "std": float(v.std()) if v.numel() > 1 else math.nan,
                                "n_seeds": int(v.numel()), "paper": None, "variant": "nonnegative flows"})
        for claim, a, b in CLAIMS:
            x, y = rules[a]["test_mse"], rules[b]["test_mse"]
            tests.append({"dataset": dataset, "method": m, "claim": claim, "a": a, "b": b, "metric": "test_mse",
                          **paired_wilcoxon(x, y)})
    for claim, m, ref, rule in TRAINED_CLAIMS:
        if m in part and ref in part:
            x, y = part[m][rule]["test_mse"], part[ref][rule]["test_mse"]
            tests.append({"dataset": dataset, "method": f"{m} vs {ref}", "claim": claim, "a": f"{m} {rule}",
                          "b": f"{ref} {rule}", "metric": "test_mse", **paired_wilcoxon(x, y)})
    return {"records": records, "significance": tests}


def claims(doc: Mapping[str, Any]) -> list:
    """The :data:`CLAIMS` for every data set and method of ``doc["nonnegative_flows"]`` (lower MSE is better)."""
    from ..claims import Claim

    out = []
    for d, part in doc["nonnegative_flows"]["per_seed"].items():
        tests = {(t["method"], t["claim"]): t for t in doc["nonnegative_flows"]["significance"][d]}
        for m, rules in part.items():
            for claim, a, b in CLAIMS:
                t = tests[(m, claim)]
                mean = {r: sum(rules[r]["test_mse"]) / len(rules[r]["test_mse"]) for r in (a, b)}
                out.append(Claim(f"{d}, {m}: {claim}", f"{b} (test MSE {mean[b]:.3e})",
                                 f"{a} {mean[a]:.3e}; lower in {t['wins']}/{t['n']} seeds, median difference "
                                 f"{t['median_diff']:+.2e}", test=t, lower_is_better=True,
                                 differs=DIFFERS_TRAINED if m == "ours-tNLL" else DIFFERS,
                                 budget="more seeds" if m == "ours-tNLL" else "more seeds, or bounds in training"))
        for claim, m, ref, rule in TRAINED_CLAIMS:
            t = tests.get((f"{m} vs {ref}", claim))
            if t is None:
                continue
            mean = {x: sum(part[x][rule]["test_mse"]) / len(part[x][rule]["test_mse"]) for x in (m, ref)}
            out.append(Claim(f"{d}: {claim}", f"{ref} {rule} (test MSE {mean[ref]:.3e})",
                             f"{m} {mean[m]:.3e}; lower in {t['wins']}/{t['n']} seeds, median difference "
                             f"{t['median_diff']:+.2e}", test=t, lower_is_better=True, differs=DIFFERS_TRAINED,
                             budget="more seeds"))
    return out


def markdown(doc: Mapping[str, Any], family: Sequence[Any] = ()) -> list[str]:
    """The non-negative-flows section of ``chemical.md`` (lines), or ``[]`` for a document without it; ``family``:
    the study's claims of the paper, in the same Holm family as this section's."""
    from ..bounds_claims import bounds_claims_section
    from ..results import markdown_table
    from ..truncated_mean import RHAT_CAVEAT, sampler_line

    part = doc.get("nonnegative_flows")
    if not part:
        return []
    rows = []
    for d, methods in part["per_seed"].items():
        for m, rules in methods.items():
            for rule in RULES:
                r = rules[rule]
                v = torch.tensor(r["test_mse"], dtype=torch.float64)
                sd = f" ± {float(v.std()) * 1e4:.3f}" if v.numel() > 1 else ""
                rows.append([d, m, rule, f"{float(v.mean()) * 1e4:.3f}{sd}",
                             f"{sum(r['negative_share']) / len(r['negative_share']):.4f}",
                             f"{max(r['max_balance_residual']):.1e}"])
    cfg = part["config"]
    lines = ["", "## Non-negative flows: the balances and flows >= 0", "",
             "Each seed's trained network of the methods below, predicting four ways on the test set "
             "(chemical/bounds.py): the untruncated conditional mean (the study's prediction), the clip-then-project "
             "baseline (clip the flows at 0, project onto the balances, repeat), and the mean and the mode of its "
             "law *truncated* to non-negative flows (`ConstrainedNormal.truncate(lower)`; the mean from "
             f"{cfg['draws']} draws per sample: rejection when its acceptance allows, else "
             f"{cfg.get('chains', cfg['draws'])} blocked-Gibbs chains from the mode, each after {cfg['burn_in']} "
             "sweeps; exact in their stationary law, every draw feasible). Bounded outputs: "
             + "; ".join(f"{d} {[i + 1 for i, b in enumerate(cfg['lower'][d]) if b is not None]}"
                         for d in part["per_seed"])
             + " (1-based). Test MSE in scaled units x 1e-4, mean ± std over seeds.", "",
             markdown_table(["dataset", "method", "rule", "test MSE (x 1e-4)", "share of negative flows",
                             "max abs(B y - k)"], rows)]
    samplers = [sampler_line(f"{d}, {m}", rules["sampler"], unit="seeds", over="test point and flow")
                for d, methods in part["per_seed"].items() for m, rules in methods.items() if rules.get("sampler")]
    if any(r["max_rhat"] is not None for methods in part["per_seed"].values() for rules in methods.values()
           for r in rules.get("sampler") or []):
        samplers.append(f"- {RHAT_CAVEAT}.")
    lines += ["", *samplers] if samplers else []
    if any("ours-tNLL" in methods for methods in part["per_seed"].values()):
        lines += ["", "`ours-tNLL` is trained *through* the bounds (chemical/task.py): the truncated law's negative "
                  "log-density of each target, its `log Z` gradient from persistent Gibbs chains "
                  "(`truncate(lower, training=chains)`, docs/bounds.md); its rules are compared with `ours-NLL`'s, "
                  "seed by seed."]
    two = any("ours-tNLL" in methods for methods in part["per_seed"].values())
    lines += ["", bounds_claims_section("Non-negative flows: do the bounds help?", claims(doc), family=family, intro=(
        "Two-sided paired Wilcoxon signed-rank tests of the test MSE over seeds (the rules share the seed's "
        "network" + ("; the `ours-tNLL` vs `ours-NLL` rows compare two networks of one seed" if two else "")
        + ").")).rstrip("\n")]
    return lines
