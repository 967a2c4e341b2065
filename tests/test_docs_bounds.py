"""docs/bounds.md's worked examples run as written (slow: exact HMC and a diffusion loop under a shared CPU)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "bounds.md").read_text(), re.S)


def test_there_is_one_example_per_use():
    assert len(SNIPPETS) == 3  # portfolio, flows, images


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=["portfolio", "flows", "images"])
def test_example_runs(index):
    out = subprocess.run([sys.executable, "-c", SNIPPETS[index]], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True True"), out.stdout
