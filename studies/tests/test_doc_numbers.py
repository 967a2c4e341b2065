"""The numbers README.md and the study pages quote are in the results (hardeq_studies.doc_numbers): every page
passes, and the check fails on a wrong number injected into a copy of a page: a typo in a result, a paper table
number mistyped, swapped digits, a duration the JSON does not record, a README bullet's number changed.

Its power is that of matching at the precision written: measured over the pages' own numbers with the last digit
changed by one, it catches 93% of the changed numbers of 4 significant digits and 99% of 5 or more, but only about
half of 3 digits and a quarter of 1-2 (a short number matches some value of a large result by chance), so the
injected cases here have 4 or more."""

from __future__ import annotations

from pathlib import Path

import pytest

from hardeq_studies.doc_numbers import PAGES, ROOT, allowed_numbers, check_page, normalise

CASES = ["README.md", *PAGES]


@pytest.mark.parametrize("page", CASES)
def test_every_number_of_the_study_pages_is_in_the_results(page):
    assert check_page(page) == []


def _copy(tmp_path: Path, page: str, old: str, new: str) -> Path:
    """A root whose results and studies are the repository's and whose ``page`` has ``old`` replaced by ``new``."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "results").symlink_to(ROOT / "results", target_is_directory=True)
    (tmp_path / "studies").symlink_to(ROOT / "studies", target_is_directory=True)
    text = (ROOT / page).read_text()
    assert text.count(old) >= 1, f"{old!r} is not on {page} any more: update the injected case"
    (tmp_path / page).write_text(text.replace(old, new, 1))
    return tmp_path


@pytest.mark.parametrize("page, old, new, wrong", [
    ("docs/diffusion.md", "scores 28.78", "scores 28.87", "28.87"),               # a typo in a result
    ("docs/diffusion.md", "3.811 / 9.223", "3.118 / 9.223", "3.118"),             # a paper table number mistyped
    ("docs/portfolio.md", "runs (p = 0.0059)", "runs (p = 0.0095)", "0.0095"),  # digits swapped
    ("docs/mof.md", "10,555 s in all", "10,655 s in all", "10,655"),             # a duration the JSON does not record
    ("docs/mof.md", "the constant's 0.3240;", "the constant's 0.3204;", "0.3204"),
    ("README.md", "0.0408 vs 0.3240", "0.0408 vs 0.3204", "0.3204"),             # a README study bullet
    ("docs/vae.md", "RL +1.456", "RL +1.546", "+1.546"),
])
def test_a_wrong_number_injected_into_a_page_fails(tmp_path, page, old, new, wrong):
    root = _copy(tmp_path, page, old, new)
    problems = check_page(page, root)
    assert len(problems) == 1 and repr(wrong) in problems[0], problems  # only the injected number fails


def test_matching_is_at_the_precision_written():
    allowed = allowed_numbers(["mof"])
    assert {"0.0408", "0.041", "0.04"} <= allowed  # CL's MAD 0.04080...: at any precision written
    assert normalise("10,555") == "10555" and "10555" in allowed  # the legs' 10554.7 s
    assert normalise("-0.43") == normalise("+0.43") == "0.43"
    assert "0.3204" not in allowed and "10655" not in allowed


def test_library_sections_code_and_generated_blocks_are_not_read(tmp_path):
    """A number inside inline code or a library section is not a result quote; the same number in a result
    section's prose is."""
    root = _copy(tmp_path, "docs/diffusion.md", "## Quick start", "## Quick start\n\n12,345.6 in a library section")
    assert check_page("docs/diffusion.md", root) == []
    other = tmp_path / "other"
    other.mkdir()
    root = _copy(other, "docs/mof.md", "## Results (`cpu` preset)",
                 "## Results (`cpu` preset)\n\n`12,345.6` in code and 12,345.6 in prose")
    problems = check_page("docs/mof.md", root)
    assert len(problems) == 1 and "'12,345.6'" in problems[0]
