"""Norms ("metrics") per slice, per leaf and over a whole pytree, and the scaling rules.

Every ``ord`` of spec/torchzero.md §1.1 is supported: any number (``0`` counts non-zeros,
``±inf`` is the max/min absolute value, negative orders allowed) and the strings ``'l0'``-``'l4'``,
``'linf'``, ``'mad'`` (mean absolute value), ``'std'``/``'var'`` (ddof=1) and ``'sum'``.
``'sum'`` is used as ``|Σx|`` wherever it serves as a norm, so a scaling transform never flips a
sign (torchzero 0.4.4 scales by the signed sum: spec/torchzero.md §4 D7).

Accumulation happens in float32 (float64 for float64 leaves) whatever the leaf dtype, so bf16
pytrees with many leaves and float16 gradients of magnitude ~300 give the true norm; statistics
spanning leaves follow the same rule (:func:`stat_dtype`). Norms of finite values are finite and
right up to the dtype's range (float32 elements of 1e20), and differentiable at zero. Complex
leaves are rejected (:func:`acc_dtype`). Global norms are combined from per-leaf partial
reductions (scalars), never by concatenating leaves, so a sharded gradient is reduced where it
lives.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optclip._core import axes as axes_lib
from optclip._core import checks

Ord = int | float | str
STRING_ORDS = ("l0", "l1", "l2", "l3", "l4", "linf", "mad", "std", "var", "sum")
_NAMED_NUMBERS = {"l0": 0.0, "l1": 1.0, "l2": 2.0, "l3": 3.0, "l4": 4.0, "linf": math.inf}
# Below this a metric counts as zero: the slice is left as it is (spec/torchzero.md §1.3, D8).
TINY_NORM = 1e-12


def canonical_ord(ord: Ord) -> float | str:
    """Validate ``ord`` and map ``'l0'``-``'l4'``/``'linf'`` to numbers."""
    checks.static("ord", ord)
    if isinstance(ord, str):
        if ord not in STRING_ORDS:
            raise ValueError(
                f"ord must be a number or one of {', '.join(map(repr, STRING_ORDS))}; got {ord!r}"
            )
        return _NAMED_NUMBERS.get(ord, ord)
    if isinstance(ord, bool) or not isinstance(ord, (int, float, np.integer, np.floating)):
        raise TypeError(f"ord must be a number or a string, got {ord!r}")
    if math.isnan(float(ord)):
        raise ValueError("ord must not be NaN")
    return float(ord)


def is_float(x: Any) -> bool:
    """Whether a leaf takes part in clipping (integer and boolean leaves pass through)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def float_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    """``fn(leaf, *matching leaves of rest)`` on floating leaves; other leaves pass through."""
    return jax.tree.map(lambda x, *r: fn(x, *r) if is_float(x) else x, tree, *rest)


def acc_dtype(dtype) -> jnp.dtype:
    """The dtype norms and statistics of a leaf are accumulated in.

    Complex leaves are rejected here, where every transform first meets a leaf's dtype: a
    cast to a real dtype would drop the imaginary part silently.
    """
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"optclip transforms take real floating (or integer) leaves; got a complex leaf "
            f"({jnp.dtype(dtype)}). Split it into real and imaginary parts (e.g. a pytree of "
            f"x.real and x.imag) to clip it")
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def stat_dtype(tree: Any = None) -> jnp.dtype:
    """Dtype of statistics that span leaves or steps (global norms, histories, EMAs of norms).

    The one rule, as for a single leaf's :func:`acc_dtype`: float32, float64 when the tree has a
    float64 leaf (which needs x64). Without a tree (hyperparameters resolved on device):
    float64 whenever x64 is enabled, so a float64 leaf never sees a threshold rounded through
    float32.
    """
    if not jax.config.jax_enable_x64:
        return jnp.dtype(jnp.float32)
    if tree is None or any(acc_dtype(x.dtype) == jnp.float64 for x in _float_leaves(tree)):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def _wide(x: jax.Array) -> jax.Array:
    return x.astype(acc_dtype(x.dtype))


@jax.custom_jvp
def safe_sqrt(x: jax.Array) -> jax.Array:
    """``sqrt(x)`` whose derivative at ``x = 0`` is 0 instead of NaN.

    A norm of an all-zero slice (a frozen parameter) is then differentiable: ``jax.grad``
    through a clipper at a zero gradient is finite, as meta-learning needs. The forward pass is
    a plain ``sqrt`` (a custom derivative, no extra operations for XLA to compile).
    """
    return jnp.sqrt(x)


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = jnp.sqrt(x)
    positive = y > 0
    return y, jnp.where(positive, dx / (2 * jnp.where(positive, y, 1)), 0)


