"""The paper's claims and their verdicts: a fixed vocabulary of six, decided on Holm-adjusted p-values.

A study's report ends with a section ``## Claims of the paper``: one row per claim with the paper's evidence,
what this run measured, the raw and the Holm-adjusted p of its paired test, and a verdict computed here from
the results document, never typed in. Every verdict carries its reason. It starts with one of :data:`VERDICTS`:

* **reproduced**: the paired test rejects "no difference" at level ``alpha`` (two-sided) *after Holm's
  adjustment over the study's family*, the difference goes the way the paper says, and no known difference of
  protocol favours the paper's side (:attr:`Claim.favours`);
* **refuted (protocol-matched)**: it goes significantly against the paper *and* the comparison matches the
  paper's protocol on what could decide it (:attr:`Claim.matches_paper`, with the reason in
  :attr:`Claim.matched`); False by default, so it is never produced by accident;
* **differs by design: X**: it goes against the paper and a stated design choice of this study explains it
  (:attr:`Claim.design`: the choice, and the measurement that shows it explains the result);
* **not reproduced at this budget**: it goes against the paper, and a larger budget (epochs, data, model
  size) could plausibly change it; the row says why (:attr:`Claim.differs`);
* **holds by construction**: the property holds by definition (an exact conditioning step has violation 0);
  no test is run. A claim whose two sides are *equal* by construction is **holds by construction (tie)**
  (:attr:`Claim.tie`): it is not evidence for a claim that one side is better, so it is never counted as
  reproduced;
* **undecided**: the adjusted test does not reject (the row says with how many pairs and what would decide
  it); or the measurement cannot decide the claim (*not informative at this budget*, :attr:`Claim.uninformative`;
  *still improving*, :attr:`Claim.improving`: the models were still improving when training stopped); or a
  difference of protocol favours the paper's side of a significant result; or, for ``n <= 5`` pairs, the
  paired t-test and the exact sign-flip test (:attr:`Claim.exact_test`) disagree after adjustment; or the claim
  was not run.

A claim of *no difference* ("about as bad as Random") that the test does not reject is **undecided**: a
non-significant test is not evidence of a tie (that needs an equivalence test with a margin, which the paper
does not give).

**One family per study.** Holm's step-down adjustment (:func:`holm`) runs over *every* tested row of one study:
the paper's claims and this repository's own hypotheses (:attr:`Claim.hypothesis`: the bounded variants'
"bounds help", the diffusion rows the paper does not have), wherever the report prints them
(:func:`decide`'s ``family``). With the ``m`` raw p-values sorted, ``p_(1) <= ... <= p_(m)``, the adjusted
``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``. Rejecting where ``p~ < alpha`` controls the family-wise
error rate at ``alpha`` under any dependence between the tests. Cost: ``O(m log m)``. A claim with a second,
exact test is adjusted twice: once in the family of primary p-values, once in the family where its exact p
replaces its primary one; the verdict needs both to agree.

**A family that cannot reject.** A rank test over ``n`` pairs cannot give a two-sided p below ``2 / 2^n``
(every difference one way: :func:`smallest_wilcoxon_p`), and Holm's first step multiplies the smallest raw p
by ``m``, every later adjusted p being at least that. So no row of a family can be significant when
``m * 2 / 2^n >= alpha`` (:func:`holm_floor`), whatever the data: 39 rows over 10 seeds reach 0.076 at best.
The report then says so above its tables, and every undecided row gives that as its reason, with the number of
pairs per row that would let the family decide, instead of a budget.

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

__all__ = ["ALPHA", "VERDICTS", "REPRODUCED", "NOT_AT_BUDGET", "REFUTED", "BY_DESIGN", "BY_CONSTRUCTION", "TIE",
           "UNDECIDED", "NOT_INFORMATIVE", "STILL_IMPROVING", "Claim", "Decision", "holm", "decide",
           "smallest_wilcoxon_p", "holm_floor", "format_p", "claims_section", "family_size", "family_sentence", "VOCABULARY"]

#: the level of every claim's test (applied to the Holm-adjusted p)
ALPHA = 0.05

REPRODUCED = "reproduced"
REFUTED = "refuted (protocol-matched)"
BY_DESIGN = "differs by design"
NOT_AT_BUDGET = "not reproduced at this budget"
BY_CONSTRUCTION = "holds by construction"
UNDECIDED = "undecided"
#: the six verdicts, the only words a claim row's verdict may start with
VERDICTS = (REPRODUCED, REFUTED, BY_DESIGN, NOT_AT_BUDGET, BY_CONSTRUCTION, UNDECIDED)
#: the verdict of a claim whose two sides are equal by construction (a form of "holds by construction")
TIE = f"{BY_CONSTRUCTION} (tie)"
#: the reason an undecided row gives when its measurement cannot decide the claim at this budget
NOT_INFORMATIVE = "not informative at this budget"
#: the reason an undecided row gives when the models were still improving when training stopped
STILL_IMPROVING = "still improving"
#: how a report's prose names the vocabulary (docs/claims.md defines each)
VOCABULARY = ("reproduced, refuted (protocol-matched), differs by design, not reproduced at this budget, holds by "
              "construction (or, for two sides equal by definition, holds by construction (tie)), undecided")


def smallest_wilcoxon_p(n: int) -> float:
    """The smallest two-sided p-value a Wilcoxon signed-rank test over ``n`` untied pairs can give:
    ``2 / 2^n`` (every difference one way)."""
    return 2.0 / 2 ** n


def smallest_attainable_p(test: Mapping[str, Any]) -> float:
    """The smallest two-sided p ``test`` could give over its pairs: ``2 / 2^n`` for the Wilcoxon signed-rank
    test (its normal approximation, used with ties, never goes lower) and the exact sign-flip test; 0 for a
    t-test, which has no floor."""
    if _test_name(test) in ("Wilcoxon", "exact sign-flip"):
        return smallest_wilcoxon_p(int(test["n"]))
    return 0.0


def holm_floor(claims: Sequence["Claim"]) -> float:
    """The smallest Holm-adjusted p any tested row of the family ``claims`` can reach, whatever the data:
    ``m`` times the smallest p any of its tests could give (NaN for a family without a test). At or above
    ``alpha``, no row of the family can be significant."""
    tested = [c for c in claims if c.test is not None and not math.isnan(c.p)]
    if not tested:
        return math.nan
    return min(1.0, len(tested) * min(smallest_attainable_p(c.test) for c in tested if c.test is not None))


def pairs_to_decide(m: int, alpha: float = ALPHA) -> int:
    """The fewest pairs per row with which a family of ``m`` rank tests can reach a Holm p below ``alpha``."""
    return next(n for n in range(1, 128) if m * smallest_wilcoxon_p(n) < alpha)


def _cannot_reject(claims: Sequence["Claim"], alpha: float) -> str:
    """Why no row of the family ``claims`` can be significant ("" when one can)."""
    floor = holm_floor(claims)
    if math.isnan(floor) or floor < alpha:
        return ""
    m = family_size(claims)
    return (f"no row of this study's family of {m} can reach a Holm p below {alpha}: the smallest it can reach is "
            f"{format_p(floor)}; {pairs_to_decide(m, alpha)} pairs per row would let it decide")


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
    """One claim of the paper (or one hypothesis of this repository), with what decides it.

    Attributes:
        claim: the claim in a few words ("ours beats KKT-hPINN on CSTR"); where the paper states it, its own
            words.
        paper: the paper's evidence (its numbers, its table).
        here: what this run measured (means, with the unit).
        test: the paired test of ``a - b`` (``n``, ``p``, ``mean_diff`` or ``median_diff``; optional ``name``),
            or None for a claim no test decides.
        lower_is_better: the metric's direction (a loss: True; a Sharpe ratio or a likelihood: False).
        no_difference: a claim of *no* difference ("about as bad as Random").
        reading: the reading of the paper this row tests, where the paper is ambiguous ("" when it is not).
        matches_paper: True only when the comparison matches the paper's protocol on what could decide it;
            only then can the verdict be *refuted (protocol-matched)*; ``matched`` says why.
        matched: why the protocol matches on what matters (required with ``matches_paper``).
        design: a design choice of this study that explains a result against the paper, with the measurement
            that shows it; the verdict is then *differs by design: ...*.
        differs: why a larger budget could plausibly change a result against the paper (the verdict is then *not
            reproduced at this budget (...)*).
        favours: a difference of protocol that favours the paper's side; a significant result the paper's way
            is then *undecided*, because the difference alone could produce it.
        uninformative: why the measurement cannot decide the claim at this budget; the verdict is then
            *undecided (not informative at this budget: ...)* whatever the p-value.
        improving: the counts that show the models were still improving when training stopped; the verdict is
            then *undecided: still improving (...)* whatever the p-value.
        construction: why the claim holds by construction; the verdict is *holds by construction* and no test
            or p-value is shown (``test`` must be None).
        tie: with ``construction``: the two sides are *equal* by construction (*holds by construction (tie)*),
            which says nothing about which is better.
        outcome: for a claim without a test that a measurement still decides: ``"for"`` (the measurement
            agrees with the paper), ``"against"`` (it does not) or ``""`` (nothing measured: *undecided*).
        budget: what would decide an undecided claim (default: more seeds).
        exact_test: a second, distribution-free test of the same pairs (the exact sign-flip test beside a paired
            t-test over ``n <= 5`` trials); where the two disagree after adjustment the verdict is undecided.
        hypothesis: a hypothesis of this repository, not a claim of the paper (it is in the study's Holm family
            all the same, and its row says so).
    """

    claim: str
    paper: str
    here: str
    test: Mapping[str, Any] | None = None
    lower_is_better: bool = True
    no_difference: bool = False
    reading: str = ""
    matches_paper: bool = False
    matched: str = ""
    design: str = ""
    differs: str = ""
    favours: str = ""
    uninformative: str = ""
    improving: str = ""
    construction: str = ""
    tie: bool = False
    outcome: str = ""
    budget: str = ""
    exact_test: Mapping[str, Any] | None = None
    hypothesis: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name in ("matches_paper", "tie", "hypothesis"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")
        if self.construction and (self.test is not None or self.exact_test is not None):
            raise ValueError(f"claim {self.claim!r}: a claim that holds by construction carries no test, "
                             f"got test {dict(self.test or self.exact_test or {})}")
        if self.tie and not self.construction:
            raise ValueError(f"claim {self.claim!r}: tie=True needs construction=... (why the sides are equal)")
        if self.exact_test is not None and self.test is None:
            raise ValueError(f"claim {self.claim!r}: exact_test is a second test beside test, which is None")
        if self.outcome not in ("", "for", "against"):
            raise ValueError(f"outcome: expected '', 'for' or 'against', got {self.outcome!r}")
        if self.matches_paper and not self.matched:
            raise ValueError(f"claim {self.claim!r}: matches_paper=True must say on what the protocol matches "
                             "(matched=...)")
        if (self.test is not None or self.outcome == "against") and not self.matches_paper and not (
                self.differs or self.design or self.uninformative or self.improving):
            raise ValueError(f"claim {self.claim!r}: a decided claim whose protocol is not the paper's must say "
                             "how it differs (differs=... for a budget, design=... for a design choice), or be "
                             "marked uninformative=... or improving=...")

    @property
    def p(self) -> float:
        """The raw p-value of the claim's test (NaN when it has none)."""
        if self.test is None:
            return math.nan
        return float(self.test["p"])

    @property
    def p_exact(self) -> float:
        """The raw p of the exact test where there is one, else :attr:`p` (its stand-in in the second family)."""
        return float(self.exact_test["p"]) if self.exact_test is not None else self.p


