"""The validated path (``validate_args=True``) on a GPU profile: at most one batched host read per call, for the
inputs, and still a ``ValueError`` naming the argument, the element and the value for each bad input.

Counted with ``hardeq.testing.count_calls`` on issue 39's cases (``tests/budget_cases.py``: B, C, D, sparse), each
public call on its own: building the constraint, building the distribution, ``sample`` / ``rsample`` + ``backward``
/ ``log_prob``. The GPU profile is forced on the CPU (``hardeq.linalg.device.forced``), as in
``tests/test_call_budgets.py``: the reads are a property of the code path, not of the device.
"""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.linalg.device import forced
from hardeq.testing import count_calls
from tests import budget_cases as bc


def _dense_calls(s):
    return (lambda: hardeq.LinearConstraint(s["A"], s["k"], validate_args=True),
            lambda con: hardeq.ConstrainedNormal(s["loc"], s["scale"], constraint=con, validate_args=True))


def _sum_calls(s):
    return (lambda: hardeq.SumConstraint(s["batch"], s["k"], validate_args=True),
            lambda con: hardeq.ConstrainedNormal(s["loc"], s["scale"], constraint=con, validate_args=True))


def _sparse_calls(s):
    return (lambda: hardeq.SparseConstraint(s["A"], s["k"], validate_args=True),
            lambda con: hardeq.ConstrainedNormal(s["loc"], s["scale"], constraint=con, validate_args=True))


def _backward(z):
    z.sum().backward()


#: name -> (setup, the constructors of the constraint and the distribution, the method called)
CASES = {
    "B sample": (lambda: bc._dense(10_000, 8, 64, seed=0), _dense_calls, lambda d, s: d.sample()),
    "B log_prob": (bc.b_setup, _dense_calls, lambda d, s: d.log_prob(s["z"])),
    "C sample": (lambda: bc._dense(512, 256, 4, seed=1), _dense_calls, lambda d, s: d.sample()),
    "D rsample + backward": (bc.d_setup, _sum_calls, lambda d, s: _backward(d.rsample())),
    "sparse sample((16,))": (bc.sparse_setup, _sparse_calls, lambda d, s: d.sample((16,))),
}


def _counted(setup, calls, method):
    """Host reads of each of the three calls (after two warm-ups: the caches of ``A`` / the index are filled)."""
    state = setup()
    constraint, distribution = calls(state)
    for _ in range(2):
        method(distribution(constraint()), state)
    reads = {}
    with count_calls() as count:
        con = constraint()
    reads["constraint"] = count
    with count_calls() as count:
        dist = distribution(con)
    reads["distribution"] = count
    with count_calls() as count:
        method(dist, state)
    reads["method"] = count
    return reads


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
@pytest.mark.parametrize("name", list(CASES))
def test_each_validated_call_reads_the_host_at_most_once(name):
    with forced("gpu"):
        reads = _counted(*CASES[name])
    for call, count in reads.items():
        assert count.host_reads <= 1, (call, dict(count.host_read_names))
    assert reads["distribution"].host_reads == 1  # (the inputs are checked: the counter sees the read)
    if "log_prob" not in name:  # (sampling checks no input: the per-row check is on the device, deferred)
        assert reads["method"].host_reads == 0, dict(reads["method"].host_read_names)


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
def test_the_cpu_profile_still_validates_with_one_read_per_constructor():
    """On a CPU profile the validated path keeps the checked sampler (its host reads synchronise nothing), but the
    input checks of the constructors are one read each there too."""
    with forced("cpu"):
        reads = _counted(*CASES["C sample"])
    assert reads["constraint"].host_reads == 1 and reads["distribution"].host_reads == 1


def _nan_at(t, index):
    t = t.clone()
    t[index] = float("nan")
    return t


def _value_at(t, index, value):
    t = t.clone()
    t[index] = value
    return t


D = torch.float32
A3 = torch.tensor([[1.0, 2.0, 0.0, 1.0], [0.0, 1.0, 1.0, -1.0]], dtype=D)
K3 = torch.tensor([1.0, 2.0], dtype=D)
LOC, SCALE = torch.zeros(4, dtype=D), torch.ones(4, dtype=D)


def _linear(A=A3, k=K3, loc=LOC, scale=SCALE, validate_constraint=True):
    con = hardeq.LinearConstraint(A, k, validate_args=validate_constraint)
    return hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=True)


