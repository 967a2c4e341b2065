"""Verdicts on the paper's claims (hardeq_studies.claims) against hand-made paired tests."""

from __future__ import annotations

import pytest

from hardeq_studies.claims import Claim, claims_section, smallest_wilcoxon_p, verdict
from hardeq_studies.stats import paired_ttest, paired_wilcoxon


def test_smallest_wilcoxon_p_is_two_over_two_to_the_n():
    assert smallest_wilcoxon_p(3) == 0.25
    for n in (5, 6, 10):
        a, b = [float(i) for i in range(n)], [float(i) + 1 + 0.01 * i for i in range(n)]
        assert paired_wilcoxon(a, b)["p"] == pytest.approx(smallest_wilcoxon_p(n))


def test_verdicts_follow_the_sign_and_the_level():
    lower = paired_wilcoxon([1.0 + 0.01 * i for i in range(10)], [2.0 + 0.02 * i for i in range(10)])
    assert verdict(lower).startswith("reproduced (Wilcoxon, n = 10, p = 0.002")
    assert verdict(lower, lower_is_better=False).startswith("refuted (Wilcoxon, n = 10")
    mixed = paired_wilcoxon([1.0, 3.0, 1.0, 3.0, 2.0, 2.5], [2.0, 2.0, 2.0, 2.0, 2.1, 2.4])
    assert verdict(mixed).startswith("undecided (Wilcoxon, n = 6")
    assert verdict(mixed, budget="10 splits").endswith("; 10 splits)")
    three = paired_wilcoxon([1.0, 1.1, 1.2], [2.0, 2.1, 2.3])
    assert verdict(three) == "undecided (Wilcoxon, n = 3, p = 0.25; at least 6 pairs)"
    t = paired_ttest([1.0, 1.1, 1.2, 0.9, 1.05], [2.0, 2.2, 2.1, 2.05, 1.9])
    assert verdict(t).startswith("reproduced (paired t, n = 5, p = ")
    assert verdict(paired_ttest([1.0], [2.0])).startswith("undecided (fewer than 2 pairs")
    assert verdict(paired_ttest([1.0, 2.0], [1.0, 2.0])).startswith("undecided")
    with pytest.raises(ValueError, match="paired: expected .*mean_diff"):
        verdict({"n": 5, "p": 0.01})


def test_claims_section_is_a_table_with_the_note():
    text = claims_section([Claim("ours beats KKT", "Table 1", "1.0 vs 2.0", "refuted (x)")], note="A note.")
    assert text.startswith("## Claims of the paper\n")
    assert "| ours beats KKT | Table 1 | 1.0 vs 2.0 | refuted (x) |" in text and text.endswith("A note.\n")


def test_no_difference_claims_are_consistent_unless_the_test_rejects():
    from hardeq_studies.claims import verdict_no_difference

    same = paired_wilcoxon([1.0, 3.0, 1.0, 3.0, 2.0, 2.5], [2.0, 2.0, 2.0, 2.0, 2.1, 2.4])
    assert verdict_no_difference(same).startswith("consistent (no significant difference; Wilcoxon, n = 6")
    worse = paired_wilcoxon([2.0 + 0.01 * i for i in range(10)], [1.0] * 10)
    assert verdict_no_difference(worse) == "refuted (Wilcoxon, n = 10, p = 0.002; the first is higher)"
