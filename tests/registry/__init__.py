"""The conformance registry: every public transform, one ``Entry`` each.

Each family adds a module here (``clipping.py``, ``ema.py``, ``growth.py``, ``history.py``,
``lp_space.py``) defining ``ENTRIES: list[Entry]``; they are collected automatically.
"""

import importlib
import pkgutil

from tests.registry.base import Entry

__all__ = ["ALL_ENTRIES", "Entry"]


def _collect() -> list[Entry]:
    entries: list[Entry] = []
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            entries.extend(importlib.import_module(f"{__name__}.{module.name}").ENTRIES)
    return entries


ALL_ENTRIES = _collect()
