r"""JSON specs of what :class:`~hardeq.diffusion.ConstrainedScheduler` records in its diffusers config (private;
no diffusers import).

Each ``*_spec`` function maps a runtime object to a JSON-serialisable value and the matching ``*_from_spec``
function maps it back, so that ``from_spec(spec(x))`` equals ``x`` (same type, values and dtype). What cannot be
written as JSON is recorded as an *unsaved* marker ``{"kind": "unsaved", "type": ..., "repr": ...}``: the
scheduler still runs with the object, but ``save_pretrained`` refuses (:func:`unsaved_entries`).

* a constraint: its own :meth:`~hardeq.EqualityConstraint.to_config` (e.g. ``{"kind": "channel_sum", "channels": C,
  "event_size": n, "totals": [...], "dtype": "float32"}`` for channel sums, ``"sum"``, ``"sparse"``, ``"linear"``;
  a constraint class without a compact kind saves its dense equivalent), read back by
  :meth:`~hardeq.EqualityConstraint.from_config` through the kind registry;
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
from typing import TYPE_CHECKING, Any, cast

from ..constraints import EqualityConstraint
from .schedules import EndSpaced, Schedule, StartEnd, StartSpaced, Steps, Uniform

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from .conditioning import ScaleLike

__all__ = ["constraint_spec", "constraint_from_spec", "schedule_spec", "schedule_from_spec", "scale_spec",
           "scale_from_spec", "unsaved", "unsaved_entries"]

_SCHEDULES: dict[str, type[Schedule]] = {cls.__name__: cls
                                         for cls in (Uniform, StartEnd, StartSpaced, EndSpaced, Steps)}


def unsaved(obj: object) -> dict[str, str]:
    """The marker recorded for a value that has no JSON spec."""
    return {"kind": "unsaved", "type": type(obj).__name__, "repr": repr(obj)[:200]}


def _is_unsaved(spec: object) -> bool:
    return isinstance(spec, dict) and spec.get("kind") == "unsaved"


def unsaved_entries(config: dict[str, Any]) -> list[str]:
    """The config keys holding an *unsaved* marker (``"constraint (SparseConstraint)"``, ...)."""
    return [f"{key} ({value['type']})" for key, value in config.items() if _is_unsaved(value)]


# ---------------------------------------------------------------------------------------------- constraints
def constraint_spec(constraint: EqualityConstraint | None) -> dict[str, Any] | None:
    """The JSON spec of ``constraint``: its :meth:`~hardeq.EqualityConstraint.to_config`."""
    return None if constraint is None else constraint.to_config()


def constraint_from_spec(spec: object) -> EqualityConstraint | None:
    """The constraint described by ``spec`` (inverse of :func:`constraint_spec`).

    Raises:
        ValueError: unknown ``kind``, missing keys, or an *unsaved* marker (from an older version that could not
        save the constraint).
    """
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise TypeError("ConstrainedScheduler: constraint must be a hardeq.EqualityConstraint (e.g. from "
                        "channel_sum_constraint), a config dict from its to_config() such as {'kind': 'channel_sum', "
                        f"'channels': C, 'event_size': C*H*W, 'totals': [...]}}, or None; got {type(spec).__name__}.")
    if _is_unsaved(spec):
        raise ValueError(f"ConstrainedScheduler: this config holds a {spec['type']} constraint that was not saved; "
                         "pass the constraint itself: ConstrainedScheduler.from_pretrained(..., constraint=...).")
    try:
        return EqualityConstraint.from_config(spec)
    except (TypeError, ValueError) as err:
        raise type(err)(f"ConstrainedScheduler: {err}") from err


# ---------------------------------------------------------------------------------------------- schedules
def schedule_spec(schedule: Schedule | None) -> dict[str, Any] | None:
    """``{"kind": <class name>, **fields}`` for the built-in schedules, an *unsaved* marker for others."""
    if schedule is None:
        return None
    if type(schedule) in _SCHEDULES.values():
        # (the built-in schedules are dataclasses)
        fields = {f.name: getattr(schedule, f.name) for f in dataclasses.fields(cast("DataclassInstance", schedule))}
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
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k != "kind"}
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


def scale_from_spec(spec: object) -> ScaleLike:
    """The inverse of :func:`scale_spec` (a runtime tensor or callable passes through)."""
    if isinstance(spec, dict):
        if _is_unsaved(spec):
            raise ValueError(f"ConstrainedScheduler: this config holds a {spec['type']} scale that was not saved; pass "
                             "it: ConstrainedScheduler.from_pretrained(..., scale=...).")
        raise ValueError(f"ConstrainedScheduler: scale must be None, a float, a tensor or a callable, got {spec!r}.")
    return cast("ScaleLike", spec)  # (a runtime tensor or callable passes through; resolve_scale uses it)
