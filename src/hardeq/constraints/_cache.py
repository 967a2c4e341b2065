"""Values derived from a tensor, remembered while that tensor lives unchanged.

The per-step pattern ``LinearConstraint(A, k_step)`` (or ``SparseConstraint``) builds a new constraint object around
the same ``A`` every step; what depends on ``A`` alone (its rank verdict, its QR, a converted sparse layout, the
row-product matrix of its Gram) is computed once. An entry is keyed by ``id(A)``, checked against a weak reference
(the id of a dead tensor may be reused) and ``A._version`` (an in-place change invalidates it), and dies with ``A``.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor

from .._utils import is_tracing

__all__ = ["PerTensorCache"]


class PerTensorCache:
    """A map ``tensor -> value`` that never keeps the tensor alive and forgets it when the tensor changes."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, Any]] = {}

    def __contains__(self, key: int) -> bool:
        """Is there an entry for the tensor with this ``id``?"""
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, A: Tensor) -> Any | None:
        if is_tracing():  # no identity under torch.compile / torch.func: compute afresh
            return None
        entry = self._entries.get(id(A))
        try:
            if entry is not None and entry[0]() is A and entry[1] == A._version:
                return entry[2]
        except RuntimeError:  # inference tensors have no version counter
            pass
        return None

    def put(self, A: Tensor, value: Any) -> None:
        if is_tracing():
            return
        key, entries = id(A), self._entries

        def forget(ref: weakref.ref, key: int = key, entries: dict = entries) -> None:  # entries: alive at exit
            if key in entries and entries[key][0] is ref:
                del entries[key]

        try:
            entries[key] = (weakref.ref(A, forget), A._version, value)
        except (TypeError, RuntimeError):  # no weak reference or no version counter (inference / functional)
            pass
