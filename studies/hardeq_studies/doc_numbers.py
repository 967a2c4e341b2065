"""Every result number the study pages quote must be in the results: a check over README.md and docs/*.md.

:mod:`hardeq_studies.docs_sync` ties the *generated* blocks and the Results/Claims sections to the reports'
Markdown. This module checks the rest of the prose of the study pages (``docs/NAME.md`` of a study, and
README.md's bullets under "Results" that name a study): every number written with a decimal point (``28.78``),
in scientific notation (``2.3e-06``) or with thousands separators (``10,555``) must be a value of that study's
results (``results/**/NAME*.json`` but the learning curves and numeric arrays longer than :data:`LONG_ARRAY`,
which would let almost any number match; and the reports ``results/**/NAME*.md``) or of its ``config.json`` (the
presets and the paper's tables: the "seed's table list" of values every study starts from), at the precision
written: ``28.78`` matches a JSON value ``28.777...`` (rounded to 2 decimals) or ``2.878e1`` written so; ``10,555``
matches ``10554.7``; signs are ignored (``-0.43`` and ``+0.43`` are one quantity written two ways).

Not checked: code fences, inline code, generated blocks (copied verbatim, checked by docs_sync), Markdown
tables' separator rows, literal tuples of numbers (``betas (0.9, 0.999)``, ``fc(784,512)``), bare powers of ten
(``1e-9``: an order of magnitude or a tolerance, never a measured value) and numbers marked approximate
(``~2e5``), and the sections of a page that
document the library or derive a formula rather than report a study's results
(:data:`LIBRARY_SECTIONS`: tolerances of the library's tests, benchmarks of a step, API notes). A number of the
prose that no result holds is named with its page, line and section, so a typo (``28.87`` for ``28.78``), a stale
number from an earlier run, or a number computed by hand without a result behind it fails the test.

Cost: one pass over the study's JSON values (each written at 0-6 decimals and 1-6 significant digits) and
over the page's lines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["NUMBER", "LIBRARY_SECTIONS", "PAGES", "allowed_numbers", "checked_lines", "check_page", "normalise"]

ROOT = Path(__file__).resolve().parents[2]

#: a number as the check reads it: thousands-grouped (10,555 / 1,234.5), decimal (28.78), scientific (2.3e-06)
NUMBER = re.compile(r"(?<![\w.,])[-+−]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w]|,\d)"
                    r"|(?<![\w.,])[-+−]?\d+\.\d+(?:[eE][-+]?\d+)?(?![\w.]\d|[\w])"
                    r"|(?<![\w.,])[-+−]?\d+(?:\.\d+)?[eE][-+]?\d+(?![\w])")

#: page -> the study names whose results it quotes (``results/**/NAME*.json|md``, ``hardeq_studies/NAME/config.json``)
PAGES = {"docs/chemical.md": ("chemical",), "docs/diffusion.md": ("diffusion",), "docs/mof.md": ("mof",),
         "docs/portfolio.md": ("portfolio",), "docs/synthetic.md": ("synthetic",),
         "docs/vae.md": ("vae-latent", "vae-data")}

#: sections (a heading's text starts with one of these) that document the library, not a study's results
LIBRARY_SECTIONS = ("Quick start", "Constraints on images", "The conditioned step", "DDPM: the exact last step",
                    "DDIM: conditioned", "Schedules", "Random streams", "Baselines: project", "diffusers integration",
                    "API", "Exact in the box", "8-bit", "Flow matching", "Cost of the exact final steps",
                    "How the FID was verified", "Implementation: the shared training harness",
                    "Vectorisation benchmark", "The graph head", "The library pieces",
                    "Why the closed-form model's NLL exceeds", "The ensemble covariance")

#: numeric arrays longer than this (learning curves, per-window series) are not sources of quotable numbers
LONG_ARRAY = 20

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
#: a literal tuple of numbers, as code writes it (``betas (0.9, 0.999)``, ``fc(784,512)``): settings, not results
_TUPLE = re.compile(r"\((?:\s*[-+]?\d[\d.eE+-]*\s*,)+\s*[-+]?\d[\d.eE+-]*\s*\)")
#: a bare power of ten (``1e-9``, ``1e7``): an order of magnitude or a tolerance, never a measured value
_POWER_OF_TEN = re.compile(r"1(?:\.0*)?[eE][-+]?\d+")


def normalise(text: str) -> str:
    """A number's text without sign, thousands separators or a leading ``+``: what is compared."""
    return text.replace("−", "-").lstrip("+-").replace(",", "")


