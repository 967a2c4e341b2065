"""The sync-free sample of a ``SumConstraint`` (``hardeq.linalg.conditioning.grouped_exact``, the GPU profile's
``validate_args=False`` path): exact per group by construction (float64 step and a repair), groups of one set to
their total, gradients of the closed form against a float64 autograd oracle, no host read, and a non-finite sample
raises naming the group."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.linalg.conditioning import grouped_exact
from hardeq.linalg.device import forced
from hardeq.testing import assert_exact_per_row, count_calls

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
SIZES = [1, 3, 1, 50, 7, 1200, 2]  # groups of one, small and one longer than a segment chunk (1024)


def _index(layout: str, g: torch.Generator) -> tuple[torch.Tensor, int]:
    if layout == "blocks":
        return torch.arange(4).repeat_interleave(30), 4
    index = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    if layout == "unsorted":
        index = index[torch.randperm(index.numel(), generator=g)]
    return index, len(SIZES)


def _oracle(index, a, loc, scale, k, eps, weights):
    """The Matheron step written out in float64 autograd: ``z = z_hat + v A^T((k - A z_hat) / s)``."""
    loc, scale, k = (t.detach().double().requires_grad_() for t in (loc, scale, k))
    z_hat, v = loc + scale * eps.double(), scale.square()
    s = torch.zeros(v.shape[:-1] + (a,), dtype=torch.float64).index_add(-1, index, v)
    r = torch.zeros(z_hat.shape[:-1] + (a,), dtype=torch.float64).index_add(-1, index, z_hat)
    z = z_hat + v * ((k - r) / s).index_select(-1, index)
    return torch.autograd.grad((z * weights.double()).sum(), (loc, scale, k))


@pytest.mark.cpu_only(reason="the GPU profile forced on CPU tensors")
@pytest.mark.parametrize("layout", ["segments", "unsorted", "blocks"])
@DTYPES
def test_values_gradients_and_no_host_read(layout, dtype):
    g = torch.Generator().manual_seed(1)
    index, a = _index(layout, g)
    n = index.numel()
    loc = torch.randn(2, n, generator=g, dtype=dtype).requires_grad_()
    scale = (0.5 + torch.rand(n, generator=g, dtype=dtype)).requires_grad_()  # (shared over the batch)
    k = torch.randn(2, a, generator=g, dtype=dtype).requires_grad_()
    eps = torch.randn(3, 2, n, generator=g, dtype=dtype)
    weights = torch.randn(3, 2, n, generator=g, dtype=dtype)
    con = hardeq.SumConstraint(index, k, validate_args=False)
    d = hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False)
    with forced("gpu"):
        d.rsample((3,), noise=eps)  # (the index's layout at its first uses)
        with count_calls() as count:
            z = d.rsample((3,), noise=eps)
            grads = torch.autograd.grad((z * weights).sum(), (loc, scale, k))
    assert count.host_reads == 0, dict(count.host_read_names)
    assert_exact_per_row(con, z.detach())
    singles = [i for i, size in enumerate(SIZES) if size == 1] if layout != "blocks" else []
    for group in singles:  # a group of one returns its total
        member = int((index == group).nonzero())
        assert torch.equal(z[..., member].detach(), k[:, group].detach().expand(3, 2))
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for got, want in zip(grads, _oracle(index, a, loc, scale, k, eps, weights)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.cpu_only(reason="the GPU profile forced on CPU tensors")
@pytest.mark.parametrize("centre,spread", [(1e3, 1e-6), (1e8, 1.0), (-3e4, 1e-5), (1e20, 1e-3)])
@DTYPES
def test_far_from_the_plane_with_total_cancellation_is_exact(centre, spread, dtype):
    """loc far off the plane against a tiny scale: the conditioned draw is many orders below the unconditioned
    one (where a single rounded step leaves garbage of the size of loc's round-off): the repair makes every row
    exact, a group of one its total (also a total far below loc, 1e-30)."""
    index = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 1, 300]))
    loc = torch.full((306,), centre, dtype=dtype) * torch.linspace(0.5, 1.5, 306, dtype=dtype)
    scale = torch.full((306,), spread, dtype=dtype).requires_grad_()
    for k in (torch.zeros(3, dtype=dtype), torch.tensor([1e-30, 2.0, -1e-3], dtype=dtype)):
        con = hardeq.SumConstraint(index, k, validate_args=False)
        with forced("gpu"):
            z = hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False).rsample((4,))
        assert_exact_per_row(con, z.detach())
        assert torch.equal(z[:, 5].detach(), k[1].expand(4))


@pytest.mark.cpu_only(reason="the deferred assertion raises at once on the CPU")
@pytest.mark.parametrize("where", ["loc", "scale"])
def test_a_non_finite_sample_raises_naming_the_group(where):
    index = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 2, 3]))
    loc, scale = torch.randn(10), torch.ones(10)
    if where == "loc":
        loc[6] = float("nan")
    else:
        scale[5:7] = 1e-30  # squares underflow float32: the group's Gram entry is 0
    con = hardeq.SumConstraint(index, torch.zeros(3), validate_args=False)
    d = hardeq.ConstrainedNormal(loc, scale.requires_grad_(), constraint=con, validate_args=False)
    with forced("gpu"), pytest.raises(hardeq.NotPSDError, match="not finite.*group: 1 of 3"):
        d.rsample()


@pytest.mark.cpu_only(reason="the GPU profile forced on CPU tensors")
def test_the_path_is_taken_and_a_second_derivative_raises(monkeypatch):
    spy = []
    original = grouped_exact._ExactSumSample.forward
    monkeypatch.setattr(grouped_exact._ExactSumSample, "forward", staticmethod(
        lambda *args: spy.append(1) or original(*args)))
    index = torch.tensor([0, 0, 1, 1, 1])
    scale = torch.ones(5, dtype=torch.float64, requires_grad=True)
    con = hardeq.SumConstraint(index, torch.tensor([1.0, 2.0], dtype=torch.float64), validate_args=False)
    with forced("gpu"):
        z = hardeq.ConstrainedNormal(torch.zeros(5, dtype=torch.float64), scale, constraint=con,
                                     validate_args=False).rsample()
    assert spy == [1]
    (grad,) = torch.autograd.grad(z.square().sum(), scale, create_graph=True)
    with pytest.raises(RuntimeError):  # never a silently wrong second derivative
        grad.sum().backward()
