r"""The value and shape checks of :class:`~hardeq.ConstrainedNormal`: the finiteness and positivity of its
parameters with one host read (:func:`_check_values`) or none (:func:`_assert_values`, under tracing), and the
broadcast of batch shapes and the ``sample_shape`` argument."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, cast

import torch
from torch import Tensor

from .._utils import check_finite
from ..linalg.covariance import Covariance, DiagonalCovariance


def _check_values(loc: Tensor, covariance: Covariance, k: Tensor | None = None,
                  pending: list[tuple[Tensor, Callable[[], None]]] | None = None) -> None:
    r"""``check_finite("loc", loc)``, ``covariance.check_values()`` and (when given) the finiteness of ``k``, with
    **one host read**: the verdicts of every check are one device boolean, read once: :math:`\sum\mu + \sum k`
    finite (a NaN or an infinity anywhere propagates to it) and the covariance's own verdict
    (``Covariance._value_verdict``; for a diagonal one :math:`\min\sigma + 0\cdot\sum\sigma \ge` ``tiny``: every
    scale finite and a positive normal number), from reductions without autograd nodes. Only when it is false (or
    when a sum overflows) do the precise checks run, each naming its argument, the first bad element and its value
    (more reads, on the way to the error). A covariance without a verdict (a structure of one's own) runs its
    ``check_values`` after the read. ``pending``: more ``(verdict, explain)`` pairs for that read (the checks of a
    ``covariance_matrix`` / ``precision_matrix``); on failure their ``explain()`` runs first."""
    parts = [t.detach() if t.requires_grad else t for t in (loc, k) if t is not None and t.numel()]
    verdict: Tensor | None = None
    if parts:
        total = parts[0].sum()
        for t in parts[1:]:
            total = total + t.sum()
        verdict = total * 0 == 0  # (finite: x * 0 is 0; NaN for NaN and inf)
    cls = type(covariance)
    owner = next(c for c in cls.__mro__ if "check_values" in c.__dict__)
    own = covariance._value_verdict() if "_value_verdict" in owner.__dict__ else None
    for part in [own] + [ok for ok, _ in pending or ()]:
        if part is not None:
            verdict = part if verdict is None else verdict & part
    if verdict is None or bool(verdict):  # the one host read
        if own is None:
            covariance.check_values()
        return
    for _, explain in pending or ():
        explain()
    check_finite("loc", loc)
    covariance.check_values()
    if k is not None:
        check_finite("constraint right-hand side k", k)


def _assert_values(loc: Tensor, covariance: Covariance, k: Tensor) -> None:
    """The value checks of validation without a host read (under ``torch.compile``, ``torch.func`` or CUDA-graph
    capture): ``loc`` and ``k`` finite, the covariance's tensors finite and, for a diagonal one, every scale a
    positive normal number; one ``torch._assert_async`` (a GPU raises at its next synchronisation). Skipped inside
    a ``torch.func`` transform (no batching rule for a device assertion)."""
    if torch._C._functorch.maybe_current_level() is not None:
        return
    ok = torch.isfinite(loc.detach()).all() & torch.isfinite(k.detach()).all()
    for t in covariance.tensors():
        ok = ok & torch.isfinite(t.detach()).all()
    scale = covariance.scale if type(covariance) is DiagonalCovariance else None
    if scale is not None:
        ok = ok & (scale.detach() >= torch.finfo(scale.dtype).tiny).all()
    torch._assert_async(ok, "ConstrainedNormal (validate_args=True, checked on the device): loc, the constraint's "
                            "k and the covariance must be finite, and scale positive (a normal number).")


def _broadcast_shapes(*shapes: torch.Size) -> torch.Size:
    """``torch.broadcast_shapes``, without its cost (tens of microseconds of Python) when the shapes are equal or
    empty, the common case."""
    first = shapes[0]
    if all(s == first or not s for s in shapes[1:]):
        return torch.Size(first)
    shape: torch.Size = torch.broadcast_shapes(*shapes)
    return shape


def _sample_shape(sample_shape: object, name: str = "sample_shape") -> torch.Size:
    """``sample_shape`` as a ``torch.Size`` of non-negative ints, or ``TypeError`` / ``ValueError`` naming it."""
    try:
        shape = torch.Size(cast("Iterable[int]", sample_shape))  # (anything else: TypeError, reported below)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a tuple (or torch.Size) of ints, got {sample_shape!r}.") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"{name} must have non-negative sizes, got {tuple(shape)}.")
    return shape
