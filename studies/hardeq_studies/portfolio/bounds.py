r"""The long-only variant of the ``portfolio`` study: weights in ``[0, 1]`` that sum to one.

The ``ours`` head gives, per test window, the Gaussian :math:`\mathcal N(\mu, \mathrm{diag}\,v)` over the
stocks' weights conditioned on :math:`\sum_i w_i = 1` (:meth:`~.task.WeightHead.distribution`). Its conditional
mean, the weights ``ours`` is evaluated at, may be short (:math:`w_i < 0`). A long-only investor needs
:math:`0 \le w_i \le 1`. Three ways to get there from the *same trained network of the same run* (so every
comparison is paired by run and differs only in the decision rule):

=========================  =============================================================================
ours                       the untruncated conditional mean (the study's ``ours``; may be short)
ours clip-project          the clip-then-project baseline: clip the conditional mean to ``[0, 1]``, project
                           orthogonally onto :math:`\sum w = 1`, repeat until both hold to round-off
                           (:func:`clip_then_project`); a repair of the decision, blind to the variances
ours truncated mean        the mean of the law *truncated* to the box,
                           :math:`E[w \mid \sum w = 1,\ 0 \le w \le 1]`, estimated by the average of
                           ``draws`` draws of ``ConstrainedNormal.truncate(0, 1)`` (rejection, or blocked
                           Gibbs / exact HMC chains from the mode after ``burn_in`` iterations:
                           docs/bounds.md); long-only by construction (a mean of feasible points); a Monte
                           Carlo estimate, so its test Sharpe carries the estimate's noise
ours truncated mode        the mode of the truncated law: the projection of :math:`\mu` onto the simplex in the
                           metric :math:`\mathrm{diag}(v)^{-1}` (:attr:`TruncatedConstrainedNormal.mode`)
=========================  =============================================================================

The network is trained once, as ``ours`` (untruncated expected Sharpe); the bounds enter at the decision. What
is measured per run is the test Sharpe of each rule, the share of short weights, the largest bound violation and
sum residual, and how far each rule moves the weights from the untruncated mean (mean over windows of
:math:`\sum_i |w_i - \bar w_i|`, the turnover the bound forces).

**Trained through the bounds** (:data:`TRAINED`, with ``long_only.trained`` in the config). A second network per
run, from the same initialisation as ``ours``, is trained through the truncated likelihood: its loss is
``w_pred`` times the forecast MSE plus :math:`-\log p_{\text{trunc}}(y) / N`, the truncated law's log-density
(``ConstrainedNormal.truncate(0, 1, training=chains)``, the gradient of :math:`\log Z` from persistent Gibbs chains,
docs/bounds.md) of the window's target :math:`y`: the *ex-post* long-only maximum-Sharpe weights of the window's
realised returns (:func:`long_only_targets`, the Markowitz allocation of :mod:`.classical` on the future instead of
the past). Its epoch is selected on the validation Sharpe of its truncated mode; it is decided with the mean and the
mode of its truncated law (:data:`TRAINED_RULES`), compared over runs with ``ours``'s (the same seed).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = ["RULES", "TRAINED", "TRAINED_RULES", "clip_then_project", "long_only_weights", "long_only_stats",
           "test_outputs", "long_only_targets", "truncated_nll", "truncated_mode_weights"]

#: the decision rules compared, in table order (the first is the untruncated reference)
RULES = ("ours", "ours clip-project", "ours truncated mean", "ours truncated mode")
#: the network trained through the truncated likelihood (one unit per run beside ``ours``)
TRAINED = "ours-truncated"
#: its rules in the table, and the rule of :func:`long_only_weights` each one is
TRAINED_RULES = {"ours-truncated truncated mean": "ours truncated mean",
                 "ours-truncated truncated mode": "ours truncated mode"}


def clip_then_project(w: Tensor, lower: float = 0.0, upper: float = 1.0, total: float = 1.0, *,
                      max_iter: int = 1000, tol: float | None = None) -> Tensor:
    r"""Alternate clipping to ``[lower, upper]`` and the orthogonal projection onto :math:`\sum_i w_i = t`.

    Each sweep clips every entry, then adds :math:`(t - \sum_i w_i) / m` to the :math:`m` entries strictly
    inside the box (the projection onto the plane within the face the clip reached, so the clipped entries stay
    put), until the sum residual is below ``tol`` and every entry is in the box; a final clip makes the bounds
    exact. Alternating projections onto two convex sets with a common point converge to a point of the
    intersection (not in general the nearest one, which is why this is a baseline, not the mode).

    Args:
        w: ``(..., N)`` weights (any floating dtype; computed in float64).
        lower, upper: the box, ``lower * N <= total <= upper * N``.
        total: the sum ``t``.
        max_iter: sweeps before a ``RuntimeError``.
        tol: sum tolerance (default ``64 N eps(float64)``).

    Returns:
        ``(..., N)`` in ``w``'s dtype: every entry in ``[lower, upper]`` and :math:`|\sum w - t|` within ``tol``.

    Raises:
        ValueError: an empty polytope (``total`` outside ``[N lower, N upper]``).
        RuntimeError: no convergence in ``max_iter`` sweeps.
    """
    N = w.shape[-1]
    if not N * lower <= total <= N * upper:
        raise ValueError(f"clip_then_project: {N} weights in [{lower}, {upper}] cannot sum to {total}.")
    tol = 64 * N * torch.finfo(torch.float64).eps if tol is None else float(tol)
    x = w.detach().to(torch.float64).clamp(lower, upper)
    for _ in range(max_iter):
        r = total - x.sum(-1, keepdim=True)
        if bool((r.abs() <= tol).all()):
            return x.to(w.dtype)
        inside = (x > lower) & (x < upper)
        # entries that can move towards the plane: inside the box, or at the bound the residual pulls away from
        free = inside | ((x <= lower) & (r > 0)) | ((x >= upper) & (r < 0))
        m = free.sum(-1, keepdim=True).clamp_min(1)
        x = torch.where(free, x + r / m, x).clamp(lower, upper)
    raise RuntimeError(f"clip_then_project: no convergence in {max_iter} sweeps (largest residual "
                       f"{float((total - x.sum(-1)).abs().max()):.3e}).")


def long_only_weights(head, raw: Tensor, *, draws: int, chains: int, burn_in: int,
                      seed: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The weights ``(K, N)`` (float64) of every rule of :data:`RULES` for the ``ours`` head's raw outputs
    ``raw`` ``(K, N, 2)`` of the ``K`` test windows, and how the truncated mean was sampled.

    The truncated mean averages ``draws`` draws per window: rejection when its acceptance is high enough, else
    ``chains`` Markov chains from the mode, ``draws / chains`` kept draws each after ``burn_in`` iterations (blocked
    Gibbs for this diagonal covariance; ``method='auto'``), taken under a forked RNG seeded with ``seed``
    (reproducible, global stream untouched). The sampler record is
    :func:`hardeq_studies.truncated_mean.truncated_mean`'s."""
    from ..truncated_mean import truncated_mean

    dist = head.distribution(raw.to(torch.float64))
    mean = dist.mean
    truncated = dist.truncate(0.0, 1.0)
    tmean, sampler = truncated_mean(truncated, draws=draws, chains=chains, burn_in=burn_in, seed=seed)
    return ({"ours": mean, "ours clip-project": clip_then_project(mean), "ours truncated mean": tmean,
             "ours truncated mode": truncated.mode}, sampler)


