"""The scripts in examples/: each runs as a subprocess (``--out tmp_path``), prints its numbers with the claims they
check, and saves its figure. These tests parse the printed numbers and check the claims and the figure.

The two fastest run by default; the others (10-30 s each on a loaded 2-core machine) are ``slow``
(``pytest -m slow tests/test_examples.py``). Examples whose extra is missing (torch_geometric, diffusers) or
without matplotlib are skipped.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NUMBER = r"([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))"

pytestmark = pytest.mark.cpu_only(reason="the examples are CPU scripts run as subprocesses")


def run_example(name: str, out: Path, *args: str, needs: tuple[str, ...] = ()) -> str:
    """Run ``examples/<name>.py --out out`` and return its stdout; fail with its output if it fails."""
    pytest.importorskip("matplotlib")
    for module in needs:
        pytest.importorskip(module)
    # the scripts default to --threads 1; OMP_NUM_THREADS=1 also keeps any other OpenMP pool from spinning
    env = dict(os.environ, PYTHONWARNINGS="ignore", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert (out / f"{name}.png").is_file(), f"{name} saved no figure in {out}:\n{proc.stdout}"
    assert (out / f"{name}.png").stat().st_size > 1000
    return proc.stdout


def number(pattern: str, text: str, group: int = 1) -> float:
    """The number that follows ``pattern`` (a regex; ``{num}`` marks where a number stands) in the output."""
    regex = pattern.replace("{num}", NUMBER) if "{num}" in pattern else re.escape(pattern) + r"\s*" + NUMBER
    m = re.search(regex, text)
    assert m is not None, f"no match for {pattern!r} in:\n{text}"
    return float(m.group(group))


def test_every_example_has_a_page_a_readme_row_and_a_committed_figure():
    scripts = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    assert len(scripts) == 8
    readme = (EXAMPLES / "README.md").read_text()
    for name in scripts:
        assert f"python examples/{name}.py" in readme
        page = ROOT / "docs" / "examples" / f"{name}.md"
        assert f"<!-- include-source: ../../examples/{name}.py -->" in page.read_text()
        assert (ROOT / "docs" / "examples" / "figures" / f"{name}.png").is_file()


def test_poisson_fixed_total(tmp_path):
    out = run_example("poisson_fixed_total", tmp_path)
    assert "non-negative integers: True" in out
    assert number("samples x 2 batch x 2 groups:", out) == 0
    assert number("max |log_prob - multinomial log-pmf| on 200 samples:", out) < 1e-10
    assert number("max |expected_l1 - binomial sum (math.comb)|:", out) < 1e-12
    assert number("max |expected_l1 - Monte Carlo mean| / standard error:", out) < 4
    freq = number(r"pmf\| of coordinate 2: {num} \(claim: < {num}", out)
    assert freq < number(r"pmf\| of coordinate 2: {num} \(claim: < {num}", out, group=2)


def test_sparse_grid_conservation(tmp_path):
    out = run_example("sparse_grid_conservation", tmp_path, "--grid", "24")
    assert "grid 24 x 24" in out
    assert number("conditional mean:", out) <= 1e-12
    assert number("over 16 samples:", out) <= 1e-12
    assert number("max |(Df - s)_last| =", out) <= 1e-10
    assert number("worst per-row residual", out.split("for contrast:")[1]) > 1e-3  # the prior is far off the plane


@pytest.mark.slow
def test_constrained_vae(tmp_path):
    out = run_example("constrained_vae", tmp_path)
    for what in ("latent samples on sum z = 0", "reconstructions on sum x = 10", "decoder samples"):
        assert number(what, out) <= 1e-5
    elbos = [float(v) for v in re.findall(r"test ELBO " + NUMBER + " nats per example", out)]
    assert len(elbos) == 10 and elbos[-1] > elbos[0] + 5  # it learns
    assert math.isfinite(number("KL(q || p) mean", out))


@pytest.mark.slow
def test_charge_neutral_gnn(tmp_path):
    out = run_example("charge_neutral_gnn", tmp_path, needs=("torch_geometric",))
    assert number("|sum q - t| / sum|q|: mean", out) <= 1e-5
    assert number("16 samples", out) <= 1e-5
    assert number("over mean and samples", out) <= 1e-6  # the one-atom ion's charge is its total
    assert number("w.r.t. mu", out) > 0.05 and number("w.r.t. v", out) > 0.05  # the Jacobians differ
    assert number("central finite differences (v):", out) < 1e-6
    assert number("vs I - v 1^T / V (mu):", out) < 1e-12


@pytest.mark.slow
def test_diffusers_pipeline(tmp_path):
    out = run_example("diffusers_pipeline", tmp_path, needs=("diffusers",))
    assert number("final=None (clamped by the pipeline): max |channel sum - total| =", out) > 1e-2
    err, tol = number(r"final='box': max \|channel sum - total\| = {num} \(claim: <= {num}", out), \
        number(r"final='box': max \|channel sum - total\| = {num} \(claim: <= {num}", out, group=2)
    assert err <= tol
    lo, hi = number(r"pixels in \[{num}, {num}\]", out), number(r"pixels in \[{num}, {num}\]", out, group=2)
    assert 0 <= lo <= hi <= 1
    assert number("round(255 total)| =", out) == 0


@pytest.mark.slow
def test_mass_balance_surrogate(tmp_path):
    out = run_example("mass_balance_surrogate", tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("worst per-row residual")]
    assert len(rows) == 2
    for line in rows:
        assert number("mixer", line) <= 1e-5 and number("splitter", line) <= 1e-5
    assert number("smallest predicted or sampled flow:", out) >= 0


@pytest.mark.slow
def test_long_only_portfolio(tmp_path):
    out = run_example("long_only_portfolio", tmp_path)
    assert number("sum|w|: mode", out) <= 1e-5
    assert number("on each of 32 days", out) <= 1e-5
    assert number("smallest weight", out) >= 0
    assert number("largest", out) <= 1


def test_include_source_hook_inlines_a_repository_file_and_refuses_missing_or_outside_ones(tmp_path):
    """docs/_hooks/hardeq_site.py: ``<!-- include-source: PATH -->`` becomes a fenced block holding the file."""
    pytest.importorskip("mkdocs")
    import importlib.util

    spec = importlib.util.spec_from_file_location("hardeq_site_hooks", ROOT / "docs" / "_hooks" / "hardeq_site.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    docs = ROOT / "docs"
    m = hooks.INCLUDE_SOURCE.search("x\n<!-- include-source: ../../examples/poisson_fixed_total.py -->\n")
    out = hooks._include_source(m, "examples/poisson_fixed_total.md", docs, ROOT)
    source = (EXAMPLES / "poisson_fixed_total.py").read_text().rstrip("\n")
    assert out == f'```python title="examples/poisson_fixed_total.py"\n{source}\n```'
    (tmp_path / "ticks.py").write_text("s = '''\n```\n'''\n")  # a fence inside the file: a longer outer fence
    m = hooks.INCLUDE_SOURCE.search("<!-- include-source: ticks.py -->")
    assert hooks._include_source(m, "page.md", tmp_path, tmp_path).startswith("````python")
    for bad in ("../../examples/gone.py", "../../../outside.py"):
        m = hooks.INCLUDE_SOURCE.search(f"<!-- include-source: {bad} -->")
        with pytest.raises(ValueError, match="no file"):
            hooks._include_source(m, "examples/page.md", docs, ROOT)
