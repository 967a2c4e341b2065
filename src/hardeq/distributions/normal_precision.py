r"""The precision :class:`~hardeq.ConstrainedNormal` computes in: the half-precision dtypes it accepts (computed in
float32), the full-precision guard of its methods (:func:`_full_precision`: no autocast, no host reads where a
read-back synchronises a device), and its support :class:`_AffineSubspace`, checked to the rounding of the value's
dtype."""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol, TypeVar, cast

import torch
from torch import Tensor
from torch.distributions import constraints

from ..constraints import EqualityConstraint
from ..constraints._cache import _NO_HOST_READS
from ..linalg.device import profile as device_profile

_F = TypeVar("_F", bound=Callable[..., Any])


class _OnDevice(Protocol):
    """A distribution whose methods run under :func:`_full_precision` (its parameters' device)."""

    @property
    def _unbroadcasted_loc(self) -> Tensor: ...

    _validate_args: bool

#: dtypes accepted and computed in float32 (results are returned in the input dtype)
HALF_DTYPES = (torch.float16, torch.bfloat16)
#: per-row tolerance of the support check for a half-precision value, in units of its eps (a point of the plane
#: rounded to half precision misses a row by at most eps / 2 times (|A||z|)_i)
HALF_SUPPORT_RTOL_EPS = 8.0


def _full_precision(method: _F) -> _F:
    """Run ``method`` with autocast disabled on the parameters' device: under ``torch.autocast`` a float32
    matmul would otherwise run in bfloat16 / float16 and lose the per-row accuracy of the conditioner; and, with
    on a device where a read-back synchronises (:func:`hardeq.linalg.device.profile`), inside
    :func:`hardeq.constraints._cache.no_host_reads` (the constraints' caches check their tensors on the device), with
    ``validate_args`` on or off."""

    @functools.wraps(method)
    def wrapper(self: _OnDevice, *args: Any, **kwargs: Any) -> Any:
        device_type = self._unbroadcasted_loc.device.type
        # (no_host_reads, without its generator; not under torch.compile, which cannot trace it and skips the caches)
        # (on a CPU, where a read-back synchronises nothing, only when the device profile is forced: linalg.device)
        # (validated or not: with validate_args=True the inputs were checked at construction, with one host read)
        sync_free = not device_profile(self._unbroadcasted_loc.device).host_guards
        token = _NO_HOST_READS.set(True) if sync_free and not torch.compiler.is_compiling() else None
        try:
            if not torch.is_autocast_enabled(device_type):
                return method(self, *args, **kwargs)
            with torch.autocast(device_type, enabled=False):
                return method(self, *args, **kwargs)
        finally:
            if token is not None:
                _NO_HOST_READS.reset(token)

    return cast(_F, wrapper)  # (functools.wraps keeps the signature)


class _AffineSubspace(constraints.Constraint):
    """The support ``{z : A z = k}``, checked to a dtype-aware round-off tolerance."""

    is_discrete = False
    event_dim = 1

    def __init__(self, constraint: EqualityConstraint) -> None:
        self.constraint = constraint
        super().__init__()

    def check(self, value: Tensor) -> Tensor:
        if value.dtype in HALF_DTYPES:  # checked in the constraint's precision, to the half-precision rounding
            rtol = HALF_SUPPORT_RTOL_EPS * torch.finfo(value.dtype).eps
            return self.constraint.check(value.to(self.constraint.dtype), rtol=rtol)
        return self.constraint.check(value.to(self.constraint.dtype))

    def __repr__(self) -> str:
        return f"AffineSubspace({self.constraint!r})"
