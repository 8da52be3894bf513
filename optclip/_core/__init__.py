"""Shared machinery of optclip: axes, mesh axes, norms, validation and diagnostics. No transform
lives here."""

from optclip._core import axes, checks, mesh, norms, stats

__all__ = ["axes", "checks", "mesh", "norms", "stats"]
