"""``hardeq.testing.count_calls``: counts every computing ATen call, not views, allocations or metadata, and
counts each kind of host read."""

from __future__ import annotations

import pytest
import torch

from hardeq.testing import CallCount, count_calls


def test_counts_computing_calls_and_skips_views_and_allocations():
    x = torch.randn(4, 3)
    with count_calls() as count:
        y = x.view(3, 4).t().unsqueeze(0).expand(2, 4, 3)[:, 1]  # views only
        torch.empty(5)
        torch.empty_like(x)
        x.new_empty(3)
        x.shape, x.dim(), x.numel()
    assert isinstance(count, CallCount)
    assert (count.calls, count.host_reads) == (0, 0), count.by_name
    with count_calls() as count:
        z = (y * 2).sum(-1)
        torch.mm(x, x.t())
        x.add_(1.0)
    assert count.calls == 4 and count.host_reads == 0
    assert count.by_name == {"mul": 1, "sum": 1, "mm": 1, "add_": 1}
    assert str(count) == "4 ATen calls, 0 host reads"
    assert z.shape == (2,)


def test_counts_the_backward_pass():
    x = torch.randn(5, requires_grad=True)
    with count_calls() as count:
        (x * x).sum().backward()
    assert count.calls >= 4 and count.host_reads == 0  # forward mul, sum; backward expand/ones, mul, add
    assert x.grad is not None


@pytest.mark.parametrize("call,name", [
    (lambda x: x.sum().item(), "_local_scalar_dense"), (lambda x: float(x.sum()), "_local_scalar_dense"),
    (lambda x: int(x.argmax()), "_local_scalar_dense"), (lambda x: x.tolist(), "tolist"),
    (lambda x: bool(x.sum() > 0), "_local_scalar_dense"), (lambda x: torch.is_nonzero(x[:1].sum()), None),
    (lambda x: torch.equal(x, x), "equal"), (lambda x: torch.nonzero(x > 0), "nonzero"),
    (lambda x: torch.unique(x), None), (lambda x: torch.masked_select(x, x > 0), "masked_select"),
    (lambda x: x[x > 0], "index"), (lambda x: x.repeat_interleave(torch.ones(5, dtype=torch.long)), None),
], ids=["item", "float", "int", "tolist", "bool", "is_nonzero", "equal", "nonzero", "unique", "masked_select",
        "bool_mask_index", "repeat_interleave"])
def test_counts_host_reads(call, name):
    x = torch.randn(5)
    with count_calls() as count:
        call(x)
    assert count.host_reads >= 1, count.by_name
    if name is not None:
        assert count.host_read_names[name] >= 1
    assert count.calls >= count.host_reads


def test_device_work_makes_no_host_read():
    x = torch.randn(5, 5, dtype=torch.float64)
    with count_calls() as count:
        S = x @ x.mT + torch.eye(5, dtype=x.dtype)
        L = torch.linalg.cholesky_ex(S).L
        torch.where(x > 0, x, 0.0).sum(-1) + torch.cholesky_solve(x, L).amax()
        x[torch.tensor([0, 2])]  # an integer index reads nothing
    assert count.host_reads == 0, count.host_read_names
    assert count.calls >= 7