def safe_root(x: jax.Array, ord: float) -> jax.Array:
    """``x ** (1 / ord)`` with the derivative at ``x = 0`` taken as 0 (see :func:`safe_sqrt`)."""
    zero = x == 0
    return jnp.where(zero, jnp.zeros_like(x), jnp.where(zero, jnp.ones_like(x), x) ** (1.0 / ord))


def _power_norm(ord: float | str) -> bool:
    """``ord`` p-norms (other than 1, 2 and inf) whose ``Σ|x|^p`` can overflow on finite input."""
    return isinstance(ord, float) and ord > 0 and ord not in (1.0, 2.0, math.inf)


# Sums of squares are also accumulated scaled by 2**-k, in the same pass: no finite input of up
# to 2**40 elements can overflow the scaled sum (float32: (2**128 * 2**-86)**2 * 2**40 = 2**124),
# and where the plain sum overflowed, the scaled one holds the norm. Powers of two keep the
# scaling exact; elements so small that their scaled squares underflow are below the
# precision of a norm that overflowed the plain sum.
_SHIFT = {jnp.dtype(jnp.float32): 86, jnp.dtype(jnp.float64): 540}


def _root_of_squares(plain: jax.Array, scaled: jax.Array, shift: int) -> jax.Array:
    """``sqrt(plain)``, or ``sqrt(scaled) * 2**shift`` where ``plain`` overflowed."""
    up = jnp.asarray(2.0 ** shift, scaled.dtype)
    return jnp.where(jnp.isinf(plain), safe_sqrt(scaled) * up, safe_sqrt(plain))


def _down(x: jax.Array) -> jax.Array:
    return x * jnp.asarray(2.0 ** -_SHIFT[x.dtype], x.dtype)


def root_sum_squares(x: jax.Array, **reduce) -> jax.Array:
    """``sqrt(Σ x²)`` (``jnp.sum`` keywords), finite and right up to ``x``'s dtype range.

    Two sums of squares, plain and scaled; XLA:GPU fuses sibling reductions into one pass over
    ``x``, XLA:CPU reads ``x`` twice (measured: the norm of an 8M-element float32 tree took
    about 2x as long on CPU).
    """
    return _root_of_squares(jnp.sum(jnp.square(x), **reduce),
                            jnp.sum(jnp.square(_down(x)), **reduce), _SHIFT[x.dtype])


def overflow_safe(plain: Callable[[], jax.Array], rescaled: Callable[[], jax.Array]
                  ) -> jax.Array:
    """``plain()``, recomputed as ``rescaled()`` where it overflowed to ``inf``.

    Only when some result is infinite is the metric recomputed from the data scaled by its
    largest magnitude. The test is one scalar (``lax.cond``), so the common case costs no second
    pass over memory (under ``jax.vmap`` the cond becomes a select and both run). Used once per
    global norm, and per slice only for the rare p-norms (p not 1, 2, inf): per-leaf norms of
    order 2 and ``'std'`` use :func:`root_sum_squares` instead, since a cond per leaf makes XLA
    compile time grow several-fold on trees of many leaves. Non-finite input stays non-finite.
    """
    raw = plain()
    return jax.lax.cond(jnp.any(jnp.isinf(raw)),
                        lambda: jnp.where(jnp.isinf(raw), rescaled(), raw), lambda: raw)


def _safe_scale(m: jax.Array) -> jax.Array:
    return jnp.where((m > 0) & jnp.isfinite(m), m, jnp.ones_like(m))


def slice_norm(x: jax.Array, ord: float | str, axes: tuple[int, ...]) -> jax.Array:
    """Metric of every slice of ``x`` reduced over ``axes`` (keepdims), in the wide dtype.

    ``axes=()`` treats every element as a one-element slice (also for 0-d leaves). Finite
    input gives a finite norm up to the dtype's range (:func:`root_sum_squares` for order 2
    and ``'std'``, :func:`overflow_safe` for other p-norms), and the derivative at an all-zero
    slice is finite.
    """
    x = _wide(x)
    if not _power_norm(ord):
        return _plain_slice_norm(x, ord, axes)

    def rescaled():
        m = _safe_scale(jnp.max(jnp.abs(x), axis=axes, keepdims=True, initial=0))
        return m * _plain_slice_norm(x / m.astype(x.dtype), ord, axes)

    return overflow_safe(lambda: _plain_slice_norm(x, ord, axes), rescaled)