@dataclass(frozen=True)
class Decision:
    """A claim with its raw and Holm-adjusted p (and its exact test's, where it has one) and its verdict (which
    starts with one of :data:`VERDICTS`)."""

    claim: Claim
    p_raw: float
    p_holm: float
    verdict: str
    p_exact_holm: float = math.nan

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


def _against(claim: Claim, where: str) -> str:
    """The verdict of a result against the paper (``where``: the test and how it went, or "")."""
    sep = f"{where}; " if where else ""
    if claim.matches_paper:
        return f"{REFUTED}: {sep}{claim.matched}"
    if claim.design:
        return f"{BY_DESIGN}: {claim.design}" + (f" ({where})" if where else "")
    return f"{NOT_AT_BUDGET} ({sep}{claim.differs})"


def _verdict(claim: Claim, p_adj: float, alpha: float, p_exact_adj: float = math.nan, blocked: str = "") -> str:
    if claim.construction:
        return f"{TIE}: {claim.construction}" if claim.tie else f"{BY_CONSTRUCTION} ({claim.construction})"
    if claim.uninformative:
        return f"{UNDECIDED} ({NOT_INFORMATIVE}: {claim.uninformative})"
    if claim.improving:
        return f"{UNDECIDED}: {STILL_IMPROVING} ({claim.improving})"
    test = claim.test
    if test is None:
        if claim.outcome == "for":
            if claim.favours:
                return f"{UNDECIDED} (measured the paper's way, but {claim.favours} could produce it)"
            return REPRODUCED + (f" ({claim.budget})" if claim.budget else "")
        if claim.outcome == "against":
            return _against(claim, "")
        return f"{UNDECIDED} ({claim.budget or 'no test'})"
    n = int(test["n"])
    where = f"{_test_name(test)}, n = {n}"
    if math.isnan(p_adj):
        return f"{UNDECIDED} (fewer than 2 pairs; {claim.budget or 'more seeds'})"
    significant = p_adj < alpha and _direction(test) != 0
    if claim.exact_test is not None and not math.isnan(p_exact_adj):
        exact = p_exact_adj < alpha and _direction(claim.exact_test) != 0
        if exact != significant:
            return (f"{UNDECIDED} ({where}: the {_test_name(test)} test and the {_test_name(claim.exact_test)} test "
                    f"disagree, Holm p {format_p(p_adj)} vs {format_p(p_exact_adj)}"
                    + (f"; with {n} pairs the exact test's smallest p is {2 / 2 ** n:.3g}" if n <= 6 else "")
                    + f"; {_budget(claim, test, alpha)})")
    if claim.no_difference:
        if not significant:
            return f"{UNDECIDED} ({where}; no significant difference, which is not evidence of a tie)"
        side = "lower" if _direction(test) < 0 else "higher"
        return _against(claim, f"{where}; the first is {side}")
    if not significant:
        alone = smallest_attainable_p(test) >= alpha  # the row could not reject even alone: its own pairs say why
        return f"{UNDECIDED} ({where}; {_budget(claim, test, alpha) if alone or not blocked else blocked})"
    if (_direction(test) < 0) == claim.lower_is_better:
        if claim.favours:
            return f"{UNDECIDED} ({where}; significant the paper's way, but {claim.favours} could produce it)"
        return f"{REPRODUCED} ({where})"
    if claim.matches_paper or claim.design:
        return _against(claim, f"{where}; significant the other way")
    return f"{NOT_AT_BUDGET} ({where}; significant the other way, but {claim.differs})"


