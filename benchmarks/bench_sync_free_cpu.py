"""CPU time of issue 39's cases B, C and D with ``validate_args=False``, for comparing sources one after another.

B: n 1e5, a 8, batch 64, construct + ``sample()`` (and the unconstrained draw ``loc + scale * randn``); C: n 2048,
a 1024, batch 16, construct + ``sample()``; D: 128 ragged graphs, ``rsample`` + squared loss + ``backward``, with
``validate_args=False`` (``d``) and with default validation (``dv``), and the unconstrained step (``d0``). Medians
of 15 calls (5 for C), the best of two rounds, 1 thread. Run it on two sources one after the other, e.g.

    PYTHONPATH=/path/to/old/src python benchmarks/bench_sync_free_cpu.py old
    PYTHONPATH=src python benchmarks/bench_sync_free_cpu.py new
"""

import sys
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
    hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=False),
                             validate_args=False).sample()


def b0():
    loc + scale * torch.randn(B, n)


sizes = torch.randint(1, 156, (128,), generator=g)
batch = torch.repeat_interleave(torch.arange(128), sizes)
N = batch.numel()
dl = torch.randn(N, generator=g).requires_grad_()
ds = (torch.rand(N, generator=g) + 0.5).requires_grad_()
tot = torch.randn(128, generator=g)
tgt = torch.randn(N)


def d():
    con = hardeq.SumConstraint(batch, tot, validate_args=False)
    ((hardeq.ConstrainedNormal(dl, ds, constraint=con, validate_args=False).rsample() - tgt) ** 2).sum().backward()


def dv():
    con = hardeq.SumConstraint(batch, tot)
    ((hardeq.ConstrainedNormal(dl, ds, constraint=con).rsample() - tgt) ** 2).sum().backward()


def d0():
    ((dl + ds * torch.randn(N) - tgt) ** 2).sum().backward()


Cn, Ca, CB = 2048, 1024, 16
cl = torch.randn(CB, Cn, generator=g)
cs = 0.5 + torch.rand(CB, Cn, generator=g)
CA = torch.randn(Ca, Cn, generator=g) / Cn ** 0.5
ck = torch.randn(CB, Ca, generator=g)


def c():
    hardeq.ConstrainedNormal(cl, cs, constraint=hardeq.LinearConstraint(CA, ck, validate_args=False),
                             validate_args=False).sample()


if __name__ == "__main__":
    out = {}
    for _ in range(2):
        for name, fn in [("b0", b0), ("b", b), ("d0", d0), ("d", d), ("dv", dv), ("c", c)]:
            out.setdefault(name, []).append(med(fn, 5 if name == "c" else 15))
    res = {key: min(v) for key, v in out.items()}
    label = sys.argv[1] if len(sys.argv) > 1 else "this source"
    print(label, {key: f"{v * 1e3:.2f}ms" for key, v in res.items()},
          "B ratio %.2f  D ratio %.2f  D validated %.2f" % (res["b"] / res["b0"], res["d"] / res["d0"],
                                                           res["dv"] / res["d0"]))
