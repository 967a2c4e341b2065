"""The contract every study fulfils: a name, presets, ``run`` and ``report``.

A study lives in ``hardeq_studies/NAME/`` with

* ``config.json`` -- its settings, read *without importing the study* by :mod:`hardeq_studies` (so that
  ``hardeq --help`` stays light): ``"summary"`` (one line), ``"extra"`` (the pip extra with its optional
  dependencies, or null), ``"default_preset"`` and ``"presets"``: ``{"quick" | "cpu" | "paper": {...,
  "description": str, "duration": str}}`` -- ``duration`` is the measured wall time, stated by ``--help``;
* ``study.py`` defining ``STUDY``, an instance of a :class:`Study` subclass.

The CLI calls ``STUDY.add_arguments(parser)`` (study-specific flags; only when that study is named), then
``doc = STUDY.run(args)`` (computes, writes ``OUT/NAME.json`` and returns the results document) and
``STUDY.report(doc, out)`` (writes ``OUT/NAME.md`` and the figures from the document alone, so
``hardeq report NAME`` can redo them without rerunning).

``args`` always carries ``preset`` (``"quick"``, ``"cpu"`` or ``"paper"``), ``seeds`` and ``epochs`` (int or
None: the preset's), ``out`` (pathlib.Path), ``resume`` (bool), ``device`` (str or None) and ``quiet`` (bool).
Studies import only hardeq's public API and this package.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "Preset", "Study", "positive_int"]

#: the preset names every study offers, smallest first
PRESETS = ("quick", "cpu", "paper")


@dataclass(frozen=True)
class Preset:
    """One preset of a study: its name, what it runs, its measured duration, and its settings."""

    name: str
    description: str
    duration: str
    settings: dict[str, Any]


class Study(ABC):
    """Base class of a study (see the module docstring).

    Args:
        name: the study's name (its folder under ``hardeq_studies``).
        config: its ``config.json``, parsed.
    """

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        missing = [p for p in PRESETS if p not in config.get("presets", {})]
        if missing:
            raise ValueError(f"study {name!r}: config.json must define the presets {list(PRESETS)}; missing {missing}.")
        self.name = name
        self.config = config
        self.summary: str = config["summary"]
        self.default_preset: str = config.get("default_preset", "quick")

    @property
    def presets(self) -> dict[str, Preset]:
        return {k: Preset(k, v.get("description", ""), v.get("duration", "not measured"),
                          {kk: vv for kk, vv in v.items() if kk not in ("description", "duration")})
                for k, v in self.config["presets"].items()}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:  # noqa: B027 (optional hook)
        """Add the study's own flags to its ``hardeq reproduce NAME`` parser (default: none)."""

    @abstractmethod
    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        """Run the study as ``args`` says, write ``args.out / f"{name}.json"`` and return that document."""

    @abstractmethod
    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        """Write ``out / f"{name}.md"`` and the figures from the results document; return the paths."""


def positive_int(text: str) -> int:
    """argparse type for counts (``--seeds``, ``--epochs``, ...): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
