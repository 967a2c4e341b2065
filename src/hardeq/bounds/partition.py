r"""The random partitions of blocked Gibbs and its round-off projection onto the plane (no ``n x n`` matrix).

See :mod:`hardeq.bounds.gibbs` for the sweep that uses them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..constraints.base import EqualityConstraint

__all__ = ["Blocks", "Projector", "STRATA_JITTER"]

#: jitter of the stratified partitions (odd sweeps), as a fraction of the range of the sorted score
STRATA_JITTER = 0.1
_F64 = torch.float64


class Blocks:
    """The random partition of one sweep and the blocks' directions, for one constraint (no n x n matrix).

    Even sweeps draw a uniformly random partition; odd sweeps a *stratified* one: the coordinates sorted by a score
    fixed by the parameters (never by the state), with a random jitter of :data:`STRATA_JITTER` of the range, then
    cut in blocks, so that coordinates alike in that score share blocks. The score is, for a grouped sum, how far the
    mean lies outside the box in standard deviations (pressed coordinates pair with pressed ones, free with free:
    the free ones then meet every other sweep however few they are); for a dense ``A``, the norm of the coordinate's
    column (a column much larger than its block's moves little along the block's null vector). Either choice is
    independent of the state, so each sweep still leaves the target invariant."""

    def __init__(self, constraint: EqualityConstraint, frozen: Tensor | None, device: torch.device,
                 pressure: Tensor) -> None:
        n = constraint.event_size
        self.n, self.device = n, device
        index = constraint.group_index
        self.grouped = index is not None
        if index is not None:
            sizes = constraint.group_sizes
            assert sizes is not None  # (declared with group_index)
            self.single = sizes.numel() == 1
            self.key = index.to(device=device, dtype=_F64)
            sorted_groups = index.sort().values.to(device)
            sizes = sizes.to(device)
            starts = torch.cumsum(sizes, 0) - sizes
            pos = torch.arange(n, device=device) - starts[sorted_groups]
            #: sorted positions that open a pair (the next sorted position is its partner, in the same group)
            self.first = ((pos % 2 == 0) & (pos + 1 < sizes[sorted_groups])).nonzero().squeeze(-1)
            self.size, self.count = 2, int(self.first.numel())
            self.direction: Tensor = torch.tensor([1.0, -1.0], dtype=_F64, device=device)
            score = pressure
        else:
            self.A = constraint.dense_rows().detach().to(device=device, dtype=_F64)        # (*bA, a, n)
            self.size = constraint.num_constraints + 1
            self.count = n // self.size
            self.frozen = frozen if frozen is not None and bool(frozen.any()) else None
            score = self.A.norm(dim=-2).reshape(-1, n).mean(0)
        flat = score.reshape(-1, n)
        if bool((flat == flat[0]).all()):                               # one partition for the whole batch
            score = flat[0]
        rank = torch.argsort(torch.argsort(score, dim=-1, stable=True), dim=-1).to(_F64) / n
        #: stratified sort key without its jitter, in [0, 1) within a group: ``(n,)`` or ``(*batch, n)``
        self.rank = rank / (1.0 + STRATA_JITTER)

    def draw(self, generator: torch.Generator | None, sweep: int) -> tuple[Tensor, Tensor]:
        """``(blocks, directions)``: ``(B, s)`` or ``(*batch, B, s)`` coordinate indices (shared or per batch
        element) and their directions, ``(s,)`` or ``(*batch, B, s)`` float64 (unit null vectors of
        ``A[:, S_b]``)."""
        shape = self.rank.shape
        if sweep % 2 == 1:
            jitter = torch.rand(shape, dtype=_F64, device=self.device, generator=generator)
            key = self.rank + jitter * (STRATA_JITTER / (1.0 + STRATA_JITTER))
            perm = torch.argsort(key + self.key if self.grouped else key, dim=-1)
        elif self.grouped and not self.single:
            perm = torch.argsort(self.key + torch.rand(self.n, dtype=_F64, device=self.device, generator=generator))
        else:
            perm = torch.randperm(self.n, device=self.device, generator=generator)
        if self.grouped:
            blocks = torch.stack([perm[..., self.first], perm[..., self.first + 1]], dim=-1)
            return blocks, self.direction
        blocks = perm[: self.count * self.size].view(self.count, self.size)
        sub = self.A[..., blocks].movedim(-3, -2)                        # (*bA, B, a, s)
        q = torch.linalg.qr(sub.mT, mode="complete")[0]                  # (*bA, B, s, s)
        d = q[..., -1]                                                   # (*bA, B, s): A[:, S_b] d = 0
        if self.frozen is not None:
            d = d.masked_fill(self.frozen[..., blocks], 0.0)
        return blocks, d


class Projector:
    r"""The float64 round-off move :math:`z \leftarrow z - VA^\top(AVA^\top)^{-1}(Az - k)` (then clamped)."""

    def __init__(self, constraint: EqualityConstraint, variance: Tensor, blocks: Blocks) -> None:
        self.con = constraint.to(dtype=_F64)
        self.v = variance
        self.grouped = blocks.grouped
        if self.grouped:
            self.gram = self.con.matvec(variance)                        # (*batch, a): per-group sums of v
        else:
            A = blocks.A
            gram = (A * variance.unsqueeze(-2)) @ A.mT                   # (*batch, a, a)
            self.chol = torch.linalg.cholesky(gram)

    def __call__(self, z: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
        r = self.con.matvec(z) - self.con.k                              # (C, *batch, a)
        if self.grouped:
            y = r / self.gram
        else:
            y = torch.cholesky_solve(r.unsqueeze(-1), self.chol).squeeze(-1)
        z = z - self.v * self.con.rmatvec(y)
        return torch.minimum(torch.maximum(z, lo), hi)
