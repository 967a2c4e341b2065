"""What the ``hardeq`` command prints and loads: ``--help`` and ``--version`` import neither torch nor the
library; ``reproduce`` and ``report`` print a short summary and the paths (``--verbose``: the whole report)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hardeq_studies import cli, load_study
from hardeq_studies.cli import main, summary

ROOT = Path(__file__).resolve().parents[2]


def _imported(*argv: str) -> set[str]:
    """The modules ``python -m hardeq_studies ARGV`` imports (from ``-X importtime``, which lists every one)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "hardeq_studies", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line.split("|")[-1] for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert len(lines) > 10, proc.stderr[-2000:]  # -X importtime did report
    return {line.strip() for line in lines[1:]}


@pytest.mark.parametrize("argv", [("--help",), ("--version",), ("reproduce", "--help"), ("report", "--help")])
def test_help_and_version_import_neither_torch_nor_the_library(argv):
    modules = _imported(*argv)
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "hardeq", "numpy", "matplotlib", "scipy"))
    assert heavy == [], f"hardeq {' '.join(argv)} imports {heavy[:10]}"
    assert "hardeq_studies.cli" in modules


def test_version_names_both_packages():
    proc = subprocess.run([sys.executable, "-m", "hardeq_studies", "--version"], capture_output=True, text=True,
                          timeout=120)
    from hardeq import __version__ as library
    from hardeq_studies import __version__ as studies

    assert proc.returncode == 0 and proc.stdout == f"hardeq-studies {studies} (hardeq {library})\n", proc


REPORT = """# tiny (cpu preset)

Some text.

## Claims of the paper

| claim (paper) | paper's evidence | here | p | p (Holm) | verdict |
|---|---|---|---|---|---|
| a beats b | 1 vs 2 | 1 vs 3 | 0.002 | 0.01 | reproduced (Wilcoxon, n = 10) |
| a beats c | 1 vs 2 | 2 vs 1 | 0.4 | 0.8 | undecided (Wilcoxon, n = 10; more seeds) |
| a beats d | 1 vs 2 | 1 vs 5 | 0.002 | 0.01 | reproduced (Wilcoxon, n = 10) |

| other | table |
|---|---|
| x | y |

## Bounds: do they help?

| claim (this repository) | weighed against | here | p | p (Holm) | verdict |
|---|---|---|---|---|---|
| e beats f | - | - | 0.3 | 0.6 | not reproduced at this budget (Wilcoxon) |
"""


def test_summary_is_the_title_and_the_verdict_tally_of_each_claims_table():
    assert summary(REPORT).splitlines() == [
        "tiny (cpu preset)",
        "Claims of the paper: 3 claims: 2 reproduced, 1 undecided",
        "Bounds: do they help?: 1 claims: 1 not reproduced at this budget",
    ]
    assert summary("no title\n") == "(report without a title)"


@pytest.mark.parametrize("name", ["chemical", "synthetic", "mof", "portfolio", "vae-data", "vae-latent", "diffusion"])
def test_summary_of_each_committed_report_counts_every_claim(name):
    text = (ROOT / "results" / f"{name}.md").read_text()
    lines = summary(text).splitlines()
    rows = sum(int(re.search(r": (\d+) claims: ", line).group(1)) for line in lines[1:])
    # every row of every table whose header ends in "verdict", counted independently
    blocks, expected, inside = text.split("\n"), 0, False
    for line in blocks:
        if line.startswith("|") and line.rstrip().endswith("| verdict |"):
            inside = True
            continue
        if inside and line.startswith("|") and not line.startswith("|---"):
            expected += 1
        elif not line.startswith("|"):
            inside = False
    assert lines[0] == text.splitlines()[0].lstrip("# ") and rows == expected > 0, (lines, expected)
    assert len(lines) <= 4


@pytest.fixture
def tiny_report(monkeypatch, tmp_path):
    """``hardeq report chemical`` on a copied results document, the study's report replaced by one that writes
    :data:`REPORT` (no figures: fast)."""
    src = ROOT / "results" / "chemical.json"
    (tmp_path / "chemical.json").write_bytes(src.read_bytes())
    study = load_study("chemical")

    def report(self, doc, out, quiet=False):
        assert quiet  # the command prints, not the study
        (Path(out) / "chemical.md").write_text(REPORT)
        return [Path(out) / "chemical.md", Path(out) / "chemical.cstr.png"]

    monkeypatch.setattr(type(study), "report", report)
    monkeypatch.setattr(type(study), "run", lambda self, args: json.loads(src.read_text()))
    return tmp_path


def test_report_prints_a_summary_and_the_paths(tiny_report, capsys):
    assert main(["report", "chemical", "--out", str(tiny_report)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["tiny (cpu preset)", "Claims of the paper: 3 claims: 2 reproduced, 1 undecided"]
    assert out[-1].startswith(f"wrote {tiny_report / 'chemical.md'}, {tiny_report / 'chemical.cstr.png'} from ")
    assert "--verbose prints the whole report" in out[-1] and "Some text." not in "\n".join(out)
    assert len(out) == 4


def test_report_verbose_prints_the_whole_markdown(tiny_report, capsys):
    assert main(["report", "chemical", "--out", str(tiny_report), "--verbose"]) == 0
    out = capsys.readouterr().out
    assert REPORT.rstrip("\n") in out and out.strip().splitlines()[-1].startswith("wrote ")


def test_reproduce_prints_a_summary_and_the_paths(tiny_report, capsys):
    assert main(["reproduce", "chemical", "--out", str(tiny_report)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == cli.smoke_line("chemical") and out[-1] == cli.smoke_line("chemical")
    assert out[1:3] == ["tiny (cpu preset)", "Claims of the paper: 3 claims: 2 reproduced, 1 undecided"]
    assert out[-2].startswith(f"wrote {tiny_report / 'chemical.json'} and its report in ")
    assert f"{tiny_report / 'chemical.md'}, {tiny_report / 'chemical.cstr.png'}" in out[-2]
    assert "Some text." not in "\n".join(out)
    assert main(["reproduce", "chemical", "--out", str(tiny_report), "--verbose"]) == 0
    assert "Some text." in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one of the two
        main(["reproduce", "chemical", "--out", str(tiny_report), "--verbose", "--quiet"])
