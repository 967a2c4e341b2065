"""ATen calls and host reads per call of the five hot paths of issue 39, with :func:`hardeq.testing.count_calls`.

Each path runs twice to warm up (first-use caches: a constraint's per-``A`` constants, a ``SumConstraint``'s layout
of its index, laid out at the first two uses of an index tensor), then once counted, on freshly built distributions
with ``validate_args=False`` (the steady state of a training loop that reuses its ``A`` / index tensors); the
unconstrained reference is counted the same way. The last row is D with a new index tensor every step (a PyG
``DataLoader``), whose layout costs a host read.
Counts do not depend on the machine's speed (they are a property of the code path), so they are measured on the CPU,
by default with the GPU's choices (``hardeq.linalg.device.forced("gpu")``: ``validate_args=False`` takes the
sync-free static path there); ``--profile cpu`` counts the CPU's own choices (the checked path, whose host reads
synchronise nothing on a CPU).

    PYTHONPATH=src python benchmarks/count_calls.py [--profile gpu|cpu] [--json out.json] [--validated]

``--validated`` counts instead each call of the validated path (``validate_args=True`` on the constraint and the
distribution): building the constraint, building the distribution, and the method, after two warm-ups
(``tests/test_validated_reads.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.budget_cases import PATHS, d_run, d_setup  # noqa: E402

D = "D ragged SumConstraint, 128 graphs: rsample + backward"

from hardeq.linalg.device import forced  # noqa: E402
from hardeq.testing import count_calls  # noqa: E402


def measure() -> dict[str, dict[str, int]]:
    rows = {}
    for name, (setup, run, reference) in PATHS.items():
        state = setup()
        run(state)  # warm-up (twice: an index tensor is laid out at its first two uses)
        run(state)
        with count_calls() as count:
            run(state)
        with count_calls() as ref:
            reference(state)
        rows[name] = {"calls": count.calls, "host_reads": count.host_reads, "ref_calls": ref.calls,
                      "ref_host_reads": ref.host_reads}
    state = d_setup()
    d_run(state)
    state["batch"] = state["batch"].clone()  # a new batch vector, as a DataLoader gives
    with count_calls() as count:
        d_run(state)
    rows["D, a new index tensor each step"] = {"calls": count.calls, "host_reads": count.host_reads,
                                               "ref_calls": rows[D]["ref_calls"], "ref_host_reads": 0}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", choices=("gpu", "cpu"), default="gpu",
                        help="the device profile whose choices run (default: a GPU's, on this CPU)")
    parser.add_argument("--validated", action="store_true", help="count each call of the validated path")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.validated:
        from tests.test_validated_reads import CASES, _counted

        with forced(args.profile):
            counted = {name: _counted(*case) for name, case in CASES.items()}
        print("| path (validate_args=True) | constraint: calls / host reads | distribution | method |")
        print("|---|---|---|---|")
        for name, r in counted.items():
            print(f"| {name} | " + " | ".join(f"{c.calls} / {c.host_reads}" for c in r.values()) + " |")
        return
    with forced(args.profile):
        rows = measure()
    print("| path | ATen calls | host reads | unconstrained |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['calls']} | {r['host_reads']} | {r['ref_calls']} / {r['ref_host_reads']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
