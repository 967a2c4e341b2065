r"""The partitions of blocked Gibbs, drawn once per call as a pool, and its round-off projection onto the plane.

See :mod:`hardeq.bounds.gibbs` for the sweep that uses them and :mod:`hardeq.bounds.sweep` for its kernel. Nothing
here runs per sweep: a sweep picks one partition of the pool by a random index (drawn independently of the state),
so no sort, no permutation and no QR is computed per sweep, and every partition's per-block constants are ready.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..constraints.base import EqualityConstraint
    from .augment import Augmentation

__all__ = ["POOL_ELEMENTS", "POOL_MAX", "POOL_MIN", "Pool", "Projector", "STRATA_JITTER"]

#: jitter of the stratified partitions (odd pool entries), as a fraction of the range of the sorted score
STRATA_JITTER = 0.1
#: partitions per pool: at most this many ...
POOL_MAX = 64
#: ... and at least this many, whatever the memory (the union of their pairings connects each group w.h.p.)
POOL_MIN = 4
#: float64 entries the pool may take (64 MiB) before it is cut towards :data:`POOL_MIN` partitions
POOL_ELEMENTS = 1 << 23
#: the fields of each coordinate slot of a block (last axis of :attr:`Pool.slots`)
SLOT_FIELDS = ("num_lo", "num_hi", "mu", "lo", "hi", "mul_lo", "mul_hi", "dib_v", "ibd")
_F64 = torch.float64


class Pool:
    r""":math:`K` random partitions of the coordinates into blocks, with each block's direction and constants.

    Built once per sampler call (``K`` between :data:`POOL_MIN` and :data:`POOL_MAX`, fewer where the pool would pass
    :data:`POOL_ELEMENTS` entries or an eighth of the call's sweeps times chains) from the generator; a sweep uses
    entry ``k`` drawn uniformly, independently of the state, so a sweep is a mixture of fixed-partition Gibbs kernels
    and leaves the target invariant.

    * **Partitions.** Even entries are uniform: the coordinates ordered by ``group + U(0, 1)`` (a uniformly random
      order inside each group of a grouped sum; of all coordinates otherwise). Odd entries are *stratified*: ordered
      by a score the parameters fix (never the state), jittered by :data:`STRATA_JITTER` of its range, so that
      coordinates alike in that score share blocks (for a grouped sum, how far the mean lies outside the box in
      standard deviations; for a dense ``A``, the norm of the coordinate's column). One sort per entry, at setup.
    * **Blocks.** A grouped sum: consecutive pairs of the order, direction :math:`e_i - e_j`; a pair that straddles
      two groups (and so a group of one, and the last member of an odd group) gets direction 0 and stays put in that
      entry. Otherwise blocks of :math:`s = a + 1` consecutive coordinates (the ``n mod s`` left over stay put), with
      :math:`d_b` the unit null vector of :math:`A_{:,S_b}` (last column of the complete QR of :math:`A_{:,S_b}^\top`,
      one batched QR at setup); a coordinate the constraint determines gets :math:`d_i = 0`.
    * **Constants** (:data:`SLOT_FIELDS`, per slot ``(K, B, Bk, s, 9)``): for the chord, the bound each slot meets
      first moving forward (``num_lo``) and last (``num_hi``) with multipliers :math:`1/d_i` and :math:`-1/d_i`
      (``-inf`` and 1 where :math:`d_i = 0`: no limit), so that :math:`\max_i (\text{num}_i - x_i)\,\text{mul}_i`
      gives :math:`t^-` and :math:`-t^+` at once; ``mu``, ``lo``, ``hi``; :math:`d_i / (v_i \sqrt{\alpha_b})`
      (``dib_v``) and :math:`d_i / \sqrt{\alpha_b}` (``ibd``). Per block (``(K, B, Bk, 2)``):
      :math:`(-\sqrt{\alpha_b}, \sqrt{\alpha_b})`, with :math:`\alpha_b = \sum_i d_i^2 / v_i` (1 where the block
      cannot move). With an augmentation, ``(K, B, r, Bk)``: :math:`W_b = \sum_{i\in b} d_i V_i / (v_i
      \sqrt{\alpha_b})`, the block's share of the mean shift :math:`Vu`.

    Memory: about ``K * B * n * (11 + r / s)`` float64 entries (``B`` the flattened batch). Cost at setup: ``K``
    sorts of ``n`` keys and, for a dense ``A``, one batched QR of ``K B n / s`` matrices ``s x a``.
    """

    def __init__(self, constraint: EqualityConstraint, A: Tensor | None, frozen: Tensor | None, pressure: Tensor,
                 var: Tensor, mu: Tensor, lo: Tensor, hi: Tensor, aug: Augmentation | None,
                 generator: torch.Generator | None, work: int = 1 << 30) -> None:
        """``A``: the dense rows ``(1 or B, a, n)`` float64 (``None`` for a grouped sum); ``frozen``: ``(B, n)``
        coordinates the constraint determines (or ``None``); ``pressure``, ``var`` (:math:`D`), ``mu``, ``lo``,
        ``hi``: ``(B, n)`` float64 (``B`` the flattened batch); ``work``: the sweeps times the chains of the call
        (the pool, whose set-up costs about a sweep of one chain per entry, gets at most an eighth of them)."""
        B, n = var.shape
        device = var.device
        index = constraint.group_index
        self.grouped = index is not None
        r = 0 if aug is None else int(aug.factor.shape[-1])
        if index is not None:
            self.size = 2
            score = pressure                                                # (B, n)
        else:
            assert A is not None
            self.size = A.shape[-2] + 1
            score = A.norm(dim=-2)                                          # (Ba, n)
        s = self.size
        self.count = n // s                                                 # blocks per partition
        per = max(1, B * n * (11 + r // s + 1))
        K = max(POOL_MIN, min(POOL_MAX, POOL_ELEMENTS // per, work // 8))
        self.K = K + K % 2
        K = self.K
        Bp = score.shape[0]
        rank = torch.argsort(torch.argsort(score, dim=-1, stable=True), dim=-1).to(_F64) / n
        rank = rank / (1.0 + STRATA_JITTER)                                 # in [0, 1 / (1 + jitter))
        u = torch.rand((K, Bp, n), dtype=_F64, device=device, generator=generator)
        stratified = (torch.arange(K, device=device) % 2 == 1).view(K, 1, 1)
        key = torch.where(stratified, rank + u * (STRATA_JITTER / (1.0 + STRATA_JITTER)), u)
        if index is not None:
            key = key + index.to(device=device, dtype=_F64)
        perm = torch.argsort(key, dim=-1)                                   # (K, Bp, n)
        blocks = perm[..., : self.count * s].reshape(K, Bp, self.count, s)  # (K, Bp, Bk, s)
        if index is not None:
            g = index.to(device)[blocks]                                    # (K, Bp, Bk, 2)
            same = (g[..., 0] == g[..., 1]).unsqueeze(-1)
            d = torch.where(same, torch.tensor([1.0, -1.0], dtype=_F64, device=device), 0.0)
        else:
            assert A is not None
            Bq = max(Bp, A.shape[0])
            cols = blocks.expand(K, Bq, self.count, s).reshape(K, Bq, 1, self.count * s)
            cols = cols.expand(K, Bq, A.shape[-2], cols.shape[-1])
            sub = A.unsqueeze(0).expand(K, Bq, *A.shape[-2:]).gather(-1, cols)
            sub = sub.reshape(K, Bq, A.shape[-2], self.count, s).permute(0, 1, 3, 4, 2)   # (K, Bq, Bk, s, a)
            d = torch.linalg.qr(sub, mode="complete")[0][..., -1]           # (K, Bq, Bk, s): A[:, S_b] d = 0
            blocks = blocks.expand(K, Bq, self.count, s)
            if frozen is not None:
                fz = frozen.expand(B, n) if frozen.shape[0] == 1 else frozen
                fz = fz.unsqueeze(0).expand(K, B, n).gather(-1, blocks.expand(K, B, self.count, s).reshape(K, B, -1))
                d = d.expand(K, B, self.count, s).masked_fill(fz.view(K, B, self.count, s), 0.0)
        blocks = blocks.expand(K, B, self.count, s)
        d = d.expand(K, B, self.count, s)
        flat = blocks.reshape(K, B, self.count * s)

        def at(t: Tensor) -> Tensor:                                        # (B, n) -> (K, B, Bk, s)
            return t.unsqueeze(0).expand(K, B, n).gather(-1, flat).view(K, B, self.count, s)

        v_b, mu_b, lo_b, hi_b = at(var), at(mu), at(lo), at(hi)
        alpha = (d * d / v_b).sum(-1)                                        # (K, B, Bk)
        moving = alpha > 0
        root = torch.where(moving, alpha, 1.0).sqrt()
        ib = torch.where(moving, 1.0 / root, 0.0).unsqueeze(-1)
        up, down = d > 0, d < 0
        ninf = torch.full_like(lo_b, -math.inf)
        num_lo = torch.where(up, lo_b, torch.where(down, hi_b, ninf))
        num_hi = torch.where(up, hi_b, torch.where(down, lo_b, ninf))
        safe = torch.where(up | down, d, 1.0)
        mul_lo = torch.where(up | down, 1.0 / safe, 1.0)
        mul_hi = torch.where(up | down, -1.0 / safe, 1.0)
        dib_v = d * ib / v_b
        #: coordinate indices of each entry's blocks, flattened: ``(K, B, Bk * s)``
        self.index = flat.contiguous()
        #: per-slot constants (:data:`SLOT_FIELDS`): ``(K, B, Bk, s, 9)``
        self.slots = torch.stack([num_lo, num_hi, mu_b, lo_b, hi_b, mul_lo, mul_hi, dib_v, d * ib], dim=-1)
        #: per-block :math:`(-\sqrt\alpha, \sqrt\alpha)`: ``(K, B, Bk, 2)``
        self.roots = torch.stack([-root, root], dim=-1)
        #: with an augmentation, :math:`W_b^\top` ``(K, B, r, Bk)``, else ``None``
        self.shares: Tensor | None = None
        if aug is not None:
            V = aug.factor.expand(B, n, r).unsqueeze(0).expand(K, B, n, r)
            rows = V.gather(-2, flat.unsqueeze(-1).expand(K, B, self.count * s, r)).view(K, B, self.count, s, r)
            self.shares = (rows * dib_v.unsqueeze(-1)).sum(-2).mT.contiguous()


class Projector:
    r"""The float64 round-off move :math:`z \leftarrow z - VA^\top(AVA^\top)^{-1}(Az - k)` (then clamped), on
    states ``(C, *batch, n)``."""

    def __init__(self, constraint: EqualityConstraint, variance: Tensor) -> None:
        self.con = constraint.to(dtype=_F64)
        self.v = variance
        self.grouped = constraint.group_index is not None
        if self.grouped:
            self.gram = self.con.matvec(variance)                        # (*batch, a): per-group sums of v
        else:
            A = constraint.dense_rows().detach().to(device=variance.device, dtype=_F64)
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
