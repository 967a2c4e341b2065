"""Keep the docs' result numbers tied to the results documents: generated blocks and checked prose.

Every number about results that ``docs/NAME.md`` or ``README.md`` states comes from a study's JSON, in one of
two ways:

* **Generated blocks.** A page embeds a section of a study's report (``results/NAME.md``, which
  ``hardeq report NAME`` regenerates from ``results/NAME.json``) verbatim between two markers::

      <!-- BEGIN generated: results/NAME.md "Claims of the paper" -->
      ...the section's lines, without its heading...
      <!-- END generated -->

  The section is everything from the heading whose text equals the quoted name to the next heading of the
  same or a higher level, with blank lines at both ends dropped. ``python -m hardeq_studies.docs_sync``
  rewrites every block from the committed reports; ``--check`` only reports the stale ones (exit status 1).
* **Checked prose.** Outside generated blocks, code fences and inline code, a section whose heading starts
  with "Results", "Claims", "Findings" or "Discussion" may state a decimal number (``1.27``, ``0.002``,
  ``8e-5``, ``34%``) only if the same text occurs in one of the reports that the page draws from (the
  ``results/*.md`` files its generated blocks or links name; for README's "Results" section, the report of the
  study each bullet names through ``hardeq reproduce NAME``).

:func:`check_page` returns the problems of one page; the tests run it over README.md and docs/*.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "report_section", "find_blocks", "sync_text", "checked_numbers", "check_page", "main"]

ROOT = Path(__file__).resolve().parents[2]

BEGIN = re.compile(r'^<!-- BEGIN generated: (?P<path>\S+\.md) "(?P<section>[^"]+)" -->\s*$')
END = "<!-- END generated -->"
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
#: a number as prose writes it (1.27, -0.22, 1,234.5, 8e-5, 34%); :func:`checked_numbers` keeps the decimal ones
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?%?(?![\w%]|\.\d)")
CHECKED_HEADINGS = ("results", "claims", "findings", "discussion")


@dataclass(frozen=True)
class Block:
    """One generated block of a page: the report it copies, the section's name, its current body and the
    line numbers (0-based) of its BEGIN and END markers."""

    path: str
    section: str
    body: str
    begin: int
    end: int


def _strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def report_section(text: str, name: str) -> str:
    """The body of the section ``name`` of a Markdown report (the lines after its heading up to the next
    heading of the same or a higher level; blank lines at both ends dropped). Raises ``KeyError`` naming the
    sections that exist when there is none of that name; headings inside code fences do not count."""
    lines = text.splitlines()
    found: tuple[int, int] | None = None
    names = []
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        level = len(m.group(1))
        if found is not None and level <= found[1]:
            return "\n".join(_strip_blank(lines[found[0] + 1:i]))
        names.append(m.group(2))
        if m.group(2) == name and found is None:
            found = (i, level)
    if found is None:
        raise KeyError(f"no section {name!r}; the report has {names}")
    return "\n".join(_strip_blank(lines[found[0] + 1:]))


def find_blocks(text: str) -> list[Block]:
    """The generated blocks of a page, in order; ``ValueError`` for a BEGIN without its END (or nested)."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if m:
            for j in range(i + 1, len(lines)):
                if BEGIN.match(lines[j]):
                    raise ValueError(f"line {j + 1}: a generated block begins inside the one of line {i + 1}")
                if lines[j].strip() == END:
                    blocks.append(Block(m.group("path"), m.group("section"),
                                        "\n".join(_strip_blank(lines[i + 1:j])), i, j))
                    i = j
                    break
            else:
                raise ValueError(f"line {i + 1}: generated block without {END!r}")
        i += 1
    return blocks


def _read_report(root: Path, path: str, cache: dict[str, str]) -> str:
    if path not in cache:
        file = root / path
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no such report (run `hardeq report` for its study)")
        cache[path] = file.read_text()
    return cache[path]


