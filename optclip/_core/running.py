"""Running-statistics machinery shared by the history-based clippers (drytorch's criteria and
``hist_clip``, ZClip, AutoClip): per-leaf scalar vectors, torch's clipping factor and lerp, the
``parity`` switch.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal

import jax
import jax.numpy as jnp

from optclip._core import checks, handout, norms
from optclip._core import stats as stats_lib

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


def per_leaf_tree(tree: Any, vector: jax.Array) -> Any:
    """Entry ``j`` of ``vector`` at the position of the ``j``-th float leaf of ``tree``, handed
    out by :func:`optclip._core.handout.rows` (``None`` at the other leaves)."""
    leaves, treedef = jax.tree.flatten(tree)
    rows = iter(handout.rows((vector,)))
    return treedef.unflatten([next(rows)[0] if norms.is_float(x) else None for x in leaves])


def scale_leaves(tree: Any, factors: jax.Array) -> Any:
    """Multiply the ``j``-th float leaf by ``factors[j]`` (or all by one scalar factor)."""
    if factors.ndim == 0:
        factor = norms.shared_scalar(factors)
        return jax.tree.map(lambda x: norms.scale(x, factor), tree)
    return jax.tree.map(norms.scale, tree, per_leaf_tree(tree, factors))


def leaf_norms(updates: Any, dtype, axis_name: norms.AxisName = None) -> jax.Array:
    """L2 norm of every float leaf of ``updates``, as one vector in ``dtype``."""
    return norms.leaf_l2_norms(norms.float_leaves(updates), axis_name, vector=True).astype(dtype)


def apply_scale(updates: Any, factor: jax.Array, old: dict[str, Any],
                **diagnostics: jax.Array) -> tuple[Any, dict[str, Any]]:
    """Scale ``updates`` by ``factor`` and commit the step's diagnostics.

    ``factor`` and every diagnostic hold one entry per float leaf (a vector, kept as one in the
    state: :mod:`optclip._core.leafvec`) or one scalar. Returns the scaled updates and, per
    diagnostic name, its new value: the step's entry where finite, else the ``old[name]``
    entry; ``clipped`` (``factor < 1``) is added. Only the factors are handed out to the
    leaves (:func:`scale_leaves`).
    """
    committed = {k: stats_lib.keep_finite(v, old[k]) for k, v in diagnostics.items()}
    committed["clipped"] = factor < 1
    return scale_leaves(updates, factor), committed


def lerp(start: jax.Array, end: jax.Array, weight: Any, value: jax.Array | None = None
         ) -> jax.Array:
    """``start + weight (end - start)`` as ``torch.lerp`` computes it.

    torch switches formulas at ``|weight| = 0.5`` (``end - (end - start) (1 - weight)`` above
    it); doing the same keeps results within an ulp of the references. A Python ``weight`` is
    formed in double and cast once, and picks its formula while tracing; ``value`` (optional,
    for a Python ``weight``) is that cast weight as an array computed elsewhere (passed through
    a barrier, so that XLA does not share its broadcast between reductions).
    """
    if isinstance(weight, numbers.Real):
        w = jnp.asarray(weight, start.dtype) if value is None else value
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
    # The empty slots sort last as the largest finite value, not inf: with no value yet
    # (filled = 0) the interpolation then forms no inf - inf (NaN for jax_debug_nans).
    ordered = jnp.sort(jnp.where(valid, history, jnp.finfo(history.dtype).max), axis=-1)
    rank = q * (jnp.maximum(filled, 1) - 1).astype(history.dtype)
    lo = jnp.floor(rank).astype(jnp.int32)
    hi = jnp.ceil(rank).astype(jnp.int32)
    a = jnp.take(ordered, lo, axis=-1)
    b = jnp.take(ordered, hi, axis=-1)
    return lerp(a, b, rank - lo.astype(history.dtype))
