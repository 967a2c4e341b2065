r"""A conformance suite for :class:`~hardeq.constraints.EqualityConstraint` subclasses.

In the manner of linear_operator's ``LinearOperatorTestCase``: subclass :class:`ConstraintTestCase`, implement
:meth:`~ConstraintTestCase.create`, name the subclass ``Test...`` and pytest runs every contract method against
a dense float64 oracle built from the matrix ``A`` that :meth:`~ConstraintTestCase.create` returns, once per
dtype in :attr:`~ConstraintTestCase.dtypes` (float32, float64) and batch shape in
:attr:`~ConstraintTestCase.batch_shapes` (the class's ``pytest_generate_tests`` hook parametrises them; hardeq
does not import pytest). Without pytest, call a test directly, e.g. ``TestMine().test_matvec(torch.float32, ())``::

    from hardeq.testing import ConstraintTestCase

    class TestMyConstraint(ConstraintTestCase):
        def create(self, batch_shape, dtype, seed):
            g = torch.Generator().manual_seed(seed)
            A = ...                                        # (a, n) or (*batch, a, n), dense
            k = torch.randn(batch_shape + (a,), generator=g, dtype=torch.float64).to(dtype)
            return MyConstraint(A, k), A, k

Tolerances. A result is compared entry by entry with the float64 oracle, relative to the size of the terms
that entry sums (``|A||z|`` for :math:`Az`, ``|A||F||F|^\top|A|^\top`` for a Gram matrix): ``1e-5`` in float32
and ``1e-12`` in float64, the library's per-row exactness promise (every row within ``tol (|A||z|)_i``).
Quantities computed in float64 internally (log-determinants, projections, minimum-norm solutions) are held
to the same relative tolerances against the conditioning-free part of their size.
"""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from ..constraints import EqualityConstraint, LinearConstraint
from ..linalg.covariance import Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance

if TYPE_CHECKING:
    import pytest

__all__ = ["ConstraintTestCase"]

#: per-entry relative tolerance by dtype (see the module docstring)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def assert_close_scaled(actual: Tensor, expected: Tensor, scale: Tensor, dtype: torch.dtype, what: str) -> None:
    r"""``|actual - expected| <= RTOL[dtype] (scale + tiny)`` entry by entry (after broadcasting)."""
    actual64, expected64 = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    if actual64.shape != expected64.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}.")
    err = (actual64 - expected64).abs()
    bound = RTOL[dtype] * (scale.detach().to(torch.float64).abs() + torch.finfo(dtype).tiny)
    err, bound = torch.broadcast_tensors(err, bound)
    if not bool((err <= bound).all()):
        worst = (err / bound).argmax()
        raise AssertionError(
            f"{what} ({dtype}): error {err.flatten()[worst]:.3e} exceeds {bound.flatten()[worst]:.3e} "
            f"(= {RTOL[dtype]:.0e} x the size of the summed terms) at flat index {int(worst)}; "
            f"max error {err.max():.3e}."
        )


def _mv(M: Tensor, x: Tensor) -> Tensor:
    """``M x`` for ``M`` ``(*bm, p, q)``, ``x`` ``(*s, *bx, q)`` (broadcasting)."""
    return (M @ x.unsqueeze(-1)).squeeze(-1)


