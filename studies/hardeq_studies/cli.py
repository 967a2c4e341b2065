"""The ``hardeq`` command line: ``hardeq reproduce STUDY [--preset quick|cpu|paper] ...`` and ``hardeq report``.

Studies are discovered lazily (:mod:`hardeq_studies`): ``hardeq --help`` and ``hardeq reproduce --help`` read
each study's ``config.json`` only; a study's module is imported when that study is named.

Before any work, ``hardeq reproduce`` checks what it can: the device (``--device`` or the preset's), ``--config``,
that ``--out`` (and ``--checkpoint-dir``) can be written, and the optional modules the study lists under
``"requires"`` in its config.json or its options need (:meth:`~hardeq_studies.contract.Study.check_requirements`),
and that no checkpoint of an earlier run would be overwritten (``--resume`` continues it, ``--fresh`` deletes it).
A bad value ends with one line ``hardeq reproduce NAME: error: ...`` on stderr and exit status 2, as argparse's
own errors do.

The first SIGINT (Ctrl-C) or SIGTERM stops a run: every worker process ends within seconds, the last atomic
checkpoints stay, one line gives the command that continues the run (the same arguments with ``--resume``) and
the exit status is 130 (SIGINT) or 143 (SIGTERM), without a traceback. The quick preset says first and last that
it is a smoke run. ``hardeq report NAME`` draws from where ``hardeq reproduce NAME`` wrote last (recorded in
``results/.last/``) unless ``--out`` says otherwise, and says which folder it draws.

Both print a short summary (the report's title and the tally of verdicts of each claims table) and the paths
they wrote; ``--verbose`` prints the whole Markdown report first.

``hardeq --help`` imports neither torch nor the library (the library's version, for ``--version``, is read
from the installed package's metadata), so it answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from . import __version__
from .argtypes import positive_int

__all__ = ["main", "build_parser", "resume_command", "summary", "LAST_DIR"]


class _Version(argparse.Action):
    """``--version``: the versions of hardeq-studies and of the library, the latter read from the installed
    distribution's metadata when asked (importing ``hardeq`` would import torch, seconds on a busy machine)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the versions of hardeq-studies and hardeq and exit", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            library = version("hardeq")
        except PackageNotFoundError:  # a source tree on sys.path, not installed
            from hardeq import __version__ as library
        print(f"hardeq-studies {__version__} (hardeq {library})")  # on stdout, as argparse's version action
        parser.exit()


def _describe(name: str, meta: dict) -> str:
    default = meta.get("default_preset", "quick")
    presets = meta["presets"]
    lines = [meta["summary"] + ".", "",
             f"Default preset: {default} ({presets[default].get('duration', 'not measured')}).", "", "Presets:"]
    for key, p in presets.items():
        # the duration's own text says whether it was measured or is projected ("projected ... (not run in full)")
        lines.append(f"  {key:6s} {p.get('description', '')}; duration: {p.get('duration', 'not measured')}")
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
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue an interrupted run from its checkpoints (refused when other code wrote them)")
    again.add_argument("--fresh", action="store_true",
                       help="delete the checkpoints of an earlier run and start over (without --resume or --fresh, "
                            "a run that finds such checkpoints stops and asks)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="write a cpu/paper result from a working tree with uncommitted changes (the JSON says so)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: the preset's)")
    _add_output_flags(p)
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
               + "\n\nRun `hardeq reproduce STUDY --help` for a study's presets, their durations (measured, or "
                 "projected where a preset was not run in full), flags.")
    parser.add_argument("--version", action=_Version)
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
    rp.add_argument("--out", type=Path, default=None,
                    help="folder holding NAME.json (default: where `hardeq reproduce NAME` wrote last, as recorded "
                         "in results/.last/ of the current folder; else results, the committed results)")
    _add_output_flags(rp)
    return parser


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    talk = p.add_mutually_exclusive_group()
    talk.add_argument("--quiet", action="store_true", help="no progress bars, summary or tables")
    talk.add_argument("--verbose", action="store_true",
                      help="print the whole Markdown report (default: a short summary and the paths written)")


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


