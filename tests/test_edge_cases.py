"""The library at its edges: wrong inputs, half precision, off-support parameters, imports.

``test_raises_on_wrong_inputs`` is a table in the style of Distrax's: (description, callable, exception type,
regex on the message); every regex names the argument at fault, so a message that stops saying *which*
argument is wrong fails the test. The Poisson rows cover its totals, rates and off-support values; the Poisson
tests check the sampler itself.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import hardeq
from hardeq import (ConstrainedNormal, ConstrainedPoisson, DiagonalCovariance, LinearConstraint, NotPSDError,
                    SparseConstraint, SumConstraint)
from hardeq.estimators import available_estimators, get_estimator, register_estimator
from hardeq.linalg.conditioning import Conditioner
from hardeq.testing import assert_exact_per_row
from tests.device import device

#: the suite's device as the library's messages name it (cpu, or cuda:0 under --device cuda)
_HERE = re.escape(str(torch.empty(0).device))

N = 4
A = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
K = torch.ones(2)
INDEX = torch.tensor([0, 0, 1, 1])
HALF = [torch.float16, torch.bfloat16]
SRC = Path(__file__).resolve().parents[1] / "src"


def _normal(loc=None, scale=None, **kwargs) -> ConstrainedNormal:
    kwargs.setdefault("constraint", LinearConstraint(A, K))
    loc = torch.zeros(N) if loc is None else loc
    if scale is None and not {"covariance", "scale_tril"} & set(kwargs):
        scale = torch.ones(N)
    return ConstrainedNormal(loc, scale, **kwargs)


def _nan_at(i: int, n: int = N) -> torch.Tensor:
    x = torch.ones(n)
    x[i] = float("nan")
    return x


# (description, callable, expected exception type, regex naming the argument)
WRONG_INPUTS = [
    # -- ConstrainedNormal: loc
    ("loc is a list", lambda: _normal(loc=[0.0] * N), TypeError, r"^loc must be a torch\.Tensor, got list"),
    ("loc is 0-d", lambda: _normal(loc=torch.tensor(0.0)), ValueError, r"^loc must have at least 1 dim"),
    ("loc is an integer tensor", lambda: _normal(loc=torch.zeros(N, dtype=torch.long)), TypeError,
     r"^loc must be a floating-point tensor \(float16, bfloat16, float32 or float64\), got dtype torch\.int64"),
    ("loc is complex", lambda: _normal(loc=torch.zeros(N, dtype=torch.complex64)), TypeError,
     r"^loc must be a floating-point tensor .*complex64"),
    ("loc is float8", lambda: _normal(loc=torch.zeros(N, dtype=torch.float8_e4m3fn)), TypeError,
     r"^loc must be a floating-point tensor \(float16, bfloat16, float32 or float64\), got dtype torch\.float8"),
    ("loc has the wrong event size", lambda: _normal(loc=torch.zeros(5), scale=torch.ones(5)), ValueError,
     r"loc has size n = 5"),
    ("loc holds NaN (validated)", lambda: _normal(loc=_nan_at(1), validate_args=True), ValueError,
     r"^loc \(shape \(4,\)\) must be finite"),
    # -- ConstrainedNormal: scale and the other covariance forms
    ("no scale", lambda: ConstrainedNormal(torch.zeros(N), constraint=LinearConstraint(A, K)), ValueError,
     r"one of scale, scale_tril .* or covariance must be given"),
    ("scale has the wrong size", lambda: _normal(scale=torch.ones(3)), ValueError,
     r"^scale must have shape \(\.\.\., n\) with n = loc\.shape\[-1\] = 4, got \(3,\)"),
    ("scale is an integer tensor", lambda: _normal(scale=torch.ones(N, dtype=torch.long)), TypeError,
     r"^scale must be a floating-point tensor"),
    ("batch shapes of loc and scale clash", lambda: _normal(loc=torch.zeros(2, N), scale=torch.ones(3, N)),
     ValueError, r"batch shapes do not broadcast: loc \(2,\), covariance \(3,\)"),
    ("scale dtype differs from loc", lambda: _normal(scale=torch.ones(N, dtype=torch.float64)), TypeError,
     r"^scale has dtype torch\.float64 but loc has dtype torch\.float32"),
    ("scale on another device", lambda: _normal(scale=torch.ones(N, device="meta")), ValueError,
     r"^scale is on device meta but loc is on " + _HERE),
    ("scale and covariance both", lambda: _normal(scale=torch.ones(N), covariance=DiagonalCovariance(torch.ones(N))),
     ValueError, r"pass covariance= alone"),
    ("covariance is a tensor", lambda: _normal(covariance=torch.eye(N)), TypeError,
     r"^covariance must be a hardeq\.Covariance .*got Tensor"),
    ("scale_tril has the wrong shape", lambda: _normal(scale_tril=torch.eye(3)), ValueError,
     r"^scale_tril must have shape \(\.\.\., n, n\)"),
    ("cov_factor has the wrong shape", lambda: _normal(cov_factor=torch.ones(3, 1)), ValueError,
     r"^cov_factor must have shape \(\.\.\., n, r\)"),
    ("negative scale (validated)", lambda: _normal(scale=-torch.ones(N), validate_args=True), ValueError,
     r"^scale \(shape \(4,\)\) must be positive, but its minimum is -1"),
    ("zero scale (validated)", lambda: _normal(scale=torch.tensor([0.0, 1, 1, 1]), validate_args=True), ValueError,
     r"^scale \(shape \(4,\)\) must be positive"),
    ("infinite scale (validated)", lambda: _normal(scale=torch.tensor([1.0, float("inf"), 1, 1]), validate_args=True),
     ValueError, r"^scale \(shape \(4,\)\) must be finite"),
    ("infinite scale (not validated), sampling",
     lambda: _normal(scale=torch.tensor([1.0, float("inf"), 1, 1]), validate_args=False).sample(), NotPSDError,
     r"covariance's scales must be finite"),
    ("all-zero scale (not validated), sampling", lambda: _normal(scale=torch.zeros(N), validate_args=False).sample(),
     NotPSDError, r"covariance's scales must be finite and not all zero"),
    ("zero scale (not validated), log_prob",
     lambda: _normal(scale=torch.tensor([0.0, 1, 1, 1]), validate_args=False).log_prob(torch.full((N,), 0.5)),
     ValueError, r"^scale \(the covariance\) must be nonsingular for log_prob and entropy"),
    ("zero scale (not validated), entropy",
     lambda: _normal(scale=torch.tensor([0.0, 1, 1, 1]), validate_args=False).entropy(),
     ValueError, r"^scale \(the covariance\) must be nonsingular for log_prob and entropy"),
    # -- ConstrainedNormal: constraint
    ("constraint is a tensor", lambda: _normal(constraint=A), TypeError,
     r"^constraint must be a hardeq\.EqualityConstraint \(e\.g\. hardeq\.LinearConstraint\), got Tensor"),
    ("constraint dtype differs from loc", lambda: _normal(constraint=LinearConstraint(A.double(), K.double())),
     TypeError, r"^constraint has dtype torch\.float64 but loc has dtype torch\.float32"),
    ("half loc with a float32 constraint",
     lambda: _normal(loc=torch.zeros(N, dtype=torch.float16), scale=torch.ones(N, dtype=torch.float16)),
     TypeError, r"^constraint has dtype torch\.float32 but loc has dtype torch\.float16"),
    # -- LinearConstraint
    ("A is 1-d", lambda: LinearConstraint(torch.ones(N), K), ValueError, r"^A must have at least 2 dim"),
    ("A is an integer tensor", lambda: LinearConstraint(A.long(), K), TypeError, r"^A must be a floating-point"),
    ("A is sparse", lambda: LinearConstraint(A.to_sparse_csr(), K), TypeError,
     r"^A must be a dense \(strided\) tensor.*SparseConstraint"),
    ("k has the wrong size", lambda: LinearConstraint(A, torch.ones(3)), ValueError,
     r"^k must have shape \(\.\.\., a\) with a = A\.shape\[-2\] = 2, got k\.shape = \(3,\)"),
    ("k dtype differs from A", lambda: LinearConstraint(A, K.double()), TypeError,
     r"^k has dtype torch\.float64 but A has dtype torch\.float32"),
    ("k on another device", lambda: LinearConstraint(A, torch.ones(2, device="meta")), ValueError,
     r"^k is on device meta but A is on " + _HERE),
    ("batch dims of A and k clash", lambda: LinearConstraint(A.expand(3, 2, N), torch.ones(2, 2)), ValueError,
     r"batch dimensions of A \(3,\) and k \(2,\) do not broadcast"),
    ("A rank-deficient (validated)", lambda: LinearConstraint(torch.tensor([[1.0, 1, 0, 0], [2, 2, 0, 0]]), K,
                                                              validate_args=True),
     ValueError, r"^A must have full row rank 2"),
    ("a > n", lambda: LinearConstraint(torch.randn(5, N), torch.ones(5)), ValueError,
     r"^A must have fewer rows than columns \(a < n\).*\(5, 4\)"),
    ("a = n", lambda: LinearConstraint(torch.eye(N), torch.ones(N)), ValueError, r"^A must have fewer rows"),
    ("A holds NaN (validated)", lambda: LinearConstraint(torch.stack([_nan_at(1), A[1]]), K, validate_args=True),
     ValueError, r"^A \(shape \(2, 4\)\) must be finite"),
    ("k holds inf (validated)", lambda: LinearConstraint(A, torch.tensor([1.0, float("inf")]), validate_args=True),
     ValueError, r"^k \(shape \(2,\)\) must be finite"),
    # -- SumConstraint
    ("index is float", lambda: SumConstraint(INDEX.float(), K), TypeError, r"^index must have dtype torch\.long"),
    ("index is 2-d", lambda: SumConstraint(INDEX[None], K), ValueError, r"^index must be 1-D"),
    ("index is empty", lambda: SumConstraint(torch.tensor([], dtype=torch.long), K), ValueError,
     r"^index must not be empty"),
    ("index out of range", lambda: SumConstraint(torch.tensor([0, 0, 1, 2]), K), ValueError,
     r"^index values must lie in \[0, a\) with a = total\.shape\[-1\] = 2, got range \[0, 2\]"),
    ("index negative", lambda: SumConstraint(torch.tensor([0, 0, -1, 1]), K), ValueError,
     r"^index values must lie in \[0, a\).*got range \[-1, 1\]"),
    ("empty group", lambda: SumConstraint(torch.tensor([0, 0, 2, 2]), torch.ones(3)), ValueError,
     r"^every group must have at least one coordinate, but groups \[1\]"),
    ("total is an integer tensor", lambda: SumConstraint(INDEX, torch.ones(2, dtype=torch.long)), TypeError,
     r"^total must be a floating-point tensor"),
    ("as many groups as coordinates", lambda: SumConstraint(torch.arange(N), torch.ones(N)), ValueError,
     r"fewer groups than coordinates \(a < n\), got a = 4 groups for n = 4"),
    # -- SparseConstraint
    ("SparseConstraint with a dense A", lambda: SparseConstraint(A, K), TypeError,
     r"^A must be a torch\.sparse_csr or sparse COO tensor, got layout torch\.strided; use hardeq\.LinearConstraint"),
    ("SparseConstraint k has the wrong size", lambda: SparseConstraint(A.to_sparse_csr(), torch.ones(3)), ValueError,
     r"^k must have shape \(\*batch, a\) with a = A\.shape\[0\] = 2, got k\.shape = \(3,\)"),
    ("SparseConstraint rank-deficient (validated)",
     lambda: SparseConstraint(torch.tensor([[1.0, 1, 0, 0], [2, 2, 0, 0]]).to_sparse_csr(), K, validate_args=True),
     ValueError, r"^A must have full row rank 2"),
    # -- the conditioner (below the distributions): float32 / float64 only
    ("Conditioner in half precision",
     lambda: Conditioner(DiagonalCovariance(torch.ones(N, dtype=torch.float16)),
                         LinearConstraint(A.half(), K.half())), TypeError,
     r"the covariance \(torch\.float16\) and the constraint \(torch\.float16\) must share dtype float32 or float64"),
    ("Conditioner with mixed dtypes",
     lambda: Conditioner(DiagonalCovariance(torch.ones(N, dtype=torch.float64)), LinearConstraint(A, K)), TypeError,
     r"the covariance \(torch\.float64\) and the constraint \(torch\.float32\) must share"),
    # -- estimators
    ("unknown estimator", lambda: _normal().rsample(estimator="nope"), ValueError,
     r"^unknown estimator 'nope': estimator must be one of .*'pathwise'.* for the 'normal' family"),
    ("estimator is not a string", lambda: _normal().rsample(estimator=3), TypeError,
     r"^estimator must be a string id, got int"),
    ("unknown family (get_estimator)", lambda: get_estimator("pathwise", "gaussian"), ValueError,
     r"^family must be one of 'normal', 'poisson'; got 'gaussian'"),
    ("unknown family (available_estimators)", lambda: available_estimators("gaussian"), ValueError,
     r"^family must be one of 'normal', 'poisson'; got 'gaussian'"),
    ("unknown family (register_estimator)", lambda: register_estimator("x", family="gaussian"), ValueError,
     r"^family must be one of 'normal', 'poisson'; got 'gaussian'"),
    ("unknown Poisson estimator", lambda: ConstrainedPoisson(torch.ones(N), torch.tensor([2, 3]), index=INDEX)
     .rsample(estimator="nope"), ValueError, r"unknown estimator 'nope'"),
    # -- ConstrainedPoisson: totals, rates, off-support values, closed forms past their bound
    ("Poisson float32 total above 2^24", lambda: ConstrainedPoisson(torch.ones(N), torch.tensor(1e9)), ValueError,
     r"^total must be at most 2\*\*24 = 16777216 when rate has dtype torch\.float32"),
    ("Poisson total 3.5", lambda: ConstrainedPoisson(torch.ones(N), torch.tensor(3.5)), ValueError,
     r"parameter total .* to satisfy the constraint"),
    ("Poisson total 3.5 sampled without validation",
     lambda: ConstrainedPoisson(torch.ones(N), torch.tensor(3.5), validate_args=False).sample(), ValueError,
     r"^cannot sample: total must hold non-negative integers"),
    ("Poisson negative total", lambda: ConstrainedPoisson(torch.ones(N), torch.tensor(-2.0)), ValueError,
     r"parameter total .* to satisfy the constraint"),
    ("Poisson negative rate", lambda: ConstrainedPoisson(torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.tensor(3.0)),
     ValueError, r"parameter rate .* to satisfy the constraint"),
    ("Poisson negative rate sampled without validation",
     lambda: ConstrainedPoisson(torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.tensor(3.0), validate_args=False).sample(),
     ValueError, r"^cannot sample: rate must be positive and finite"),
    ("Poisson log_prob of counts with the wrong sum",
     lambda: ConstrainedPoisson(torch.ones(N), torch.tensor(3.0)).log_prob(torch.tensor([1.0, 1.0, 0.0, 0.0])),
     ValueError, r"^Expected value to lie in the support.*sums are \[2\.0\] while total is \[3\.0\]"),
    ("Poisson log_prob of negative counts",
     lambda: ConstrainedPoisson(torch.ones(N), torch.tensor(3.0)).log_prob(torch.tensor([4.0, -1.0, 0.0, 0.0])),
     ValueError, r"^Expected value .* to hold non-negative integer counts"),
    ("Poisson log_prob of non-integer counts",
     lambda: ConstrainedPoisson(torch.ones(N), torch.tensor(3.0)).log_prob(torch.tensor([1.5, 1.5, 0.0, 0.0])),
     ValueError, r"^Expected value .* to hold non-negative integer counts"),
    ("Poisson on a dense constraint",
     lambda: ConstrainedPoisson(torch.ones(N), constraint=LinearConstraint(torch.ones(1, N), torch.tensor([3.0]))),
     TypeError, r"^constraint must be a grouped-sum constraint"),
    ("Poisson expected_l1 past the cdf bound",
     lambda: ConstrainedPoisson(torch.ones(2, dtype=torch.float64), torch.tensor(1e15, dtype=torch.float64))
     .expected_l1(torch.tensor([5e14, 5e14], dtype=torch.float64)), ValueError, r"expected_l1.*above the bound"),
    # -- sampling arguments
    ("noise has the wrong shape", lambda: _normal().rsample((2,), noise=torch.randn(3, N)), ValueError,
     r"^noise must have shape sample_shape \+ batch_shape \+ \(noise_size,\) = \(2, 4\), got \(3, 4\)"),
    ("noise is an integer tensor", lambda: _normal().rsample((2,), noise=torch.ones(2, N, dtype=torch.long)),
     TypeError, r"^noise must be a floating-point tensor"),
    ("noise is a list", lambda: _normal().rsample(noise=[0.0] * N), TypeError, r"^noise must be a torch\.Tensor"),
    ("noise on another device", lambda: _normal().rsample(noise=torch.zeros(N, device="meta")), ValueError,
     r"^noise is on device meta but loc is on " + _HERE),
    ("sample_shape is a string", lambda: _normal().sample("ab"), TypeError,
     r"^sample_shape must be a tuple \(or torch\.Size\) of ints, got 'ab'"),
    ("sample_shape is an int", lambda: _normal().rsample(3), TypeError, r"^sample_shape must be a tuple"),
    ("sample_shape holds a float", lambda: _normal().rsample((2.5,)), TypeError, r"^sample_shape must be a tuple"),
    ("sample_shape is negative", lambda: _normal().sample((-1,)), ValueError,
     r"^sample_shape must have non-negative sizes, got \(-1,\)"),
    ("expand to a clashing batch_shape", lambda: _normal().expand((3,)).expand((2,)), ValueError,
     r"^batch_shape must be a shape that \(3,\) .* expands to, got \(2,\)"),
    # -- log_prob value and expected-loss target
    ("log_prob of an integer tensor", lambda: _normal().log_prob(torch.ones(N, dtype=torch.long)), TypeError,
     r"^value must be a floating-point tensor \(float16, bfloat16, float32 or float64\), got dtype torch\.int64"),
    ("log_prob of a list", lambda: _normal().log_prob([0.5] * N), TypeError, r"^value must be a torch\.Tensor"),
    ("log_prob of the wrong size", lambda: _normal().log_prob(torch.ones(3)), ValueError,
     r"^value must have shape \(\.\.\., n\) broadcastable with batch_shape \+ \(n,\) = \(4,\), got \(3,\)"),
    ("log_prob of a clashing batch", lambda: _normal(loc=torch.zeros(2, N)).log_prob(torch.ones(3, N)), ValueError,
     r"^value must have shape .* = \(2, 4\), got \(3, 4\)"),
    ("log_prob off the plane (validated)", lambda: _normal(validate_args=True).log_prob(torch.zeros(N)), ValueError,
     r"value argument .* to be within the support \(AffineSubspace"),
    ("expected_l2 target of the wrong size", lambda: _normal().expected_l2(torch.ones(3)), ValueError,
     r"^target must have shape \(\.\.\., n\) broadcastable with batch_shape \+ \(n,\) = \(4,\), got \(3,\)"),
    ("expected_l1 target of the wrong size", lambda: _normal().expected_l1(torch.ones(2, 3)), ValueError,
     r"^target must have shape .* got \(2, 3\)"),
    ("expected_l1 integer target", lambda: _normal().expected_l1(torch.ones(N, dtype=torch.long)), TypeError,
     r"^target must be a floating-point tensor"),
    ("expected_l2 target on another device", lambda: _normal().expected_l2(torch.ones(N, device="meta")), ValueError,
     r"^target is on device meta but loc is on " + _HERE),
    # -- layers
    ("head with both constraint forms",
     lambda: hardeq.nn.ConstrainedGaussianHead(3, N, constraint_matrix=A, index=INDEX), ValueError,
     r"exactly one of constraint_matrix .* and index"),
    ("head constraint_value of the wrong size",
     lambda: hardeq.nn.ConstrainedGaussianHead(3, N, constraint_matrix=A)(torch.randn(3), torch.ones(3)),
     ValueError, r"^constraint_value must have shape \(\.\.\., 2\), got \(3,\)"),
    ("head features of the wrong size",
     lambda: hardeq.nn.ConstrainedGaussianHead(3, N, constraint_matrix=A)(torch.randn(5), torch.ones(2)),
     ValueError, r"^features must have shape \(\.\.\., 3\), got \(5,\)"),
]


@pytest.mark.parametrize("call, error, match", [pytest.param(*row[1:], id=row[0]) for row in WRONG_INPUTS])
def test_raises_on_wrong_inputs(call, error, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=match):
            call()


def test_table_covers_the_issue():
    """The table keeps at least one row for each mistake named in the issue (a row removed fails here)."""
    ids = " | ".join(row[0] for row in WRONG_INPUTS)
    for needle in ["wrong event size", "rank-deficient", "a > n", "empty group", "index out of range", "NaN",
                   "unknown estimator", "unknown family", "noise has the wrong shape", "sample_shape",
                   "integer tensor", "target of the wrong size", "negative scale", "zero scale", "dense A",
                   "another device", "dtype differs", "half loc"]:
        assert needle in ids, needle


# ---------------------------------------------------------------------------------------------- half precision
def _half_constraints(dtype):
    g = torch.Generator().manual_seed(3)
    n, a = 12, 3
    A = torch.randn(a, n, generator=g).to(dtype)
    index = torch.arange(n) % a
    k = torch.randn(5, a, generator=g).to(dtype)
    return n, [("linear", LinearConstraint(A, k), A), ("sum", SumConstraint(index, k), None)]


def _row_ratio(A: torch.Tensor, k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``|(Az - k)_i| / (|A||z|)_i`` per row, in float64, of the returned (half-precision) ``z``."""
    A64, k64, z64 = A.double(), k.double(), z.double()
    return (z64 @ A64.mT - k64).abs() / (z64.abs() @ A64.abs().mT)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_every_method(dtype):
    """float16 / bfloat16 inputs: every method works, returns the input dtype, and each returned vector meets
    ``|(Az - k)_i| <= eps_half (|A||z|)_i`` per row (the rounding of a float32-exact vector gives eps_half / 2)."""
    n, cases = _half_constraints(dtype)
    eps = torch.finfo(dtype).eps
    g = torch.Generator().manual_seed(0)
    loc = (3 * torch.randn(5, n, generator=g)).to(dtype).requires_grad_()
    scale = (0.2 + torch.rand(5, n, generator=g)).to(dtype).requires_grad_()
    for name, con, A in cases:
        A = con.dense_matrix() if A is None else A
        d = ConstrainedNormal(loc, scale, constraint=con)
        # z is rounded to half precision, so it is off the plane for float32's support check
        reference = ConstrainedNormal(loc.detach().float(), scale.detach().float(),
                                      constraint=con.to(dtype=torch.float32), validate_args=False)
        z = d.rsample((7,))
        out = {"mean": d.mean, "variance": d.variance, "sample": d.sample((7,)), "rsample": z,
               "log_prob": d.log_prob(z), "entropy": d.entropy(),
               "expected_l2": d.expected_l2(torch.zeros(n, dtype=dtype)),
               "expected_l1": d.expected_l1(torch.zeros(n, dtype=dtype))}
        for what, t in out.items():
            assert t.dtype == dtype, (name, what, t.dtype)
            assert torch.isfinite(t).all(), (name, what)
        for what in ("mean", "sample", "rsample"):
            worst = _row_ratio(A, con.k, out[what]).max().item()
            assert worst <= eps, f"{name} {what}: per-row residual {worst / eps:.2f} eps_half"
        # the densities are the float32 ones, rounded once
        torch.testing.assert_close(out["log_prob"].float(), reference.log_prob(z.detach().float()),
                                   rtol=4 * eps, atol=4 * eps * 10)
        torch.testing.assert_close(out["entropy"].float(), reference.entropy(), rtol=4 * eps, atol=4 * eps)
        # gradients reach the half-precision parameters, in their dtype
        (out["log_prob"].float().sum() + out["expected_l2"].float().sum() + z.float().square().sum()).backward()
        assert loc.grad.dtype == dtype and scale.grad.dtype == dtype
        assert torch.isfinite(loc.grad).all() and torch.isfinite(scale.grad).all()
        loc.grad = scale.grad = None


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_support_check(dtype):
    """With validation, a half-precision point of the plane is accepted (checked to 8 eps_half per row) and a
    point off it rejected."""
    torch.manual_seed(0)
    n, cases = _half_constraints(dtype)
    for _, con, _ in cases:
        d = ConstrainedNormal(torch.zeros(5, n, dtype=dtype), torch.ones(5, n, dtype=dtype), constraint=con,
                              validate_args=True)
        d.log_prob(d.sample((3,)))
        # off the plane in every row by far more than the tolerance (8 eps_half (|A||z|)_i): a shift along the
        # rows' own directions moves row i by (A A^T c)_i = |A|_F-scale amounts; a uniform +0.5 could leave a row
        # whose entries sum to about 0 within it
        A = con.dense_matrix().double()
        z = d.sample()
        scale = z.double().abs() @ A.abs().mT + 1.0
        shift = (2.0 * scale) @ torch.linalg.pinv(A).mT  # A shift = 2 scale, row by row
        with pytest.raises(ValueError, match="support"):
            d.log_prob((z.double() + shift).to(dtype))


