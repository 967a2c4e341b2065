r""":class:`BlockDiagonalCovariance`: one low-rank + diagonal block per group (e.g. per graph of a PyG batch).

With group ids :math:`h(i)` (``index``, PyG's ``batch`` vector), a factor ``W`` (``n x r``) and scales
:math:`\sigma`,

.. math::
    \Sigma_{ij} = [h(i) = h(j)]\; W_{i\cdot}W_{j\cdot}^\top + [i = j]\;\sigma_i^2,

i.e. :math:`\Sigma = \mathrm{blockdiag}_g(W_gW_g^\top + \mathrm{diag}(\sigma_g^2))` with :math:`W_g` the rows of
group ``g``: nodes of one molecule correlate, molecules do not. Square root :math:`F = [\mathrm{diag}(\sigma),
\tilde W]` with :math:`\tilde W` the ``n x (G r)`` block matrix (group ``g``'s rows of ``W`` in columns
``g r .. g r + r - 1``), so a sample consumes ``n + G r`` normals. Inverse and log-determinant go through one
``r x r`` capacitance matrix per group, :math:`C_g = I + W_g^\top D_g^{-1}W_g` (Woodbury). Nothing ``n x n`` is formed.

Cost (``G`` groups, batch ``B``): the capacitance factors O(B n r^2 + B G r^3) once; a product with ``F``,
:math:`F^\top`, :math:`\Sigma` or :math:`\Sigma^{-1}` O(B n r p) for ``p`` vectors. A
:class:`~hardeq.SumConstraint` whose every group contains whole covariance groups (the same groups, or coarser)
keeps the O(n) grouped path: one pair registration (``"grouped"``) below.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.distributions import constraints

from .._utils import check_group_index, check_same_dtype_device, check_tensor, is_tracing, stale_without_graph
from ..constraints import SumConstraint, pairs
from ..constraints._cache import PerTensorCache, no_host_reads
from ..ops.group_sum import GroupSum
from .device import profile
from .covariance import (Covariance, _check_positive, _finite_verdict, _positive_verdict, low_rank_max_abs_sqrt,
                         register_trace_inv_mul)

__all__ = ["BlockDiagonalCovariance"]

#: per index tensor, ``{num_groups as given (None: the default): (num_groups, counts, GroupSum)}``: a training
#: loop builds the covariance each step on the same ``batch`` vector, whose check and layout are made once
_INDEX_LAYOUTS = PerTensorCache(snapshot_on_reuse=True)


def _index_layout(index: Tensor, num_groups: int | None) -> tuple[int, Tensor, GroupSum]:
    """``(G, counts, GroupSum)`` of a group-id vector, checked (values in ``[0, G)``, no empty group; ``G`` is
    ``index.max() + 1`` unless given) the first times an index tensor is used and remembered while it lives
    unchanged (the lookup compares its contents: on the host on a CPU, on the device and deferred where a read-back
    synchronises, :mod:`hardeq.constraints._cache`). Under tracing: computed afresh."""
    entries = None
    if not is_tracing():
        with no_host_reads(not profile(index.device).host_guards):
            entries = _INDEX_LAYOUTS.get(index)
        hit = None if entries is None else entries.get(num_groups)
        if hit is not None:
            return hit  # type: ignore[no-any-return]  # (the cache holds Any)
    explicit = num_groups is not None
    G = num_groups if num_groups is not None else (int(index.max()) + 1 if index.numel() else 0)
    counts = check_group_index(index, G, "a = num_groups" if explicit else "a = index.max() + 1")
    layout = (G, counts, GroupSum(index, G, counts))
    if not is_tracing():
        if entries is None:
            entries = {}
            _INDEX_LAYOUTS.put(index, entries)
        entries[num_groups] = layout
    return layout


class BlockDiagonalCovariance(Covariance):
    r""":math:`\Sigma = \mathrm{blockdiag}_g(W_gW_g^\top + \mathrm{diag}(\sigma_g^2))` over the groups of ``index``.

    Args:
        index (LongTensor): group id of each coordinate, ``(n,)``, values in ``[0, G)``, no empty group (PyG's
            ``batch`` vector); shared by the batch.
        cov_factor (Tensor): ``W``, ``(*batch, n, r)``; row ``i`` interacts only with rows of its own group.
        scale (Tensor): standard deviations of the diagonal part, ``(*batch, n)``, positive.
        num_groups (int, optional): ``G``; default ``index.max() + 1``.

    Example:
        >>> index = torch.tensor([0, 0, 0, 1, 1])
        >>> cov = BlockDiagonalCovariance(index, torch.ones(5, 1), torch.ones(5))
        >>> cov.dense()[0, 3], cov.dense()[0, 1], cov.noise_size
        (tensor(0.), tensor(1.), 7)
    """

    arg_constraints = {"cov_factor": constraints.independent(constraints.real, 2),  # noqa: RUF012
                       "scale": constraints.independent(constraints.positive, 1)}

    def __init__(self, index: Tensor, cov_factor: Tensor, scale: Tensor, *, num_groups: int | None = None) -> None:
        if not isinstance(index, Tensor) or index.dtype != torch.long or index.dim() != 1:
            raise TypeError(f"index must be a 1-D torch.long tensor of group ids, got "
                            f"{getattr(index, 'dtype', type(index).__name__)} of shape "
                            f"{tuple(getattr(index, 'shape', ()))}.")
        check_tensor("cov_factor", cov_factor, min_dim=2)
        check_tensor("scale", scale, min_dim=1)
        check_same_dtype_device(cov_factor=cov_factor, scale=scale)
        n = scale.shape[-1]
        if cov_factor.shape[-2] != n or index.shape[0] != n:
            raise ValueError(f"cov_factor must have shape (..., n, r) and index shape (n,) with n = scale.shape[-1] = "
                             f"{n}, got {tuple(cov_factor.shape)} and {tuple(index.shape)}.")
        if index.device != scale.device:
            raise ValueError(f"index is on device {index.device} but scale is on {scale.device}.")
        try:
            torch.broadcast_shapes(cov_factor.shape[:-2], scale.shape[:-1])
        except RuntimeError:
            raise ValueError(f"batch shapes of cov_factor {tuple(cov_factor.shape[:-2])} and scale "
                             f"{tuple(scale.shape[:-1])} do not broadcast.") from None
        self._set(index, _index_layout(index, num_groups), cov_factor, scale)

    def _set(self, index: Tensor, layout: tuple[int, Tensor, GroupSum], cov_factor: Tensor, scale: Tensor) -> None:
        num_groups, self.counts, self._group_sum = layout
        self.batch_shape = torch.broadcast_shapes(cov_factor.shape[:-2], scale.shape[:-1])
        self.index, self.num_groups = index, num_groups
        self.cov_factor, self.scale = cov_factor, scale
        self.rank = cov_factor.shape[-1]
        self.event_size = scale.shape[-1]
        self.noise_size = self.event_size + num_groups * self.rank
        self._cap_tril: Tensor | None = None

    # ------------------------------------------------------------------ identity
    def tensors(self) -> tuple[Tensor, ...]:
        return (self.cov_factor, self.scale)

    def with_tensors(self, *tensors: Tensor) -> "BlockDiagonalCovariance":
        index = self.index.to(tensors[0].device)
        if index is not self.index:
            return BlockDiagonalCovariance(index, *tensors, num_groups=self.num_groups)
        new = object.__new__(BlockDiagonalCovariance)  # (the same index: its checked layout, no second check)
        new._set(index, (self.num_groups, self.counts, self._group_sum), *tensors)
        return new

    def check_values(self) -> None:
        from .._utils import check_finite

        check_finite("cov_factor", self.cov_factor)
        _check_positive("scale", self.scale)

    def _value_verdict(self) -> Tensor | None:
        return _finite_verdict(self.cov_factor) & _positive_verdict(self.scale)

    # ------------------------------------------------------------------ group helpers
    def _sum_rows(self, X: Tensor) -> Tensor:
        """Per-group sums over the rows: ``(*, n, r, p) -> (*, G, r, p)`` (two-level summation)."""
        lead = X.shape[:-3]
        out = self._group_sum.matmul(X.reshape(lead + (X.shape[-3], -1)))
        return out.reshape(lead + (self.num_groups,) + X.shape[-2:])

    def _gather_rows(self, T: Tensor) -> Tensor:
        """Each group's ``(r, p)`` block to its members: ``(*, G, r, p) -> (*, n, r, p)``."""
        return T.index_select(-3, self.index)

    @property
    def capacitance_tril(self) -> Tensor:
        r"""Cholesky factors of :math:`C_g = I + W_g^\top D_g^{-1}W_g`, ``(*batch, G, r, r)``, computed once (again when
        that was under ``no_grad`` and a gradient is needed now)."""
        if stale_without_graph(self._cap_tril, self.cov_factor, self.scale):
            W = self.cov_factor
            Dinv_W = W / self.scale.square().unsqueeze(-1)
            cap = self._sum_rows(Dinv_W.unsqueeze(-1) * W.unsqueeze(-2))
            self._cap_tril = torch.linalg.cholesky(cap + torch.eye(self.rank, dtype=W.dtype, device=W.device))
        assert self._cap_tril is not None  # (set just above when missing)
        return self._cap_tril

    # ------------------------------------------------------------------ the six methods
    def sqrt_matmul(self, X: Tensor) -> Tensor:
        n, G, r = self.event_size, self.num_groups, self.rank
        bottom = X[..., n:, :].reshape(X.shape[:-2] + (G, r, X.shape[-1]))
        return self.scale.unsqueeze(-1) * X[..., :n, :] + (self.cov_factor.unsqueeze(-1)
                                                           * self._gather_rows(bottom)).sum(-2)

    def sqrt_t_matmul(self, Y: Tensor) -> Tensor:
        top = self.scale.unsqueeze(-1) * Y
        bottom = self._sum_rows(self.cov_factor.unsqueeze(-1) * Y.unsqueeze(-2))  # (*, G, r, p)
        bottom = bottom.reshape(bottom.shape[:-3] + (-1, Y.shape[-1]))
        shape = torch.broadcast_shapes(top.shape[:-2], bottom.shape[:-2])
        return torch.cat([top.expand(shape + top.shape[-2:]), bottom.expand(shape + bottom.shape[-2:])], dim=-2)

    def diagonal(self) -> Tensor:
        return self.cov_factor.square().sum(-1) + self.scale.square()

    def logdet(self) -> Tensor:
        cap = 2 * self.capacitance_tril.diagonal(dim1=-2, dim2=-1).log().sum((-2, -1))
        return cap + 2 * self.scale.abs().log().sum(-1)

    def inv_matmul(self, X: Tensor) -> Tensor:
        r"""Woodbury per group: :math:`D^{-1}X - D^{-1}\tilde W C^{-1}\tilde W^\top D^{-1}X`. Rows of group ``g`` of the
        result depend only on rows of group ``g`` of ``X``, so ``X`` may also hold group-local columns (the compact
        form of a block matrix such as :math:`\tilde W`)."""
        var = self.scale.square().unsqueeze(-1)
        U = X / var
        T = self._sum_rows(self.cov_factor.unsqueeze(-1) * U.unsqueeze(-2))  # (*, G, r, p)
        T = torch.cholesky_solve(T, self.capacitance_tril)
        return U - (self.cov_factor.unsqueeze(-1) * self._gather_rows(T)).sum(-2) / var

    # ------------------------------------------------------------------ overridden for speed
    def inv_diagonal(self) -> Tensor:
        r""":math:`1/\sigma_i^2 - \lVert L_{h(i)}^{-1}W_i^\top/\sigma_i^2\rVert^2`: O(n r^2)."""
        var = self.scale.square()
        M = torch.linalg.solve_triangular(self._gather_rows(self.capacitance_tril),
                                          (self.cov_factor / var.unsqueeze(-1)).unsqueeze(-1), upper=False)
        out: Tensor = 1 / var - M.square().sum((-2, -1))
        return out

    def diag_part(self) -> Tensor | None:
        return self.scale.square()

    def factor_part(self) -> Tensor | None:
        r""":math:`\tilde W`, the ``(*batch, n, G r)`` block matrix (formed only by the generic pairwise trace)."""
        W = self.cov_factor
        onehot = torch.zeros(self.index.shape + (self.num_groups,), dtype=W.dtype, device=W.device)  # (n, G)
        onehot.scatter_(-1, self.index.unsqueeze(-1), 1.0)  # (one_hot would read the index range on the host)
        return (onehot.unsqueeze(-1) * W.unsqueeze(-2)).flatten(-2)

    def max_abs_sqrt(self) -> Tensor:
        return low_rank_max_abs_sqrt(self.scale, self.cov_factor)

    def __repr__(self) -> str:
        return (f"BlockDiagonalCovariance(n={self.event_size}, groups={self.num_groups}, rank={self.rank}, "
                f"batch_shape={tuple(self.batch_shape)})")


