"""Paired significance tests over seeds (the numbers the docs quote are computed here, not by hand)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["paired_ttest", "paired_wilcoxon"]


def paired_wilcoxon(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int]:
    """Two-sided Wilcoxon signed-rank test of the paired differences ``a_i - b_i`` (one pair per seed).

    Args:
        a, b: per-seed values of two methods, paired by seed (same length ``n``).

    Returns:
        ``{"n", "wins"`` (pairs with ``a_i < b_i``), ``"median_diff"`` (median of ``a - b``),
        ``"median_ratio"`` (median of ``a / b``), ``"statistic", "p"}``; ``p`` is exact for ``n <= 50``
        without ties (scipy's default), 1.0 when every difference is 0, NaN when ``n < 2``.
    """
    import numpy as np
    from scipy.stats import wilcoxon

    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"a and b must be 1-D and paired (same length), got shapes {x.shape} and {y.shape}.")
    n = int(x.size)
    d = x - y
    out: dict[str, float | int] = {
        "n": n, "wins": int((d < 0).sum()),
        "median_diff": float(np.median(d)) if n else math.nan,
        "median_ratio": float(np.median(x / y)) if n and bool((y != 0).all()) else math.nan,
    }
    if n < 2:
        return {**out, "statistic": math.nan, "p": math.nan}
    if not bool((d != 0).any()):
        return {**out, "statistic": 0.0, "p": 1.0}
    res = wilcoxon(x, y, alternative="two-sided")
    return {**out, "statistic": float(res.statistic), "p": float(res.pvalue)}


def paired_ttest(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int]:
    """Two-sided paired t-test of ``a_i - b_i`` (one pair per seed), for few seeds where the Wilcoxon test
    cannot reach small p-values (with ``n = 3`` its smallest two-sided p is 0.25).

    Returns:
        ``{"n", "mean_diff", "sd_diff", "t", "p"}``; ``p`` is NaN when ``n < 2``, 1.0 when every difference is 0,
        and 0.0 when the differences are equal and non-zero.
    """
    import numpy as np
    from scipy.stats import ttest_rel

    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"a and b must be 1-D and paired (same length), got shapes {x.shape} and {y.shape}.")
    d = x - y
    n = int(d.size)
    out: dict[str, float | int] = {"n": n, "mean_diff": float(d.mean()) if n else math.nan,
                                   "sd_diff": float(d.std(ddof=1)) if n > 1 else math.nan}
    if n < 2:
        return {**out, "t": math.nan, "p": math.nan}
    if not bool((d != 0).any()):
        return {**out, "t": 0.0, "p": 1.0}
    if float(d.std()) == 0.0:
        return {**out, "t": math.copysign(math.inf, float(d.mean())), "p": 0.0}
    res = ttest_rel(x, y)
    return {**out, "t": float(res.statistic), "p": float(res.pvalue)}
