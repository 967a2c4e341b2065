r""":class:`NonlinearConstraint`: a smooth equality constraint :math:`h(z) = k` and its per-row feasibility test.

``h`` is a torch function ``(..., n) -> (..., a)`` acting row by row (the output of one batch element depends
only on that element's input); its Jacobian :math:`J(z) = \partial h / \partial z` (``(..., a, n)``) comes from
``torch.func`` (one ``vjp`` and a ``vmap`` over the ``a`` output directions: the cost of ``a`` backward passes,
vectorised) or from the user's ``jacobian``.

**Per-row tolerance.** Write :math:`c(z) = h(z) - J(z) z` (the offset of the tangent plane at ``z``: for an affine
:math:`h(z) = Az + c` it is the constant ``c``). The tangent plane at ``z`` is the linear constraint
:math:`J z' = k - c`, and row ``i`` of :math:`h(z) - k = J z + c - k` is a sum of three terms. A point is feasible
when, for **every** row ``i``,

.. math::
    |h_i(z) - k_i| \le \mathrm{tol}\;s_i(z), \qquad s_i(z) = (|J(z)|\,|z|)_i + |c_i(z)| + |k_i|,

``tol = 1e-5`` (float32) / ``1e-12`` (float64): the linear per-row criterion applied to the tangent plane, with the
sizes of its right-hand side's terms added (each term is rounded relative to its own size). It is invariant to
rescaling one row of ``h`` and ``k``, never relative to the largest row, and for an affine ``h`` it is the linear
scale plus ``|c_i| + |k_i|``. :math:`s_i` vanishes only where every term of the row does (then only an exact zero
passes).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from .._utils import check_finite, check_tensor

__all__ = ["NonlinearConstraint", "ManifoldError", "feasibility_tol"]

#: the per-row tolerance of a feasible point, per dtype (as the linear constraints)
_TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def feasibility_tol(dtype: torch.dtype) -> float:
    """The per-row feasibility tolerance ``tol`` of ``dtype`` (1e-5 float32, 1e-12 float64)."""
    if dtype not in _TOL:
        raise TypeError(f"nonlinear constraints compute in float32 or float64, got dtype {dtype}.")
    return _TOL[dtype]


class ManifoldError(RuntimeError):
    """A point could not be brought onto the manifold :math:`h(z) = k` (no point there, an iteration that did not
    converge, or a rank-deficient Jacobian); the message names the batch element, the row and the residual."""


def _first_bad(bad: Tensor) -> tuple[int, ...]:
    """Index (a tuple) of the first ``True`` entry of a boolean tensor (one host read; only on failure)."""
    return tuple(int(i) for i in bad.nonzero()[0])


class NonlinearConstraint:
    r"""A smooth equality constraint :math:`h(z) = k` on vectors :math:`z \in \mathbb R^n`, with ``a < n`` rows.

    The set :math:`\mathcal M = \{z : h(z) = k\}` is an ``(n - a)``-dimensional manifold where the Jacobian
    :math:`J(z)` has full row rank. :class:`~hardeq.ConstrainedNormal` with this constraint conditions a Gaussian
    on it (see :class:`~hardeq.manifold.ManifoldNormal`).

    Args:
        h: a torch function ``(..., n) -> (..., a)`` acting row by row (batch elements independent), twice
            differentiable (the samplers and gradients need :math:`J` and Hessian-vector products of
            :math:`\lambda^\top h`). It is called on tensors of the constraint's dtype.
        k: the right-hand side, shape ``(*batch, a)``; a floating-point tensor (float32 or float64). Its batch
            dimensions broadcast with the distribution's.
        jacobian: optional ``(..., n) -> (..., a, n)``, :math:`J(z)`; by default ``torch.func`` (``vjp`` and
            ``vmap``), or a loop of ``a`` backward passes when ``h`` cannot be ``vmap``-ed.
        validate_args: check that ``k`` is finite (default: ``torch.distributions``' global setting).

    Example:
        >>> circle = NonlinearConstraint(lambda z: (z ** 2).sum(-1, keepdim=True), torch.tensor([4.0]))
        >>> z = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> circle.residual(z), circle.check(z)
        (tensor([[ 0.], [-3.]]), tensor([ True, False]))
        >>> circle.jacobian(z).shape
        torch.Size([2, 1, 2])
    """

    #: the distribution :class:`~hardeq.ConstrainedNormal` returns for this constraint (registered by
    #: :mod:`hardeq.manifold.distribution`: :class:`~hardeq.manifold.ManifoldNormal`)
    distribution_class: ClassVar[type[Any] | None] = None

    def __init__(self, h: Callable[[Tensor], Tensor], k: Tensor, *,
                 jacobian: Callable[[Tensor], Tensor] | None = None, validate_args: bool | None = None) -> None:
        if not callable(h):
            raise TypeError(f"h must be a callable (..., n) -> (..., a) on torch tensors, got {type(h).__name__}.")
        if jacobian is not None and not callable(jacobian):
            raise TypeError("jacobian must be None or a callable (..., n) -> (..., a, n), got "
                            f"{type(jacobian).__name__}.")
        check_tensor("k", k, min_dim=1)
        if k.dtype not in _TOL:
            raise TypeError(f"k must be float32 or float64 (nonlinear constraints compute in one of them), got "
                            f"{k.dtype}.")
        if k.shape[-1] < 1:
            raise ValueError(f"k must have shape (*batch, a) with a >= 1 rows, got shape {tuple(k.shape)}.")
        if validate_args is None:
            validate_args = bool(torch.distributions.Distribution._validate_args)
        if validate_args:
            check_finite("k", k)
        self.h = h
        self.k = k
        self._jacobian = jacobian
        self._validate_args = validate_args
        self._use_vmap = True

    # ------------------------------------------------------------------ shape
    @property
    def num_constraints(self) -> int:
        """Number of rows ``a``."""
        return self.k.shape[-1]

    @property
    def batch_shape(self) -> torch.Size:
        """Batch shape of ``k`` (``h`` itself acts row by row)."""
        return self.k.shape[:-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def with_k(self, k: Tensor) -> NonlinearConstraint:
        """The same ``h`` (and ``jacobian``) with a new right-hand side ``k``."""
        return NonlinearConstraint(self.h, k, jacobian=self._jacobian, validate_args=self._validate_args)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> NonlinearConstraint:
        """``k`` moved / cast (``h`` must accept tensors of the new dtype); ``self`` when nothing changes."""
        k = self.k.to(device=device, dtype=dtype)
        return self if k is self.k else self.with_k(k)

    def expand(self, batch_shape: torch.Size) -> NonlinearConstraint:
        return self.with_k(self.k.expand(tuple(batch_shape) + (self.num_constraints,)))

    # ------------------------------------------------------------------ evaluation
    def _points(self, z: object, name: str = "z") -> Tensor:
        z = check_tensor(name, z, min_dim=1)
        if z.dtype != self.dtype:
            raise TypeError(f"{name} must have the constraint's dtype {self.dtype}, got {z.dtype}.")
        return z

    def value(self, z: Tensor) -> Tensor:
        """:math:`h(z)`, ``(..., n) -> (..., a)``; ``ValueError`` naming ``h`` when its output has the wrong shape or
        dtype."""
        z = self._points(z)
        out = self.h(z)
        if not isinstance(out, Tensor):
            raise TypeError(f"h must return a torch.Tensor, got {type(out).__name__}.")
        a = self.num_constraints
        if out.shape != z.shape[:-1] + (a,):
            raise ValueError(f"h must map (..., n) to (..., a) with a = k.shape[-1] = {a}: for an input of shape "
                             f"{tuple(z.shape)} it returned shape {tuple(out.shape)}.")
        if out.dtype != z.dtype:
            raise TypeError(f"h must return the input's dtype {z.dtype}, got {out.dtype}.")
        return out

    def residual(self, z: Tensor) -> Tensor:
        """:math:`h(z) - k`, shape ``broadcast(z.shape[:-1], batch_shape) + (a,)``."""
        return self.value(z) - self.k

    def jacobian(self, z: Tensor) -> Tensor:
        r""":math:`J(z)`, ``(..., n) -> (..., a, n)``. By ``torch.func``: one ``vjp`` of ``h`` and a ``vmap`` over the
        ``a`` unit cotangents (cost of ``a`` backward passes, vectorised); differentiable w.r.t. ``z`` (the
        samplers' :math:`\nabla\log\det` needs that)."""
        z = self._points(z)
        if self._jacobian is not None:
            J = self._jacobian(z)
            expected = z.shape[:-1] + (self.num_constraints, z.shape[-1])
            if not isinstance(J, Tensor) or J.shape != expected:
                got = tuple(J.shape) if isinstance(J, Tensor) else type(J).__name__
                raise ValueError(f"jacobian must map (..., n) to (..., a, n) = {tuple(expected)} for an input of shape "
                                 f"{tuple(z.shape)}, got {got}.")
            return J
        a = self.num_constraints
        eye = torch.eye(a, dtype=z.dtype, device=z.device)
        out_shape = z.shape[:-1] + (a,)
        cotangents = eye.reshape((a,) + (1,) * (len(out_shape) - 1) + (a,)).expand((a,) + out_shape)
        if a == 1:  # one backward pass, no vmap
            pullback = torch.func.vjp(self.value, z)[1]
            row: Tensor = pullback(cotangents[0])[0]
            return row.unsqueeze(-2)
        if self._use_vmap:
            try:
                pullback = torch.func.vjp(self.value, z)[1]
                rows: Tensor = torch.func.vmap(pullback)(cotangents)[0]  # (a, ..., n)
                return rows.movedim(0, -2)
            except (RuntimeError, NotImplementedError):  # h is not vmap-able: a loop of backward passes
                self._use_vmap = False
        with torch.enable_grad():
            zz = z if z.requires_grad else z.detach().requires_grad_(True)
            out = self.value(zz)
            graph = z.requires_grad and torch.is_grad_enabled()
            rows_list = [torch.autograd.grad(out, zz, cotangents[i], retain_graph=True, create_graph=graph,
                                             allow_unused=True)[0] for i in range(a)]
        rows_list = [torch.zeros_like(z) if r is None else r for r in rows_list]
        return torch.stack(rows_list, -2)

    def value_and_jacobian(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """``(h(z), J(z))``."""
        return self.value(z), self.jacobian(z)

    # ------------------------------------------------------------------ feasibility
    def scale(self, z: Tensor, value: Tensor | None = None, J: Tensor | None = None) -> Tensor:
        r"""The per-row scale :math:`s_i(z) = (|J||z|)_i + |h_i(z) - (Jz)_i| + |k_i|` (module docstring),
        ``(..., a)``, without gradient."""
        with torch.no_grad():
            if value is None:
                value = self.value(z)
            if J is None:
                J = self.jacobian(z)
            Jz = (J @ z.unsqueeze(-1)).squeeze(-1)
            return (J.abs() @ z.abs().unsqueeze(-1)).squeeze(-1) + (value - Jz).abs() + self.k.abs()

    def row_ratio(self, z: Tensor, value: Tensor | None = None, J: Tensor | None = None) -> Tensor:
        r""":math:`|h_i(z) - k_i| / s_i(z)` per row, ``(..., a)`` (feasible: every ratio at most
        :func:`feasibility_tol`); an exact zero residual gives 0 even where :math:`s_i = 0`."""
        with torch.no_grad():
            if value is None:
                value = self.value(z)
            r = (value - self.k).abs()
            s = self.scale(z, value, J)
            return torch.where(r == 0, torch.zeros_like(r), r / s)

    def check(self, z: Tensor, tol: float | None = None) -> Tensor:
        """Boolean ``(...)``: does ``z`` meet every row to ``tol`` (default :func:`feasibility_tol`)?"""
        z = self._points(z)
        tol = feasibility_tol(z.dtype) if tol is None else tol
        return (self.row_ratio(z) <= tol).all(-1)

    def assert_feasible(self, z: Tensor, what: str = "z", value: Tensor | None = None,
                        J: Tensor | None = None, error: type[Exception] = ManifoldError) -> None:
        """``error`` (default :class:`ManifoldError`; ``ValueError`` for a user's argument) naming the batch element,
        the row, the residual and the tolerance unless every row of every element of ``z`` is feasible (one host
        read)."""
        ratio = self.row_ratio(z, value, J)
        tol = feasibility_tol(z.dtype)
        bad = ~(ratio <= tol)
        if bool(bad.any()):
            where = _first_bad(bad)
            if value is None:
                value = self.value(z)
            res = (value - self.k).expand(ratio.shape)[where].item()
            s = self.scale(z, value, J).expand(ratio.shape)[where].item()
            raise error(
                f"{what} is not on the manifold h(z) = k: at batch index {where[:-1]}, row {where[-1]}, "
                f"|h(z) - k| = {abs(res):.3e} exceeds tol * s = {tol:.0e} * {s:.3e} "
                f"({int(bad.any(-1).sum())} element(s) fail).")

    # ------------------------------------------------------------------ a sampler's last step
    def last_step(self, loc: Tensor, scale: Tensor, noise: Tensor | None = None) -> Tensor:
        r"""Finish a diffusion / flow sampler on :math:`\mathcal M` (``final=`` of :mod:`hardeq.diffusion`).

        With ``noise`` (standard normals, ``loc``'s shape) one ``"linearised"`` draw per row of ``loc`` of
        :math:`\mathcal N(\mathrm{loc}, \mathrm{diag}(\mathrm{scale}^2)) \mid h = k` (the tangent-plane
        conditional at the mode, returned along :math:`\Sigma J_*^\top`); with ``noise=None`` the mode, the
        :math:`\Sigma^{-1}`-metric projection of ``loc`` onto :math:`\mathcal M`. For an affine ``h`` these are the
        linear conditional's sample (Matheron's rule with the same noise) and mean.

        Args:
            loc: ``(B, n)`` (the flattened :math:`\hat x_0`), float32 or float64; ``k`` is cast to its dtype and
                device (``h`` must accept them), ``k``'s batch shape ``()`` or ``(B,)``.
            scale: standard deviations ``(n,)`` or ``(B, n)``, positive.
            noise: ``(B, n)`` standard normals, or ``None``.

        Returns:
            ``(B, n)``, every row of :math:`h = k` within the per-row tolerance (one host read).

        Raises:
            ManifoldError: a row could not be brought onto :math:`\mathcal M` (it names the batch element and row).

        Cost: one projection (Newton on the KKT system) and, for a draw, one tangent-plane sample and a few
        Newton steps in the ``a`` normal coordinates.
        """
        cls = type(self).distribution_class
        if cls is None:  # (registered when hardeq.manifold is imported, which importing this class does)
            raise RuntimeError("hardeq.manifold.distribution is not imported.")
        con = self.to(device=loc.device, dtype=loc.dtype)
        dist = cls(loc, scale, constraint=con, validate_args=False)
        z: Tensor = dist.mode if noise is None else dist.rsample(noise=noise)
        con.assert_feasible(z, "the last step's sample" if noise is not None else "the last step's projection")
        return z

    def __repr__(self) -> str:
        name = getattr(self.h, "__name__", type(self.h).__name__)
        return f"NonlinearConstraint(h={name}, a={self.num_constraints}, batch_shape={tuple(self.batch_shape)})"
