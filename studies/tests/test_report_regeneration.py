"""``hardeq report`` regenerates every committed result's Markdown and figures from its JSON.

For each committed result set (``results/**/NAME.json`` of a study NAME; not ``results/quick/``), the folder is
copied, every ``.md`` and ``.png`` in the copy is replaced by a stale placeholder, and the study's report is run
on the copy. Then: every Markdown file equals the committed one byte for byte; every figure equals the
committed one pixel for pixel (decoded with matplotlib; the PNG bytes are also equal when the same matplotlib
and FreeType write them, as on the machine that committed them, but a PNG encoder's bytes are not promised
across versions); no file appears that is not committed; the only figures the report does not redraw are the
diffusion sample grids, which the run draws from samples that the JSON does not hold; and every figure a
committed ``.md`` links exists.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from hardeq_studies import available, load_study

RESULTS = Path(__file__).resolve().parents[2] / "results"
STALE = b"stale placeholder\n"


def _private(parts: tuple[str, ...]) -> bool:
    """A path a user's own runs write beside the committed results (quick runs, checkpoints, the ``.last`` state
    of ``hardeq report``): gitignored, so not a committed result set."""
    return any(part in ("quick", "checkpoints") or part.startswith(".") for part in parts[:-1])


def _result_sets() -> list[Path]:
    if not RESULTS.is_dir():
        return []
    names = set(available())
    return sorted(p for p in RESULTS.rglob("*.json")
                  if p.stem in names and not _private(p.relative_to(RESULTS).parts))


def _pixels(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(path)


@pytest.mark.parametrize("doc_path", _result_sets(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_report_regenerates_the_committed_outputs(doc_path, tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from hardeq_studies.diffusion.report import GRID_FILES

    committed = doc_path.parent
    copy = tmp_path / "results"
    shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("quick", "checkpoints"))
    for sub in [p for p in copy.iterdir() if p.is_dir()]:
        shutil.rmtree(sub)  # other result sets (subfolders) are tested on their own
    for p in copy.iterdir():
        if p.suffix in (".md", ".png"):
            p.write_bytes(STALE)
    study = load_study(doc_path.stem)
    study.report(json.loads(doc_path.read_text()), copy, quiet=True)

    prefix = doc_path.stem
    mine = {p.name for p in copy.iterdir() if p.is_file()}
    theirs = {p.name for p in committed.iterdir() if p.is_file()}
    assert mine == theirs, f"the report wrote files that are not committed: {sorted(mine - theirs)}"
    for name in sorted(theirs):
        if not name.startswith(prefix.replace("-", "_")) and not name.startswith(prefix):
            continue
        new, old = copy / name, committed / name
        if name.endswith(".md"):
            assert new.read_bytes() == old.read_bytes(), f"{name} differs from `hardeq report {prefix}`'s"
        elif name.endswith(".png"):
            if new.read_bytes() == STALE:
                assert name in GRID_FILES.values(), f"`hardeq report {prefix}` did not redraw {name}"
                continue
            a, b = _pixels(new), _pixels(old)
            assert a.shape == b.shape and np.array_equal(a, b), f"{name}: pixels differ from the redrawn figure"
    for md in committed.glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+\.png)\)", md.read_text()):
            assert (committed / link).is_file(), f"{md.name} links {link}, which is not committed"


def test_every_committed_result_set_is_found():
    sets = _result_sets()
    if not sets:
        pytest.skip("no results/ folder (not a source checkout)")
    assert {p.stem for p in sets} == set(available())
