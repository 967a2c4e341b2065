"""The Gibbs sweep makes no host read: the reads of a blocked_gibbs call do not grow with its sweeps, counted with a
TorchFunctionMode over the functions tests/host_sync.py names; and the ATen calls per sweep (views excluded), counted
with a TorchDispatchMode, stay below a regression bound (measured 130-133 at n = 50, batch 32, 4 chains)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hardeq
from hardeq.bounds import blocked_gibbs, truncated_mode

from ..host_sync import _ALWAYS

F = torch.float64
VIEWS = {"aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::permute",
         "aten::transpose", "aten::t", "aten::alias", "aten::detach", "aten::as_strided", "aten::unbind",
         "aten::split", "aten::_reshape_alias", "aten::reshape", "aten::flatten", "aten::movedim", "aten::diagonal"}


class _ATen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if "view" not in name and name not in VIEWS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _ALWAYS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["sum", "dense", "lowrank"])
def test_sweeps_make_no_host_reads(kind):
    n, batch = 50, 32
    g = torch.Generator().manual_seed(0)
    loc = torch.randn(batch, n, generator=g, dtype=F) * 0.3 - 0.2
    con = (hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.ones(batch, 1, dtype=F)) if kind == "sum"
           else hardeq.LinearConstraint(torch.ones(1, n, dtype=F), torch.ones(batch, 1, dtype=F)))
    extra = {"cov_factor": torch.randn(n, 2, generator=g, dtype=F) * 0.1} if kind == "lowrank" else {}
    d = hardeq.ConstrainedNormal(loc, 0.3, constraint=con, **extra)
    lo, hi = torch.zeros(batch, n, dtype=F), torch.ones(batch, n, dtype=F)
    start = truncated_mode(d, lo, hi).expand(4, batch, n).contiguous()
    counts = {}
    for sweeps in (10, 30):
        aten, reads = _ATen(), _Reads()
        with reads, aten:
            blocked_gibbs(d, lo, hi, start, num_samples=1, burn_in=sweeps - 1,
                          generator=torch.Generator().manual_seed(1))
        counts[sweeps] = (aten.calls, reads.reads)
    assert counts[30][1] == counts[10][1], counts      # host reads per call, independent of the sweeps
    per_sweep = (counts[30][0] - counts[10][0]) / 20
    assert per_sweep <= 170, per_sweep
