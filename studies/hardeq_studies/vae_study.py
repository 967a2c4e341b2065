"""What the two MNIST VAE studies (``vae-data``, ``vae-latent``) share: their flags, settings, run and document.

Each study's ``run.py`` offers ``settings(config, preset)`` and ``run(settings, trials, epochs, **subsets,
checkpoint_path=, resume=, device=, progress=)`` (units checkpointed one by one); its ``report.py`` offers
``summarise(result, config)`` with ``records``, ``per_trial``, ``curves``, ``significance``, ``timing`` (and,
for vae-data, ``images`` and, when the units recorded test-RL curves, ``test_curves``).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from .contract import Study, positive_int
from .runtime import RunSetup, add_run_arguments

__all__ = ["VaeStudy"]


class VaeStudy(Study):
    """Base of the VAE studies; ``subsets`` names their subset flags (also ``run``'s keywords and the result's
    keys, recorded as ``<name>_run``)."""

    subsets: tuple[str, ...] = ()

    def _module(self, name: str) -> Any:
        return importlib.import_module(f"{type(self).__module__.rsplit('.', 1)[0]}.{name}")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--importance-samples", type=positive_int, default=None,
                            help="K of the importance-sampled NLL (default: the preset's)")
        add_run_arguments(parser)

    def settings(self, args: argparse.Namespace) -> dict[str, Any]:
        s = self._module("run").settings(self.config, args.preset)
        if getattr(args, "importance_samples", None):
            s["importance_samples"] = int(args.importance_samples)
        return s

    def execute(self, run: RunSetup) -> dict[str, Any]:
        return self._module("run").run(
            run.settings, run.trials, run.epochs, **{k: getattr(run.args, k, None) for k in self.subsets},
            checkpoint_path=run.checkpoint, resume=run.resume, device=run.device, progress=not run.quiet)

    def document(self, run: RunSetup, result: Any, wall: float) -> dict[str, Any]:
        summary = self._module("report").summarise(result, self.config)
        used = {**run.settings, "preset": run.preset, "trials": run.trials, "epochs": run.epochs,
                **{f"{k}_run": result[k] for k in self.subsets}, "paper": self.config["paper"],
                "source": self.config["source"]}
        images = {k: summary[k] for k in ("images", "test_curves") if k in summary}
        return {"config": used, "records": summary["records"], "device": run.device,
                "data": {"n_train": result["n_train"], "n_test": result["n_test"]}, "per_trial": summary["per_trial"],
                "curves": summary["curves"], **images, "significance": summary["significance"],
                "timing": {"total_s": wall, **summary["timing"]}}