def family_size(claims: Sequence[Claim]) -> int:
    """The number of tested claims (the ``m`` of Holm's adjustment) among ``claims``."""
    return sum(not math.isnan(c.p) for c in claims)


def decide(claims: Sequence[Claim], alpha: float = ALPHA, family: Sequence[Claim] = ()) -> list[Decision]:
    """Each claim's verdict from its Holm-adjusted p over the study's family: ``claims`` and ``family`` (the
    study's other tested rows, printed elsewhere in its report) together."""
    every = list(claims) + list(family)
    adjusted = holm([c.p for c in every])[: len(claims)]
    exact = holm([c.p_exact for c in every])[: len(claims)]
    blocked = _cannot_reject(every, alpha)
    return [Decision(c, c.p, q, _verdict(c, q, alpha, e if c.exact_test is not None else math.nan, blocked),
                     e if c.exact_test is not None else math.nan)
            for c, q, e in zip(claims, adjusted, exact)]


def _p_cells(d: Decision) -> list[str]:
    if d.claim.exact_test is None:
        return [format_p(d.p_raw), format_p(d.p_holm)]
    name = _test_name(d.claim.exact_test)
    return [f"{format_p(d.p_raw)} ({name} {format_p(d.claim.p_exact)})",
            f"{format_p(d.p_holm)} ({name} {format_p(d.p_exact_holm)})"]


