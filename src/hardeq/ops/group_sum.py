r"""Grouped sums with precise two-level summation (:class:`GroupSum`, :func:`group_sum`), the gather back to group
members (:func:`gather`) and per-group normalisation (:func:`group_probs`): the operator :math:`A` of a
:class:`~hardeq.SumConstraint` and the normaliser of a grouped multinomial."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._utils import is_tracing

if TYPE_CHECKING:
    from ..constraints._cache import PerTensorCache

__all__ = ["GroupSum", "group_sum", "gather", "group_probs", "SUM_CHUNK"]

#: coordinates per chunk in the two-level summation
SUM_CHUNK = 1024


class GroupSum:
    r"""Per-group sums :math:`(Ax)_j = \sum_{i : g(i) = j} x_i` by a two-level summation.

    Coordinates are scattered into ``(chunk, group)`` slots (chunks of :data:`SUM_CHUNK` consecutive
    coordinates), then the chunks are reduced with ``torch.sum`` (pairwise). A plain ``index_add``
    accumulates sequentially, with relative error ~ ``n eps`` (1.3e-4 at n = 1e6 in float32); this one has
    ~ ``(SUM_CHUNK + log n) eps``. The slot layout is computed once per ``index``.

    Two layouts need no scatter (a scatter accumulates serially, 10-50x slower than a vectorised reduction):

    * equal consecutive blocks (:attr:`block`; one sum, the channels of an image, equal graphs): a reshape and a
      pairwise ``torch.sum``; the gather back is an ``expand``;
    * sorted groups of at most :data:`SUM_CHUNK` coordinates each (:attr:`offsets`; PyG's ``batch`` vector of a
      ragged batch of graphs): one ``torch.segment_reduce`` over contiguous segments, 3x faster than the scatter
      at n = 1e4 on a CPU; each group is summed sequentially, so its error is at most that of one chunk of the
      two-level summation (``SUM_CHUNK eps`` relative to the group's absolute sum). Not under ``torch.compile``
      or a ``torch.func`` transform (no batching rule): the scatter path then.

    Args:
        index (LongTensor): group id of each coordinate, ``(n,)``, values in ``[0, num_groups)``.
        num_groups (int): ``a``.
        counts (LongTensor, optional): members per group, ``(num_groups,)``, when the caller has them already
            (saves one ``bincount``).

    Shapes:
        ``__call__``: ``(*, n) -> (*, a)``; :meth:`matmul`: ``(*, n, m) -> (*, a, m)``.
    """

    def __init__(self, index: Tensor, num_groups: int, counts: Tensor | None = None, *,
                 layout: tuple[int | None, Tensor | None] | None = None) -> None:
        n = index.shape[0]
        chunk = max(SUM_CHUNK, num_groups)
        self.index = index
        self.num_groups = num_groups
        self.num_chunks = -(-n // chunk)
        self._slot: Tensor | None = index if self.num_chunks == 1 else None
        if layout is not None:  # (block, offsets), established by the caller (e.g. one pass over a sorted index)
            self.block, self.offsets = layout
            return
        #: size of each group when the groups are equal consecutive blocks (one sum; the channels of an image;
        #: equal graphs), else None. Then a sum is a reshape + ``torch.sum`` (pairwise, vectorised) and the
        #: gather an ``expand``: no scatter, which accumulates serially (10-50x slower for few groups). Not looked
        #: for when tracing (torch.compile, torch.func, CUDA-graph capture): the test reads a value on the host.
        self.block = None if is_tracing() else _equal_block_size(index, num_groups)
        #: ``(num_groups + 1,)`` segment boundaries when the groups are sorted (``index`` non-decreasing) and at most
        #: :data:`SUM_CHUNK` long but not equal blocks, else None (never under tracing)
        self.offsets = None if self.block is not None else _sorted_offsets(index, num_groups, counts)

    @property
    def slot(self) -> Tensor:
        """Slot of each coordinate in the ``(chunk, group)`` layout of the two-level summation, ``(n,)`` (built on
        first use: the equal-block and segment layouts never need it; not kept when built while tracing)."""
        if self._slot is not None:
            return self._slot
        n, chunk = self.index.shape[0], max(SUM_CHUNK, self.num_groups)
        chunk_of = torch.arange(self.num_chunks, device=self.index.device).repeat_interleave(chunk)[:n]
        slot = chunk_of * self.num_groups + self.index
        if not is_tracing():
            self._slot = slot
        return slot

    def __call__(self, x: Tensor) -> Tensor:
        a = self.num_groups
        if self.block is not None:
            return x.reshape(x.shape[:-1] + (a, self.block)).sum(-1)
        if self.offsets is not None and not is_tracing():
            offsets = self.offsets if x.dim() == 1 else self.offsets.expand(x.shape[:-1] + self.offsets.shape)
            return torch.segment_reduce(x, "sum", offsets=offsets, axis=-1)
        out = x.new_zeros(x.shape[:-1] + (self.num_chunks * a,)).index_add(-1, self.slot, x)
        return out.view(x.shape[:-1] + (self.num_chunks, a)).sum(-2)

    def matmul(self, X: Tensor) -> Tensor:
        a, m = self.num_groups, X.shape[-1]
        if self.block is not None:
            return X.reshape(X.shape[:-2] + (a, self.block, m)).sum(-2)
        out = X.new_zeros(X.shape[:-2] + (self.num_chunks * a, m)).index_add(-2, self.slot, X)
        return out.view(X.shape[:-2] + (self.num_chunks, a, m)).sum(-3)

    def broadcast(self, u: Tensor) -> Tensor:
        r"""Each group's value to its members, ``(*, a) -> (*, n)`` (:math:`A^\top u`)."""
        if self.block is not None:
            return u.unsqueeze(-1).expand(u.shape + (self.block,)).reshape(u.shape[:-1] + (-1,))
        return u.index_select(-1, self.index)

    def add_broadcast_(self, z: Tensor, u: Tensor, weight: Tensor | None = None) -> Tensor:
        r""":math:`z \mathrel{+}= w \circ A^\top u` in place, ``z`` ``(*, n)``, ``u`` ``(*, a)``, ``weight`` ``w``
        broadcastable to ``z`` (``None``: ones); returns ``z``. For equal consecutive blocks it works on the
        ``(*, a, block)`` view of ``z`` with ``u`` broadcast along each block, so :math:`A^\top u` is never
        materialised (one pass over ``z`` instead of two, no ``(*, n)`` temporary); otherwise (other groups, a
        non-contiguous ``z``, a ``w`` whose last dimension broadcasts from 1) ``z.addcmul_(w, broadcast(u))``."""
        if self.block is not None and z.is_contiguous() and (weight is None or weight.shape[-1] == z.shape[-1]):
            a = self.num_groups
            view = z.view(z.shape[:-1] + (a, self.block))
            if weight is None:
                view.add_(u.unsqueeze(-1))
            else:
                view.addcmul_(weight.reshape(weight.shape[:-1] + (a, self.block)), u.unsqueeze(-1))
            return z
        return z.add_(self.broadcast(u)) if weight is None else z.addcmul_(weight, self.broadcast(u))

    def to(self, device: torch.device | str | None) -> "GroupSum":
        return GroupSum(self.index.to(device=device), self.num_groups)


def _sorted_offsets(index: Tensor, num_groups: int, counts: Tensor | None) -> Tensor | None:
    """Segment boundaries ``(num_groups + 1,)`` if ``index`` is non-decreasing and no group has more than
    :data:`SUM_CHUNK` members, else None (O(n), once; not under tracing: data-dependent)."""
    n = index.shape[0]
    if is_tracing() or n < 2 or num_groups < 1:
        return None
    # sorted, with ids in [0, num_groups) (others: not ours to judge, the scatter path reports them as it always did)
    if not bool((index[1:] >= index[:-1]).all() & (index[0] >= 0) & (index[-1] < num_groups)):
        return None
    if counts is None:
        counts = torch.bincount(index, minlength=num_groups)
    if bool(counts.max() > SUM_CHUNK):
        return None
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def _equal_block_size(index: Tensor, num_groups: int) -> int | None:
    """``n / a`` if ``index`` is ``0..0 1..1 ... (a-1)..(a-1)`` in equal blocks, else None (O(n), once)."""
    n = index.shape[0]
    if num_groups < 1 or n % num_groups:
        return None
    block = n // num_groups
    expected = torch.arange(num_groups, device=index.device).repeat_interleave(block)
    return block if torch.equal(index, expected) else None


def group_sum(x: Tensor, index: Tensor | None, num_groups: int = 1) -> Tensor:
    r"""Per-group sums ``(*, n) -> (*, a)``; without ``index``, the sum over all coordinates, ``(*, 1)``. The
    :class:`GroupSum` of an index tensor (its layout: a few host reads) is made once while the tensor lives at the
    same version (:func:`group_sum_of`)."""
    if index is None:
        return x.sum(-1, keepdim=True)
    return group_sum_of(index, num_groups)(x)


def group_sum_of(index: Tensor, num_groups: int) -> GroupSum:
    """The :class:`GroupSum` of ``index`` with ``num_groups`` groups, remembered per index tensor and version (an
    in-place change through the tensor lays it out again; see :mod:`hardeq.constraints._cache`, whose
    unvalidated lookups trust the version the same way). Under tracing: made afresh."""
    cache = _group_sums()
    entries = cache.get(index, trust_version=True)
    made = None if entries is None else entries.get(num_groups)
    if made is None:
        made = GroupSum(index, num_groups)
        if entries is None:
            entries = {}
            cache.put(index, entries)
        entries[num_groups] = made
    return made


@functools.cache
def _group_sums() -> PerTensorCache:
    """The cache of :func:`group_sum_of` (made at its first use: :mod:`hardeq.constraints` imports this module)."""
    from ..constraints._cache import PerTensorCache  # (a leaf module, which imports nothing of ops)

    return PerTensorCache()


def gather(x: Tensor, index: Tensor | None) -> Tensor:
    """Broadcast a per-group value to the group's members: ``(*, a) -> (*, n)`` (``(*, 1)`` without index)."""
    return x if index is None else x.index_select(-1, index)


def group_probs(rate: Tensor, index: Tensor | None, num_groups: int = 1) -> Tensor:
    r""":math:`p_i = \theta_i / \sum_{j : g(j) = g(i)} \theta_j`, shape of ``rate`` ``(*batch, n)``. O(n)."""
    return rate / gather(group_sum(rate, index, num_groups), index)