@register_trace_inv_mul(BlockDiagonalCovariance, BlockDiagonalCovariance)
def _trace_block_pair(p: BlockDiagonalCovariance, q: BlockDiagonalCovariance) -> Tensor:
    r"""Same groups: :math:`\langle\mathrm{diag}\,\Sigma_p^{-1}, \sigma_q^2\rangle
    + \langle W_q, \Sigma_p^{-1}W_q\rangle`
    with :math:`\Sigma_p^{-1}` applied to the compact (group-local) columns of :math:`W_q`: O(n r^2)."""
    if p.index is not q.index and not torch.equal(p.index, q.index):
        d, V = q.diag_part(), q.factor_part()
        assert d is not None and V is not None  # (a block-diagonal covariance has both parts)
        return (p.inv_diagonal() * d).sum(-1) + p.inv_quad_matrix(V)
    return (p.inv_diagonal() * q.scale.square()).sum(-1) + (q.cov_factor * p.inv_matmul(q.cov_factor)).sum((-2, -1))


#: the verdict of :func:`_groups_nest` per pair of group layouts (the covariance's, the constraint's), each made
#: once per index tensor: a training loop pairs the same ``batch`` vector's constraint and covariance every step
_NESTED: "weakref.WeakKeyDictionary[GroupSum, weakref.WeakKeyDictionary[GroupSum, bool]]" = weakref.WeakKeyDictionary()


