"""Verdicts on the paper's claims (hardeq_studies.claims): the five-word vocabulary, Holm's adjustment against
an independent reference, and which protocol facts allow which verdict."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hardeq_studies.claims import (
    BY_CONSTRUCTION, NOT_AT_BUDGET, REFUTED, REPRODUCED, UNDECIDED, VERDICTS, Claim, claims_section, decide, holm,
    smallest_wilcoxon_p,
)
from hardeq_studies.stats import paired_ttest, paired_wilcoxon

LOWER = paired_wilcoxon([1.0 + 0.01 * i for i in range(10)], [2.0 + 0.02 * i for i in range(10)])  # p = 0.002
MIXED = paired_wilcoxon([1.0, 3.0, 1.0, 3.0, 2.0, 2.5], [2.0, 2.0, 2.0, 2.0, 2.1, 2.4])


def _holm_reference(p):
    """Holm by its definition, independently of :func:`holm`: reject H_(i) while p_(i) <= alpha / (m - i + 1);
    the adjusted p of a hypothesis is the smallest alpha at which the step-down procedure rejects it."""
    p = np.asarray(p, dtype=np.float64)
    m = p.size
    out = np.empty(m)
    for i in range(m):
        # smallest alpha rejecting i: every hypothesis at least as small (in sorted order) must be rejected
        order = np.argsort(p, kind="stable")
        rank = int(np.where(order == i)[0][0])
        out[i] = min(1.0, max((m - j) * p[order[j]] for j in range(rank + 1)))
    return out


def test_smallest_wilcoxon_p_is_two_over_two_to_the_n():
    assert smallest_wilcoxon_p(3) == 0.25
    for n in (5, 6, 10):
        a, b = [float(i) for i in range(n)], [float(i) + 1 + 0.01 * i for i in range(n)]
        assert paired_wilcoxon(a, b)["p"] == pytest.approx(smallest_wilcoxon_p(n))


def test_holm_against_a_hand_computed_case_and_the_definition():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4*0.005 = 0.02, 3*0.01 = 0.03, 2*0.03 = 0.06, max(0.06, 1*0.04) = 0.06
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # the audit's case: p = 0.015 and 0.030 in a family of 30 do not survive
    fam = [0.015, 0.030] + [0.5] * 28
    assert all(q > 0.05 for q in holm(fam)[:2])
    rng = np.random.default_rng(0)
    for m in (1, 2, 7, 30):
        raw = rng.uniform(0, 0.2, m) ** 2
        assert holm(raw) == pytest.approx(_holm_reference(raw), rel=1e-12)


def test_holm_properties_monotone_at_least_raw_capped_and_nan_skipped():
    rng = np.random.default_rng(1)
    for _ in range(50):
        raw = list(rng.uniform(0, 1, rng.integers(1, 20)) ** 3)
        adj = holm(raw)
        assert all(q >= p and q <= 1.0 for p, q in zip(raw, adj))
        for (p1, q1), (p2, q2) in itertools.combinations(zip(raw, adj), 2):
            if p1 < p2:
                assert q1 <= q2
    adj = holm([0.01, math.nan, 0.02])  # the NaN is no test: a family of 2
    assert adj[0] == pytest.approx(0.02) and math.isnan(adj[1]) and adj[2] == pytest.approx(0.02)
    assert holm([]) == []
    with pytest.raises(ValueError, match=r"pvalues: expected values in \[0, 1\].*1.5"):
        holm([0.1, 1.5])


def _one(claim: Claim) -> str:
    return decide([claim])[0].verdict


def test_verdicts_follow_the_sign_the_level_and_the_protocol():
    c = dict(claim="c", paper="p", here="h")
    assert _one(Claim(**c, test=LOWER, differs="x")) == "reproduced (Wilcoxon, n = 10)"
    # the other way: refuted only when the protocol matches the paper's
    assert _one(Claim(**c, test=LOWER, lower_is_better=False, differs="batch 32 vs 128")) == \
        "not reproduced at this budget (Wilcoxon, n = 10; significant the other way, but batch 32 vs 128)"
    assert _one(Claim(**c, test=LOWER, lower_is_better=False, matches_paper=True)) == "refuted (Wilcoxon, n = 10)"
    # a difference of protocol that favours the paper's side makes a paper-way result undecided
    assert _one(Claim(**c, test=LOWER, favours="3.8x the data", differs="x")).startswith(
        "undecided (Wilcoxon, n = 10; significant the paper's way, but 3.8x the data could produce it)")
    assert _one(Claim(**c, test=MIXED, differs="x")).startswith("undecided (Wilcoxon, n = 6; ")
    three = paired_wilcoxon([1.0, 1.1, 1.2], [2.0, 2.1, 2.3])
    assert _one(Claim(**c, test=three, differs="x")) == "undecided (Wilcoxon, n = 3; at least 6 pairs)"
    t = paired_ttest([1.0, 1.1, 1.2, 0.9, 1.05], [2.0, 2.2, 2.1, 2.05, 1.9])
    assert _one(Claim(**c, test=t, differs="x")) == "reproduced (paired t, n = 5)"
    assert _one(Claim(**c, test=paired_ttest([1.0], [2.0]), differs="x")).startswith("undecided (fewer than 2")
    assert _one(Claim(**c, test=paired_ttest([1.0, 2.0], [1.0, 2.0]), differs="x")).startswith("undecided")
    with pytest.raises(ValueError, match="test: expected .*mean_diff"):
        _one(Claim(**c, test={"n": 5, "p": 0.01}, differs="x"))


def test_uninformative_construction_and_untested_claims():
    c = dict(claim="c", paper="p", here="h")
    assert _one(Claim(**c, test=LOWER, uninformative="FID of 200 images")) == \
        "undecided (not informative at this budget: FID of 200 images)"
    assert _one(Claim(**c, construction="exact conditioning")) == "holds by construction (exact conditioning)"
    assert _one(Claim(**c, outcome="against", differs="10 of 1000 epochs")) == \
        "not reproduced at this budget (10 of 1000 epochs)"
    assert _one(Claim(**c, outcome="against", matches_paper=True)) == "refuted"
    assert _one(Claim(**c, outcome="for")) == "reproduced"
    assert _one(Claim(**c, budget="`--models ladder` would decide it")) == \
        "undecided (`--models ladder` would decide it)"
    with pytest.raises(ValueError, match="by construction carries no test"):
        Claim(**c, test=LOWER, construction="x")
    with pytest.raises(ValueError, match="must say how it differs"):
        Claim(**c, test=LOWER)
    with pytest.raises(TypeError, match="matches_paper: expected a bool"):
        Claim(**c, test=LOWER, matches_paper="yes")
    with pytest.raises(ValueError, match="outcome: expected"):
        Claim(**c, outcome="maybe")


def test_no_difference_claims_are_undecided_unless_the_test_rejects():
    c = dict(claim="c", paper="p", here="h", no_difference=True)
    assert _one(Claim(**c, test=MIXED, differs="x")).startswith(
        "undecided (Wilcoxon, n = 6; no significant difference, which is not evidence of a tie)")
    worse = paired_wilcoxon([2.0 + 0.01 * i for i in range(10)], [1.0] * 10)
    assert _one(Claim(**c, test=worse, matches_paper=True)) == "refuted (Wilcoxon, n = 10; the first is higher)"
    assert _one(Claim(**c, test=worse, differs="20 sets")).startswith(
        "not reproduced at this budget (Wilcoxon, n = 10; the first is higher; 20 sets")


def test_holm_decides_the_verdict_not_the_raw_p():
    weak = {"n": 20, "p": 0.015, "median_diff": -1.0}
    family = [Claim("a", "p", "h", test=weak, differs="x")] + \
        [Claim(f"b{i}", "p", "h", test={"n": 20, "p": 0.6, "median_diff": 1.0}, differs="x") for i in range(29)]
    d = decide(family)
    assert d[0].p_raw == 0.015 and d[0].p_holm == pytest.approx(0.45)
    assert d[0].verdict.startswith(UNDECIDED) and decide(family[:1])[0].verdict.startswith(REPRODUCED)


def test_claims_section_shows_raw_and_adjusted_p_and_only_the_five_verdicts():
    rows = [Claim("ours beats KKT", "Table 1", "1.0 vs 2.0", test=LOWER, differs="x", reading="shared noise"),
            Claim("exact", "0", "0", construction="exact conditioning")]
    text = claims_section(rows, note="A note.")
    assert text.startswith("## Claims of the paper\n") and text.endswith("A note.\n")
    assert "| ours beats KKT (reading: shared noise) | Table 1 | 1.0 vs 2.0 | 0.002 | 0.002 | reproduced (" in text
    assert "| exact | 0 | 0 | - | - | holds by construction (exact conditioning) |" in text
    assert "over this study's 1 tested claims" in text
    untested = claims_section(rows[1:])  # a quick run with one trial: nothing to adjust, and it says so
    assert "No claim has a test in this run" in untested and "tested claims" not in untested
    for d in decide(rows):
        assert d.word in VERDICTS
    assert {REPRODUCED, NOT_AT_BUDGET, REFUTED, BY_CONSTRUCTION, UNDECIDED} == set(VERDICTS)
