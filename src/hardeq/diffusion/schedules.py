r"""Conditioning schedules: at which steps of a sampling loop the :math:`x_0`-prediction is constrained.

A sampling loop of ``num_steps`` steps is indexed ``i = 0, ..., num_steps - 1``: ``i = 0`` is the first
(noisiest) step, ``i = num_steps - 1`` the last one, which produces :math:`x_0`. A schedule maps
``num_steps`` to the sorted tuple of the indices ``i`` at which the predicted :math:`\hat x_0` is replaced by
its conditioned version (:func:`~hardeq.diffusion.constrained_x0`).

Only a schedule that contains the last index ``num_steps - 1`` returns samples that satisfy the constraint
exactly (:attr:`Schedule.includes_last`); the others only steer the trajectory towards the constraint.

=========================  ==========================================================  =====================
schedule                   steps for ``num_steps = 10``                                 paper's name
=========================  ==========================================================  =====================
``Uniform(4)``             ``(1, 4, 6, 9)``: the last step of each of 4 equal blocks    "Uniform 4"
``StartEnd(3, 1)``         ``(0, 1, 2, 9)``: the first 3 and the last 1                 "Start 3 End 1"
``StartSpaced(4, 2)``      ``(0, 2, 4, 6)``: 4 steps from the start, 2 apart            "Start 4 Space 2"
``EndSpaced(4, 3)``        ``(0, 3, 6, 9)``: 4 steps ending at the last, 3 apart        "End 4 Space 3"
=========================  ==========================================================  =====================

Schedules are small frozen (hashable, comparable) objects; ``repr`` gives the constructor call
(``StartEnd(3, 1)``) and :attr:`~Schedule.label` / ``str`` the paper's name (``"Start 3 End 1"``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Schedule", "Uniform", "StartEnd", "StartSpaced", "EndSpaced", "Steps", "resolve_steps"]


def _check_int(name: str, value: object, *, minimum: int, owner: str) -> int:
    """``value`` as an int ``>= minimum``, else ``TypeError`` / ``ValueError`` naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < minimum:
        kind = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{owner}: {name} must be {kind}, got {name} = {value}.")
    return int(value)


def _check_num_steps(num_steps: object) -> int:
    return _check_int("num_steps", num_steps, minimum=1, owner="Schedule.steps")


class Schedule(ABC):
    """Base class of the conditioning schedules: subclasses implement :meth:`_steps` and :attr:`label`.

    Examples:
        >>> s = StartEnd(3, 1)  # a Schedule: the first 3 steps and the last one
        >>> isinstance(s, Schedule), s.steps(10), s.label, s.includes_last(10)
        (True, (0, 1, 2, 9), 'Start 3 End 1', True)
    """

    def steps(self, num_steps: int) -> tuple[int, ...]:
        """Sorted indices ``i`` in ``range(num_steps)`` at which the :math:`\\hat x_0`-prediction is conditioned.

        Raises:
            ValueError: if ``num_steps`` is not a positive int or the schedule asks for more steps than the
                loop has.
        """
        num_steps = _check_num_steps(num_steps)
        return tuple(sorted(set(self._steps(num_steps))))

    @abstractmethod
    def _steps(self, num_steps: int) -> Iterable[int]:
        ...

    @property
    @abstractmethod
    def label(self) -> str:
        """The paper's name of the schedule, e.g. ``"Start 3 End 1"``."""

    def includes_last(self, num_steps: int) -> bool:
        """Does the schedule condition the last step (so that the returned :math:`x_0` is exact)?"""
        return num_steps - 1 in self.steps(num_steps)

    def __str__(self) -> str:
        return self.label

    def _too_many(self, need: int, num_steps: int) -> ValueError:
        return ValueError(f"{self!r} needs a loop of at least {need} steps, but num_steps = {num_steps}.")


