"""mkdocs hook: render the pages' TeX formulas to MathML when the site is built.

``pymdownx.arithmatex`` (generic mode) wraps every formula in ``<span class="arithmatex">\\(...\\)``
or ``<div class="arithmatex">\\[...\\]``; this hook replaces each with the MathML that
``latex2mathml`` produces, so the built pages show formulas without any JavaScript, font
download or network access (browsers render MathML natively). A formula that cannot be
converted fails the build. Notebook pages (mkdocs-jupyter) come with nbconvert's MathJax loader,
which points at no script at all here; the hook removes it.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_FORMULA = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*'
    r"(?:\\\((?P<inline>.*?)\\\)|\\\[(?P<block>.*?)\\\])\s*</(?P=tag)>",
    re.S,
)
_NBCONVERT_MATHJAX = re.compile(
    r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.S
)


def to_mathml(tex: str, display: str) -> str:
    # latex2mathml has no \! (negative thin space): drop it, it only tightens spacing.
    tex = tex.replace(r"\!", "")
    return convert(html.unescape(tex).strip(), display=display)


def render(page_html: str) -> str:
    def replace(match: re.Match) -> str:
        if match["inline"] is not None:
            return f'<span class="optclip-math">{to_mathml(match["inline"], "inline")}</span>'
        return f'<div class="optclip-math">{to_mathml(match["block"], "block")}</div>'

    return _FORMULA.sub(replace, page_html)


def on_page_content(html_text: str, page, config, files) -> str:
    rendered = render(_NBCONVERT_MATHJAX.sub("", html_text))
    if 'class="arithmatex"' in rendered:
        raise ValueError(f"{page.file.src_path}: a formula was left unrendered")
    return rendered
