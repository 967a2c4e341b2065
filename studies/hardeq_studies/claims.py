"""The paper's claims and their verdicts: a fixed vocabulary of five, decided on Holm-adjusted p-values.

A study's report ends with a section ``## Claims of the paper``: one row per claim with the paper's evidence,
what this run measured, the raw and the Holm-adjusted p of its paired test, and a verdict computed here from
the results document, never typed in. The verdict is one of :data:`VERDICTS`:

* **reproduced**: the paired test rejects "no difference" at level ``alpha`` (two-sided) *after Holm's
  adjustment over the study's family of claims*, the difference goes the way the paper says, and no known
  difference of protocol favours the paper's side (:attr:`Claim.favours`);
* **not reproduced at this budget**: the result goes against the paper (significantly the other way, or a
  measured outcome without a test), but the protocol differs from the paper's in a way that could decide it;
  the row says how (:attr:`Claim.differs`);
* **refuted**: it goes significantly against the paper *and* the comparison matches the paper's protocol in
  every respect that could decide it. Only a claim built with ``matches_paper=True`` can be refuted; the
  default is False, so "refuted" is never produced by accident;
* **holds by construction**: the two sides are equal (or the property holds) by their definition; no run can
  decide it, so no test is run and no p-value is shown;
* **undecided**: the test does not reject after adjustment (the row says with how many pairs and what budget
  would decide it), or the measurement cannot decide the claim at this budget (:attr:`Claim.uninformative`:
  "not informative at this budget"), or a difference of protocol favours the paper's side of a significant
  result, or the claim was not run.

A claim of *no difference* ("about as bad as Random") that the test does not reject is **undecided**: a
non-significant test is not evidence of a tie (that needs an equivalence test with a margin, which the paper
does not give).

**Holm's step-down adjustment** (:func:`holm`) over the ``m`` claims of one study that ran a test: with the raw
p-values sorted, ``p_(1) <= ... <= p_(m)``, the adjusted ``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``.
Rejecting where ``p~ < alpha`` controls the family-wise error rate at ``alpha`` under any dependence between
the tests. Cost: ``O(m log m)``.

``Claim.test`` is the dictionary of :func:`hardeq_studies.stats.paired_wilcoxon`,
:func:`~hardeq_studies.stats.paired_ttest` or a report's own paired test of ``a - b`` (``a`` the paper's
winner, ``b`` the method it should beat), so "the paper's way" is ``a < b`` when lower is better.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .results import markdown_table

__all__ = ["ALPHA", "VERDICTS", "REPRODUCED", "NOT_AT_BUDGET", "REFUTED", "BY_CONSTRUCTION", "UNDECIDED",
           "NOT_INFORMATIVE", "Claim", "Decision", "holm", "decide", "smallest_wilcoxon_p", "format_p",
           "claims_section"]

#: the level of every claim's test (applied to the Holm-adjusted p)
ALPHA = 0.05

REPRODUCED = "reproduced"
NOT_AT_BUDGET = "not reproduced at this budget"
REFUTED = "refuted"
BY_CONSTRUCTION = "holds by construction"
UNDECIDED = "undecided"
#: the five verdicts, the only words a claim row's verdict may start with
VERDICTS = (REPRODUCED, NOT_AT_BUDGET, REFUTED, BY_CONSTRUCTION, UNDECIDED)
#: the reason an undecided row gives when its measurement cannot decide the claim at this budget
NOT_INFORMATIVE = "not informative at this budget"


def smallest_wilcoxon_p(n: int) -> float:
    """The smallest two-sided p-value a Wilcoxon signed-rank test over ``n`` untied pairs can give:
    ``2 / 2^n`` (every difference one way)."""
    return 2.0 / 2 ** n


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order.

    Args:
        pvalues: raw p-values in [0, 1]; NaN entries (no test) stay NaN and do not count in the family size.

    Returns:
        ``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))`` over the ``m`` finite p-values sorted ascending
        (ties keep their input order); each adjusted value is at least its raw one and at most 1, and the
        adjustment keeps the raw values' order.

    Raises:
        ValueError: a p-value outside [0, 1].
    """
    ps = [float(p) for p in pvalues]
    bad = [p for p in ps if not math.isnan(p) and not 0.0 <= p <= 1.0]
    if bad:
        raise ValueError(f"pvalues: expected values in [0, 1] (or NaN for no test), got {bad}")
    finite = sorted((p, i) for i, p in enumerate(ps) if not math.isnan(p))
    m = len(finite)
    out = [math.nan] * len(ps)
    running = 0.0
    for rank, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def format_p(p: float) -> str:
    """A p-value as the claims tables print it (two significant digits; scientific below 1e-3; "-" for none)."""
    if p is None or math.isnan(p):
        return "-"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _direction(test: Mapping[str, Any]) -> float:
    for key in ("mean_diff", "median_diff"):
        if key in test and test[key] is not None and math.isfinite(test[key]):
            return float(test[key])
    raise ValueError(f"test: expected a test result with 'mean_diff' or 'median_diff', got keys {sorted(test)}")


