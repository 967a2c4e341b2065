r"""Data of the ``portfolio`` study: daily closes, calendar periods, and look-ahead-free windows.

Two price tables ship in ``data/`` next to this module (provenance and licences in ``data/SOURCE.md``):

* ``sp500``: 471 S&P 500 constituents, 2015-01-05 .. 2020-09-22 (GPL-3.0, from the R package ``pob``);
* ``sp500_20``: 20 large S&P 500 stocks, 1990-01-02 .. 2022-12-28 (BSD-3-Clause, from ``skfolio``).

A *window* is one allocation decision at trading day ``t`` (the index of the first day held): the model
reads the closes of days ``t - W .. t - 1`` (``W`` = window) and the portfolio is held over days
``t .. t + H - 1`` (``H`` = horizon). Its realised daily returns are
:math:`r_{t+j} = p_{t+j} / p_{t+j-1} - 1` for ``j = 0 .. H-1`` (the first uses the last input close), so a
window touches the closes ``t - W .. t + H - 1``. A window belongs to a period when its *holding* days
``t .. t + H - 1`` all lie in that period; its input may reach back into earlier periods (the past), never
forward. Training decisions therefore end before the validation period starts, and validation decisions
before the test period starts: no window of an earlier split sees a price of a later one.
"""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["CONFIG_PATH", "DATA_DIR", "DATASETS", "PriceTable", "Windows", "PortfolioData", "load_config",
           "load_prices", "make_windows", "load_data"]

CONFIG_PATH = Path(__file__).resolve().parent / "config.json"
DATA_DIR = Path(__file__).resolve().parent / "data"
#: data set name -> file in :data:`DATA_DIR`
DATASETS = {"sp500": "sp500_471stocks_2015-01-05_2020-09-22_close.csv.gz",
            "sp500_20": "skfolio_sp500_20assets_1990-2022_close.csv.gz"}


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """The study's settings (``config.json`` next to this module, or ``path``)."""
    return json.loads(Path(path or CONFIG_PATH).read_text())


@dataclass
class PriceTable:
    """Daily closes.

    Attributes:
        dates: ``(T,)`` ``numpy.datetime64[D]``, strictly increasing trading days.
        tickers: ``N`` names.
        prices: ``(T, N)`` float64, all finite and positive.
    """

    dates: np.ndarray
    tickers: list[str]
    prices: np.ndarray

    def select(self, tickers: list[str]) -> PriceTable:
        """The table restricted to ``tickers`` (in that order); unknown names raise ``ValueError``."""
        pos = {t: i for i, t in enumerate(self.tickers)}
        missing = [t for t in tickers if t not in pos]
        if missing:
            raise ValueError(f"tickers: unknown {missing[:5]} (of {len(missing)}).")
        return PriceTable(self.dates, list(tickers), self.prices[:, [pos[t] for t in tickers]])


def load_prices(name: str) -> PriceTable:
    """Read the shipped table ``name`` (:data:`DATASETS`) and check it (dates increasing, prices > 0).

    The parsed file is cached per process; every call returns its own copy of the arrays."""
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {name!r}.")
    dates, tickers, prices = _read(name)
    return PriceTable(dates.copy(), list(tickers), prices.copy())


@lru_cache(maxsize=None)
def _read(name: str) -> tuple[np.ndarray, tuple[str, ...], np.ndarray]:
    with gzip.open(DATA_DIR / DATASETS[name], "rt", newline="") as fh:
        rows = list(csv.reader(fh))
    tickers = rows[0][1:]
    dates = np.array([r[0] for r in rows[1:]], dtype="datetime64[D]")
    prices = np.array([[float(v) for v in r[1:]] for r in rows[1:]], dtype=np.float64)
    if prices.shape != (len(dates), len(tickers)):
        raise ValueError(f"{DATASETS[name]}: ragged table {prices.shape}.")
    if not (np.diff(dates) > np.timedelta64(0, "D")).all():
        raise ValueError(f"{DATASETS[name]}: dates are not strictly increasing.")
    if not (np.isfinite(prices).all() and (prices > 0).all()):
        raise ValueError(f"{DATASETS[name]}: prices must be finite and positive.")
    return dates, tuple(tickers), prices


