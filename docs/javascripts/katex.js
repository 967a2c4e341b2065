// Renders the math of every page with KaTeX, shipped with the site (docs/assets/katex): no request leaves it.
// pymdownx.arithmatex (generic mode) wraps each formula in an element of class "arithmatex", inline as
// \( ... \) and displayed as \[ ... \]; only those elements are rendered, so a "$" in code stays as it is.
// Material's instant navigation replaces the page body without a reload: document$ fires for every page.
function renderMath(root) {
  root.querySelectorAll(".arithmatex").forEach((element) => {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  });
}

if (typeof document$ !== "undefined") {
  document$.subscribe(({ body }) => renderMath(body));
} else {
  document.addEventListener("DOMContentLoaded", () => renderMath(document.body));
}
