"""The ``hardeq`` command line: ``hardeq reproduce STUDY [--preset quick|cpu|paper] ...`` and ``hardeq report``.

Studies are discovered lazily (:mod:`hardeq_studies`): ``hardeq --help`` and ``hardeq reproduce --help`` read
each study's ``config.json`` only; a study's module is imported when that study is named.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from hardeq import __version__ as hardeq_version

from . import __version__

__all__ = ["main", "build_parser"]

PRESET_ALIASES = {"quick": "quick", "cpu": "cpu", "full": "cpu", "paper": "paper"}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _describe(name: str, meta: dict) -> str:
    default = meta.get("default_preset", "quick")
    presets = meta["presets"]
    lines = [meta["summary"] + ".", "",
             f"Default preset: {default} ({presets[default].get('duration', 'not measured')}).", "", "Presets:"]
    for key, p in presets.items():
        lines.append(f"  {key:6s} {p.get('description', '')}; measured: {p.get('duration', 'not measured')}")
    lines += ["", f"Writes OUT/{name}.json (records, config, environment with git commit and dirty flag), "
              f"OUT/{name}.md and figures; OUT defaults to results/quick for the quick preset, results otherwise."]
    if meta.get("extra"):
        lines.append(f'Optional dependencies: pip install "hardeq-studies[{meta["extra"]}]".')
    return "\n".join(lines)


def _add_common(p: argparse.ArgumentParser, meta: dict) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--preset", choices=list(meta["presets"]), default=None,
                       help=f"protocol to run (default: {meta.get('default_preset', 'quick')})")
    group.add_argument("--quick", dest="preset", action="store_const", const="quick", help="same as --preset quick")
    group.add_argument("--cpu", dest="preset", action="store_const", const="cpu", help="same as --preset cpu")
    group.add_argument("--full", dest="preset", action="store_const", const="cpu",
                       help="same as --preset cpu (the full protocol that fits on a CPU; the committed results)")
    group.add_argument("--paper", dest="preset", action="store_const", const="paper",
                       help="same as --preset paper (meant for --device cuda)")
    p.add_argument("--seeds", type=_positive, default=None, help="number of seeds (default: the preset's)")
    p.add_argument("--epochs", type=_positive, default=None, help="training epochs, at least 1 (default: the preset's)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: results/quick for --preset quick, else results)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its checkpoints")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: the preset's)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or tables")
    p.set_defaults(_default_preset=meta.get("default_preset", "quick"))


def _selected(argv: list[str], names: list[str]) -> str | None:
    """The study named after ``reproduce`` in ``argv`` (so that only its module is imported)."""
    if "reproduce" not in argv:
        return None
    for token in argv[argv.index("reproduce") + 1:]:
        if not token.startswith("-"):
            return token if token in names else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the study named in ``argv`` (if any) gets its own flags, the others only the common ones."""
    from . import available, info, load_study

    names = available()
    parser = argparse.ArgumentParser(
        prog="hardeq", description="Deep generative models with hard linear equality constraints: exact conditioning.")
    parser.add_argument("--version", action="version",
                        version=f"hardeq-studies {__version__} (hardeq {hardeq_version})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    rep = sub.add_parser("reproduce", help="run one of the paper's studies and write OUT/NAME.{json,md,png}",
                         description="Run a study; writes OUT/NAME.json, OUT/NAME.md and PNG figures. "
                                     "Studies: " + ", ".join(names) + ". See `hardeq reproduce STUDY --help`.")
    studies = rep.add_subparsers(dest="study", metavar="STUDY", required=True)
    selected = _selected(list(argv or []), names)
    for name in names:
        meta = info(name)
        p = studies.add_parser(name, help=meta["summary"], description=_describe(name, meta),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(p, meta)
        if name == selected:
            load_study(name).add_arguments(p)
    rp = sub.add_parser("report", help="rewrite OUT/NAME.md and its figures from OUT/NAME.json (no training)",
                        description="Rewrite OUT/NAME.md and the figures from an existing OUT/NAME.json.")
    rp.add_argument("study", choices=names, metavar="STUDY", help=", ".join(names))
    rp.add_argument("--out", type=Path, default=Path("results"), help="folder holding NAME.json (default: results)")
    rp.add_argument("--quiet", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    import json

    from . import load_study
    from .extras import MissingDependency

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        study = load_study(args.study)
        if args.command == "report":
            path = args.out / f"{args.study}.json"
            if not path.exists():
                parser.error(f"{path} does not exist; run `hardeq reproduce {args.study}` first")
            doc = json.loads(path.read_text())
            study.report(doc, args.out, quiet=args.quiet)
            return 0
        args.preset = args.preset or args._default_preset
        if args.out is None:
            args.out = Path("results/quick") if args.preset == "quick" else Path("results")
        args.command_line = "hardeq " + shlex.join(argv)
        doc = study.run(args)
        if doc:  # empty on the non-zero ranks of a torchrun job
            study.report(doc, args.out, quiet=args.quiet)
    except (MissingDependency, ValueError) as exc:
        print(f"hardeq {args.command} {args.study}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
