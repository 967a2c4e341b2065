r"""Orthogonal projection onto :math:`\{y : A y = k\}` (KKT-hPINN, Chen et al., 2024).

.. math::
    \Pi(y) = y - A^\top (A A^\top)^{-1} (A y - k),

the solution of :math:`\min_z \|z - y\|^2` s.t. :math:`A z = k` (its KKT system solved in closed form).
It is the conditional mean of :math:`\mathcal N(y, I)` given :math:`A z = k`
(``ConstrainedNormal(y, torch.ones_like(y), constraint=c).mean``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._utils import batch_mv
from ..constraints import EqualityConstraint
from ..linalg.triangular import tri_solve_vec
from ._common import _AffineLayer, check_constraint, check_y_against_constraint

__all__ = ["KKTProjection", "kkt_projection"]


class KKTProjection(_AffineLayer):
    r"""Orthogonal projection onto the affine subspace :math:`\{y : A y = k\}` (KKT-hPINN).

    .. math::
        \Pi(y) = y - A^\top (A A^\top)^{-1} (A y - k) = y - W^\top (W y - C^{-1} k),
        \qquad A A^\top = C C^\top,\; W = C^{-1} A.

    ``C`` (Cholesky factor) and ``W`` (one triangular solve, no explicit inverse) are computed once in
    float64 in ``__init__`` and stored as buffers in ``A``'s dtype; a call costs two ``a x n`` mat-vecs per
    sample plus an ``a x a`` triangular solve of ``k``. Exactly differentiable w.r.t. ``y`` (Jacobian
    :math:`I - A^\top(AA^\top)^{-1}A`) and ``k`` (Jacobian :math:`A^\top(AA^\top)^{-1}`); ``A`` is fixed.

    Args:
        constraint_matrix (Tensor): ``A``, shape ``(*batch, a, n)``, full row rank, ``a < n``, float32/64.
        constraint_value (Tensor, optional): default right-hand side ``k`` (``(*batch, a)``), used when
            ``forward`` gets none.

    Shapes:
        - y: ``(*sample, *batch, n)``; constraint_value: ``(*batch, a)``, e.g. one ``k = b - B x`` per input.
        - output: the broadcast shape ``(*sample, *batch, n)``.

    Example:
        >>> A = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
        >>> layer = KKTProjection(A)
        >>> layer
        KKTProjection(a=1, n=4)
        >>> layer(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[2.0]]))  # subtract the mean excess
        tensor([[-1.,  0.,  1.,  2.]])
    """

    def __init__(self, constraint_matrix: Tensor, constraint_value: Tensor | None = None) -> None:
        super().__init__(constraint_matrix, constraint_value)
        self._refresh()

    def _refresh(self) -> None:
        A = self.constraint_matrix
        A64 = A.to(torch.float64)
        C = torch.linalg.cholesky(A64 @ A64.mT)  # (*batch, a, a); full row rank checked in __init__
        W = torch.linalg.solve_triangular(C, A64, upper=False)  # (*batch, a, n), rows orthonormal
        self._cholesky: Tensor  # derived buffers (typed here: nn.Module's attribute lookup says Tensor | Module)
        self._whitened: Tensor
        self._set_derived(_cholesky=C.to(A.dtype), _whitened=W.to(A.dtype))

    def forward(self, y: Tensor, constraint_value: Tensor | None = None) -> Tensor:
        r"""Project ``y`` onto :math:`\{A y = k\}`, ``k = constraint_value`` (or the default)."""
        y, k = self._inputs(y, constraint_value)
        W = self._whitened
        r = batch_mv(W, y) - tri_solve_vec(self._cholesky, k, upper=False)  # (*, a) = C^{-1} (A y - k)
        return y - batch_mv(W.mT, r)


def kkt_projection(y: Tensor, constraint: EqualityConstraint) -> Tensor:
    r"""Functional form of :class:`KKTProjection`: :math:`y - A^\top (A A^\top)^{-1}(A y - k)`.

    The constraint projects itself (:meth:`~hardeq.constraints.EqualityConstraint.project`): O(n) for a
    :class:`~hardeq.SumConstraint`, O(nnz + a^2) for a :class:`~hardeq.SparseConstraint` (cached Cholesky of
    :math:`AA^\top`),
    O(n a) for a :class:`~hardeq.LinearConstraint` after one float64 QR of its ``A`` (cached on the constraint).
    Differentiable w.r.t. ``y``, ``k`` and a dense ``A`` that requires grad.

    Args:
        y (Tensor): ``(*sample, *batch, n)``.
        constraint (EqualityConstraint): ``A z = k`` with batch shape ``batch``.

    Returns:
        Tensor: ``(*sample, *batch, n)``, satisfying ``A out = k`` to round-off.

    Examples:
        >>> from hardeq.baselines import kkt_projection
        >>> A = LinearConstraint(torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]]), torch.tensor([4.0, 3.0]))
        >>> z = kkt_projection(torch.tensor([1.0, 2.0, 5.0, 5.0]), A)
        >>> z, bool(A.check(z))
        (tensor([ 2.2000, -0.6000,  2.4000,  1.2000]), True)
    """
    constraint = check_constraint(constraint, "kkt_projection")
    y = check_y_against_constraint(y, constraint, "kkt_projection")
    return constraint.project(y)

