"""No host read on the other hot paths of issue 39's item 1, on a GPU profile with ``validate_args=False``: every
gradient estimator, the expected losses, ``log_prob`` / ``entropy`` / ``variance``, the heads of
:mod:`hardeq.nn` and the diffusion conditioning step, each with a gradient where it has one.

Each call is the steady state of a training loop: a freshly built constraint and distribution on the same ``A`` /
index tensor per call, two calls first (an operator is laid out, and its one-time reads made, at its first uses),
then the counted one (``hardeq.testing.count_calls``). The budget cases (B, C, D, sparse) are in
``tests/test_call_budgets.py``. Two of these paths used to read the host on every call: the ``constrained_layer``
estimator chose its elimination pivots again for each new constraint object (4 reads), and ``GraphNormal``'s
log-normaliser checked its finiteness with ``bool(...)`` (1 read).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch

import hardeq
import hardeq.diffusion as hd
import hardeq.nn as hn
from hardeq.estimators import available_estimators
from hardeq.linalg.device import forced
from hardeq.testing import count_calls

N, A_ROWS, BATCH = 60, 4, 8


def _inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    A = torch.randn(A_ROWS, N, generator=g)
    return {"A": A, "csr": (A * (A.abs() > 1) + torch.eye(A_ROWS, N)).to_sparse_csr(),
            "index": torch.arange(N) % A_ROWS, "k": torch.randn(BATCH, A_ROWS, generator=g),
            "loc": torch.randn(BATCH, N, generator=g).requires_grad_(),
            "scale": (0.5 + torch.rand(BATCH, N, generator=g)).requires_grad_(),
            "y": torch.randn(BATCH, N, generator=g), "features": torch.randn(BATCH, 16, generator=g)}


S = _inputs()
CONSTRAINTS: dict[str, Callable[[], hardeq.EqualityConstraint]] = {
    "dense": lambda: hardeq.LinearConstraint(S["A"], S["k"], validate_args=False),
    "sum": lambda: hardeq.SumConstraint(S["index"], S["k"], validate_args=False),
    "sparse": lambda: hardeq.SparseConstraint(S["csr"], S["k"], validate_args=False),
}


def _dist(kind: str) -> hardeq.ConstrainedNormal:
    return hardeq.ConstrainedNormal(S["loc"], S["scale"], constraint=CONSTRAINTS[kind](), validate_args=False)


def _rsample(kind: str, estimator: str) -> Callable[[], None]:
    return lambda: _dist(kind).rsample((2,), estimator=estimator).square().sum().backward()


def _method(kind: str, name: str) -> Callable[[], None]:
    calls: dict[str, Callable[[hardeq.ConstrainedNormal], torch.Tensor]] = {
        "expected_l2": lambda d: d.expected_l2(S["y"]).sum(),
        "expected_l1": lambda d: d.expected_l1(S["y"]).sum(),
        "log_prob": lambda d: d.log_prob(d.sample()).sum(),
        "entropy": lambda d: d.entropy().sum(),
        "variance": lambda d: d.variance.sum(),
    }
    return lambda: calls[name](_dist(kind)).backward()


def _heads() -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    dense = hn.ConstrainedGaussianHead(16, N, constraint_matrix=S["A"])
    grouped = hn.ConstrainedGaussianHead(16, N, index=S["index"])
    graph = hn.GraphGaussianHead(16)
    g = torch.Generator().manual_seed(2)
    batch = torch.repeat_interleave(torch.arange(32), torch.randint(1, 30, (32,), generator=g))
    nodes, totals = torch.randn(batch.numel(), 16, generator=g), torch.randn(32, generator=g)

    def on_own_sample(d: Any) -> torch.Tensor:
        return d.log_prob(d.sample()).sum()

    return {
        "ConstrainedGaussianHead (A): log_prob": lambda: on_own_sample(dense(S["features"], S["k"])).backward(),
        "ConstrainedGaussianHead (A): rsample": lambda: dense(S["features"], S["k"]).rsample().sum().backward(),
        "ConstrainedGaussianHead (index): expected_l2":
            lambda: grouped(S["features"], S["k"]).expected_l2(S["y"]).sum().backward(),
        "GraphGaussianHead: log_prob": lambda: on_own_sample(graph(nodes, batch, totals, num_graphs=32)).backward(),
        "GraphGaussianHead: entropy": lambda: graph(nodes, batch, totals, num_graphs=32).entropy().sum().backward(),
        "GraphGaussianHead: rsample": lambda: graph(nodes, batch, totals, num_graphs=32).rsample().sum().backward(),
    }


def _diffusion() -> dict[str, Callable[[], None]]:
    con = hd.channel_sum_constraint((3, 8, 8), torch.full((4, 3), 10.0))
    x0 = torch.randn(4, 3 * 8 * 8, generator=torch.Generator().manual_seed(5))
    return {"constrained_x0": lambda: hd.constrained_x0(x0, con, 0.1),
            "constrained_x0, deterministic": lambda: hd.constrained_x0(x0, con, 0.1, deterministic=True)}


PATHS: dict[str, Callable[[], None]] = {
    **{f"{kind} rsample[{est}] + backward": _rsample(kind, est) for kind in CONSTRAINTS
       for est in available_estimators()},
    **{f"{kind} {name} + backward": _method(kind, name) for kind in CONSTRAINTS
       for name in ("expected_l2", "expected_l1", "log_prob", "entropy", "variance")},
}


def _reads(call: Callable[[], None]) -> tuple[int, dict[str, int]]:
    with forced("gpu"):
        call()
        call()
        with count_calls() as count:
            call()
    return count.host_reads, dict(count.host_read_names)


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
@pytest.mark.parametrize("name", list(PATHS))
def test_distribution_paths_read_nothing(name):
    reads, names = _reads(PATHS[name])
    assert reads == 0, names


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
def test_heads_and_the_diffusion_step_read_nothing(monkeypatch):
    monkeypatch.setattr(torch.distributions.Distribution, "_validate_args", False)  # (the heads' distributions)
    for name, call in {**_heads(), **_diffusion()}.items():
        reads, names = _reads(call)
        assert reads == 0, (name, names)


def test_a_graph_normal_with_a_zero_variance_still_names_the_graph():
    """The log-normaliser's finiteness check is deferred on a GPU profile (no host read); a CPU raises it at once,
    with the graph named, whichever profile is forced."""
    variance = torch.tensor([1.0, 0.0, 2.0, 1.0])
    batch = torch.tensor([0, 0, 1, 1])
    for kind in ("cpu", "gpu"):
        with forced(kind):
            d = hn.GraphNormal(torch.zeros(4), variance, batch, torch.zeros(2), validate_args=False)
            with pytest.raises(ValueError, match=r"graph\(s\) \[0\]"):
                d.entropy()


def _covariance_case(form: str, kind: str) -> Callable[[], None]:
    g = torch.Generator().manual_seed(13)
    n, a, B = 30, 3, 2
    loc, scale = torch.randn(B, n, generator=g), 0.3 + torch.rand(B, n, generator=g)
    k = torch.randn(B, a, generator=g)
    blocks = torch.arange(n) * 6 // n  # (6 covariance groups, each inside one of the 3 constraint groups below)
    index = torch.arange(n) * a // n
    factor = 0.4 * torch.randn(B, n, 2, generator=g)
    tril = torch.tril(0.2 * torch.randn(B, n, n, generator=g), -1) + torch.diag_embed(scale)
    A = torch.randn(a, n, generator=g)

    def dist() -> hardeq.ConstrainedNormal:
        con = (hardeq.SumConstraint(index, k, validate_args=False) if kind == "sum"
               else hardeq.LinearConstraint(A, k, validate_args=False))
        if form == "low-rank":
            return hardeq.ConstrainedNormal(loc, scale, cov_factor=factor, constraint=con, validate_args=False)
        if form == "full":
            return hardeq.ConstrainedNormal(loc, scale_tril=tril, constraint=con, validate_args=False)
        cov = hardeq.BlockDiagonalCovariance(blocks, factor, scale)
        return hardeq.ConstrainedNormal(loc, covariance=cov, constraint=con, validate_args=False)

    def step() -> None:
        d = dist()
        z = d.sample((3,))
        d.log_prob(z)
        torch.distributions.kl_divergence(d, dist())

    return step


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
@pytest.mark.parametrize("kind", ["sum", "dense"])
@pytest.mark.parametrize("form", ["low-rank", "full", "block-diagonal"])
def test_every_covariance_form_reads_nothing_per_step(form, kind):
    """``sample``, ``log_prob`` and KL of a covariance built each step: a ``BlockDiagonalCovariance`` on the same
    ``batch`` vector used to check its index (range, empty groups, layout) on every construction and on every
    internal copy (up to 19 reads per ``sample``), and to test on the host whether its groups nest in a
    ``SumConstraint``'s; both are now made once per index tensor (or pair of them)."""
    reads, names = _reads(_covariance_case(form, kind))
    assert reads == 0, names


