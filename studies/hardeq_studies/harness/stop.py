"""Stopping a run when asked: SIGINT (Ctrl-C) or SIGTERM becomes a :class:`StopRun` exception.

In the main process :func:`stop_on_signals` turns the first SIGINT or SIGTERM into :class:`StopRun`, raised in
the main thread wherever it is; the stack unwinds through every ``finally`` (an atomic checkpoint being written
is abandoned and its temporary file removed, so the last complete checkpoint stays), and the command line
prints the ``--resume`` command and exits ``128 + signal`` (130 for SIGINT, 143 for SIGTERM). Signals that
arrive while it unwinds are ignored, so a second Ctrl-C cannot turn a clean stop into a traceback.

Worker processes (:mod:`.pool`) ignore SIGINT -- on a terminal Ctrl-C reaches every process of the group, and
the main process decides -- and leave quietly on the SIGTERM the main process sends them
(:func:`worker_signals`).
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["StopRun", "STOP_SIGNALS", "stop_on_signals", "worker_signals"]

#: the signals that stop a run
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: seconds after which a stop dropped inside a callback (see :func:`_stop_once`) is delivered again
REDELIVER_S = 0.02


class StopRun(BaseException):
    """The run was asked to stop by signal ``signum`` (SIGINT or SIGTERM).

    A ``BaseException`` like ``KeyboardInterrupt``, so that no ``except Exception`` on the way up swallows it.
    """

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"stopped by {self.signal_name}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """``128 + signum``, the shell's status of a process ended by the signal (130 SIGINT, 143 SIGTERM)."""
        return 128 + self.signum


def _stop_once() -> Callable[[int, FrameType | None], None]:
    """A signal handler that raises :class:`StopRun` on the first signal it receives and ignores every later one
    (a second Ctrl-C during cleanup must not interrupt it).

    Python runs a signal handler between bytecodes of the main thread, which can be inside a weakref callback or a
    ``__del__``; an exception raised there is "ignored" (printed, then dropped), so the run would go on and ignore
    every later signal. While the handler is installed, ``sys.unraisablehook`` therefore catches a dropped
    :class:`StopRun`, prints nothing, re-arms the handler and trips the signal again :data:`REDELIVER_S` later
    from another thread (``_thread.interrupt_main``), so that it is raised once the callback has returned."""
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if received:
            return
        received.append(signum)
        raise StopRun(signum)

    def unraisable(info: sys.UnraisableHookArgs) -> None:
        if isinstance(info.exc_value, StopRun):
            received.clear()
            # trip the signal again a moment later, from another thread: tripped here, the handler would run at
            # once, inside this hook, and be dropped again; by then the callback has returned (should the signal land
            # in another callback, this repeats)
            signum = info.exc_value.signum
            timer = threading.Timer(REDELIVER_S, _thread.interrupt_main, args=(signum,))
            timer.daemon = True
            timer.start()
            return
        previous_hook(info)

    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    return handler


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside, the first SIGINT or SIGTERM raises :class:`StopRun` in the main thread and later ones are
    ignored; the previous handlers come back on exit. Outside the main thread (where Python cannot install
    handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hook = sys.unraisablehook
    handler = _stop_once()
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sys.unraisablehook = hook


def worker_signals() -> None:
    """In a worker process: ignore SIGINT, and raise :class:`StopRun` on the first SIGTERM (the main process's
    request to stop; the worker unwinds and leaves quietly). Then unblock both (the pool starts its workers
    with them blocked, so that none arrives before this)."""
    handler = _stop_once()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
