"""Helpers shared by test modules."""

from __future__ import annotations

from typing import Any

import jax


def nnx_pure(tree: Any) -> Any:
    """``tree`` (an ``nnx.State`` or optimizer state) with every flax ``Variable`` replaced by
    its array, on every supported flax (``nnx.as_pure`` is newer than the floor, 0.12.0)."""
    from flax import nnx

    variable_types = tuple(t for t in (getattr(nnx, "Variable", None),
                                       getattr(nnx, "VariableState", None)) if t is not None)
    return jax.tree.map(lambda x: x.value if isinstance(x, variable_types) else x, tree,
                        is_leaf=lambda x: isinstance(x, variable_types))
