"""Running-statistics machinery shared by the history-based clippers (drytorch's criteria and
``hist_clip``, ZClip, AutoClip): per-leaf scalar vectors, torch's clipping factor and lerp, the
``parity`` switch.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal

import jax
import jax.numpy as jnp

from optclip._core import checks, norms

Parity = Literal["fixed", "reference"]


PARITY = ("fixed", "reference")


# torch.nn.utils.clip_grad_norm_ divides by ``norm + 1e-6``, and so does
# ZClip's own rule.
TORCH_EPS = 1e-6


def torch_clip_factor(max_norm: jax.Array, norm: jax.Array) -> jax.Array:
    """torch's ``clip_grad_norm_`` factor ``min(1, max_norm / (norm + 1e-6))``.

    Exactly 1 when ``norm + 1e-6 <= max_norm`` (so "no clipping" leaves values bit-identical);
    a norm equal to ``max_norm`` is still shrunk by ``max_norm / (max_norm + 1e-6)``.
    """
    # No threshold (inf) gives 1; the finite stand-in keeps the derivative finite (inf * 0).
    unbounded = jnp.isinf(max_norm)
    bound = jnp.where(unbounded, jnp.ones_like(max_norm), max_norm)
    return jnp.where(unbounded, 1, jnp.minimum(bound / (norm + TORCH_EPS), 1))


def check_parity(parity: Any) -> None:
    checks.one_of("parity", parity, PARITY)


def float_leaves(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if norms.is_float(x)]


def stack(scalars: list[jax.Array], dtype) -> jax.Array:
    """Per-leaf scalars as one vector (scalars only: leaves are never concatenated)."""
    if not scalars:
        return jnp.zeros((0,), dtype)
    return norms.gather_scalars([s.astype(dtype) for s in scalars])


def per_leaf_tree(tree: Any, vector: jax.Array) -> Any:
    """Entry ``j`` of ``vector`` at the position of the ``j``-th float leaf of ``tree``."""
    leaves, treedef = jax.tree.flatten(tree)
    out, j = [], 0
    vector = norms.computed_once(vector)
    for x in leaves:
        if norms.is_float(x):
            out.append(vector[j])
            j += 1
        else:
            out.append(None)
    return treedef.unflatten(out)


def scale_leaves(tree: Any, factors: jax.Array) -> Any:
    """Multiply the ``j``-th float leaf by ``factors[j]`` (or all by one scalar factor)."""
    leaves, treedef = jax.tree.flatten(tree)
    out, j = [], 0
    factors = norms.computed_once(factors)
    for x in leaves:
        if norms.is_float(x):
            out.append(norms.scale(x, factors if factors.ndim == 0 else factors[j]))
            j += 1
        else:
            out.append(x)
    return treedef.unflatten(out)


def stack_diag(tree: Any, per_leaf: bool, dtype) -> jax.Array:
    """The inverse of ``per_leaf_tree`` for a diagnostics tree (``None`` leaves dropped)."""
    if not per_leaf:
        return tree
    return stack(jax.tree.leaves(tree), dtype)


def lerp(start: jax.Array, end: jax.Array, weight: Any) -> jax.Array:
    """``start + weight (end - start)`` as ``torch.lerp`` computes it.

    torch switches formulas at ``|weight| = 0.5`` (``end - (end - start) (1 - weight)`` above
    it); doing the same keeps results within an ulp of the references. A Python ``weight`` is
    formed in double and cast once, and picks its formula while tracing.
    """
    if isinstance(weight, numbers.Real):
        w = jnp.asarray(weight, start.dtype)
        if abs(weight) < 0.5:
            return start + w * (end - start)
        return end - (end - start) * (1 - w)
    w = jnp.asarray(weight).astype(start.dtype)
    return jnp.where(jnp.abs(w) < 0.5, start + w * (end - start), end - (end - start) * (1 - w))


def saturate(var: jax.Array) -> jax.Array:
    """A variance beyond the dtype's range (norms ~1e20 in float32) kept at its largest value."""
    return jnp.minimum(var, jnp.finfo(var.dtype).max)


def history_quantile(history: jax.Array, filled: jax.Array, q: float) -> jax.Array:
    """``torch.quantile(valid slots, q)`` (linear) over the last axis; the ring order is moot."""
    size = history.shape[-1]
    valid = jnp.arange(size) < filled
    ordered = jnp.sort(jnp.where(valid, history, jnp.inf), axis=-1)
    rank = q * (jnp.maximum(filled, 1) - 1).astype(history.dtype)
    lo = jnp.floor(rank).astype(jnp.int32)
    hi = jnp.ceil(rank).astype(jnp.int32)
    a = jnp.take(ordered, lo, axis=-1)
    b = jnp.take(ordered, hi, axis=-1)
    return lerp(a, b, rank - lo.astype(history.dtype))
