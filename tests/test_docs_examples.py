"""The code blocks of the docs marked ``<!-- test: run -->`` run as written.

Blocks of one page share a namespace, in page order, so a later block can use the names an
earlier one defined.
"""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
MARKED = re.compile(r"<!-- test: run -->\s*\n```python\n(.*?)```", re.S)
PAGES = sorted(p.name for p in DOCS.glob("*.md") if MARKED.search(p.read_text()))


def test_some_pages_have_runnable_blocks():
    assert {"getting-started.md", "logging.md", "sharding.md"} <= set(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_marked_blocks_run(page):
    """Every marked block runs; a typo or a name optclip does not have is a failure."""
    namespace: dict = {"__name__": f"docs_{page}"}
    for i, block in enumerate(MARKED.findall((DOCS / page).read_text())):
        exec(compile(block, f"<docs/{page}, runnable block {i}>", "exec"), namespace)
