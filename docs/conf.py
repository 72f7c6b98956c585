"""Sphinx configuration: the API reference comes from the docstrings (autodoc + napoleon, for
their Google-style sections), the pages are Markdown (MyST). Build: ``make docs``.

Why Sphinx rather than mkdocs + mkdocstrings: autodoc imports the package and documents the
objects as they are at run time. Several public functions get their docstring after
definition (``detsum.index_add``'s is assigned beside the custom op it wraps), which a
static reader of the source would not see."""

import pathlib
import sys

# Local extensions: docs/_ext/mathtext_svg.py.
sys.path.insert(0, str(pathlib.Path(__file__).parent / "_ext"))

project = "detsum"
author = "the detsum developers"
copyright = "2026, the detsum developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    # Math drawn at build time as SVG, so the pages read offline (MathJax comes from a CDN,
    # imgmath needs LaTeX): see the extension's docstring.
    "mathtext_svg",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# The docstrings use Google style ("Args:", "Returns:", "Example:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"

# Links from the Markdown pages to the example scripts beside them are plain files.
myst_heading_anchors = 3
html_theme = "alabaster"
html_math_renderer = "mathtext_svg"
# custom.css: wider pages, and long code lines wrap instead of hiding behind a scrollbar.
html_static_path = ["_static"]
html_title = "detsum"
