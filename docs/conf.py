"""Sphinx configuration: the API reference comes from the docstrings (autodoc + napoleon, for
their Google-style sections), the pages are Markdown (MyST). Build: ``make docs``."""

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
