"""Registry of gradient estimators, keyed by their string id.

An estimator is a function of plain tensors (never of a ``Distribution``) returning the exact constrained
sample in the forward pass; estimators differ only in their backward pass. Two families are kept apart:
``"normal"`` (Gaussian conditioned on ``A z = k``) and ``"poisson"`` (Poissons conditioned on their sums).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from torch import Tensor

#: an estimator function: plain tensors in, the sample out
_E = TypeVar("_E", bound=Callable[..., Tensor])

__all__ = ["Estimator", "register_estimator", "get_estimator", "available_estimators", "ESTIMATORS"]


@dataclass(frozen=True)
class Estimator:
    """A registered estimator: its id, family, function, and whether its gradient is exact (unbiased).

    Examples:
        >>> from hardeq.estimators import get_estimator
        >>> e = get_estimator("pathwise")
        >>> e.name, e.family, e.exact  # exact: its gradient is unbiased
        ('pathwise', 'normal', True)
    """

    name: str
    family: str
    fn: Callable[..., Tensor]
    exact: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.fn(*args, **kwargs)


ESTIMATORS: dict[str, dict[str, Estimator]] = {"normal": {}, "poisson": {}}


def _family(family: object) -> dict[str, Estimator]:
    """The registry of ``family``, or ``ValueError`` listing the known families."""
    if not isinstance(family, str) or family not in ESTIMATORS:
        known = ", ".join(repr(f) for f in sorted(ESTIMATORS))
        raise ValueError(f"family must be one of {known}; got {family!r}.")
    return ESTIMATORS[family]


def register_estimator(name: str, *, family: str = "normal", exact: bool = False) -> Callable[[_E], _E]:
    """Decorator registering ``fn`` under ``name`` in ``family`` (``"normal"`` or ``"poisson"``).

    Examples:
        >>> from hardeq.estimators import ESTIMATORS, get_estimator, register_estimator
        >>> @register_estimator("no_grad")
        ... def no_grad(cond, loc, noise):  # the exact sample, no gradient
        ...     return get_estimator("pathwise")(cond, loc, noise).detach()
        >>> d = ConstrainedNormal(torch.zeros(3, requires_grad=True), 1.0,
        ...                       constraint=SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1)))
        >>> try:
        ...     d.rsample((2,), "no_grad").requires_grad, d.rsample((2,)).requires_grad
        ... finally:
        ...     del ESTIMATORS["normal"]["no_grad"]  # unregister again
        (False, True)
    """
    registry = _family(family)

    def decorator(fn: _E) -> _E:
        if name in registry:
            raise ValueError(f"estimator {name!r} is already registered for family {family!r}.")
        registry[name] = Estimator(name, family, fn, exact)
        return fn

    return decorator


def get_estimator(name: str, family: str = "normal") -> Estimator:
    """Look up an estimator by id; unknown ids raise ``ValueError`` listing the known ones.

    Examples:
        >>> from hardeq.estimators import get_estimator
        >>> get_estimator("marginal_expectation").exact
        False
        >>> get_estimator("pathwize")
        Traceback (most recent call last):
            ...
        ValueError: unknown estimator 'pathwize': estimator must be one of ... for the 'normal' family.
    """
    registry = _family(family)
    if not isinstance(name, str):
        raise TypeError(f"estimator must be a string id, got {type(name).__name__}.")
    try:
        return registry[name]
    except KeyError:
        raise ValueError(
            f"unknown estimator {name!r}: estimator must be one of {', '.join(repr(e) for e in sorted(registry))} "
            f"for the {family!r} family."
        ) from None


def available_estimators(family: str = "normal") -> list[str]:
    """Sorted ids of the estimators registered for ``family``.

    Examples:
        >>> from hardeq.estimators import available_estimators
        >>> "pathwise" in available_estimators(), "random" in available_estimators("poisson")
        (True, True)
    """
    return sorted(_family(family))
