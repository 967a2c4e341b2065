"""Small tensor helpers shared across the package (private)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ._validation import not_a_tensor

__all__ = ["batch_mv", "validate_default", "check_tensor", "check_finite", "check_same_dtype_device",
           "check_group_index"]


def batch_mv(matrix: Tensor, vec: Tensor) -> Tensor:
    r"""Matrix-vector product ``matrix @ vec`` with broadcasting, without copying ``matrix``.

    ``matrix`` has shape ``(*bm, p, q)`` and ``vec`` has shape ``(*sample, *bv, q)`` where ``bv`` is
    broadcastable with ``bm``; leading dimensions of ``vec`` beyond ``bm`` (sample dimensions) are folded
    into the columns of one matrix-matrix product, so a matrix shared by many samples is read once.

    Shapes:
        matrix: ``(*bm, p, q)``; vec: ``(*sample, *bv, q)``; returns ``(*sample, *broadcast(bm, bv), p)``.
    """
    if matrix.dim() == 2:
        return vec @ matrix.mT
    num_batch = matrix.dim() - 2
    extra = vec.dim() - 1 - num_batch
    if extra <= 0:
        return (matrix @ vec.unsqueeze(-1)).squeeze(-1)
    sample_shape = vec.shape[:extra]
    cols = vec.reshape((sample_shape.numel(),) + vec.shape[extra:])  # (s, *bv, q); explicit s: q may be 0 (rank 0)
    cols = cols.movedim(0, -1)  # (*bv, q, s)
    out = matrix @ cols  # (*b, p, s)
    out = out.movedim(-1, 0)  # (s, *b, p)
    return out.reshape(sample_shape + out.shape[1:])


def stale_without_graph(cached: Tensor | None, *sources: Tensor) -> bool:
    """Whether a lazily cached tensor must be (re)computed: it is missing, or it was computed under
    ``torch.no_grad()`` (no autograd graph) while a source requires grad and grad is enabled now. Without this,
    a first use inside ``no_grad`` (a detached sample) would freeze the cache and silently cut every later
    gradient through it."""
    if cached is None:
        return True
    # (a tensor with a grad_fn requires grad: asking requires_grad alone is the same test, and torch.compile can
    # trace it, where reading grad_fn is a graph break)
    return not cached.requires_grad and torch.is_grad_enabled() and any(s.requires_grad for s in sources)


def validate_default(validate_args: bool | None) -> bool:
    """Resolve ``validate_args=None`` to torch.distributions' global default."""
    if validate_args is None:
        return bool(torch.distributions.Distribution._validate_args)
    return bool(validate_args)


#: the floating dtypes hardeq accepts (float16 / bfloat16 are computed in float32 by the distributions)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, value: object, *, min_dim: int = 0, floating: bool = True) -> Tensor:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is a suitable tensor."""
    if not isinstance(value, Tensor):
        raise not_a_tensor(name, value)
    if floating and value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), got dtype "
                        f"{value.dtype}.")
    if value.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimension(s), got shape {tuple(value.shape)}."
        )
    return value


def check_finite(name: str, value: Tensor) -> None:
    """Raise ``ValueError`` if ``value`` holds NaN or infinity."""
    # the sum is finite when every entry is (it may overflow: then the exact test below decides): one reduction and
    # one read-back (isfinite is a composite of several kernels; so is sum * 0 == 0 with its wrapped scalars)
    if not value.is_floating_point():
        return
    if is_tracing():  # inside a graph: checked on the device, the error deferred (no batching rule under torch.func)
        if torch._C._functorch.maybe_current_level() is None:
            torch._assert_async(torch.isfinite(value.detach()).all(), f"{name} must be finite (checked on the device).")
        return
    if math.isfinite((value.detach() if value.requires_grad else value).sum().item()):
        return
    if not bool(torch.isfinite(value).all()):
        mask = ~torch.isfinite(value.detach())
        bad = mask.sum().item()
        first = first_index(mask)
        raise ValueError(
            f"{name} (shape {tuple(value.shape)}) must be finite, but found {bad} NaN/inf entr"
            f"{'y' if bad == 1 else 'ies'} (the first: {name}[{', '.join(map(str, first))}] = "
            f"{value.detach()[first].item()})."
        )


def first_index(mask: Tensor) -> tuple[int, ...]:
    """The index of the first true entry of a boolean tensor with one (row-major order); for error messages."""
    flat = int(mask.flatten().to(torch.uint8).argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


def check_same_dtype_device(**tensors: Tensor | None) -> None:
    """Raise ``TypeError`` if the given tensors disagree in dtype, ``ValueError`` if in device."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if t.dtype != ref.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; all floating-point "
                "arguments must share one dtype."
            )
        if t.device != ref.device:
            raise ValueError(
                f"{name} is on device {t.device} but {ref_name} is on {ref.device}; all arguments must "
                "be on one device."
            )


def is_tracing() -> bool:
    """True under ``torch.compile`` tracing, inside a ``torch.func`` transform (``vmap``, ``grad``, ...) or while
    the current CUDA stream is being captured into a CUDA graph: then data-dependent Python branches
    (``bool(tensor)``, ``.item()``) must be avoided (a host synchronisation is an error during capture)."""
    return (torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None
            or cuda_graph_capturing())


def assert_deferred(ok: Tensor, message: str, error: Callable[[], Exception]) -> None:
    """``torch._assert_async(ok, message)``: no host read, the failure raised at the device's next synchronisation.
    A CPU raises it at once, and there (in eager mode) it is re-raised as ``error()``, which may read the host to
    name what failed. ``ok``: a one-element bool tensor."""
    if is_tracing() or ok.device.type != "cpu":
        torch._assert_async(ok, message)
        return
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        raise error() from None


def cuda_graph_capturing() -> bool:
    """Is the current CUDA stream capturing a CUDA graph (``torch.cuda.graph``)? ``False`` without CUDA; no
    synchronisation (CUDA is not initialised by asking)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def group_sizes(index: Tensor, num_groups: int) -> Tensor:
    """Members per group, ``(num_groups,)`` long, by a scatter (static shape; no check)."""
    return torch.zeros(num_groups, dtype=torch.long, device=index.device).index_add_(0, index, torch.ones_like(index))


def check_group_index(index: Tensor, num_groups: int, source: str = "a = total.shape[-1]") -> Tensor:
    """Check a group-id vector (``(n,)``, values in ``[0, num_groups)``, no empty group); return group sizes.
    ``source`` names where ``num_groups`` came from, for the message. Two host synchronisations: the range, and
    the smallest group."""
    if index.numel() == 0:
        raise ValueError("index must not be empty.")
    lo, hi = torch.aminmax(index)
    lo, hi = torch.stack([lo, hi]).tolist()
    if lo < 0 or hi >= num_groups:
        raise ValueError(
            f"index values must lie in [0, a) with {source} = {num_groups}, got range [{lo}, {hi}]."
        )
    counts = torch.bincount(index, minlength=num_groups)
    if int(counts.min()) == 0:
        empty = torch.nonzero(counts == 0)[:5, 0].tolist()
        raise ValueError(
            f"every group must have at least one coordinate, but groups {empty} (of {source} = {num_groups}) are "
            "empty."
        )
    return counts


LOG_2PI = math.log(2 * math.pi)