def test_autocast_head_forward_backward():
    """A network head under ``torch.autocast("cpu", dtype=torch.bfloat16)``: with a float32 right-hand side the
    distribution is float32 and exact to the float32 criterion (autocast does not reach the conditioner); with a
    bfloat16 one it is bfloat16 within eps_bf16 per row. Forward and backward."""
    torch.manual_seed(0)
    head = hardeq.nn.ConstrainedGaussianHead(8, 6, constraint_matrix=torch.randn(2, 6))
    x, y, k = torch.randn(16, 8), torch.randn(16, 6), torch.randn(16, 2)
    # CUDA's autocast runs softplus (the head's scale) in float32, the CPU's in bfloat16: the distribution takes
    # the promoted dtype of its inputs either way
    low = torch.bfloat16 if device().type == "cpu" else torch.float32
    for rhs, dtype in [(k, torch.float32), (k.bfloat16(), low)]:
        with torch.autocast(device().type, dtype=torch.bfloat16):
            d = head(x, rhs)
            z = d.rsample((4,))
            loss = d.expected_l2(y).sum() + d.expected_l1(y).sum() - d.log_prob(z).sum() - d.entropy().sum()
        assert d.mean.dtype == z.dtype == dtype
        loss.float().backward()
        grads = [p.grad for p in head.parameters()]
        assert all(gr is not None and torch.isfinite(gr).all() and gr.abs().sum() > 0 for gr in grads)
        head.zero_grad()
        A = head.constraint_matrix
        if dtype == torch.float32:
            assert_exact_per_row(LinearConstraint(A, rhs.float()), d.mean.detach())
            assert_exact_per_row(LinearConstraint(A, rhs.float()), z.detach())
        else:
            assert _row_ratio(A, rhs, z.detach()).max() <= torch.finfo(dtype).eps