def _label(c: Claim) -> str:
    return (("[this repository] " if c.hypothesis else "") + c.claim
            + (f" (reading: {c.reading})" if c.reading else ""))


def family_sentence(m: int, hypotheses: int, alpha: float = ALPHA, where: str = "",
                    floor: float = math.nan) -> str:
    """How a claims table's p-values are adjusted: over the study's ``m`` tested rows, ``hypotheses`` of them this
    repository's own (``where``: the section that prints them, if not this one); ``floor``: the family's
    :func:`holm_floor`, said when no row can reach ``alpha``."""
    if not m:
        return "No row has a test in this run (too few pairs), so there is no p to adjust; each verdict"
    own = (f" ({hypotheses} of them this repository's own hypotheses{', ' + where if where else ''})"
           if hypotheses else "")
    cannot = (f". With these pairs no row can be significant, whatever the data: the smallest Holm-adjusted p a "
              f"row of {m} rank tests can reach is {format_p(floor)} (docs/claims.md; {pairs_to_decide(m, alpha)} "
              f"pairs per row would let the family decide). Each verdict"
              if not math.isnan(floor) and floor >= alpha else "; the verdict")
    return (f"Each tested row's two-sided paired p is Holm-adjusted over this study's one family of {m} tested "
            f"rows{own}{cannot} reads the adjusted p at level {alpha} and")


