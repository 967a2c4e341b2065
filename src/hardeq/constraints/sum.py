r""":class:`SumConstraint`: grouped sums, every operation a scatter or a gather (O(n))."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._utils import check_finite, check_group_index, check_tensor, group_sizes, is_tracing, validate_default
from .._validation import check_device, not_a_tensor
from ..ops.group_sum import SUM_CHUNK, GroupSum
from ._cache import PerTensorCache, lookup_on_host, no_host_reads
from .base import EqualityConstraint, config_dtype, dtype_name, register_constraint_kind, require_keys

if TYPE_CHECKING:
    from ..linalg.conditioning.grouped_exact import ExactSumOps
    from ..linalg.conditioning.grouped_sample import GroupedOps

__all__ = ["SumConstraint"]


class _Layout:
    """What one ``index`` with ``a`` groups determines: the group sizes (checked), the summation layout, the
    groups of one and the operations of the one-node grouped sample (the last two computed on first use). Shared by
    every constraint on that index."""

    __slots__ = ("any_single", "counts", "exact", "group_sum", "index", "mask", "ops", "sorted")

    def __init__(self, index: Tensor, a: int, counts: Tensor, *,
                 known: tuple[int | None, Tensor | None, bool] | None = None,
                 sorted: tuple[Tensor, int] | None = None) -> None:
        self.index = index
        self.counts = counts
        #: a sorted index's group offsets ``(a + 1,)`` and largest group (None when not known sorted)
        self.sorted = sorted
        #: is there a group of one (None: not known yet), and its members, ``(n,)`` bool (computed on first use)
        self.any_single: bool | None = None if known is None else known[2]
        self.mask: Tensor | None = None
        self.group_sum = GroupSum(index, a, counts, layout=None if known is None else known[:2])
        self.ops: GroupedOps | None = None
        self.exact: ExactSumOps | None = None

    @classmethod
    def of_sorted(cls, index: Tensor, a: int) -> _Layout | None:
        """The layout of PyG's ``batch`` vector, checked in one pass with one host synchronisation: ``index`` rises
        from 0 to ``a - 1`` in steps of 0 or 1 (sorted, every id in range, no empty group); the group sizes come
        from a binary search of the group boundaries, and with them the summation layout (equal blocks or
        segments) and whether a group has one member. ``None`` when ``index`` is not such a vector (the general
        check then runs, and names what is wrong) or under tracing. O(n) elementwise + O(a log n)."""
        n = index.shape[0]
        if n < 2 or a < 1 or is_tracing():
            return None
        ordered = torch.ge(index[1:], index[:-1]).all()  # (a bool per step: no n-sized temporary of longs)
        offsets = torch.searchsorted(index, torch.arange(a + 1, device=index.device))
        counts = offsets.diff()
        smallest, largest = torch.aminmax(counts)
        facts = torch.stack((ordered, offsets[0], offsets[-1], smallest, largest)).tolist()
        # sorted, nothing below 0 (offsets[0] = #{index < 0}), nothing at or above a (offsets[a] = #{index < a}), no
        # empty group: then the steps are 0 or 1 and the index runs from 0 to a - 1
        if not facts[0] or facts[1] != 0 or facts[2] != n or facts[3] < 1:
            return None
        block = n // a if facts[3] == facts[4] else None
        segments = offsets if block is None and facts[4] <= SUM_CHUNK else None
        return cls(index, a, counts, known=(block, segments, facts[3] == 1), sorted=(offsets, int(facts[4])))

    def singles(self) -> tuple[Tensor | None, bool]:
        """``(mask, any)``: the members of groups of one, ``(n,)`` bool (None when there is none), and whether there
        is one (one host synchronisation, once, unless known when the index was checked)."""
        if self.any_single is None:
            self.any_single = bool(self.counts.min() == 1)
        if self.any_single and self.mask is None:
            self.mask = self.counts.index_select(0, self.index) == 1
        return self.mask, self.any_single

    def grouped_ops(self) -> GroupedOps:
        r"""The operations of the one-node grouped sample (:class:`~hardeq.linalg.conditioning.grouped.GroupedOps`):
        segment sums called directly for sorted groups (the sample runs eagerly only, so without the tracing check
        of :class:`~hardeq.ops.GroupSum`), the gather, and the groups of one as two index lists (their members and
        their groups: setting them and zeroing their gradient are short indexed copies instead of passes over
        ``n``)."""
        if self.ops is not None:
            return self.ops
        from ..linalg.conditioning.grouped_sample import GroupedOps

        gs = self.group_sum
        offsets = gs.offsets
        matvec: Callable[[Tensor], Tensor] = gs
        if offsets is not None:
            def matvec(x: Tensor) -> Tensor:  # (unsafe: the offsets are ours, checked when laid out)
                off = offsets if x.dim() == 1 else offsets.expand(x.shape[:-1] + offsets.shape)
                return torch.segment_reduce(x, "sum", offsets=off, axis=-1, unsafe=True)
        mask, any_single = self.singles()
        if mask is None or not any_single:
            self.ops = GroupedOps(matvec, gs.broadcast, matvec, matvec)
            return self.ops
        members = mask.nonzero().squeeze(-1)
        groups = self.index.index_select(0, members)
        p = members.shape[0]

        def pin(z: Tensor, k: Tensor) -> Tensor:
            values = k.index_select(-1, groups)
            return z.index_copy_(-1, members, values if values.dim() == z.dim() and values.shape == z.shape[:-1] + (p,)
                                 else values.expand(z.shape[:-1] + (p,)))

        def unpin(g: Tensor) -> Tensor:
            return g.index_fill_(-1, members, 0.0)

        self.ops = GroupedOps(matvec, gs.broadcast, matvec, matvec, pin, unpin)
        return self.ops


    def exact_ops(self) -> ExactSumOps:
        r"""The operations of the sync-free sample (:class:`~hardeq.linalg.conditioning.grouped_exact.ExactSumOps`),
        built on first use: the group sums (the matvec of :meth:`grouped_ops`), the last member of each group (where
        the repair goes: the segment ends for sorted groups, else the largest position in each group, one scatter)
        and the groups of one (their members and groups, as in :meth:`grouped_ops`)."""
        if self.exact is not None:
            return self.exact
        from ..linalg.conditioning.grouped_exact import ExactSumOps

        ops = self.grouped_ops()
        offsets, index, a = self.group_sum.offsets, self.index, self.counts.shape[0]
        if offsets is not None:
            last = offsets[1:] - 1
        else:
            positions = torch.arange(index.shape[0], device=index.device)
            last = torch.zeros(a, dtype=torch.long, device=index.device).scatter_reduce_(0, index, positions, "amax")
        members = groups = None
        mask, any_single = self.singles()
        if mask is not None and any_single:
            members = mask.nonzero().squeeze(-1)
            groups = index.index_select(0, members)
        self.exact = ExactSumOps(index, a, ops.matvec, last, members, groups, sorted=self.sorted)
        return self.exact


#: per index tensor given by the user: ``{a: _Layout}``, so that the per-step pattern ``SumConstraint(batch, totals)``
#: (a new constraint around the same PyG ``batch`` vector every step) checks and lays out the index twice, then
#: compares it with its copy; the copy is taken at the second use, so a new ``batch`` vector per step (a PyG
#: ``DataLoader``) pays none (no n-sized allocation and copy per step)
_LAYOUTS = PerTensorCache(snapshot_on_reuse=True)


def _layout(index: Tensor, a: int, validate: bool) -> _Layout:
    """The (cached) layout of ``index`` with ``a`` groups; checks the index the first time (range, no empty group).
    Under ``torch.compile`` / ``torch.func`` with validation off: computed afresh, with no data-dependent check."""
    if is_tracing():  # inside a graph: no data-dependent check; with validation, one on the device (deferred)
        counts = group_sizes(index, a)
        if validate and torch._C._functorch.maybe_current_level() is None and index.numel():
            torch._assert_async((index.amin() >= 0) & (index.amax() < a) & (counts.amin() >= 1),
                                f"index values must lie in [0, a) with a = {a}, and every group must have at least "
                                "one coordinate (checked on the device).")
        return _Layout(index, a, counts)
    with no_host_reads(not lookup_on_host(validate, index.device)):  # (else the cache checks it on the device)
        layouts = _LAYOUTS.get(index, trust_version=not validate)  # (unvalidated: the version only, _cache)
    layout = None if layouts is None else layouts.get(a)
    if layout is None:
        layout = _Layout.of_sorted(index, a) or _Layout(index, a, check_group_index(index, a))
        if layouts is None:
            layouts = {}
            _LAYOUTS.put(index, layouts)
        layouts[a] = layout
    return layout


@register_constraint_kind("sum", "channel_sum")
class SumConstraint(EqualityConstraint):
    r"""Grouped sum constraints: :math:`\sum_{i : g(i) = j} z_i = t_j` for every group ``j``.

    Equivalent to a :class:`LinearConstraint` whose ``A`` is the ``a x n`` group-indicator matrix, but every
    operation is a scatter-add or a gather (O(n) time and memory): applying ``A`` sums coordinates per group,
    ``A^T`` broadcasts a group value to its members, :math:`AA^\top = \mathrm{diag}(c)` holds the group sizes
    ``c`` and :math:`A\,\mathrm{diag}(v)A^\top` is diagonal (per-group sums of ``v``). Hence the minimum-norm
    solution spreads each total evenly over its group, :math:`z_0 = A^\top(t / c)`, and the projection
    subtracts each group's mean excess, :math:`z - A^\top((Az - t)/c)`.

    Args:
        index (LongTensor): group id of each coordinate, shape ``(n,)``, values in ``[0, a)``, every group
            non-empty (PyG's ``batch`` vector, an image's channel id, ...). ``index = torch.zeros(n)`` is the
            single sum-to-total constraint.
        total (Tensor): required sum of each group, shape ``(*batch, a)``.
        validate_args (bool, optional): check finiteness of ``total``; defaults to torch.distributions'
            global setting. Shapes, index range and non-empty groups are always checked.

    Example:
        >>> c = SumConstraint(torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, 2.0]))
        >>> c.matvec(torch.ones(5))
        tensor([2., 3.])
        >>> c.particular_solution()
        tensor([0.5000, 0.5000, 0.6667, 0.6667, 0.6667])
    """

    def __init__(self, index: Tensor, total: Tensor, *, validate_args: bool | None = None) -> None:
        if not isinstance(index, Tensor):
            raise not_a_tensor("index", index, "a torch.Tensor of dtype torch.long")
        if index.dtype != torch.long:
            raise TypeError(f"index must have dtype torch.long, got {index.dtype}.")
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D (one group id per coordinate), got shape {tuple(index.shape)}.")
        if isinstance(total, (int, float)):
            total = torch.tensor([float(total)], device=index.device)
        check_tensor("total", total, min_dim=1)
        if total.device != index.device:
            raise ValueError(f"total is on device {total.device} but index is on {index.device}.")
        a, n = total.shape[-1], index.shape[0]
        self._validate_args = validate_default(validate_args)
        # checked once per index tensor (cached while it lives unchanged); under torch.compile / torch.func with
        # validation off, no data-dependent check (static shapes only)
        layout = _layout(index, a, self._validate_args)
        if a >= n:
            raise ValueError(
                f"there must be fewer groups than coordinates (a < n), got a = {a} groups for n = {n}."
            )
        self.index = index
        self.k = total
        self.counts = layout.counts
        # precise two-level summation (hardeq.ops.GroupSum): a plain index_add drifts ~ n eps
        self._group_sum = layout.group_sum
        self._layout = layout
        if self._validate_args:
            check_finite("total", total)

    @property
    def num_constraints(self) -> int:
        return self.k.shape[-1]

    @property
    def event_size(self) -> int:
        return self.index.shape[0]

    @property
    def batch_shape(self) -> torch.Size:
        return self.k.shape[:-1]

    @property
    def group_index(self) -> Tensor:
        """The group id of each coordinate, ``(n,)`` (the ``index`` given to the constructor)."""
        return self.index

    @property
    def group_sizes(self) -> Tensor:
        """Members per group, ``(a,)`` long (computed once, when the index was checked)."""
        return self.counts

    def matvec(self, z: Tensor) -> Tensor:
        return self._group_sum(z)

    def rmatvec(self, u: Tensor) -> Tensor:
        return self._group_sum.broadcast(u)

    def rmatvec_add_(self, z: Tensor, u: Tensor, weight: Tensor | None = None) -> Tensor:
        r""":math:`z \mathrel{+}= w \circ A^\top u` in place (``weight`` ``w`` broadcastable to ``z``, ``None`` for
        ones), for ``z`` ``(*lead, n)`` and ``u`` ``(*lead, a)``; returns ``z``. For equal consecutive groups (one sum,
        the channels of an image) :math:`A^\top u` is never formed: ``u`` is broadcast along each block of a view of
        ``z`` (one pass, no ``(*lead, n)`` temporary)."""
        if z.shape[-1] != self.event_size or u.shape[-1] != self.num_constraints:
            raise ValueError(f"z must have shape (*lead, n) and u (*lead, a) (n = {self.event_size}, a = "
                             f"{self.num_constraints}), got z.shape = {tuple(z.shape)}, u.shape = {tuple(u.shape)}.")
        return self._group_sum.add_broadcast_(z, u, weight)

    def matmul(self, X: Tensor) -> Tensor:
        return self._group_sum.matmul(X)

    @property
    def has_diagonal_gram(self) -> bool:
        return True

    def diagonal_gram(self, variance: Tensor) -> Tensor:
        r"""Per-group sums of ``variance`` (each coordinate is in one group, so the Gram matrix is diagonal),
        with the two-level summation of :meth:`matvec`; shape ``(*batch, a)``."""
        return self.matvec(variance)

    def dense_matrix(self) -> Tensor:
        rows = torch.zeros((self.num_constraints,) + self.index.shape, dtype=self.k.dtype, device=self.k.device)
        return rows.scatter_(0, self.index.unsqueeze(0), 1.0)  # (one_hot would read the index range on the host)

    def logdet_gram_identity(self) -> Tensor:
        r""":math:`\log\det(AA^\top) = \sum_j \log c_j` (group sizes), a scalar; O(a)."""
        return self.counts.to(torch.float64).log().sum().to(self.k.dtype)

    @property
    def storage_numel(self) -> int:
        return self.event_size

    @property
    def operator_requires_grad(self) -> bool:
        return False  # the operator is the group index: integers

    def abs_matvec(self, z_abs: Tensor) -> Tensor:
        return self.matvec(z_abs)

    def pinned_values(self) -> tuple[Tensor, Tensor] | None:
        """Members of groups of one: their value is the group's total."""
        mask, any_pinned = self._layout.singles()
        if mask is None or not any_pinned:
            return None
        return mask, self.k.index_select(-1, self.index)

    def pinned_values_static(self) -> tuple[Tensor, Tensor] | None:
        """Members of groups of one, without a host read: the layout's verdict when it is known, else the mask
        ``sizes[index] == 1`` formed always."""
        layout = self._layout
        if layout.any_single is not None:
            return self.pinned_values()
        return self.counts.index_select(0, self.index) == 1, self.k.index_select(-1, self.index)

    def _exact_sum_ops(self) -> ExactSumOps | None:
        """The sync-free sample's operations of this index (:meth:`_Layout.exact_ops`); None for a subclass."""
        return self._layout.exact_ops() if type(self) is SumConstraint else None

    def _grouped_ops(self) -> GroupedOps | None:
        """The one-node grouped sample's operations of this index (:meth:`_Layout.grouped_ops`); None for a
        subclass (which may override the products: the sample then takes its methods)."""
        return self._layout.grouped_ops() if type(self) is SumConstraint else None

    def _sizes(self, dtype: torch.dtype) -> Tensor:
        return self.counts.to(dtype)

    def particular_solution(self) -> Tensor:
        r""":math:`A^\top(t / c)`: each total spread evenly over its group, ``(*batch, n)``; O(n)."""
        return self.rmatvec(self.k / self._sizes(self.k.dtype))

    def project(self, z: Tensor) -> Tensor:
        r""":math:`z - A^\top((Az - t) / c)`: subtract each group's mean excess; O(n) per vector."""
        self._check_points(z)
        return z - self.rmatvec(self.residual(z) / self._sizes(z.dtype))

    def same_row_space(self, other: EqualityConstraint) -> bool:
        r"""For another grouped constraint: the same partition of the coordinates (group labels may differ),
        O(n log n); otherwise the dense test of the base class."""
        if other is self:
            return True
        other_index = other.group_index if isinstance(other, EqualityConstraint) else None
        if other_index is None:
            return super().same_row_space(other)
        a = self.num_constraints
        if other.num_constraints != a or other_index.shape != self.index.shape:
            return False
        if other_index is self.index or torch.equal(other_index, self.index):  # (the same tensor: no host read)
            return True
        # same partition <=> exactly a distinct (own label, other label) pairs
        return int(torch.unique(self.index * a + other_index.to(self.index.device)).numel()) == a

    def expand(self, batch_shape: torch.Size) -> SumConstraint:
        new = object.__new__(SumConstraint)
        new.index, new.counts, new._validate_args = self.index, self.counts, False
        new._group_sum, new._layout = self._group_sum, self._layout
        new.k = self.k.expand(torch.Size(batch_shape) + self.k.shape[-1:])
        return new

    def with_k(self, k: Tensor) -> SumConstraint:
        check_tensor("k", k, min_dim=1)
        if k.shape[-1] != self.num_constraints or k.device != self.index.device:
            raise ValueError(f"k must have shape (*batch, a) with a = {self.num_constraints} on {self.index.device}, "
                             f"got shape {tuple(k.shape)} on {k.device}.")
        new = self.expand(self.batch_shape)
        new.k = k
        return new

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> SumConstraint:
        check_device(device)
        index, k = self.index.to(device=device), self.k.to(device=device, dtype=dtype)
        if index is self.index and k is self.k:
            return self
        if index is self.index:
            return self.with_k(k)
        return SumConstraint(index, k, validate_args=False)

    def to_config(self) -> dict[str, Any]:
        """``{"kind": "channel_sum", "channels": a, "event_size": n, "totals": [...], "dtype": ...}`` when the groups
        are equal consecutive blocks (the channels of an image), else ``{"kind": "sum", "index": [n ints],
        "totals": [...], "dtype": ...}``; ``totals`` of shape ``(*batch, a)`` as nested lists, floats exact."""
        totals, dtype = self.k.detach().cpu().tolist(), dtype_name(self.dtype)
        if self._group_sum.block is not None:
            return {"kind": "channel_sum", "channels": self.num_constraints, "event_size": self.event_size,
                    "totals": totals, "dtype": dtype}
        return {"kind": "sum", "index": self.index.cpu().tolist(), "totals": totals, "dtype": dtype}

    @classmethod
    def _from_config(cls, config: dict[str, Any]) -> SumConstraint:
        dtype = config_dtype(config)
        if config.get("kind") == "channel_sum":
            require_keys(config, "channels", "event_size", "totals")
            C, n = int(config["channels"]), int(config["event_size"])
            if C <= 0 or n % C:
                raise ValueError(f"a channel_sum config needs event_size = C*H*W divisible by channels = C, got "
                                 f"channels = {C}, event_size = {n}.")
            totals = torch.tensor(config["totals"], dtype=dtype)
            if totals.dim() < 1 or totals.shape[-1] != C:
                raise ValueError(f"channel_sum totals must have shape (C,) or (*batch, C) with C = {C}, got "
                                 f"{tuple(totals.shape)}.")
            return cls(torch.arange(C).repeat_interleave(n // C), totals)
        require_keys(config, "index", "totals")
        return cls(torch.tensor(config["index"], dtype=torch.long), torch.tensor(config["totals"], dtype=dtype))

    def __repr__(self) -> str:
        return (f"SumConstraint(groups={self.num_constraints}, n={self.event_size}, "
                f"batch_shape={tuple(self.batch_shape)})")
