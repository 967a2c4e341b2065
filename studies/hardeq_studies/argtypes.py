"""argparse types of the command line's counts; a leaf module (it imports nothing of this package), so that
``hardeq --help`` and every study's flags can use it without importing a study or the harness."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["positive_int", "nonnegative_int"]


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {text}")
        return value

    parse.__name__ = f"{what.replace('-', '_')}_int"
    return parse


#: argparse type for counts (``--seeds``, ``--epochs``, ...): an integer >= 1
positive_int = _int_at_least(1, "positive")
#: argparse type for counts where 0 means "the default" (``--threads 0``): an integer >= 0
nonnegative_int = _int_at_least(0, "non-negative")