def _groups_nest(constraint: SumConstraint, covariance: BlockDiagonalCovariance) -> bool:
    """Does every covariance group lie inside one constraint group? O(n) and one host read the first time a pair
    of index tensors meets, then remembered with their layouts (which are remade when an index changes)."""
    inner = _NESTED.setdefault(covariance._group_sum, weakref.WeakKeyDictionary())
    verdict = inner.get(constraint._group_sum)
    if verdict is None:
        g, h = constraint.group_index, covariance.index.to(constraint.group_index.device)
        G = covariance.num_groups
        lo = torch.full((G,), g.numel(), dtype=g.dtype, device=g.device).scatter_reduce(0, h, g, "amin")
        hi = torch.full((G,), -1, dtype=g.dtype, device=g.device).scatter_reduce(0, h, g, "amax")
        verdict = inner[constraint._group_sum] = bool(torch.equal(lo, hi))
    return verdict


@pairs.register_pair("grouped", SumConstraint, BlockDiagonalCovariance)
def _grouped_sum_block(constraint: SumConstraint, covariance: BlockDiagonalCovariance) -> pairs.Grouped | None:
    r"""Every covariance group inside one constraint group: :math:`\Sigma A^\top = \mathrm{diag}(w)A^\top` with
    :math:`w_i = (\Sigma\mathbf 1_{g(i)})_i = \sigma_i^2 + W_i\cdot\sum_{j : h(j) = h(i)}W_j`, and
    :math:`A\Sigma A^\top = \mathrm{diag}(Aw)`. O(n r); ``None`` when some covariance group straddles two constraint
    groups."""
    if is_tracing():  # a data-dependent test: under torch.compile / torch.func the dense path is taken
        return None
    if not _groups_nest(constraint, covariance):
        return None
    W = covariance.cov_factor
    sums = covariance._group_sum.matmul(W)  # (*, G, r)
    w = covariance.scale.square() + (W * sums.index_select(-2, covariance.index)).sum(-1)
    return pairs.Grouped(w, constraint.matvec(w))
