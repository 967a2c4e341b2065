"""ATen calls and host reads per call of the five hot paths of issue 39, with :func:`hardeq.testing.count_calls`.

Each path runs once to warm up (first-use caches: a constraint's per-``A`` constants), then once counted, on
freshly built distributions with ``validate_args=False``; the unconstrained reference is counted the same way.
Counts do not depend on the machine's speed (they are a property of the code path), so they are measured on the CPU.

    PYTHONPATH=src python benchmarks/count_calls.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.budget_cases import PATHS  # noqa: E402

from hardeq.testing import count_calls  # noqa: E402


def measure() -> dict[str, dict[str, int]]:
    rows = {}
    for name, (setup, run, reference) in PATHS.items():
        state = setup()
        run(state)  # warm-up
        with count_calls() as count:
            run(state)
        with count_calls() as ref:
            reference(state)
        rows[name] = {"calls": count.calls, "host_reads": count.host_reads, "ref_calls": ref.calls,
                      "ref_host_reads": ref.host_reads}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = measure()
    print("| path | ATen calls | host reads | unconstrained |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['calls']} | {r['host_reads']} | {r['ref_calls']} / {r['ref_host_reads']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
