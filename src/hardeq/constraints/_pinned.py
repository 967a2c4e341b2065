r"""The coordinates a constraint determines on its own: a row of ``A`` with one nonzero.

A row :math:`i` whose only nonzero is :math:`a_{ij}` fixes :math:`z_j = k_i / a_{ij}` on the whole plane (a group of
one: an atom alone in its graph, a pinned pixel). The conditioner sets these coordinates to that value exactly after
every step, so that they come back exactly (a total of 0 as 0) whatever the covariance and the factor.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pinned_dense", "pinned_dense_static", "pinned_from_rows", "singleton_rows"]


def pinned_from_rows(single: Tensor, col: Tensor, coef: Tensor, k: Tensor, n: int) -> tuple[Tensor, Tensor]:
    r"""``(mask, values)`` from the singleton rows: ``single`` (``(*batch_A, a)`` bool: the row has one nonzero),
    ``col`` (``(*batch_A, a)``: its column), ``coef`` (``(*batch_A, a)``: its entry) and ``k`` (``(*batch, a)``).
    ``mask`` is ``(*batch_A, n)``; ``values`` is ``(*batch, n)``, :math:`k_i / a_{ij}` at ``j = col[i]`` for every
    singleton row, 0 elsewhere. Differentiable in ``k`` and ``coef``."""
    mask = torch.zeros(single.shape[:-1] + (n,), dtype=torch.long, device=single.device)
    mask = mask.scatter_add_(-1, col, single.long()) > 0
    safe = torch.where(single, coef, torch.ones_like(coef))
    per_row = torch.where(single, k / safe, torch.zeros((), dtype=k.dtype, device=k.device))
    batch = per_row.shape[:-1]
    values = torch.zeros(batch + (n,), dtype=k.dtype, device=k.device)
    return mask, values.scatter_add(-1, col.expand(batch + col.shape[-1:]), per_row)


def singleton_rows(A: Tensor, branch_free: bool = False) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(single, col, coef)`` of :func:`pinned_from_rows` for a dense ``A`` (``(*batch_A, a, n)``): O(a n), one
    host synchronisation; ``None`` when no row of ``A`` has exactly one nonzero (with ``branch_free``: never
    ``None``, no host read). ``coef`` is differentiable in ``A``."""
    with torch.no_grad():
        nz = A.detach() != 0
        single = nz.sum(-1) == 1
        if not branch_free and not bool(single.any()):
            return None
        col = nz.to(torch.uint8).argmax(-1)  # the first (for a singleton row: the only) nonzero of each row
    return single, col, A.gather(-1, col.unsqueeze(-1)).squeeze(-1)


def pinned_dense_static(A: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`pinned_dense` without a host read: the mask and values always (the mask all false when no row has
    one nonzero)."""
    rows = singleton_rows(A, branch_free=True)
    assert rows is not None  # (branch_free)
    return pinned_from_rows(*rows, k, A.shape[-1])


def pinned_dense(A: Tensor, k: Tensor) -> tuple[Tensor, Tensor] | None:
    """:meth:`~hardeq.EqualityConstraint.pinned_values` of a dense ``A`` (``(*batch_A, a, n)``): O(a n), one host
    synchronisation; ``None`` when no row of ``A`` has exactly one nonzero."""
    rows = singleton_rows(A)
    return None if rows is None else pinned_from_rows(*rows, k, A.shape[-1])
