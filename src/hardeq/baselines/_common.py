r"""Shared machinery of the sample-then-repair baselines (private).

* argument checks: the constraint matrix once at construction, ``y`` and ``constraint_value`` on every call;
* :class:`_AffineLayer`: the ``nn.Module`` base holding ``A`` (and optionally a default ``k``) as buffers;
* greedy pivot selection (Gaussian elimination along a column order) and the "solve for the dependent
  coordinates" map shared by :class:`~hardeq.baselines.ConstraintLayer` and
  :class:`~hardeq.baselines.EqualityCompletion`.

Both of those layers are instances of one affine map: for a set ``D`` of ``a`` dependent columns with
:math:`A_D` invertible, write :math:`E = A_D^{-1}` and :math:`R_0 = E A` with its ``D`` columns zeroed; then

.. math::
    y_D \leftarrow E k - R_0 y, \qquad y_F \text{ unchanged},

satisfies :math:`A y = A_F y_F + A_D(E k - E A_F y_F) = k`. The layers differ only in how ``D`` is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self

import torch
from torch import Tensor, nn

from .._utils import batch_mv
from ..constraints import EqualityConstraint

__all__: list[str] = []


# ----------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------


def check_constraint_matrix(A: object, owner: str) -> Tensor:
    """Validate ``A`` once: a finite floating tensor ``(*batch, a, n)`` with full row rank ``a < n``."""
    if isinstance(A, EqualityConstraint):
        raise TypeError(
            f"{owner}: constraint_matrix must be a torch.Tensor, got a {type(A).__name__}; use "
            f"{owner}.from_constraint(constraint) to build the layer from a constraint object."
        )
    if not isinstance(A, Tensor):
        raise TypeError(f"{owner}: constraint_matrix must be a torch.Tensor, got {type(A).__name__}.")
    if A.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{owner}: constraint_matrix must have dtype float32 or float64, got {A.dtype}.")
    if A.dim() < 2:
        raise ValueError(
            f"{owner}: constraint_matrix must have shape (*batch, a, n), got shape {tuple(A.shape)}."
        )
    a, n = A.shape[-2:]
    if a == 0 or a >= n:
        raise ValueError(
            f"{owner}: constraint_matrix must have 0 < a < n (fewer constraints than variables), got "
            f"constraint_matrix.shape = {tuple(A.shape)}."
        )
    if not bool(torch.isfinite(A).all()):
        raise ValueError(f"{owner}: constraint_matrix (shape {tuple(A.shape)}) has NaN/inf entries.")
    rank = torch.linalg.matrix_rank(A.detach().double())
    if bool((rank < a).any()):
        raise ValueError(
            f"{owner}: constraint_matrix must have full row rank a = {a}, but some batch element has rank "
            f"{int(rank.min())} (constraint_matrix.shape = {tuple(A.shape)}); remove linearly dependent rows."
        )
    return A


def check_vector(name: str, value: object, *, size: int, size_name: str, dtype: torch.dtype,
                 device: torch.device, owner: str) -> Tensor:
    """Per-call check of a vector argument ``(*batch, size)``: type, dtype, device, last dimension."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(value).__name__}.")
    if value.dtype != dtype:
        raise TypeError(
            f"{owner}: {name} has dtype {value.dtype} but the layer holds {dtype} (convert the input, or the "
            f"layer with .to({value.dtype}))."
        )
    if value.device != device:
        raise ValueError(
            f"{owner}: {name} is on device {value.device} but the layer is on {device} (move one of them)."
        )
    if value.dim() < 1 or value.shape[-1] != size:
        raise ValueError(
            f"{owner}: {name} must have shape (..., {size_name}) with {size_name} = {size}, got "
            f"{name}.shape = {tuple(value.shape)}."
        )
    return value


def check_broadcast(owner: str, **shapes: torch.Size) -> torch.Size:
    """Broadcast batch shapes, raising ``ValueError`` that lists them when they are incompatible."""
    try:
        shape: torch.Size = torch.broadcast_shapes(*shapes.values())
        return shape
    except RuntimeError:
        listed = ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items())
        raise ValueError(f"{owner}: batch dimensions do not broadcast: {listed}.") from None


def check_constraint(constraint: object, owner: str) -> EqualityConstraint:
    if not isinstance(constraint, EqualityConstraint):
        raise TypeError(
            f"{owner}: constraint must be a hardeq constraint (a hardeq.EqualityConstraint, e.g. "
            f"hardeq.LinearConstraint), got "
            f"{type(constraint).__name__}."
        )
    return constraint


def check_y_against_constraint(y: object, constraint: EqualityConstraint, owner: str) -> Tensor:
    """Per-call check of ``y`` against a constraint object (functional forms)."""
    y = check_vector("y", y, size=constraint.event_size, size_name="n", dtype=constraint.dtype,
                     device=constraint.device, owner=owner)
    check_broadcast(owner, y=y.shape[:-1], constraint=constraint.batch_shape)
    return y


