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
    """.ci/run installs and tests exactly as the README's second command says."""
    text = (ROOT / "README.md").read_text()
    second = re.findall(r"```bash\n(.*?)\n```", text, re.S)[1]
    install, _, tests = second.partition(" && pip install ")[2].partition(" && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"pip install --quiet {install}" in ci
    for command in tests.split(" && "):
        assert command in ci.splitlines(), command