def test_autocast_float32_distribution_stays_exact():
    """float32 inputs built and used under autocast keep the float32 per-row criterion (a dense constraint, where
    the conditioner's matmuls would otherwise run in bfloat16)."""
    g = torch.Generator().manual_seed(1)
    n, a = 40, 8
    con = LinearConstraint(torch.randn(a, n, generator=g), torch.randn(3, a, generator=g))
    with torch.autocast(device().type, dtype=torch.bfloat16):
        d = ConstrainedNormal(torch.randn(3, n, generator=g), torch.rand(3, n, generator=g) + 0.1, constraint=con)
        z, mean = d.rsample((5,)), d.mean
    assert z.dtype == mean.dtype == torch.float32
    assert_exact_per_row(con, z)
    assert_exact_per_row(con, mean)


# ---------------------------------------------------------------------------------------------- off-support scale
def test_negative_scale_without_validation_is_its_absolute_value():
    """``Sigma = diag(scale^2)``: with ``validate_args=False`` a negative scale is the law of ``|scale|`` in every
    method (a finite log_prob, never NaN); with validation it is rejected (table above)."""
    g = torch.Generator().manual_seed(2)
    scale = torch.rand(N, generator=g) + 0.5
    signs = torch.tensor([-1.0, 1.0, -1.0, -1.0])
    for sign in (signs, -torch.ones(N)):
        neg = _normal(scale=sign * scale, validate_args=False)
        pos = _normal(scale=scale, validate_args=False)
        z = pos.sample((6,))
        assert torch.isfinite(neg.log_prob(z)).all()
        torch.testing.assert_close(neg.log_prob(z), pos.log_prob(z))
        torch.testing.assert_close(neg.entropy(), pos.entropy())
        torch.testing.assert_close(neg.variance, pos.variance)
        noise = torch.randn(6, N, generator=g)
        assert_exact_per_row(neg.constraint, neg.rsample((6,), noise=noise))


