r"""A conformance suite for samplers of a Gaussian on a plane truncated to a box (:mod:`hardeq.bounds`).

Subclass :class:`SamplerTestCase`, implement :meth:`~SamplerTestCase.draw` (``num`` draws of a
:class:`~hardeq.bounds.target.PlaneTarget` in ``[lower, upper]``, as independent as the sampler makes them, shaped
``(num, *batch, n)``), name the subclass ``Test...``, and pytest runs every check once per dtype in
:attr:`~SamplerTestCase.dtypes` and problem in :attr:`~SamplerTestCase.problems` (the class's
``pytest_generate_tests`` hook; hardeq does not import pytest)::

    from hardeq.testing.sampler_case import SamplerTestCase

    class TestMySampler(SamplerTestCase):
        def draw(self, target, lower, upper, num, generator):
            start = hardeq.bounds.truncated_mode(target, lower, upper).expand((num,) + target.shape)
            return my_sampler(target, lower, upper, start, burn_in=100, generator=generator)

The checks, each against an oracle independent of the library's samplers:

* **exact feasibility**: every draw within its bounds exactly (``>=``, ``<=`` in the target's dtype) and every row
  of :math:`Az = k` within the library's per-row tolerance (:func:`~hardeq.testing.assert_exact_per_row`);
* **stationarity**: each coordinate of each batch element against numpy rejection draws of the dense conditional
  (:func:`~hardeq.testing.dense_conditional`, then an eigen-root and a box test), by two-sample Kolmogorov-Smirnov
  tests at a Bonferroni-corrected level :data:`KS_LEVEL` over the coordinates (a batch of two different laws: a
  result must not depend on what else is in the batch);
* **shapes and dtypes**: ``(num, *batch, n)`` in the target's dtype, float32 and float64;
* **reproducibility**: the same ``generator`` seed gives the same draws.

The problems are small (``n = 4`` or 5; a grouped sum with a diagonal covariance and a batch of two; two dense rows
with a low-rank covariance), with boxes that cut the plane hard enough that rejection keeps 5-30% of its draws.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ..bounds.target import PlaneTarget
from ..constraints import EqualityConstraint, LinearConstraint, SumConstraint
from ..linalg.conditioning import Conditioner
from ..linalg.covariance import Covariance, DiagonalCovariance, LowRankCovariance
from .exactness import assert_exact_per_row
from .oracles import dense_conditional

if TYPE_CHECKING:
    import pytest

__all__ = ["KS_LEVEL", "SamplerTestCase"]

#: family-wise level of the Kolmogorov-Smirnov checks of one problem (Bonferroni over its coordinates)
KS_LEVEL = 1e-3


def _problem(name: str, dtype: torch.dtype) -> tuple[PlaneTarget, Tensor, Tensor]:
    """``(target, lower, upper)`` of a named problem, in ``dtype``."""
    f64 = torch.float64
    cov: Covariance
    con: EqualityConstraint
    if name == "grouped-diagonal":
        loc = torch.tensor([[0.9, -0.2, 0.4, 0.3], [0.1, 0.2, 0.8, 0.6]], dtype=f64)
        cov = DiagonalCovariance(torch.tensor([[0.5, 0.3, 0.4, 0.6], [0.3, 0.3, 0.5, 0.2]], dtype=f64).to(dtype))
        con = SumConstraint(torch.tensor([0, 0, 1, 1]), torch.tensor([[0.8, 0.9], [0.6, 1.2]], dtype=f64).to(dtype))
        lower, upper = torch.zeros(2, 4, dtype=f64), torch.full((2, 4), 0.7, dtype=f64)
    elif name == "dense-lowrank":
        g = torch.Generator().manual_seed(3)
        loc = torch.tensor([0.1, 0.5, 0.2, 0.4, 0.3], dtype=f64)
        W = torch.randn(5, 2, generator=g, dtype=f64) * 0.3
        cov = LowRankCovariance(W.to(dtype), torch.full((5,), 0.3, dtype=f64).to(dtype))
        A = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.0, 0.5, 0.0]], dtype=f64)
        con = LinearConstraint(A.to(dtype), torch.tensor([1.2, 0.1], dtype=f64).to(dtype))
        lower, upper = torch.zeros(5, dtype=f64), torch.full((5,), 0.6, dtype=f64)
    else:
        raise ValueError(f"unknown problem {name!r}")
    batch = torch.Size(loc.shape[:-1])
    target = PlaneTarget(loc.to(dtype), cov, con, Conditioner(cov, con), batch)
    return target, lower.to(dtype), upper.to(dtype)


def rejection_oracle(target: PlaneTarget, lower: Tensor, upper: Tensor, num: int, seed: int = 0) -> np.ndarray:
    """``num`` exact draws per batch element, ``(num, *batch, n)`` float64 numpy, by numpy rejection from the dense
    conditional (no sampler of the library involved)."""
    shape = target.shape
    n = shape[-1]
    flat = max(1, target.batch_shape.numel())
    loc = target.loc.detach().double().expand(shape).reshape(flat, n)
    sigma = target.covariance.dense().detach().double().expand(target.batch_shape + (n, n)).reshape(flat, n, n)
    A = target.constraint.dense_rows().detach().double()
    A = A.expand(target.batch_shape + A.shape[-2:]).reshape(flat, *A.shape[-2:])
    k = target.constraint.k.detach().double().expand(target.batch_shape + A.shape[-2:-1]).reshape(flat, -1)
    lo = lower.detach().double().expand(shape).reshape(flat, n).numpy()
    hi = upper.detach().double().expand(shape).reshape(flat, n).numpy()
    rng = np.random.default_rng(seed)
    out = np.empty((num, flat, n))
    for b in range(flat):
        oracle = dense_conditional(loc[b], sigma[b], A[b], k[b])
        mean, cov = oracle.mean.numpy(), oracle.covariance.numpy()
        evals, evecs = np.linalg.eigh((cov + cov.T) / 2)
        root = evecs * np.sqrt(np.clip(evals, 0.0, None))
        kept: list[np.ndarray] = []
        while sum(len(x) for x in kept) < num:
            z = mean + rng.standard_normal((50_000, n)) @ root.T
            kept.append(z[((z >= lo[b]) & (z <= hi[b])).all(1)])
        out[:, b] = np.concatenate(kept)[:num]
    return out.reshape((num,) + tuple(shape))


class SamplerTestCase(ABC):
    """Subclass, implement :meth:`draw`, name the subclass ``Test...`` (module docstring)."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    problems: tuple[str, ...] = ("grouped-diagonal", "dense-lowrank")
    #: draws per batch element of the stationarity check
    num: int = 1500

    @abstractmethod
    def draw(self, target: PlaneTarget, lower: Tensor, upper: Tensor, num: int,
             generator: torch.Generator) -> Tensor:
        """``num`` draws ``(num, *batch, n)`` of ``target`` truncated to ``[lower, upper]``, in its dtype."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """pytest hook (called on the class; no pytest import needed): every check runs for each dtype in
        :attr:`dtypes` and each problem in :attr:`problems`."""
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=lambda d: str(d).replace("torch.", ""))
        if "problem" in metafunc.fixturenames:
            metafunc.parametrize("problem", self.problems)

    def _draws(self, problem: str, dtype: torch.dtype, num: int, seed: int = 0
               ) -> tuple[PlaneTarget, Tensor, Tensor, Tensor]:
        target, lower, upper = _problem(problem, dtype)
        z = self.draw(target, lower, upper, num, torch.Generator().manual_seed(seed))
        return target, lower, upper, z

    def test_shapes_dtypes_and_exact_feasibility(self, problem: str, dtype: torch.dtype) -> None:
        target, lower, upper, z = self._draws(problem, dtype, 64)
        assert tuple(z.shape) == (64,) + tuple(target.shape), f"draws shaped {tuple(z.shape)}"
        assert z.dtype == dtype, f"draws in {z.dtype}, expected {dtype}"
        assert bool(((z >= lower) & (z <= upper)).all()), "a draw lies outside its bounds"
        assert_exact_per_row(target.constraint, z)

    def test_stationary_law_against_rejection(self, problem: str, dtype: torch.dtype) -> None:
        from scipy import stats

        target, lower, upper, z = self._draws(problem, dtype, self.num)
        ref = rejection_oracle(target, lower, upper, 4000)
        draws = z.detach().double().reshape(self.num, -1, target.event_size).numpy()
        ref = ref.reshape(4000, -1, target.event_size)
        tests = draws.shape[1] * draws.shape[2]
        for b in range(draws.shape[1]):
            for i in range(draws.shape[2]):
                p = stats.ks_2samp(draws[:, b, i], ref[:, b, i]).pvalue
                assert p > KS_LEVEL / tests, f"batch element {b}, coordinate {i}: KS p = {p:.2e}"

    def test_reproducible_with_a_generator(self, problem: str, dtype: torch.dtype) -> None:
        a = self._draws(problem, dtype, 16, seed=5)[3]
        b = self._draws(problem, dtype, 16, seed=5)[3]
        assert torch.equal(a, b), "the same generator seed gave different draws"
