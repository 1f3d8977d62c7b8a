"""Sphinx configuration of prazo's documentation site (``make docs``).

Sphinx with MyST: the pages stay Markdown (as the README and ``docs/design.md``
were), autodoc reads the docstrings, ``sphinxarg`` reads the ``prazo`` command's
argparse parser, and ``docs/_ext/prazo_reference.py`` builds the settings and
reasons tables from the code at build time. Nothing is fetched: no intersphinx,
no link check.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "prazo"
author = "the prazo authors"
copyright = "prazo authors, MIT licence"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    # The docstrings say "Args:" and "Returns:" (Google style).
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
    "prazo_reference",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["colon_fence"]
# GitHub's slugs for every heading down to ####, so a page's links to a section keep working.
myst_heading_anchors = 4
# No typographic quotes or dashes: the pages name flags (--threads) and headers that a
# reader copies, and docutils' smartquotes would print "--" as an en dash, no flag at all.
smartquotes = False
html_theme = "furo"
# docs/_static/prazo.css: the reference tables' cells wrap their literals (see its comment).
html_static_path = ["_static"]
html_css_files = ["prazo.css"]
html_title = "prazo"
# The docstrings are written for readers of the source: members in source order, signatures from the code.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# A method without a docstring of its own gets none: not the base class's (httpx's, waitress's, ...).
autodoc_inherit_docstrings = False
# One warning is a failed build (make docs runs sphinx -W --keep-going). Not nitpicky: with no
# intersphinx (offline) every annotation naming the stdlib or a third-party class would warn.
nitpicky = False
