r"""Rejection sampling of the truncated law from the untruncated conditional: exact iid draws.

Draw :math:`z \sim \mathcal N(\mu, \Sigma) \mid Az = k` exactly (Matheron's rule, the distribution's conditioner)
and keep the draws with :math:`l \le z \le u`. The kept draws are iid from the truncated law (the number kept per
batch element is decided by a count, never by the values), every one on the plane to the untruncated per-row
tolerance and inside the box exactly (the test is the box itself; nothing is clamped). Draws are made in rounds for
the whole batch at once; each round is sized from the acceptance measured so far, and a batch element stops
collecting once it has ``num`` draws.

Cost: :math:`\text{num}/p` untruncated draws per batch element for an acceptance :math:`p`, each O(n a)
(O(n) grouped); :class:`~hardeq.TruncatedConstrainedNormal` uses it by default when a pilot measures
:math:`p \ge` :data:`AUTO_THRESHOLD`, i.e. at most ten untruncated draws per kept one.
"""

from __future__ import annotations

import math
import torch
from torch import Tensor

from .target import PlaneTarget

__all__ = ["AUTO_THRESHOLD", "DEFAULT_MAX_DRAWS", "rejection_sample", "RejectionBudgetExceeded"]

#: pilot acceptance at or above which ``method="auto"`` uses rejection (at most 10 untruncated draws per kept one)
AUTO_THRESHOLD = 0.1
#: default cap on untruncated draws per batch element and kept draw (``num * DEFAULT_MAX_DRAWS`` in all)
DEFAULT_MAX_DRAWS = 10_000
#: most vectors drawn in one round (all batch elements together), to bound memory
ROUND_ELEMENTS = 1 << 24


class RejectionBudgetExceeded(RuntimeError):
    """Rejection sampling drew its budget without collecting the requested number of draws (acceptance too low);
    the message gives the measured acceptance. Use ``method="hmc"``.

    Examples:
        >>> from hardeq.bounds import rejection_sample
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total)
        >>> rejection_sample(d, torch.zeros(3, dtype=torch.float64), torch.full((3,), 1.02, dtype=torch.float64), 100,
        ...                  max_draws=1000, generator=torch.Generator().manual_seed(0))  # a thin box around (1, 1, 1)
        Traceback (most recent call last):
            ...
        hardeq.bounds.rejection.RejectionBudgetExceeded: rejection sampling drew ... Use method='hmc' (or ...
    """


@torch.no_grad()
def rejection_sample(dist: object, lower: Tensor, upper: Tensor, num: int, *, max_draws: int | None = None,
                     generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    r"""``num`` exact iid draws of ``dist`` (a :class:`~hardeq.ConstrainedNormal`) truncated to ``[lower, upper]``.

    Args:
        dist: the untruncated conditional (a :class:`~hardeq.ConstrainedNormal` or a
            :class:`~hardeq.bounds.target.PlaneTarget`).
        lower, upper: ``(*batch, n)`` in the compute dtype (``±inf`` where unbounded).
        num: draws per batch element.
        max_draws: cap on untruncated draws per batch element (default ``num * DEFAULT_MAX_DRAWS``, at least
            ``DEFAULT_MAX_DRAWS``).
        generator: for reproducible draws.

    Returns:
        ``(samples, acceptance)``: ``(num, *batch, n)`` in the compute dtype, and the measured acceptance
        ``(*batch)`` float64 (kept / drawn over all rounds).

    Raises:
        RejectionBudgetExceeded: some batch element did not collect ``num`` draws within ``max_draws``.

    Examples:
        >>> from hardeq.bounds import rejection_sample
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total)
        >>> lower, upper = torch.zeros(3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64)
        >>> z, acceptance = rejection_sample(d, lower, upper, 100, generator=torch.Generator().manual_seed(0))
        >>> z.shape, bool(((z >= 0) & (z <= 2)).all()), bool(total.check(z).all()), 0 < float(acceptance) <= 1
        (torch.Size([100, 3]), True, True, True)
    """
    target = PlaneTarget.of(dist)
    batch, n = target.batch_shape, target.event_size
    B = batch.numel()
    loc = target.loc
    cap = max(DEFAULT_MAX_DRAWS, num * DEFAULT_MAX_DRAWS) if max_draws is None else int(max_draws)
    out = torch.empty((num, B, n), dtype=loc.dtype, device=loc.device)
    filled = torch.zeros(B, dtype=torch.long, device=loc.device)
    drawn = torch.zeros(B, dtype=torch.float64, device=loc.device)
    kept = torch.zeros(B, dtype=torch.float64, device=loc.device)
    lo, hi = lower.reshape(B, n), upper.reshape(B, n)
    rate = 1.0
    while num > 0:
        need = int((num - filled).max())
        if need <= 0:
            break
        size = max(16, math.ceil(1.2 * need / rate))
        size = min(size, max(16, 4 * int(drawn.max())), max(16, ROUND_ELEMENTS // max(B * n, 1)))
        z = target.conditioner.sample(loc, (size,), generator=generator).reshape(size, B, n)
        ok = ((z >= lo) & (z <= hi)).all(-1)  # (size, B)
        active = filled < num
        drawn += torch.where(active, float(size), 0.0)
        kept += torch.where(active, ok.sum(0).to(torch.float64), 0.0)
        slot = torch.cumsum(ok.long(), 0) - 1 + filled  # position each kept draw would take
        take = ok & (slot < num) & active
        r, b = take.nonzero(as_tuple=True)
        out[slot[r, b], b] = z[r, b]
        filled = torch.minimum(filled + ok.sum(0) * active, torch.full_like(filled, num))
        # the smallest acceptance among the unfinished elements, (kept + 1) / (drawn + 2); a round is at most four
        # times all the draws so far, so a pessimistic estimate costs at most a constant factor
        unfinished = filled < num
        if bool(unfinished.any()):
            rate = float(((kept + 1) / (drawn + 2))[unfinished].min())
        if bool(((filled < num) & (drawn >= cap)).any()):
            bad = int(((filled < num) & (drawn >= cap)).nonzero()[0])
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(bad), batch)) if len(batch) else ()
            acc = float(kept[bad] / drawn[bad])
            raise RejectionBudgetExceeded(
                f"rejection sampling drew {int(drawn[bad])} untruncated vectors for batch element {idx} and kept "
                f"{int(filled[bad])} of the {num} requested (measured acceptance {acc:.3g}); the box holds too little "
                f"of the conditional's mass for rejection. Use method='hmc' (or raise max_draws).")
    acceptance = (kept / drawn.clamp_min(1)).reshape(batch)
    return out.reshape((num,) + batch + (n,)), acceptance
