"""The training loop's progress: a ``tqdm`` bar on a terminal, else a status line every ``log_every`` epochs."""

from __future__ import annotations

import sys
import time
from typing import Any

from .distributed import DistContext

__all__ = ["progress_bar", "report_epoch"]


class _NoBar:
    """Stands in for ``tqdm`` when it is not installed (status lines are still printed with ``log_every``)."""

    disable = True

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(progress: bool, ctx: DistContext, **kwargs: Any):
    """A ``tqdm`` bar, shown on rank 0 when ``progress`` and stderr is a terminal (disabled otherwise)."""
    disable = not (bool(progress) and ctx.is_main and sys.stderr.isatty())
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(disable=disable, dynamic_ncols=True, **kwargs)


def report_epoch(tr: Any, bar: Any, progress: bool, log_every: int, desc: str, t_start: float) -> None:
    """Advance the bar, or print a status line every ``log_every`` epochs when stderr is not a terminal."""
    cfg, done = tr.config, tr.epoch
    bar.update(1)
    selecting = tr.val_data is not None
    if bar.disable is False and selecting:
        bar.set_postfix_str(f"best val {cfg.select_metric} (median) {tr.best_value.median().item():.3g}")
    if (log_every and progress and tr.ctx.is_main and bar.disable
            and (done % log_every == 0 or done == cfg.epochs)):
        best = (f"  best val {cfg.select_metric} (median over members) {tr.best_value.median().item():.4g}"
                if selecting else "")
        print(f"[{desc}] epoch {done}/{cfg.epochs}{best}  {time.perf_counter() - t_start:.0f} s",
              file=sys.stderr, flush=True)
