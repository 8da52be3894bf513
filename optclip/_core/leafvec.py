"""Per-leaf state as one vector per field: entry ``j`` belongs to the ``j``-th floating leaf.

A value kept for every leaf (a norm, a running statistic, a clipping flag) is stored as one
array of shape ``(F,)``, ``F`` the number of floating leaves of the tree ``init`` saw, in the
order of ``jax.tree.leaves``. Kept as a tree of 0-d arrays instead, each value is one more
output of the compiled step per leaf, and XLA:CPU's buffer assignment compares every output
with those before it: compile time then grows with the square of the leaf count (a transform
keeping 4 values per leaf compiled in about 4x adam's time at 2000 leaves, and in about 2.3x
with the same values as 4 vectors). :func:`per_leaf` gives such a vector back as a tree.

Numbers are stored in the tree's statistics dtype (:func:`optclip._core.norms.stat_dtype`:
float64 when a leaf is float64); each leaf's entries are computed in its own statistics dtype
(:func:`groups`, :func:`take`, :func:`assemble`), so a float32 leaf next to a float64 one gets
float32 arithmetic, stored exactly in float64.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optclip._core import handout, norms


def is_leaf_value(x: Any) -> bool:
    """Whether a leaf of a user's tree has an entry in per-leaf vectors (floating arrays and
    Python floats, which every transform reads as 0-d arrays)."""
    return norms.is_float(x) or isinstance(x, float)


def size(tree: Any) -> int:
    """``F``: the number of floating leaves of ``tree``."""
    return sum(1 for x in jax.tree.leaves(tree) if is_leaf_value(x))


def full(tree: Any, value: Any, dtype: Any = None) -> jax.Array:
    """A fresh per-leaf vector of ``value`` for ``tree``, in ``dtype`` (default: the tree's
    statistics dtype)."""
    return jnp.full((size(tree),), value, dtype or norms.stat_dtype(tree))


def stack(values: list[jax.Array], like: jax.Array) -> jax.Array:
    """Per-leaf 0-d values (one per floating leaf, in order) as one vector of ``like``'s dtype
    (upcast exactly where a leaf's statistics are narrower), written once
    (:func:`optclip._core.norms.gather_scalars`)."""
    if not values:
        return jnp.zeros((0,), like.dtype)
    return norms.gather_scalars([jnp.asarray(v).astype(like.dtype) for v in values])


class Group(NamedTuple):
    """Floating leaves of one statistics dtype: their indices among the tree's leaves, their
    positions in a per-leaf vector, and the dtype."""
    leaves: list[int]
    positions: np.ndarray
    dtype: Any
    whole: bool   # the group is every floating leaf, in order


def groups(leaves: list[Any]) -> list[Group]:
    """The floating leaves of a flattened tree by statistics dtype (one group in the usual case
    of a single dtype)."""
    floats = [i for i, x in enumerate(leaves) if norms.is_float(x)]
    position = {i: n for n, i in enumerate(floats)}
    by_dtype = handout.by_dtype({i: norms.acc_dtype(leaves[i].dtype) for i in floats})
    single = len(by_dtype) == 1
    return [Group(idx, np.array([position[i] for i in idx], np.int32), dtype, single)
            for dtype, idx in by_dtype.items()]


def take(vector: jax.Array, group: Group) -> jax.Array:
    """The group's entries of ``vector``, in the group's dtype (numbers) or as they are."""
    part = vector if group.whole else vector[group.positions]
    if jnp.issubdtype(part.dtype, jnp.floating):
        return part.astype(group.dtype)
    return part


def assemble(parts: list[jax.Array], group_list: list[Group], like: jax.Array) -> jax.Array:
    """One per-leaf vector (of ``like``'s shape and dtype) from each group's entries."""
    if len(group_list) == 1 and group_list[0].whole:
        return parts[0].astype(like.dtype)
    out = like
    for part, group in zip(parts, group_list):
        out = out.at[group.positions].set(part.astype(like.dtype), unique_indices=True)
    return out


def from_scalars(values: dict[int, Any], leaves: list[Any], like: jax.Array,
                 finish: Any = None) -> jax.Array:
    """One per-leaf vector (of ``like``'s shape and dtype) from 0-d values computed leaf by
    leaf (``{index in leaves: value}``, every floating leaf of ``leaves``): gathered by
    statistics dtype (:func:`optclip._core.norms.gather_scalars`), then :func:`assemble`.

    ``finish`` (elementwise) is applied to each group's vector, or with tuples of values to
    one vector per entry of the tuples: the values can then be the leaves' raw reductions,
    which XLA gathers with no kernel per leaf, and what each leaf's entry is made of them is
    computed once, on the vectors.
    """
    group_list = groups(leaves)
    finish = finish or (lambda v: v)

    def gathered(group: Group) -> jax.Array:
        entries = [values[i] for i in group.leaves]
        if isinstance(entries[0], tuple):
            return finish(*(norms.gather_scalars(list(c)) for c in zip(*entries)))
        return finish(norms.gather_scalars(entries))

    return assemble([gathered(group) for group in group_list], group_list, like)


def per_leaf(values: Any, like: Any) -> Any:
    """A per-leaf vector of an optclip state as a tree mirroring ``like``.

    optclip keeps every value it holds for each leaf (a norm, a running statistic, whether the
    leaf was clipped) as one array of shape ``(F,)``: entry ``j`` belongs to the ``j``-th
    floating leaf of ``jax.tree.leaves(params)``. This returns the tree of ``like`` (the
    parameters, or any tree of the same structure) with entry ``j`` at that leaf and ``None``
    at integer and boolean leaves. Works eagerly and under ``jax.jit``.

    Args:
      values: the per-leaf field of a state (``F`` entries; more axes are allowed, e.g. a
        per-leaf history of shape ``(F, length)`` gives each leaf its row).
      like: a tree with the structure of the parameters the transform was initialised on.

    Raises:
      ValueError: ``values`` does not hold one entry per floating leaf of ``like``.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> params = {"b": jnp.zeros(2), "w": jnp.zeros((2, 2))}
      >>> tx = optclip.adagc(warmup_steps=1)
      >>> _, state = tx.update({"b": jnp.ones(2), "w": jnp.ones((2, 2))}, tx.init(params))
      >>> norms = optclip.per_leaf(state.norm, params)
      >>> float(norms["b"]), float(norms["w"])
      (1.4142135381698608, 2.0)
    """
    leaves, treedef = jax.tree.flatten(like)
    floats = [i for i, x in enumerate(leaves) if is_leaf_value(x)]
    shape = jnp.shape(values)
    if not shape or shape[0] != len(floats):
        raise ValueError(
            f"per_leaf: values of shape {tuple(shape)} do not hold one entry per floating leaf "
            f"of the tree given ({len(floats)} floating leaves); pass a per-leaf field of a "
            f"state built for this tree")
    out: list[Any] = [None] * len(leaves)
    for j, i in enumerate(floats):
        out[i] = values[j]
    return treedef.unflatten(out)
