"""Error messages that say what to fix: the hints the argument checks add for common mistakes.

Each function is called with one line where an argument enters (a constraint's ``A``, a distribution's ``loc``, a
``.to(device=...)``) and either raises a ``TypeError``/``ValueError`` naming the argument, what was expected, what
was received and the fix, or returns a hint to append to an existing message. No host synchronisation: the checks
read shapes, types and ``torch.cuda.is_available()`` only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__: list[str] = []  # (private helpers)


def conversion_hint(name: str, value: object) -> str:
    """How to make ``value`` a tensor, for the message of an argument that must be a ``torch.Tensor``: numpy arrays
    (and numpy scalars) by ``torch.as_tensor`` / ``torch.from_numpy``, Python sequences by ``torch.tensor``;
    ``""`` for anything else."""
    module = type(value).__module__.split(".")[0]
    if module == "numpy":
        return f"; convert it with torch.as_tensor({name}) (or torch.from_numpy({name}), which shares its memory)"
    if isinstance(value, (list, tuple)):
        return f"; convert it with torch.tensor({name})"
    return ""


def not_a_tensor(name: str, value: object, expected: str = "a torch.Tensor", note: str = "") -> TypeError:
    """The ``TypeError`` for an argument ``name`` that must be ``expected`` but is ``value``, with a conversion
    hint (:func:`conversion_hint`) and an optional ``note`` (e.g. what else is accepted)."""
    return TypeError(f"{name} must be {expected}, got {_type_name(value)}{note}{conversion_hint(name, value)}.")


def _type_name(value: object) -> str:
    module = type(value).__module__
    return type(value).__name__ if module == "builtins" else f"{module.split('.')[0]}.{type(value).__name__}"


def check_not_transposed(A_shape: tuple[int, ...] | torch.Size, k_shape: tuple[int, ...] | torch.Size) -> None:
    """``ValueError`` naming ``A`` when ``A`` looks transposed: its row count disagrees with ``k``'s last dimension
    but its column count matches it (``A`` of shape ``(n, a)`` instead of ``(a, n)``)."""
    if len(A_shape) < 2 or len(k_shape) < 1:
        return
    rows, cols, a = A_shape[-2], A_shape[-1], k_shape[-1]
    if rows != a and cols == a:
        raise ValueError(
            f"A has shape {tuple(A_shape)}, which reads as (n, a) = ({rows}, {cols}): k has a = {a} entries, so A must "
            f"be (a, n) = ({cols}, {rows}), one row per constraint; did you mean A.T (A.mT for a batch)?")


def image_flatten_hint(name: str, shape: tuple[int, ...] | torch.Size, n: int) -> str:
    """A hint for a ``name`` of ``shape`` whose trailing dimensions hold the ``n`` values the constraint acts on
    (an image ``(C, H, W)`` given where ``(n,)`` is expected): ``"; ... flatten them, loc.flatten(-3)"``; ``""``
    when no trailing block of dimensions has ``n`` elements."""
    shape = tuple(shape)
    start = next((s for s in range(len(shape) - 1) if math.prod(shape[s:]) == n), None)
    if start is None:
        return ""
    dims = " x ".join(map(str, shape[start:]))
    return (f"; its trailing dimensions {dims} hold the n = {n} values the constraint acts on (an image?): flatten "
            f"them, {name}.flatten({start - len(shape)}), and reshape the results back "
            f"(e.g. sample.unflatten(-1, {shape[start:]}))")


def check_device(device: Any, name: str = "device") -> None:
    """``ValueError`` naming ``name`` when ``device`` asks for CUDA on a machine without it (instead of torch's
    ``AssertionError: Torch not compiled with CUDA enabled`` or its ``RuntimeError`` deep inside a computation),
    or for a CUDA index the machine does not have. ``None`` (keep the device) passes."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be a torch device (e.g. 'cpu', 'cuda', 'cuda:0'), got {device!r}.") from None
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = (f"this torch ({torch.__version__}) was built without CUDA" if built is None else
               f"this torch ({torch.__version__}, CUDA {built}) finds no usable GPU")
        raise ValueError(f"{name}={str(device)!r} asks for a GPU, but {why}: use {name}='cpu', or run on a machine "
                         "with a GPU and a CUDA build of torch (https://pytorch.org/get-started/locally/).")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name}={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s).")
