"""The paper's studies, run by ``hardeq reproduce NAME``.

Each study is a module in this package exposing::

    DESCRIPTION: str                         # one line, shown by ``hardeq reproduce --help``
    add_arguments(parser) -> None            # optional: study-specific flags
    reproduce(args: argparse.Namespace) -> dict   # runs the study, writes results/NAME.{json,md,png}

``args`` always carries ``preset`` ("quick" or "full"), ``seeds`` (int or None), ``epochs`` (int or None),
``out`` (pathlib.Path) and ``resume`` (bool). Studies import only hardeq's public API.
"""

from __future__ import annotations

import importlib

__all__ = ["STUDIES", "load_study"]

#: study name -> module (relative to this package). Only studies that exist are listed.
STUDIES: dict[str, str] = {
    "chemical": "chemical",
    "synthetic": "synthetic",
}


def load_study(name: str):
    """Import the module of study ``name``; unknown names raise ``ValueError`` listing the known ones."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; available: {sorted(STUDIES)}.")
    return importlib.import_module(f".{STUDIES[name]}", __name__)
