r"""Constraint layer (CL) for linear equalities (Stoian et al., ICLR 2024).

Variables are ranked by an ordering. Each equality is solved for its highest-ranked variable after the
equalities solved before it have been substituted in, i.e. Gaussian elimination along the ordering: the
reduced row echelon form of :math:`A` whose pivots are, scanning variables from the highest-ranked down,
the first variable with a non-zero coefficient in a not-yet-used row. With :math:`D` the ``a`` pivot
(dependent) variables and :math:`F` the others,

.. math::
    y_F \leftarrow y_F, \qquad y_D \leftarrow A_D^{-1}(k - A_F y_F),

so each dependent variable is a function of lower-ranked free variables only, as in sequential
substitution. The network's outputs at :math:`D` are overwritten and receive no gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from ._common import (
    _AffineLayer,
    check_constraint,
    check_order,
    check_y_against_constraint,
    dependent_operator,
    fill_dependent,
    greedy_pivots,
)

__all__ = ["ConstraintLayer", "constraint_layer"]


class ConstraintLayer(_AffineLayer):
    r"""Constraint layer (CL): solve each equality for its highest-ranked variable, pass the rest through.

    The elimination (pivot choice, :math:`E = A_D^{-1}` and :math:`R_0 = E A` with zeroed ``D`` columns) is
    done once in float64 in ``__init__``; a call computes :math:`y_D = E k - R_0 y` (two small mat-vecs) and
    scatters it into ``y``. Exactly differentiable w.r.t. ``y`` and ``k``; the gradient w.r.t. ``y_D`` is
    exactly zero. A batched ``A`` gets its own pivots per batch element.

    Args:
        constraint_matrix (Tensor): ``A``, shape ``(*batch, a, n)``, full row rank, ``a < n``, float32/64.
        constraint_value (Tensor, optional): default right-hand side ``k`` (``(*batch, a)``).
        order (sequence of int or LongTensor, optional): the variable ordering, a permutation of
            ``range(n)`` listed from lowest to highest rank; each constraint is solved for its latest
            variable in ``order``. Default: coordinate order (the last coordinates become dependent).

    Attributes:
        dependent (LongTensor): the pivot variables, ``(*batch, a)``, in elimination order (highest first).

    Shapes:
        - y: ``(*sample, *batch, n)``; constraint_value: ``(*batch, a)``.
        - output: ``(*sample, *batch, n)``.

    Example:
        >>> A = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
        >>> layer = ConstraintLayer(A)
        >>> layer.dependent  # y_3 from row 2, then y_2 from row 1
        tensor([3, 2])
        >>> layer(torch.tensor([1.0, 2.0, 5.0, 5.0]), torch.tensor([4.0, 3.0]))
        tensor([1., 2., 1., 0.])
    """

    dependent: Tensor

    def __init__(self, constraint_matrix: Tensor, constraint_value: Tensor | None = None, *,
                 order: Sequence[int] | Tensor | None = None) -> None:
        super().__init__(constraint_matrix, constraint_value)
        self._order = check_order(order, self.event_size, type(self).__name__)
        self._refresh()

    def _refresh(self) -> None:
        A = self.constraint_matrix
        column_order = _scan_order(self._order, A.shape[-1])
        dependent = greedy_pivots(A, column_order, shared=False, owner=type(self).__name__)
        E, R0 = dependent_operator(A, dependent)
        self._gain: Tensor  # derived buffers (typed here: nn.Module's attribute lookup says Tensor | Module)
        self._reduced: Tensor
        self._set_derived(dependent=dependent, _gain=E, _reduced=R0)

    def forward(self, y: Tensor, constraint_value: Tensor | None = None) -> Tensor:
        r"""Overwrite the dependent variables of ``y`` so that ``A y = k`` (``k = constraint_value``)."""
        y, k = self._inputs(y, constraint_value)
        return fill_dependent(y, k, self._gain, self._reduced, self.dependent)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self._order is None else ", order=custom")


def constraint_layer(y: Tensor, constraint: EqualityConstraint, order: Sequence[int] | Tensor | None = None
                     ) -> Tensor:
    r"""Functional form of :class:`ConstraintLayer`; differentiable w.r.t. ``y`` and ``k`` (and a dense ``A``).

    A grouped-sum constraint (one with a ``group_index``, e.g. :class:`~hardeq.SumConstraint`) takes an O(n)
    path: in each group the highest-ranked member becomes the group total minus the other members. Any other
    constraint is materialised (``dense_rows()``, ``a x n``) and eliminated once per ``A`` tensor (O(a^2 n);
    again on every call when ``A`` requires grad or an ``order`` is given).

    Args:
        y (Tensor): ``(*sample, *batch, n)``, e.g. a reparameterised unconstrained Gaussian sample.
        constraint (EqualityConstraint): ``A z = k``.
        order (sequence of int or LongTensor, optional): see :class:`ConstraintLayer`.

    Returns:
        Tensor: ``(*sample, *batch, n)`` with ``A out = k`` to round-off.

    Examples:
        >>> from hardeq.baselines import constraint_layer
        >>> total = SumConstraint(torch.zeros(4, dtype=torch.long), torch.tensor([2.0]))
        >>> constraint_layer(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), total)  # the last member becomes 2 - (1 + 2 + 3)
        tensor([[ 1.,  2.,  3., -4.]])
    """
    constraint = check_constraint(constraint, "constraint_layer")
    y = check_y_against_constraint(y, constraint, "constraint_layer")
    n = constraint.event_size
    order_t = check_order(order, n, "constraint_layer")
    if constraint.group_index is not None:
        return _sum_constraint_layer(y, constraint, order_t)
    return fill_dependent(y, constraint.k, *_elimination(constraint, order_t, n))


#: eliminations of constraints whose matrix needs no gradient and that have no operator cache, per constraint
#: object (and default order): the constrained_layer estimator calls the layer on every rsample of one distribution
_ELIMINATIONS: "weakref.WeakKeyDictionary[EqualityConstraint, tuple[Tensor, Tensor, Tensor]]" = \
    weakref.WeakKeyDictionary()


def _elimination(constraint: EqualityConstraint, order: Tensor | None, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(E, R0, dependent)`` of the Gaussian elimination of ``A`` (pivots from its entries); computed once per
    operator tensor (:meth:`~hardeq.EqualityConstraint.operator_cache`: a new constraint on the same ``A``
    each step reads the host only once, when the pivots are chosen), else once per constraint object, when
    ``order`` is None and ``A`` needs no gradient."""
    shared = constraint.operator_cache() if order is None else None
    cached = None
    if order is None:
        cached = shared.get("elimination") if shared is not None else _ELIMINATIONS.get(constraint)
    if cached is not None:
        return cached
    A = constraint.dense_rows()  # Gaussian elimination chooses pivots from the entries of A
    dependent = greedy_pivots(A, _scan_order(order, n), shared=False, owner="constraint_layer")
    E, R0 = dependent_operator(A, dependent)
    if order is None and not A.requires_grad:
        if shared is not None:
            shared["elimination"] = (E, R0, dependent)
        else:
            _ELIMINATIONS[constraint] = (E, R0, dependent)
    return E, R0, dependent


