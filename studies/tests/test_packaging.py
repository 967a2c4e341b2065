"""The hardeq-studies package: its command, its extras, and a SOURCE.md and a licence file beside every data
set, with the licences stated in its metadata."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import hardeq_studies

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "studies"
PACKAGE = Path(hardeq_studies.__file__).resolve().parent


def _pyproject() -> dict:
    return tomllib.loads((STUDIES / "pyproject.toml").read_text())


def _data_folders() -> list[Path]:
    """Every folder of the package that holds data files (anything but code, configs and notes)."""
    code = {".py", ".json", ".md", ".txt"}
    return sorted({p.parent for p in PACKAGE.rglob("*") if p.is_file() and p.suffix not in code
                   and "__pycache__" not in p.parts})


def test_every_data_set_has_its_source_and_licence():
    folders = _data_folders()
    assert len(folders) == 5, folders  # chemical_process, cifar10_jpeg, mnist, mof/data, portfolio/data
    for folder in folders:
        assert (folder / "SOURCE.md").is_file(), folder
        assert list(folder.glob("LICENSE*")) or list(folder.glob("*LICENSE*")), f"no licence file in {folder}"


def test_metadata_states_the_data_licences():
    project = _pyproject()["project"]
    licence = project["license"]
    for spdx in ("MIT", "GPL-3.0-only", "BSD-3-Clause", "CC-BY-SA-3.0"):
        assert spdx in licence.split(" AND "), spdx
    assert licence.count("LicenseRef-") == 3  # the three data sets whose sources state no licence
    for pattern in project["license-files"]:
        assert list(STUDIES.glob(pattern)), pattern
    assert project["scripts"] == {"hardeq": "hardeq_studies.cli:main"}
    assert "hardeq" in project["dependencies"]


def test_readme_first_command_installs_both_packages_and_runs_the_quick_chemical_study():
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n```", text, re.S).group(1)
    assert first.endswith("hardeq reproduce chemical")
    assert 'pip install torch==2.13.0 -e . -e "./studies[chemical]"' in first
    assert "results/quick/chemical.*" in text
    extras = _pyproject()["project"]["optional-dependencies"]
    assert "matplotlib" in " ".join(extras["chemical"])
