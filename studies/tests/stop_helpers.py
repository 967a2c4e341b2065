"""Worker functions and a driver for the tests of stopping a run (test_stop.py): module-level, so that spawned
worker processes can import them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def sleeper(seconds: float, folder: str, key: str) -> str:
    """A unit that announces itself (``folder/KEY.pid`` holds its pid) and then works for ``seconds``. The file is
    written under another name and renamed, so that it never exists empty (a reader that sees it reads the pid)."""
    partial = Path(folder, f"{key}.pid.partial")
    partial.write_text(str(os.getpid()))
    partial.rename(Path(folder, f"{key}.pid"))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)
    return key


def fails(message: str) -> None:
    raise ValueError(message)


def dies(code: int) -> None:
    os._exit(code)


def main() -> int:
    """``python stop_helpers.py FOLDER UNITS JOBS SECONDS``: run ``UNITS`` sleepers in ``JOBS`` workers under
    :func:`~hardeq_studies.harness.stop_on_signals`; exit ``128 + signal`` when stopped, printing one line."""
    from hardeq_studies.harness import StopRun, run_units, stop_on_signals

    folder, units, jobs, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    try:
        with stop_on_signals():
            done = run_units(sleeper, {f"u{i}": {"seconds": seconds, "folder": folder, "key": f"u{i}"}
                                       for i in range(units)}, jobs=jobs, desc="sleepers")
    except StopRun as stop:
        print(f"stopped by {stop.signal_name}", file=sys.stderr)
        return stop.exit_status
    print("done", " ".join(done.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
