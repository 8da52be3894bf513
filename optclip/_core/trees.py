"""Pytree plumbing shared by the families: per-leaf results unzipped into trees, per-leaf state
flattened alongside the updates and rebuilt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optclip._core import norms


def tree_unzip(fn: Callable[..., tuple], tree: Any, *others: Any, n: int) -> tuple:
    """Map ``fn(leaf, *matching entries of others)`` (-> n-tuple) over ``tree`` and return
    ``n`` trees of ``tree``'s structure (``None`` where ``fn`` gives ``None``). ``None`` leaves
    of ``tree`` reach ``fn`` too; ``others`` as in :func:`flatten_with` (per-leaf state with
    ``None`` at some leaves)."""
    leaves, entries, treedef = flatten_with(tree, *others)
    results = [fn(*args) for args in zip(leaves, *entries)]
    return tuple(treedef.unflatten([r[i] for r in results]) for i in range(n))


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


def scalars_like(tree: Any, value: Any, dtype=None) -> Any:
    """A 0-d array of ``value`` per floating leaf of ``tree`` (in ``dtype``, or the leaf's
    statistics dtype), ``None`` for the other leaves: per-leaf scalar state."""
    return jax.tree.map(
        lambda x: jnp.full((), value, dtype or norms.acc_dtype(x.dtype))
        if norms.is_float(x) else None, tree)