def long_only_targets(returns: Tensor, *, rf: float, days: int) -> Tensor:
    """The training targets of :data:`TRAINED`, ``(K, N)`` float64: the long-only maximum-Sharpe weights of each
    window's *realised* daily returns ``returns`` ``(K, H, N)`` (:func:`~.classical.max_sharpe_long_only`, Ledoit-Wolf
    covariance); every entry in ``[0, 1]`` and each row summing to one to round-off. Computed once per ``returns``
    tensor (the runs of a universe share it; a weak-keyed cache)."""
    from .classical import max_sharpe_long_only

    cached = _TARGETS.get(id(returns))
    if cached is None or cached[0]() is not returns or cached[1] != (rf, days):
        _TARGETS.clear()  # one universe at a time: no other entry is needed again
        cached = (weakref.ref(returns), (rf, days), max_sharpe_long_only(returns.detach().cpu(), rf=rf, days=days))
        _TARGETS[id(returns)] = cached
    return cached[2]


#: :func:`long_only_targets` of the last returns tensor (by id, checked through a weak reference)
_TARGETS: dict[int, tuple[Any, tuple[float, int], Tensor]] = {}


def truncated_nll(head, raw: Tensor, target: Tensor, state: dict[str, Any]) -> Tensor:
    r""":math:`-\log p_{\text{trunc}}(y) / N`, averaged over the batch, of the targets ``target`` ``(B, N)`` under the
    ``ours`` law of ``raw`` ``(B, N, 2)`` truncated to ``[0, 1]`` in training mode (float64). ``state`` keeps the
    persistent chains across steps (``state["chains"]``: the ``training=True`` truncation's
    :class:`hardeq.bounds.PersistentChains`, made at the first step with ``state["num_chains"]`` chains and
    ``state["sweeps"]`` sweeps). Its value is the *unnormalised* NLL (training mode does not estimate
    :math:`\log Z`), its gradient the likelihood's with :math:`\nabla\log Z` from the chains."""
    dist = head.distribution(raw.to(torch.float64)).truncate(0.0, 1.0, training=state.get("chains", True))
    if "chains" not in state:
        state["chains"] = dist.training
        state["chains"].chains, state["chains"].sweeps = int(state["num_chains"]), int(state["sweeps"])
    return -dist.log_prob(target.to(torch.float64)).mean() / head.N