def _scan_order(order: Tensor | None, n: int) -> Tensor:
    """Columns from the highest-ranked variable down."""
    return torch.arange(n - 1, -1, -1) if order is None else order.flip(0)


def _sum_constraint_layer(y: Tensor, constraint: EqualityConstraint, order: Tensor | None) -> Tensor:
    """O(n) CL for grouped sums: the highest-ranked member of each group is total minus the others."""
    index = constraint.group_index
    assert index is not None  # (called for a constraint with a group_index only)
    n, a = constraint.event_size, constraint.num_constraints
    rank = torch.arange(n, device=index.device)
    if order is not None:
        order = order.to(index.device)
        rank = torch.empty_like(rank).scatter_(0, order, rank)  # rank[order[i]] = i
    top = torch.full((a,), -1, dtype=torch.long, device=index.device).scatter_reduce(
        0, index, rank, reduce="amax")
    dependent = top if order is None else order[top]  # (a,) the pivot of each group
    free = torch.ones(n, dtype=y.dtype, device=y.device).index_fill(0, dependent, 0.0)
    y_D = constraint.k - constraint.matvec(y * free)  # (*, a)
    out_batch = torch.broadcast_shapes(y.shape[:-1], y_D.shape[:-1])
    return y.expand(out_batch + (n,)).scatter(-1, dependent.expand(out_batch + (a,)),
                                              y_D.expand(out_batch + (a,)))
