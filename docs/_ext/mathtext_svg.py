"""Math drawn at build time: every ``math`` role and directive becomes an SVG image made by
matplotlib's mathtext, embedded in the page, so the site shows its formulas offline.

Why not the usual renderers: ``sphinx.ext.mathjax`` loads MathJax from a CDN at reading time,
so a page opened offline shows raw TeX; ``sphinx.ext.imgmath`` needs a LaTeX installation and
dvipng or dvisvgm. matplotlib is already in the ``docs`` extra (for the figures), and mathtext
draws the TeX subset the docstrings use (``\\mathrm``, ``\\sum`` with limits, sub- and
superscripts) with the Computer Modern fonts it ships, glyphs written out as paths: no
download, no font on the reader's machine. An expression mathtext cannot parse fails the build
(a warning, an error under ``-W``) naming it, so a page never shows raw TeX silently.

The image's ``alt`` text is the TeX source, for screen readers and for copying.
"""

from __future__ import annotations

import base64
import html
import io
import re

from docutils import nodes
from sphinx.util import logging
from sphinx.util.math import get_node_equation_number

logger = logging.getLogger(__name__)

FONT_SIZE = 12  # points, about the body text of the alabaster theme


class MathtextError(ValueError):
    pass


def render_svg(latex: str) -> tuple[str, float]:
    """``latex`` (without dollar signs) as an SVG document, and the depth of its baseline below
    the image's bottom in points (to align inline math with the text)."""
    import matplotlib

    matplotlib.use("agg")
    from matplotlib import mathtext
    from matplotlib.font_manager import FontProperties

    buffer = io.BytesIO()
    with matplotlib.rc_context({"mathtext.fontset": "cm", "svg.fonttype": "path",
                                "svg.hashsalt": "detsum-docs"}):
        try:
            depth = mathtext.math_to_image(f"${latex}$", buffer,
                                           prop=FontProperties(size=FONT_SIZE), format="svg")
        except ValueError as error:
            raise MathtextError(str(error).strip().splitlines()[-1]) from None
    svg = buffer.getvalue().decode("utf-8")
    # The metadata block holds the drawing's date: without it, a rebuild gives the same page.
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, flags=re.S)
    return svg, float(depth or 0.0)


def _image(latex: str, css_class: str, *, inline: bool) -> str:
    svg, depth = render_svg(latex)
    source = "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")
    align = f' style="vertical-align: -{depth:.1f}pt"' if inline else ""
    text = html.escape(latex, quote=True)
    return f'<img class="{css_class}" src="{source}" alt="{text}" title="{text}"{align}/>'


def _warn(self, node, error: MathtextError):
    logger.warning("mathtext cannot draw %r: %s", node.astext(), error, location=node)
    self.body.append(f'<span class="math">{self.encode(node.astext())}</span>')


def visit_inline(self, node: nodes.math) -> None:
    try:
        self.body.append(_image(node.astext(), "math", inline=True))
    except MathtextError as error:
        _warn(self, node, error)
    raise nodes.SkipNode


def visit_block(self, node: nodes.math_block) -> None:
    self.body.append(self.starttag(node, "div", CLASS="math"))
    self.body.append("<p>")
    if node.get("number"):
        number = get_node_equation_number(self, node)
        self.body.append(f'<span class="eqno">({number})</span>')
    try:
        # One image per line of a multi-line block, each a display formula of its own.
        for line in (part.strip() for part in node.astext().split("\n\n")):
            if line:
                self.body.append(_image(line, "math display", inline=False))
    except MathtextError as error:
        _warn(self, node, error)
    self.body.append("</p>\n</div>")
    raise nodes.SkipNode


def setup(app):
    app.add_html_math_renderer("mathtext_svg", inline_renderers=(visit_inline, None),
                               block_renderers=(visit_block, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
