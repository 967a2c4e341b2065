r"""Conformance test case for covariance structures (:class:`hardeq.Covariance`), shipped with the library.

In the manner of linear_operator's ``LinearOperatorTestCase``: a structure's test class says only how to
build it. Subclass :class:`CovarianceTestCase` in a pytest module and implement

.. code-block:: python

    class TestMyCovariance(CovarianceTestCase):
        def create(self, batch_shape, dtype, seed):
            ...  # -> (MyCovariance of parameters in `dtype`, dense Sigma of the same parameter values)

and pytest collects a test of every method of :class:`~hardeq.Covariance` (values in float32 and float64,
gradients by ``gradcheck`` in float64, ``trace_inv_mul`` against every built-in structure and the
``register_trace_inv_mul`` dispatch), each against a dense ``torch.linalg`` oracle evaluated in float64.
The structure must be rebuildable from its parameters as ``cov.with_tensors(*cov.tensors())`` (what
:meth:`~hardeq.Covariance.to` does; default ``type(cov)(*tensors)``).

Tolerances (:data:`TOLERANCES`): ``create`` should return a well-conditioned :math:`\Sigma` (condition number
below about 20, entries of order one, ``n`` about 5). A backward-stable evaluation then has a relative error of
about :math:`c\,n\,\kappa\,\varepsilon`: :math:`5 \cdot 20 \cdot 1.2\cdot10^{-7} \approx 10^{-5}` in float32,
:math:`2\cdot10^{-14}` in float64. We allow ``rtol = 1e-4`` (float32) and ``1e-10`` (float64), an order of
magnitude (float32) and four (float64) above that, with a matching ``atol`` for entries that are zero in exact
arithmetic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from ..linalg.covariance import (Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance,
                                 register_trace_inv_mul, trace_inv_mul)

__all__ = ["CovarianceTestCase", "TOLERANCES"]

#: ``assert_close`` tolerances against the float64 dense oracle, per dtype (justified in the module docstring)
TOLERANCES: dict[torch.dtype, dict[str, float]] = {torch.float32: dict(rtol=1e-4, atol=1e-5),
                                                   torch.float64: dict(rtol=1e-10, atol=1e-12)}

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=_gen(seed))


def _close(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol["rtol"], atol=tol["atol"],
                               msg=lambda m: f"{what}: {m}")


# the built-in structures, as partners for the pairwise trace (well-conditioned, like `create` should be)
def _diagonal(batch: tuple[int, ...], n: int, dtype: torch.dtype, seed: int) -> tuple[Covariance, Tensor]:
    scale = (0.5 + torch.rand(batch + (n,), dtype=torch.float64, generator=_gen(seed))).to(dtype)
    return DiagonalCovariance(scale), torch.diag_embed(scale.double() ** 2)


def _full(batch: tuple[int, ...], n: int, dtype: torch.dtype, seed: int) -> tuple[Covariance, Tensor]:
    X = torch.randn(batch + (n, n), dtype=torch.float64, generator=_gen(seed))
    L: Tensor = torch.linalg.cholesky(X @ X.mT / n + 0.5 * torch.eye(n, dtype=torch.float64)).to(dtype)
    return FullCovariance(L), L.double() @ L.double().mT


def _lowrank(batch: tuple[int, ...], n: int, dtype: torch.dtype, seed: int) -> tuple[Covariance, Tensor]:
    g = _gen(seed)
    W = (0.7 * torch.randn(batch + (n, 2), dtype=torch.float64, generator=g)).to(dtype)
    scale = (0.5 + torch.rand(batch + (n,), dtype=torch.float64, generator=g)).to(dtype)
    return LowRankCovariance(W, scale), W.double() @ W.double().mT + torch.diag_embed(scale.double() ** 2)


#: a structure of the partner covariances: (batch, n, dtype, seed) -> (the covariance, its dense Sigma)
_Make = Callable[[tuple[int, ...], int, torch.dtype, int], tuple[Covariance, Tensor]]
_PARTNERS: dict[str, _Make] = {"diagonal": _diagonal, "full": _full, "lowrank": _lowrank}


class CovarianceTestCase(ABC):
    """Base class of a covariance structure's conformance tests (a pytest class: name the subclass ``Test*``).

    Attributes:
        batch_shape: batch shape of the parameters in the tests.
        event_size: ``n``; ``create`` must honour it.

    Examples:
        >>> from hardeq.testing import CovarianceTestCase
        >>> class TestWrongDense(CovarianceTestCase):
        ...     def create(self, batch_shape, dtype, seed):  # the structure and its dense Sigma
        ...         scale = torch.ones(batch_shape + (self.event_size,), dtype=dtype)
        ...         return DiagonalCovariance(scale), torch.diag_embed(2 * scale.double())  # wrong: Sigma = I
        >>> TestWrongDense().test_identity(torch.float64)
        Traceback (most recent call last):
            ...
        AssertionError: dense: Tensor-likes are not close! ...
    """

    batch_shape: tuple[int, ...] = (2, 3)
    event_size: int = 5

    @abstractmethod
    def create(self, batch_shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[Covariance, Tensor]:
        """The structure with parameters in ``dtype`` and batch shape ``batch_shape``, and its dense
        :math:`\\Sigma` (``(*batch_shape, n, n)``, computed from the same parameter values, preferably in
        float64 and without the structure's own methods). Different seeds give different parameters."""

    # ------------------------------------------------------------------ helpers
    def _case(self, dtype: torch.dtype, seed: int = 0) -> tuple[Covariance, Tensor]:
        cov, S = self.create(self.batch_shape, dtype, seed)
        return cov, S.double()

    def _dense_sqrt(self, cov: Covariance) -> Tensor:
        eye = torch.eye(cov.noise_size, dtype=cov.dtype).expand(cov.batch_shape + (cov.noise_size,) * 2)
        return cov.sqrt_matmul(eye)  # F, (*batch, n, m)

    @staticmethod
    def _mv(M: Tensor, x: Tensor) -> Tensor:
        return (M @ x.unsqueeze(-1)).squeeze(-1)

    # ------------------------------------------------------------------ identity
    def test_declared_interface(self) -> None:
        """At most six abstract methods on the base class; the attributes callers read exist on every structure."""
        assert len(Covariance.__abstractmethods__) <= 6, sorted(Covariance.__abstractmethods__)
        cov, S = self._case(torch.float64)
        _close(cov.variance, S.diagonal(dim1=-2, dim2=-1), torch.float64, "variance")
        assert isinstance(cov.is_diagonal, bool)

    @DTYPES
    def test_identity(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        n, batch = self.event_size, torch.Size(self.batch_shape)
        assert isinstance(cov, Covariance)
        assert cov.event_size == n and cov.batch_shape == batch and cov.noise_size >= n
        assert cov.dtype == dtype and cov.device == S.device
        assert all(isinstance(t, Tensor) for t in cov.tensors())
        assert cov.param_numel == sum(t.numel() for t in cov.tensors())
        assert type(cov).__name__ in repr(cov)
        assert len(cov.arg_constraints) == len(cov.tensors()), "one arg_constraints entry per parameter"
        for name, constraint in cov.arg_constraints.items():
            assert bool(constraint.check(getattr(cov, name)).all()), f"{name} violates its arg_constraint"
        _close(cov.dense(), S, dtype, "dense")

    @DTYPES
    def test_is_diagonal(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        off = S - torch.diag_embed(S.diagonal(dim1=-2, dim2=-1))
        assert cov.is_diagonal == bool((off == 0).all()), "is_diagonal must say whether Sigma is diagonal"
        if cov.is_diagonal:
            assert cov.variance.shape == cov.batch_shape + (self.event_size,)
            _close(cov.variance, S.diagonal(dim1=-2, dim2=-1), dtype, "variance")

    @DTYPES
    def test_to(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        assert cov.to(dtype=dtype) is cov and cov.to(device=cov.device) is cov
        other = torch.float64 if dtype == torch.float32 else torch.float32
        moved = cov.to(dtype=other)
        assert type(moved) is type(cov) and moved.dtype == other and moved.batch_shape == cov.batch_shape
        _close(moved.dense(), S, other, "to(dtype).dense")

    def test_check_values_rejects_non_finite(self) -> None:
        cov, _ = self.create((), torch.float64, 0)
        cov.check_values()
        for i in range(len(cov.tensors())):
            bad = [t.clone(memory_format=torch.contiguous_format) for t in cov.tensors()]
            bad[i].view(-1)[0] = float("nan")
            with pytest.raises(ValueError, match="finite"):
                cov.with_tensors(*bad).check_values()

    # ------------------------------------------------------------------ Sigma and its square root
    @DTYPES
    def test_diagonal_and_decomposition(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        _close(cov.diagonal(), S.diagonal(dim1=-2, dim2=-1), dtype, "diagonal")
        d, V = cov.diag_part(), cov.factor_part()
        rebuilt = torch.zeros_like(S)
        if d is not None:
            rebuilt = rebuilt + torch.diag_embed(d.double())
        if V is not None:
            rebuilt = rebuilt + V.double() @ V.double().mT
        _close(rebuilt.to(dtype), S, dtype, "diag(diag_part) + factor_part factor_part^T")

    @DTYPES
    def test_square_root(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        F = self._dense_sqrt(cov).double()
        assert F.shape == cov.batch_shape + (self.event_size, cov.noise_size)
        _close((F @ F.mT).to(dtype), S, dtype, "F F^T")
        Y = _randn(*self.batch_shape, self.event_size, 4, seed=1)
        _close(cov.sqrt_t_matmul(Y.to(dtype)), F.mT @ Y, dtype, "sqrt_t_matmul")
        X = _randn(*self.batch_shape, cov.noise_size, 3, seed=2)
        _close(cov.sqrt_matmul(X.to(dtype)), F @ X, dtype, "sqrt_matmul")
        noise = _randn(7, *self.batch_shape, cov.noise_size, seed=3)
        _close(cov.sqrt_matvec(noise.to(dtype)), self._mv(F, noise), dtype, "sqrt_matvec")

    @DTYPES
    def test_max_abs_sqrt(self, dtype: torch.dtype) -> None:
        cov, _ = self._case(dtype)
        F = self._dense_sqrt(cov)
        got = cov.with_tensors(*(t.detach().requires_grad_() for t in cov.tensors())).max_abs_sqrt()
        assert got.shape == cov.batch_shape + (1,) and not got.requires_grad, "max_abs_sqrt must be detached"
        largest = F.abs().flatten(-2).amax(-1, keepdim=True).double()  # max |F_ij| <= c <= sqrt(m) max |F_ij|
        slack = 1 + TOLERANCES[dtype]["rtol"]
        assert bool((got.double() <= largest * cov.noise_size ** 0.5 * slack).all()), "max_abs_sqrt too large"
        assert bool((got.double() * slack >= largest).all()), "max_abs_sqrt below the largest entry of F"

    @DTYPES
    def test_scaled(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        c = (2.0 + torch.rand(self.batch_shape + (1,), dtype=torch.float64, generator=_gen(4))).to(dtype)
        sc = cov.scaled(c)
        assert type(sc) is type(cov) and sc.batch_shape == cov.batch_shape
        _close(sc.dense(), S / c.double().unsqueeze(-1) ** 2, dtype, "scaled(c).dense")
        unit = cov.scaled(cov.max_abs_sqrt()).max_abs_sqrt()  # what the conditioner does with it
        _close(unit, torch.ones_like(unit, dtype=torch.float64), dtype, "scaled(max_abs_sqrt()).max_abs_sqrt()")

    @DTYPES
    def test_matvec_and_matmul(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        x = _randn(4, *self.batch_shape, self.event_size, seed=5)  # with a sample dimension
        _close(cov.matvec(x.to(dtype)), self._mv(S, x), dtype, "matvec")
        x1 = _randn(self.event_size, seed=6)  # broadcast over the batch
        _close(cov.matvec(x1.to(dtype)), self._mv(S, x1.expand(S.shape[:-1])), dtype, "matvec (unbatched x)")
        X = _randn(*self.batch_shape, self.event_size, 3, seed=7)
        _close(cov.matmul(X.to(dtype)), S @ X, dtype, "matmul")

    @DTYPES
    def test_sandwich(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        A = _randn(3, self.event_size, seed=8)  # shared by the batch
        _close(cov.sandwich(A.to(dtype)), A @ S @ A.mT, dtype, "sandwich (2-D A)")
        Ab = _randn(*self.batch_shape, 2, self.event_size, seed=9)
        _close(cov.sandwich(Ab.to(dtype)), Ab @ S @ Ab.mT, dtype, "sandwich (batched A)")

    @DTYPES
    def test_reparameterize(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        F = self._dense_sqrt(cov).double()
        loc = _randn(*self.batch_shape, self.event_size, seed=10)
        noise = _randn(6, *self.batch_shape, cov.noise_size, seed=11)
        expected = loc + self._mv(F, noise)
        loc_d = loc.to(dtype, copy=True)
        # `noise` may be overwritten (a buffer the caller gives away): pass a copy; `loc` must survive
        _close(cov.reparameterize_(noise.to(dtype, copy=True), loc_d), expected, dtype, "reparameterize_")
        assert torch.equal(loc_d, loc.to(dtype)), "reparameterize_ overwrote loc"
        # gradients flow to loc and the parameters
        leaf = loc.to(dtype).requires_grad_()
        params = [t.detach().requires_grad_() for t in cov.tensors()]
        out = cov.with_tensors(*params).reparameterize_(noise.to(dtype, copy=True), leaf)
        _close(out.detach(), expected, dtype, "reparameterize_ (with grad)")
        out.sum().backward()
        assert leaf.grad is not None and all(p.grad is not None for p in params)

    # ------------------------------------------------------------------ inverse and determinant
    @DTYPES
    def test_inverse_and_logdet(self, dtype: torch.dtype) -> None:
        cov, S = self._case(dtype)
        Sinv = torch.linalg.inv(S)
        x = _randn(4, *self.batch_shape, self.event_size, seed=12)
        _close(cov.inv_matvec(x.to(dtype)), self._mv(Sinv, x), dtype, "inv_matvec")
        _close(cov.inv_quad(x.to(dtype)), (x * self._mv(Sinv, x)).sum(-1), dtype, "inv_quad")
        X = _randn(*self.batch_shape, self.event_size, 3, seed=13)
        _close(cov.inv_quad_matrix(X.to(dtype)), (X.mT @ Sinv @ X).diagonal(dim1=-2, dim2=-1).sum(-1), dtype,
               "inv_quad_matrix")
        _close(cov.inv_diagonal(), Sinv.diagonal(dim1=-2, dim2=-1), dtype, "inv_diagonal")
        _close(cov.logdet(), torch.linalg.slogdet(S)[1], dtype, "logdet")

    # ------------------------------------------------------------------ pairwise
    @DTYPES
    @pytest.mark.parametrize("partner", list(_PARTNERS))
    def test_trace_inv_mul_against_every_structure(self, dtype: torch.dtype, partner: str) -> None:
        cov, S = self._case(dtype, seed=14)
        other, So = _PARTNERS[partner](self.batch_shape, self.event_size, dtype, 15)
        _close(trace_inv_mul(cov, other), torch.linalg.solve(S, So).diagonal(dim1=-2, dim2=-1).sum(-1), dtype,
               f"trace_inv_mul(self, {partner})")
        _close(trace_inv_mul(other, cov), torch.linalg.solve(So, S).diagonal(dim1=-2, dim2=-1).sum(-1), dtype,
               f"trace_inv_mul({partner}, self)")

    def test_register_trace_inv_mul_dispatch(self) -> None:
        cov, S = self._case(torch.float64)
        other, So = _diagonal(self.batch_shape, self.event_size, torch.float64, 16)
        sub = type(f"Sub{type(cov).__name__}", (type(cov),), {})  # a fresh subclass inherits the registration
        p: Covariance = object.__new__(sub)  # the same parameters, as the subclass
        p.__dict__.update(vars(cov))
        expected = torch.linalg.solve(S, So).diagonal(dim1=-2, dim2=-1).sum(-1)
        _close(trace_inv_mul(p, other), expected, torch.float64, "inherited trace_inv_mul")
        calls: list[int] = []

        @register_trace_inv_mul(sub, DiagonalCovariance)
        def _special(p_: Covariance, q_: Covariance) -> Tensor:  # the most specific registration wins
            calls.append(1)
            return torch.zeros(p_.batch_shape, dtype=p_.dtype)

        assert bool((trace_inv_mul(p, other) == 0).all()) and calls == [1]
        _close(trace_inv_mul(cov, other), expected, torch.float64, "registration of a subclass leaks to its base")
        with pytest.raises(TypeError, match=f"p: Tensor, q: {type(cov).__name__}"):
            trace_inv_mul(S, cov)  # type: ignore[arg-type]  # (the wrong type is the case under test)

    # ------------------------------------------------------------------ gradients
    def _gradcheck(self, fn: Callable[[Covariance], Tensor]) -> None:
        cov, _ = self.create((2,), torch.float64, 17)
        params = tuple(t.detach().clone().requires_grad_() for t in cov.tensors())
        assert torch.autograd.gradcheck(lambda *ts: fn(cov.with_tensors(*ts)), params)

    def test_gradcheck_matvec(self) -> None:
        x = _randn(3, 2, self.event_size, seed=18)
        self._gradcheck(lambda c: c.matvec(x))

    def test_gradcheck_inv_quad(self) -> None:
        x = _randn(3, 2, self.event_size, seed=19)
        self._gradcheck(lambda c: c.inv_quad(x))

    def test_gradcheck_logdet(self) -> None:
        self._gradcheck(lambda c: c.logdet())

    def test_gradcheck_sandwich(self) -> None:
        A = _randn(3, self.event_size, seed=20)
        self._gradcheck(lambda c: c.sandwich(A))

    def test_float32_gradients_match_float64(self) -> None:
        """The float32 gradient of a scalar through every differentiable method equals the float64 one."""
        x = _randn(2, *self.batch_shape, self.event_size, seed=21)
        A = _randn(3, self.event_size, seed=22)
        cov64, _ = self._case(torch.float64)
        grads = {}
        for dtype in (torch.float32, torch.float64):
            params = [t.detach().to(dtype).requires_grad_() for t in cov64.tensors()]
            c = cov64.with_tensors(*params)
            xd = x.to(dtype)
            loss = (c.logdet().sum() + c.inv_quad(xd).sum() + (c.matvec(xd) * xd).sum()
                    + c.sandwich(A.to(dtype)).sum() + c.inv_diagonal().sum())
            grads[dtype] = torch.autograd.grad(loss, params)
        for g32, g64 in zip(grads[torch.float32], grads[torch.float64]):
            _close(g32, g64.detach(), torch.float32, "float32 gradient")

    # ------------------------------------------------------------------ in a distribution
    @DTYPES
    def test_conditioned_on_a_plane(self, dtype: torch.dtype) -> None:
        """``ConstrainedNormal(covariance=cov)``: its samples lie on the plane and its covariance matrix is
        :math:`\\Sigma - \\Sigma A^\\top (A\\Sigma A^\\top)^{-1} A\\Sigma` (``A``: 2 x n, well conditioned)."""
        from ..constraints import LinearConstraint
        from ..distributions import ConstrainedNormal

        cov, S = self._case(dtype)
        A = _randn(2, self.event_size, seed=23)
        k = _randn(*self.batch_shape, 2, seed=24)
        d = ConstrainedNormal(torch.zeros(self.batch_shape + (self.event_size,), dtype=dtype), covariance=cov,
                              constraint=LinearConstraint(A.to(dtype), k.to(dtype)))
        assert d.covariance is cov and d.noise_size == cov.noise_size
        assert bool(d.constraint.check(d.sample((3,))).all())
        SA = S @ A.T
        _close(d.covariance_matrix, S - SA @ torch.linalg.solve(A @ SA, SA.mT), dtype, "covariance_matrix")
