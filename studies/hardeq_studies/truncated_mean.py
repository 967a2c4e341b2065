"""The bounded variants' truncated mean: a Monte Carlo mean of ``TruncatedConstrainedNormal`` draws, and a record
of how they were drawn.

The portfolio's long-only weights and the chemical study's non-negative flows both predict with the mean of the
model's conditional law truncated to a box. ``method="auto"`` draws it by rejection when the pilot acceptance
allows (exact iid draws), else by blocked-Gibbs chains from the mode (exact in the stationary law, every draw
feasible; docs/bounds.md). The record names the method and the chains' diagnostics, so that a report can say
whether the chains had mixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["SAMPLER_NAMES", "truncated_mean", "sampler_line", "RHAT_CAVEAT"]

#: how the record's methods read in a report
SAMPLER_NAMES = {"gibbs": "blocked Gibbs", "hmc": "exact HMC", "rejection": "rejection"}


def truncated_mean(truncated, *, draws: int, chains: int, burn_in: int, seed: int) -> tuple[Tensor, dict[str, Any]]:
    """The mean ``batch_shape + (n,)`` of ``draws`` draws of ``truncated`` (a ``TruncatedConstrainedNormal``) and
    the sampler record ``{"method", "min_ess", "max_rhat"}``.

    Markov chains: ``chains`` chains from the mode, ``ceil(draws / chains)`` kept draws each after ``burn_in``
    iterations (at least 4 per chain give an effective sample size and a split R-hat). The draws are taken under a
    forked RNG seeded with ``seed`` (reproducible; the global stream is untouched). ``min_ess`` is the smallest
    effective sample size over the batch and the coordinates (the number of draws for rejection); ``max_rhat`` the
    largest finite split R-hat (``None`` for rejection, or where none is finite: a coordinate pinned at a bound in
    every chain has none)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        out = truncated.sample_with_info((int(draws),), chains=int(chains), burn_in=int(burn_in))
    record = {"method": out.method, "min_ess": _finite(out.ess, "min"), "max_rhat": _finite(out.rhat, "max")}
    return out.samples.mean(0), record


def _finite(values: Tensor | None, reduce: str) -> float | None:
    """The smallest (``reduce="min"``) or largest (``"max"``) finite entry of ``values``, or ``None``."""
    if values is None:
        return None
    finite = values[torch.isfinite(values)]
    return float(getattr(finite, reduce)()) if finite.numel() else None


def sampler_line(label: str, records: Sequence[dict[str, Any]], *, unit: str, over: str) -> str:
    """One markdown bullet: which sampler drew ``label``'s truncated mean in how many of the ``records`` (one per
    run or seed, named ``unit``), with the smallest effective sample size and the largest split R-hat among them
    (taken ``over`` every point of the test set, e.g. ``"window and weight"``)."""
    methods = sorted({r["method"] for r in records})
    used = ", ".join(f"{SAMPLER_NAMES.get(m, m)} in {sum(r['method'] == m for r in records)}/{len(records)} {unit}"
                     for m in methods)
    ess = [r["min_ess"] for r in records if r["min_ess"] is not None]
    rhat = [r["max_rhat"] for r in records if r["max_rhat"] is not None]
    detail = [f"smallest effective sample size {min(ess):.1f}"] if ess else []
    if rhat:  # three decimals, as R-hat near 1 is read; a chain that barely moves gives astronomic values
        detail.append(f"largest split R-hat {max(rhat):.3f}" if max(rhat) < 1e4 else
                      f"largest split R-hat {max(rhat):.3g}")
    return (f"- {label}: the truncated mean was sampled by {used}"
            + (f" ({'; '.join(detail)}, over every {over})" if detail else "") + ".")


#: what a report says under its sampler lines when chains were run: how to read a large split R-hat
RHAT_CAVEAT = ("Split R-hat compares chains of only a few draws each, so a large value can mean strongly "
               "autocorrelated chains as well as chains still near their start")
