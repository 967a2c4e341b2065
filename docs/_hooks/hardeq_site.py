"""MkDocs hooks of the hardeq site (named in mkdocs.yml under ``hooks:``; not a page of the site).

Two jobs, both done at build time from the files in the repository, so the Markdown files stay readable on
their own (on GitHub, in an editor) and the built site has no broken link:

* **Study figures.** The studies write their figures next to their reports, in ``results/`` (outside ``docs/``).
  A page links them as it would on its own, ``![...](../results/mof_curves.png)``; :func:`on_files` adds every
  figure under ``results/`` (``results/quick/`` excepted) to the site as ``results/...``, and
  :func:`on_page_markdown` rewrites each link that leaves ``docs/`` for one of those figures into the site's
  path. A link that leaves ``docs/`` for anything else is left as it is, so ``mkdocs build --strict`` fails on it.
* **Sections included from another page.** A guide page is built from today's docs, not written anew: the line

      <!-- include: api.md "## Constraints" -->

  is replaced by the body of that section of ``docs/api.md`` (everything after the heading, up to the next
  heading of the same or a higher level; fenced code is not searched for headings). The included text's
  relative links are rebased onto the including page, its links to its own anchors (``#x``) point back to the
  source page, and its headings are shifted so that the section's heading would sit at ``level`` (default 2):
  ``<!-- include: math.md "### Scaling and equilibration" level=3 -->``. A missing file or section is an error
  that names them, so the build fails rather than publishing an empty page.
* **Source files included whole.** ``<!-- include-source: ../../examples/poisson_fixed_total.py -->`` (a path
  relative to the page, anywhere in the repository) is replaced by a fenced code block holding the file, so an
  example's page shows the script as it is in the repository. A missing file, or one outside the repository, is
  an error that names it.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.hardeq")

#: figure formats taken from results/
FIGURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg")
#: folders of results/ that are not published (smoke-run output, the pointer to the last run)
SKIPPED_RESULTS = ("quick", ".last")

INCLUDE = re.compile(r'^<!--\s*include:\s*(?P<path>[\w./-]+\.md)\s+"(?P<heading>#+ [^"]+)"'
                     r'(?:\s+level=(?P<level>[1-6]))?\s*-->\s*$', re.MULTILINE)
INCLUDE_SOURCE = re.compile(r"^<!--\s*include-source:\s*(?P<path>[\w./-]+)\s*-->\s*$", re.MULTILINE)
#: fence language by suffix for include-source
SOURCE_LANGUAGES = {".py": "python", ".yml": "yaml", ".yaml": "yaml", ".toml": "toml", ".sh": "bash"}
# a Markdown inline link or image: [text](target) / ![alt](target "title"); the target is group "target"
LINK = re.compile(r'(?P<head>!?\[[^\]\n]*\]\()(?P<target>[^)\s]+)(?P<tail>(?:\s+"[^"]*")?\))')
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6}) (.*)$")

_figures: dict[str, str] = {}  # repository-relative path -> site path (src_uri), filled by on_files


def _repo_root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def on_files(files, config):
    """Add the figures under results/ to the site as ``results/...`` (copied by MkDocs, never into docs/)."""
    root = _repo_root(config)
    results = root / "results"
    _figures.clear()
    if not results.is_dir():
        return files
    for path in sorted(results.rglob("*")):
        rel = path.relative_to(root).as_posix()
        parts = path.relative_to(results).parts
        if path.suffix.lower() not in FIGURE_SUFFIXES or not path.is_file() or parts[0] in SKIPPED_RESULTS:
            continue
        if files.get_file_from_path(rel) is None:
            files.append(File(rel, str(root), config["site_dir"], config["use_directory_urls"]))
        _figures[rel] = rel
    return files


def _split_target(target: str) -> tuple[str, str]:
    path, sep, anchor = target.partition("#")
    return path, sep + anchor


def _is_relative(target: str) -> bool:
    return not re.match(r"^([a-z][a-z0-9+.-]*:|/|#)", target, re.IGNORECASE)


def _rewrite_links(text: str, fn) -> str:
    """Apply ``fn(target) -> target`` to every inline link outside fenced code and inline code."""
    out, fenced = [], False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
            out.append(line)
            continue
        if fenced:
            out.append(line)
            continue
        pieces = re.split(r"(`[^`]*`)", line)  # odd pieces are inline code
        for i in range(0, len(pieces), 2):
            pieces[i] = LINK.sub(lambda m: m["head"] + fn(m["target"]) + m["tail"], pieces[i])
        out.append("".join(pieces))
    return "".join(out)


def _section(text: str, heading: str, source: str) -> tuple[str, int]:
    """The body of the section ``heading`` (``"## Title"``) of ``text`` and the heading's level."""
    want_level = len(heading) - len(heading.lstrip("#"))
    want_title = heading[want_level:].strip()
    lines = text.splitlines(keepends=True)
    start, fenced, titles = None, False, []
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else HEADING.match(line.rstrip("\n"))
        if m is None:
            continue
        level, title = len(m[1]), m[2].strip()
        if start is not None and level <= want_level:
            return "".join(lines[start:i]).strip("\n") + "\n", want_level
        if start is None and level == want_level:
            titles.append(title)
            if title == want_title:
                start = i + 1
    if start is None:
        raise ValueError(f"include: {source} has no section {heading!r}; its level-{want_level} sections are "
                         f"{titles}")
    return "".join(lines[start:]).strip("\n") + "\n", want_level


