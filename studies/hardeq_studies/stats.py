"""Paired significance tests over seeds (the numbers the docs quote are computed here, not by hand)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["paired_ttest", "paired_wilcoxon", "sign_flip_test", "SIGN_FLIP_MAX_N", "EXACT_BESIDE_T"]

#: a paired t-test over at most this many pairs is reported beside an exact sign-flip test (its normality cannot
#: be checked on so few pairs, and heavy tails are common: one trial of a diverging method can dominate the mean)
EXACT_BESIDE_T = 5

#: the largest n :func:`sign_flip_test` enumerates exactly (2^n sign vectors)
SIGN_FLIP_MAX_N = 20


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


def sign_flip_test(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int | str]:
    """Exact two-sided sign-flip permutation test of the paired differences ``d_i = a_i - b_i``.

    Under "no difference" with pairs exchangeable, each ``d_i`` is as likely as ``-d_i``. The statistic is
    ``|sum_i d_i|``; ``p`` is the share of the ``2^n`` sign vectors ``s`` with ``|sum_i s_i d_i| >= |sum_i d_i|``
    (the observed one included, so ``p >= 2 / 2^n`` when some ``d_i != 0``; with ``n = 5`` the smallest p is
    0.0625). It assumes no normality, unlike :func:`paired_ttest`, and uses the differences' sizes, unlike the
    signs-only sign test. Cost: ``O(n 2^n)`` time and memory (``n <= SIGN_FLIP_MAX_N``).

    Returns:
        ``{"n", "mean_diff", "p", "name": "exact sign-flip"}``; ``p`` is NaN when ``n < 2`` and 1.0 when every
        difference is 0.

    Raises:
        ValueError: ``a`` and ``b`` not paired 1-D sequences, or ``n > SIGN_FLIP_MAX_N``.
    """
    import numpy as np

    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"a and b must be 1-D and paired (same length), got shapes {x.shape} and {y.shape}.")
    d = x - y
    n = int(d.size)
    if n > SIGN_FLIP_MAX_N:
        raise ValueError(f"a, b: the exact sign-flip test enumerates 2^n sign vectors; expected n <= "
                         f"{SIGN_FLIP_MAX_N}, got n = {n}")
    out: dict[str, float | int | str] = {"n": n, "mean_diff": float(d.mean()) if n else math.nan,
                                         "name": "exact sign-flip"}
    if n < 2:
        return {**out, "p": math.nan}
    if not bool((d != 0).any()):
        return {**out, "p": 1.0}
    signs = 1.0 - 2.0 * ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1)
    stats = np.abs(signs @ d)
    observed = abs(float(d.sum()))
    # a relative slack so that sign vectors equal to the observed sum up to round-off count as "at least as large"
    hits = int((stats >= observed * (1 - 1e-12)).sum())
    return {**out, "p": hits / 2 ** n}
