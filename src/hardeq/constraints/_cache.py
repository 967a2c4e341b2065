"""Values derived from a tensor, remembered while that tensor lives with unchanged contents.

The per-step pattern ``LinearConstraint(A, k_step)`` (or ``SparseConstraint``) builds a new constraint object around
the same ``A`` every step; what depends on ``A`` alone (its rank verdict, its QR, a converted sparse layout, the
row-product matrix of its Gram) is computed once. An entry is keyed by ``id(A)``, checked against a weak reference
(the id of a dead tensor may be reused), ``A._version`` (an in-place change through ``A`` itself invalidates it at
once) and a **snapshot of the contents** of ``A``: an edit through ``A.data`` (or through another view of the same
storage, or under ``torch.no_grad`` on a leaf's ``.data``) does not bump ``A._version``, so every lookup also
compares ``A`` with the copy taken when the entry was stored (``torch.equal``, one pass over ``A``: O(a n), or O(nnz)
for a sparse tensor, against the O(a^2 n) work an entry saves). An entry dies with ``A``.

Memory: the snapshot is one more copy of ``A`` (detached) per live cached tensor.

``PerTensorCache(snapshot_on_reuse=True)`` (the layouts of :class:`~hardeq.SumConstraint`'s group index) takes the
snapshot only when a tensor is used a second time: the first entry holds no copy, a lookup of it is a miss (the value
is computed afresh from the current contents, so an edit in between is seen) and the entry stored after that miss
takes the snapshot. A tensor used once (PyG's ``batch`` vector, a new one every step) then costs no copy; one used
every step is computed twice, then compared as above.

**Without host reads** (inside :func:`no_host_reads`, which :class:`~hardeq.ConstrainedNormal` enters on a device
where a read-back synchronises): the comparison cannot decide on the host whether the entry is stale, so a lookup
returns the entry and checks the contents on the device, deferred (``torch._assert_async``: on a CPU it raises at
once; on a GPU at the next synchronisation). An edit through ``.data`` of a cached tensor then raises instead of
being recomputed around: build the constraint from a new tensor after editing one in place that way.

**Unvalidated constructors** (``validate_args=False``) of :class:`~hardeq.SparseConstraint` (its converted
layouts), :class:`~hardeq.SumConstraint` (its group index's layout) and :class:`~hardeq.LinearConstraint` (the
constants derived from a dense ``A``: its float64 copy, QR, row pairs, ``|A|``) look up with ``trust_version``:
the same live tensor at the same ``_version`` is a hit, with no comparison at all (no kernel, no host read, on any
device). Seen: every in-place operation on the tensor or on a view of it through autograd's version counter
(``index[4] = 2``, ``A.values().mul_(2)``, ``index.copy_(...)``), which bumps ``_version``: the entry is recomputed.
Not seen: an edit
through ``.data``, through ``torch.no_grad()`` writes on ``.data``, or by code that writes the storage without
bumping the counter (another tensor sharing it through ``set_``, DLPack / NumPy views, a custom kernel); the stale
layout is then used. Build the constraint from a new tensor after such an edit, or construct it with
``validate_args=True``, whose lookup compares the contents (on the host on a CPU, on the device, deferred, on a GPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .._utils import is_tracing

__all__ = ["PerTensorCache", "host_reads_allowed", "lookup_on_host", "no_host_reads"]

_NO_HOST_READS: contextvars.ContextVar[bool] = contextvars.ContextVar("hardeq_no_host_reads", default=False)

#: the message of the deferred check of a cached tensor's contents (see the module docstring)
STALE_MESSAGE = ("hardeq: a tensor a constraint caches derived values of (A, or a group index) was modified in place "
                 "without bumping its version (through .data or another view), or holds NaN, since it was first "
                 "used; with validate_args=False (and on a GPU with validation too: lookup_on_host) such an edit is "
                 "not looked for on the host. Build the constraint "
                 "from a new tensor (e.g. A.clone()) after editing it, or use validate_args=True.")


def lookup_on_host(validate: bool, device: torch.device) -> bool:
    """Whether a constraint's constructor compares a cached tensor with its snapshot on the host: with validation
    where a read-back synchronises nothing (a CPU, :func:`hardeq.linalg.device.profile`). Otherwise the comparison is
    made on the device and deferred (the tensor was checked when its entry was made; validation's one host read is
    then the constructor's value checks)."""
    from ..linalg.device import profile

    return validate and profile(device).host_guards


def host_reads_allowed() -> bool:
    """Whether the library may read values back to the host here (``False`` inside :func:`no_host_reads`)."""
    return not _NO_HOST_READS.get()


@contextlib.contextmanager
def no_host_reads(active: bool = True) -> Iterator[None]:
    """Within the block (when ``active``), the library's hot paths make no host read: checks that would read a
    value back are made on the device and deferred (see the module docstring)."""
    if not active:
        yield
        return
    token = _NO_HOST_READS.set(True)
    try:
        yield
    finally:
        _NO_HOST_READS.reset(token)


def _parts(A: Tensor) -> tuple[Tensor, ...]:
    """The tensors that hold the contents of ``A`` (values and, for a sparse layout, its indices), detached."""
    if A.layout == torch.strided:  # (the common case first: an index, a dense matrix; no detach kernel unless needed)
        return (A.detach() if A.requires_grad else A,)
    A = A.detach()
    if A.layout == torch.sparse_coo:
        return (A._indices(), A._values())
    if A.layout == torch.sparse_csr:
        return (A.crow_indices(), A.col_indices(), A.values())
    raise TypeError(f"unsupported layout {A.layout}")


def _snapshot(A: Tensor) -> tuple[Tensor, ...]:
    return tuple(p.clone() for p in _parts(A))


def _unchanged(A: Tensor, snapshot: tuple[Tensor, ...]) -> bool:
    parts = _parts(A)
    if len(parts) == 1 == len(snapshot):  # (a dense tensor)
        p, s = parts[0], snapshot[0]
        return p.shape == s.shape and p.dtype == s.dtype and torch.equal(p, s)
    verdict = _unchanged_verdict(A, snapshot)  # (the parts of a sparse tensor: one host read for all of them)
    return verdict is not None and bool(verdict)


def _unchanged_verdict(A: Tensor, snapshot: tuple[Tensor, ...]) -> Tensor | None:
    """The comparison of :func:`_unchanged` as a 0-dim bool device tensor, not read (``None`` when the shapes or
    dtypes differ: a miss, known on the host)."""
    parts = _parts(A)
    if len(parts) != len(snapshot) or any(p.shape != s.shape or p.dtype != s.dtype for p, s in zip(parts, snapshot)):
        return None
    same = [torch.eq(p, s).all() for p, s in zip(parts, snapshot)]
    return same[0] if len(same) == 1 else torch.stack(same).all()


def _assert_unchanged(A: Tensor, snapshot: tuple[Tensor, ...]) -> bool:
    """The device-side, deferred form of :func:`_unchanged`: ``False`` (a miss) when the shapes or dtypes differ
    (known on the host), else ``True`` with a deferred assertion that the contents are equal."""
    parts = _parts(A)
    if len(parts) != len(snapshot) or any(p.shape != s.shape or p.dtype != s.dtype for p, s in zip(parts, snapshot)):
        return False
    same = [torch.eq(p, s) for p, s in zip(parts, snapshot)]  # (a sparse A's parts: one reduction over all three)
    torch._assert_async((same[0] if len(same) == 1 else torch.cat([x.reshape(-1) for x in same])).all(), STALE_MESSAGE)
    return True


class PerTensorCache:
    """A map ``tensor -> value`` that never keeps the tensor alive and forgets it when the tensor changes (through
    an in-place operation on it or through ``.data``; see the module docstring). With ``snapshot_on_reuse`` the copy
    of the contents is taken at the second use of a tensor, not the first."""

    def __init__(self, *, snapshot_on_reuse: bool = False) -> None:
        self._lazy = snapshot_on_reuse
        self._entries: dict[int, tuple[weakref.ref[Tensor], int, tuple[Tensor, ...] | None, Any]] = {}

    def __contains__(self, key: int) -> bool:
        """Is there an entry for the tensor with this ``id``?"""
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, A: Tensor, trust_version: bool = False) -> Any | None:
        """The value stored for ``A``, or ``None`` (a miss). ``trust_version`` (an unvalidated constructor's lookup):
        a hit needs the same tensor and version only, and its contents are not compared with the snapshot (no
        comparison kernel, no host read; an edit through ``.data`` is then not seen, see the module docstring)."""
        if is_tracing():  # no identity under torch.compile / torch.func: compute afresh
            return None
        key = id(A)
        entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            if entry[0]() is A and entry[1] == A._version:
                if entry[2] is None:  # stored without a snapshot: computed afresh, and the put that follows takes one
                    return None
                if trust_version or (_unchanged if not _NO_HOST_READS.get() else _assert_unchanged)(A, entry[2]):
                    return entry[3]
        except RuntimeError:  # inference tensors have no version counter
            return None
        del self._entries[key]  # changed contents: the value is stale
        return None

    def get_pending(self, A: Tensor) -> tuple[Any, Tensor | None] | None:
        """Like :meth:`get`, without reading the comparison of ``A`` with its snapshot: ``(value, unchanged)`` with
        ``unchanged`` a 0-dim bool device tensor (``None`` when the entry needs no comparison), or ``None`` for a
        miss. The caller reads ``unchanged`` (batched with its own checks: one host read) and, when it is false,
        calls :meth:`forget` and does not use ``value``."""
        if is_tracing():
            return None
        key = id(A)
        entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            if entry[0]() is A and entry[1] == A._version:
                if entry[2] is None:  # (as get: a miss, and the put that follows takes the snapshot)
                    return None
                unchanged = _unchanged_verdict(A, entry[2])
                if unchanged is not None:
                    return entry[3], unchanged
        except RuntimeError:  # inference tensors have no version counter
            return None
        del self._entries[key]
        return None

    def forget(self, A: Tensor) -> None:
        """Drop the entry of ``A`` (if any)."""
        self._entries.pop(id(A), None)

    def put(self, A: Tensor, value: Any) -> None:
        if is_tracing():
            return
        key, entries = id(A), self._entries

        def forget(ref: weakref.ref[Tensor], key: int = key,  # entries: alive at exit
                   entries: dict[int, tuple[weakref.ref[Tensor], int, tuple[Tensor, ...] | None, Any]] = entries
                   ) -> None:
            if key in entries and entries[key][0] is ref:
                del entries[key]

        old = entries.get(key)
        try:
            snapshot = _snapshot(A) if not self._lazy or (old is not None and old[0]() is A) else None
            entries[key] = (weakref.ref(A, forget), A._version, snapshot, value)
        except (TypeError, RuntimeError):  # no weak reference or no version counter (inference / functional)
            pass