def _plain_slice_norm(x: jax.Array, ord: float | str, axes: tuple[int, ...]) -> jax.Array:
    k = math.prod(x.shape[a] for a in axes)
    reduce = dict(axis=axes, keepdims=True)
    if ord == "mad":
        return jnp.sum(jnp.abs(x), **reduce) / k
    if ord in ("std", "var"):
        mean = jnp.sum(x, **reduce) / k
        if k < 2:
            return jnp.full(mean.shape, jnp.nan, x.dtype)
        if ord == "std":
            return root_sum_squares(x - mean, **reduce) / math.sqrt(k - 1)
        return jnp.sum(jnp.square(x - mean), **reduce) / (k - 1)
    if ord == "sum":
        return jnp.abs(jnp.sum(x, **reduce))
    if ord == 2.0:
        return root_sum_squares(x, **reduce)
    if ord == 1.0:
        return jnp.sum(jnp.abs(x), **reduce)
    if ord == 0.0:
        return jnp.sum((x != 0).astype(x.dtype), **reduce)
    if ord == math.inf:
        return jnp.max(jnp.abs(x), initial=0.0, **reduce)
    if ord == -math.inf:
        return jnp.min(jnp.abs(x), initial=math.inf, **reduce)
    return safe_root(jnp.sum(jnp.abs(x) ** ord, **reduce), ord)


def sees_nonfinite(ord: float | str) -> bool:
    """Whether a NaN or Inf element always makes the metric non-finite.

    Not for ``0`` (counts non-zeros), negative orders (``|inf|**p = 0``) or ``-inf`` (the
    minimum): with those a transform must also check the updates themselves.
    """
    return not (ord == 0.0 or ord == -math.inf or (isinstance(ord, float) and ord < 0))


def metric_defined(ord: float | str, size: int) -> bool:
    """Whether a group of ``size`` elements has a metric worth scaling by.

    ``'std'``/``'var'`` (ddof=1) need two elements (torchzero returns NaN there:
    spec/torchzero.md §4 D9); an empty group has nothing to measure (``'mad'`` would be 0/0,
    negative orders infinite).
    """
    return size > 0 and not (ord in ("std", "var") and size < 2)


def leaf_norm(x: jax.Array, ord: float | str) -> jax.Array:
    """Metric of a whole leaf as a 0-d array in the wide dtype."""
    return slice_norm(x, ord, tuple(range(x.ndim))).reshape(())


# Same-shape leaves reduced by one variadic reduce, at most this many at a time (compile time
# on XLA:CPU was lowest for groups of 16-64 at 2000 leaves; larger groups got slower again).
_GROUP_SIZE = 32
# Only leaves up to this many elements are grouped: trees with thousands of leaves are mostly
# small leaves (compile time), while a variadic reduce over large leaves ran ~8% slower on CPU.
_GROUP_MAX_ELEMENTS = 1 << 16
_REDUCERS = {"sum": (jax.lax.add, 0.0), "max": (jax.lax.max, -math.inf),
             "min": (jax.lax.min, math.inf)}


def _may_group() -> bool:
    """Whether same-shape leaves may share a variadic reduce.

    Only where a single device is visible: leaves of one shape can carry different shardings,
    and a variadic reduce over them makes XLA reshard (all-to-all, all-gather) to one sharding.
    """
    return jax.device_count() == 1


