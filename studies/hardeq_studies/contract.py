"""The contract every study fulfils: a name, presets, ``run`` and ``report``.

A study lives in ``hardeq_studies/NAME/`` with

* ``config.json`` -- its settings, read *without importing the study* by :mod:`hardeq_studies` (so that
  ``hardeq --help`` stays light): ``"summary"`` (one line), ``"extra"`` (the pip extra with its optional
  dependencies, or null), ``"default_preset"`` and ``"presets"``: ``{"quick" | "cpu" | "paper": {...,
  "description": str, "duration": str}}`` -- ``duration`` is the measured wall time, stated by ``--help``;
* ``study.py`` defining ``STUDY``, an instance of a :class:`Study` subclass, and the modules it needs.

The CLI calls ``STUDY.add_arguments(parser)`` (study-specific flags; only when that study is named), then
``doc = STUDY.run(args)`` (computes, writes ``OUT/NAME.json`` and returns the results document) and
``STUDY.report(doc, out)`` (writes ``OUT/NAME.md`` and the figures from the document alone, so
``hardeq report NAME`` can redo them without rerunning).

:meth:`Study.run` is a template: it resolves the run once for every study (:func:`~hardeq_studies.runtime.
setup_run`: device, process group, threads, trials, epochs, checkpoint folder), times the study's
:meth:`Study.execute`, writes the document the study's :meth:`Study.document` describes (rank 0 only),
removes the checkpoints and leaves the process group. A study supplies its settings, the computation
(training goes through :mod:`hardeq_studies.harness`) and its records.

A run may take several *legs*: a leg that ends without a result (interrupted by SIGINT / SIGTERM, or failed)
records its wall time beside the checkpoints (:func:`~hardeq_studies.runtime.record_leg`), and the ``--resume``
leg that completes the run writes ``"resumed"`` (bool), ``"resumed_legs"`` (the wall seconds of every leg, the
last one included) and ``"wall_seconds_total"`` (their sum) into the results document. A run without
``--resume`` forgets earlier legs. A running leg also rewrites its elapsed time every 30 s
(:class:`~hardeq_studies.runtime.LegClock`), so a leg killed outright (SIGKILL, power loss) still counts, up to
its last heartbeat.

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

from .argtypes import nonnegative_int, positive_int
from .extras import require
from .results import atomic_write_text, write_json
from .runtime import (LegClock, RunSetup, discard_checkpoints, earlier_legs, finish_run, forget_legs, record_leg,
                      setup_run, study_checkpoints)

__all__ = ["PRESETS", "Preset", "Study", "RunSetup", "positive_int", "nonnegative_int"]

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
    """Base class of a study (see the module docstring): a study implements :meth:`execute`, :meth:`document`
    and :meth:`markdown`, and optionally :meth:`add_arguments`, :meth:`settings`, :meth:`write_extra`,
    :meth:`figures` and :meth:`console`; :meth:`run` and :meth:`report` are templates around them.

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

    #: join the ``torchrun`` process group (the study splits its work over ranks)
    distributed: bool = False
    #: device when neither ``--device`` nor the preset names one (``None``: CUDA when available)
    default_device: str | None = "cpu"
    #: intra-op threads when neither ``--threads`` nor the preset sets them (``None``: torch's own)
    default_threads: int | None = 1
    #: keep the checkpoints after a completed run (a cache of trained models, reused by the next run)
    keeps_checkpoints: bool = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:  # noqa: B027 (optional hook)
        """Add the study's own flags to its ``hardeq reproduce NAME`` parser (default: none)."""

    def check_requirements(self, args: argparse.Namespace) -> None:
        """Import every optional dependency the run ``args`` asks for, before any work; a missing one raises
        :class:`~hardeq_studies.extras.MissingDependency` naming what to install (a corrupt one may raise
        ``ValueError``). Default: the modules ``config.json`` lists under ``"requires"``; a study whose options
        need more (a flag that turns on a metric with its own weights, say) extends it."""
        extra = self.config.get("extra") or "studies"
        for module in self.config.get("requires", []):
            require(module, extra, purpose=f"the {self.name} study")

    def pending_checkpoints(self, args: argparse.Namespace, folder: Path) -> list[Path]:
        """The checkpoints of an earlier run in ``folder`` that this run would overwrite unless it continues
        them with ``--resume`` (the CLI refuses to start over them without ``--resume`` or ``--fresh``, and
        ``--fresh`` removes exactly these). Default: every checkpoint of the study
        (:func:`~hardeq_studies.runtime.study_checkpoints`); a study that keeps finished models as a cache
        leaves those out."""
        return study_checkpoints(self.name, folder)

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        """The preset's settings with the study's command-line overrides (default: the preset's as they are)."""
        return dict(self.presets[args.preset].settings)

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        """Run the study as ``args`` says, write ``args.out / f"{name}.json"`` and return that document
        (empty on the non-zero ranks of a ``torchrun`` job).

        A leg that raises (SIGINT / SIGTERM through :class:`~hardeq_studies.harness.StopRun`, or an error)
        records its wall time for the ``--resume`` leg (see the module docstring) and re-raises."""
        run = setup_run(args, self.settings(args), self.name, distributed=self.distributed,
                        default_device=self.default_device, default_threads=self.default_threads)
        legs = earlier_legs(run.legs) if run.resume else []
        resumed = run.resume and bool(legs or self.pending_checkpoints(args, run.checkpoint_dir))
        if run.ctx.is_main and not run.resume:
            forget_legs(run.legs)
        clock = LegClock(run.legs, enabled=run.ctx.is_main)  # a killed leg still counts, to its last heartbeat
        doc: dict[str, Any] = {}
        try:  # the leg's time is kept until its document is written (a stop while summarising it included)
            result = self.execute(run)
            wall = clock.elapsed()
            if run.ctx.is_main:
                fields = self.document(run, result, wall)
                config, records = fields.pop("config"), fields.pop("records")
                fields.setdefault("command", run.command)
                fields.update(resumed=resumed, resumed_legs=[*legs, wall], wall_seconds_total=sum(legs) + wall)
                doc = write_json(run.out / f"{self.name}.json", self.name, run.preset, config, records, **fields)
                self.write_extra(run, result)
        except BaseException:
            seconds = clock.stop()
            if run.ctx.is_main:
                record_leg(run.legs, seconds)
            raise
        clock.stop()
        if run.ctx.is_main:
            forget_legs(run.legs)
            if not self.keeps_checkpoints:
                discard_checkpoints(args, run.checkpoint_dir, f"{self.name}*.pt")
        finish_run(run.ctx)
        return doc

    @abstractmethod
    def execute(self, run: RunSetup) -> Any:
        """The study's computation for the resolved run."""

    @abstractmethod
    def document(self, run: RunSetup, result: Any, wall: float) -> dict[str, Any]:
        """The results document's fields from :meth:`execute`'s ``result`` and the wall time of this leg:
        ``config`` (the settings used), ``records`` and any further fields (``device``, ``timing``, ...;
        ``command``, ``resumed``, ``resumed_legs`` and ``wall_seconds_total`` are added)."""

    def write_extra(self, run: RunSetup, result: Any) -> None:  # noqa: B027 (optional hook)
        """Write further files next to ``OUT/NAME.json`` (default: none)."""

    def report(self, doc: dict[str, Any], out: Path, *, quiet: bool = False) -> list[Path]:
        """Write the figures and ``out / f"{name}.md"`` from the results document alone; print
        :meth:`console` unless ``quiet``; return the paths (the markdown first)."""
        out = Path(out)
        figures = [p for p in self.figures(doc, out) if p is not None]
        text = self.markdown(doc, out)
        atomic_write_text(out / f"{self.name}.md", text)
        if not quiet:
            print(self.console(doc, out, text))
        return [out / f"{self.name}.md", *figures]

    @abstractmethod
    def markdown(self, doc: dict[str, Any], out: Path) -> str:
        """The text of ``OUT/NAME.md``."""

    def figures(self, doc: dict[str, Any], out: Path) -> list[Path]:
        """Write the figures into ``out``; return their paths (default: none)."""
        return []

    def console(self, doc: dict[str, Any], out: Path, text: str) -> str:
        """What ``run`` prints after the report (default: the markdown)."""
        return text

