r"""Equality completion (ECNN): predict the independent outputs, solve the constraint for the dependent ones.

With a fixed set :math:`D` of ``a`` dependent columns (:math:`A_D` invertible) and :math:`I` the others,

.. math::
    y_D = A_D^{-1} (k - A_I y_I).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import _AffineLayer, check_vector, dependent_operator, fill_dependent, greedy_pivots

__all__ = ["EqualityCompletion"]


class EqualityCompletion(_AffineLayer):
    r"""Equality completion (ECNN): ``y_D`` solved from :math:`A_D y_D = k - A_I y_I`.

    A drop-in layer: ``forward`` takes the full ``n``-vector (so the network still outputs ``n`` values;
    the entries at ``dependent`` are ignored and receive zero gradient) and returns it completed. A network
    that outputs only the ``n - a`` independent values uses :meth:`complete` instead. :math:`A_D^{-1}` and
    :math:`A_D^{-1} A_I` are computed once in float64 (one LU solve) in ``__init__``; a call costs two small
    mat-vecs. Exactly differentiable w.r.t. ``y`` and ``k``.

    Args:
        constraint_matrix (Tensor): ``A``, shape ``(*batch, a, n)``, full row rank, ``a < n``, float32/64.
        constraint_value (Tensor, optional): default right-hand side ``k`` (``(*batch, a)``).
        dependent (sequence of int or LongTensor, optional): the ``a`` dependent columns (in any order,
            shared by all batch elements); ``A[..., :, dependent]`` must be invertible. Default: the first
            invertible set scanning the columns left to right (greedy: a column is taken when it is
            independent of those taken before, in every batch element).

    Attributes:
        dependent (LongTensor): ``(a,)``, the dependent columns.
        independent (LongTensor): ``(n - a,)``, the other columns in increasing order.

    Raises:
        ValueError: if ``dependent`` has the wrong length, repeats or is out of range, or ``A_D`` is singular.

    Shapes:
        - y: ``(*sample, *batch, n)``; constraint_value: ``(*batch, a)``; output ``(*sample, *batch, n)``.
        - y_independent (:meth:`complete`): ``(*sample, *batch, n - a)``.

    Example:
        >>> A = torch.tensor([[1.0, 1.0, 1.0]])
        >>> layer = EqualityCompletion(A)  # default: y_0 = k - y_1 - y_2
        >>> layer.dependent, layer.independent
        (tensor([0]), tensor([1, 2]))
        >>> layer(torch.tensor([9.0, 0.25, 0.5]), torch.tensor([1.0]))
        tensor([0.2500, 0.2500, 0.5000])
        >>> layer.complete(torch.tensor([0.25, 0.5]), torch.tensor([1.0]))
        tensor([0.2500, 0.2500, 0.5000])
    """

    dependent: Tensor
    independent: Tensor

    def __init__(self, constraint_matrix: Tensor, constraint_value: Tensor | None = None, *,
                 dependent: Sequence[int] | Tensor | None = None) -> None:
        super().__init__(constraint_matrix, constraint_value)
        A = self.constraint_matrix
        owner = type(self).__name__
        a, n = A.shape[-2:]
        if dependent is None:
            dep = greedy_pivots(A, torch.arange(n), shared=True, owner=owner)
        else:
            dep = _check_dependent(dependent, a, n, owner).to(A.device)
            A_D = A.detach().double()[..., dep]
            rank = torch.linalg.matrix_rank(A_D)
            if bool((rank < a).any()):
                raise ValueError(
                    f"{owner}: constraint_matrix[..., :, dependent] must be invertible, but with dependent = "
                    f"{dep.tolist()} it has rank {int(rank.min())} < a = {a} (in some batch element); choose "
                    "other dependent columns, or leave dependent=None for the default selection."
                )
        mask = torch.ones(n, dtype=torch.bool, device=A.device)
        mask[dep] = False
        self.register_buffer("dependent", dep)
        self.register_buffer("independent", torch.nonzero(mask).squeeze(-1))
        self._refresh()

    def _refresh(self) -> None:
        E, R0 = dependent_operator(self.constraint_matrix, self.dependent)
        self._gain: Tensor  # derived buffers (typed here: nn.Module's attribute lookup says Tensor | Module)
        self._reduced: Tensor
        self._set_derived(_gain=E, _reduced=R0)

    def forward(self, y: Tensor, constraint_value: Tensor | None = None) -> Tensor:
        r"""Replace ``y[..., dependent]`` by :math:`A_D^{-1}(k - A_I y_I)`; the rest passes through."""
        y, k = self._inputs(y, constraint_value)
        return fill_dependent(y, k, self._gain, self._reduced, self.dependent)

    def complete(self, y_independent: Tensor, constraint_value: Tensor | None = None) -> Tensor:
        r"""Full ``n``-vector from the ``n - a`` independent values (ordered as :attr:`independent`)."""
        A = self.constraint_matrix
        n, a = self.event_size, self.num_constraints
        y_I = check_vector("y_independent", y_independent, size=n - a, size_name="n - a", dtype=A.dtype,
                           device=A.device, owner=type(self).__name__)
        y = y_I.new_zeros(y_I.shape[:-1] + (n,)).index_copy(-1, self.independent, y_I)
        out: Tensor = self(y, constraint_value)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dependent={self.dependent.tolist()}"


def _check_dependent(dependent: object, a: int, n: int, owner: str) -> Tensor:
    if isinstance(dependent, Tensor):
        if dependent.dtype not in (torch.int32, torch.int64) or dependent.dim() != 1:
            raise TypeError(f"{owner}: dependent must be a 1-D integer tensor or a sequence of ints, got a "
                            f"{dependent.dtype} tensor of shape {tuple(dependent.shape)}.")
        values = dependent.tolist()
    elif isinstance(dependent, Sequence) and all(isinstance(i, int) for i in dependent):
        values = list(dependent)
    else:
        raise TypeError(f"{owner}: dependent must be a sequence of ints, got {type(dependent).__name__}.")
    if len(values) != a:
        raise ValueError(f"{owner}: dependent must list a = {a} column indices (one per constraint), got "
                         f"{len(values)}: {values}.")
    if len(set(values)) != a:
        raise ValueError(f"{owner}: dependent must not repeat a column, got {values}.")
    if any(not 0 <= v < n for v in values):
        raise ValueError(f"{owner}: dependent indices must lie in [0, n) with n = {n}, got {values}.")
    return torch.tensor(values, dtype=torch.long)
