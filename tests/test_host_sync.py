"""No host synchronisation on the hot paths: what lets them run in a CUDA graph, tested on any device.

The static path -- the conditioner ``ConstrainedNormal(..., validate_args=False)`` builds under ``torch.compile``, a
``torch.func`` transform or CUDA-graph capture (``hardeq._utils.is_tracing``) -- and the grouped path
(``SumConstraint``) in it: construct the constraint and the distribution, ``rsample`` (with a gradient),
``sample``, ``log_prob``, ``entropy`` and ``backward``. :class:`tests.host_sync.forbid_host_sync` fails on any
``item``/``bool``/``nonzero``/boolean-mask/host-copy/checking-``cholesky`` call inside the block; under
``--device cuda`` torch's own ``set_sync_debug_mode("error")`` is on as well. The capture branch of ``is_tracing``
is switched on by patching ``hardeq._utils.cuda_graph_capturing`` (on a GPU, ``tests/test_cuda_graphs.py`` captures
for real). The results are then checked against the default (validated, checked) path on the same noise.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import hardeq
import hardeq._utils
from hardeq.linalg.conditioning import Conditioner
from hardeq.linalg.covariance import DiagonalCovariance
from hardeq.testing import assert_exact_per_row
from tests.device import device
from tests.host_sync import HostSyncError, forbid_host_sync
from tests.static_cases import HOT_PATHS, build, hot_inputs

DTYPES = [torch.float32, torch.float64]
#: static vs checked path on the same noise: the two differ by the refinement schedule only (round-off)
RTOL = {torch.float32: 2e-4, torch.float64: 1e-9}


@pytest.fixture
def static_regime(monkeypatch):
    """``is_tracing()`` is true, as while a CUDA graph is being captured."""
    monkeypatch.setattr(hardeq._utils, "cuda_graph_capturing", lambda: True)


@contextlib.contextmanager
def no_host_sync():
    """:func:`forbid_host_sync`, and torch's CUDA sync check when the suite runs on CUDA."""
    cuda = device().type == "cuda"
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    with forbid_host_sync() as guard:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield guard
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.parametrize("call", [
    lambda x: x.sum().item(), lambda x: bool(x.sum() > 0), lambda x: x[x > 0], lambda x: torch.nonzero(x),
    lambda x: x.tolist(), lambda x: x.cpu(), lambda x: x.to("cpu"), lambda x: int(x.argmax()),
    lambda x: f"{x.sum():.3f}", lambda x: torch.unique(x), lambda x: torch.equal(x, x),
    lambda x: torch.linalg.cholesky(torch.eye(2, dtype=x.dtype) + 0 * x[:2, None]),
    lambda x: torch.linalg.cholesky_ex(torch.eye(2, dtype=x.dtype), check_errors=True),
    lambda x: x.repeat_interleave(torch.ones(5, dtype=torch.long)), lambda x: x + torch.tensor(1.0),
    lambda x: torch.as_tensor([1.0, 2.0], device=x.device),
], ids=["item", "bool", "mask", "nonzero", "tolist", "cpu", "to_cpu", "int", "format", "unique", "equal",
        "cholesky", "cholesky_ex_checked", "repeat_interleave", "tensor_from_python", "as_tensor_from_python"])
def test_guard_catches_host_syncs(call):
    x = torch.randn(5)
    with pytest.raises(HostSyncError, match="host synchronisation"):
        with forbid_host_sync():
            call(x)


def test_guard_lets_device_work_through():
    x = torch.randn(5, 5, dtype=torch.float64)
    with forbid_host_sync() as guard:
        S = x @ x.mT + torch.eye(5, dtype=x.dtype)
        L = torch.linalg.cholesky_ex(S).L
        y = torch.where(x > 0, x, 0.0).sum(-1) + torch.cholesky_solve(x, L).amax()
    assert guard.calls >= 6 and torch.isfinite(y).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,cov", HOT_PATHS)
def test_static_path_makes_no_host_sync(static_regime, kind, cov, dtype):
    t = hot_inputs(kind, cov, dtype, requires_grad=True)
    with no_host_sync():
        d = build(kind, cov, t, validate_args=False)
        z = d.rsample((2,), noise=t["eps"])
        lp = d.log_prob(z)
        s = d.sample((3,))
        loss = z.square().sum() - lp.sum() - d.entropy().sum()
        loss.backward()
    assert d.conditioner.static
    assert (d.conditioner.method == "grouped") == ((kind, cov) == ("sum", "diag"))
    con = d.constraint
    assert_exact_per_row(con, z.detach())
    assert_exact_per_row(con, s)
    grads = {name: t[name].grad.clone() for name in ("loc", "scale", "cov_factor", "scale_tril") if name in t}
    # the same computation on the default path (validated, checked and refined on demand), outside the block
    hardeq._utils.cuda_graph_capturing = lambda: False  # restored by monkeypatch
    for v in grads:
        t[v].grad = None
    ref = build(kind, cov, t, validate_args=True)
    assert not ref.conditioner.static
    z_ref = ref.rsample((2,), noise=t["eps"])
    lp_ref = ref.log_prob(z_ref)
    (z_ref.square().sum() - lp_ref.sum() - ref.entropy().sum()).backward()
    z, lp, z_ref, lp_ref = z.detach(), lp.detach(), z_ref.detach(), lp_ref.detach()
    rtol = RTOL[dtype]
    torch.testing.assert_close(z, z_ref, rtol=rtol, atol=rtol * float(z_ref.abs().amax()))
    torch.testing.assert_close(lp, lp_ref, rtol=rtol, atol=rtol * float(lp_ref.abs().amax()))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, t[name].grad, rtol=rtol, atol=rtol * float(t[name].grad.abs().amax()),
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_conditioner_makes_no_host_sync(dtype):
    """``Conditioner(static=True)`` directly (no tracing needed): the grouped and the Cholesky factor, on an ``A``
    (or index) used before (what a training loop does)."""
    for kind in ("linear", "sum"):
        t = hot_inputs(kind, "diag", dtype)
        con = (hardeq.LinearConstraint(t["A"], t["k"]) if kind == "linear"
               else hardeq.SumConstraint(t["index"], t["k"]))
        cov = DiagonalCovariance(t["scale"])
        con.pinned_values()  # in eager mode the determined coordinates of an A are found once (one read), then kept
        with no_host_sync():
            cond = Conditioner(cov, con, static=True)
            z = cond.sample(t["loc"], (4,))
            zc = cond.condition(t["loc"] + t["scale"] * t["eps"])
        assert cond.method == ("grouped" if kind == "sum" else ("cholesky" if dtype == torch.float64
                                                                 else "cholesky64"))
        assert_exact_per_row(con, z)
        assert_exact_per_row(con, zc)


def test_default_path_checks_on_the_host():
    """The guard does see the validated path's per-row check (one read-back per call), so the tests above can fail."""
    t = hot_inputs("linear", "diag", torch.float32)
    d = build("linear", "diag", t, validate_args=True)
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            d.rsample()


def test_capture_probe_needs_no_cuda():
    """Outside capture (and on a CPU-only build) the probe is false and does not initialise CUDA."""
    initialised = torch.cuda.is_initialized()
    assert hardeq._utils.cuda_graph_capturing() is False
    assert hardeq._utils.is_tracing() is False
    assert torch.cuda.is_initialized() == initialised
