"""Verdicts on the paper's claims (hardeq_studies.claims): the six-verdict vocabulary, Holm's adjustment against
an independent reference, and which protocol facts allow which verdict."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hardeq_studies.claims import (
    BY_CONSTRUCTION, BY_DESIGN, NOT_AT_BUDGET, REFUTED, REPRODUCED, TIE, UNDECIDED, VERDICTS, Claim, claims_section,
    decide, holm, holm_floor, smallest_wilcoxon_p,
)
from hardeq_studies.stats import paired_ttest, paired_wilcoxon, sign_flip_test

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
    assert _one(Claim(**c, test=LOWER, lower_is_better=False, matches_paper=True, matched="same data")) == \
        "refuted (protocol-matched): Wilcoxon, n = 10; significant the other way; same data"
    # a design choice of this study that explains it
    assert _one(Claim(**c, test=LOWER, lower_is_better=False, design="the variance head")) == \
        "differs by design: the variance head (Wilcoxon, n = 10; significant the other way)"
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
    assert _one(Claim(**c, outcome="against", matches_paper=True, matched="same data")) == \
        "refuted (protocol-matched): same data"
    assert _one(Claim(**c, outcome="against", design="beta_t noise")) == "differs by design: beta_t noise"
    assert _one(Claim(**c, construction="same gradient", tie=True)) == "holds by construction (tie): same gradient"
    assert _one(Claim(**c, test=LOWER, improving="52 of 100 at the last step")) == \
        "undecided: still improving (52 of 100 at the last step)"
    assert _one(Claim(**c, outcome="for")) == "reproduced"
    assert _one(Claim(**c, budget="`--models ladder` would decide it")) == \
        "undecided (`--models ladder` would decide it)"
    with pytest.raises(ValueError, match="by construction carries no test"):
        Claim(**c, test=LOWER, construction="x")
    with pytest.raises(ValueError, match="must say how it differs"):
        Claim(**c, test=LOWER)
    with pytest.raises(TypeError, match="matches_paper: expected a bool"):
        Claim(**c, test=LOWER, matches_paper="yes")
    with pytest.raises(ValueError, match="must say on what the protocol matches"):
        Claim(**c, test=LOWER, matches_paper=True)
    with pytest.raises(ValueError, match="tie=True needs construction"):
        Claim(**c, tie=True)
    with pytest.raises(ValueError, match="exact_test is a second test"):
        Claim(**c, exact_test=LOWER, differs="x")
    with pytest.raises(ValueError, match="outcome: expected"):
        Claim(**c, outcome="maybe")


def test_no_difference_claims_are_undecided_unless_the_test_rejects():
    c = dict(claim="c", paper="p", here="h", no_difference=True)
    assert _one(Claim(**c, test=MIXED, differs="x")).startswith(
        "undecided (Wilcoxon, n = 6; no significant difference, which is not evidence of a tie)")
    worse = paired_wilcoxon([2.0 + 0.01 * i for i in range(10)], [1.0] * 10)
    assert _one(Claim(**c, test=worse, matches_paper=True, matched="m")) == \
        "refuted (protocol-matched): Wilcoxon, n = 10; the first is higher; m"
    assert _one(Claim(**c, test=worse, differs="20 sets")).startswith(
        "not reproduced at this budget (Wilcoxon, n = 10; the first is higher; 20 sets")


def test_holm_decides_the_verdict_not_the_raw_p():
    weak = {"n": 20, "p": 0.015, "median_diff": -1.0}
    family = [Claim("a", "p", "h", test=weak, differs="x")] + \
        [Claim(f"b{i}", "p", "h", test={"n": 20, "p": 0.6, "median_diff": 1.0}, differs="x") for i in range(29)]
    d = decide(family)
    assert d[0].p_raw == 0.015 and d[0].p_holm == pytest.approx(0.45)
    assert d[0].verdict.startswith(UNDECIDED) and decide(family[:1])[0].verdict.startswith(REPRODUCED)


def test_holm_runs_over_the_whole_family_including_rows_printed_elsewhere():
    """One family per study: a hypothesis printed in another section counts in m, so p = 0.0039 in a family of 24
    (as chemical "plant: ours beats CL") is Holm 0.051, not 0.029 as in the paper's 15 alone."""
    paper = [Claim(f"c{i}", "p", "h", test={"n": 10, "p": 0.002, "median_diff": -1.0}, differs="x")
             for i in range(11)]
    paper.append(Claim("plant", "p", "h", test={"n": 10, "p": 0.0039, "median_diff": -1.0}, differs="x"))
    paper += [Claim(f"d{i}", "p", "h", test={"n": 10, "p": 0.3, "median_diff": -1.0}, differs="x")
              for i in range(3)]
    own = [Claim(f"own{i}", "p", "h", test={"n": 10, "p": 0.9, "median_diff": -1.0}, differs="x", hypothesis=True)
           for i in range(9)]
    alone = {d.claim.claim: d for d in decide(paper)}
    joint = {d.claim.claim: d for d in decide(paper, family=own)}
    assert alone["plant"].p_holm == pytest.approx(holm([c.p for c in paper])[11])
    assert joint["plant"].p_holm == pytest.approx(holm([c.p for c in paper + own])[11])
    assert alone["plant"].verdict.startswith(REPRODUCED) and joint["plant"].verdict.startswith(UNDECIDED)
    text = claims_section(paper, family=own, family_where="in section X")
    assert "one family of 24 tested rows (9 of them this repository's own hypotheses, in section X)" in text