BAD = [
    ("loc NaN", lambda: _linear(loc=_nan_at(LOC, 2)), r"loc \(shape \(4,\)\) must be finite.*loc\[2\] = nan"),
    ("loc inf", lambda: _linear(loc=_value_at(LOC, 1, float("inf"))), r"loc.*must be finite.*loc\[1\] = inf"),
    ("scale negative", lambda: _linear(scale=_value_at(SCALE, 3, -0.5)), r"scale.*must be positive.*scale\[3\]"),
    ("scale zero", lambda: _linear(scale=_value_at(SCALE, 0, 0.0)), r"scale.*must be positive.*scale\[0\]"),
    ("scale subnormal", lambda: _linear(scale=_value_at(SCALE, 1, 1e-40)), r"scale has entries down to"),
    ("scale NaN", lambda: _linear(scale=_nan_at(SCALE, 1)), r"scale.*must be finite.*scale\[1\] = nan"),
    ("k NaN", lambda: _linear(k=_nan_at(K3, 1)), r"k \(shape \(2,\)\) must be finite.*k\[1\] = nan"),
    ("k NaN, constraint unvalidated", lambda: _linear(k=_nan_at(K3, 0), validate_constraint=False),
     r"constraint right-hand side k.*must be finite.*k\[0\] = nan"),
    ("A NaN", lambda: _linear(A=_nan_at(A3, (1, 2))), r"A \(shape \(2, 4\)\) must be finite.*A\[1, 2\] = nan"),
    ("A rank-deficient", lambda: _linear(A=torch.stack([A3[0], 2 * A3[0]])), r"A must have full row rank"),
    ("total NaN", lambda: hardeq.SumConstraint(torch.tensor([0, 0, 1, 1]), _nan_at(K3, 1), validate_args=True),
     r"total.*must be finite.*total\[1\] = nan"),
    ("sparse k NaN", lambda: hardeq.SparseConstraint(A3.to_sparse_csr(), _nan_at(K3, 0), validate_args=True),
     r"k.*must be finite.*k\[0\] = nan"),
]


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
@pytest.mark.parametrize("case,build,match", BAD, ids=[b[0] for b in BAD])
def test_a_bad_input_is_named_in_a_value_error(case, build, match, profile):
    with forced(profile), pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_log_prob_of_a_point_off_the_plane_names_value(profile):
    with forced(profile):
        d = _linear()
        z = d.sample((3,))
        d.log_prob(z)  # (on the plane: fine)
        with pytest.raises(ValueError, match="value argument"):
            d.log_prob(z + 0.1)


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_an_edit_through_data_of_a_validated_A_is_seen(profile):
    """The one read of a validated ``LinearConstraint`` includes the comparison of a cached ``A`` with its snapshot:
    an edit through ``.data`` that makes ``A`` rank-deficient is found, not hidden behind the cached verdict."""
    A = A3.clone()
    with forced(profile):
        _linear(A=A).sample()
        _linear(A=A).sample()
        A.data[1] = 3 * A.data[0]
        with pytest.raises(ValueError, match="full row rank"):
            _linear(A=A)
        A.data[1] = A3[1]
        z = _linear(A=A).sample()  # (restored: validated afresh, and sampled on the new contents)
    assert torch.allclose(A3.double() @ z.double(), K3.double(), atol=1e-5)


_M = torch.tensor([[2.0, 0.5, 0.0, 0.1], [0.5, 1.5, 0.2, 0.0], [0.0, 0.2, 1.0, 0.3], [0.1, 0.0, 0.3, 1.2]])
FORMS = {"scale_tril": dict(scale_tril=torch.linalg.cholesky(_M)), "covariance_matrix": dict(covariance_matrix=_M),
         "precision_matrix": dict(precision_matrix=_M),
         "cov_factor": dict(cov_factor=torch.ones(4, 2), scale=torch.full((4,), 0.5))}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_covariance_form_is_validated_in_one_read(form):
    con = hardeq.LinearConstraint(A3, K3, validate_args=False)
    with forced("gpu"), count_calls() as count:
        hardeq.ConstrainedNormal(LOC, constraint=con, validate_args=True, **FORMS[form])
    assert count.host_reads == 1, dict(count.host_read_names)


