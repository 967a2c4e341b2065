r"""JSON specs of what :class:`~hardeq.diffusion.ConstrainedScheduler` records in its diffusers config (private;
no diffusers import).

Each ``*_spec`` function maps a runtime object to a JSON-serialisable value and the matching ``*_from_spec``
function maps it back, so that ``from_spec(spec(x))`` equals ``x`` (same type, values and dtype). What cannot be
written as JSON is recorded as an *unsaved* marker ``{"kind": "unsaved", "type": ..., "repr": ...}``: the
scheduler still runs with the object, but ``save_pretrained`` refuses (:func:`unsaved_entries`).

* channel sums (a ``SumConstraint`` with ``index = arange(C).repeat_interleave(n // C)``, as built by
  ``channel_sum_constraint``): ``{"kind": "channel_sum", "channels": C, "event_size": n, "totals": [...],
  "dtype": "float32"}``, ``totals`` of shape ``(C,)`` or ``(B, C)`` as (nested) lists;
* any other ``SumConstraint``: ``{"kind": "sum", "index": [n ints], "totals": [...], "dtype": ...}``;
* a ``LinearConstraint``: ``{"kind": "linear", "A": [[...]], "k": [...], "dtype": ...}``, dense nested lists,
  meant for small constraints (an ``(a, n)`` matrix costs about ``20 a n`` bytes of JSON);
* a built-in schedule: ``{"kind": "Uniform", "n": 4}``, ``{"kind": "StartEnd", "start": 3, "end": 1}``,
  ``StartSpaced`` / ``EndSpaced`` (``n``, ``spacing``), ``{"kind": "Steps", "indices": [0, -1]}``;
* ``scale``: ``null`` or a float.

``None`` is ``null`` throughout. Floats are written by Python's ``repr`` (shortest round-trip), so totals and
matrices come back bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch

from ..constraints import EqualityConstraint, LinearConstraint, SumConstraint
from .schedules import EndSpaced, Schedule, StartEnd, StartSpaced, Steps, Uniform

__all__ = ["constraint_spec", "constraint_from_spec", "schedule_spec", "schedule_from_spec", "scale_spec",
           "scale_from_spec", "unsaved", "unsaved_entries"]

_SCHEDULES = {cls.__name__: cls for cls in (Uniform, StartEnd, StartSpaced, EndSpaced, Steps)}
_DTYPES = ("float16", "bfloat16", "float32", "float64")


def unsaved(obj: object) -> dict[str, str]:
    """The marker recorded for a value that has no JSON spec."""
    return {"kind": "unsaved", "type": type(obj).__name__, "repr": repr(obj)[:200]}


def _is_unsaved(spec: object) -> bool:
    return isinstance(spec, dict) and spec.get("kind") == "unsaved"


def unsaved_entries(config: dict[str, Any]) -> list[str]:
    """The config keys holding an *unsaved* marker (``"constraint (SparseConstraint)"``, ...)."""
    return [f"{key} ({value['type']})" for key, value in config.items() if _is_unsaved(value)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(spec: dict[str, Any]) -> torch.dtype:
    name = spec.get("dtype", "float32")
    if name not in _DTYPES:
        raise ValueError(f"ConstrainedScheduler: constraint spec dtype must be one of {_DTYPES}, got {name!r}.")
    return getattr(torch, name)


# ---------------------------------------------------------------------------------------------- constraints
def _is_channel_layout(c: SumConstraint) -> bool:
    C, n = c.num_constraints, c.event_size
    if n % C:
        return False
    return bool(torch.equal(c.index.cpu(), torch.arange(C).repeat_interleave(n // C)))


def constraint_spec(constraint: EqualityConstraint | None) -> dict[str, Any] | None:
    """The JSON spec of ``constraint`` (see the module table), or an *unsaved* marker for other types."""
    if constraint is None:
        return None
    dtype = _dtype_name(constraint.dtype)
    if type(constraint) is SumConstraint:
        totals = constraint.k.detach().cpu().tolist()
        if _is_channel_layout(constraint):
            return {"kind": "channel_sum", "channels": constraint.num_constraints, "event_size": constraint.event_size,
                    "totals": totals, "dtype": dtype}
        return {"kind": "sum", "index": constraint.index.cpu().tolist(), "totals": totals, "dtype": dtype}
    if type(constraint) is LinearConstraint:
        return {"kind": "linear", "A": constraint.A.detach().cpu().tolist(), "k": constraint.k.detach().cpu().tolist(),
                "dtype": dtype}
    return unsaved(constraint)


def _require(spec: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if k not in spec]
    if missing:
        raise ValueError(f"ConstrainedScheduler: a constraint spec of kind {spec.get('kind')!r} needs the keys "
                         f"{list(keys)}, missing {missing} in {spec!r}.")


def constraint_from_spec(spec: object) -> EqualityConstraint | None:
    """The constraint described by ``spec`` (inverse of :func:`constraint_spec`).

    Raises:
        ValueError: unknown ``kind``, missing keys, or an *unsaved* marker (the object was never saved).
    """
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise TypeError("ConstrainedScheduler: constraint must be a hardeq.LinearConstraint / SumConstraint (e.g. "
                        "from channel_sum_constraint), a constraint spec dict such as {'kind': 'channel_sum', "
                        f"'channels': C, 'event_size': C*H*W, 'totals': [...]}}, or None; got {type(spec).__name__}.")
    kind = spec.get("kind")
    if kind == "channel_sum":
        _require(spec, "channels", "event_size", "totals")
        C, n = int(spec["channels"]), int(spec["event_size"])
        if C <= 0 or n % C:
            raise ValueError(f"ConstrainedScheduler: a channel_sum spec needs event_size = C*H*W divisible by "
                             f"channels = C, got channels = {C}, event_size = {n}.")
        totals = torch.tensor(spec["totals"], dtype=_dtype(spec))
        if totals.dim() not in (1, 2) or totals.shape[-1] != C:
            raise ValueError(f"ConstrainedScheduler: channel_sum totals must have shape (C,) = ({C},) or (B, C), got "
                             f"{tuple(totals.shape)}.")
        return SumConstraint(torch.arange(C).repeat_interleave(n // C), totals)
    if kind == "sum":
        _require(spec, "index", "totals")
        return SumConstraint(torch.tensor(spec["index"], dtype=torch.long), torch.tensor(spec["totals"],
                                                                                         dtype=_dtype(spec)))
    if kind == "linear":
        _require(spec, "A", "k")
        return LinearConstraint(torch.tensor(spec["A"], dtype=_dtype(spec)), torch.tensor(spec["k"],
                                                                                          dtype=_dtype(spec)))
    if kind == "unsaved":
        raise ValueError(f"ConstrainedScheduler: this config holds a {spec['type']} constraint that was not saved "
                         f"(only channel sums, SumConstraint and LinearConstraint have a JSON spec); pass the "
                         f"constraint itself: ConstrainedScheduler.from_pretrained(..., constraint=...).")
    raise ValueError(f"ConstrainedScheduler: unknown constraint spec kind {kind!r}; expected 'channel_sum', 'sum' or "
                     "'linear'.")


# ---------------------------------------------------------------------------------------------- schedules
def schedule_spec(schedule: Schedule | None) -> dict[str, Any] | None:
    """``{"kind": <class name>, **fields}`` for the built-in schedules, an *unsaved* marker for others."""
    if schedule is None:
        return None
    if type(schedule) in _SCHEDULES.values():
        fields = {f.name: getattr(schedule, f.name) for f in dataclasses.fields(schedule)}
        return {"kind": type(schedule).__name__, **{k: list(v) if isinstance(v, tuple) else v
                                                    for k, v in fields.items()}}
    return unsaved(schedule)


def schedule_from_spec(spec: object) -> Schedule | None:
    """A :class:`Schedule` from ``None``, a schedule, a spec dict or a sequence of step indices (as :class:`Steps`).

    Raises:
        TypeError: anything else. ValueError: an unknown ``kind`` or an *unsaved* marker.
    """
    if spec is None or isinstance(spec, Schedule):
        return spec
    if isinstance(spec, dict):
        kind = spec.get("kind")
        if kind == "unsaved":
            raise ValueError(f"ConstrainedScheduler: this config holds a {spec['type']} schedule that was not saved; "
                             "pass it: ConstrainedScheduler.from_pretrained(..., schedule=...).")
        if kind not in _SCHEDULES:
            raise ValueError(f"ConstrainedScheduler: unknown schedule kind {kind!r}; expected one of "
                             f"{sorted(_SCHEDULES)}.")
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k != "kind"}
        return _SCHEDULES[kind](**fields)
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Iterable):
        raise TypeError("schedule must be a hardeq.diffusion Schedule, a sequence of step indices, a schedule spec "
                        f"such as {{'kind': 'Uniform', 'n': 4}} or None, got {type(spec).__name__}.")
    return Steps(tuple(spec))


# ---------------------------------------------------------------------------------------------- scale
def scale_spec(scale: object) -> float | dict[str, str] | None:
    """``None`` or a float as is; a tensor or a callable as an *unsaved* marker."""
    if scale is None:
        return None
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale):
        return float(scale)
    return unsaved(scale)


def scale_from_spec(spec: object) -> object:
    """The inverse of :func:`scale_spec` (a runtime tensor or callable passes through)."""
    if isinstance(spec, dict):
        if _is_unsaved(spec):
            raise ValueError(f"ConstrainedScheduler: this config holds a {spec['type']} scale that was not saved; pass "
                             "it: ConstrainedScheduler.from_pretrained(..., scale=...).")
        raise ValueError(f"ConstrainedScheduler: scale must be None, a float, a tensor or a callable, got {spec!r}.")
    return spec
