"""The ``hardeq`` command line as a new user meets it: exit codes, argparse-style errors without tracebacks,
presets and their stated durations, lazy study discovery, the quick preset's default output folder, the
results document (git commit and dirty flag), the pip-extra message, the central palette."""

from __future__ import annotations

import json
import sys

import pytest

from hardeq_studies.cli import build_parser, main
from hardeq_studies import available, info, load_study
from hardeq_studies.extras import MissingDependency, require
from hardeq_studies.palette import COLORS, color
from hardeq_studies.results import git_state
from hardeq_studies.stats import paired_wilcoxon

from study_test_helpers import run_or_fail


def _hardeq(*args, cwd=None, timeout=300):
    return run_or_fail([sys.executable, "-m", "hardeq_studies", *args], cwd=cwd, timeout=timeout)


def test_missing_subcommand_exits_2():
    for args in ([], ["reproduce"]):
        proc = _hardeq(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "required" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["--datasets", "cstr", "nope"], "argument --datasets: invalid choice: 'nope'"),
    (["--methods", "ours", "OURS"], "argument --methods: invalid choice: 'OURS'"),
    (["--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),
    (["--seeds", "-1"], "argument --seeds: must be a positive integer"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
])
def test_bad_values_give_one_line_errors(args, needle):
    proc = _hardeq("reproduce", "chemical", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and needle in error_lines[0], proc.stderr


OURS = ("chemical", "synthetic")  # the studies of this test module (others test their own)


def test_top_level_help_lists_every_study():
    proc = _hardeq("--help")
    assert proc.returncode == 0
    listed = [line.split()[0] for line in proc.stdout.split("studies:\n", 1)[1].splitlines() if line.startswith("  ")]
    assert listed == available() and len(listed) == 7


def test_help_states_default_preset_and_measured_durations():
    for name in OURS:
        proc = _hardeq("reproduce", name, "--help")
        assert proc.returncode == 0
        meta = info(name)
        default = meta["default_preset"]
        assert f"Default preset: {default} ({meta['presets'][default]['duration']})" in " ".join(proc.stdout.split())
        for preset in ("quick", "cpu", "paper"):
            assert meta["presets"][preset]["duration"]
            assert preset in proc.stdout
        assert "--full" in proc.stdout and "--quick" in proc.stdout
        # a projected duration (a preset not run in full) is not labelled as a measurement
        assert "measured: projected" not in proc.stdout and "measured: not run" not in proc.stdout
        for preset in ("quick", "cpu", "paper"):
            duration = " ".join(meta["presets"][preset]["duration"].split())
            assert f"duration: {duration}" in " ".join(proc.stdout.split()), (name, preset)


def test_help_imports_no_study_and_no_matplotlib():
    code = ("import sys\nfrom hardeq_studies.cli import main\n"
            "for argv in (['--help'], ['reproduce', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "heavy = [m for m in sys.modules if m.startswith(('matplotlib', 'hardeq_studies.chemical', "
            "'hardeq_studies.synthetic', 'hardeq_studies.harness', 'scipy'))]\nprint('HEAVY', heavy)")
    proc = run_or_fail([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout[-2000:]


def test_full_is_the_cpu_preset_and_quick_the_default():
    args = build_parser(["reproduce", "chemical"]).parse_args(["reproduce", "chemical", "--full"])
    assert args.preset == "cpu"
    args = build_parser(["reproduce", "chemical"]).parse_args(["reproduce", "chemical"])
    assert args.preset is None and args._default_preset == "quick"
    with pytest.raises(SystemExit):
        build_parser([]).parse_args(["reproduce", "chemical", "--quick", "--paper"])  # one preset only


@pytest.mark.slow
def test_quick_writes_under_results_quick_and_records_git(tmp_path):
    """The quick preset's default output is results/quick/, so it never overwrites the committed results."""
    proc = _hardeq("reproduce", "chemical", "--datasets", "plant", "--methods", "NN", "ours", "--seeds", "1",
                   "--epochs", "1", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "results" / "quick" / "chemical.json").exists()
    assert not (tmp_path / "results" / "chemical.json").exists()
    doc = json.loads((tmp_path / "results" / "quick" / "chemical.json").read_text())
    assert doc["environment"]["git"] == git_state()["git"] and doc["environment"]["dirty"] == git_state()["dirty"]
    assert doc["environment"]["git"] != "unknown" and isinstance(doc["environment"]["dirty"], bool)
    # `hardeq report` redraws the Markdown and figures from the JSON alone
    (tmp_path / "results" / "quick" / "chemical.md").unlink()
    assert main(["report", "chemical", "--out", str(tmp_path / "results" / "quick"), "--quiet"]) == 0
    assert "plant" in (tmp_path / "results" / "quick" / "chemical.md").read_text()


def test_runtime_errors_are_one_line_not_tracebacks(tmp_path, capsys):
    assert main(["reproduce", "chemical", "--paper", "--device", "cuda:0", "--out", str(tmp_path), "--quiet",
                 "--datasets", "plant", "--methods", "NN", "--seeds", "1", "--epochs", "1"]) in (0, 2)
    err = capsys.readouterr().err
    if err:
        assert err.count("\n") == 1 and "error:" in err and "CUDA" in err


def test_missing_dependency_names_the_extra():
    with pytest.raises(MissingDependency, match=r'pip install "hardeq-studies\[graphs\]"'):
        require("surely_not_an_installed_module_xyz", "graphs", purpose="graph batches")
    assert require("json", "none").dumps([]) == "[]"


def test_every_study_fulfils_the_contract():
    assert set(OURS) <= set(available())
    for name in OURS:
        study = load_study(name)
        assert study.name == name and set(study.presets) == {"quick", "cpu", "paper"}
        assert study.default_preset in study.presets
        assert callable(study.run) and callable(study.report)
    with pytest.raises(ValueError, match="unknown study"):
        load_study("nope")


def test_one_colour_per_method():
    chemical = load_study("chemical").config["methods"]
    assert len({color(m) for m in chemical}) == len(chemical)  # distinct within the study
    estimators = ["pathwise", "marginal_expectation", "constrained_marginal", "unconstrained_marginal",
                  "constrained_layer", "constrained_layer_independent", "constrained_reparam_independent", "random"]
    assert len({color(m) for m in estimators}) == len(estimators)
    assert all(color(m) == COLORS[m] for m in chemical + estimators)
    assert color("some-new-method") == color("some-new-method")  # stable for unknown names


def test_every_panel_uses_the_method_colour(tmp_path, monkeypatch):
    """The learning-curve figure draws each method in its palette colour in every panel, labels off-scale
    curves and puts integer ticks on the epoch axis."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from hardeq_studies.chemical.report import plot_curves

    drawn, texts, axes = [], [], []
    plot, text = Axes.plot, Axes.text

    def spy_plot(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), kwargs.get("color")))
        axes.append(self)
        return plot(self, *args, **kwargs)

    def spy_text(self, x, y, s, *args, **kwargs):
        texts.append(s)
        return text(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy_plot)
    monkeypatch.setattr(Axes, "text", spy_text)
    curves = {"cstr": {"NN": {"train": [1.0, 0.5, 0.4], "val": [1.0, 0.6, 0.5]},
                       "ours": {"train": [0.9, 0.4, 0.3], "val": [0.9, 0.5, 0.4], "val_log_var": [0.0, -1.0, -2.0]},
                       "PINN": {"train": [1e4, 1e5, 1e6], "val": [1e4, 1e5, 1e6]}}}
    plot_curves(curves, tmp_path)
    for label, c in drawn:
        method = label.split(" ")[0]
        assert c == color(method), (label, c)
    assert {label.split(" ")[0] for label, _ in drawn} == {"NN", "ours", "PINN"}
    assert any("PINN (off scale" in t for t in texts)
    ticks = axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)


def test_paired_wilcoxon():
    a, b = [1.0 + i for i in range(10)], [2.0 + 2 * i for i in range(10)]
    r = paired_wilcoxon(a, b)
    assert r["n"] == 10 and r["wins"] == 10 and r["p"] == pytest.approx(2 / 1024)  # exact: all ranks one way
    assert paired_wilcoxon(a, a)["p"] == 1.0
    with pytest.raises(ValueError, match="paired"):
        paired_wilcoxon([1.0, 2.0], [1.0])


def _exit_status(argv):
    """``main(argv)``'s exit status, whether it returns it or argparse raises ``SystemExit``."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv, needle", [
    (["reproduce", "chemical", "--device", "gpu"], "argument --device: 'gpu' is not a torch device"),
    (["reproduce", "chemical", "--out", "/proc/hardeq-cannot-write-here"], "argument --out: cannot write to"),
    (["reproduce", "chemical", "--config", "/nonexistent.json"], "argument --config: cannot read '/nonexistent.json'"),
    (["reproduce", "mof", "--graphs", "3"], "argument --graphs: must be at least"),
    (["report", "chemical", "--out", "/nonexistent-folder"], "chemical.json does not exist"),
])
def test_bad_arguments_give_one_line_and_exit_2_before_any_work(argv, needle, capsys, monkeypatch):
    from hardeq_studies import load_study

    for name in ("chemical", "mof"):
        monkeypatch.setattr(type(load_study(name)), "run", lambda self, args: pytest.fail("run() was called"))
    assert _exit_status(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_cuda_asked_for_but_absent_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    for argv in (["reproduce", "chemical", "--paper"], ["reproduce", "vae-latent", "--device", "cuda:0"]):
        assert _exit_status(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "CUDA is not available" in err and "--device cpu" in err, err


@pytest.mark.parametrize("study", ["portfolio", "vae-data", "vae-latent", "chemical"])
def test_missing_matplotlib_is_reported_before_training(study, capsys, monkeypatch, tmp_path):
    from hardeq_studies import load_study

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setattr(type(load_study(study)), "run", lambda self, args: pytest.fail("training started"))
    assert main(["reproduce", study, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'matplotlib' is needed" in err and 'pip install "hardeq-studies[' in err, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_report_says_what_it_wrote_and_claims_no_run(tmp_path, capsys):
    """``hardeq report`` rewrites the Markdown from the JSON; it neither writes nor claims to write the JSON."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "results" / "chemical.json"
    (tmp_path / "chemical.json").write_bytes(src.read_bytes())
    assert main(["report", "chemical", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("wrote ") and "chemical.md" in last and "(no training)" in last, last
    assert "chemical.json," not in out and " s\n" not in out
    assert (tmp_path / "chemical.json").read_bytes() == src.read_bytes()