def _test_name(test: Mapping[str, Any]) -> str:
    return str(test.get("name") or ("paired t" if "t" in test else "Wilcoxon"))


@dataclass(frozen=True)
class Claim:
    """One claim of the paper, with what decides it.

    Attributes:
        claim: the paper's claim in a few words ("ours beats KKT-hPINN on CSTR").
        paper: the paper's evidence (its numbers, its table).
        here: what this run measured (means, with the unit).
        test: the paired test of ``a - b`` (``n``, ``p``, ``mean_diff`` or ``median_diff``; optional ``name``),
            or None for a claim no test decides.
        lower_is_better: the metric's direction (a loss: True; a Sharpe ratio or a likelihood: False).
        no_difference: a claim of *no* difference ("about as bad as Random").
        reading: the reading of the paper this row tests, where the paper is ambiguous ("" when it is not).
        matches_paper: True only when the comparison matches the paper's protocol in every respect that could
            decide it; only then can the verdict be *refuted*.
        differs: how the protocol differs from the paper's in a way that could decide the claim, and which way
            it could move it (required for a tested claim that does not match the paper's protocol).
        favours: a difference of protocol that favours the paper's side; a significant result the paper's way
            is then *undecided*, because the difference alone could produce it.
        uninformative: why the measurement cannot decide the claim at this budget; the verdict is then
            *undecided (not informative at this budget: ...)* whatever the p-value.
        construction: why the claim holds by construction; the verdict is *holds by construction* and no test
            or p-value is shown (``test`` must be None).
        outcome: for a claim without a test that a measurement still decides: ``"for"`` (the measurement
            agrees with the paper), ``"against"`` (it does not) or ``""`` (nothing measured: *undecided*).
        budget: what would decide an undecided claim (default: more seeds).
    """

    claim: str
    paper: str
    here: str
    test: Mapping[str, Any] | None = None
    lower_is_better: bool = True
    no_difference: bool = False
    reading: str = ""
    matches_paper: bool = False
    differs: str = ""
    favours: str = ""
    uninformative: str = ""
    construction: str = ""
    outcome: str = ""
    budget: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.matches_paper, bool):
            raise TypeError(f"matches_paper: expected a bool, got {type(self.matches_paper).__name__}")
        if self.construction and self.test is not None:
            raise ValueError(f"claim {self.claim!r}: a claim that holds by construction carries no test, "
                             f"got test {dict(self.test)}")
        if self.outcome not in ("", "for", "against"):
            raise ValueError(f"outcome: expected '', 'for' or 'against', got {self.outcome!r}")
        if (self.test is not None or self.outcome == "against") and not self.matches_paper \
                and not self.differs and not self.uninformative:
            raise ValueError(f"claim {self.claim!r}: a decided claim whose protocol is not the paper's must say "
                             "how it differs (differs=...), or be marked uninformative=...")

    @property
    def p(self) -> float:
        """The raw p-value of the claim's test (NaN when it has none)."""
        if self.test is None:
            return math.nan
        p = float(self.test["p"])
        return p


@dataclass(frozen=True)
class Decision:
    """A claim with its raw and Holm-adjusted p and its verdict (which starts with one of :data:`VERDICTS`)."""

    claim: Claim
    p_raw: float
    p_holm: float
    verdict: str

    @property
    def word(self) -> str:
        """The verdict's word, one of :data:`VERDICTS`."""
        return next(v for v in VERDICTS if self.verdict.startswith(v))


