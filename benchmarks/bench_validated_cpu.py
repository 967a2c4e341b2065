"""CPU time of issue 39's cases B, C and D with ``validate_args=True`` (constraint and distribution validated), for
comparing sources one after another, and the device profiles (``--profile gpu`` runs a GPU's choices on the CPU: the
sync-free sampler after the one-read input checks).

B: n 1e5, a 8, batch 64, construct + ``sample()``; C: n 2048, a 1024, batch 16, construct + ``sample()``; D: 128 ragged
graphs, construct + ``rsample`` + squared loss + ``backward``. Medians of 15 calls (5 for C), the best of two rounds,
1 thread. E.g.

    PYTHONPATH=/path/to/old/src python benchmarks/bench_validated_cpu.py old
    PYTHONPATH=src python benchmarks/bench_validated_cpu.py new [--profile gpu]
"""

import argparse
import contextlib
import time

import torch

import hardeq

torch.set_num_threads(1)


def med(fn, reps=15):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


g = torch.Generator().manual_seed(0)
B, n, a = 64, 100_000, 8
loc = torch.randn(B, n, generator=g)
scale = 0.5 + torch.rand(B, n, generator=g)
A = torch.randn(a, n, generator=g)
k = torch.randn(B, a, generator=g)


def b():
    hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=True),
                             validate_args=True).sample()


sizes = torch.randint(1, 156, (128,), generator=g)
batch = torch.repeat_interleave(torch.arange(128), sizes)
N = batch.numel()
dl = torch.randn(N, generator=g).requires_grad_()
ds = (torch.rand(N, generator=g) + 0.5).requires_grad_()
tot = torch.randn(128, generator=g)
tgt = torch.randn(N)


def d():
    con = hardeq.SumConstraint(batch, tot, validate_args=True)
    ((hardeq.ConstrainedNormal(dl, ds, constraint=con, validate_args=True).rsample() - tgt) ** 2).sum().backward()


Cn, Ca, CB = 2048, 1024, 16
cl = torch.randn(CB, Cn, generator=g)
cs = 0.5 + torch.rand(CB, Cn, generator=g)
CA = torch.randn(Ca, Cn, generator=g) / Cn ** 0.5
ck = torch.randn(CB, Ca, generator=g)


def c():
    hardeq.ConstrainedNormal(cl, cs, constraint=hardeq.LinearConstraint(CA, ck, validate_args=True),
                             validate_args=True).sample()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("label", nargs="?", default="this source")
    parser.add_argument("--profile", choices=("gpu", "cpu"), default=None,
                        help="force a device profile (hardeq.linalg.device.forced; default: the CPU's own)")
    args = parser.parse_args()
    if args.profile is None:
        context = contextlib.nullcontext()
    else:
        from hardeq.linalg.device import forced

        context = forced(args.profile)
    out = {}
    with context:
        for _ in range(2):
            for name, fn in [("b", b), ("d", d), ("c", c)]:
                out.setdefault(name, []).append(med(fn, 5 if name == "c" else 15))
    res = {key: min(v) for key, v in out.items()}
    print(args.label, {key: f"{v * 1e3:.2f}ms" for key, v in res.items()})