def leaf_reductions(arrays: list[jax.Array], prepare: Callable[[jax.Array], jax.Array],
                    kind: str = "sum") -> list[jax.Array]:
    """``kind`` (``'sum'``, ``'max'``, ``'min'``) of ``prepare(x)`` over all axes, per array.

    One reduction per array; on a single device, small arrays of one shape and dtype share one
    variadic ``lax.reduce`` (the same per-array results, no data copied or concatenated), which
    cuts XLA compile time on trees of thousands of leaves by about 3x.
    """
    op, init = _REDUCERS[kind]
    prepared = [prepare(x) for x in arrays]
    if not _may_group():
        return [jax.lax.reduce(p, jnp.asarray(init, p.dtype), op, tuple(range(p.ndim)))
                for p in prepared]
    results: list[Any] = [None] * len(prepared)
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, p in enumerate(prepared):
        key = (p.shape, p.dtype) if p.size <= _GROUP_MAX_ELEMENTS else i
        groups[key].append(i)
    for members in groups.values():
        shape, dtype = prepared[members[0]].shape, prepared[members[0]].dtype
        for start in range(0, len(members), _GROUP_SIZE):
            chunk = members[start:start + _GROUP_SIZE]
            outs = jax.lax.reduce(
                tuple(prepared[i] for i in chunk), tuple(jnp.asarray(init, dtype) for _ in chunk),
                lambda a, b: tuple(op(u, v) for u, v in zip(a, b)), tuple(range(len(shape))))
            for i, out in zip(chunk, outs):
                results[i] = out
    return results


def _float_leaves(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if is_float(x)]


def gather_scalars(partials: list[jax.Array]) -> jax.Array:
    """Per-leaf scalars as one vector, for a reduction that XLA computes once.

    Why not ``jnp.stack``: XLA's simplifier rewrites a reduction over stacked scalars into a
    chain of ``n`` scalar operations, and its fusion pass then copies that cheap chain into
    every per-leaf computation that consumes the result (a global gate or clipping factor):
    ``n`` leaves cost ``O(n^2)`` instructions and compile time quadratic in the leaf count.
    Writing the scalars into a vector with one scatter, an operation XLA neither rewrites nor
    duplicates, keeps the combination a single reduction whose result each leaf reads.
    """
    values = jnp.stack([jnp.asarray(p) for p in partials])
    return jnp.zeros_like(values).at[jnp.arange(len(partials))].set(
        values, indices_are_sorted=True, unique_indices=True)


def _combine(partials: list[jax.Array], how: Callable, empty: float) -> jax.Array:
    if not partials:
        return jnp.asarray(empty, jnp.float32)
    return how(gather_scalars(partials))


def tree_sum(partials: list[jax.Array]) -> jax.Array:
    """Sum of per-leaf scalars, as one reduction (keeps compile time flat in the leaf count)."""
    return _combine(partials, jnp.sum, 0.0)


def global_norm(tree: Any, ord: float | str = 2.0) -> jax.Array:
    """Metric of all floating leaves of ``tree`` taken as one vector (spec/torchzero.md §1.1b).

    Computed from per-leaf partial reductions combined as scalars. Unlike torchzero 0.4.4,
    ``ord=0`` counts non-zeros instead of raising (§4 D6). Scale-safe: where the plain sum
    overflowed (one scalar test, :func:`overflow_safe`), it is recomputed from the leaves divided
    by the largest magnitude of the tree; the common case reads the leaves once.
    """
    leaves = _float_leaves(tree)
    if not (_power_norm(ord) or ord in (2.0, "std")):
        return _plain_global_norm(leaves, ord)

    def rescaled():
        peak = _combine(leaf_reductions(leaves, lambda x: jnp.abs(_wide(x)), "max"), jnp.max, 0.0)
        peak = _safe_scale(peak)
        return peak * _plain_global_norm(leaves, ord, peak)

    return overflow_safe(lambda: _plain_global_norm(leaves, ord), rescaled)


def _plain_global_norm(leaves: list[jax.Array], ord: float | str, peak=None) -> jax.Array:
    count = sum(x.size for x in leaves)

    def total(prepare, kind="sum"):
        if peak is None:
            return leaf_reductions(leaves, lambda x: prepare(_wide(x)), kind)
        return leaf_reductions(
            leaves, lambda x: prepare(_wide(x) / peak.astype(acc_dtype(x.dtype))), kind)

    if ord == math.inf:
        return _combine(total(jnp.abs, "max"), jnp.max, 0.0)
    if ord == -math.inf:
        return _combine(total(jnp.abs, "min"), jnp.min, math.inf)
    if ord in ("std", "var", "sum"):
        signed = tree_sum(total(lambda x: x))
        if ord == "sum":
            return jnp.abs(signed)
        mean = signed / max(count, 1)
        if count < 2:
            return jnp.full((), jnp.nan, signed.dtype)
        if ord == "std":
            return safe_sqrt(tree_sum(total(lambda x: jnp.square(x - mean))) / (count - 1))
        return tree_sum(total(lambda x: jnp.square(x - mean))) / (count - 1)
    if ord == "mad":
        return tree_sum(total(jnp.abs)) / max(count, 1)
    if ord == 2.0:
        return safe_sqrt(tree_sum(total(jnp.square)))
    if ord == 1.0:
        return tree_sum(total(jnp.abs))
    if ord == 0.0:
        return tree_sum(total(lambda x: (x != 0).astype(x.dtype)))
    return safe_root(tree_sum(total(lambda x: jnp.abs(x) ** ord)), ord)


