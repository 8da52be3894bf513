"""Shared machinery of optclip: axes, norms, validation and diagnostics. No transform lives here."""

from optclip._core import axes, checks, norms, stats

__all__ = ["axes", "checks", "norms", "stats"]
