"""Every committed result names a clean commit of this repository's history (honest reproduction).

``RERUN_PENDING`` lists the result sets still computed from uncommitted code, whose clean rerun is open work
(their docs say so); the test checks that they are indeed still marked dirty, so the list cannot outlive the
rerun, and that every other result set is clean.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hardeq_studies import available

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"


#: result sets (paths under results/) whose clean rerun is still to be made
RERUN_PENDING: set[str] = set()


def _private(parts: tuple[str, ...]) -> bool:
    """A path a user's own runs write beside the committed results (quick runs, checkpoints, the ``.last`` state
    of ``hardeq report``): gitignored, so not a committed result set."""
    return any(part in ("quick", "checkpoints") or part.startswith(".") for part in parts[:-1])


def _documents() -> list[Path]:
    names = set(available())
    return sorted(p for p in RESULTS.rglob("*.json")
                  if p.stem in names and not _private(p.relative_to(RESULTS).parts)) if RESULTS.is_dir() else []


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_result_comes_from_a_clean_commit_on_this_history(path):
    env = json.loads(path.read_text())["environment"]
    if str(path.relative_to(RESULTS)) in RERUN_PENDING:
        assert env.get("dirty") is True, f"{path.name} is clean now: remove it from RERUN_PENDING"
        return
    assert env.get("dirty") is False, f"{path.name}: computed from a tree with uncommitted changes"
    assert "allow_dirty" not in env
    commit = env.get("git")
    assert commit and len(commit) == 40, f"{path.name}: no commit recorded ({commit!r})"
    if _git("rev-parse", "--is-inside-work-tree").returncode != 0:
        pytest.skip("not a git checkout")
    known = _git("cat-file", "-e", f"{commit}^{{commit}}")
    if known.returncode != 0 and _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: the commit's history is not here")
    assert known.returncode == 0, f"{path.name}: commit {commit[:12]} is not in this repository"
    ancestor = _git("merge-base", "--is-ancestor", commit, "HEAD")
    assert ancestor.returncode == 0, f"{path.name}: commit {commit[:12]} is not an ancestor of HEAD"
