"""The paper's claims, each decided by a paired test over seeds: reproduced, refuted or undecided.

A study's report ends with a section ``## Claims of the paper``: one row per claim with the paper's evidence,
what this run measured and a verdict computed here from the results document, never typed in:

* **reproduced**: the paired test rejects "no difference" at level ``alpha`` (two-sided) and the difference
  goes the way the paper says;
* **refuted**: it rejects, and the difference goes the other way (the paper's claim is contradicted);
* **undecided**: it does not reject; the row says with how many pairs, and what budget would decide it
  (:func:`undecided`, with the smallest p a Wilcoxon test over ``n`` pairs can reach);
* **by construction**: the two sides are equal by their definition, so no run can decide the claim;
* **consistent**: for a claim of *no difference* ("about as bad as Random"), the test does not reject
  (:func:`verdict_no_difference`); a significant difference either way refutes it.

``paired`` is the dictionary of :func:`hardeq_studies.stats.paired_wilcoxon` or :func:`~hardeq_studies.stats.
paired_ttest` of ``a - b`` (``a`` the paper's winner, ``b`` the method it should beat), so "the paper's way" is
``a < b`` when lower is better.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .results import markdown_table

__all__ = ["ALPHA", "Claim", "verdict", "verdict_no_difference", "smallest_wilcoxon_p", "claims_section"]

#: the level of every claim's test
ALPHA = 0.05


def smallest_wilcoxon_p(n: int) -> float:
    """The smallest two-sided p-value a Wilcoxon signed-rank test over ``n`` untied pairs can give:
    ``2 / 2^n`` (every difference one way)."""
    return 2.0 / 2 ** n


def _direction(paired: Mapping[str, Any]) -> float:
    for key in ("mean_diff", "median_diff"):
        if key in paired and paired[key] is not None and math.isfinite(paired[key]):
            return float(paired[key])
    raise ValueError(f"paired: expected a test result with 'mean_diff' or 'median_diff', got keys {sorted(paired)}")


def _test_name(paired: Mapping[str, Any]) -> str:
    return "paired t" if "t" in paired else "Wilcoxon"


def _p(paired: Mapping[str, Any]) -> str:
    p = float(paired["p"])
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def verdict(paired: Mapping[str, Any], *, lower_is_better: bool = True, alpha: float = ALPHA,
            budget: str | None = None) -> str:
    """The verdict on "``a`` beats ``b``" from the paired test of ``a - b``.

    Args:
        paired: the test's dictionary (``n``, ``p`` and ``mean_diff`` or ``median_diff``).
        lower_is_better: the metric's direction (a loss: True; a Sharpe ratio or a likelihood: False).
        alpha: the two-sided level.
        budget: for an undecided claim, what would decide it (default: "more seeds").

    Returns:
        ``"reproduced (TEST, n = N, p = P)"``, ``"refuted (...)"`` or ``"undecided (..., p = P; BUDGET)"``.
    """
    n, p = int(paired["n"]), float(paired["p"])
    where = f"{_test_name(paired)}, n = {n}, p = {_p(paired)}"
    if math.isnan(p):
        return f"undecided (fewer than 2 pairs; {budget or 'more seeds'})"
    if p >= alpha or _direction(paired) == 0:
        if _test_name(paired) == "Wilcoxon" and smallest_wilcoxon_p(n) >= alpha:
            budget = budget or f"at least {next(k for k in range(n, 64) if smallest_wilcoxon_p(k) < alpha)} pairs"
        return f"undecided ({where}; {budget or 'more seeds'})"
    paper_way = (_direction(paired) < 0) == lower_is_better
    return f"{'reproduced' if paper_way else 'refuted'} ({where})"


def verdict_no_difference(paired: Mapping[str, Any], *, alpha: float = ALPHA) -> str:
    """The verdict on "``a`` and ``b`` are about the same": ``"consistent (no significant difference; ...)"``
    when the paired test does not reject at ``alpha``, else ``"refuted (... a lower / higher)"``."""
    n, p = int(paired["n"]), float(paired["p"])
    where = f"{_test_name(paired)}, n = {n}, p = {_p(paired)}"
    if math.isnan(p):
        return "undecided (fewer than 2 pairs)"
    if p >= alpha or _direction(paired) == 0:
        return f"consistent (no significant difference; {where})"
    return f"refuted ({where}; the first is {'lower' if _direction(paired) < 0 else 'higher'})"


@dataclass(frozen=True)
class Claim:
    """One row of the claims table.

    Attributes:
        claim: the paper's claim in a few words ("ours beats KKT-hPINN on CSTR").
        paper: the paper's evidence (its numbers, its table).
        here: what this run measured (means, with the unit).
        verdict: from :func:`verdict`, or a sentence for a claim that no test decides (e.g. "by construction:
            equal when ...").
    """

    claim: str
    paper: str
    here: str
    verdict: str


def claims_section(claims: Sequence[Claim], note: str = "") -> str:
    """``## Claims of the paper``: the table (and an optional note under it)."""
    rows = [[c.claim, c.paper, c.here, c.verdict] for c in claims]
    text = ("## Claims of the paper\n\nEach claim is decided by a two-sided paired test over seeds at level "
            f"{ALPHA}: reproduced (significant, the paper's way), refuted (significant, the other way) or "
            "undecided (not significant; with what would decide it).\n\n"
            + markdown_table(["claim (paper)", "paper's evidence", "here", "verdict"], rows))
    return text + (f"\n{note}\n" if note else "")