def check_resume(name: str, folder: Path) -> str | None:
    """Why ``--resume`` must not continue from the checkpoints of study ``name`` in ``folder`` (one was written
    by other code), or ``None``."""
    from .harness.checkpoint import code_mismatch, load_checkpoint
    from .runtime import study_checkpoints

    for path in study_checkpoints(name, folder):
        try:
            why = code_mismatch(load_checkpoint(path))
        except Exception as exc:  # noqa: BLE001 (any unreadable file is a reason not to resume from it)
            why = f"cannot be read ({type(exc).__name__}: {exc})"
        if why:
            return f"--resume: checkpoint {path} {why}; pass --fresh instead to delete it and start over"
    return None


def resume_command(argv: list[str]) -> str:
    """The command that continues the run of ``argv``: the same arguments with ``--resume`` (``--fresh``,
    which would discard what the run left, dropped)."""
    args = [a for a in argv if a != "--fresh"]
    if "--resume" not in args:
        args.append("--resume")
    return "hardeq " + shlex.join(args)


def smoke_line(name: str) -> str:
    """What the quick preset prints first and last: its numbers are not the study's results."""
    return (f"quick preset: a smoke run of the {name} study (a few seeds and epochs, to check that everything "
            "runs); its numbers are not the study's results, which come from --preset cpu")


def last_state(name: str) -> Path:
    """``results/.last/NAME.json`` (under the current folder): where ``hardeq reproduce NAME`` wrote last."""
    return LAST_DIR / f"{name}.json"


#: the folder of the :func:`last_state` files (``results/.*`` is not tracked by git)
LAST_DIR = Path("results") / ".last"


def _record_last(name: str, out: Path, preset: str, command: str) -> None:
    import json

    from .results import atomic_write_text

    try:
        atomic_write_text(last_state(name), json.dumps({"out": str(Path(out).resolve()), "preset": preset,
                                                        "command": command}) + "\n")
    except OSError:  # a read-only working folder: `hardeq report` then needs --out, as before
        pass


