"""Sphinx configuration: the API reference comes from the docstrings (autodoc + napoleon, for
their Google-style sections), the pages are Markdown (MyST). Build: ``make docs``.

Why Sphinx rather than mkdocs + mkdocstrings: autodoc imports the package and documents the
objects as they are at run time. Several public functions get their docstring after
definition (``detsum.index_add``'s is assigned beside the custom op it wraps), which a
static reader of the source would not see."""

project = "detsum"
author = "the detsum developers"
copyright = "2026, the detsum developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
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
html_title = "detsum"
