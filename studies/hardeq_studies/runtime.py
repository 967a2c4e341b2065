"""What every study's ``run`` does around its computation: the device (and the process group under
``torchrun``), threads, trials, epochs and checkpoint folder from the command line and the preset, the wall
time of every leg of a run that was interrupted and resumed, and the removal of the checkpoints after a
completed run. :meth:`hardeq_studies.contract.Study.run` calls these.

This module sits below :mod:`hardeq_studies.contract`, which imports it; it imports only
:mod:`hardeq_studies.argtypes` and :mod:`hardeq_studies.harness` of this package, so that ``Study.execute``
is typed with :class:`RunSetup` and no import cycle is hidden behind a function-level import.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .argtypes import positive_int
from .harness import DistContext, init_distributed

__all__ = ["RunSetup", "add_run_arguments", "setup_run", "discard_checkpoints", "finish_run", "legs_path",
           "earlier_legs", "record_leg", "forget_legs", "study_checkpoints", "LegClock", "HEARTBEAT_S"]


def add_run_arguments(parser: argparse.ArgumentParser, *, threads: bool = True) -> None:
    """The flags :func:`setup_run` and :func:`discard_checkpoints` read: ``--threads`` (unless the study has
    its own), ``--checkpoint-dir``, ``--keep-checkpoints``."""
    if threads:
        parser.add_argument("--threads", type=positive_int, default=None,
                            help="intra-op threads (default: the preset's, else 1; 1 is fastest on a shared CPU)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="default: OUT/checkpoints (removed after a completed run unless --keep-checkpoints)")
    parser.add_argument("--keep-checkpoints", action="store_true")


@dataclass(frozen=True)
class RunSetup:
    """The resolved run of study ``name``.

    Attributes:
        args: the command line (for the study's own flags).
        settings: the preset's settings with the study's command-line overrides.
        device, ctx: the torch device and the distributed context (one process unless ``torchrun``).
        trials: seed indices ``0..seeds-1`` (``--seeds`` or the preset's ``seeds``; empty if neither).
        epochs: ``--epochs`` or the preset's ``epochs`` (``None`` if neither).
        checkpoint_dir: ``--checkpoint-dir`` or ``OUT/checkpoints``; :attr:`checkpoint` is
            ``checkpoint_dir / NAME-PRESET.pt``.
    """

    args: argparse.Namespace
    name: str
    preset: str
    settings: dict[str, Any]
    device: torch.device
    ctx: DistContext
    trials: list[int]
    epochs: int | None
    out: Path
    checkpoint_dir: Path
    resume: bool
    quiet: bool
    command: str

    @property
    def checkpoint(self) -> Path:
        return self.checkpoint_dir / f"{self.name}-{self.preset}.pt"

    @property
    def legs(self) -> Path:
        """The record of the earlier, interrupted legs of this run (:func:`legs_path`)."""
        return legs_path(self.checkpoint_dir, self.name)


def setup_run(args: argparse.Namespace, settings: dict[str, Any], name: str, *, distributed: bool = False,
              default_device: str | None = "cpu", default_threads: int | None = 1) -> RunSetup:
    """Resolve the run of study ``name`` from ``args`` and the preset's ``settings``.

    ``--device`` (else the settings', else ``default_device``; ``None``: CUDA when available; CUDA asked for
    but absent: ``ValueError``); with ``distributed`` the process group of ``torchrun`` is joined. Threads:
    ``--threads``, else the settings', else ``default_threads`` (``None``: torch's own count is kept).
    """
    requested = getattr(args, "device", None) or settings.get("device") or default_device
    if requested is not None and str(requested).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for (the paper preset's default) but CUDA is not available; "
                         "pass --device cpu to run it on the CPU.")
    ctx = init_distributed(requested) if distributed else DistContext(device=torch.device(
        requested or ("cuda" if torch.cuda.is_available() else "cpu")))
    threads = getattr(args, "threads", None) or settings.get("threads") or default_threads
    if threads:
        torch.set_num_threads(int(threads))
    seeds = getattr(args, "seeds", None) or settings.get("seeds")
    epochs = getattr(args, "epochs", None) or settings.get("epochs")
    out = Path(args.out)
    return RunSetup(
        args=args, name=name, preset=args.preset, settings=settings, device=ctx.device, ctx=ctx,
        trials=list(range(int(seeds))) if seeds else [], epochs=None if epochs is None else int(epochs), out=out,
        checkpoint_dir=Path(getattr(args, "checkpoint_dir", None) or out / "checkpoints"),
        resume=bool(getattr(args, "resume", False)), quiet=bool(getattr(args, "quiet", False)),
        command=getattr(args, "command_line", None) or f"hardeq reproduce {name} --preset {args.preset}")


def study_checkpoints(name: str, folder: Path) -> list[Path]:
    """The checkpoint files of study ``name`` in ``folder`` (``NAME*.pt`` and ``NAME*/**/*.pt``; not ``cache/``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = set(folder.glob(f"{name}*.pt"))
    for sub in folder.glob(f"{name}*"):
        if sub.is_dir():
            found.update(sub.rglob("*.pt"))
    return sorted(found)


def discard_checkpoints(args: argparse.Namespace, folder: Path, pattern: str) -> None:
    """After a completed run: remove the checkpoints ``folder / pattern`` (and the folder when empty) unless
    ``--keep-checkpoints``."""
    if getattr(args, "keep_checkpoints", False):
        return
    folder = Path(folder)
    for path in folder.glob(pattern):
        path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass


def finish_run(ctx: DistContext) -> None:
    """Leave the process group of a ``torchrun`` job (all ranks wait for rank 0's results first)."""
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ legs of a run
def legs_path(checkpoint_dir: Path, name: str) -> Path:
    """``CHECKPOINT_DIR/NAME.legs.json``: the wall seconds of the earlier legs of an interrupted run of study
    ``name`` (written when a leg ends without a result, read by the ``--resume`` leg that completes the run)."""
    return Path(checkpoint_dir) / f"{name}.legs.json"


#: how often a running leg rewrites its elapsed wall time beside the checkpoints (:class:`LegClock`)
HEARTBEAT_S = 30.0


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def earlier_legs(path: Path) -> list[float]:
    """The wall seconds of the earlier legs recorded in ``path``: the legs :func:`record_leg` closed, then a leg
    that was killed outright (SIGKILL, power loss) while its :class:`LegClock` ran, counted up to its last
    heartbeat (so at most :data:`HEARTBEAT_S` short). ``[]`` when there is no record or it is unreadable: a lost
    record only shortens the reported total, it cannot change a result."""
    data = _read(path)
    legs = [float(x) for x in data.get("legs", []) if isinstance(x, (int, float))]
    open_leg = data.get("open")
    if isinstance(open_leg, dict) and isinstance(open_leg.get("elapsed"), (int, float)):
        legs.append(float(open_leg["elapsed"]))
    return legs


def record_leg(path: Path, seconds: float) -> None:
    """Append a closed leg of ``seconds`` to the closed legs of ``path`` (atomically: a temporary file and
    ``os.replace``); the open entry of the leg being closed is dropped."""
    closed = [float(x) for x in _read(path).get("legs", []) if isinstance(x, (int, float))]
    _write(Path(path), {"legs": closed + [float(seconds)]})


class LegClock:
    """The wall clock of one leg of a run, written to the legs record ``path`` every ``every`` seconds (a daemon
    thread; only once the checkpoint folder exists, which it never creates) as ``{"legs": [...earlier...], "open":
    {"elapsed": s}}``, so that a leg killed without a chance to
    record itself (SIGKILL) still counts, up to its last heartbeat, in the next leg's :func:`earlier_legs`.
    :meth:`stop` ends the heartbeat and returns the leg's seconds; the caller then records or forgets the leg.

    Only the main rank runs one; ``enabled=False`` makes it a plain clock.
    """

    def __init__(self, path: Path, *, every: float = HEARTBEAT_S, enabled: bool = True) -> None:
        self.path, self.every = Path(path), float(every)
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._earlier = earlier_legs(self.path)  # a leg killed before this one becomes a closed leg
        self._thread = threading.Thread(target=self._beat, daemon=True) if enabled else None
        if self._thread is not None:
            if self._earlier:
                _write(self.path, {"legs": self._earlier})
            self._thread.start()

    def elapsed(self) -> float:
        """Seconds since the leg started."""
        return time.perf_counter() - self.t0

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            if not self.path.parent.is_dir():  # no checkpoints yet: nothing a later leg could resume
                continue
            try:
                _write(self.path, {"legs": self._earlier, "open": {"elapsed": self.elapsed()}})
            except OSError:  # a full or vanished disk loses the heartbeat, never the run
                pass

    def stop(self) -> float:
        """End the heartbeat (the open entry stays until the caller records or forgets the leg); the leg's
        seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.elapsed()


def forget_legs(path: Path) -> None:
    """Remove the record of earlier legs (a run that starts afresh, or one that completed)."""
    Path(path).unlink(missing_ok=True)
