"""Independent units of a study in parallel worker processes that stop when the run is asked to stop.

:func:`run_units` runs ``fn(**kwargs)`` for every unit in ``jobs`` spawned processes (each unit in one
process, handed out in the order given as workers become free: put the costliest first) and returns the
results in that order. Unlike a ``concurrent.futures`` pool it stops cleanly:

* SIGINT / SIGTERM to the main process (:func:`~.stop.stop_on_signals` turns them into :class:`~.stop.StopRun`),
  or any error, terminates every worker (SIGTERM, then SIGKILL after a grace period) and starts no further
  unit; each worker unwinds quietly (its atomic checkpoints stay as they were last written) and none is left;
* workers ignore SIGINT, so a Ctrl-C on a terminal (which reaches every process of the group) is handled once,
  by the main process, and no worker prints a traceback;
* a worker whose main process dies stops itself (it watches its parent), so killing the main process outright
  leaves no orphan training on;
* a unit that raises re-raises its exception in the main process (with the worker's traceback as its cause);
  a worker that dies (killed, out of memory) raises ``RuntimeError`` naming its unit.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Mapping
from multiprocessing.connection import wait
from typing import Any

from .stop import STOP_SIGNALS, StopRun, worker_signals

__all__ = ["run_units", "RemoteTraceback", "HEARTBEAT_S"]

#: seconds between the main process's status lines when stderr is not a terminal
HEARTBEAT_S = 60.0
#: seconds a terminated worker gets to unwind before it is killed
GRACE_S = 10.0


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (the ``__cause__`` of the re-raised one)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


def _watch_parent() -> None:
    """Stop this worker (SIGTERM to itself) when its main process ends, whatever the reason."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _thread_lock_for_tqdm() -> None:
    """Give ``tqdm`` a thread lock in this worker instead of the multiprocessing lock it creates by default: a
    semaphore that a worker ended with ``os._exit`` could not release (the resource tracker then warns)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 (any failure to pickle)
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _worker(fn: Callable[..., Any], tasks: Any, results: Any) -> None:
    """A worker process: receive ``(key, kwargs)`` on ``tasks`` until ``None``; send ``("done" | "error", key,
    payload)`` on ``results`` (a pipe: sent before the next line runs); leave quietly on SIGTERM."""
    try:
        worker_signals()
        _watch_parent()
        _thread_lock_for_tqdm()
        while True:
            item = tasks.recv()
            if item is None:
                break
            key, kwargs = item
            try:
                value = fn(**kwargs)
            except StopRun:
                raise
            except BaseException as exc:  # noqa: BLE001 (sent to the main process, which re-raises it)
                results.send(("error", key, (_portable(exc), traceback.format_exc())))
                break
            results.send(("done", key, value))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here on a terminate just ends the process
    except StopRun as stop:
        # the main process asked for this: leave at once, without a traceback and without the interpreter's
        # teardown (seconds with torch loaded); the stack has unwound, so no temporary checkpoint is left
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(stop.exit_status)


def _end(procs: list[Any], grace: float) -> None:
    """Terminate the workers still alive (SIGTERM), wait ``grace`` seconds, then kill what is left; reap all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_units(fn: Callable[..., Any], units: Mapping[Hashable, Mapping[str, Any]], *, jobs: int,
              desc: str = "units", progress: bool = False,
              on_done: Callable[[Hashable, Any], None] | None = None) -> dict[Hashable, Any]:
    """Run ``fn(**units[key])`` for every key in ``jobs`` spawned worker processes; ``{key: result}`` in the
    order of ``units``.

    Args:
        fn: a module-level function (it is pickled by reference for ``spawn``); its keyword arguments and
            result must pickle.
        units: ``key -> kwargs``, started in this order (costliest first balances the workers).
        jobs: worker processes (at most one per unit).
        desc: the name in status lines and errors.
        progress: print a status line to stderr every :data:`HEARTBEAT_S` seconds when stderr is not a
            terminal (units done, units running).
        on_done: ``on_done(key, result)`` in the main process as each unit finishes.

    Raises:
        StopRun: the run was asked to stop (every worker has been ended when it propagates).
        RuntimeError: a worker died without a result.
        Exception: what a unit raised, with the worker's traceback as ``__cause__``.
    """
    keys = list(units)
    jobs = max(1, min(int(jobs), len(keys)))
    ctx = multiprocessing.get_context("spawn")
    todo = list(keys)
    out: dict[Hashable, Any] = {}
    workers: list[dict[str, Any]] = []  # {"proc", "tasks" (send end), "results" (receive end), "unit"}
    t0 = last = time.monotonic()
    beat = progress and not sys.stderr.isatty()

    def give(w: dict[str, Any]) -> None:
        """Send ``w`` its next unit, or ``None`` (stop) when none is left."""
        w["unit"] = todo.pop(0) if todo else None
        w["tasks"].send(None if w["unit"] is None else (w["unit"], dict(units[w["unit"]])))

    def lost(w: dict[str, Any]) -> RuntimeError:
        w["proc"].join(GRACE_S)  # its pipes close a moment before it can be reaped
        code = w["proc"].exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with status {code}")
        return RuntimeError(f"{desc}: the worker process {w['proc'].pid} running unit {w['unit']!r} {how} without "
                            "a result")

    try:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # inherited: workers start with them blocked
        try:
            for i in range(jobs):
                task_recv, task_send = ctx.Pipe(duplex=False)
                result_recv, result_send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, args=(fn, task_recv, result_send), name=f"{desc}-worker-{i}",
                                daemon=True)
                p.start()
                task_recv.close()
                result_send.close()
                workers.append({"proc": p, "tasks": task_send, "results": result_recv, "unit": None})
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for w in workers:
            give(w)
        while len(out) < len(keys):
            busy = [w for w in workers if w["unit"] is not None]
            ready = wait([w["results"] for w in busy] + [w["proc"].sentinel for w in busy], timeout=1.0)
            for w in busy:
                if w["results"] in ready or w["results"].poll():
                    try:
                        kind, key, payload = w["results"].recv()
                    except EOFError:
                        raise lost(w) from None
                    if kind == "error":
                        exc, text = payload
                        raise exc from RemoteTraceback(text)
                    out[key] = payload
                    give(w)
                    if on_done is not None:
                        on_done(key, payload)
                elif w["proc"].sentinel in ready:
                    raise lost(w)
            if beat and time.monotonic() - last >= HEARTBEAT_S:
                last = time.monotonic()
                running = ", ".join(str(w["unit"]) for w in workers if w["unit"] is not None) or "-"
                print(f"[{desc}] {len(out)}/{len(keys)} units done; running: {running}; {last - t0:.0f} s",
                      file=sys.stderr, flush=True)
        for w in workers:
            w["proc"].join(GRACE_S)
    finally:
        _end([w["proc"] for w in workers], GRACE_S)
        for w in workers:
            w["tasks"].close()
            w["results"].close()
    return {key: out[key] for key in keys}
