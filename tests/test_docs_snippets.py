"""Every fenced Python block of README.md and docs/**/*.md runs, as a reader would paste it.

The blocks of one page run in order, in one fresh interpreter and one namespace (a later block may use what an
earlier one defined), with the repository root as the working folder. A page is found and its blocks are read
at collection, so a new page or a new block is tested without any change here.

Rules, checked here too:

- every fence names its language: ```` ```python ```` blocks run; shell commands, output listings and formulas
  use another name (``bash``, ``text``) and do not; a bare ```` ``` ```` fails, since it could hide Python;
- a block that cannot run on every machine carries a marker on the line before its fence, with the reason:
  ``<!-- snippet: needs cuda -->`` (runs when ``torch.cuda.is_available()``, else is skipped with that
  reason) or ``<!-- snippet: needs download: REASON -->`` (downloads from the network, which the tests do not:
  always skipped with REASON); ``<!-- snippet: slow -->`` puts its page's run in the slow group
  (``pytest -m slow``). Skipped blocks are left out of the page's run, and their reasons are the skip reason of
  ``test_markers_are_known_and_stand_before_python_blocks``;
- a page whose block imports an optional dependency that is not installed (diffusers, pyro, torch_geometric,
  matplotlib, scipy) is skipped with the extra to install, as the other tests of those extras are.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = {"python", "py", "python3"}
#: seconds one page may run (a page that runs longer fails, never skips)
PAGE_TIMEOUT = 240
#: optional modules a page may import, and what installs them
OPTIONAL = {"diffusers": 'the diffusion extra (pip install -e ".[diffusion]")',
            "pyro": 'the pyro extra (pip install -e ".[pyro]")',
            "torch_geometric": 'the graphs extra (pip install -e ".[graphs]")',
            "matplotlib": "matplotlib (pip install matplotlib)",
            "scipy": 'SciPy (pip install -e ".[test]")'}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<what>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its page (relative to the repository root), the line of its opening fence (1-based),
    the language (the info string's first word, "" for none), its code (dedented) and its marker, if any."""

    page: str
    line: int
    language: str
    code: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/ (not the build hooks), sorted."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *docs]


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The fenced blocks of one page, in order. A fence may be indented (inside a list item); its body is
    dedented by the fence's indentation. An unclosed fence is an error (it would swallow the rest of the page)."""
    lines = path.read_text().splitlines()
    page = path.relative_to(root).as_posix()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        close = re.compile(r"^[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{page}:{i + 1}: the fence {fence} is never closed")
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k]) if k >= 0 else None
        language = re.split(r"[\s{]", info.lstrip("{."), maxsplit=1)[0].lower() if info else ""
        found.append(Block(page, i + 1, language, "\n".join(body) + "\n", marker.group("what") if marker else None))
        i = j + 1
    return found


def skip_reason(block: Block) -> str | None:
    """Why ``block`` does not run here (its marker), or ``None``."""
    what = block.marker
    if what is None or what == "slow":
        return None
    if what == "needs cuda":
        import torch

        return None if torch.cuda.is_available() else f"{block.where} needs a CUDA GPU (none here)"
    if what.startswith("needs download:") and what.split(":", 1)[1].strip():
        return f"{block.where} downloads: {what.split(':', 1)[1].strip()} (the tests use no network)"
    raise ValueError(f"{block.where}: unknown snippet marker {what!r}; use 'needs cuda', "
                     "'needs download: REASON' or 'slow'")


ALL = [b for p in pages() for b in blocks(p)]
PAGES = {}
for _b in ALL:
    if _b.language in PYTHON:
        PAGES.setdefault(_b.page, []).append(_b)


def _page_param(page: str) -> object:
    slow = any(b.marker == "slow" for b in PAGES[page])
    return pytest.param(page, id=page, marks=[pytest.mark.slow] if slow else [])


# The runner. Every page runs in a process of its own: a server interpreter imports torch, numpy and hardeq once
# (seconds on a busy machine) and forks one child per page, which starts from that state as a fresh interpreter
# would after those imports; without fork (not POSIX), one interpreter per page. Each block is compiled under
# its page's name with its own line numbers, so a traceback points at the page's line. Exit status of a page:
# 0 (ran), 1 (a block raised), 3 (an import failed: MISSING-MODULE names it), None (killed at the timeout).
RUN_PAGE = r"""
def run_page(blocks):
    import sys, traceback
    namespace = {"__name__": "__main__"}
    for b in blocks:
        print(f"--- {b['page']}:{b['line']}", flush=True)
        try:
            exec(compile("\n" * b["line"] + b["code"], b["page"], "exec"), namespace)
        except ModuleNotFoundError as exc:
            print(f"MISSING-MODULE {exc.name} at {b['page']}:{b['line']}", flush=True)
            traceback.print_exc()
            return 3
        except BaseException:
            print(f"FAILED {b['page']}:{b['line']}", flush=True)
            traceback.print_exc()
            return 1
    return 0
"""

RUNNER = RUN_PAGE + r"""
import json, sys
sys.exit(run_page(json.loads(sys.stdin.read())))
"""

SERVER = RUN_PAGE + r"""
import json, os, signal, sys, tempfile, time
import numpy, torch
import hardeq
reply = sys.stdout
for line in sys.stdin:
    request = json.loads(line)
    fd, log = tempfile.mkstemp(suffix=".log")
    pid = os.fork()
    if pid == 0:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
        try:
            status = run_page(request["blocks"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)
    os.close(fd)
    deadline, status = time.monotonic() + request["timeout"], None
    while True:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(code)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    with open(log) as f:
        output = f.read()
    os.unlink(log)
    reply.write(json.dumps({"status": status, "output": output}) + "\n")
    reply.flush()
"""


