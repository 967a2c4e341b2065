"""The library is only the library: torch and numpy, no data, no studies, no command; scipy only when
``hardeq.testing.mc_atol`` is called (extra ``hardeq[test]``)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "hardeq"


def test_the_package_holds_only_code():
    others = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".py" and p.name != "py.typed"]
    assert others == [], f"non-code files in src/hardeq (they would ship in the wheel): {others}"
    assert not (SRC / "studies").exists() and not (SRC / "data").exists() and not (SRC / "cli.py").exists()


def test_pyproject_declares_torch_and_numpy_only_and_no_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = sorted(d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["project"]["dependencies"])
    assert deps == ["numpy", "torch"]
    assert "scripts" not in project["project"] and project["project"]["license"] == "MIT"
    assert project["tool"]["setuptools"]["package-data"]["hardeq"] == ["py.typed"]


def test_importing_the_library_imports_neither_scipy_nor_the_studies():
    code = ("import sys\nimport hardeq, hardeq.nn, hardeq.diffusion, hardeq.estimators, hardeq.baselines, "
            "hardeq.testing\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('scipy', 'hardeq_studies', "
            "'matplotlib')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
