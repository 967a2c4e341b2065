"""A whole training step compiles without a graph break on the CPU, in the default (validated, checked) mode.

network -> ``ConstrainedNormal`` -> ``rsample`` / ``log_prob`` -> loss -> ``backward`` -> optimiser step, under
``torch.compile(fullgraph=True)`` (``fullgraph``: any graph break is an error), for the three kinds of constraint a
user batches: dense (``LinearConstraint``, a shared ``A`` and a ``k`` per input), grouped (a ragged PyG-like batch
of graphs padded to a fixed node budget, as users of CUDA graphs do, ``SumConstraint``) and sparse
(``SparseConstraint``: dynamo cannot trace a sparse tensor, so the constraint is built outside the step and given
each step's ``k`` by ``with_k``; inside the graph it computes with its COO index and value arrays). Inside the graph,
validation and the per-row check run on the device (``torch._assert_async``), so nothing reads back to the host.

The default suite uses the ``aot_eager`` backend (dynamo and AOT autograd: the forward and backward graphs, without
code generation); inductor is the ``slow`` variant. References: the same steps run eagerly from the same weights
and noise give the same losses and weights (to ``rtol``), and every sample is exact per row
(``hardeq.testing.assert_exact_per_row``).
"""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.testing import assert_exact_per_row

N_GRAPHS, BUDGET, FEATURES = 6, 48, 5
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}


def padded_graph_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged batch of ``N_GRAPHS`` graphs (1-9 nodes; groups of one included) padded to ``BUDGET`` nodes: the
    padding nodes form one more group of their own, with total 0, so the shapes never change between steps."""
    sizes = torch.randint(1, 10, (N_GRAPHS,), generator=g)
    sizes[0] = 1
    batch = torch.repeat_interleave(torch.arange(N_GRAPHS), sizes)
    pad = torch.full((BUDGET - batch.numel(),), N_GRAPHS)
    return torch.cat([batch, pad]), sizes


def make_case(kind: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    n = BUDGET
    if kind == "dense":
        a = 4
        A = torch.randn(a, n, generator=g, dtype=dtype)
        make = lambda k, v=None: hardeq.LinearConstraint(A, k, validate_args=v)  # noqa: E731
    elif kind == "grouped":
        index, _ = padded_graph_batch(g)
        a = N_GRAPHS + 1
        make = lambda k, v=None: hardeq.SumConstraint(index, k, validate_args=v)  # noqa: E731
    else:
        a = 6
        A = torch.zeros(a, n, dtype=dtype)
        for j in range(n):
            A[j % a, j] = 1.0 + torch.rand((), generator=g, dtype=dtype)
            A[(j + 1) % a, j] = -0.5
        A = A.to_sparse_csr()
        # built outside the compiled step (a sparse tensor cannot enter a graph); a new k by with_k inside it
        base = {v: hardeq.SparseConstraint(A, torch.zeros(a, dtype=dtype), validate_args=v) for v in (None, True)}
        make = lambda k, v=None: base[v].with_k(k)  # noqa: E731
    x = torch.randn(3, FEATURES, generator=g, dtype=dtype)
    k = torch.randn(3, a, generator=g, dtype=dtype)
    if kind == "grouped":
        k[:, -1] = 0.0  # the padding group sums to 0
    target = torch.randn(3, n, generator=g, dtype=dtype)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2 * n)).to(dtype)
    return net, make, x, k, target


def step_fn(net, make, validate, lr=1e-2):
    """One step; the optimiser is SGD written out (``torch.optim.SGD.step`` breaks the graph on purpose in this
    torch: compiled optimisers are compiled on their own)."""
    params = list(net.parameters())

    def step(x, k, target, eps):
        out = net(x)
        loc, scale = out.chunk(2, dim=-1)
        d = hardeq.ConstrainedNormal(loc, torch.nn.functional.softplus(scale) + 1e-3, constraint=make(k, validate),
                                     validate_args=validate)
        z = d.rsample(noise=eps)
        loss = (z - target).square().mean() - 1e-3 * d.log_prob(z).mean()
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(lr * p.grad)
                p.grad.zero_()
        return loss.detach(), z.detach()
    return step


def run(kind, dtype, backend, validate=None):
    results = {}
    for mode in ("eager", "compiled"):
        net, make, x, k, target = make_case(kind, dtype)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        step = step_fn(net, make, validate)
        if mode == "compiled":  # (trace_autograd_ops: backward() inside the graph)
            step = torch._dynamo.config.patch(trace_autograd_ops=True)(
                torch.compile(step, fullgraph=True, backend=backend))
        g = torch.Generator().manual_seed(1)
        losses, samples = [], []
        for _ in range(3):
            eps = torch.randn(3, BUDGET, generator=g, dtype=dtype)
            loss, z = step(x, k, target, eps)
            losses.append(loss)
            samples.append(z)
        results[mode] = (torch.stack(losses), samples, [p.detach().clone() for p in net.parameters()], make(k))
    return results


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def check(results, dtype):
    (l_e, _z_e, w_e, con), (l_c, z_c, w_c, _) = results["eager"], results["compiled"]
    rtol = RTOL[dtype]
    torch.testing.assert_close(l_c, l_e, rtol=rtol, atol=rtol * float(l_e.abs().max()))
    for p_c, p_e in zip(w_c, w_e):
        torch.testing.assert_close(p_c, p_e, rtol=rtol, atol=rtol * float(p_e.abs().max()))
    for z in z_c:
        assert_exact_per_row(con, z)
    assert not torch.equal(w_c[0], make_case("dense", dtype)[0][0].weight)  # the steps did train


@pytest.mark.parametrize("validate", [None, True], ids=["default", "validated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["dense", "grouped", "sparse"])
def test_training_step_compiles_without_graph_break(kind, dtype, validate):
    """``validate`` None: torch's default (under ``torch.compile`` torch turns distribution validation off);
    True: validation forced on, checked on the device inside the graph."""
    check(run(kind, dtype, "aot_eager", validate), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "grouped", "sparse"])
def test_training_step_compiles_with_inductor(kind):
    check(run(kind, torch.float32, "inductor"), torch.float32)
