r"""What differs by device, decided in one place.

The library runs the same algorithms on every device; a few choices depend on where the tensors live, because a
CPU and a GPU pay for different things. On a CPU, a pass over memory that leaves the cache costs as much as the
arithmetic, a fresh buffer costs its page faults, and reading a value back into Python costs nothing; on a GPU,
each kernel launch costs microseconds of host time, while a read-back synchronises the host with the device (the
host waits until the device has finished everything queued) and cannot happen while a CUDA graph is captured.

So, by device kind (:func:`profile`):

==========================  ==========================================  ==============================================
choice                      CPU (``"cpu"``)                             any other device (``"gpu"``)
==========================  ==========================================  ==============================================
chunked loops               chunks of about :data:`CHUNK_ELEMS`         one chunk holding every row (each chunk costs
                            elements (each transient stays in cache)    launches; buffers are the output's size anyway)
host-read guards            allowed where they save passes (a screen    never: the branch-free form always runs
                            of the residual check, an overflow guard;   (``validate_args=False`` takes the static,
                            ``validate_args=False`` keeps the checked   sync-free conditioner)
                            conditioner: its float32 factor and screen
                            are 2-3x faster than the static float64 one)
blocked drivers             the fused blocked Gram-Cholesky and the     the vendor's batched GEMM, Cholesky and sparse
                            blocked sparse products (``torch.mm`` of a  products
                            cached block layout)
fused kernels               no: the ATen form (each operator a pass     the library's Triton kernels where Triton runs
                            over memory, no launch cost)                (:func:`fused_kernels`), else the ATen form
==========================  ==========================================  ==============================================

float64 is used on both for the factor of the Gram matrix and for log-densities (a GPU's float64 rate is lower, but
the factor is ``a x a`` and the per-row promise needs it).

The choice is a function of the device's kind only; :func:`forced` overrides it (for tests of both branches on one
machine, and for measuring), e.g. ``with forced("gpu"): ...`` runs the GPU branches on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["CHUNK_ELEMS", "DeviceProfile", "forced", "fused_kernels", "interpreted_kernels", "profile",
           "rows_per_chunk"]

#: elements of one chunk of a chunked loop on the CPU (each transient of the chunk stays in cache)
CHUNK_ELEMS = 1 << 21


@dataclass(frozen=True)
class DeviceProfile:
    """The device-dependent choices (see the module docstring)."""

    #: ``"cpu"`` or ``"gpu"``
    kind: str
    #: chunked loops: chunks of about :data:`CHUNK_ELEMS` elements (else one chunk)
    chunked: bool
    #: host-read guards allowed (a read-back that saves work; never on a GPU)
    host_guards: bool
    #: the library's blocked drivers (fused blocked Gram-Cholesky, blocked sparse products)
    blocked_drivers: bool
    #: the library's fused Triton kernels, where Triton runs on the device (:func:`fused_kernels`)
    fused_kernels: bool


_PROFILES = {"cpu": DeviceProfile("cpu", chunked=True, host_guards=True, blocked_drivers=True, fused_kernels=False),
             "gpu": DeviceProfile("gpu", chunked=False, host_guards=False, blocked_drivers=False, fused_kernels=True)}
_forced: str | None = None
_interpreted = False  # (interpreted_kernels)


def profile(device: torch.device) -> DeviceProfile:
    """The choices for tensors on ``device`` (or the forced ones, :func:`forced`)."""
    if _forced is not None:
        return _PROFILES[_forced]
    return _PROFILES["cpu" if device.type == "cpu" else "gpu"]


def fused_kernels(device: torch.device) -> bool:
    """Take the library's fused Triton kernels for tensors on ``device``: the profile wants them
    (:attr:`DeviceProfile.fused_kernels`) and Triton runs there: a CUDA device with ``triton`` importable (every
    CUDA build of torch installs it), or a CPU inside :func:`interpreted_kernels` (tests of the kernels on a machine
    without a GPU, with the GPU's choices :func:`forced`)."""
    if not profile(device).fused_kernels:
        return False
    if device.type == "cuda":
        return _triton_importable()
    return device.type == "cpu" and _interpreted and _triton_importable()


@contextlib.contextmanager
def interpreted_kernels(on: bool = True) -> Iterator[None]:
    """Within the block, tensors on a CPU take the fused Triton kernels where the profile wants them (run by
    Triton's interpreter: ``TRITON_INTERPRET=1`` must have been set before ``triton`` was first imported); with
    ``on=False``, they do not. For tests."""
    global _interpreted
    previous, _interpreted = _interpreted, on
    try:
        yield
    finally:
        _interpreted = previous


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def forced(kind: str) -> Iterator[None]:
    """Within the block, every device takes the choices of ``kind`` (``"cpu"`` or ``"gpu"``)."""
    global _forced
    if kind not in _PROFILES:
        raise ValueError(f"kind must be one of {sorted(_PROFILES)}, got {kind!r}.")
    previous, _forced = _forced, kind
    try:
        yield
    finally:
        _forced = previous


def rows_per_chunk(count: int, n: int, min_rows: int, device: torch.device, chunk_elems: int | None = None) -> int:
    """Rows of ``n`` elements per chunk for a loop over ``count`` rows: chunked (:attr:`DeviceProfile.chunked`),
    chunks of about ``chunk_elems`` (default :data:`CHUNK_ELEMS`) elements and at least ``min_rows`` rows (each
    chunk streams an operand once); otherwise all rows at once.

    The rows of a chunk hold a multiple of 16 elements: ``normal_`` fills a tensor in blocks of 16 draws and
    redraws the last 16 of a tensor whose size is not a multiple of 16, so only then is the noise of the chunks the
    same stream as one ``torch.randn`` of the whole output."""
    if not profile(device).chunked:
        return max(1, count)
    step = max(1, min_rows, (CHUNK_ELEMS if chunk_elems is None else chunk_elems) // max(1, n))
    quantum = 16 // math.gcd(n, 16)
    return max(1, min(count, -(-step // quantum) * quantum))