def test_an_exact_test_that_disagrees_with_the_t_test_leaves_the_claim_undecided():
    a = [1.0, 1.1, 1.2, 0.9, 1.05]
    b = [2.0, 2.2, 2.1, 2.05, 1.9]
    t, flip = paired_ttest(a, b), sign_flip_test(a, b)
    assert flip["p"] == pytest.approx(2 / 32)  # every difference one way: the smallest p of 5 pairs
    d = decide([Claim("c", "p", "h", test=t, exact_test=flip, differs="x")])[0]
    assert d.verdict.startswith(UNDECIDED) and "disagree" in d.verdict and d.p_exact_holm == pytest.approx(0.0625)
    # with enough pairs both reject: the verdict is the t-test's
    a8, b8 = a + [1.0, 0.95, 1.1], b + [2.0, 2.1, 1.95]
    d8 = decide([Claim("c", "p", "h", test=paired_ttest(a8, b8), exact_test=sign_flip_test(a8, b8),
                       differs="x")])[0]
    assert d8.verdict == "reproduced (paired t, n = 8)"
    assert "(exact sign-flip 0.0078)" in claims_section([d8.claim])


def test_claims_section_shows_raw_and_adjusted_p_and_only_the_six_verdicts():
    rows = [Claim("ours beats KKT", "Table 1", "1.0 vs 2.0", test=LOWER, differs="x", reading="shared noise"),
            Claim("exact", "0", "0", construction="exact conditioning")]
    text = claims_section(rows, note="A note.")
    assert text.startswith("## Claims of the paper\n") and text.endswith("A note.\n")
    assert "| ours beats KKT (reading: shared noise) | Table 1 | 1.0 vs 2.0 | 0.002 | 0.002 | reproduced (" in text
    assert "| exact | 0 | 0 | - | - | holds by construction (exact conditioning) |" in text
    assert "over this study's one family of 1 tested rows" in text
    untested = claims_section(rows[1:])  # a quick run with one trial: nothing to adjust, and it says so
    assert "No row has a test in this run" in untested and "tested rows" not in untested
    for d in decide(rows):
        assert d.word in VERDICTS
    assert {REPRODUCED, NOT_AT_BUDGET, REFUTED, BY_DESIGN, BY_CONSTRUCTION, UNDECIDED} == set(VERDICTS)
    assert TIE.startswith(BY_CONSTRUCTION)


