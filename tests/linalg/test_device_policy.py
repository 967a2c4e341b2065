"""``hardeq.linalg.device``: the one module deciding what differs by device; both branches run on the CPU by
forcing the choice, and give the same exact samples."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.linalg import device as policy
from hardeq.linalg.conditioning import cholesky as factor_module
from hardeq.linalg.conditioning import fused as fused_module
from hardeq.testing import assert_exact_per_row

DTYPES = (torch.float32, torch.float64)


def test_profiles_by_device_kind_and_forcing():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert policy.profile(cpu).kind == "cpu" and policy.profile(meta).kind == "gpu"
    assert policy.profile(cpu).chunked and policy.profile(cpu).host_guards and policy.profile(cpu).blocked_drivers
    gpu = policy.profile(meta)
    assert not (gpu.chunked or gpu.host_guards or gpu.blocked_drivers)
    with policy.forced("gpu"):
        assert policy.profile(cpu) == gpu
        with policy.forced("cpu"):
            assert policy.profile(meta).kind == "cpu"
        assert policy.profile(cpu) == gpu
    assert policy.profile(cpu).kind == "cpu"
    with pytest.raises(ValueError, match="kind must be one of"):
        with policy.forced("tpu"):
            pass


def test_chunking_follows_the_profile():
    n = 100_000
    assert policy.rows_per_chunk(64, n, 8, torch.device("cpu")) == max(8, policy.CHUNK_ELEMS // n)
    with policy.forced("gpu"):
        assert policy.rows_per_chunk(64, n, 8, torch.device("cpu")) == 64
        assert fused_module._screen_columns(n, torch.float32, torch.device("cpu")) == (None, 1.0)
    assert fused_module._screen_columns(n, torch.float32, torch.device("cpu"))[0] == n // fused_module.SCREEN_FRACTION


@pytest.mark.cpu_only(reason="forces the CPU's choices against the GPU's on CPU tensors")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_both_branches_sample_exactly(kind, dtype, monkeypatch):
    """Per-sample scales and a shared dense A large enough for the blocked Gram-Cholesky on the CPU branch: the
    GPU branch factorises S by the vendor's Cholesky (equilibrated: ``d`` set), samples in one chunk without the
    screen, and gives the CPU branch's values (same noise stream) to round-off, exact per row either way."""
    monkeypatch.setattr(factor_module, "BLOCKED_MIN_ROWS", 8)
    monkeypatch.setattr(fused_module, "FUSED_CHUNK_ELEMS", 4 * 5000)
    g = torch.Generator().manual_seed(3)
    B, n, a = 12, 5000, 8
    A = torch.randn(a, n, generator=g, dtype=dtype)
    loc, scale = torch.randn(B, n, generator=g, dtype=dtype), 0.5 + torch.rand(B, n, generator=g, dtype=dtype)
    k = torch.randn(B, a, generator=g, dtype=dtype)
    shared = hardeq.ConstrainedNormal(loc[0], scale[0], constraint=hardeq.LinearConstraint(A, k[0]))
    out = {}
    for branch in ("cpu", kind):
        with policy.forced(branch):
            d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k))
            torch.manual_seed(0)
            out[branch] = d.sample()
            assert_exact_per_row(d.constraint, out[branch])
            cond = shared.conditioner if branch == "cpu" else hardeq.ConstrainedNormal(
                loc[0], scale[0], constraint=hardeq.LinearConstraint(A, k[0])).conditioner
            assert (cond.factor.d is None) == (branch == "cpu" and cond.method == "cholesky")  # blocked: no D
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(out[kind], out["cpu"], rtol=tol, atol=tol * float(out["cpu"].abs().amax()))


def test_no_file_of_the_conditioning_package_is_over_400_lines():
    from pathlib import Path

    import hardeq.linalg.conditioning as package

    sizes = {p.name: len(p.read_text().splitlines()) for p in Path(package.__file__).parent.glob("*.py")}
    assert max(sizes.values()) <= 400, sizes
