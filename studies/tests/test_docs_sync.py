"""Docs' result numbers are generated from, or checked against, the study reports (hardeq_studies.docs_sync)."""

from __future__ import annotations

import pytest

from hardeq_studies.docs_sync import (check_page, checked_numbers, find_blocks, main, pages, report_section,
                                     sync_text)

REPORT = """# Study

## Results

| method | NLL |
|---|---|
| ours | 88.25 |

### Detail

gap 13.5 nats

```
## not a heading (inside a fence)
```

## Claims of the paper

| claim | verdict |
|---|---|
| ours best | refuted (paired t, p = 0.002) |

## Timing
"""


def _page(body: str) -> str:
    return f"# Page\n\n## Protocol\n\nlearning rate 0.001, window 1.5 days\n\n{body}\n"


def _tree(tmp_path, page: str, report: str = REPORT):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "s.md").write_text(report)
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "s.md"
    doc.write_text(page)
    return doc


def test_report_section_stops_at_a_heading_of_the_same_or_higher_level():
    results = report_section(REPORT, "Results")
    assert "88.25" in results and "gap 13.5" in results and "Claims" not in results
    assert "not a heading" in results  # the fenced line belongs to the section
    assert report_section(REPORT, "Detail").startswith("gap 13.5")
    last = report_section(REPORT, "Claims of the paper").splitlines()[-1]
    assert last == "| ours best | refuted (paired t, p = 0.002) |"
    assert report_section(REPORT, "Timing") == ""
    with pytest.raises(KeyError, match="no section 'Nope'.*'Results'"):
        report_section(REPORT, "Nope")


def test_sync_rewrites_stale_blocks_and_is_idempotent(tmp_path):
    page = _page('## Results\n\n<!-- BEGIN generated: results/s.md "Claims of the paper" -->\nold\n'
                 '<!-- END generated -->')
    doc = _tree(tmp_path, page)
    new, changed = sync_text(page, tmp_path)
    assert changed == ['results/s.md "Claims of the paper"']
    assert "refuted (paired t, p = 0.002)" in new and "\nold\n" not in new
    assert sync_text(new, tmp_path) == (new, [])
    stale = 's.md: generated block results/s.md "Claims of the paper" is stale'
    assert check_page(doc, tmp_path)[0].startswith(stale)
    doc.write_text(new)
    assert check_page(doc, tmp_path) == []


def test_blocks_must_end_and_must_not_nest():
    begin = '<!-- BEGIN generated: results/s.md "Results" -->'
    with pytest.raises(ValueError, match="line 1: generated block without"):
        find_blocks(begin + "\nx\n")
    with pytest.raises(ValueError, match="line 2: a generated block begins inside the one of line 1"):
        find_blocks(f"{begin}\n{begin}\n<!-- END generated -->\n")
    with pytest.raises(FileNotFoundError, match="results/missing.md"):
        sync_text('<!-- BEGIN generated: results/missing.md "Results" -->\n<!-- END generated -->\n')


def test_numbers_in_results_prose_must_come_from_the_report(tmp_path):
    page = _page("## Results (see results/s.md)\n\nours reaches 88.25, a gap of 13.5 nats (p = 0.002); "
                 "ours is 42.0% better, `1.234` in code\n\n```\n9.99\n```\n\n### Claims\n\nrefuted at 7.25\n\n"
                 "## Design notes\n\nfree prose 3.14\n\n## Discussion\n\nchecked 2.71")
    doc = _tree(tmp_path, page)
    problems = check_page(doc, tmp_path)
    assert len(problems) == 3, problems
    assert "'42.0%'" in problems[0] and "results/s.md" in problems[0]
    assert "'7.25'" in problems[1] and "Claims" in problems[1]
    assert "'2.71'" in problems[2] and "Discussion" in problems[2]


def test_readme_bullets_are_checked_against_the_study_they_name(tmp_path):
    page = ("# hardeq\n\n## Results\n\n- **S** (`hardeq reproduce s --preset cpu`): NLL 88.25,\n  gap 13.6\n"
            "- **Speed** ([notes](docs/notes.md)): 2.5x faster\n\n## Other\n\n7.77\n")
    _tree(tmp_path, "x")
    (tmp_path / "docs" / "notes.md").write_text("measured 2.5x\n")
    readme = tmp_path / "README.md"
    readme.write_text(page)
    problems = check_page(readme, tmp_path)
    assert len(problems) == 1 and "'13.6'" in problems[0] and "results/s.md" in problems[0]


def test_checked_numbers_are_the_decimal_ones():
    line = "Sharpe 1.27 vs 1.08, 10/10 runs, p = 0.002, 8e-5, 34% of 4,900 runs, torch 2.13.0, `0.5`, v1.2, 1,234.5"
    assert checked_numbers(line) == ["1.27", "1.08", "0.002", "8e-5", "34%", "1,234.5"]


def test_main_rewrites_and_check_reports(tmp_path, capsys):
    page = _page('## Results\n\n<!-- BEGIN generated: results/s.md "Detail" -->\n<!-- END generated -->')
    _tree(tmp_path, page)
    (tmp_path / "README.md").write_text("# hardeq\n")
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().out
    assert main(["--root", str(tmp_path)]) == 0
    assert "gap 13.5 nats" in (tmp_path / "docs" / "s.md").read_text()
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_a_block_naming_a_missing_section_or_report_is_a_problem_not_a_crash(tmp_path):
    page = _page('## Results\n\n<!-- BEGIN generated: results/s.md "Nope" -->\n<!-- END generated -->')
    doc = _tree(tmp_path, page)
    problems = check_page(doc, tmp_path)
    assert len(problems) == 1 and "no section 'Nope'" in problems[0]
    doc.write_text(_page('<!-- BEGIN generated: results/gone.md "Results" -->\n<!-- END generated -->'))
    assert "results/gone.md: no such report" in check_page(doc, tmp_path)[0]


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_committed_docs_quote_only_what_the_reports_state(page):
    """README.md and docs/*.md: every generated block equals its report's section, and every decimal number in
    a Results / Claims / Findings / Discussion section occurs in the reports the page draws from."""
    assert check_page(page) == []