def truncated_mode_weights(head, raw: Tensor) -> Tensor:
    """The truncated law's mode ``(K, N)`` (float64) of the ``ours`` law of ``raw`` ``(K, N, 2)``: the decision the
    validation Sharpe of :data:`TRAINED` selects its epoch on (deterministic)."""
    return head.distribution(raw.to(torch.float64)).truncate(0.0, 1.0).mode


def test_outputs(model, inputs: Tensor, batch_size: int = 64) -> Tensor:
    """The weight head's raw outputs ``(K, N, c)`` (float64) of the network ``model`` on the windows ``inputs``
    (relative prices ``(K, T, N)``), in evaluation mode and without gradients, as :func:`~.run.evaluate` forms
    them."""
    model.eval()
    with torch.no_grad():
        raws = [model(inputs[i: i + batch_size] - 1)[1].to(torch.float64) for i in range(0, inputs.shape[0],
                                                                                         batch_size)]
    return torch.cat(raws)


def long_only_stats(weights: dict[str, Tensor], returns: Tensor, *, rf: float, days: int) -> dict[str, Any]:
    """Per-rule means over the test windows: ``test_sharpe``, ``short_share`` (fraction of weights < 0),
    ``max_violation`` (largest distance of a weight outside ``[0, 1]``), ``max_sum_residual``
    (:math:`\\max |\\sum w - 1|`) and ``moved`` (mean over windows of :math:`\\sum_i |w_i - \\bar w_i|`, from the
    untruncated mean :math:`\\bar w`)."""
    from .task import portfolio_stats

    base = weights["ours"]
    out: dict[str, Any] = {}
    for rule, w in weights.items():
        s = portfolio_stats(w, returns.to(torch.float64), rf=rf, days=days)
        violation = torch.maximum((-w).clamp_min(0), (w - 1).clamp_min(0)).amax()
        out[rule] = {"test_sharpe": float(s["sharpe"].mean()), "short_share": float(s["short_share"].mean()),
                     "max_violation": float(violation), "max_sum_residual": float(s["sum_residual"].max()),
                     "moved": float((w - base).abs().sum(-1).mean())}
    return out


#: the per-run metrics of every rule (means over the test windows; max for the violation and the residual)
METRICS = ("test_sharpe", "short_share", "max_violation", "max_sum_residual", "moved")
#: the hypotheses tested over runs: (claim, the rule that should be better, the rule it is compared with)
CLAIMS = (("bounds help: the truncated mean beats the untruncated mean", "ours truncated mean", "ours"),
          ("the truncated mean beats clip-then-project", "ours truncated mean", "ours clip-project"),
          ("the truncated mode beats clip-then-project", "ours truncated mode", "ours clip-project"))
#: the hypotheses of the network trained through the truncated likelihood (tested when it was run)
TRAINED_CLAIMS = (("training through the bounds: its truncated mean beats ours's", "ours-truncated truncated mean",
                   "ours truncated mean"),
                  ("training through the bounds: its truncated mode beats ours's", "ours-truncated truncated mode",
                   "ours truncated mode"))