BAD_FORMS = [
    ("covariance_matrix asymmetric", dict(covariance_matrix=_value_at(_M, (0, 1), 1.5)),
     "covariance_matrix.*symmetric"),
    ("covariance_matrix NaN", dict(covariance_matrix=_nan_at(_M, (2, 3))),
     r"covariance_matrix.*must be finite.*covariance_matrix\[2, 3\] = nan"),
    ("precision_matrix not positive definite", dict(precision_matrix=-_M),
     "precision_matrix must be positive definite"),
    ("scale_tril with a negative diagonal", dict(scale_tril=-torch.eye(4)), "scale_tril.*lower triangular"),
    ("cov_factor NaN", dict(cov_factor=_nan_at(torch.ones(4, 2), (3, 1)), scale=torch.ones(4)),
     r"cov_factor.*must be finite.*cov_factor\[3, 1\] = nan"),
    ("low-rank scale negative", dict(cov_factor=torch.ones(4, 2), scale=_value_at(torch.ones(4), 2, -1.0)),
     r"scale.*must be positive.*scale\[2\]"),
]


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
@pytest.mark.parametrize("case,kwargs,match", BAD_FORMS, ids=[b[0] for b in BAD_FORMS])
def test_a_bad_covariance_is_named_in_a_value_error(case, kwargs, match, profile):
    con = hardeq.LinearConstraint(A3, K3, validate_args=False)
    with forced(profile), pytest.raises(ValueError, match=match):
        hardeq.ConstrainedNormal(LOC, constraint=con, validate_args=True, **kwargs)


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
def test_every_validated_method_reads_the_host_at_most_once():
    """Beyond the budget cases: the other methods of a validated distribution on a GPU profile. Those that take an
    input (``log_prob``'s value, the expected losses' target) check it with one read; the others read nothing."""
    s = bc._dense(300, 6, 8, seed=2)

    def build():
        con = hardeq.LinearConstraint(s["A"], s["k"], validate_args=True)
        return hardeq.ConstrainedNormal(s["loc"], s["scale"], constraint=con, validate_args=True)

    calls = {"sample": (lambda d, z, q: d.sample((2,)), 0), "rsample": (lambda d, z, q: d.rsample((2,)), 0),
             "mean": (lambda d, z, q: d.mean, 0), "variance": (lambda d, z, q: d.variance, 0),
             "entropy": (lambda d, z, q: d.entropy(), 0),
             "kl": (lambda d, z, q: torch.distributions.kl_divergence(d, q), 0),
             "log_prob": (lambda d, z, q: d.log_prob(z), 1), "expected_l2": (lambda d, z, q: d.expected_l2(z), 1),
             "expected_l1": (lambda d, z, q: d.expected_l1(z), 1)}
    with forced("gpu"):
        z = build().sample()
        for name, (call, reads) in calls.items():
            for _ in range(2):
                call(build(), z, build())
            d, q = build(), build()
            with count_calls() as count:
                call(d, z, q)
            assert count.host_reads == reads, (name, dict(count.host_read_names))


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
@pytest.mark.parametrize("kind", ["dense", "sum", "sparse"])
def test_kl_between_two_fresh_distributions_on_one_operator_reads_nothing(kind):
    """A training loop builds both sides of ``KL(q || p)`` each step, each with its own constraint object on the
    same ``A`` (or group index) tensor: deciding that the two planes are parallel must not read the host (it did
    for a ``SumConstraint``, whose ``torch.equal`` of the two indices ran even for the same tensor)."""
    g = torch.Generator().manual_seed(3)
    n, a = 40, 5
    loc, scale, k = torch.randn(n, generator=g), 0.5 + torch.rand(n, generator=g), torch.randn(a, generator=g)
    index = torch.arange(n) % a
    A = torch.randn(a, n, generator=g)
    sparse = (A * (torch.rand(a, n, generator=g) < 0.3) + torch.eye(a, n)).to_sparse_csr()
    make = {"dense": lambda: hardeq.LinearConstraint(A, k, validate_args=False),
            "sum": lambda: hardeq.SumConstraint(index, k, validate_args=False),
            "sparse": lambda: hardeq.SparseConstraint(sparse, k, validate_args=False)}[kind]

    def build(shift):
        return hardeq.ConstrainedNormal(loc + shift, scale, constraint=make(), validate_args=False)

    with forced("gpu"):
        for _ in range(2):
            torch.distributions.kl_divergence(build(0.0), build(1.0))
        q, p = build(0.0), build(1.0)
        with count_calls() as count:
            kl = torch.distributions.kl_divergence(q, p)
    assert count.host_reads == 0, dict(count.host_read_names)
    assert bool(torch.isfinite(kl)) and float(kl) > 0