def sync_text(text: str, root: Path = ROOT, errors: list[str] | None = None) -> tuple[str, list[str]]:
    """``text`` with every generated block rewritten from its report under ``root``, and the list of the blocks
    that changed (``'results/NAME.md "Section"'``). A block whose report or section does not exist is left as it
    is and its problem appended to ``errors`` (raised, as ``KeyError`` / ``FileNotFoundError``, when ``errors``
    is None)."""
    lines = text.splitlines()
    cache: dict[str, str] = {}
    changed = []
    for block in reversed(find_blocks(text)):
        try:
            fresh = report_section(_read_report(root, block.path, cache), block.section)
        except (KeyError, FileNotFoundError) as exc:
            if errors is None:
                raise
            errors.append(f"{block.path}: {exc.args[0] if exc.args else exc}")
            continue
        if fresh != block.body:
            changed.append(f'{block.path} "{block.section}"')
        lines[block.begin + 1:block.end] = fresh.splitlines()
    new = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
    return new, changed[::-1]


def _prose_lines(text: str) -> list[tuple[int, str, str]]:
    """``(line number, line, heading path)`` of the lines outside code fences and generated blocks."""
    out = []
    fenced = in_block = False
    headings: list[tuple[int, str]] = []
    for i, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if BEGIN.match(line):
            in_block = True
            continue
        if line.strip() == END:
            in_block = False
            continue
        if in_block:
            continue
        m = HEADING.match(line)
        if m:
            level = len(m.group(1))
            headings = [h for h in headings if h[0] < level] + [(level, m.group(2))]
        out.append((i + 1, line, " / ".join(h[1] for h in headings)))
    return out


def _is_checked(heading_path: str) -> bool:
    return any(part.strip().lower().startswith(CHECKED_HEADINGS) for part in heading_path.split(" / "))


def checked_numbers(line: str) -> list[str]:
    """The decimal numbers of a prose line, inline code removed."""
    tokens = NUMBER.findall(re.sub(r"`[^`]*`", "", line))
    return [t.rstrip(",") for t in tokens if any(c in t for c in ".eE%")]


def _page_reports(text: str) -> set[str]:
    found = {b.path for b in find_blocks(text)}
    found |= set(re.findall(r"(results/(?:[\w.-]+/)*[\w.-]+\.md)", text))
    return found


def check_page(path: Path, root: Path = ROOT) -> list[str]:
    """The problems of one page: stale generated blocks, and numbers in its Results/Claims/Findings sections
    that none of its reports states. README.md's Results bullets are checked against the study each bullet
    names (``hardeq reproduce NAME``), or the Markdown files a bullet links when it names no study."""
    path = Path(path)
    text = path.read_text()
    errors: list[str] = []
    try:
        problems = [f"{path.name}: generated block {b} is stale; run `python -m hardeq_studies.docs_sync`"
                    for b in sync_text(text, root, errors)[1]]
    except ValueError as exc:
        problems = [f"{path.name}: {exc}"]
    problems += [f"{path.name}: {e}" for e in errors[::-1]]
    cache: dict[str, str] = {}
    page_reports = [p for p in sorted(_page_reports(text)) if (root / p).is_file()]
    bullet_reports: list[str] = []
    for lineno, line, heading in _prose_lines(text):
        if not _is_checked(heading):
            continue
        if path.name == "README.md":
            if line.lstrip().startswith("- "):
                named = re.findall(r"hardeq reproduce ([\w-]+)", line)
                linked = re.findall(r"\]\(([\w./-]+\.md)\)", line)
                bullet_reports = [f"results/{n}.md" for n in named] if named else linked
            reports = bullet_reports
        else:
            reports = page_reports
        sources = [_read_report(root, r, cache) for r in reports if (root / r).is_file()]
        for number in checked_numbers(line):
            if not any(number in s for s in sources):
                where = ", ".join(reports) or "no report (the page names none)"
                problems.append(f"{path.name}:{lineno}: {number!r} (section {heading!r}) is in none of {where}")
    return problems


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hardeq_studies.docs_sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale blocks and unchecked numbers")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout's)")
    args = parser.parse_args(argv)
    status = 0
    for page in pages(args.root):
        text = page.read_text()
        if not args.check:
            try:
                new, changed = sync_text(text, args.root, errors=[])
            except ValueError:
                changed = []  # check_page below names the problem
            if changed:
                page.write_text(new)
                print(f"{page.relative_to(args.root)}: rewrote {', '.join(changed)}")
        for problem in check_page(page, args.root):
            print(problem)
            status = 1
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