@dataclass
class Windows:
    """The decisions of one split.

    Attributes:
        start: ``(K,)`` int, the first held day ``t`` of every window (row of the price table).
        inputs: ``(K, W, N)`` closes of days ``t-W .. t-1`` divided by the close of day ``t-1`` (so the last
            input is 1).
        future: ``(K, H, N)`` closes of days ``t .. t+H-1`` divided by the close of day ``t-1``.
        returns: ``(K, H, N)`` realised daily simple returns of days ``t .. t+H-1``.
        past_returns: ``(K, W-1, N)`` daily returns inside the input window (for the Markowitz baseline).
    """

    start: np.ndarray
    inputs: np.ndarray
    future: np.ndarray
    returns: np.ndarray
    past_returns: np.ndarray

    def __len__(self) -> int:
        return int(self.start.shape[0])

    def tensors(self, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        """The arrays as tensors of ``dtype`` (``start`` stays int64)."""
        out = {k: torch.as_tensor(getattr(self, k), dtype=dtype) for k in ("inputs", "future", "returns",
                                                                          "past_returns")}
        out["start"] = torch.as_tensor(self.start, dtype=torch.long)
        return out


def make_windows(prices: np.ndarray, first: int, last: int, window: int, horizon: int, stride: int = 1) -> Windows:
    """Windows whose held days ``t .. t+H-1`` lie in rows ``first .. last`` (inclusive) of ``prices``.

    Args:
        prices: ``(T, N)`` closes.
        first, last: the period's first and last row.
        window, horizon: ``W >= 2`` and ``H >= 2`` trading days.
        stride: days between consecutive decisions (the first decision is at ``max(first, W)``).

    Returns:
        :class:`Windows` (possibly empty when the period is shorter than ``H`` or has no history before it).
    """
    for arg, v, lo in (("window", window, 2), ("horizon", horizon, 2), ("stride", stride, 1)):
        if not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{arg} must be an integer >= {lo}, got {v!r}.")
    T, N = prices.shape
    if not (0 <= first <= last < T):
        raise ValueError(f"need 0 <= first <= last < {T}, got first={first}, last={last}.")
    starts = np.arange(max(first, window), last - horizon + 2, stride, dtype=np.int64)
    idx_in = starts[:, None] + np.arange(-window, 0)[None]  # (K, W)
    idx_out = starts[:, None] + np.arange(horizon)[None]  # (K, H)
    anchor = prices[starts - 1][:, None, :] if len(starts) else np.zeros((0, 1, N))
    inputs = prices[idx_in] / anchor
    future = prices[idx_out] / anchor
    prev = np.concatenate([np.ones((len(starts), 1, N)), future[:, :-1]], axis=1)
    returns = future / prev - 1.0
    past_returns = inputs[:, 1:] / inputs[:, :-1] - 1.0
    return Windows(starts, inputs, future, returns, past_returns)


@dataclass
class PortfolioData:
    """A price table split by calendar periods into train/val/test windows.

    Attributes:
        table: the (possibly ticker-restricted) :class:`PriceTable`.
        periods: ``{split: (first_date, last_date)}`` as ISO strings, as configured.
        rows: ``{split: (first_row, last_row)}`` rows of the table inside each period.
        splits: ``{split: Windows}``.
        window, horizon: ``W`` and ``H``.
    """

    table: PriceTable
    periods: dict[str, tuple[str, str]]
    rows: dict[str, tuple[int, int]]
    splits: dict[str, Windows]
    window: int
    horizon: int

    @property
    def num_assets(self) -> int:
        return len(self.table.tickers)

    def describe(self) -> dict[str, Any]:
        """JSON-able facts: periods, rows, number of windows, first and last decision dates per split."""
        d = self.table.dates
        out: dict[str, Any] = {"num_assets": self.num_assets, "window": self.window, "horizon": self.horizon}
        for s, w in self.splits.items():
            out[s] = {"period": list(self.periods[s]), "trading_days": self.rows[s][1] - self.rows[s][0] + 1,
                      "windows": len(w),
                      "first_decision": str(d[w.start[0]]) if len(w) else None,
                      "last_decision": str(d[w.start[-1]]) if len(w) else None,
                      "first_input_day": str(d[w.start[0] - self.window]) if len(w) else None,
                      "last_held_day": str(d[w.start[-1] + self.horizon - 1]) if len(w) else None}
        return out


def select_tickers(tickers: list[str], num: int | None, seed: int = 0) -> list[str]:
    """``num`` tickers drawn without replacement by a fixed ``numpy`` generator, kept in table order
    (``None`` or ``num >= len(tickers)``: all)."""
    if num is None or num >= len(tickers):
        return list(tickers)
    if num < 2:
        raise ValueError(f"num_assets must be >= 2 (a sum constraint needs two assets), got {num}.")
    pick = np.sort(np.random.default_rng(seed).choice(len(tickers), size=num, replace=False))
    return [tickers[i] for i in pick]


def load_data(dataset: str, periods: dict[str, list[str]], window: int, horizon: int, *, train_stride: int = 1,
              eval_stride: int = 1, val_stride: int | None = None, num_assets: int | None = None,
              asset_seed: int = 0) -> PortfolioData:
    """Load ``dataset`` and cut the windows of ``periods = {"train"|"val"|"test": [first_date, last_date]}``.

    The periods must be in time order and disjoint (train before val before test); each split must hold at
    least one window. ``train_stride`` thins the (overlapping) training decisions, ``val_stride`` (default
    ``eval_stride``) the validation ones and ``eval_stride`` the test ones. ``num_assets`` stocks are drawn by
    :func:`select_tickers` with ``asset_seed`` (``None``: all).
    """
    table = load_prices(dataset)
    if set(periods) != {"train", "val", "test"}:
        raise ValueError(f"periods must have keys train, val, test; got {sorted(periods)}.")
    table = table.select(select_tickers(table.tickers, num_assets, asset_seed))
    rows: dict[str, tuple[int, int]] = {}
    bounds = []
    for s in ("train", "val", "test"):
        lo, hi = (np.datetime64(x, "D") for x in periods[s])
        if hi < lo:
            raise ValueError(f"periods[{s!r}]: last date {hi} precedes first date {lo}.")
        inside = np.nonzero((table.dates >= lo) & (table.dates <= hi))[0]
        if inside.size == 0:
            raise ValueError(f"periods[{s!r}] = {periods[s]} holds no trading day of {dataset!r} "
                             f"({table.dates[0]} .. {table.dates[-1]}).")
        rows[s] = (int(inside[0]), int(inside[-1]))
        bounds.append((lo, hi))
    for (_, hi0), (lo1, _), names in zip(bounds, bounds[1:], (("train", "val"), ("val", "test"))):
        if not hi0 < lo1:
            raise ValueError(f"periods: {names[0]} must end before {names[1]} starts (time order, no overlap).")
    splits = {s: make_windows(table.prices, *rows[s], window, horizon,
                              stride={"train": train_stride, "val": val_stride or eval_stride}.get(s, eval_stride))
              for s in rows}
    for s, w in splits.items():
        if len(w) == 0:
            raise ValueError(f"periods[{s!r}] holds no window of {window} + {horizon} days; lengthen the period "
                             f"or shorten window/horizon.")
    return PortfolioData(table, {s: tuple(periods[s]) for s in rows}, rows, splits, window, horizon)