def _spellings(x: float) -> Iterator[str]:
    """``|x|`` at 0-6 decimals, 1-6 significant digits, and in scientific notation (both exponent spellings)."""
    a = abs(float(x))
    for d in range(7):
        yield f"{a:.{d}f}"
    for g in range(1, 7):
        yield f"{a:.{g}g}"
        e = f"{a:.{g - 1}e}"
        yield e
        yield re.sub(r"e([-+])0(\d)", r"e\g<1>\2", e)
        yield re.sub(r"e\+", "e", re.sub(r"e\+0(\d)", r"e\1", e))


def _values(obj: Any) -> Iterator[float | str]:
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _values(v)
    elif isinstance(obj, list):
        if len(obj) > LONG_ARRAY and all(isinstance(v, (int, float)) for v in obj):
            return  # a curve or a per-window series: not what prose quotes, and it would make any number match
        for v in obj:
            yield from _values(v)


def _sources(studies: Iterable[str], root: Path) -> list[Path]:
    paths: list[Path] = []
    for name in studies:
        paths += [p for p in (root / "results").rglob(f"{name}*") if p.suffix in (".json", ".md")
                  and not p.name.endswith(".curves.json")  # learning curves: thousands of values, quoted nowhere
                  and not any(part in ("quick", "checkpoints") or part.startswith(".")
                              for part in p.relative_to(root / "results").parts[:-1])]
        paths.append(root / "studies" / "hardeq_studies" / name.replace("-", "_") / "config.json")
    return sorted(p for p in paths if p.is_file())


def allowed_numbers(studies: Iterable[str], root: Path = ROOT) -> set[str]:
    """Every spelling (:func:`normalise`) of every number of the studies' results and configs."""
    out: set[str] = set()
    for path in _sources(studies, root):
        text = path.read_text()
        if path.suffix == ".md":
            out.update(normalise(m.group()) for m in NUMBER.finditer(text))
            out.update(re.findall(r"\d+", text))  # plain integers too: a page may group them (3000 -> 3,000)
            continue
        for v in _values(json.loads(text)):
            if isinstance(v, str):
                out.update(normalise(m.group()) for m in NUMBER.finditer(v))
            elif v == v and abs(v) != float("inf"):
                out.update(_spellings(v))
    return out


def checked_lines(text: str, readme: bool = False) -> Iterator[tuple[int, str, str, str]]:
    """``(line number, line without inline code, heading, study named)`` of the prose the check reads. For README
    only the bullets under "Results" that name a study (``hardeq reproduce NAME``; the study is ``""``
    otherwise), their continuation lines included."""
    heading, fence, generated, study, skip = "", False, False, "", False
    for i, line in enumerate(text.split("\n"), 1):
        if line.startswith("<!-- BEGIN generated"):
            generated = True
        if line.startswith("<!-- END generated"):
            generated = False
            continue
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = _HEADING.match(line)
        if m and not fence:
            heading = m.group(2)
            if len(m.group(1)) <= 3:
                skip = heading.startswith(LIBRARY_SECTIONS)
            study = ""
            continue
        if fence or generated or skip or re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", line):
            continue
        if readme:
            if not heading.startswith("Results"):
                continue
            if line.startswith("- "):
                named = re.findall(r"hardeq reproduce ([\w-]+)", line)
                study = named[0] if named else ""
            if not study:
                continue
        yield i, re.sub(r"`[^`]*`", "", line), heading, study


def check_page(page: str, root: Path = ROOT) -> list[str]:
    """The numbers of ``page`` (``"README.md"`` or a key of :data:`PAGES`) that no result of its studies holds."""
    text = (root / page).read_text()
    readme = page == "README.md"
    cache: dict[tuple[str, ...], set[str]] = {}
    problems = []
    for i, line, heading, study in checked_lines(text, readme):
        studies = (study,) if readme else PAGES[page]
        if studies not in cache:
            cache[studies] = allowed_numbers(studies, root)
        clean = _TUPLE.sub("", line)
        for m in NUMBER.finditer(clean):
            if _POWER_OF_TEN.fullmatch(normalise(m.group())) or clean[:m.start()].endswith("~"):
                continue
            if normalise(m.group()) not in cache[studies]:
                problems.append(f"{page}:{i}: {m.group()!r} (section {heading!r}) is in no result of "
                                f"{', '.join(studies)} (results/**/{'|'.join(studies)}*.json|md, config.json)")
    return problems
