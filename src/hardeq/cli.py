"""The ``hardeq`` command line: ``hardeq reproduce NAME [--quick|--full] ...``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from .experiments import STUDIES, load_study

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hardeq",
        description="Deep generative models with hard linear equality constraints: exact conditioning.",
    )
    parser.add_argument("--version", action="version", version=f"hardeq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    rep = sub.add_parser("reproduce", help="run one of the paper's studies and write results/NAME.*",
                         description="Run a study; writes OUT/NAME.json, OUT/NAME.md and PNG plots.")
    studies = rep.add_subparsers(dest="study", metavar="STUDY")
    for name in sorted(STUDIES):
        module = load_study(name)
        p = studies.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION)
        preset = p.add_mutually_exclusive_group()
        preset.add_argument("--quick", dest="preset", action="store_const", const="quick",
                            help="minutes-long smoke run (what the tests execute)")
        preset.add_argument("--full", dest="preset", action="store_const", const="full",
                            help="the paper's protocol")
        p.set_defaults(preset="quick")
        p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the preset's)")
        p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the preset's)")
        p.add_argument("--out", type=Path, default=Path("results"), help="output folder (default: results)")
        p.add_argument("--resume", action="store_true", help="continue an interrupted run from its checkpoint")
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "reproduce":
        if getattr(args, "study", None) is None:
            parser.parse_args(["reproduce", "--help"])
            return 0
        args._module.reproduce(args)
        return 0
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
