"""The README's usage example runs as written, and its commands match .ci/run."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Usage\n\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.splitlines()) <= 25
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([32, 5])" in out.stdout


def test_ci_runs_the_readme_test_command():
    text = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[test,graphs,diffusion]" && python -m pytest' in text
    assert 'pip install --quiet torch==2.13.0 -e ".[test,graphs,diffusion]"' in ci and "python -m pytest" in ci


def test_cli_version_and_help():
    out = subprocess.run([sys.executable, "-m", "hardeq", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("hardeq ")
    out = subprocess.run([sys.executable, "-m", "hardeq", "reproduce", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "STUDY" in out.stdout


def test_readme_quick_command_writes_under_results_quick():
    """The first command installs the chemical extra and runs the default (quick) preset, which writes under
    results/quick/ (tests/studies/test_cli.py runs it); pyproject defines that extra."""
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n```", text, re.S).group(1)
    assert first.endswith("hardeq reproduce chemical") and '-e ".[chemical]"' in first
    assert "results/quick/chemical.*" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^chemical = \[", pyproject, re.M)
    assert "DESIGN" + ".md" not in text  # the repository must be self-contained
