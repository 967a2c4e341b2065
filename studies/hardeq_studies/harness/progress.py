"""The training loop's progress: a ``tqdm`` bar on a terminal; else (output to a log file or a pipe) a status
line every ``log_every`` epochs and, whatever ``log_every`` and however long an epoch, at least one every
:data:`HEARTBEAT_S` seconds (:class:`Heartbeat`)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .distributed import DistContext

__all__ = ["progress_bar", "report_epoch", "Heartbeat", "HEARTBEAT_S", "still_running"]

#: the longest silence (seconds) of a run with progress on whose stderr is not a terminal
HEARTBEAT_S = 30.0


class Heartbeat:
    """Says a status line when :data:`HEARTBEAT_S` seconds have passed since the last one.

    Args:
        enabled: speak at all (progress on, rank 0, stderr not a terminal: a tqdm bar shows progress there).
        interval: seconds between lines.
    """

    def __init__(self, enabled: bool, interval: float = HEARTBEAT_S) -> None:
        self.enabled, self.interval = bool(enabled), float(interval)
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.enabled and time.monotonic() - self.last >= self.interval

    def say(self, text: str) -> None:
        """Print ``text`` to stderr (whether due or not) and restart the interval."""
        self.last = time.monotonic()
        print(text, file=sys.stderr, flush=True)


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


def report_epoch(tr: Any, bar: Any, progress: bool, log_every: int, desc: str, t_start: float,
                 heartbeat: Heartbeat | None = None) -> None:
    """Advance the bar, or (stderr not a terminal) print a status line every ``log_every`` epochs and
    whenever ``heartbeat`` is due."""
    cfg, done = tr.config, tr.epoch
    bar.update(1)
    selecting = tr.val_data is not None
    if bar.disable is False and selecting:
        bar.set_postfix_str(f"best val {cfg.select_metric} (median) {tr.best_value.median().item():.3g}")
    scheduled = bool(log_every) and (done % log_every == 0 or done == cfg.epochs)
    if progress and tr.ctx.is_main and bar.disable and (scheduled or (heartbeat is not None and heartbeat.due())):
        best = (f"  best val {cfg.select_metric} (median over members) {tr.best_value.median().item():.4g}"
                if selecting else "")
        line = f"[{desc}] epoch {done}/{cfg.epochs}{best}  {time.perf_counter() - t_start:.0f} s"
        if heartbeat is not None:
            heartbeat.say(line)
        else:
            print(line, file=sys.stderr, flush=True)


@contextmanager
def still_running(desc: str, enabled: bool, interval: float = 60.0) -> Iterator[None]:
    """While inside, a background thread prints ``[desc] still running, N min so far`` to stderr every
    ``interval`` seconds when ``enabled`` (a run whose output goes to a file: phases that print nothing of
    their own -- a long evaluation, a block of Monte Carlo -- still show that the run is alive)."""
    if not enabled:
        yield
        return
    done = threading.Event()
    t0 = time.monotonic()

    def tick() -> None:
        while not done.wait(interval):
            print(f"[{desc}] still running, {(time.monotonic() - t0) / 60:.1f} min so far", file=sys.stderr,
                  flush=True)

    thread = threading.Thread(target=tick, name=f"{desc}-still-running", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(1.0)
