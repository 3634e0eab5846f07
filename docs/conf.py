"""Sphinx configuration of the compile_cache docs site (MyST markdown, built in strict mode).

The site's source is the repository itself, so every link means the same on GitHub and here:
README.md is the home page, docs/*.md the guides, docs/reference/*.md the generated reference,
benchmarks/RESULTS.md the results. ``make docs`` (and ``make test``, before the suite) runs

    python -m sphinx -E -W --keep-going -n -q -c docs -b html . docs/_build/html

Every warning is an error, so a link to a page, a file or a heading anchor that does not exist
fails the build.
"""

from __future__ import annotations

from typing import Any

project = "compile_cache"
author = "the compile_cache authors"
copyright = "2026, the compile_cache authors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "README"
include_patterns = ["README.md", "docs/*.md", "docs/reference/*.md", "benchmarks/RESULTS.md"]
exclude_patterns = ["docs/_build", ".venv", "build"]

# Every heading down to ### gets an anchor, named as GitHub names it, so `page.md#anchor` links
# work on GitHub and here, and a missing one is a warning (an error under -W).
myst_heading_anchors = 3
# Flags stay as typed: no "--train" turned into an en dash, no curly quotes in commands.
smartquotes = False

html_theme = "alabaster"
html_title = "compile_cache"
html_theme_options = {
    "description": "torch.compile as a one-time cost",
    "fixed_sidebar": True,
    "page_width": "1260px",
    "sidebar_width": "220px",
    "code_font_size": "0.78em",
}
html_sidebars = {"**": ["about.html", "navigation.html", "searchbox.html"]}
html_static_path: list[str] = []
html_extra_path = ["_extra"]  # index.html: the site's root, sent on to README.html
html_show_sourcelink = False

# The navigation: README.md stays plain markdown on GitHub, so its table of contents is added
# here, when Sphinx reads it.
NAVIGATION = """

```{toctree}
:hidden:
:caption: Guides

docs/getting-started
docs/clusters
docs/object-storage
docs/serving
docs/precompile
docs/security
docs/troubleshooting
docs/how-it-works
```

```{toctree}
:hidden:
:caption: Reference

docs/reference/env
docs/reference/cli
benchmarks/RESULTS
```
"""


def _add_navigation(app: Any, docname: str, source: list[str]) -> None:
    if docname == root_doc:
        source[0] += NAVIGATION


def setup(app: Any) -> None:
    app.connect("source-read", _add_navigation)
