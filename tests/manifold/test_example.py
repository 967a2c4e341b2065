"""examples/nonlinear_energy_balance.py runs, and its claims hold (it exits non-zero when one fails)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.cpu_only(reason="a CPU script run as a subprocess")
def test_nonlinear_energy_balance_example(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "nonlinear_energy_balance.py"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"the example failed:\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("claim ")]
    assert len(lines) == 4 and all(line.endswith(": OK") for line in lines), proc.stdout
    assert (tmp_path / "nonlinear_energy_balance.png").stat().st_size > 1000