#: host reads per call of a ConstrainedPoisson built each step (GPU profile, validate_args=False): sampling reads
#: its parameters' verdicts and its largest total once (integer totals are a precondition it always checks, and
#: the largest decides the binomial chunks); expected_l1 and entropy sum a window of pmf terms whose length is data
POISSON_READS = {"sample": 1, "rsample + backward": 1, "log_prob + backward": 0, "mean": 0,
                 "expected_l2 + backward": 0, "expected_l1 + backward": 1, "entropy + backward": 2}


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
@pytest.mark.parametrize("name", list(POISSON_READS))
def test_poisson_paths_read_the_host_only_where_their_work_is_data(name):
    """Each path used to check and lay out its group index again on every construction (15-40 reads per call, measured);
    the layout is now made once per index tensor and the sampler's checks are one batched read."""
    g = torch.Generator().manual_seed(17)
    n, a = 50, 5
    index = torch.arange(n) % a
    rate = (0.1 + torch.rand(4, n, generator=g)).requires_grad_()
    total = torch.randint(0, 30, (4, a), generator=g).to(torch.float32)
    y = torch.randint(0, 5, (4, n), generator=g).to(torch.float32)
    z = hardeq.ConstrainedPoisson(rate, total, index=index).sample()

    def dist() -> hardeq.ConstrainedPoisson:
        return hardeq.ConstrainedPoisson(rate, total, index=index, validate_args=False)

    calls: dict[str, Callable[[], Any]] = {
        "sample": lambda: dist().sample((3,)),
        "rsample + backward": lambda: dist().rsample((2,), estimator="marginal_expectation").sum().backward(),
        "log_prob + backward": lambda: dist().log_prob(z).sum().backward(),
        "mean": lambda: dist().mean,
        "expected_l2 + backward": lambda: dist().expected_l2(y).sum().backward(),
        "expected_l1 + backward": lambda: dist().expected_l1(y).sum().backward(),
        "entropy + backward": lambda: dist().entropy().sum().backward(),
    }
    reads, names = _reads(calls[name])
    assert reads == POISSON_READS[name], names


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
def test_the_vae_helpers_read_nothing_and_still_name_a_nan(monkeypatch):
    """A constrained latent's KL to its prior and the importance-weighted bound read nothing per step (the bound's
    NaN check read the host on every call); a NaN log-weight is still a ValueError on a CPU, whichever profile."""
    monkeypatch.setattr(torch.distributions.Distribution, "_validate_args", False)  # (the layers' distributions)
    torch.manual_seed(0)
    plane = hardeq.SumConstraint(torch.tensor([0, 0, 0, 1, 1, 1]), torch.zeros(2), validate_args=False)
    latent = hn.ConstrainedGaussianLatent(16, 6, plane)

    def kl() -> None:
        q = latent(S["features"])
        torch.distributions.kl_divergence(q, latent.prior(q)).sum().backward()

    for name, call in {"latent KL": kl, "importance_log_likelihood":
                       lambda: hn.importance_log_likelihood(torch.randn(10, BATCH))}.items():
        reads, names = _reads(call)
        assert reads == 0, (name, names)
    for kind in ("cpu", "gpu"):
        with forced(kind), pytest.raises(ValueError, match="log_weights contains NaN"):
            hn.importance_log_likelihood(torch.tensor([[0.0], [math.nan]]))