#: how this comparison differs from a decisive one
DIFFERS = ("the bounds enter only at the decision (the network is trained untruncated), and the universes and runs "
           "are few")
#: the same for the claims of the network trained through the bounds
DIFFERS_TRAINED = ("its targets (the ex-post long-only maximum-Sharpe weights) are this repository's choice, its "
                   "gradient is persistent-chain (biased), and the universes and runs are few")


def summarise(result: dict[str, Any], runs: list[int], universe: str) -> dict[str, Any] | None:
    """``{"per_run": {rule: {metric: [per run]}}, "records", "significance"}`` of one universe's long-only rules
    (``None`` when ``ours`` was not run with the long-only variant). Records: ``method = "long-only: RULE"``."""
    from ..stats import paired_wilcoxon

    units = [result["units"].get(("ours", r)) for r in runs]
    if not units or any(u is None or "long_only" not in u for u in units):
        return None
    per_run = {rule: {k: [float(u["long_only"][rule][k]) for u in units] for k in METRICS} for rule in RULES}
    trained = [result["units"].get((TRAINED, r)) for r in runs]
    claims_run = CLAIMS
    if all(u is not None and "long_only" in u for u in trained):
        for rule, own in TRAINED_RULES.items():
            per_run[rule] = {k: [float(u["long_only"][own][k]) for u in trained] for k in METRICS}
        claims_run = CLAIMS + TRAINED_CLAIMS
    records = []
    for rule in per_run:
        for k in METRICS:
            v = torch.tensor(per_run[rule][k], dtype=torch.float64)
            records.append({"dataset": universe, "method": f"long-only: {rule}", "metric": k, "mean": float(v.mean()),
                            "std": float(v.std()) if v.numel() > 1 else float("nan"), "n_seeds": int(v.numel()),
                            "paper": None, "variant": "long-only"})
    tests = []
    for claim, a, b in claims_run:
        x, y = per_run[a]["test_sharpe"], per_run[b]["test_sharpe"]
        t = paired_wilcoxon(x, y)
        tests.append({"universe": universe, "claim": claim, "a": a, "b": b, "metric": "test_sharpe",
                      "a_higher": int(sum(xi > yi for xi, yi in zip(x, y))), **t})
    sampler = [u.get("long_only_sampler") for u in units]
    out = {"per_run": per_run, "records": records, "significance": tests,
           "sampler": sampler if all(x is not None for x in sampler) else None}
    if claims_run is not CLAIMS:
        out["trained"] = {"best_epoch": [int(u["best_epoch"]) for u in trained],
                          "val_sharpe": [float(u["val_sharpe"]) for u in trained],
                          "seconds": [float(u["seconds"]) for u in trained],
                          "sampler": [u.get("long_only_sampler") for u in trained]}
    return out


def claims(doc: dict[str, Any]) -> list:
    """The :data:`CLAIMS` in every universe of ``doc["long_only"]`` (higher test Sharpe is better)."""
    from ..claims import Claim

    out = []
    for u, part in doc["long_only"].items():
        for t in part["significance"]:
            means = {r: sum(part["per_run"][r]["test_sharpe"]) / len(part["per_run"][r]["test_sharpe"])
                     for r in (t["a"], t["b"])}
            trained = t["a"] in TRAINED_RULES
            out.append(Claim(f"{u}: {t['claim']}", f"{t['b']} (test Sharpe {means[t['b']]:.3f})",
                             f"{t['a']} {means[t['a']]:.3f}; higher in {t['a_higher']}/{t['n']} runs, median "
                             f"difference {t['median_diff']:+.3f}", test=t, lower_is_better=False,
                             differs=DIFFERS_TRAINED if trained else DIFFERS,
                             budget="more runs" if trained else "more runs, or bounds in training"))
    return out


