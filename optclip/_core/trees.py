"""Pytree plumbing shared by the families: per-leaf state flattened alongside the updates and
rebuilt."""

from __future__ import annotations

from typing import Any

import jax


def flatten_with(tree: Any, *others: Any) -> tuple[list, list[list], Any]:
    """Leaves of ``tree`` (``None`` kept as a leaf) and the matching entries of ``others``.

    ``others`` are trees built from ``tree`` by a ``jax.tree.map`` that returns ``None`` for
    some leaves (e.g. per-leaf state with ``None`` for integer leaves); they are flattened up
    to ``tree``'s structure, so position ``i`` of every list belongs to the same leaf. Returns
    ``(leaves, [other_leaves, ...], treedef)``; ``treedef.unflatten`` rebuilds any of them.
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
    return leaves, [treedef.flatten_up_to(other) for other in others], treedef


def unflatten_at(treedef: Any, values: dict[int, Any]) -> Any:
    """The tree of ``treedef`` (from :func:`flatten_with`) with ``values[i]`` at leaf ``i`` and
    ``None`` at the leaves ``values`` leaves out (per-leaf state of the float leaves only)."""
    return treedef.unflatten([values.get(i) for i in range(treedef.num_leaves)])
