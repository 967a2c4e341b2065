"""The scripts in examples/: each runs as a subprocess (``--out tmp_path``), prints its numbers with the claims they
check, checks those claims itself (exit status 1 and the failed claims on stderr when one does not hold) and saves
its figure. These tests parse the printed numbers and check the claims again, independently, and the figure; and
they show that a script fails when its claim does (a library broken on purpose, and every script's claims fed
NaN).

The two fastest run by default; the others (10-30 s each on a loaded 2-core machine) are ``slow``
(``pytest -m slow tests/test_examples.py``). Examples whose extra is missing (torch_geometric, diffusers) or
without matplotlib are skipped.
"""

from __future__ import annotations

import collections
import importlib.util
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


def run_example(name: str, out: Path, *args: str, needs: tuple[str, ...] = (), warnings: bool = False) -> str:
    """Run ``examples/<name>.py --out out`` and return its stdout; fail with its output if it fails. With
    ``warnings``, Python's warnings are shown and the script must print none."""
    pytest.importorskip("matplotlib")
    for module in needs:
        pytest.importorskip(module)
    # the scripts default to --threads 1; OMP_NUM_THREADS=1 also keeps any other OpenMP pool from spinning
    env = dict(os.environ, PYTHONWARNINGS="default" if warnings else "ignore", MPLBACKEND="Agg",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    if warnings:
        assert "Warning" not in proc.stderr, proc.stderr
    assert re.search(r"^all \d+ claims hold$", proc.stdout, re.M), proc.stdout
    assert (out / f"{name}.png").is_file(), f"{name} saved no figure in {out}:\n{proc.stdout}"
    assert (out / f"{name}.png").stat().st_size > 1000
    return proc.stdout


def number(pattern: str, text: str, group: int = 1) -> float:
    """The number that follows ``pattern`` (a regex; ``{num}`` marks where a number stands) in the output."""
    regex = pattern.replace("{num}", NUMBER) if "{num}" in pattern else re.escape(pattern) + r"\s*" + NUMBER
    m = re.search(regex, text)
    assert m is not None, f"no match for {pattern!r} in:\n{text}"
    return float(m.group(group))


def load_example(name: str):
    """Import ``examples/<name>.py`` as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.py")))
def test_every_claim_of_every_example_can_fail(name, capsys):
    """Fed NaN for every number, each claim of a script fails (none is vacuous), and ``enforce`` exits with a
    non-zero status that lists them; fed the claims all true, it says so."""
    module = load_example(name)
    checked = module.claims(collections.defaultdict(lambda: math.nan))
    assert len(checked) >= 3 and not any(ok for _, ok in checked), [c for c, ok in checked if ok]
    with pytest.raises(SystemExit) as exc:
        module.enforce(checked)
    message = str(exc.value.code)
    assert exc.value.code != 0 and f"{len(checked)} of {len(checked)} claims failed" in message
    assert all(claim in message for claim, _ in checked)
    module.enforce([(claim, True) for claim, _ in checked])
    assert capsys.readouterr().out == f"all {len(checked)} claims hold\n"


BREAK_POISSON = """
import runpy, sys
import hardeq

original = hardeq.ConstrainedPoisson.expected_l1


def broken(self, *args, **kwargs):  # a library bug: the closed-form expected L1 loss 0.1% too large
    return original(self, *args, **kwargs) * 1.001


hardeq.ConstrainedPoisson.expected_l1 = broken
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_an_example_exits_non_zero_when_its_claim_fails(tmp_path):
    """examples/poisson_fixed_total.py run against a library whose expected L1 loss is 0.1% off: the script exits
    with status 1 and names the claim that failed, instead of printing the number and exiting 0."""
    pytest.importorskip("matplotlib")
    env = dict(os.environ, PYTHONWARNINGS="ignore", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", BREAK_POISSON, str(EXAMPLES / "poisson_fixed_total.py"),
                           "--out", str(tmp_path), "--samples", "2000"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "poisson_fixed_total.py: 1 of 6 claims failed:" in proc.stderr, proc.stderr
    assert "  - expected_l1 equals the binomial sum to < 1e-12 (got " in proc.stderr, proc.stderr
    assert "claims hold" not in proc.stdout and "Traceback" not in proc.stderr
    assert (tmp_path / "poisson_fixed_total.png").is_file()  # the figure is still drawn, to look at


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
    out = run_example("sparse_grid_conservation", tmp_path, "--grid", "24", warnings=True)  # no sparse warnings
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
    assert "for contrast" not in out  # plain rounding met the totals here: no contrast to show


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


@pytest.mark.slow
def test_nonlinear_energy_balance(tmp_path):
    out = run_example("nonlinear_energy_balance", tmp_path)
    assert "all 5 claims hold" in out
    assert number(r"samples {num} \(tol", out) <= 1e-5


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
