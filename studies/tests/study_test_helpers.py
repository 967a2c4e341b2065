"""Helpers of the study tests."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest


def run_or_fail(cmd: Sequence[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``; running past
    ``timeout`` seconds fails the calling test (a test that cannot finish has not passed, so it never skips)."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout:g} s; stderr tail:\n{tail}", pytrace=False)