def _sampler_lines(parts: dict[str, Any]) -> list[str]:
    """One line per universe naming the truncated mean's sampler over the runs (``[]`` for documents written
    before the sampler was recorded)."""
    from ..truncated_mean import RHAT_CAVEAT, sampler_line

    lines = [sampler_line(u, part["sampler"], unit="runs", over="window and weight")
             for u, part in parts.items() if part.get("sampler")]
    if any(r["max_rhat"] is not None for part in parts.values() for r in part.get("sampler") or []):
        lines.append(f"- {RHAT_CAVEAT}; docs/portfolio.md checks the worst windows against long reference chains "
                     "(`python -m hardeq_studies.portfolio.mixing`).")
    return ["", *lines] if lines else []


def markdown(doc: dict[str, Any], family: list[Any] | tuple[Any, ...] = ()) -> list[str]:
    """The long-only section of ``portfolio.md`` (lines), or ``[]`` for a document without the variant; ``family``:
    the study's claims of the paper, in the same Holm family as this section's."""
    from ..bounds_claims import bounds_claims_section
    from ..results import markdown_table

    if not doc.get("long_only"):
        return []
    rows = []
    for u, part in doc["long_only"].items():
        for rule in [r for r in (*RULES, *TRAINED_RULES) if r in part["per_run"]]:
            r = part["per_run"][rule]
            n = len(r["test_sharpe"])
            mean = {k: sum(r[k]) / n for k in METRICS}
            sd = (sum((x - mean["test_sharpe"]) ** 2 for x in r["test_sharpe"]) / (n - 1)) ** 0.5 if n > 1 else None
            sharpe = f"{mean['test_sharpe']:.3f}" + (f" ± {sd:.3f}" if sd is not None else "")
            rows.append([u, rule, sharpe, f"{mean['short_share']:.3f}", f"{max(r['max_violation']):.1e}",
                         f"{max(r['max_sum_residual']):.1e}", f"{mean['moved']:.3f}"])
    n_runs = len(next(iter(doc["long_only"].values()))["per_run"]["ours"]["test_sharpe"])
    lo = doc["config"].get("long_only", {})
    lines = ["", "## Long-only variant: weights in [0, 1] summing to one", "",
             "The `ours` network of each run, decided four ways on the test windows (portfolio/bounds.py): its "
             "untruncated conditional mean (may be short), the clip-then-project baseline (clip to [0, 1], project "
             "onto the sum, repeat), and the mean and the mode of its law *truncated* to the box "
             "(`ConstrainedNormal.truncate(0, 1)`; the mean from "
             f"{lo.get('draws', '?')} draws per window: rejection when its acceptance allows, else "
             f"{lo.get('chains', '?')} blocked-Gibbs chains from the mode, each after {lo.get('burn_in', '?')} "
             "sweeps; exact in their stationary law, every draw feasible). Mean ± std over "
             f"{n_runs} runs; `moved`: mean over windows of sum abs(w - w_ours).", "",
             markdown_table(["universe", "rule", "test Sharpe", "share of short weights", "max bound violation",
                             "max abs(sum(w) - 1)", "moved"], rows)]
    trained = {u: part["trained"] for u, part in doc["long_only"].items() if part.get("trained")}
    if trained:
        tcfg = lo.get("trained", {})
        lines += ["", f"The `{TRAINED}` rows: a second network per run (the same initialisation as `ours`) trained "
                  "through the truncated likelihood, loss `w_pred` MSE + `-log p_trunc(y) / N` with `y` the window's "
                  "ex-post long-only maximum-Sharpe weights, the gradient of `log Z` from persistent Gibbs chains "
                  f"({tcfg.get('chains', '?')} chains x {tcfg.get('sweeps', '?')} sweeps per step, "
                  "`truncate(0, 1, training=chains)`); its epoch selected on the validation Sharpe of its truncated "
                  "mode, and decided with the truncated mean (drawn as above) and mode. `moved` is from its own "
                  "untruncated mean. Training time per run: "
                  + "; ".join(f"{u} {sum(t['seconds']) / len(t['seconds']):.0f} s (selected epochs "
                              f"{', '.join(str(e) for e in t['best_epoch'])})" for u, t in trained.items()) + "."]
    lines += _sampler_lines(doc["long_only"])
    lines += ["", bounds_claims_section("Long-only variant: do the bounds help?", claims(doc), family=family, intro=(
        f"Two-sided paired Wilcoxon signed-rank tests of the test Sharpe over the {n_runs} runs of each "
        "universe (the rules share the run's network).")).rstrip("\n")]
    return lines
