"""Provenance: checkpoints record the code that wrote them and ``--resume`` refuses other code with a reason;
committed presets (cpu, paper) are not written from a dirty tree unless ``--allow-dirty``, which the JSON
records."""

from __future__ import annotations

import json

import pytest
import torch

from hardeq_studies import results
from hardeq_studies.cli import main
from hardeq_studies.harness import (atomic_torch_save, code_fingerprint, code_mismatch, code_stamp, fingerprint,
                                    load_checkpoint, run_blocks)
from hardeq_studies.harness.checkpoint import CODE_KEY

OTHER_CODE = {"code": "0123456789abcdef", "git": "f" * 40, "dirty": True}


def test_code_fingerprint_follows_the_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "fp_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "config.json").write_text("{}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = code_fingerprint(("fp_probe_pkg",))
    code_fingerprint.cache_clear()
    assert code_fingerprint(("fp_probe_pkg",)) == first  # deterministic
    (pkg / "config.json").write_text('{"lr": 2}\n')
    code_fingerprint.cache_clear()
    second = code_fingerprint(("fp_probe_pkg",))
    (pkg / "__init__.py").write_text("X = 2\n")
    code_fingerprint.cache_clear()
    third = code_fingerprint(("fp_probe_pkg",))
    code_fingerprint.cache_clear()
    assert len({first, second, third}) == 3
    assert code_fingerprint() == code_stamp()["code"]  # the default covers hardeq and hardeq_studies


def test_checkpoints_are_stamped_and_fingerprints_cover_the_code(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    atomic_torch_save({"fingerprint": fingerprint({"lr": 1}), "x": torch.ones(2)}, path)
    ck = load_checkpoint(path)
    assert ck[CODE_KEY] == code_stamp() and code_mismatch(ck) is None
    assert code_mismatch({**ck, CODE_KEY: OTHER_CODE}).startswith("was written by other code: code 0123456789abcdef")
    assert "records no code fingerprint" in code_mismatch({"fingerprint": "x"})
    same = fingerprint({"lr": 1})
    monkeypatch.setattr("hardeq_studies.harness.checkpoint.code_fingerprint", lambda: "another code version")
    assert fingerprint({"lr": 1}) != same  # same settings, other code: another run


def test_run_blocks_refuses_to_resume_from_other_code(tmp_path):
    path = tmp_path / "blocks.pt"
    blocks = {"a": lambda: 1, "b": lambda: 2}
    assert run_blocks(blocks, checkpoint_path=path, run_id="r") == {"a": 1, "b": 2}
    assert run_blocks(blocks, checkpoint_path=path, run_id="r", resume=True) == {"a": 1, "b": 2}
    ck = load_checkpoint(path)
    atomic_torch_save({**ck, CODE_KEY: OTHER_CODE}, path)
    with pytest.raises(ValueError, match="was written by other code.*resuming would mix two versions"):
        run_blocks(blocks, checkpoint_path=path, run_id="r", resume=True)


def test_cli_resume_refuses_a_checkpoint_of_other_code_before_any_work(tmp_path, capsys, monkeypatch):
    from hardeq_studies import load_study

    monkeypatch.setattr(type(load_study("synthetic")), "run", lambda self, args: pytest.fail("run() was called"))
    stale = {"fingerprint": "x", "blocks": {}, CODE_KEY: OTHER_CODE}
    atomic_torch_save(stale, tmp_path / "checkpoints" / "synthetic.pt")
    assert main(["reproduce", "synthetic", "--out", str(tmp_path), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume: checkpoint" in err and "other code" in err, err
    assert "commit ffffffffffff with uncommitted changes" in err


def _dirty(monkeypatch, dirty: bool) -> None:
    monkeypatch.setattr(results, "git_state", lambda: {"git": "a" * 40, "dirty": dirty})


@pytest.mark.parametrize("preset", ["cpu", "paper"])
def test_committed_presets_are_refused_from_a_dirty_tree(preset, tmp_path, capsys, monkeypatch):
    from hardeq_studies import load_study

    _dirty(monkeypatch, True)
    monkeypatch.setattr(type(load_study("synthetic")), "run", lambda self, args: pytest.fail("run() was called"))
    assert main(["reproduce", "synthetic", "--preset", preset, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "uncommitted changes" in err and "--allow-dirty" in err, err
    with pytest.raises(ValueError, match="not written: the working tree has uncommitted changes"):
        results.write_json(tmp_path / "s.json", "synthetic", preset, {}, [])
    assert not (tmp_path / "s.json").exists()


def test_allow_dirty_is_recorded_and_quick_results_are_never_refused(tmp_path, monkeypatch):
    _dirty(monkeypatch, True)
    doc = results.write_json(tmp_path / "q.json", "synthetic", "quick", {}, [])
    assert doc["environment"]["dirty"] is True and "allow_dirty" not in doc["environment"]
    results.allow_dirty(True)
    try:
        doc = results.write_json(tmp_path / "c.json", "synthetic", "cpu", {}, [])
    finally:
        results.allow_dirty(False)
    written = json.loads((tmp_path / "c.json").read_text())
    assert written["environment"]["allow_dirty"] is True and written["environment"]["dirty"] is True
    assert written["environment"]["git"] == "a" * 40 and written["environment"]["code"] == code_fingerprint()
    _dirty(monkeypatch, False)
    doc = results.write_json(tmp_path / "clean.json", "synthetic", "cpu", {}, [])
    assert "allow_dirty" not in doc["environment"]


def test_dirty_ignores_the_results_folder():
    """Writing one study's results must not make the next study's tree dirty."""
    import subprocess
    from pathlib import Path

    root = Path(results.__file__).resolve().parent
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, cwd=root)
    if top.returncode != 0:
        pytest.skip("not a git checkout")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                            cwd=root).stdout
    outside = [line for line in status.splitlines() if not line[3:].startswith("results/")]
    assert results.git_state()["dirty"] is bool(outside)
