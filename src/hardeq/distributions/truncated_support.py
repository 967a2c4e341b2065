r"""The parts :class:`~hardeq.TruncatedConstrainedNormal` is built from: what it reads of its base distribution
(:class:`_Base`) and what its parts read of it (:class:`_Truncated`), its support (:class:`_BoxOnPlane`), the
full-precision guard of its methods, the ``sample_shape`` check and the per-row tolerance.

This module does not import :mod:`hardeq.distributions.normal` (which imports the truncated distribution in
``ConstrainedNormal.truncate``): the base distribution is read through the structural type :class:`_Base`. The
parts of the truncated distribution (:mod:`.truncated_normaliser`, :mod:`.truncated_sampling`,
:mod:`.truncated_log_z`) are mixins whose methods read the distribution through :class:`_Truncated`, so none of
them imports :mod:`.truncated`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import Tensor
from torch.distributions import constraints

from ..bounds.result import TruncatedSamples
from ..bounds.sum_normaliser import SumRowLayout
from ..bounds.training import PersistentChains
from ..constraints.base import EqualityConstraint
from ..linalg.conditioning import Conditioner
from ..linalg.covariance import Covariance

_F = TypeVar("_F", bound=Callable[..., Any])

#: per-row tolerance of the untruncated law, by compute dtype (the library's exactness promise)
ROW_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


class _Base(Protocol):
    """What :class:`TruncatedConstrainedNormal` uses of its base :class:`~hardeq.ConstrainedNormal`."""

    _unbroadcasted_loc: Tensor
    _validate_args: bool
    covariance: Covariance
    constraint: EqualityConstraint

    @property
    def conditioner(self) -> Conditioner: ...

    @property
    def batch_shape(self) -> torch.Size: ...

    @property
    def event_shape(self) -> torch.Size: ...

    @property
    def result_dtype(self) -> torch.dtype: ...

    @property
    def mean(self) -> Tensor: ...

    @property
    def support(self) -> constraints.Constraint: ...

    def log_prob(self, value: Tensor) -> Tensor: ...

    def expand(self, batch_shape: torch.Size, _instance: Any = None) -> Any: ...

    def _out(self, t: Tensor) -> Tensor: ...

    def _as_event(self, name: str, value: Tensor) -> Tensor: ...

class _Truncated(Protocol):
    """What the parts of :class:`~hardeq.TruncatedConstrainedNormal` (its mixins) use of it: the base law, the box
    in the compute dtype, the cache, the settings, and the methods of the other parts."""

    base: _Base
    _lo: Tensor
    _hi: Tensor
    _cache: dict[str, Any]
    training: PersistentChains | None
    normaliser_samples: int
    grad_samples: int
    pilot_samples: int

    @property
    def _unbroadcasted_loc(self) -> Tensor: ...

    @property
    def batch_shape(self) -> torch.Size: ...

    @property
    def event_shape(self) -> torch.Size: ...

    @property
    def free_dim(self) -> int: ...

    @property
    def normaliser_exact(self) -> bool: ...

    @property
    def _line_exact(self) -> bool: ...

    @property
    def mode(self) -> Tensor: ...

    @property
    def acceptance(self) -> Tensor: ...

    def _compute_mode(self) -> Tensor: ...

    def _chain_start(self) -> Tensor: ...

    def _start_is_approximate(self) -> bool: ...

    def _start_from_mode(self) -> None: ...

    def _refuse_beyond_the_levels(self, rare: Tensor) -> None: ...

    def _check_volume(self) -> None: ...

    def _volume_in_question(self) -> bool: ...

    def _deferred_volume_check(self) -> Tensor | None: ...

    def _certified(self, verdict: Tensor | None, read: bool = True) -> None: ...

    def _needs_grad(self) -> bool: ...

    def _sum_layout(self) -> SumRowLayout | None: ...

    def _sum_row(self) -> tuple[Tensor, Tensor]: ...

    def _direction(self) -> Tensor: ...

    def _count_in_box(self, num: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]: ...

    def _mc(self) -> tuple[Tensor, Tensor, Tensor]: ...

    def _subset(self, method: str) -> tuple[Tensor, Tensor]: ...

    def _kernel(self, lower: Tensor, upper: Tensor, start: Tensor, steps: int, method: str) -> Tensor: ...

    def _chain(self, start: Tensor, sweeps: int, verdict: Tensor | None = None) -> Tensor: ...

    def _plane_log_prob(self) -> Callable[[Tensor], Tensor]: ...

    def _warn_k(self) -> None: ...

    def _sample_compute(self, sample_shape: object, method: str, *, chains: int | None = None, burn_in: int = 100,
                        thin: int = 1, travel_time: tuple[float, float] | None = None,
                        threshold: float = ...,
                        max_draws: int | None = None, generator: torch.Generator | None = None) -> TruncatedSamples: ...


def _full_precision(method: _F) -> _F:
    """Run ``method`` with autocast disabled on the parameters' device (as the base distribution's methods do): under
    ``torch.autocast`` a float32 matmul would otherwise run in a half dtype and lose the per-row accuracy."""

    @functools.wraps(method)
    def wrapper(self: _Truncated, *args: Any, **kwargs: Any) -> Any:
        device_type = self._unbroadcasted_loc.device.type
        if not torch.is_autocast_enabled(device_type):
            return method(self, *args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


class _BoxOnPlane(constraints.Constraint):
    """The support :math:`\\{z : Az = k,\\ l \\le z \\le u\\}`: the box exactly, the plane as
    :class:`~hardeq.ConstrainedNormal`'s support checks it (per row, to round-off)."""

    is_discrete = False
    event_dim = 1

    def __init__(self, plane: constraints.Constraint, lower: Tensor, upper: Tensor) -> None:
        self.plane, self.lower, self.upper = plane, lower, upper
        super().__init__()

    def check(self, value: Tensor) -> Tensor:
        v = value.to(self.lower.dtype)
        on_plane: Tensor = self.plane.check(value)
        return ((v >= self.lower) & (v <= self.upper)).all(-1) & on_plane

    def __repr__(self) -> str:
        return f"BoxOnPlane({self.plane!r})"