@dataclass(frozen=True, repr=False)
class Uniform(Schedule):
    r"""``n`` steps spread evenly over the loop, ending at the last step.

    The loop is cut into ``n`` consecutive blocks of (nearly) equal length and the last step of each block is
    conditioned: :math:`i_j = \lfloor (j + 1)\,N / n \rfloor - 1` for :math:`j = 0, \dots, n - 1`
    (``N = num_steps``). ``Uniform(N)`` conditions every step, ``Uniform(1)`` only the last one.

    Example:
        >>> Uniform(4).steps(10), Uniform(1).steps(10), Uniform(5).steps(10)
        ((1, 4, 6, 9), (9,), (1, 3, 5, 7, 9))
    """

    n: int

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1, owner="Uniform")

    def _steps(self, num_steps: int) -> Iterable[int]:
        if self.n > num_steps:
            raise self._too_many(self.n, num_steps)
        return [(j + 1) * num_steps // self.n - 1 for j in range(self.n)]

    @property
    def label(self) -> str:
        return f"Uniform {self.n}"

    def __repr__(self) -> str:
        return f"Uniform({self.n})"


@dataclass(frozen=True, repr=False)
class StartEnd(Schedule):
    """The first ``start`` and the last ``end`` steps: ``0, ..., start - 1`` and
    ``N - end, ..., N - 1`` (``N = num_steps``). Either count may be 0 (not both); they must not overlap
    (``start + end <= N``).

    Example:
        >>> StartEnd(3, 1).steps(10), StartEnd(1, 0).steps(10), StartEnd(0, 2).steps(10)
        ((0, 1, 2, 9), (0,), (8, 9))
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        _check_int("start", self.start, minimum=0, owner="StartEnd")
        _check_int("end", self.end, minimum=0, owner="StartEnd")
        if self.start + self.end == 0:
            raise ValueError("StartEnd: start + end must be positive (at least one conditioned step), got "
                             "start = 0 and end = 0.")

    def _steps(self, num_steps: int) -> Iterable[int]:
        if self.start + self.end > num_steps:
            raise self._too_many(self.start + self.end, num_steps)
        return [*range(self.start), *range(num_steps - self.end, num_steps)]

    @property
    def label(self) -> str:
        return f"Start {self.start} End {self.end}"

    def __repr__(self) -> str:
        return f"StartEnd({self.start}, {self.end})"


@dataclass(frozen=True, repr=False)
class StartSpaced(Schedule):
    """``n`` steps from the start, ``spacing`` apart: ``0, spacing, ..., (n - 1) spacing``.

    Does not contain the last step unless ``(n - 1) spacing = N - 1``; "Start 4 Space 1" is ``(0, 1, 2, 3)``.

    Example:
        >>> StartSpaced(4, 1).steps(10), StartSpaced(4, 2).steps(10)
        ((0, 1, 2, 3), (0, 2, 4, 6))
    """

    n: int
    spacing: int

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1, owner="StartSpaced")
        _check_int("spacing", self.spacing, minimum=1, owner="StartSpaced")

    def _steps(self, num_steps: int) -> Iterable[int]:
        need = (self.n - 1) * self.spacing + 1
        if need > num_steps:
            raise self._too_many(need, num_steps)
        return [j * self.spacing for j in range(self.n)]

    @property
    def label(self) -> str:
        return f"Start {self.n} Space {self.spacing}"

    def __repr__(self) -> str:
        return f"StartSpaced({self.n}, {self.spacing})"


@dataclass(frozen=True, repr=False)
class EndSpaced(Schedule):
    """``n`` steps ending at the last step, ``spacing`` apart: ``N - 1, N - 1 - spacing, ...,
    N - 1 - (n - 1) spacing``. Always contains the last step; ``EndSpaced(1, 1)`` is the last step only.

    Example:
        >>> EndSpaced(4, 3).steps(10), EndSpaced(3, 1).steps(10), EndSpaced(1, 1).steps(10)
        ((0, 3, 6, 9), (7, 8, 9), (9,))
    """

    n: int
    spacing: int

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1, owner="EndSpaced")
        _check_int("spacing", self.spacing, minimum=1, owner="EndSpaced")

    def _steps(self, num_steps: int) -> Iterable[int]:
        need = (self.n - 1) * self.spacing + 1
        if need > num_steps:
            raise self._too_many(need, num_steps)
        return [num_steps - 1 - j * self.spacing for j in range(self.n)]

    @property
    def label(self) -> str:
        return f"End {self.n} Space {self.spacing}"

    def __repr__(self) -> str:
        return f"EndSpaced({self.n}, {self.spacing})"


@dataclass(frozen=True, repr=False)
class Steps(Schedule):
    """An explicit set of step indices; negative indices count from the end (``-1`` is the last step).

    Example:
        >>> Steps((0, -1)).steps(10), Steps(()).steps(10)
        ((0, 9), ())
    """

    indices: tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.indices, (str, bytes)) or not isinstance(self.indices, Iterable):
            raise TypeError(f"Steps: indices must be a sequence of ints, got {type(self.indices).__name__}.")
        values = tuple(self.indices)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"Steps: indices must be ints, got {type(v).__name__} ({v!r}).")
        object.__setattr__(self, "indices", values)

    def _steps(self, num_steps: int) -> Iterable[int]:
        out = []
        for v in self.indices:
            if not -num_steps <= v < num_steps:
                raise ValueError(f"Steps: index {v} is out of range for a loop of num_steps = {num_steps}.")
            out.append(v % num_steps)
        return out

    @property
    def label(self) -> str:
        return "Steps " + ",".join(map(str, self.indices)) if self.indices else "None"

    def __repr__(self) -> str:
        return f"Steps({self.indices!r})"


def resolve_steps(schedule: Schedule | Iterable[int] | None, num_steps: int, *, default_last: bool) -> frozenset[int]:
    """The set of conditioned step indices of ``schedule`` for a loop of ``num_steps`` steps.

    ``schedule`` may be a :class:`Schedule`, an iterable of step indices (as :class:`Steps`), or ``None``:
    then the last step only if ``default_last`` (a constraint was given), else no step.
    """
    if schedule is None:
        return frozenset({num_steps - 1}) if default_last else frozenset()
    if not isinstance(schedule, Schedule):
        if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Iterable):
            raise TypeError("schedule must be a hardeq.diffusion Schedule (Uniform, StartEnd, StartSpaced, "
                            f"EndSpaced, Steps), a sequence of step indices or None, got {type(schedule).__name__}.")
        schedule = Steps(tuple(schedule))
    return frozenset(schedule.steps(num_steps))
