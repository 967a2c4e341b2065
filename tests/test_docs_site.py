"""The documentation site (mkdocs.yml, docs/): `mkdocs build --strict` passes, the API reference covers every
public name, and the build hooks (section includes, results/ figures, reST docstrings) do what they say.

The build needs the `docs` extra (`pip install -e ".[docs]"`); without it these tests skip, and CI installs it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "_hooks"

#: public names that are modules (documented by their members) or metadata, not API entries
NOT_ENTRIES = {"baselines", "bounds", "diffusion", "estimators", "nn", "testing", "pairs", "__version__"}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _packages_with_all() -> dict[str, list[str]]:
    """Every package under src/hardeq that declares `__all__`, with it (read from the source: no import, so
    optional dependencies stay unloaded). A new subpackage is covered as soon as it exists."""
    found = {}
    for init in sorted((ROOT / "src" / "hardeq").rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(ROOT / "src").parts)
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                found[package] = list(ast.literal_eval(node.value))
    return found


def _documented() -> set[str]:
    """The last component of every `::: dotted.name` of docs/reference/*.md."""
    names = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        names |= {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M)}
    return names


def test_api_reference_documents_every_public_name():
    """Every name of every `__all__` under src/hardeq has a `::: ...` entry in docs/reference/*.md."""
    packages = _packages_with_all()
    assert {"hardeq", "hardeq.constraints", "hardeq.nn", "hardeq.diffusion", "hardeq.ops"} <= set(packages)
    documented = _documented()
    missing = {p: [n for n in names if n not in NOT_ENTRIES and n not in documented] for p, names in packages.items()}
    missing = {p: names for p, names in missing.items() if names}
    assert missing == {}, f"public names missing from docs/reference/*.md (add `::: package.name`): {missing}"


def test_every_docs_page_is_in_the_nav():
    """A page left out of mkdocs.yml's nav would only be an INFO line of the build; keep the nav complete."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")
             if "_hooks" not in p.parts}
    listed = set(re.findall(r"([\w/.-]+\.md)\s*$", nav, re.M))
    assert pages - listed == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav entries without a page: {sorted(listed - pages)}"


# ----------------------------------------------------------------------------------------------- the hooks

@pytest.fixture(scope="module")
def site_hooks():
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    return _load("hardeq_site_hooks_under_test", HOOKS / "hardeq_site.py")


@pytest.fixture(scope="module")
def rst():
    pytest.importorskip("griffe", reason="the docs extra is not installed")
    return _load("hardeq_griffe_rst_under_test", HOOKS / "griffe_rst.py")


PAGE = """# Title

## First

Intro [vae](vae.md#units) and [here](#second) and [web](https://example.org).

```
## not a heading (fenced)
```

### Sub

text

## Second

last
"""


def test_section_stops_at_a_heading_of_the_same_level_and_skips_fences(site_hooks):
    body, level = site_hooks._section(PAGE, "## First", "p.md")
    assert level == 2 and body.startswith("Intro") and "## not a heading" in body and "### Sub" in body
    assert "last" not in body
    assert site_hooks._section(PAGE, "## Second", "p.md")[0] == "last\n"
    with pytest.raises(ValueError, match=r"p.md has no section '## Nope'.*'First', 'Second'"):
        site_hooks._section(PAGE, "## Nope", "p.md")


def test_include_rebases_links_and_shifts_headings(site_hooks, tmp_path):
    (tmp_path / "api.md").write_text(PAGE)
    m = site_hooks.INCLUDE.search('x\n<!-- include: ../api.md "## First" level=3 -->\n')
    out = site_hooks._include(m, "guide/page.md", tmp_path)
    assert "[vae](../vae.md#units)" in out  # relative link rebased onto guide/
    assert "[here](../api.md#second)" in out  # own anchor points back at the source page
    assert "[web](https://example.org)" in out
    assert "#### Sub" in out and "## not a heading" in out  # shifted by one level, fenced line untouched
    missing = site_hooks.INCLUDE.search('<!-- include: ../gone.md "## First" -->')
    with pytest.raises(ValueError, match="no page '../gone.md'"):
        site_hooks._include(missing, "guide/page.md", tmp_path)


def test_links_leaving_docs_map_figures_and_leave_the_rest_for_strict(site_hooks):
    class Page:
        class file:
            src_uri = "mof.md"

    site_hooks._figures.clear()
    site_hooks._figures["results/mof_curves.png"] = "results/mof_curves.png"
    config = {"docs_dir": str(ROOT / "docs")}
    md = "![c](../results/mof_curves.png) [r](../README.md) [m](math.md) `[x](../results/mof_curves.png)`"
    out = site_hooks.on_page_markdown(md, Page, config, None)
    assert out == "![c](results/mof_curves.png) [r](../README.md) [m](math.md) `[x](../results/mof_curves.png)`"
    site_hooks._figures.clear()


def test_rst_docstrings_become_markdown(rst):
    text = """Normal :math:`\\mathcal N(\\mu,
\\Sigma)`, see :class:`~hardeq.LinearConstraint` and :func:`hardeq.ops.group_sum`.

.. math::
    z = \\hat z + K(k - A\\hat z).

.. code-block:: python

    x = 1

Args:
    lo, hi (float): the box
        continued.
    x: one.

Example:
    >>> 1 + 1
    2
"""
    out = rst.convert(text)
    assert "$\\mathcal N(\\mu, \\Sigma)$" in out
    assert "`LinearConstraint`" in out and "`hardeq.ops.group_sum`" in out and ":class:" not in out
    assert "$$\nz = \\hat z + K(k - A\\hat z).\n$$" in out
    assert "```python\nx = 1\n```" in out
    assert "    lo (float): the box\n        continued.\n    hi (float): the box\n        continued.\n" in out
    assert "Examples:\n    >>> 1 + 1\n    2" in out


def test_backslash_escape_in_a_docstring_fails_the_build(rst, caplog):
    """A non-raw docstring with ``\\top`` holds TAB + "op": the extension warns, so --strict fails."""
    import griffe

    source = 'def f():\n    """Transpose :math:`A^\\top u`."""\n\n\ndef g():\n    r"""Fine :math:`A^\\top u`."""\n'
    with caplog.at_level("WARNING"):
        module = griffe.visit("m", filepath=Path("m.py"), code=source,
                              extensions=griffe.load_extensions(rst.RstToMarkdown()))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "m.f contains '\\t'" in warnings[0], warnings
    assert module["g"].docstring.value == "Fine $A^\\top u$."


# ----------------------------------------------------------------------------------------------- the build

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once by `mkdocs build --strict` into a temporary folder: any warning (broken link or anchor,
    missing reference, a page outside the nav, a docstring griffe cannot parse) fails it."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed")
    site = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def test_mkdocs_build_strict(site):
    reference = (site / "reference" / "hardeq" / "index.html").read_text()
    assert "ConstrainedNormal" in reference and 'class="arithmatex"' in reference and ":math:" not in reference
    assert (site / "results" / "mof_curves.png").is_file()  # copied by the hook from results/
    guide = (site / "guide" / "constraints" / "index.html").read_text()
    assert "Adding a constraint" in guide  # the section included from docs/api.md
    assert "<!-- include:" not in guide


#: elements whose attribute makes the browser fetch something when the page is shown (an <a href> does not)
RESOURCE = re.compile(r"<(script|link|img|iframe|source|video|audio|embed|object|track|input)\b[^>]*?"
                      r"\s(src|href|data|srcset|poster)\s*=\s*[\"']([^\"']+)[\"']", re.I)
CSS_URL = re.compile(r"(?:url\(\s*[\"']?|@import\s+[\"'])([^\"')]+)", re.I)


def _external(url: str) -> bool:
    return bool(re.match(r"^(?:[a-z][a-z0-9+.-]*:)?//", url.strip(), re.I)) and not url.startswith("data:")


def test_the_site_requests_nothing_from_another_host(site):
    """Offline, or behind a firewall, every page shows its math: no script, stylesheet, font, image or frame of
    the built site comes from another host (an external <a href> is a link, not a request), and every local
    one exists. The math is KaTeX, shipped in docs/assets/katex."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 30
    external, missing = [], []
    for page in pages:
        text = page.read_text()
        for tag, attr, url in RESOURCE.findall(text):
            for one in (u.split()[0] for u in url.split(",")) if attr.lower() == "srcset" else (url,):
                if _external(one):
                    external.append(f"{page.relative_to(site)}: <{tag} {attr}={one}>")
                elif not one.startswith(("data:", "#")):
                    path = one.split("#")[0].split("?")[0]
                    target = site / path.lstrip("/") if path.startswith("/") else page.parent / path  # 404.html
                    if not target.exists():
                        missing.append(f"{page.relative_to(site)}: {one}")
    for css in sorted(site.rglob("*.css")):
        for url in CSS_URL.findall(css.read_text()):
            if _external(url):
                external.append(f"{css.relative_to(site)}: url({url})")
            elif not url.startswith(("data:", "#")) and not (css.parent / url.split("#")[0].split("?")[0]).exists():
                missing.append(f"{css.relative_to(site)}: url({url})")
    assert external == [], f"resources from other hosts: {external[:20]}"
    assert missing == [], f"local resources that the site lacks: {missing[:20]}"
    home = (site / "index.html").read_text()
    for path in ("assets/katex/katex.min.js", "assets/katex/contrib/auto-render.min.js", "javascripts/katex.js",
                 "assets/katex/katex.min.css"):
        assert path in home and (site / path).is_file(), path
    assert (site / "assets" / "katex" / "LICENSE").is_file()
    assert "fonts.googleapis.com" not in home and "fonts.gstatic.com" not in home


#: node script: render every formula of the built site (argv[2]) with the shipped KaTeX (argv[1]); print the
#: number of formulas and one line per formula KaTeX refuses
KATEX_CHECK = r"""
const katex = require(process.argv[1]);
const fs = require("fs"), path = require("path");
const walk = (d) => fs.readdirSync(d, {withFileTypes: true}).flatMap((e) => e.isDirectory()
  ? walk(path.join(d, e.name)) : e.name.endsWith(".html") ? [path.join(d, e.name)] : []);
const unescape = (s) => s.replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&quot;/g, '"')
  .replace(/&#39;/g, "'").replace(/&amp;/g, "&");
let n = 0;
for (const file of walk(process.argv[2])) {
  const html = fs.readFileSync(file, "utf8");
  const formula = /<(span|div) class="arithmatex">([\s\S]*?)<\/\1>/g;
  let m;
  while ((m = formula.exec(html))) {
    const tex = unescape(m[2]).trim();
    const display = tex.startsWith("\\[");
    n++;
    try {
      katex.renderToString(tex.slice(2, -2), {displayMode: display, throwOnError: true});
    } catch (e) {
      console.log("REFUSED " + path.relative(process.argv[2], file) + ": " + tex.slice(0, 120) + " -- "
                  + e.message.split("\n")[0]);
    }
  }
}
console.log("FORMULAS " + n);
"""


def test_katex_renders_every_formula_of_the_site(site):
    """Every formula of the built site renders with the shipped KaTeX (which supports most but not all of
    MathJax's TeX: an unsupported command would show as red source text). Needs node to run KaTeX here."""
    import shutil

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: KaTeX cannot be run outside a browser here")
    proc = subprocess.run([node, "-e", KATEX_CHECK, str(ROOT / "docs" / "assets" / "katex" / "katex.min.js"),
                           str(site)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    count = int(re.search(r"FORMULAS (\d+)", proc.stdout).group(1))
    assert count > 300 and refused == [], refused[:20]


def test_the_offline_scan_finds_external_resources(tmp_path):
    """The scan of the test above is not a formality: CDN scripts, stylesheets, fonts and protocol-relative URLs
    are found; links and local files are not."""
    html = ('<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>'
            '<link rel="stylesheet" href="//fonts.googleapis.com/css?family=Roboto">'
            '<a href="https://example.org">a link</a><script src="assets/katex/katex.min.js"></script>'
            '<img alt="x" src="figures/method.png">')
    found = [url for _, _, url in RESOURCE.findall(html) if _external(url)]
    assert found == ["https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js",
                     "//fonts.googleapis.com/css?family=Roboto"]
    css = ('@font-face{src:url(fonts/KaTeX_AMS-Regular.woff2)} @import "https://x.org/a.css"; '
           'b{background:url("data:,")}')
    assert [u for u in CSS_URL.findall(css) if _external(u)] == ["https://x.org/a.css"]


def test_the_landing_page_picture_is_made_by_its_script(tmp_path):
    """docs/figures/method.py still runs against the library (it checks that the repaired and the conditioned
    samples lie on the line) and draws the picture."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "method.png"
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "figures" / "method.py"), str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 20_000


def test_the_landing_page_has_an_install_line_code_and_the_picture(site):
    home = (ROOT / "docs" / "index.md").read_text()
    assert "pip install torch==2.13.0 -e ." in home and "```python\nimport torch\nimport hardeq\n" in home
    assert "![" in home and "(figures/method.png)" in home
    assert (ROOT / "docs" / "figures" / "method.py").is_file()
    assert (site / "figures" / "method.png").is_file()


def test_getting_started_example_is_the_readme_example():
    """docs/getting-started.md quotes README.md's usage example (which tests/test_readme.py runs) verbatim."""
    readme = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    guide = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "getting-started.md").read_text(), re.S)[0]
    assert guide == readme