def _shift_headings(text: str, shift: int) -> str:
    out, fenced = [], False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else HEADING.match(line.rstrip("\n"))
        if m is not None and shift:
            level = min(6, max(1, len(m[1]) + shift))
            line = "#" * level + " " + m[2] + ("\n" if line.endswith("\n") else "")
        out.append(line)
    return "".join(out)


def _include(match: re.Match, page_uri: str, docs_dir: Path) -> str:
    source = match["path"]
    source_uri = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), source))
    path = docs_dir / source_uri
    if source_uri.startswith("../") or not path.is_file():
        raise ValueError(f"include in {page_uri}: no page {source!r} under docs/ (resolved to {source_uri!r})")
    body, level = _section(path.read_text(encoding="utf-8"), match["heading"].strip(), source_uri)
    page_dir = posixpath.dirname(page_uri)

    def rebase(target: str) -> str:
        if target.startswith("#"):
            return posixpath.relpath(source_uri, page_dir or ".") + target
        if not _is_relative(target):
            return target
        path_part, anchor = _split_target(target)
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source_uri), path_part))
        return posixpath.relpath(resolved, page_dir or ".") + anchor

    body = _rewrite_links(body, rebase)
    return _shift_headings(body, int(match["level"] or 2) - level)


def _include_source(match: re.Match, page_uri: str, docs_dir: Path, root: Path) -> str:
    source = match["path"]
    path = (docs_dir / posixpath.dirname(page_uri) / source).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise ValueError(f"include-source in {page_uri}: no file {source!r} in the repository (resolved to {path})")
    text = path.read_text(encoding="utf-8").rstrip("\n")
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    language = SOURCE_LANGUAGES.get(path.suffix, "")
    return f"{fence}{language} title=\"{path.relative_to(root).as_posix()}\"\n{text}\n{fence}"


def on_page_markdown(markdown, page, config, files):
    """Expand the include lines, then point links that leave docs/ for a results/ figure at the site's copy."""
    page_uri = page.file.src_uri
    docs_dir = Path(config["docs_dir"])
    markdown = INCLUDE.sub(lambda m: _include(m, page_uri, docs_dir), markdown)
    markdown = INCLUDE_SOURCE.sub(lambda m: _include_source(m, page_uri, docs_dir, _repo_root(config)), markdown)
    page_dir = posixpath.dirname(page_uri)

    def to_site(target: str) -> str:
        if not _is_relative(target):
            return target
        path_part, anchor = _split_target(target)
        resolved = posixpath.normpath(posixpath.join(page_dir, path_part))
        if not resolved.startswith("../"):
            return target
        repo_rel = resolved[3:]
        if repo_rel in _figures:
            return posixpath.relpath(_figures[repo_rel], page_dir or ".") + anchor
        return target  # left for MkDocs to report under --strict

    return _rewrite_links(markdown, to_site)