class ConstraintTestCase(ABC):
    """Base class: a subclass implements :meth:`create` and inherits the ``test_*`` methods below.

    Examples:
        >>> from hardeq.testing import ConstraintTestCase
        >>> class TestDense(ConstraintTestCase):  # pytest collects it from a test module
        ...     def create(self, batch_shape, dtype, seed):
        ...         A = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, -1.0]], dtype=dtype)
        ...         k = torch.ones(batch_shape + (2,), dtype=dtype)
        ...         return LinearConstraint(A, k), A, k
        >>> TestDense().test_matvec(torch.float32, (2,))  # without pytest: one contract, passes (None)
    """

    #: batch shapes of ``k`` (and of ``A`` if the constraint supports a batched ``A``) to test
    batch_shapes: tuple[tuple[int, ...], ...] = ((), (2,))
    #: dtypes to test; every test runs in each
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    #: seed of :meth:`create` and of the random test vectors
    seed: int = 0
    #: device of the last case :meth:`create` returned (``k.device``); the test vectors are moved there
    _device: torch.device | None = None

    @abstractmethod
    def create(self, batch_shape: tuple[int, ...], dtype: torch.dtype, seed: int
               ) -> tuple[EqualityConstraint, Tensor, Tensor]:
        """Return ``(constraint, A, k)``: the constraint under test, its dense ``A`` (``(a, n)`` or
        ``(*batch, a, n)``) and its right-hand side ``k`` (``(*batch, a)``), all in ``dtype``."""

    # ------------------------------------------------------------------ helpers
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """pytest hook (called on the class; no pytest import needed): every test runs for each dtype in
        :attr:`dtypes` and each batch shape in :attr:`batch_shapes`."""
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=lambda d: str(d).replace("torch.", ""))
        if "batch_shape" in metafunc.fixturenames:
            metafunc.parametrize("batch_shape", [tuple(b) for b in self.batch_shapes], ids=lambda b: f"batch{b}")

    def _case(self, dtype: torch.dtype, batch_shape: tuple[int, ...]
              ) -> tuple[EqualityConstraint, Tensor, Tensor]:
        """``(constraint, A, k)`` from :meth:`create`, with ``A`` and ``k`` as the float64 oracle's inputs."""
        c, A, k = self.create(tuple(batch_shape), dtype, self.seed)
        self._device = k.device  # the random test vectors below are drawn on the host, then moved here
        return c, A.to(torch.float64), k.to(torch.float64)

    def _rand(self, *shape: int, dtype: torch.dtype, offset: int = 1) -> Tensor:
        g = torch.Generator().manual_seed(self.seed + offset)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(device=self._device, dtype=dtype)

    @staticmethod
    def _oracle_projection(A: Tensor, k: Tensor, z: Tensor) -> Tensor:
        """``z - A^T (A A^T)^{-1} (A z - k)`` in float64."""
        r = _mv(A, z) - k
        return z - _mv(A.mT, torch.linalg.solve(A @ A.mT, r.unsqueeze(-1)).squeeze(-1))

    def _covariances(self, n: int, batch_shape: tuple[int, ...], dtype: torch.dtype
                     ) -> Iterator[tuple[str, Covariance, Tensor]]:
        """Each covariance structure with its dense square root ``F`` (``Sigma = F F^T``), float64."""
        g = torch.Generator().manual_seed(self.seed + 7)

        def rand(*shape: int) -> Tensor:
            return torch.randn(batch_shape + shape, generator=g, dtype=torch.float64).to(self._device)

        scale = rand(n).abs() + 0.5
        yield "diagonal", DiagonalCovariance(scale.to(dtype)), torch.diag_embed(scale)
        L = torch.tril(rand(n, n)) * 0.3 + torch.diag_embed(rand(n).abs() + 1.0)
        yield "full", FullCovariance(L.to(dtype)), L
        W = rand(n, 2)
        yield "lowrank", LowRankCovariance(W.to(dtype), scale.to(dtype)), torch.cat([W, torch.diag_embed(scale)], -1)

    # ------------------------------------------------------------------ the operator
    def test_shapes_and_repr(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        a, n = A.shape[-2:]
        assert (c.num_constraints, c.event_size) == (a, n), (c.num_constraints, c.event_size, A.shape)
        assert c.batch_shape == torch.broadcast_shapes(A.shape[:-2], k.shape[:-1]), c.batch_shape
        assert c.dtype == dtype and c.k.shape[-1] == a
        assert 0 < c.storage_numel <= A.numel()
        assert isinstance(repr(c), str) and type(c).__name__ in repr(c)
        torch.testing.assert_close(c.dense_matrix().to(torch.float64), A.expand(c.dense_matrix().shape),
                                   rtol=0, atol=0)

    def test_matvec(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        n = A.shape[-1]
        for sample in ((), (3,), (2, 3)):
            z = self._rand(*sample, *batch_shape, n, dtype=dtype)
            z64 = z.to(torch.float64)
            assert_close_scaled(c.matvec(z), _mv(A, z64), _mv(A.abs(), z64.abs()), dtype, f"matvec {sample}")

    def test_rmatvec(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        a = A.shape[-2]
        for sample in ((), (3,)):
            u = self._rand(*sample, *batch_shape, a, dtype=dtype)
            u64 = u.to(torch.float64)
            assert_close_scaled(c.rmatvec(u), _mv(A.mT, u64), _mv(A.abs().mT, u64.abs()), dtype,
                                f"rmatvec {sample}")

    def test_matmul(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        X = self._rand(*batch_shape, A.shape[-1], 4, dtype=dtype)
        X64 = X.to(torch.float64)
        assert_close_scaled(c.matmul(X), A @ X64, A.abs() @ X64.abs(), dtype, "matmul")

    def test_abs_matvec(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        x = self._rand(3, *batch_shape, A.shape[-1], dtype=dtype).abs()
        expected = _mv(A.abs(), x.to(torch.float64))
        assert_close_scaled(c.abs_matvec(x), expected, expected, dtype, "abs_matvec")

    def test_residual_and_per_row_check(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        n = A.shape[-1]
        z = self._rand(5, *batch_shape, n, dtype=dtype)
        z64 = z.to(torch.float64)
        assert_close_scaled(c.residual(z), _mv(A, z64) - k, _mv(A.abs(), z64.abs()) + k.abs(), dtype, "residual")
        on_plane = self._oracle_projection(A, k, z64).to(dtype)
        assert bool(c.check(on_plane).all()), "check rejects points on the plane"
        # per row: a perturbation of one row's residual by 1% of that row's size (far above its round-off)
        # must be seen, even when other rows are much larger (a max-over-rows test would miss it)
        # (the point on the plane A z = k + 1e-2 size e_last nearest to on_plane: only the last row moves)
        size = _mv(A.abs(), on_plane.to(torch.float64).abs()) + k.abs()  # (5, *batch, a)
        last = torch.zeros_like(size)
        last[..., -1] = 1e-2 * size[..., -1]
        bumped = self._oracle_projection(A, k + last, on_plane.to(torch.float64))
        assert not bool(c.check(bumped.to(dtype)).any()), "check accepts a point violating the last row"
        assert c.check(on_plane).shape == (5,) + c.batch_shape

    # ------------------------------------------------------------------ what the conditioner asks for
    def test_gram_factors_under_each_covariance(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        n = A.shape[-1]
        for name, cov, F in self._covariances(n, batch_shape, dtype):
            Sigma = F @ F.mT
            AF = A @ F
            scale = (A.abs() @ F.abs()) @ (A.abs() @ F.abs()).mT  # size of the terms of each entry
            expected = AF @ AF.mT
            assert_close_scaled(c.gram(cov), expected.expand(c.gram(cov).shape), scale, dtype, f"gram/{name}")
            B = c.sqrt_gram_factor(cov)  # (*batch, m, a)
            assert_close_scaled(B.mT @ B, expected.expand((B.mT @ B).shape), scale, dtype,
                                f"sqrt_gram_factor^T sqrt_gram_factor/{name}")
            X = c.cross_covariance(cov)
            assert_close_scaled(X, (Sigma @ A.mT).expand(X.shape), F.abs() @ (A.abs() @ F.abs()).mT, dtype,
                                f"cross_covariance/{name}")

    def test_diagonal_gram(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        v = self._rand(*batch_shape, A.shape[-1], dtype=dtype).abs() + 0.1
        out = c.diagonal_gram(v)
        if out is None:
            return  # nothing to check for this constraint
        G = (A * v.to(torch.float64).unsqueeze(-2)) @ A.mT
        off = G - torch.diag_embed(G.diagonal(dim1=-2, dim2=-1))
        assert bool((off == 0).all()), "diagonal_gram is not None but A diag(v) A^T is not diagonal"
        expected = G.diagonal(dim1=-2, dim2=-1)
        assert_close_scaled(out, expected.expand(out.shape), expected, dtype, "diagonal_gram")

    def test_orthonormal_decomposition(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        a, n = A.shape[-2:]
        Q, R, N = c.orthonormal_decomposition()
        assert Q.dtype == R.dtype == N.dtype == torch.float64
        assert Q.shape[-2:] == (n, a) and R.shape[-2:] == (a, a) and N.shape[-2:] == (n, n - a)
        eye = torch.eye(n, dtype=torch.float64, device=Q.device)
        QN = torch.cat([Q, N], -1)
        torch.testing.assert_close(QN.mT @ QN, eye.expand(QN.shape[:-2] + (n, n)), rtol=0, atol=1e-12)
        torch.testing.assert_close(torch.triu(R), R, rtol=0, atol=0)
        scale = A.abs().amax((-2, -1), keepdim=True)
        torch.testing.assert_close(Q @ R, A.mT.expand((Q @ R).shape), rtol=0, atol=1e-12 * float(scale.max()) * n)
        assert float((A @ N).abs().max()) <= 1e-12 * float(scale.max()) * n

    def test_logdet_gram_identity(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        expected = torch.linalg.slogdet(A @ A.mT)[1]
        out = c.logdet_gram_identity()
        assert out.dtype == dtype
        # computed in float64 (the value is float64-exact up to cond(A) eps64) and rounded to dtype
        assert_close_scaled(out, expected.expand(out.shape), expected.abs() + A.shape[-2], dtype,
                            "logdet_gram_identity")

    def test_pinned_values(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        pinned = c.pinned_values()
        if pinned is None:
            return  # nothing to check for this constraint
        mask, values = pinned
        assert mask.dtype == torch.bool and mask.shape == (A.shape[-1],)
        # a coordinate is pinned iff it has no component in null(A): every point of the plane shares it
        N = torch.linalg.qr(A.mT, mode="complete")[0][..., A.shape[-2]:]
        free = N.abs().amax(-1) > 1e-10  # (*, n)
        assert bool((free[..., mask] == 0).all()), "pinned_values marks a coordinate that is not determined"
        z0 = self._oracle_projection(A, k, torch.zeros_like(k[..., :1]).expand(k.shape[:-1] + (A.shape[-1],)))
        assert_close_scaled(values[..., mask], z0[..., mask], z0[..., mask].abs() + 1, dtype, "pinned values")

    # ------------------------------------------------------------------ geometry of the plane
    def test_particular_solution(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        z0 = c.particular_solution()
        assert z0.shape == c.batch_shape + (A.shape[-1],) and z0.dtype == dtype
        expected = self._oracle_projection(A, k, torch.zeros(c.batch_shape + (A.shape[-1],), dtype=torch.float64,
                                                                  device=A.device))
        assert_close_scaled(z0, expected, expected.abs().amax(-1, keepdim=True), dtype, "particular_solution")
        assert bool(c.check(z0).all()), "the particular solution is not on the plane"

    def test_project(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        z = self._rand(4, *batch_shape, A.shape[-1], dtype=dtype) * 3
        p = c.project(z)
        assert p.shape == z.shape and p.dtype == dtype
        expected = self._oracle_projection(A, k, z.to(torch.float64))
        size = z.to(torch.float64).abs().amax(-1, keepdim=True) + expected.abs().amax(-1, keepdim=True)
        assert_close_scaled(p, expected, size, dtype, "project")
        assert bool(c.check(p).all()), "project(z) is not on the plane"
        assert_close_scaled(c.project(p), p, size, dtype, "project is idempotent")
        # orthogonal: the correction z - p lies in the row space of A (no component in null(A))
        N = torch.linalg.qr(A.mT, mode="complete")[0][..., A.shape[-2]:]
        correction = (z - p).to(torch.float64)
        leak = (correction.unsqueeze(-2) @ N).squeeze(-2).abs()
        assert bool((leak <= 10 * RTOL[dtype] * size).all()), f"projection not orthogonal: {leak.max():.2e}"

    def test_same_row_space(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        a, n = A.shape[-2:]
        assert c.same_row_space(c)
        # the same plane written with permuted, rescaled rows
        g = torch.Generator().manual_seed(self.seed + 3)
        perm = torch.randperm(a, generator=g).to(A.device)
        D = (torch.rand(a, generator=g, dtype=torch.float64) * 10 + 0.1).to(A.device)
        A2 = (A[..., perm, :] * D.unsqueeze(-1)).to(dtype)
        other = LinearConstraint(A2, (k[..., perm] * D).to(dtype))
        assert c.same_row_space(other), "a rescaled, reordered copy of A is not recognised"
        assert other.same_row_space(c)
        # a different plane: replace the last row by a random direction
        A3 = A.clone()
        A3[..., -1, :] = torch.randn(n, generator=g, dtype=torch.float64).to(A.device)
        different = LinearConstraint(A3.to(dtype), k.to(dtype))
        assert not c.same_row_space(different) and not different.same_row_space(c)

    def test_group_index(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        index = c.group_index
        if index is None:
            return  # nothing to check for this constraint
        assert index.dtype == torch.long and index.shape == (A.shape[-1],)
        onehot = torch.nn.functional.one_hot(index, A.shape[-2]).mT.to(torch.float64)
        torch.testing.assert_close(A, onehot.expand(A.shape), rtol=0, atol=0)

    # ------------------------------------------------------------------ copies
    def test_expand_with_k_to(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        n = A.shape[-1]
        big = torch.Size((3,)) + c.batch_shape
        e = c.expand(big)
        assert e.batch_shape == big and e.k.shape == big + (A.shape[-2],)
        z = self._rand(2, *big, n, dtype=dtype)
        torch.testing.assert_close(e.matvec(z), c.matvec(z).expand(e.matvec(z).shape), rtol=0, atol=0)
        torch.testing.assert_close(e.logdet_gram_identity(), c.logdet_gram_identity().expand(
            e.logdet_gram_identity().shape), rtol=0, atol=0)
        k2 = self._rand(*c.batch_shape, A.shape[-2], dtype=dtype, offset=5)
        w = c.with_k(k2)
        assert type(w) is type(c) and w.k is k2
        torch.testing.assert_close(w.residual(z), c.matvec(z) - k2, rtol=0, atol=0)
        assert bool(w.check(w.project(z)).all())
        assert c.to(dtype=dtype) is c and c.to(device=c.device) is c
        other = torch.float64 if dtype == torch.float32 else torch.float32
        t = c.to(dtype=other)
        assert t.dtype == other and type(t) is type(c)
        torch.testing.assert_close(t.dense_matrix(), c.dense_matrix().to(other), rtol=0, atol=0)

    # ------------------------------------------------------------------ configs and copies
    def test_config_round_trip(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        """``to_config`` survives JSON and ``EqualityConstraint.from_config`` rebuilds the same ``A`` and ``k``, bit
        for bit, in the same dtype (the same class when the class registered a kind)."""
        from ..constraints import constraint_kinds

        c, A, k = self._case(dtype, batch_shape)
        config = json.loads(json.dumps(c.to_config()))
        assert config["kind"] in constraint_kinds(), f"kind {config['kind']!r} is not registered"
        back = EqualityConstraint.from_config(config)
        assert back.dtype == dtype and back.batch_shape == c.batch_shape
        if type(c).to_config is not EqualityConstraint.to_config:  # a class with its own kind comes back as itself
            assert type(back) is type(c), (type(back), type(c))
        assert torch.equal(back.dense_matrix().expand(c.dense_matrix().shape), c.dense_matrix())
        assert torch.equal(back.k.expand(c.k.shape), c.k)

    def test_deepcopy_and_pickle(self, dtype: torch.dtype, batch_shape: tuple[int, ...]) -> None:
        c, A, k = self._case(dtype, batch_shape)
        z = self._rand(3, *c.batch_shape, A.shape[-1], dtype=dtype)
        for other in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
            assert type(other) is type(c)
            assert torch.equal(other.matvec(z), c.matvec(z)) and torch.equal(other.k, c.k)
            assert torch.equal(other.project(z), c.project(z))

    # ------------------------------------------------------------------ gradients
    def test_gradients(self, batch_shape: tuple[int, ...]) -> None:
        """``torch.autograd.gradcheck`` (float64) of the differentiable maps w.r.t. ``z``, ``u`` and ``k``."""
        # float64 only: gradcheck's finite differences need it
        c, A, k = self.create(tuple(batch_shape), torch.float64, self.seed)
        a, n = A.shape[-2:]
        z = self._rand(2, *c.batch_shape, n, dtype=torch.float64).requires_grad_()
        u = self._rand(2, *c.batch_shape, a, dtype=torch.float64).requires_grad_()
        k2 = k.detach().clone().requires_grad_()
        assert torch.autograd.gradcheck(c.matvec, (z,))
        assert torch.autograd.gradcheck(c.rmatvec, (u,))
        assert torch.autograd.gradcheck(c.abs_matvec, (z.detach().abs().requires_grad_(),))
        assert torch.autograd.gradcheck(lambda z, k: c.with_k(k).residual(z), (z, k2))
        assert torch.autograd.gradcheck(lambda z, k: c.with_k(k).project(z), (z, k2))
        assert torch.autograd.gradcheck(lambda k: c.with_k(k).particular_solution(), (k2,))