# ----------------------------------------------------------------------------------------------------------
# the module base
# ----------------------------------------------------------------------------------------------------------


class _AffineLayer(nn.Module):
    r"""Base of the layers: ``A`` (and an optional default ``k``) as buffers, per-call checks, ``extra_repr``."""

    constraint_matrix: Tensor
    constraint_value: Tensor | None

    def __init__(self, constraint_matrix: Tensor, constraint_value: Tensor | None = None) -> None:
        super().__init__()
        owner = type(self).__name__
        A = check_constraint_matrix(constraint_matrix, owner)
        a = A.shape[-2]
        if constraint_value is not None:
            check_vector("constraint_value", constraint_value, size=a, size_name="a", dtype=A.dtype,
                         device=A.device, owner=owner)
            check_broadcast(owner, constraint_matrix=A.shape[:-2], constraint_value=constraint_value.shape[:-1])
            constraint_value = constraint_value.detach().clone()
        self.register_buffer("constraint_matrix", A.detach().clone())
        self.register_buffer("constraint_value", constraint_value)
        # derived factors are recomputed (in float64) whenever A changes dtype/device or is loaded
        self.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]  # torch: unannotated method
            lambda module, incompatible_keys: module._refresh())

    def _refresh(self) -> None:
        """(Re)compute the derived buffers from ``constraint_matrix``; subclasses override."""

    def _set_derived(self, **buffers: Tensor) -> None:
        for name, value in buffers.items():
            if name in self._buffers:
                self._buffers[name] = value
            else:
                self.register_buffer(name, value, persistent=False)

    def _apply(self, fn: Callable[[Tensor], Tensor], *args: Any, **kwargs: Any) -> Self:  # .to(), .double(), ...
        super()._apply(fn, *args, **kwargs)  # type: ignore[no-untyped-call]  # torch: nn.Module._apply unannotated
        # recompute rather than convert, so that .double() on a float32 layer gives float64 accuracy
        self._refresh()
        return self

    @classmethod
    def from_constraint(cls, constraint: EqualityConstraint, **kwargs: Any) -> Self:
        r"""Build the layer from any :class:`~hardeq.constraints.EqualityConstraint`.

        The layer operates on the matrix by definition, so ``A`` is materialised with
        ``constraint.dense_rows()`` (``a x n``) and ``constraint.k`` becomes the default
        right-hand side, used when ``forward`` is called without ``constraint_value``. Keyword arguments are
        passed to the constructor.
        """
        constraint = check_constraint(constraint, cls.__name__)
        return cls(constraint.dense_rows(), constraint.k, **kwargs)

    @property
    def num_constraints(self) -> int:
        """Number of constraint rows ``a``."""
        return self.constraint_matrix.shape[-2]

    @property
    def event_size(self) -> int:
        """Dimension ``n`` of ``y``."""
        return self.constraint_matrix.shape[-1]

    def _inputs(self, y: object, constraint_value: object) -> tuple[Tensor, Tensor]:
        owner = type(self).__name__
        A = self.constraint_matrix
        y = check_vector("y", y, size=self.event_size, size_name="n", dtype=A.dtype, device=A.device,
                         owner=owner)
        if constraint_value is None:
            if self.constraint_value is None:
                raise ValueError(
                    f"{owner}: constraint_value (k) is required: this layer was built without a default "
                    "right-hand side; call layer(y, constraint_value)."
                )
            constraint_value = self.constraint_value
        k = check_vector("constraint_value", constraint_value, size=self.num_constraints, size_name="a",
                         dtype=A.dtype, device=A.device, owner=owner)
        check_broadcast(owner, y=y.shape[:-1], constraint_value=k.shape[:-1], constraint_matrix=A.shape[:-2])
        return y, k

    def extra_repr(self) -> str:
        s = f"a={self.num_constraints}, n={self.event_size}"
        if self.constraint_matrix.dim() > 2:
            s += f", batch_shape={tuple(self.constraint_matrix.shape[:-2])}"
        return s


# ----------------------------------------------------------------------------------------------------------
# pivot selection and the dependent-coordinate solve
# ----------------------------------------------------------------------------------------------------------


def check_order(order: object, n: int, owner: str) -> Tensor | None:
    """Validate a variable ordering: a permutation of ``range(n)``; ``None`` means coordinate order."""
    if order is None:
        return None
    if isinstance(order, Tensor):
        if order.dtype not in (torch.int32, torch.int64) or order.dim() != 1:
            raise TypeError(f"{owner}: order must be a 1-D integer tensor or sequence, got {order.dtype} "
                            f"tensor of shape {tuple(order.shape)}.")
        values = order.tolist()
    elif isinstance(order, Sequence) and all(isinstance(i, int) for i in order):
        values = list(order)
    else:
        raise TypeError(f"{owner}: order must be a sequence of ints (a permutation of range(n)), got "
                        f"{type(order).__name__}.")
    if sorted(values) != list(range(n)):
        raise ValueError(f"{owner}: order must be a permutation of range(n) with n = {n}, got {values}.")
    return torch.tensor(values, dtype=torch.long)


