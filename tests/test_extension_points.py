"""The extension points: a covariance and a constraint written with only their abstract methods pass the shipped
conformance suites (so every default is right), pair operations dispatch through ``register_pair`` (most specific
registration wins), constraint kinds serialise through ``to_config`` / ``from_config`` (the diffusers scheduler's
config uses them), and no concrete constraint class is type-checked outside the constraint modules.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from torch.distributions import constraints as dist_constraints

import hardeq
from hardeq.constraints import (EqualityConstraint, constraint_kinds, pairs, register_constraint_kind,
                                register_pair)
from hardeq.testing import ConstraintTestCase, CovarianceTestCase, dense_conditional

SRC = pathlib.Path(hardeq.__file__).parent


def test_at_most_six_abstract_methods():
    assert len(hardeq.Covariance.__abstractmethods__) <= 6, sorted(hardeq.Covariance.__abstractmethods__)
    assert len(EqualityConstraint.__abstractmethods__) <= 6, sorted(EqualityConstraint.__abstractmethods__)


# ---------------------------------------------------------------------------------------- a minimal covariance
class MinimalCovariance(hardeq.Covariance):
    """Sigma = L L^T with only the six abstract methods: every other method is the base class's default."""

    arg_constraints = {"scale_tril": dist_constraints.lower_cholesky}  # noqa: RUF012

    def __init__(self, scale_tril):
        self.scale_tril = scale_tril
        self.event_size = self.noise_size = scale_tril.shape[-1]
        self.batch_shape = scale_tril.shape[:-2]

    def tensors(self):
        return (self.scale_tril,)

    def sqrt_matmul(self, X):
        return self.scale_tril @ X

    def sqrt_t_matmul(self, Y):
        return self.scale_tril.mT @ Y

    def diagonal(self):
        return self.scale_tril.square().sum(-1)

    def logdet(self):
        return 2 * self.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    def inv_matmul(self, X):
        Y = torch.linalg.solve_triangular(self.scale_tril, X, upper=False)
        return torch.linalg.solve_triangular(self.scale_tril.mT, Y, upper=True)


class TestMinimalCovariance(CovarianceTestCase):
    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        X = torch.randn(batch_shape + (5, 5), dtype=torch.float64, generator=g)
        L = torch.linalg.cholesky(X @ X.mT / 5 + 0.5 * torch.eye(5, dtype=torch.float64)).to(dtype)
        return MinimalCovariance(L), L.double() @ L.double().mT


# ---------------------------------------------------------------------------------------- a minimal constraint
class MinimalConstraint(EqualityConstraint):
    """A dense shared ``A`` with only the six abstract members."""

    def __init__(self, A, k):
        self.A, self.k = A, k

    @property
    def event_size(self):
        return self.A.shape[-1]

    def matvec(self, z):
        return z @ self.A.mT

    def rmatvec(self, u):
        return u @ self.A

    def dense_matrix(self):
        return self.A

    def with_k(self, k):
        return MinimalConstraint(self.A, k)

    def to(self, device=None, dtype=None):
        A, k = self.A.to(device=device, dtype=dtype), self.k.to(device=device, dtype=dtype)
        return self if A is self.A and k is self.k else MinimalConstraint(A, k)


