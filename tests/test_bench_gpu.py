"""``benchmarks/bench_gpu.py`` (run by ``benchmarks/gpu.sh`` on a GPU) works end to end: ``--smoke`` on the suite's
device writes its JSON and markdown with every target measured; the pieces of the test and study phases."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from tests.device import device

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_json_and_markdown(bench, tmp_path):
    doc = bench.main(["--smoke", "--device", device().type, "--out", str(tmp_path)])
    stem = bench.slug(doc["device"])
    saved = json.loads((tmp_path / f"{stem}.json").read_text())
    table = (tmp_path / f"{stem}.md").read_text()
    assert saved["device"] == doc["device"] and saved["smoke"] is True and "tests" not in saved
    cases = [r["case"] for r in saved["targets"]]
    assert cases == ["B", "C", "C", "D", "sparse"]
    for row in saved["targets"]:
        assert "error" not in row, row
        assert row["hardeq"] > 0 and row["repeats"] >= 3
        assert row["residual"] <= 1e-5, row  # every sample meets every row (float32 criterion)
    assert [r["batch"] for r in saved["targets"] if r["case"] == "C"] == [2, 4]
    assert table.startswith(f"# GPU path: {doc['device']}") and table.count("\n| ") == 1 + len(cases)


def test_a_failing_case_is_recorded_not_fatal(bench):
    def boom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB\nmore")
    assert bench._guarded("C", boom) == {"case": "C", "error": "RuntimeError: CUDA out of memory. Tried to allocate "
                                                               "2 GiB"}


def test_pytest_summary_is_parsed(bench):
    text = "....\nFAILED tests/x.py::t\n3 failed, 2400 passed, 12 skipped, 1 error in 201.5s\n"
    assert bench.parse_pytest_summary(text) == {"failed": 3, "passed": 2400, "skipped": 12, "errors": 1}
    assert bench.parse_pytest_summary("no summary") == {}


def test_phase_commands(bench, tmp_path):
    assert bench.pytest_command("cuda")[1:5] == ["-m", "pytest", "--device", "cuda"]
    assert bench.pytest_command("cuda", 8)[-3:] == ["-n", "8", str(ROOT / "tests")]
    cmd = bench.study_command("cuda", 300, tmp_path)
    assert cmd[1:10] == ["-m", "hardeq_studies", "reproduce", "mof", "--preset", "paper", "--device", "cuda",
                         "--splits"]
    assert "--steps" in cmd and cmd[cmd.index("--steps") + 1] == "300"
    assert bench.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_gpu_sh_refuses_without_cuda(bench):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the script would run the whole benchmark")
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "torch.cuda.is_available() is False" in out.stderr


def test_study_markdown_reads_the_study_timing(bench):
    doc = {"device": "x", "machine": {}, "command": "c", "seconds": 1.0, "targets": [],
           "study": {"command": "hardeq reproduce mof", "returncode": 0, "wall_s": 60.0, "steps_asked": 300,
                     "wall_s_per_step": 0.2, "train_s": 30.0, "steps_taken": 300, "train_s_per_step": 0.1}}
    assert "100.0 ms per optimiser step" in bench.markdown(doc)


def test_profile_script_counts_launches_and_syncs(tmp_path):
    """``benchmarks/profile_gpu.py --smoke`` profiles the four cases on the suite's device and writes both files."""
    spec = importlib.util.spec_from_file_location("profile_gpu", ROOT / "benchmarks" / "profile_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    records = module.main(["--device", device().type, "--smoke", "--calls", "2", "--rows", "5", "--out",
                           str(tmp_path)])
    assert [r["case"] for r in records] == ["B", "C16", "D", "sparse"]
    for r in records:
        assert r["calls"] == 2 and "Self CPU" in r["cpu_table"] and isinstance(r["syncs_per_call"], dict)
    assert json.loads((tmp_path / "profile.json").read_text())[0]["case"] == "B"
    assert (tmp_path / "profile.txt").read_text().startswith("== B:")
