"""Per-leaf values handed out from vectors: entry ``j`` of each vector as its own 0-d array,
for a fixed number of kernels per group of leaves.

Decisions that concern every leaf (clipping factors, committed statistics) are cheapest taken
once, on vectors with one entry per leaf. Each leaf then needs its entries as separate 0-d
arrays (per-leaf state fields, the factor its update is scaled by). Read one by one, each
entry costs a kernel of its own on XLA:CPU, and a kernel reading entry ``j`` is distinct for
every ``j`` (compiled once per leaf); XLA:CPU also orders its kernels by comparing every pair
of them, so kernels per leaf cost compile time that grows with the square of the leaf count.
Here one variadic ``lax.reduce`` hands out :data:`GROUP` entries of a vector: each entry is
reduced together with a filler and a marker saying which of the two it is, by a select, so
every value comes back bit for bit (signed zeros, NaN payloads, subnormals).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Entries of one vector that one variadic reduce hands out.
GROUP = 32


def by_dtype(dtypes: dict[int, Any]) -> dict[Any, list[int]]:
    """Leaf indices grouped by the dtype of their per-leaf values (``{index: dtype}``), in
    order: one vector per group carries the leaves' decisions."""
    groups: dict[Any, list[int]] = {}
    for i, dtype in dtypes.items():
        groups.setdefault(jnp.dtype(dtype), []).append(i)
    return groups


def rows(vectors: tuple[jax.Array, ...] | list[jax.Array]) -> list[tuple[jax.Array, ...]]:
    """Per entry ``j``, entry ``j`` of every vector (all of one length), each a 0-d array of
    its vector's dtype, bit for bit. Derivatives flow through the float entries."""
    vectors = tuple(jnp.asarray(v) for v in vectors)
    if not vectors or vectors[0].shape[0] == 0:
        return []
    floats = [jnp.issubdtype(v.dtype, jnp.floating) for v in vectors]
    kept = [v if f else jax.lax.stop_gradient(v) for v, f in zip(vectors, floats)]
    flat = _handed_out(*kept)
    width = len(vectors)
    return [tuple(flat[j * width:(j + 1) * width]) for j in range(vectors[0].shape[0])]


def _pick(a: tuple, b: tuple) -> tuple:
    """Combiner of the variadic reduce: the side whose marker (last entry) is set, by select
    (no arithmetic: no value changes, in whatever order XLA combines)."""
    return (*(jax.lax.select(a[-1], u, v) for u, v in zip(a[:-1], b[:-1])),
            jax.lax.bitwise_or(a[-1], b[-1]))


def _hand_out(*vectors: jax.Array) -> tuple[jax.Array, ...]:
    """Entry ``j`` of every vector, for every ``j`` in order."""
    # Each entry next to a filler; one marker operand says which of the two is the entry.
    # One reduce per vector and group: a kernel's compile time grows faster than its operand
    # count (five vectors handed out together compiled 2.5x slower than one by one).
    marker = jnp.array([True, False])
    count = vectors[0].shape[0]
    columns = []
    for v in vectors:
        padded = jnp.stack([v, jnp.zeros_like(v)], axis=1)
        entries: list[jax.Array] = []
        for start in range(0, count, GROUP):
            operands = (*(jax.lax.index_in_dim(padded, j, keepdims=False)
                          for j in range(start, min(count, start + GROUP))), marker)
            init = (*(np.zeros((), v.dtype) for _ in operands[:-1]), np.bool_(False))
            entries += jax.lax.reduce(operands, init, _pick, (0,))[:-1]
        columns.append(entries)
    return tuple(column[j] for j in range(count) for column in columns)


def _sliced(*vectors: jax.Array) -> tuple[jax.Array, ...]:
    """What :func:`_hand_out` returns, by plain indexing (linear and transposable)."""
    return tuple(v[j] for j in range(vectors[0].shape[0]) for v in vectors)


def _jvp(primals, tangents):
    # jax differentiates no variadic reduce: tangents go through plain indexing (traced only
    # where something differentiates); integer and bool entries have float0 tangents.
    def tangent(v, t, j):
        if jnp.issubdtype(v.dtype, jnp.floating):
            return t[j]
        return np.zeros((), jax.dtypes.float0)

    count = primals[0].shape[0]
    return _hand_out(*primals), tuple(tangent(v, t, j) for j in range(count)
                                      for v, t in zip(primals, tangents))


_handed_out = jax.custom_jvp(_hand_out)
_handed_out.defjvp(_jvp)
