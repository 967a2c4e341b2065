"""hardeq-studies: the paper's studies, run by ``hardeq reproduce NAME``; one subpackage per study.

This package is separate from the library ``hardeq`` and imports only its public API (tested by
studies/tests/test_public_api.py). It ships the data sets the studies read (``data/``, ``mof/data``,
``portfolio/data``), each beside its SOURCE.md and licence file. A study's ``config.json`` names the pip extra
with its optional dependencies (``"extra"``) and the modules the command imports before any work
(``"requires"``).

Discovery is lazy: :func:`available` lists the subpackages that hold a ``config.json`` and :func:`info` reads
it, without importing any study (``hardeq --help`` stays light). :func:`load_study` imports one study and
returns its :class:`~hardeq_studies.contract.Study`. The contract is described in
:mod:`hardeq_studies.contract`; the shared training harness is :mod:`hardeq_studies.harness`.
"""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["available", "info", "load_study", "__version__"]

__version__ = "0.1.0"

_ROOT = Path(__file__).resolve().parent


def _folder(name: str) -> str:
    """The subpackage of study ``name`` (``vae-latent`` lives in ``vae_latent``)."""
    return name.replace("-", "_")


def available() -> list[str]:
    """Names of the studies (folders of this package with a ``config.json``, ``_`` read as ``-``), sorted."""
    return sorted(p.parent.name.replace("_", "-") for p in _ROOT.glob("*/config.json")
                  if not p.parent.name.startswith("_"))


@lru_cache(maxsize=None)
def info(name: str) -> dict[str, Any]:
    """The ``config.json`` of study ``name`` (read, not imported); unknown names raise ``ValueError``."""
    if name not in available():
        raise ValueError(f"unknown study {name!r}; available: {available()}.")
    return json.loads((_ROOT / _folder(name) / "config.json").read_text())


def load_study(name: str):
    """Import study ``name`` and return its ``STUDY`` object; unknown names raise ``ValueError``."""
    info(name)
    return importlib.import_module(f"{__name__}.{_folder(name)}.study").STUDY