def _budget(claim: Claim, test: Mapping[str, Any], alpha: float) -> str:
    n = int(test["n"])
    if claim.budget:
        return claim.budget
    if _test_name(test) == "Wilcoxon" and smallest_wilcoxon_p(n) >= alpha:
        return f"at least {next(k for k in range(n, 64) if smallest_wilcoxon_p(k) < alpha)} pairs"
    return "more seeds"


def _verdict(claim: Claim, p_adj: float, alpha: float) -> str:
    if claim.construction:
        return f"{BY_CONSTRUCTION} ({claim.construction})"
    if claim.uninformative:
        return f"{UNDECIDED} ({NOT_INFORMATIVE}: {claim.uninformative})"
    test = claim.test
    if test is None:
        if claim.outcome == "for":
            if claim.favours:
                return f"{UNDECIDED} (measured the paper's way, but {claim.favours} could produce it)"
            return REPRODUCED + (f" ({claim.budget})" if claim.budget else "")
        if claim.outcome == "against":
            if claim.matches_paper:
                return REFUTED
            return f"{NOT_AT_BUDGET} ({claim.differs})"
        return f"{UNDECIDED} ({claim.budget or 'no test'})"
    n = int(test["n"])
    where = f"{_test_name(test)}, n = {n}"
    if math.isnan(p_adj):
        return f"{UNDECIDED} (fewer than 2 pairs; {claim.budget or 'more seeds'})"
    significant = p_adj < alpha and _direction(test) != 0
    if claim.no_difference:
        if not significant:
            return f"{UNDECIDED} ({where}; no significant difference, which is not evidence of a tie)"
        side = "lower" if _direction(test) < 0 else "higher"
        if claim.matches_paper:
            return f"{REFUTED} ({where}; the first is {side})"
        return f"{NOT_AT_BUDGET} ({where}; the first is {side}; {claim.differs})"
    if not significant:
        return f"{UNDECIDED} ({where}; {_budget(claim, test, alpha)})"
    if (_direction(test) < 0) == claim.lower_is_better:
        if claim.favours:
            return f"{UNDECIDED} ({where}; significant the paper's way, but {claim.favours} could produce it)"
        return f"{REPRODUCED} ({where})"
    if claim.matches_paper:
        return f"{REFUTED} ({where})"
    return f"{NOT_AT_BUDGET} ({where}; significant the other way, but {claim.differs})"


def decide(claims: Sequence[Claim], alpha: float = ALPHA) -> list[Decision]:
    """Each claim's verdict from its Holm-adjusted p over the family ``claims`` (the claims with a test)."""
    adjusted = holm([c.p for c in claims])
    return [Decision(c, c.p, q, _verdict(c, q, alpha)) for c, q in zip(claims, adjusted)]


def claims_section(claims: Sequence[Claim], note: str = "", alpha: float = ALPHA, intro: str = "") -> str:
    """``## Claims of the paper``: how verdicts are decided, the table (claim, the paper's evidence, here, raw
    p, Holm-adjusted p, verdict) and an optional note under it."""
    decisions = decide(claims, alpha)
    m = sum(not math.isnan(d.p_raw) for d in decisions)
    rows = [[d.claim.claim + (f" (reading: {d.claim.reading})" if d.claim.reading else ""), d.claim.paper,
             d.claim.here, format_p(d.p_raw), format_p(d.p_holm), d.verdict] for d in decisions]
    text = ("## Claims of the paper\n\n" + (intro + "\n\n" if intro else "")
            + (f"Each tested claim's two-sided paired p is Holm-adjusted over this study's {m} tested claims; the "
               f"verdict reads the adjusted p at level {alpha} and" if m else
               "No claim has a test in this run (too few pairs), so there is no p to adjust; each verdict")
            + " is one of five (docs/claims.md): reproduced, not reproduced at this budget, refuted, holds by "
            "construction, undecided.\n\n"
            + markdown_table(["claim (paper)", "paper's evidence", "here", "p", "p (Holm)", "verdict"], rows))
    return text + (f"\n{note}\n" if note else "")