def greedy_pivots(A: Tensor, column_order: Tensor, *, shared: bool, owner: str) -> Tensor:
    r"""Columns chosen by Gaussian elimination scanning ``column_order``: the greedy basis.

    A column is selected when it is linearly independent (beyond a round-off tolerance) of the columns
    selected before it, i.e. the pivot columns of the reduced row echelon form of ``A[..., column_order]``.
    Row partial pivoting, in float64. With ``shared=True`` one set is chosen for every batch element (a
    column is taken only if it is independent in all of them) and the result has shape ``(a,)``; otherwise
    each batch element gets its own set, shape ``(*batch, a)``. Pivots are listed in selection order.
    """
    a, n = A.shape[-2:]
    batch_shape = A.shape[:-2]
    M = A.detach().to(torch.float64).reshape((-1, a, n))[..., column_order.to(A.device)].clone()  # (B, a, n)
    B = M.shape[0]
    rows = torch.arange(B, device=A.device)
    tol = 1e2 * max(a, n) * torch.finfo(torch.float64).eps * M.abs().amax((-2, -1))  # (B,)
    remaining = torch.ones(B, a, dtype=torch.bool, device=A.device)
    pivots = []
    for _ in range(a):
        absM = M.abs() * remaining.unsqueeze(-1)  # (B, a, n): only rows not yet used as pivot rows
        ok = absM.amax(-2) > tol.unsqueeze(-1)  # (B, n)
        if shared:
            ok = ok.all(0, keepdim=True).expand(B, n)
        found = ok.any(-1)
        if not bool(found.all()):
            extra = (" independent in every batch element; pass dependent=... explicitly" if shared else "")
            raise ValueError(
                f"{owner}: could not find {a} linearly independent columns of constraint_matrix{extra} "
                f"(shape {tuple(A.shape)})."
            )
        j = ok.to(torch.float32).argmax(-1)  # (B,) first admissible column in the scan order
        col = M[rows, :, j] * remaining  # (B, a)
        i = col.abs().argmax(-1)  # (B,) partial pivoting among the unused rows
        pivot_row = M[rows, i] / M[rows, i, j].unsqueeze(-1)  # (B, n)
        factor = M[rows, :, j].clone()
        factor[rows, i] = 0.0
        M = M - factor.unsqueeze(-1) * pivot_row.unsqueeze(-2)
        M[rows, i] = pivot_row
        M[rows, :, j] = 0.0
        M[rows, i, j] = 1.0
        remaining[rows, i] = False
        pivots.append(column_order.to(A.device)[j])
    out = torch.stack(pivots, -1)  # (B, a)
    if shared:
        return out[0]
    return out.reshape(batch_shape + (a,))


def dependent_operator(A: Tensor, dependent: Tensor) -> tuple[Tensor, Tensor]:
    r"""``E = A_D^{-1}`` (``(*batch, a, a)``) and ``R_0 = E A`` with the ``D`` columns set to exactly zero.

    Computed in float64 (one LU solve) and returned in ``A``'s dtype; differentiable w.r.t. ``A``.
    ``dependent`` has shape ``(a,)`` (shared) or ``(*batch, a)``.
    """
    a, n = A.shape[-2:]
    A64 = A.to(torch.float64)
    batch_shape = torch.broadcast_shapes(A.shape[:-2], dependent.shape[:-1])
    A64 = A64.expand(batch_shape + (a, n))
    index = dependent.unsqueeze(-2).expand(batch_shape + (a, a))
    A_D = A64.gather(-1, index)  # (*batch, a, a): column r of A_D is A[:, dependent[r]]
    eye = torch.eye(a, dtype=torch.float64, device=A.device).expand(batch_shape + (a, a))
    sol = torch.linalg.solve(A_D, torch.cat([eye, A64], -1))  # (*batch, a, a + n)
    E = sol[..., :a]
    R0 = sol[..., a:].scatter(-1, index, 0.0)
    return E.to(A.dtype), R0.to(A.dtype)


def fill_dependent(y: Tensor, k: Tensor, E: Tensor, R0: Tensor, dependent: Tensor) -> Tensor:
    r"""Overwrite the dependent coordinates: ``y_D = E k - R_0 y``; every other coordinate passes through.

    ``y`` (``(*sample, *batch, n)``) gets no gradient at the dependent coordinates (``R_0`` is zero there and
    they are overwritten).
    """
    y_D = batch_mv(E, k) - batch_mv(R0, y)  # (*, a)
    out_batch = torch.broadcast_shapes(y.shape[:-1], y_D.shape[:-1])
    a, n = y_D.shape[-1], y.shape[-1]
    index = dependent.expand(out_batch + (a,))
    return y.expand(out_batch + (n,)).scatter(-1, index, y_D.expand(out_batch + (a,)))