def _env() -> dict[str, str]:
    return dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


class PageRunner:
    """Runs a page's blocks in a process of its own; see :data:`SERVER`. ``run`` returns ``(status, output)``."""

    def __init__(self) -> None:
        self.server = None
        if hasattr(os, "fork"):
            self.server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())

    def run(self, blocks: list[Block], timeout: float) -> tuple[int | None, str]:
        payload = [{"page": b.page, "line": b.line, "code": b.code} for b in blocks]
        if self.server is None:
            try:
                proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(payload), text=True,
                                      capture_output=True, cwd=ROOT, env=_env(), timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                return None, str(exc.stdout or "")
            return proc.returncode, proc.stdout + proc.stderr
        self.server.stdin.write(json.dumps({"blocks": payload, "timeout": timeout}) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        assert line, f"the snippet server died (status {self.server.poll()})"
        answer = json.loads(line)
        return answer["status"], answer["output"]

    def close(self) -> None:
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait(timeout=60)


@pytest.fixture(scope="module")
def runner():
    r = PageRunner()
    yield r
    r.close()


@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES])
def test_python_blocks_of_the_page_run_in_order(page, runner):
    """The page's Python blocks (those not skipped by a marker) run in one process, in order, and none raises.
    Matplotlib draws off-screen; torch uses one thread (the machine is shared)."""
    run = [b for b in PAGES[page] if skip_reason(b) is None]
    if not run:
        pytest.skip(f"every Python block of {page} is skipped by its marker")
    status, output = runner.run(run, PAGE_TIMEOUT)
    if status is None:
        pytest.fail(f"{page}: its blocks ran past {PAGE_TIMEOUT} s (make the snippet smaller, or mark the page "
                    f"<!-- snippet: slow -->):\n{output[-3000:]}")
    if status == 3:
        top = re.search(r"MISSING-MODULE (\S+)", output).group(1).split(".")[0]
        if top in OPTIONAL:
            pytest.skip(f"{page} needs {OPTIONAL[top]}")
    assert status == 0, f"{page}: a block failed\n{output[-8000:]}"


def test_every_fence_names_its_language():
    bare = [b.where for b in ALL if not b.language]
    assert bare == [], ("fences without a language (use ```python for code that runs, ```bash for commands, "
                        f"```text for output and formulas): {bare}")


def test_markers_are_known_and_stand_before_python_blocks():
    """Every marker is one of the known ones and stands before a Python block; the blocks whose need is unmet
    here are reported as this test's skip reason (their pages' runs leave them out)."""
    unmet = []
    for b in ALL:
        if b.marker is not None:
            assert b.language in PYTHON, f"{b.where}: a snippet marker before a {b.language} block"
            reason = skip_reason(b)  # raises on an unknown marker
            if reason is not None:
                unmet.append(reason)
    if unmet:
        pytest.skip("; ".join(unmet))


#: pages a new reader meets first; their code must fit a 1280-pixel-wide window (Material's content column shows
#: about 88 characters of code there) without scrolling sideways
FIRST_PAGES = ("README.md", "docs/index.md", "docs/getting-started.md")


def test_code_of_the_first_pages_fits_88_columns():
    long = [f"{b.where}+{i}: {len(line)} characters" for b in ALL if b.page in FIRST_PAGES and b.language in PYTHON
            for i, line in enumerate(b.code.splitlines(), 1) if len(line) > 88]
    assert long == [], f"code lines wider than 88 columns (wrap the comment): {long}"


def test_the_block_reader_finds_indented_and_tilde_fences_and_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n- item\n\n    ```python\n    x = 1\n      y = 2\n    ```\n\n"
                    "<!-- snippet: needs cuda -->\n\n~~~~bash\n```\n~~~~\n\n```{.python title=\"a\"}\nz = 3\n```\n")
    found = blocks(page, tmp_path)
    assert [(b.line, b.language, b.code, b.marker) for b in found] == [
        (5, "python", "x = 1\n  y = 2\n", None), (12, "bash", "```\n", "needs cuda"), (16, "python", "z = 3\n", None)]
    (tmp_path / "open.md").write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks(tmp_path / "open.md", tmp_path)


def test_a_failing_block_fails_its_page_with_the_page_line(runner):
    """The runner is not a formality: a block that raises fails the run, the traceback names the page's line, and
    a page does not see what another page defined (nor a block after a failed one run)."""
    a = Block("docs/x.md", 7, "python", "a = 1\n", None)
    b = Block("docs/x.md", 12, "python", "b = a + 1\nraise RuntimeError(b)\n", None)
    c = Block("docs/x.md", 20, "python", "print('not reached')\n", None)
    status, output = runner.run([a, b, c], 60)
    assert status == 1 and "FAILED docs/x.md:12" in output and "not reached" not in output
    assert 'File "docs/x.md", line 14' in output and "RuntimeError: 2" in output
    status, output = runner.run([Block("docs/y.md", 3, "python", "print(a)\n", None)], 60)
    assert status == 1 and "NameError: name 'a' is not defined" in output
    status, output = runner.run([Block("docs/y.md", 3, "python", "import surely_not_a_module_xyz\n", None)], 60)
    assert status == 3 and "MISSING-MODULE surely_not_a_module_xyz" in output
    status, output = runner.run([Block("docs/z.md", 1, "python", "import time\ntime.sleep(30)\n", None)], 2)
    assert status is None  # killed at the timeout
