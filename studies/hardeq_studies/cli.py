"""The ``hardeq`` command line: ``hardeq reproduce STUDY [--preset quick|cpu|paper] ...`` and ``hardeq report``.

Studies are discovered lazily (:mod:`hardeq_studies`): ``hardeq --help`` and ``hardeq reproduce --help`` read
each study's ``config.json`` only; a study's module is imported when that study is named.

Before any work, ``hardeq reproduce`` checks what it can: the device (``--device`` or the preset's), ``--config``,
that ``--out`` (and ``--checkpoint-dir``) can be written, and the optional modules the study lists under
``"requires"`` in its config.json. A bad value ends with one line ``hardeq reproduce NAME: error: ...`` on stderr
and exit status 2, as argparse's own errors do.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from hardeq import __version__ as hardeq_version

from . import __version__
from .contract import positive_int

__all__ = ["main", "build_parser"]


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
    p.add_argument("--seeds", type=positive_int, default=None, help="number of seeds (default: the preset's)")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="training epochs, at least 1 (default: the preset's)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: results/quick for --preset quick, else results)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from its checkpoints (refused when other code wrote them)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="write a cpu/paper result from a working tree with uncommitted changes (the JSON says so)")
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
        prog="hardeq", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The studies of 'Deep Generative Models with Hard Linear Equality Constraints', reproduced with "
                    "the hardeq library\n(package hardeq-studies).",
        epilog="studies:\n" + "\n".join(f"  {n:12s}{info(n)['summary']}" for n in names)
               + "\n\nRun `hardeq reproduce STUDY --help` for a study's presets, their measured durations, flags.")
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


def _fail(prog: str, message: str) -> int:
    """Print ``PROG: error: MESSAGE`` (one line, as argparse does) on stderr; the exit status is 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def check_device(device: str | None, preset_device: str | None, preset: str) -> str | None:
    """Why ``device`` (``--device``; ``None``: the preset's, ``preset_device``) cannot be used here, or ``None``."""
    import torch

    if device is None and preset_device is None:
        return None
    flag = f"--device {device}" if device is not None else f"the {preset} preset's device {preset_device}"
    device = device or preset_device
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"argument --device: {device!r} is not a torch device; use e.g. cpu, cuda or cuda:0"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return f"{flag}: CUDA is not available on this machine; pass --device cpu"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"{flag}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        return f"{flag}: MPS is not available on this machine; pass --device cpu"
    elif dev.type not in ("cpu", "cuda", "mps"):
        return f"argument --device: {device!r}: the studies run on cpu, cuda or mps"
    return None


def check_writable(folder: Path, flag: str) -> str | None:
    """Why ``folder`` cannot hold the outputs (it cannot be created, or a file cannot be written in it)."""
    import tempfile

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"argument {flag}: cannot write to {str(folder)!r} ({exc.strerror or exc})"
    return None


def check_config_file(path: Path | None) -> str | None:
    """Why ``--config PATH`` cannot be read as a JSON object, or ``None``."""
    import json

    if path is None:
        return None
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        return f"argument --config: cannot read {str(path)!r} ({exc.strerror or exc})"
    except json.JSONDecodeError as exc:
        return f"argument --config: {str(path)!r} is not JSON ({exc})"
    if not isinstance(doc, dict):
        return f"argument --config: {str(path)!r} holds a {type(doc).__name__}, expected a JSON object"
    return None


def check_requirements(name: str, meta: dict, modules: list[str] | None = None) -> None:
    """Import the optional modules study ``name`` declares (``"requires"`` in its config.json) before any work;
    a missing one raises :class:`~hardeq_studies.extras.MissingDependency` naming the pip extra."""
    from .extras import require

    extra = meta.get("extra") or "studies"
    for module in meta.get("requires", []) if modules is None else modules:
        require(module, extra, purpose=f"the {name} study")


def study_checkpoints(name: str, folder: Path) -> list[Path]:
    """The checkpoint files of study ``name`` in ``folder`` (``NAME*.pt`` and ``NAME*/**/*.pt``; not ``cache/``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = set(folder.glob(f"{name}*.pt"))
    for sub in folder.glob(f"{name}*"):
        if sub.is_dir():
            found.update(sub.rglob("*.pt"))
    return sorted(found)


def check_resume(name: str, folder: Path) -> str | None:
    """Why ``--resume`` must not continue from the checkpoints of study ``name`` in ``folder`` (one was written
    by other code), or ``None``."""
    from .harness.checkpoint import code_mismatch, load_checkpoint

    for path in study_checkpoints(name, folder):
        try:
            why = code_mismatch(load_checkpoint(path))
        except Exception as exc:  # noqa: BLE001 (any unreadable file is a reason not to resume from it)
            why = f"cannot be read ({type(exc).__name__}: {exc})"
        if why:
            return f"--resume: checkpoint {path} {why}; remove {folder} or run without --resume"
    return None


def main(argv: list[str] | None = None) -> int:
    import json
    import time

    from . import info, load_study
    from .extras import MissingDependency

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    prog = f"hardeq {args.command} {args.study}"
    meta = info(args.study)
    try:
        if args.command == "report":
            path = args.out / f"{args.study}.json"
            if not path.is_file():
                return _fail(prog, f"{path} does not exist; run `hardeq reproduce {args.study}` first")
            problem = check_writable(args.out, "--out")
            if problem:
                return _fail(prog, problem)
            try:
                doc = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                return _fail(prog, f"{path} is not JSON ({exc})")
            check_requirements(args.study, meta, [m for m in meta.get("requires", []) if m == "matplotlib"])
            paths = load_study(args.study).report(doc, args.out, quiet=args.quiet)
            if not args.quiet:
                print(f"wrote {', '.join(str(p) for p in paths)} from {path} (no training)")
            return 0
        args.preset = args.preset or args._default_preset
        if args.out is None:
            args.out = Path("results/quick") if args.preset == "quick" else Path("results")
        for problem in (check_device(args.device, meta["presets"][args.preset].get("device"), args.preset),
                        check_config_file(getattr(args, "config", None)),
                        check_writable(args.out, "--out"),
                        check_writable(args.checkpoint_dir, "--checkpoint-dir")
                        if getattr(args, "checkpoint_dir", None) else None):
            if problem:
                return _fail(prog, problem)
        from .results import allow_dirty, dirty_refusal

        allow_dirty(args.allow_dirty)
        problem = dirty_refusal(args.study, args.preset)
        if problem:
            return _fail(prog, problem)
        if args.resume:
            problem = check_resume(args.study, getattr(args, "checkpoint_dir", None) or args.out / "checkpoints")
            if problem:
                return _fail(prog, problem)
        check_requirements(args.study, meta)
        study = load_study(args.study)
        args.command_line = "hardeq " + shlex.join(argv)
        t0 = time.perf_counter()
        doc = study.run(args)
        if doc:  # empty on the non-zero ranks of a torchrun job
            seconds = time.perf_counter() - t0
            study.report(doc, args.out, quiet=args.quiet)
            if not args.quiet:
                print(f"wrote {args.out / (args.study + '.json')} and its report in {seconds:.1f} s")
    except (MissingDependency, ValueError) as exc:
        return _fail(prog, str(exc))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