# ---------------------------------------------------------------------------------------------
# Scaling rules. A multiplier is formed from the norm and multiplied in (one fused pass, and
# XLA can fuse it into the next transform; no select between two versions of every leaf).

def clip_multiplier(norm: jax.Array, max_norm: jax.Array) -> jax.Array:
    """``min(1, max_norm / norm)``, exactly 1 whenever ``norm <= max_norm`` (also for 0 or NaN)."""
    # The second where keeps the derivative finite at norm == 0 (the unselected branch).
    over = norm > max_norm
    return jnp.where(over, max_norm / jnp.where(over, norm, 1), jnp.ones_like(norm))


def normalize_multiplier(norm: jax.Array, target: jax.Array, eps=None) -> jax.Array:
    """``target / norm``; ``target / (norm + eps)`` in the eps mode.

    Without ``eps`` a slice whose metric is ``<= 1e-12`` (or NaN) is left unchanged, in the
    per-slice and the global path alike (torchzero 0.4.4 differs between them and returns NaN
    globally for a zero update: spec/torchzero.md §4 D5, D8, D17).
    """
    if eps is not None:
        return target / (norm + eps)
    return jnp.where(norm > TINY_NORM, target / jnp.where(norm > TINY_NORM, norm, 1), 1)


def scale(x: jax.Array, factor: jax.Array) -> jax.Array:
    """``x * factor`` computed in the wide dtype and cast back to ``x``'s dtype."""
    if not is_float(x):
        return x
    return (_wide(x) * factor.astype(acc_dtype(x.dtype))).astype(x.dtype)


def divide(x: jax.Array, divisor: jax.Array) -> jax.Array:
    """``x / divisor`` computed in the wide dtype and cast back to ``x``'s dtype.

    For references that divide by a precomputed divisor rather than multiply by its inverse
    (torchzero's EMA and growth clippers, spec/torchzero.md §5): the last bit can differ.
    """
    if not is_float(x):
        return x
    return (_wide(x) / divisor.astype(acc_dtype(x.dtype))).astype(x.dtype)


def scale_slices(
    tree: Any,
    ord: float | str,
    multiplier: Callable[[jax.Array], jax.Array],
    *,
    dim: axes_lib.Dim = None,
    inverse_dims: bool = False,
    min_size: int = 1,
    param_ndim=axes_lib._UNSET,
) -> tuple[Any, Any]:
    """Scale every slice by ``multiplier(norm)``; returns ``(scaled tree, norms tree)``.

    With ``dim='global'`` all leaves form one slice: one global norm (a scalar) and one factor.
    Otherwise norms come back per leaf in the wide dtype with the reduced axes squeezed out.
    Leaves that the axes rule leaves alone (no axes, or slices smaller than ``min_size``) are
    returned unchanged with a 0-d zero norm; non-float leaves pass through with a ``None`` norm.
    """
    if dim == axes_lib.GLOBAL:
        norm = global_norm(tree, ord)
        factor = multiplier(norm)
        return jax.tree.map(lambda x: scale(x, factor), tree), norm

    def one_leaf(x):
        if not is_float(x):
            return x, None
        axes = axes_lib.reduction_axes(x.ndim, dim, inverse_dims, param_ndim=param_ndim)
        if axes is None or axes_lib.slice_size(x.shape, axes) < min_size:
            return x, jnp.zeros((), acc_dtype(x.dtype))
        norm = slice_norm(x, ord, axes)
        return scale(x, multiplier(norm)), jnp.squeeze(norm, axis=axes)

    return tree_unzip(one_leaf, tree, 2)


def tree_unzip(fn: Callable[[Any], tuple], tree: Any, n: int) -> tuple[Any, ...]:
    """Map ``fn`` (leaf -> n-tuple) over ``tree`` and return ``n`` trees of the same structure."""
    leaves, treedef = jax.tree.flatten(tree)
    results = [fn(x) for x in leaves]
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