class TestMinimalConstraint(ConstraintTestCase):
    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        A = torch.randn(2, 6, dtype=torch.float64, generator=g)
        k = torch.randn(batch_shape + (2,), dtype=torch.float64, generator=g)
        return MinimalConstraint(A.to(dtype), k.to(dtype)), A.to(dtype), k.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_minimal_structures_condition_exactly(dtype):
    """Both minimal classes in one ConstrainedNormal: mean, variance, log_prob and KL against the dense oracle."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(6, 6, dtype=torch.float64, generator=g)
    L = torch.linalg.cholesky(X @ X.T / 6 + 0.5 * torch.eye(6, dtype=torch.float64))
    A = torch.randn(2, 6, dtype=torch.float64, generator=g)
    k = torch.tensor([0.3, -1.0], dtype=torch.float64)
    loc = torch.randn(6, dtype=torch.float64, generator=g)
    d = hardeq.ConstrainedNormal(loc.to(dtype), covariance=MinimalCovariance(L.to(dtype)),
                                 constraint=MinimalConstraint(A.to(dtype), k.to(dtype)))
    o = dense_conditional(loc, L @ L.T, A, k)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(d.mean.double(), o.mean, **tol)
    torch.testing.assert_close(d.variance.double(), o.covariance.diagonal(), **tol)
    torch.testing.assert_close(d.log_prob(o.mean.to(dtype)).double(), o.log_prob(o.mean), **tol)
    assert abs(float(torch.distributions.kl_divergence(d, d))) < (1e-4 if dtype == torch.float32 else 1e-12)
    assert bool(d.constraint.check(d.sample((5,))).all())


# ---------------------------------------------------------------------------------------- pair registry
class CountingSum(hardeq.SumConstraint):
    pass


def test_register_pair_most_specific_wins_and_leaves_the_base_alone():
    calls = []
    index = torch.tensor([0, 0, 1, 1, 1])
    cov = hardeq.DiagonalCovariance(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))
    plain = hardeq.SumConstraint(index, torch.tensor([1.0, 2.0], dtype=torch.float64))
    sub = CountingSum(index, plain.k)
    expected = plain.gram(cov)

    @register_pair("gram", CountingSum, hardeq.DiagonalCovariance)
    def _gram(constraint, covariance):
        calls.append(type(covariance).__name__)
        return pairs._dispatch("gram", hardeq.SumConstraint, hardeq.DiagonalCovariance)(constraint, covariance)

    torch.testing.assert_close(sub.gram(cov), expected, rtol=0, atol=0)
    assert calls == ["DiagonalCovariance"]
    plain.gram(cov)
    assert calls == ["DiagonalCovariance"], "a registration for a subclass must not reach its base"

    # a "grouped" registration returning None turns the O(n) path off for the pair: the dense path, same answer
    @register_pair("grouped", CountingSum, hardeq.DiagonalCovariance)
    def _no_grouped(constraint, covariance):
        return None

    loc = torch.zeros(5, dtype=torch.float64)
    a = hardeq.ConstrainedNormal(loc, covariance=cov, constraint=sub)
    b = hardeq.ConstrainedNormal(loc, covariance=cov, constraint=plain)
    assert a.conditioner.method != "grouped" and b.conditioner.method == "grouped"
    torch.testing.assert_close(a.variance, b.variance)
    torch.testing.assert_close(a.log_prob(b.mean), b.log_prob(b.mean))


def test_register_pair_rejects_bad_arguments():
    with pytest.raises(ValueError, match="operation must be one of"):
        register_pair("trace", EqualityConstraint, hardeq.Covariance)
    with pytest.raises(TypeError, match="two classes"):
        register_pair("gram", "SumConstraint", hardeq.Covariance)
    with pytest.raises(TypeError, match="constraint: Tensor"):
        pairs.gram(torch.ones(2), hardeq.DiagonalCovariance(torch.ones(2)))


# ---------------------------------------------------------------------------------------- kinds and configs
@register_constraint_kind("test_scaled_sum")
class ScaledSum(MinimalConstraint):
    """A registered kind with a compact config: ``A = c * ones(1, n)``."""

    def __init__(self, n, c, k):
        super().__init__(torch.full((1, n), float(c), dtype=k.dtype), k)
        self.c = float(c)

    def with_k(self, k):
        return ScaledSum(self.event_size, self.c, k)

    def to_config(self):
        return {"kind": "test_scaled_sum", "n": self.event_size, "c": self.c, "k": self.k.tolist(),
                "dtype": str(self.k.dtype).removeprefix("torch.")}

    @classmethod
    def _from_config(cls, config):
        return cls(config["n"], config["c"], torch.tensor(config["k"], dtype=getattr(torch, config["dtype"])))


def test_registered_kind_round_trips_and_unregistered_classes_save_dense():
    c = ScaledSum(4, 2.5, torch.tensor([[1.0], [3.0]], dtype=torch.float64))
    back = EqualityConstraint.from_config(json.loads(json.dumps(c.to_config())))
    assert type(back) is ScaledSum and torch.equal(back.k, c.k) and torch.equal(back.A, c.A)
    assert "test_scaled_sum" in constraint_kinds()
    m = MinimalConstraint(torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([0.25]))
    config = m.to_config()
    assert config["kind"] == "linear"
    dense = EqualityConstraint.from_config(config)
    assert type(dense) is hardeq.LinearConstraint and torch.equal(dense.A, m.A) and torch.equal(dense.k, m.k)


def test_kind_registry_errors():
    with pytest.raises(ValueError, match="registered kinds: .*'linear'.*'sparse'.*'sum'"):
        EqualityConstraint.from_config({"kind": "polygon"})
    with pytest.raises(TypeError, match="dict"):
        EqualityConstraint.from_config([("kind", "sum")])
    linear = hardeq.LinearConstraint(torch.ones(1, 3), torch.ones(1)).to_config()
    with pytest.raises(TypeError, match="describes a LinearConstraint"):
        hardeq.SumConstraint.from_config(linear)
    with pytest.raises(ValueError, match="missing \\['k'\\]"):
        EqualityConstraint.from_config({"kind": "linear", "A": [[1.0, 2.0]]})
    with pytest.raises(ValueError, match="registered to LinearConstraint"):
        register_constraint_kind("linear")(ScaledSum)
    with pytest.raises(TypeError, match="_from_config"):
        register_constraint_kind("test_no_reader")(MinimalConstraint)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_constraint_from_coo_round_trips_copies_and_saves_in_the_scheduler_config(dtype):
    import copy
    import pickle

    from hardeq.diffusion import _scheduler_spec as spec

    A = torch.tensor([[1.0, 0.0, -2.0, 0.0, 0.5], [0.0, 3.0, 0.0, 1.0, 0.0]], dtype=dtype).to_sparse()  # COO
    c = hardeq.SparseConstraint(A, torch.tensor([[1.0, 2.0], [0.0, -1.0]], dtype=dtype))
    z = torch.randn(2, 5, dtype=dtype)
    for other in (copy.deepcopy(c), pickle.loads(pickle.dumps(c)),
                  spec.constraint_from_spec(json.loads(json.dumps(spec.constraint_spec(c))))):
        assert type(other) is hardeq.SparseConstraint and other.dtype == dtype
        assert torch.equal(other.matvec(z), c.matvec(z)) and torch.equal(other.k, c.k)
    d = hardeq.ConstrainedNormal(torch.zeros(2, 5, dtype=dtype), torch.ones(5, dtype=dtype), constraint=c)
    _ = d.mean  # factorised
    again = copy.deepcopy(d.constraint)
    assert torch.equal(again.project(z), c.project(z))


def test_channel_sum_configs_of_older_saves_still_load():
    old = {"kind": "channel_sum", "channels": 2, "event_size": 8, "totals": [1.0, 2.0], "dtype": "float32"}
    c = EqualityConstraint.from_config(old)
    assert type(c) is hardeq.SumConstraint and c.to_config() == old
    old_sum = {"kind": "sum", "index": [0, 1, 0, 1, 1], "totals": [1.0, 2.0], "dtype": "float64"}
    assert EqualityConstraint.from_config(old_sum).to_config() == old_sum


def test_no_concrete_constraint_type_checks_outside_the_constraint_modules():
    """No isinstance / type() test of LinearConstraint, SumConstraint or SparseConstraint outside
    hardeq/constraints, and no error message listing constraint types by hand."""
    pattern = re.compile(r"(isinstance\([^)]*|type\([^)]*\) (is|==) )(Linear|Sum|Sparse)Constraint")
    listing = re.compile(r"(LinearConstraint|SumConstraint)\s*(,|or|/)\s*(hardeq\.)?(SumConstraint|LinearConstraint)")
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "constraints":
            continue
        text = path.read_text()
        offenders += [f"{path.name}: {m.group(0)}" for m in pattern.finditer(text)]
        for line in text.splitlines():
            if ("Error(" in line or "raise" in line or line.strip().startswith(('f"', '"'))) and listing.search(line) \
                    and "must be" in line:
                offenders.append(f"{path.name}: {line.strip()}")
    assert not offenders, offenders