# ---------------------------------------------------------------------------------------------- imports
def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=120)


def test_subpackages_reachable_lazily_without_optional_extras():
    """``hardeq.nn`` and ``hardeq.diffusion`` work after ``import hardeq`` with diffusers and torch_geometric
    blocked; the subpackages load on first access; the diffusers scheduler fails when used, naming the extra."""
    out = _run("""
        import sys
        sys.modules["diffusers"] = None  # an import of it raises ImportError
        sys.modules["torch_geometric"] = None
        import hardeq
        assert "hardeq.nn" not in sys.modules and "hardeq.diffusion" not in sys.modules
        hardeq.nn.ConstrainedGaussianHead
        hardeq.diffusion.ddim_sample
        assert "hardeq.nn" in sys.modules and "nn" in dir(hardeq)
        import torch
        d = hardeq.nn.GraphGaussianHead(3)(torch.randn(5, 3), torch.tensor([0, 0, 0, 1, 1]), torch.ones(2))
        assert torch.allclose(d.mean[:3].sum(), torch.tensor(1.0))
        try:
            hardeq.diffusion.ConstrainedScheduler(object())
        except ImportError as e:
            assert 'pip install "hardeq[diffusion]"' in str(e), e
        else:
            raise AssertionError("ConstrainedScheduler worked without diffusers")
        try:
            hardeq.not_a_module
        except AttributeError as e:
            assert "not_a_module" in str(e)
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_import_does_not_load_scipy_or_optional_dependencies():
    out = _run("""
        import sys
        import hardeq
        names = ("scipy", "diffusers", "torch_geometric", "hardeq.nn", "hardeq.diffusion")
        loaded = [m for m in names if m in sys.modules]
        print(loaded)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
