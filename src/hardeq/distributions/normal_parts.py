r"""Private machinery of :class:`~hardeq.ConstrainedNormal` (the mixin :class:`_NormalParts`): the standard normal
noise :meth:`~hardeq.ConstrainedNormal.rsample` consumes, the log-normaliser of the density on the plane, and the
checks of a value or target argument. Its methods read the distribution through the structural type
:class:`_Normal`, so this module does not import :mod:`hardeq.distributions.normal`."""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from .._utils import LOG_2PI, check_finite, check_tensor
from ..constraints import EqualityConstraint
from ..linalg.conditioning import Conditioner
from ..linalg.conditioning.static_dense import SINGULAR_SCALE_MESSAGE
from .normal_checks import _sample_shape


class _Normal(Protocol):
    """What the methods of :class:`_NormalParts` read of the :class:`~hardeq.ConstrainedNormal` they belong to."""

    _logdet_checked: bool
    _validate_args: bool

    @property
    def _unbroadcasted_loc(self) -> Tensor: ...

    @property
    def _batch_shape(self) -> torch.Size: ...

    @property
    def batch_shape(self) -> torch.Size: ...

    @property
    def event_shape(self) -> torch.Size: ...

    @property
    def noise_size(self) -> int: ...

    @property
    def result_dtype(self) -> torch.dtype: ...

    @property
    def constraint(self) -> EqualityConstraint: ...

    @property
    def conditioner(self) -> Conditioner: ...

    def _as_event(self: _Normal, name: str, value: object) -> Tensor: ...


class _NormalParts:
    """The noise, the log-normaliser and the argument checks of :class:`~hardeq.ConstrainedNormal`."""

    def _noise(self: _Normal, sample_shape: torch.Size | list[int] | tuple[int, ...], noise: Tensor | None) -> Tensor:
        loc = self._unbroadcasted_loc
        if noise is None and sample_shape == ():  # (one draw, the training-loop call: no shape to check)
            return torch.randn(self._batch_shape + (self.noise_size,), dtype=loc.dtype, device=loc.device)
        shape = _sample_shape(sample_shape) + self.batch_shape + (self.noise_size,)
        if noise is None:
            return torch.randn(shape, dtype=loc.dtype, device=loc.device)
        check_tensor("noise", noise)
        if noise.shape != shape:
            raise ValueError(f"noise must have shape sample_shape + batch_shape + (noise_size,) = {tuple(shape)}, "
                             f"got {tuple(noise.shape)}.")
        if noise.device != loc.device:
            raise ValueError(f"noise is on device {noise.device} but loc is on {loc.device}; pass noise on "
                             f"{loc.device}.")
        return noise.to(loc.dtype)

    def _log_normaliser(self: _Normal) -> Tensor:
        r""":math:`-\tfrac12[(n - a)\log 2\pi + \log\det\Sigma - \log\det S + \log\det AA^\top]`, ``batch_shape``."""
        n, a = self.event_shape[0], self.constraint.num_constraints
        plane_logdet = self.conditioner.plane_logdet()
        if not self._logdet_checked:  # once per distribution: a host read, or (static) a deferred device check
            message = SINGULAR_SCALE_MESSAGE
            finite = torch.isfinite(plane_logdet.detach()).all()
            if not self.conditioner.static:
                if not bool(finite):
                    raise ValueError(message)
            elif torch._C._functorch.maybe_current_level() is None:  # (no batching rule for a device assertion)
                try:
                    torch._assert_async(finite, message)
                except RuntimeError:  # raised at once on a CPU, eagerly
                    raise ValueError(message) from None
            self._logdet_checked = True
        out: Tensor = -0.5 * ((n - a) * LOG_2PI + plane_logdet)
        return out

    def _as_event(self: _Normal, name: str, value: object) -> Tensor:
        """``value`` checked as a floating tensor ``(..., n)`` that broadcasts with ``batch_shape + (n,)``, on the
        parameters' device, in the compute dtype; raises ``TypeError``/``ValueError`` naming ``name``."""
        value = check_tensor(name, value, min_dim=1)
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}; cast it first "
                            f"(e.g. {name}.to({self.result_dtype})).")
        expected = self.batch_shape + self.event_shape
        try:
            torch.broadcast_shapes(value.shape, expected)
            ok = value.shape[-1] == self.event_shape[0]
        except RuntimeError:
            ok = False
        if not ok:
            shape, n = tuple(value.shape), self.event_shape[0]
            start = next((s for s in range(len(shape) - 1) if math.prod(shape[s:]) == n), None)
            hint = "" if start is None else (
                f"; its trailing dimensions {' x '.join(map(str, shape[start:]))} hold n = {n} values (an image?): "
                f"flatten them, {name}.flatten({start - len(shape)})")
            raise ValueError(f"{name} must have shape (..., n) broadcastable with batch_shape + (n,) = "
                             f"{tuple(expected)}, got {shape}{hint}.")
        loc = self._unbroadcasted_loc
        if value.device != loc.device:
            raise ValueError(f"{name} is on device {value.device} but loc is on {loc.device}; pass {name} on "
                             f"{loc.device}.")
        return value.to(loc.dtype)
    def _as_target(self: _Normal, target: object) -> Tensor:
        """``target`` checked as in :meth:`_as_event` and, with ``validate_args``, finite (a NaN target would
        give a NaN loss silently)."""
        target = self._as_event("target", target)
        if self._validate_args:
            check_finite("target", target)
        return target
