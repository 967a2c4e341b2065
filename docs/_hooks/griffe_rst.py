"""Griffe extension of the hardeq site: hardeq's docstrings are written in reStructuredText (Sphinx roles and
directives, doctests); mkdocstrings renders docstrings as Markdown. This rewrites, in each docstring's text:

* ``:math:`x``` -> ``$x$`` and ``.. math::`` blocks -> ``$$ ... $$`` (typeset by ``pymdownx.arithmatex``);
* ``:class:`~a.B``` / ``:func:`` / ``:meth:`` / ``:attr:`` / ``:mod:`` / ``:data:`` / ``:exc:`` / ``:obj:``
  -> inline code (a leading ``~`` keeps the last component, as Sphinx does);
* ``Example:`` -> ``Examples:``, the section the Google-style parser renders as doctests (it reads ``Example:``
  as a plain admonition, where ``>>>`` lines become nested block quotes);
* ``.. code-block:: LANG`` blocks, and doctest blocks (``>>>`` lines and their output) outside an example
  section -> fenced code blocks;
* a paragraph ending in ``::`` (an RST literal block follows) -> ``:``;
* an ``Args:`` entry that documents several parameters at once (``lo, hi (float): the box``) -> one entry per
  parameter with the same text, the form the Google-style parser reads (it would otherwise report a parameter
  ``'lo, hi'`` missing from the signature).

Named in mkdocs.yml under the Python handler's ``extensions``; the source files are left as they are.
"""

from __future__ import annotations

import ast
import re

from griffe import Extension, logger

#: characters a docstring has only by accident: a backslash escape (``\\top`` -> TAB + "op") in a docstring that
#: is not a raw string
CONTROL = re.compile(r"[\t\b\f\v\a]")

ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
MATH_ROLE = re.compile(r":math:`([^`]+)`")
ARGS_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters):\s*$")
GROUPED_ITEM = re.compile(r"^(\s*)(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)+)(\s*\([^)]*\))?:(\s.*)?$")
EXAMPLES = re.compile(r"^\s*Examples?:\s*$")
DIRECTIVE = re.compile(r"^(\s*)\.\. (math|code-block)::\s*(\S*)\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _role(m: re.Match) -> str:
    target = m[3].strip()
    if m[2]:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _block(lines: list[str], start: int, base: int) -> tuple[list[str], int]:
    """The lines indented deeper than ``base`` from ``start`` (blank lines inside kept), dedented; the end."""
    body, i = [], start
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
        body.append(lines[i])
        i += 1
    while body and not body[-1].strip():
        body.pop()
        i -= 1
    while body and not body[0].strip():
        body.pop(0)
    cut = min((_indent(b) for b in body if b.strip()), default=0)
    return [b[cut:] for b in body], i


def convert(text: str) -> str:
    """The Markdown form of one reStructuredText docstring (see the module docstring)."""
    # roles first, on the whole text: a role may wrap onto the next line
    text = MATH_ROLE.sub(lambda r: "$" + " ".join(r[1].split()) + "$", text)
    text = ROLE.sub(_role, text)
    lines = text.splitlines()
    out: list[str] = []
    i, fenced = 0, False
    in_examples, examples_indent = False, -1  # inside a Google-style Example(s): section, and its header's indent
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            out.append(line)
            i += 1
            continue
        if line.strip() and (EXAMPLES.match(line) or _indent(line) <= examples_indent):
            in_examples = bool(EXAMPLES.match(line))
            examples_indent = _indent(line) if in_examples else -1
            if in_examples:  # the parser reads "Examples:" as doctests, and "Example:" as a plain admonition
                out.append(line.replace("Example:", "Examples:") if "Examples:" not in line else line)
                i += 1
                continue
        m = DIRECTIVE.match(line)
        if m:
            pad = m[1]
            body, i = _block(lines, i + 1, len(pad))
            if m[2] == "math":
                out += ["", pad + "$$", *[pad + b for b in body], pad + "$$", ""]
            else:
                out += ["", pad + "```" + (m[3] or ""), *[pad + b if b else b for b in body], pad + "```", ""]
            continue
        if line.lstrip().startswith(">>>"):
            base = _indent(line)
            body = []
            while i < len(lines) and lines[i].strip() and _indent(lines[i]) >= base:
                body.append(lines[i][base:])
                i += 1
            if in_examples:  # the Google-style parser renders an Example(s): section's doctests itself
                out += [" " * base + b for b in body]
                continue
            pad = " " * base
            out += ["", pad + "```pycon", *[pad + b for b in body], pad + "```", ""]
            continue
        if line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
            line = line.rstrip()[:-1]
        out.append(line)
        i += 1
    return "\n".join(_split_grouped_args(out))


def _split_grouped_args(lines: list[str]) -> list[str]:
    """One entry per parameter for ``a, b (type): text`` items of ``Args:``-like sections."""
    out: list[str] = []
    i, section = 0, None  # section: the indentation of the current Args-like header, else None
    while i < len(lines):
        line = lines[i]
        head = ARGS_SECTION.match(line)
        if head:
            section = len(head[1])
            out.append(line)
            i += 1
            continue
        if section is not None and line.strip() and _indent(line) <= section:
            section = None
        item = GROUPED_ITEM.match(line) if section is not None else None
        if item is None or _indent(line) <= section:
            out.append(line)
            i += 1
            continue
        cont, i = [], i + 1
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) > _indent(line):
            cont.append(lines[i])
            i += 1
        for name in (n.strip() for n in item[2].split(",")):
            out += [f"{item[1]}{name}{item[3] or ''}:{item[4] or ''}", *cont]
    return out


class RstToMarkdown(Extension):
    """Rewrites every docstring of the loaded package (see the module docstring)."""

    def on_instance(self, *, node, obj, agent, **kwargs) -> None:  # noqa: ARG002 (griffe's hook signature)
        if obj.docstring is None:
            return
        raw = None  # the docstring before griffe's cleaning (which turns a TAB into spaces)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            raw = ast.get_docstring(node, clean=False)
        bad = CONTROL.search(raw or "")
        if bad:  # a warning, so `mkdocs build --strict` fails on it
            logger.warning(f"{obj.filepath}:{obj.docstring.lineno}: the docstring of {obj.path} contains "
                           f"{bad[0]!r}: a backslash escape in a docstring that is not a raw string (r\"\"\"...)")
        obj.docstring.value = convert(obj.docstring.value)