def _last_out(name: str) -> Path | None:
    """The folder ``hardeq reproduce NAME`` wrote last (recorded by :func:`_record_last`), if it still holds
    ``NAME.json``."""
    import json

    try:
        out = Path(json.loads(last_state(name).read_text())["out"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return out if (out / f"{name}.json").is_file() else None


def _report(args: argparse.Namespace, prog: str, meta: dict) -> int:
    import json

    from . import load_study

    if args.out is None:
        last = _last_out(args.study)
        args.out = last or Path("results")
        if not args.quiet:
            print(f"drawing {args.out / (args.study + '.json')}: "
                  + (f"where `hardeq reproduce {args.study}` wrote last" if last else
                     f"the committed results (no `hardeq reproduce {args.study}` recorded in {LAST_DIR})")
                  + "; --out FOLDER draws another")
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
    paths = load_study(args.study).report(doc, args.out, quiet=True)
    if not args.quiet:
        _tell(paths, args.verbose)
        print(f"wrote {', '.join(str(p) for p in paths)} from {path} (no training)"
              + ("" if args.verbose else "; --verbose prints the whole report"))
    return 0


def summary(markdown: str) -> str:
    """A few lines for the terminal from a study's Markdown report: its title and, for each claims table (a
    table whose last column is ``verdict``), the number of claims under each verdict's label (its reason, after
    `` (`` or ``: ``, left out), in the order first met.

    >>> print(summary("# study (cpu preset)\\n\\n## Claims of the paper\\n\\n| claim | p | verdict |\\n|---|---|---|\\n"
    ...               "| a | 0.01 | reproduced (Wilcoxon) |\\n| b | 0.4 | undecided (more seeds) |\\n"
    ...               "| c | 0.02 | reproduced |\\n| d | 0.3 | undecided: still improving |\\n"))
    study (cpu preset)
    Claims of the paper: 4 claims: 2 reproduced, 2 undecided
    """
    lines = markdown.splitlines()
    out = [next((line.lstrip("# ").strip() for line in lines if line.startswith("# ")), "(report without a title)")]
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("# ").strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if cells and cells[-1] == "verdict":
            tally: dict[str, int] = {}
            i += 2  # the header and its |---| row
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                # the verdict's label: its reason (after " (" or ": ") is the report's, not the summary's
                verdict = lines[i].strip().strip("|").split("|")[-1].strip().split(" (")[0].split(": ")[0]
                tally[verdict] = tally.get(verdict, 0) + 1
                i += 1
            counts = ", ".join(f"{n} {verdict}" for verdict, n in tally.items())
            out.append(f"{section or 'claims'}: {sum(tally.values())} claims: {counts}")
            continue
        i += 1
    return "\n".join(out)


def _tell(paths: list, verbose: bool) -> None:
    """Print the whole report (``--verbose``) or its :func:`summary`; ``paths[0]`` is the Markdown report."""
    try:
        text = Path(paths[0]).read_text()
    except (IndexError, OSError):
        return
    print(text.rstrip("\n") if verbose else summary(text))


def _reproduce(args: argparse.Namespace, argv: list[str], prog: str, meta: dict) -> int:
    """``hardeq reproduce``: every check before any work, then the run; the first SIGINT or SIGTERM stops it
    (every worker process ends), prints the command that resumes it and returns 130 or 143."""
    import os

    from .harness.stop import StopRun, stop_on_signals

    state: dict = {"folder": None, "written": False}
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        with stop_on_signals():
            return _run(args, argv, prog, meta, state, rank0)
    except (StopRun, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, StopRun) else StopRun(2)  # a KeyboardInterrupt is a SIGINT
        if rank0:
            if state["written"]:
                tail = (f"{args.out / (args.study + '.json')} was written; redo its report with: "
                        f"hardeq report {args.study} "
                        f"--out {shlex.quote(str(args.out))}")
            elif state["folder"] is None:
                tail = "nothing was run"
            else:
                tail = f"the last checkpoints are kept in {state['folder']}; continue with: {resume_command(argv)}"
            print(f"{prog}: stopped by {stop.signal_name}; {tail}", file=sys.stderr, flush=True)
        return stop.exit_status


def _run(args: argparse.Namespace, argv: list[str], prog: str, meta: dict, state: dict, rank0: bool) -> int:
    import time

    from . import load_study
    from .harness.progress import still_running
    from .results import allow_dirty, dirty_refusal

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
    allow_dirty(args.allow_dirty)
    problem = dirty_refusal(args.study, args.preset)
    if problem:
        return _fail(prog, problem)
    folder = Path(getattr(args, "checkpoint_dir", None) or args.out / "checkpoints")
    if args.resume:
        problem = check_resume(args.study, folder)
        if problem:
            return _fail(prog, problem)
    check_requirements(args.study, meta)
    study = load_study(args.study)
    study.check_requirements(args)
    pending = study.pending_checkpoints(args, folder)
    if pending and not args.resume and not args.fresh:
        return _fail(prog, f"{folder} holds {len(pending)} checkpoint(s) of an earlier run of this study "
                           f"({pending[0].relative_to(folder)}{', ...' if len(pending) > 1 else ''}); pass --resume "
                           "to continue it, or --fresh to delete them and start over")
    if args.fresh and pending:
        for path in pending:
            path.unlink(missing_ok=True)
        if not args.quiet:
            print(f"--fresh: deleted {len(pending)} checkpoint(s) of an earlier run from {folder}", file=sys.stderr)
    args.command_line = "hardeq " + shlex.join(argv)
    smoke = args.preset == "quick" and not args.quiet and rank0
    if smoke:
        print(smoke_line(args.study), flush=True)
    state["folder"] = folder
    t0 = time.perf_counter()
    with still_running(args.study, enabled=not args.quiet and rank0 and not sys.stderr.isatty()):
        doc = study.run(args)
    if doc:  # empty on the non-zero ranks of a torchrun job
        state["written"] = True
        seconds = time.perf_counter() - t0
        _record_last(args.study, args.out, args.preset, args.command_line)
        paths = study.report(doc, args.out, quiet=True)
        if not args.quiet:
            _tell(paths, args.verbose)
            print(f"wrote {args.out / (args.study + '.json')} and its report in {seconds:.1f} s: "
                  f"{', '.join(str(p) for p in paths)}"
                  + ("" if args.verbose else "; --verbose prints the whole report"))
        if smoke:
            print(smoke_line(args.study), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``hardeq``; returns the exit status (0; 2: a bad argument or a missing dependency, one line on stderr;
    130 / 143: stopped by SIGINT / SIGTERM, with the command that resumes the run)."""
    from . import info
    from .extras import MissingDependency

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    prog = f"hardeq {args.command} {args.study}"
    meta = info(args.study)
    try:
        if args.command == "report":
            return _report(args, prog, meta)
        return _reproduce(args, argv, prog, meta)
    except (MissingDependency, ValueError) as exc:
        return _fail(prog, str(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