def claims_section(claims: Sequence[Claim], note: str = "", alpha: float = ALPHA, intro: str = "",
                   family: Sequence[Claim] = (), family_where: str = "") -> str:
    """``## Claims of the paper``: how verdicts are decided, the table (claim, the paper's evidence, here, raw
    p, Holm-adjusted p, verdict) and an optional note under it. ``family``: the study's other tested rows (its
    hypotheses printed in another section, named by ``family_where``), adjusted together with ``claims``."""
    decisions = decide(claims, alpha, family)
    every = list(claims) + list(family)
    m = family_size(every)
    own = sum(c.hypothesis and not math.isnan(c.p) for c in every)
    rows = [[_label(d.claim), d.claim.paper, d.claim.here, *_p_cells(d), d.verdict] for d in decisions]
    text = ("## Claims of the paper\n\n" + (intro + "\n\n" if intro else "")
            + family_sentence(m, own, alpha, family_where if family else "", holm_floor(every))
            + f" is one of six (docs/claims.md): {VOCABULARY}. Rows marked [this repository] are not the "
            "paper's claims and never count as its reproduction.\n\n"
            + markdown_table(["claim (paper)", "paper's evidence", "here", "p", "p (Holm)", "verdict"], rows))
    return text + (f"\n{note}\n" if note else "")
