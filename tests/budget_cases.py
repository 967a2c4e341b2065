"""The five hot paths of the ATen-call budgets (issue 39), shared by ``tests/test_call_budgets.py`` and
``benchmarks/count_calls.py``: ``PATHS[name] = (setup, run, reference)``; ``setup()`` returns the inputs, ``run``
is the counted call (a freshly built distribution, ``validate_args=False``), ``reference`` the unconstrained one."""

from __future__ import annotations

from typing import Any, Callable

import torch

import hardeq

DTYPE = torch.float32
State = dict[str, Any]


def _dense(n: int, a: int, batch: int, seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    return {"loc": torch.randn(batch, n, generator=g, dtype=DTYPE),
            "scale": 0.5 + torch.rand(batch, n, generator=g, dtype=DTYPE),
            "A": torch.randn(a, n, generator=g, dtype=DTYPE), "k": torch.randn(batch, a, generator=g, dtype=DTYPE)}


def _dist(s: State) -> hardeq.ConstrainedNormal:
    con = hardeq.LinearConstraint(s["A"], s["k"], validate_args=False)
    return hardeq.ConstrainedNormal(s["loc"], s["scale"], constraint=con, validate_args=False)


def _unconstrained(s: State) -> torch.Tensor:
    return s["loc"] + s["scale"] * torch.randn(s["loc"].shape, dtype=DTYPE)


def b_setup() -> State:
    s = _dense(10_000, 8, 64, seed=0)
    s["z"] = _dist(s).sample()
    return s


def b_log_prob(s: State) -> torch.Tensor:
    return _dist(s).log_prob(s["z"])


def b_log_prob_reference(s: State) -> torch.Tensor:
    return torch.distributions.Normal(s["loc"], s["scale"], validate_args=False).log_prob(s["z"])


def d_setup(graphs: int = 128, max_nodes: int = 155) -> State:
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, max_nodes + 1, (graphs,), generator=g)
    batch = torch.repeat_interleave(torch.arange(graphs), sizes)
    n = batch.numel()
    return {"batch": batch, "loc": torch.randn(n, generator=g, dtype=DTYPE).requires_grad_(),
            "scale": (torch.rand(n, generator=g, dtype=DTYPE) + 0.5).requires_grad_(),
            "k": torch.randn(graphs, generator=g, dtype=DTYPE)}


def d_run(s: State) -> None:
    con = hardeq.SumConstraint(s["batch"], s["k"], validate_args=False)
    hardeq.ConstrainedNormal(s["loc"], s["scale"], constraint=con, validate_args=False).rsample().sum().backward()


def d_reference(s: State) -> None:
    _unconstrained(s).sum().backward()


def sparse_setup(n: int = 20_000, a: int = 100, per_row: int = 40) -> State:
    g = torch.Generator().manual_seed(7)
    cols = torch.stack([torch.randperm(n, generator=g)[:per_row].sort().values for _ in range(a)])
    crow = torch.arange(0, a * per_row + 1, per_row)
    values = torch.randn(a * per_row, generator=g, dtype=DTYPE)
    A = torch.sparse_csr_tensor(crow, cols.flatten(), values, (a, n), check_invariants=False)
    return {"A": A, "k": torch.randn(a, generator=g, dtype=DTYPE), "loc": torch.randn(n, generator=g, dtype=DTYPE),
            "scale": 0.5 + torch.rand(n, generator=g, dtype=DTYPE)}


def sparse_run(s: State) -> torch.Tensor:
    con = hardeq.SparseConstraint(s["A"], s["k"], validate_args=False)
    return hardeq.ConstrainedNormal(s["loc"], s["scale"], constraint=con, validate_args=False).sample((16,))


def sparse_reference(s: State) -> torch.Tensor:
    return s["loc"] + s["scale"] * torch.randn((16,) + s["loc"].shape, dtype=DTYPE)


#: name -> (setup, counted run, unconstrained reference)
PATHS: dict[str, tuple[Callable[[], State], Callable[[State], Any], Callable[[State], Any]]] = {
    "B sample (n 1e4, a 8, batch 64)": (lambda: _dense(10_000, 8, 64, seed=0), lambda s: _dist(s).sample(),
                                        _unconstrained),
    "B log_prob, fresh distribution": (b_setup, b_log_prob, b_log_prob_reference),
    "D ragged SumConstraint, 128 graphs: rsample + backward": (d_setup, d_run, d_reference),
    "C sample (n 512, a 256, batch 4)": (lambda: _dense(512, 256, 4, seed=1), lambda s: _dist(s).sample(),
                                         _unconstrained),
    "sparse sample((16,)) (n 2e4, a 100, 40 nnz per row)": (sparse_setup, sparse_run, sparse_reference),
}
#: the budgets of issue 39 (ATen calls per call, host reads included)
BUDGETS = {"B sample (n 1e4, a 8, batch 64)": 40, "B log_prob, fresh distribution": 40,
           "D ragged SumConstraint, 128 graphs: rsample + backward": 20, "C sample (n 512, a 256, batch 4)": 60,
           "sparse sample((16,)) (n 2e4, a 100, 40 nnz per row)": 50}
