"""A ConstrainedNormal factorises once: after a warm-up (``mean``, ``sample``, ``log_prob``, ``entropy``), every
further ``log_prob``, ``entropy``, ``expected_l1``, ``expected_l2``, ``variance``, ``rsample`` with every registered
estimator (forward and backward) and ``kl_divergence(q, p)`` between two warmed distributions on the same plane
runs ZERO matrix factorisations. The one exception is the ``constrained_layer`` estimator's first call on a dense
constraint: that baseline eliminates ``A`` itself (one LU solve), once per constraint object; its second call runs
none.

Counted (by a ``TorchFunctionMode``): Cholesky, QR, SVD, eigen-decompositions, LU, rank, dense solves, inverses,
determinants. Triangular solves and ``cholesky_solve`` reuse a factor and are not counted. Deterministic.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import hardeq
from hardeq.estimators import available_estimators

FACTORISATIONS = {
    "cholesky", "cholesky_ex", "qr", "svd", "svdvals", "eig", "eigvals", "eigh", "eigvalsh", "matrix_rank",
    "solve", "solve_ex", "inv", "inv_ex", "inverse", "lu", "lu_factor", "lu_factor_ex", "pinv", "lstsq", "det",
    "slogdet", "logdet", "cholesky_inverse",
}


class CountFactorisations(TorchFunctionMode):
    """Records the name of every factorising torch function called inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func)).removeprefix("linalg_")
        if name in FACTORISATIONS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


N, A_ROWS, BATCH = 8, 3, (2,)


def build(constraint_kind: str, structure: str, seed: int = 0, constraint=None) -> hardeq.ConstrainedNormal:
    g = torch.Generator().manual_seed(seed)
    loc = torch.randn(BATCH + (N,), generator=g, dtype=torch.float64).requires_grad_()
    scale = (0.5 + torch.rand(BATCH + (N,), generator=g, dtype=torch.float64)).requires_grad_()
    if constraint is None:
        k = torch.randn(BATCH + (A_ROWS,), generator=torch.Generator().manual_seed(99), dtype=torch.float64)
        if constraint_kind == "dense":
            A = torch.randn(A_ROWS, N, generator=torch.Generator().manual_seed(98), dtype=torch.float64)
            constraint = hardeq.LinearConstraint(A, k)
        else:
            constraint = hardeq.SumConstraint(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]), k)
    if structure == "diag":
        cov = hardeq.DiagonalCovariance(scale)
    elif structure == "full":
        L = (torch.randn(BATCH + (N, N), generator=g, dtype=torch.float64).tril(-1) * 0.3
             + torch.diag_embed(scale.detach())).requires_grad_()
        cov = hardeq.FullCovariance(L)
    else:
        cov = hardeq.LowRankCovariance(torch.randn(BATCH + (N, 2), generator=g, dtype=torch.float64), scale)
    return hardeq.ConstrainedNormal(loc, covariance=cov, constraint=constraint)


def warm_up(d: hardeq.ConstrainedNormal) -> hardeq.ConstrainedNormal:
    _ = d.mean
    z = d.sample((2,))
    d.log_prob(z)
    d.entropy()
    return d


def _rsample_backward(estimator):
    def op(d):
        d.rsample((3,), estimator).square().sum().backward(retain_graph=True)  # twice through one distribution
    return op


OPERATIONS = {
    "log_prob": lambda d: d.log_prob(d.sample((2,))),
    "entropy": lambda d: d.entropy(),
    "expected_l1": lambda d: d.expected_l1(torch.zeros(N, dtype=torch.float64)),
    "expected_l2": lambda d: d.expected_l2(torch.zeros(N, dtype=torch.float64)),
    "variance": lambda d: d.variance,
    **{f"rsample[{e}]": _rsample_backward(e) for e in available_estimators("normal")},
}
CASES = [(c, s) for c in ("dense", "sum") for s in ("diag", "full", "lowrank")]
CASE_IDS = [f"{c}-{s}" for c, s in CASES]


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("constraint_kind, structure", CASES, ids=CASE_IDS)
def test_no_factorisation_after_warm_up(constraint_kind, structure, operation):
    d = warm_up(build(constraint_kind, structure))
    with CountFactorisations() as first:
        OPERATIONS[operation](d)
    # the constraint-layer proxy (a baseline) eliminates A with one LU solve of its own, once per constraint object
    allowed = ["solve"] if operation == "rsample[constrained_layer]" and constraint_kind == "dense" else []
    assert first.calls in ([], allowed), f"{operation} factorised again after the warm-up: {first.calls}"
    with CountFactorisations() as second:
        OPERATIONS[operation](d)
    assert second.calls == [], f"{operation} factorised on its second call: {second.calls}"


@pytest.mark.parametrize("shared", [True, False], ids=["one-constraint", "equal-copies"])
@pytest.mark.parametrize("constraint_kind, structure", CASES, ids=CASE_IDS)
def test_kl_between_warmed_distributions_does_not_factorise(constraint_kind, structure, shared):
    p = warm_up(build(constraint_kind, structure, seed=1))
    constraint = p.constraint if shared else p.constraint.with_k(p.constraint.k.clone())
    q = warm_up(build(constraint_kind, structure, seed=2, constraint=constraint))
    with CountFactorisations() as counter:
        kl = torch.distributions.kl_divergence(q, p)
    assert bool(torch.isfinite(kl).all())
    assert counter.calls == [], f"kl_divergence(q, p) factorised: {counter.calls}"