def test_sign_flip_test_against_enumeration_and_scipy():
    """The exact sign-flip p against an enumeration written out here and scipy's exact paired permutation test
    (statistic: the mean difference, two-sided); its floor 2 / 2^n; its errors."""
    from scipy.stats import permutation_test

    rng = np.random.default_rng(3)
    for n in (2, 3, 5, 7):
        for _ in range(5):
            a, b = rng.normal(0, 1, n), rng.normal(0.3, 1, n)
            got = sign_flip_test(a, b)
            d = a - b
            ref = np.mean([abs(sum(s * x for s, x in zip(signs, d))) >= abs(d.sum()) * (1 - 1e-12)
                           for signs in itertools.product((1, -1), repeat=n)])
            assert got["p"] == pytest.approx(ref, abs=1e-12)
            sp = permutation_test((a, b), lambda x, y: np.mean(x - y), permutation_type="samples",
                                  alternative="two-sided", n_resamples=10 ** 6)
            assert got["p"] == pytest.approx(min(1.0, sp.pvalue), abs=1e-9)
            assert got["mean_diff"] == pytest.approx(d.mean()) and got["n"] == n
    assert sign_flip_test([1.0] * 5, [2.0] * 5)["p"] == pytest.approx(2 / 32)
    assert sign_flip_test([1.0, 2.0], [1.0, 2.0])["p"] == 1.0
    assert math.isnan(sign_flip_test([1.0], [2.0])["p"])
    with pytest.raises(ValueError, match="paired"):
        sign_flip_test([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="n <= 20, got n = 21"):
        sign_flip_test([0.0] * 21, [1.0] * 21)


def _wilcoxon_claim(n: int, worst_case: bool) -> Claim:
    """A claim whose ``n`` pairs all go the paper's way (``worst_case``: the smallest p the test can give)."""
    a = [1.0 + 0.01 * i for i in range(n)]
    b = [x + (1.0 + 0.01 * i if worst_case else (-1) ** i * (1 + i)) for i, x in enumerate(a)]
    return Claim("ours beats X", "paper", "here", test=paired_wilcoxon(a, b), differs="budget")


def test_a_family_that_cannot_reject_says_so_and_whatever_the_data_rejects_nothing():
    # 39 rank tests over 10 pairs: Holm's smallest attainable p is 39 * 2 / 2^10 = 0.076, so even 39 rows with every
    # difference one way (each raw p at the floor) stay undecided, and each row says why
    family = [_wilcoxon_claim(10, worst_case=True) for _ in range(39)]
    assert holm_floor(family) == pytest.approx(39 * smallest_wilcoxon_p(10))
    decisions = decide(family)
    assert min(d.p_holm for d in decisions) == pytest.approx(holm_floor(family))
    for d in decisions:
        assert d.word == UNDECIDED
        assert "no row of this study's family of 39 can reach a Holm p below 0.05" in d.verdict
        assert "11 pairs per row" in d.verdict  # 39 * 2 / 2^11 = 0.038
    text = claims_section(family[:1], family=family[1:])
    assert "no row can be significant, whatever the data" in text and "0.076" in text
    # 25 rows can: 25 * 2 / 2^10 = 0.049, and the same data are then reproduced, with the ordinary sentence
    family = family[:25]
    assert holm_floor(family) < 0.05
    assert all(d.word == REPRODUCED for d in decide(family))
    assert "no row can be significant" not in claims_section(family[:1], family=family[1:])
    assert "the verdict reads the adjusted p" in claims_section(family[:1], family=family[1:])


def test_the_floor_is_a_true_lower_bound_and_a_t_test_has_none():
    rng = np.random.default_rng(3)
    for _ in range(30):  # random pairs, ties included: no Holm p ever goes below the floor
        n, m = int(rng.integers(6, 12)), int(rng.integers(1, 40))
        family = [Claim("c", "p", "h", test=paired_wilcoxon(list(rng.integers(0, 4, n) * 1.0),
                                                             list(rng.integers(0, 4, n) * 1.0)), differs="budget")
                  for _ in range(m)]
        family = [c for c in family if not math.isnan(c.p)]
        if family:
            assert min(holm([c.p for c in family])) >= holm_floor(family) * (1 - 1e-12)
    t = Claim("c", "p", "h", test=paired_ttest([1.0, 2.0, 3.0], [2.0, 3.5, 4.2]), differs="budget")
    assert holm_floor([t] * 50) == 0.0
    assert math.isnan(holm_floor([Claim("c", "p", "h", construction="exact")]))
