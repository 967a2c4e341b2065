#!/usr/bin/env bash
# The GPU path, measured (issue "Speed v4"): on one CUDA GPU, in under 10 minutes,
#   1. the targets B, C (the heavy case, batch 16 and 256), D and sparse on the GPU against their baselines,
#   2. the library tests on CUDA (python -m pytest --device cuda -q, over pytest-xdist workers when installed),
#   3. one paper-preset study (mof, one split, the likelihood group) for 300 optimiser steps, to time a step;
# then writes benchmarks/results/gpu/<device>.json, <device>.md and <device>-tests.log (see benchmarks/bench_gpu.py).
# This checkout's src/ and studies/ come first on PYTHONPATH, so nothing needs installing beyond torch, numpy,
# pytest, hypothesis, scipy, mpmath (and torch_geometric for the study).
#
# Usage (from anywhere, with the project's environment active or PYTHON set):
#   benchmarks/gpu.sh                       # everything
#   benchmarks/gpu.sh --skip-study          # extra arguments go to bench_gpu.py
# Without a GPU it stops with a message; `python benchmarks/bench_gpu.py --smoke --device cpu` checks the driver.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$PWD/src:$PWD/studies${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "benchmarks/gpu.sh: torch.cuda.is_available() is False for $PYTHON; run it on a machine with a CUDA GPU" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec timeout 570 "$PYTHON" benchmarks/bench_gpu.py --device cuda "$@"
