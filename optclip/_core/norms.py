"""Norms ("metrics") per slice, per leaf and over a whole pytree, and the scaling rules.

Every ``ord`` of torchzero 0.4.4 is supported: any number (``0`` counts non-zeros,
``±inf`` is the max/min absolute value, negative orders allowed) and the strings ``'l0'``-``'l4'``,
``'linf'``, ``'mad'`` (mean absolute value), ``'std'``/``'var'`` (ddof=1) and ``'sum'``.
``'sum'`` is used as ``|Σx|`` wherever it serves as a norm, so a scaling transform never flips a
sign (torchzero 0.4.4 scales by the signed sum).

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
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optclip._core import branch, checks

# The mesh names stay importable from here, where the families read them.
from optclip._core.mesh import AxisName as AxisName
from optclip._core.mesh import across as across
from optclip._core.mesh import all_true as all_true
from optclip._core.mesh import any_true as any_true
from optclip._core.mesh import axes_size as axes_size
from optclip._core.mesh import check_axis_name as check_axis_name
from optclip._core.mesh import split_axes as split_axes

Ord = int | float | str
STRING_ORDS = ("l0", "l1", "l2", "l3", "l4", "linf", "mad", "std", "var", "sum")
_NAMED_NUMBERS = {"l0": 0.0, "l1": 1.0, "l2": 2.0, "l3": 3.0, "l4": 4.0, "linf": math.inf}
# Below this a metric counts as zero: the slice is left as it is.
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
    if tree is None or any(acc_dtype(x.dtype) == jnp.float64 for x in float_leaves(tree)):
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
SCALE_SHIFT = {jnp.dtype(jnp.float32): 86, jnp.dtype(jnp.float64): 540}
# Arrays up to this many elements get both sums from one variadic reduce: one kernel and one
# read of the data instead of two of each (XLA:CPU also splits each plain sum into two
# kernels). XLA:CPU runs a variadic reduce as one sequential loop, exact to rounding at this
# size but not for large arrays (measured on float32: relative error 1e-6 at 65536 elements,
# 6e-2 at 38M, where the plain sums stay near 1e-8), so larger arrays keep the two sums; so
# do arrays where several devices are visible (see _may_group).
PAIR_MAX_ELEMENTS = 1 << 12


def _add_pairs(a: tuple, b: tuple) -> tuple:
    """Combiner of a variadic sum (module level: jax caches its traced form)."""
    return tuple(jax.lax.add(u, v) for u, v in zip(a, b))


def _squares(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x²`` and ``(x 2**-k)²``, the two quantities a scale-safe sum of squares accumulates."""
    # Through a max: XLA's simplifier rewrites (x c) (x c) into (x x) (c c), where c² underflows
    # to 0 (NaN for a one-element array whose square overflowed).
    down = jnp.maximum(jnp.abs(x) * jnp.asarray(2.0 ** -SCALE_SHIFT[x.dtype], x.dtype), 0)
    return jax.lax.mul(x, x), jax.lax.mul(down, down)


def sums_paired(x: jax.Array) -> bool:
    """Whether ``x``'s plain and scaled sums of squares come from one variadic reduce."""
    return x.size <= PAIR_MAX_ELEMENTS and _may_group()


def _sum_squares(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Plain and scaled sums of squares of ``x`` over ``axes`` (reduced axes dropped)."""
    squares = _squares(x)
    zero = jnp.zeros((), x.dtype)
    if sums_paired(x):
        return tuple(jax.lax.reduce(squares, (zero, zero), _add_pairs, axes))
    return tuple(jax.lax.reduce(v, zero, jax.lax.add, axes) for v in squares)


def _add_compensated(a: tuple, b: tuple) -> tuple:
    """Combiner of :func:`compensated_squares`: ``(sum, error, scaled sum)`` triples added, the
    rounding error of adding the sums kept (Knuth's two-sum, exact in round-to-nearest)."""
    (high_a, low_a, scaled_a), (high_b, low_b, scaled_b) = a, b
    high = jax.lax.add(high_a, high_b)
    back = jax.lax.sub(high, high_a)
    error = jax.lax.add(jax.lax.sub(high_a, jax.lax.sub(high, back)), jax.lax.sub(high_b, back))
    return high, jax.lax.add(jax.lax.add(low_a, low_b), error), jax.lax.add(scaled_a, scaled_b)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def compensated_squares(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Plain and scaled sums of squares of ``x`` over ``axes`` (reduced axes dropped, as
    :func:`root_of_squares` takes them) from one variadic reduce that also carries the plain
    sum's rounding error: the plain sum is exact to about one rounding in whatever order XLA
    adds the elements (XLA:CPU adds a variadic reduce's elements in sequence, where a plain sum
    loses up to ``n`` roundings: about ``sqrt(n)`` on random data). The scaled sum, read only
    where the plain one overflowed, is not compensated: each carried sum costs XLA:CPU's loop
    about as much time as it saves in memory traffic. A plain sum that is not finite is
    returned as it is (the error of adding infinities is NaN).

    Differentiable (``jax.grad`` through a projection, for meta-learning): the derivative is
    that of the two plain sums, ``Σ 2 x dx`` and its scaled twin; the rounding error carried
    beside the plain sum is a constant to it (and jax has no derivative of a variadic reduce
    whose operand is a constant)."""
    plain, scaled = _squares(x)
    zero = jnp.zeros((), x.dtype)
    high, low, scaled = jax.lax.reduce((plain, jnp.zeros_like(plain), scaled),
                                       (zero, zero, zero), _add_compensated, axes)
    return jax.lax.select(jnp.isfinite(high), jax.lax.add(high, low), high), scaled


@compensated_squares.defjvp
def _compensated_squares_jvp(axes, primals, tangents):
    (x,), (dx,) = primals, tangents
    zero = jnp.zeros((), x.dtype)
    _, slopes = jax.jvp(lambda v: tuple(jax.lax.reduce(s, zero, jax.lax.add, axes)
                                        for s in _squares(v)), (x,), (dx,))
    return compensated_squares(x, axes), slopes


def root_of_squares(plain: jax.Array, scaled: jax.Array, shift: int) -> jax.Array:
    """``sqrt(plain)``, or ``sqrt(scaled) * 2**shift`` where ``plain`` overflowed.

    One root (whose derivative is finite at 0) for both cases, built from ``lax`` operations:
    per-leaf norms trace and compile fewer operations.
    """
    over = jax.lax.eq(plain, jnp.asarray(jnp.inf, plain.dtype))
    picked = jax.lax.select(over, scaled, plain)
    up = jax.lax.select(over, jax.lax.full_like(plain, 2.0 ** shift),
                        jax.lax.full_like(plain, 1))
    return jax.lax.mul(safe_sqrt(picked), up)


def root_sum_squares(x: jax.Array, total: Callable[[jax.Array], jax.Array] | None = None,
                     **reduce) -> jax.Array:
    """``sqrt(Σ x²)`` (over ``axis`` with ``keepdims`` as ``jnp.sum`` takes them, or with
    ``total`` as the sum), finite and right up to ``x``'s dtype range.

    Two sums of squares, plain and scaled (:data:`SCALE_SHIFT`); for arrays of up to
    ``PAIR_MAX_ELEMENTS`` elements both come from one variadic reduce.
    """
    if total is not None:
        return root_of_squares(*(total(v) for v in _squares(x)), SCALE_SHIFT[x.dtype])
    axis = reduce.pop("axis", None)
    keepdims = reduce.pop("keepdims", False)
    if reduce:
        raise TypeError(f"root_sum_squares takes axis and keepdims, got {sorted(reduce)}")
    axes = tuple(range(x.ndim)) if axis is None else tuple(
        a % x.ndim for a in (axis if isinstance(axis, tuple) else (axis,)))
    norm = root_of_squares(*_sum_squares(x, axes), SCALE_SHIFT[x.dtype])
    return jnp.expand_dims(norm, axes) if keepdims else norm


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


def slice_norm(x: jax.Array, ord: float | str, axes: tuple[int, ...],
               split: tuple[str, ...] = ()) -> jax.Array:
    """Metric of every slice of ``x`` reduced over ``axes`` (keepdims), in the wide dtype.

    ``axes=()`` treats every element as a one-element slice (also for 0-d leaves). ``split``
    names the mesh axes (inside ``shard_map``/``pmap``) over which the reduced axes of ``x`` are
    split: the partial reductions are combined across them (:func:`across`). Finite input gives
    a finite norm up to the dtype's range (:func:`root_sum_squares` for order 2 and ``'std'``,
    :func:`overflow_safe` for other p-norms), and the derivative at an all-zero slice is finite.
    """
    x = _wide(x)

    def total(v, kind="sum"):
        op, init = _REDUCERS[kind]
        local = jax.lax.reduce(v, jnp.asarray(init, v.dtype), op, axes)
        return across(jnp.expand_dims(local, axes), kind, split)

    if not _power_norm(ord):
        return _plain_slice_norm(x, ord, axes, split, total)

    def rescaled():
        m = _safe_scale(jnp.maximum(total(jnp.abs(x), "max"), 0.0))
        return m * _plain_slice_norm(x / m.astype(x.dtype), ord, axes, split, total)

    return overflow_safe(lambda: _plain_slice_norm(x, ord, axes, split, total), rescaled)


def _plain_slice_norm(x: jax.Array, ord: float | str, axes: tuple[int, ...],
                      split: tuple[str, ...], total: Callable) -> jax.Array:
    k = math.prod(x.shape[a] for a in axes) * axes_size(split)
    if ord == "mad":
        return total(jnp.abs(x)) / k
    if ord in ("std", "var"):
        mean = total(x) / k
        if k < 2:
            return jnp.full(mean.shape, jnp.nan, x.dtype)
        if ord == "std":
            return _slice_root_sum_squares(x - mean, axes, split) / math.sqrt(k - 1)
        return total(jnp.square(x - mean)) / (k - 1)
    if ord == "sum":
        return jnp.abs(total(x))
    if ord == 2.0:
        return _slice_root_sum_squares(x, axes, split)
    if ord == 1.0:
        return total(jnp.abs(x))
    if ord == 0.0:
        return total((x != 0).astype(x.dtype))
    if ord == math.inf:
        return jnp.maximum(total(jnp.abs(x), "max"), 0.0)
    if ord == -math.inf:
        return total(jnp.abs(x), "min")
    return safe_root(total(jnp.abs(x) ** ord), ord)


def _slice_root_sum_squares(x: jax.Array, axes: tuple[int, ...],
                            split: tuple[str, ...]) -> jax.Array:
    """:func:`root_sum_squares` of every slice (keepdims), the sums combined across ``split``."""
    plain, scaled = (across(jnp.expand_dims(v, axes), "sum", split)
                     for v in _sum_squares(x, axes))
    return root_of_squares(plain, scaled, SCALE_SHIFT[x.dtype])


Items = list[tuple[jax.Array, tuple[int, ...], tuple[str, ...]]]


def slice_l2_norms(items: Items | Callable[[], Items]) -> list[jax.Array]:
    """L2 norm of every slice (keepdims, wide dtype) of each ``(array, axes, split)``: the
    arrays reduced over ``axes``, the sums combined across the mesh axes ``split``.

    Each array is read once. Small arrays on a single device give the plain and the scaled
    sums of squares (:data:`SCALE_SHIFT`) from one variadic reduce; larger arrays give the
    plain sum, and their scaled sums are taken only on a step where some plain sum overflowed
    (one scalar ``lax.cond`` for all of them). A NaN/Inf element leaves its slice's norm
    non-finite. ``items`` may be a function building the list: arrays computed from others
    are then rebuilt inside that branch rather than written out for it.
    """
    def widened(listed: Items) -> Items:
        return [(_wide(x), axes, split) for x, axes, split in listed]

    if callable(items):
        def wide() -> Items:
            return widened(items())
    else:
        # Widened once: the branch reads the same arrays (XLA then reduces them the same way).
        listed = widened(items)

        def wide() -> Items:
            return listed

    first = wide()
    paired = [sums_paired(x) for x, _, _ in first]

    def unpaired(listed: Items) -> Items:
        return [i for i, p in zip(listed, paired) if not p]

    large = iter(_lazy_slice_l2_norms(unpaired(first), lambda: unpaired(wide())))
    return [_slice_root_sum_squares(*i) if p else next(large) for i, p in zip(first, paired)]


def _lazy_slice_l2_norms(items: Items, build: Callable[[], Items]) -> list[jax.Array]:
    """:func:`slice_l2_norms` of wide arrays from plain sums, the scaled sums under one cond
    (over the arrays ``build()`` gives again)."""
    if not items:
        return []
    plain = [across(jnp.expand_dims(jax.lax.reduce(jax.lax.square(x), jnp.zeros((), x.dtype),
                                                   jax.lax.add, axes), axes), "sum", split)
             for x, axes, split in items]
    # Per array (a NaN in one array must not hide an overflow in another).
    overflow = gather_scalars([jnp.any(jnp.isinf(p)) for p in plain])
    scaled = _when_overflowed(
        overflow, lambda: [overflowed_sums(x, p, axes, split)
                           for p, (x, axes, split) in zip(plain, build())], plain, True)
    return [root_of_squares(p, q, SCALE_SHIFT[x.dtype])
            for p, q, (x, _, _) in zip(plain, scaled, items)]


def slice_stds(items: Items) -> list[jax.Array]:
    """:func:`slice_norm` of order ``'std'`` of every slice (keepdims, wide dtype) of each
    ``(array, axes, split)``, the same values.

    A large array is read twice, for the mean and for the plain sum of squared deviations, and
    a third time only on a step where some of those sums overflowed (:func:`slice_l2_norms`,
    the deviations rebuilt there instead of written out for it).
    """
    wide = [(_wide(x), axes, split) for x, axes, split in items]
    counts = [math.prod(x.shape[a] for a in axes) * axes_size(split) for x, axes, split in wide]
    means = [across(jnp.expand_dims(jax.lax.reduce(x, jnp.zeros((), x.dtype), jax.lax.add, axes),
                                    axes), "sum", split) / k
             for (x, axes, split), k in zip(wide, counts)]
    spread = [i for i, k in enumerate(counts) if k >= 2]
    roots = iter(slice_l2_norms(lambda: [(wide[i][0] - means[i], *wide[i][1:]) for i in spread]))
    return [next(roots) / math.sqrt(k - 1) if k >= 2 else jnp.full(m.shape, jnp.nan, x.dtype)
            for (x, _, _), m, k in zip(wide, means, counts)]


def overflowed_sums(x: jax.Array, plain: jax.Array, axes: tuple[int, ...],
                    split: tuple[str, ...]) -> jax.Array:
    """Scaled sums of squares (:data:`SCALE_SHIFT`) of the slices of the wide ``x`` over ``axes``
    (keepdims, combined across ``split``) whose plain sums ``plain`` overflowed to ``inf``; the
    other slices get values that :func:`root_of_squares` never reads.

    The same sums as :func:`_squares` accumulates, scaled by a per-slice factor (``2**-k`` where
    ``plain`` is ``inf``, else 0) instead of by constants: XLA:CPU writes a broadcast constant
    shared by the reductions of several same-shaped arrays out as a buffer of their size, which
    each of them then reads. With a factor that is not a constant XLA does not rewrite
    ``(x f) (x f)`` into ``(x x) (f f)``, so no ``max(., 0)`` guard is needed either.
    """
    factor = jnp.where(plain == jnp.inf, jnp.asarray(2.0 ** -SCALE_SHIFT[x.dtype], x.dtype),
                       jnp.zeros((), x.dtype))
    down = jax.lax.abs(x) * factor
    local = jax.lax.reduce(jax.lax.mul(down, down), jnp.zeros((), x.dtype), jax.lax.add, axes)
    return across(jnp.expand_dims(local, axes), "sum", split)


def sees_nonfinite(ord: float | str) -> bool:
    """Whether a NaN or Inf element always makes the metric non-finite.

    Not for ``0`` (counts non-zeros), negative orders (``|inf|**p = 0``), ``-inf`` (the
    minimum) or ``inf`` (XLA:CPU's fast maximum over large arrays skips NaN): with those a
    transform must also check the updates themselves.
    """
    return not (ord in (0.0, math.inf, -math.inf) or (isinstance(ord, float) and ord < 0))


def metric_defined(ord: float | str, size: int) -> bool:
    """Whether a group of ``size`` elements has a metric worth scaling by.

    ``'std'``/``'var'`` (ddof=1) need two elements (torchzero returns NaN
    there); an empty group has nothing to measure (``'mad'`` would be 0/0,
    negative orders infinite).
    """
    return size > 0 and not (ord in ("std", "var") and size < 2)


def leaf_norm(x: jax.Array, ord: float | str, axis_name: AxisName = None) -> jax.Array:
    """Metric of a whole leaf as a 0-d array in the wide dtype (split over ``axis_name``)."""
    return slice_norm(x, ord, tuple(range(x.ndim)), split_axes([x], axis_name)[0]).reshape(())


def leaf_norms(leaves: list[jax.Array] | Callable[[], list[jax.Array]], ord: float | str,
               axis_name: AxisName = None) -> list[jax.Array]:
    """:func:`leaf_norm` of each leaf (0-d, wide dtype); order 2 by :func:`leaf_l2_norms`.

    ``leaves`` may be a function building the list: leaves computed from others (an EMA moved
    toward the update) are then rebuilt inside the rare overflow branch rather than written out
    for it. A list of scalars, not a vector: per-leaf consumers that index a vector compile one
    distinct kernel per leaf.
    """
    if ord == 2.0:
        return leaf_l2_norms(leaves, axis_name)
    build = leaves if callable(leaves) else (lambda: leaves)
    return [leaf_norm(x, ord, axis_name) for x in build()]


def leaf_l2_norms(leaves: list[jax.Array] | Callable[[], list[jax.Array]],
                  axis_name: AxisName = None, vector: bool = False) -> Any:
    """L2 norm of every array in ``leaves`` (``leaf_norm(x, 2)`` for each), each leaf read once.

    The one per-leaf L2 routine: a list of 0-d norms in the wide dtype, or with ``vector=True``
    one vector (the roots then taken once, on the vector). Each leaf is reduced once: small
    leaves give the plain and the scaled sums of squares (:data:`SCALE_SHIFT`) from one variadic
    reduce shared with same-shape leaves (:func:`leaf_reductions`); larger leaves give the plain
    sum, and their scaled sums are computed only when some plain sum overflowed (one scalar
    ``lax.cond`` for all leaves). The sums are combined across the mesh axes ``axis_name``
    names. ``leaves`` may be a function building the list (called again inside that branch).
    """
    build = leaves if callable(leaves) else (lambda: leaves)
    arrays = build()
    if not arrays:
        return jnp.zeros((0,), jnp.float32) if vector else []
    if not one_wide_dtype(arrays):
        each = [leaf_norm(x, 2.0, axis_name) for x in arrays]
        return gather_scalars([n.astype(stat_dtype()) for n in each]) if vector else each
    split = split_axes(arrays, axis_name)
    plain, scaled, lazy = _square_partials(arrays, build)
    shift = SCALE_SHIFT[acc_dtype(arrays[0].dtype)]

    def combined(values):
        return [across(v, "sum", axes) for v, axes in zip(values, split)]

    plain = combined(plain)
    if vector:
        plain = gather_scalars(plain)
        return root_of_squares(plain, _when_overflowed(
            jnp.isinf(plain), lambda: gather_scalars(combined(scaled())), plain, lazy), shift)
    overflow = jnp.isinf(gather_scalars(plain)) if lazy else None
    scaled = _when_overflowed(overflow, lambda: combined(scaled()), plain, lazy)
    return [root_of_squares(p, q, shift) for p, q in zip(plain, scaled)]


# Same-shape leaves reduced by one variadic reduce, at most this many at a time (compile time
# on XLA:CPU was lowest for groups of 16-64 at 2000 leaves; larger groups got slower again).
_GROUP_SIZE = 32
# Only leaves up to this many elements are grouped: trees with thousands of leaves are mostly
# small leaves (compile time). A variadic reduce is XLA:CPU's own kernel, not the library
# kernel that takes a plain float sum (jax 0.10.2, 2-core CPU): about as fast for leaves of
# 4096 elements, 2-2.6x slower per element for 16k-65k; on a ResNet-50-shaped tree (18 of
# 161 leaves in that range) the step of chain(clip_by_global_norm, adam) did not change
# with the limit at 4096, and larger leaves are reduced alone.
GROUP_MAX_ELEMENTS = 1 << 16
_REDUCERS = {"sum": (jax.lax.add, 0.0), "max": (jax.lax.max, -math.inf),
             "min": (jax.lax.min, math.inf)}


def _may_group() -> bool:
    """Whether arrays may be reduced by a variadic reduce (same-shape leaves together, or the
    plain and scaled sums of squares of one array side by side).

    Only where a single device is visible: XLA's SPMD partitioner gathers the operands of a
    variadic reduce over a sharded array (all-gather) instead of reducing each shard, and leaves
    of one shape can carry different shardings.
    """
    return jax.device_count() == 1


def _identity(init: float, dtype) -> jax.Array:
    """The reduction's initial value in ``dtype``; ``±inf`` is the integer type's extreme."""
    if jnp.issubdtype(dtype, jnp.integer) and math.isinf(init):
        info = jnp.iinfo(dtype)
        return jnp.asarray(info.min if init < 0 else info.max, dtype)
    return jnp.asarray(init, dtype)


def leaf_reductions(arrays: list[jax.Array], prepare: Callable[[jax.Array], Any],
                    kind: str = "sum") -> list[Any]:
    """``kind`` (``'sum'``, ``'max'``, ``'min'``) of ``prepare(x)`` over all axes, per array.

    ``prepare`` returns an array, or a tuple of arrays reduced side by side (the result per
    array is then a tuple). One reduction per array; on a single device, small arrays of one
    shape and dtype share one variadic ``lax.reduce`` (the same per-array results, no data
    copied or concatenated), which cuts XLA compile time on trees of thousands of leaves by
    about 3x. A tuple over a larger array is reduced by one plain reduction per entry.
    """
    op, init = _REDUCERS[kind]
    prepared = [prepare(x) for x in arrays]
    multi = bool(prepared) and isinstance(prepared[0], tuple)
    parts = [p if multi else (p,) for p in prepared]
    results: list[Any] = [None] * len(parts)

    def combine(a, b):
        return tuple(op(u, v) for u, v in zip(a, b))

    def reduce(group: list[int]) -> None:
        operands = tuple(v for i in group for v in parts[i])
        first = operands[0]
        if len(operands) == 1 or (len(group) == 1 and (first.size > PAIR_MAX_ELEMENTS
                                                        or not _may_group())):
            outs = [jax.lax.reduce(v, _identity(init, v.dtype), op, tuple(range(v.ndim)))
                    for v in operands]
        else:
            outs = jax.lax.reduce(operands, tuple(_identity(init, v.dtype) for v in operands),
                                  combine, tuple(range(first.ndim)))
        k = len(parts[group[0]])
        for n, i in enumerate(group):
            results[i] = tuple(outs[n * k:(n + 1) * k]) if multi else outs[n]

    if not _may_group():
        for i in range(len(parts)):
            reduce([i])
        return results
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, p in enumerate(parts):
        key = (p[0].shape, p[0].dtype) if p[0].size <= GROUP_MAX_ELEMENTS else i
        groups[key].append(i)
    for members in groups.values():
        for start in range(0, len(members), _GROUP_SIZE):
            reduce(members[start:start + _GROUP_SIZE])
    return results


def float_leaves(tree: Any) -> list[jax.Array]:
    """The floating leaves of ``tree``, in order (integer, ``None`` and masked leaves left out).

    The one rule for which leaves take part (:func:`is_float`): arrays of a floating dtype.
    A Python ``float`` leaf is not an array and is left out here; every transform's ``update``
    first turns such leaves into 0-d arrays (``checks.transformation``), which then count.
    """
    return [x for x in jax.tree.leaves(tree) if is_float(x)]


def apart(*values: Any) -> Any:
    """``values`` (arrays or pytrees; one value alone is returned as itself) behind one
    ``lax.optimization_barrier``: XLA shares no subexpression, not even a broadcast constant,
    between what is computed from them and the rest of the step.

    XLA:CPU runs a reduction in one kernel that reads each input once only when every
    intermediate it needs is used by that reduction alone; an intermediate shared with another
    computation (a scalar's broadcast the size of the leaf, read by the reductions of all
    same-shape leaves, or ``g - mean`` read by a reduction and by the output) is first written
    out as an array and read back. Passing the leaf and the scalars of one reduction through a
    barrier together keeps that reduction to one read of the leaf. Bit-identical: the barrier
    changes no value. Inside ``shard_map`` call it per leaf: a joint barrier over several leaves
    would mark each as varying over the mesh axes of any of them.
    """
    return jax.lax.optimization_barrier(values if len(values) > 1 else values[0])


def gather_scalars(partials: list[jax.Array]) -> jax.Array:
    """Per-leaf scalars as one vector, for a reduction that XLA computes once.

    Why not ``jnp.stack``: XLA's simplifier rewrites a reduction over stacked scalars into a
    chain of ``n`` scalar operations, and its fusion pass then copies that cheap chain into
    every per-leaf computation that consumes the result (a global gate or clipping factor):
    ``n`` leaves cost ``O(n^2)`` instructions and compile time quadratic in the leaf count.
    Writing the scalars into a vector with one scatter, an operation XLA neither rewrites nor
    duplicates, keeps the combination a single reduction whose result each leaf reads.
    """
    return computed_once(jnp.stack([jnp.asarray(p) for p in partials]))


def computed_once(values: jax.Array) -> jax.Array:
    """``values`` (a small array of per-leaf values) copied by one scatter along axis 0.

    XLA neither rewrites nor duplicates the scatter, so the computation behind ``values`` runs
    once, and the per-leaf computations that read ``values[i]`` do not each get a copy of it
    (see :func:`gather_scalars`).
    """
    if values.ndim == 0 or values.shape[0] == 0:
        return values
    return jnp.zeros_like(values).at[np.arange(values.shape[0])].set(
        values, indices_are_sorted=True, unique_indices=True)


def shared_scalar(value: jax.Array) -> jax.Array:
    """The 0-d ``value`` computed once and read by every per-leaf computation.

    XLA copies a chain of cheap scalar operations (a clipping factor from a norm and running
    statistics) into every fusion that consumes it: on a tree of many leaves each leaf's kernel
    then carries the whole chain. Read from a one-entry vector written by one scatter
    (:func:`computed_once`), the chain runs once and each leaf's kernel reads one number.
    """
    # Two entries: XLA rewrites a one-entry scatter into a copy of its update.
    value = jnp.asarray(value)
    return computed_once(jnp.stack([value, jnp.zeros_like(value)]))[0]


def _combine(partials: list[jax.Array], how: Callable, empty: float,
             split: list[tuple[str, ...]] | None = None, kind: str = "sum") -> jax.Array:
    if not partials:
        return jnp.asarray(empty, jnp.float32)
    groups: dict[tuple[str, ...], list[jax.Array]] = collections.defaultdict(list)
    for p, axes in zip(partials, split or [()] * len(partials)):
        groups[axes].append(p)
    totals = [across(how(gather_scalars(ps)), kind, axes) for axes, ps in groups.items()]
    return totals[0] if len(totals) == 1 else how(jnp.stack(totals))


def tree_sum(partials: list[jax.Array], split: list[tuple[str, ...]] | None = None
             ) -> jax.Array:
    """Sum of per-leaf scalars, as one reduction (keeps compile time flat in the leaf count).

    ``split`` (from :func:`split_axes`) gives, per partial, the mesh axes to sum it across.
    """
    return _combine(partials, jnp.sum, 0.0, split)


def global_norm(tree: Any, ord: float | str = 2.0, axis_name: AxisName = None,
                build: Callable[[], Any] | None = None) -> jax.Array:
    """Metric of all floating leaves of ``tree`` taken as one vector.

    Computed from per-leaf partial reductions combined as scalars. Unlike torchzero 0.4.4,
    ``ord=0`` counts non-zeros instead of raising. Inside ``shard_map``/``pmap``,
    ``axis_name`` names the mesh axes the leaves are split over: the partial reductions are
    combined across devices (one scalar collective per group of leaves split alike).
    Scale-safe: order 2 takes the sum of squares scaled by ``2**-86`` where the plain one
    overflowed (small leaves give both in one variadic reduce; large leaves are read a second
    time only on such a step, under one scalar ``lax.cond``); other orders that can overflow
    are recomputed from the leaves divided by the largest magnitude (:func:`overflow_safe`).
    The common case reads the leaves once. ``build`` (optional) returns ``tree`` again: it is
    called inside that branch, so that leaves computed from others are recomputed there rather
    than kept for it.
    """
    leaves = float_leaves(tree)
    rebuild = None if build is None else (lambda: float_leaves(build()))
    split = split_axes(leaves, axis_name)
    if ord == 2.0 and one_wide_dtype(leaves):
        plain, scaled, lazy = _square_partials(leaves, rebuild)
        total = tree_sum(plain, split)
        scaled_total = _when_overflowed(jnp.isinf(total), lambda: tree_sum(scaled(), split),
                                        total, lazy)
        return root_of_squares(total, scaled_total, SCALE_SHIFT[acc_dtype(leaves[0].dtype)])
    if not (_power_norm(ord) or ord in (2.0, "std")):
        return _plain_global_norm(leaves, ord, split)

    def rescaled():
        again = leaves if rebuild is None else rebuild()
        peak = _combine(leaf_reductions(again, lambda x: jnp.abs(_wide(x)), "max"), jnp.max, 0.0,
                        split, "max")
        peak = _safe_scale(peak)
        return peak * _plain_global_norm(again, ord, split, peak)

    return overflow_safe(lambda: _plain_global_norm(leaves, ord, split), rescaled)


def one_wide_dtype(leaves: list[jax.Array]) -> bool:
    """Whether all leaves accumulate in one dtype (then their scaled sums share one scale)."""
    return bool(leaves) and len({acc_dtype(x.dtype) for x in leaves}) == 1


def _square_partials(leaves: list[jax.Array], build: Callable[[], list] | None = None
                     ) -> tuple[list[jax.Array], Callable[[], list], bool]:
    """Per leaf, the plain sum of squares, and a function giving the scaled sums (see
    :data:`SCALE_SHIFT`): each leaf is read once.

    Small leaves on a single device get both sums from one variadic reduce, so their scaled
    sums come for free; a large leaf's scaled sum is a second read of it, so the function
    computes it only when called (under :func:`_when_overflowed`, on the rare step whose plain
    sum overflowed). The third entry says whether the function reads any leaf (``lazy``).
    ``build`` (optional) rebuilds ``leaves`` inside that call, so that leaves computed from
    others are recomputed there rather than kept for it.
    """
    paired = [sums_paired(x) for x in leaves]
    pairs = leaf_reductions([x for x, p in zip(leaves, paired) if p],
                            lambda x: _squares(_wide(x)))
    singles = [x for x, p in zip(leaves, paired) if not p]
    plain_singles = leaf_reductions(singles, lambda x: jax.lax.square(_wide(x)))

    def merge(from_pairs, from_singles):
        it_p, it_s = iter(from_pairs), iter(from_singles)
        return [next(it_p) if p else next(it_s) for p in paired]

    def scaled():
        # Rebuilt only when some leaf is read again (tracing build() is not free).
        again = (singles if build is None or not singles
                 else [x for x, p in zip(build(), paired) if not p])
        return merge([q for _, q in pairs],
                     leaf_reductions(again, lambda x: _squares(_wide(x))[1]))

    return merge([p for p, _ in pairs], plain_singles), scaled, bool(singles)


def _when_overflowed(overflow: jax.Array, scaled_total: Callable[[], jax.Array],
                     like: jax.Array, lazy: bool) -> jax.Array:
    """``scaled_total()``; where computing it needs a second read of large leaves, only on a
    step whose plain sum ``overflow``-ed (one scalar ``lax.cond``; zeros otherwise, unused).

    On a GPU always (:mod:`optclip._core.branch`): its reduces read the same leaves as the
    plain sums, and XLA's GPU compiler fuses sibling reductions of one array into one kernel
    and one read.
    """
    if not lazy:
        return scaled_total()
    return branch.rare(jnp.any(overflow), scaled_total,
                       lambda: jax.tree.map(jnp.zeros_like, like))


def _plain_global_norm(leaves: list[jax.Array], ord: float | str,
                       split: list[tuple[str, ...]], peak=None) -> jax.Array:
    count = sum(x.size * axes_size(axes) for x, axes in zip(leaves, split))

    def total(prepare, kind="sum"):
        if peak is None:
            return leaf_reductions(leaves, lambda x: prepare(_wide(x)), kind)
        return leaf_reductions(
            leaves, lambda x: prepare(_wide(x) / peak.astype(acc_dtype(x.dtype))), kind)

    def tsum(partials):
        return tree_sum(partials, split)

    if ord == math.inf:
        return _combine(total(jnp.abs, "max"), jnp.max, 0.0, split, "max")
    if ord == -math.inf:
        return _combine(total(jnp.abs, "min"), jnp.min, math.inf, split, "min")
    if ord in ("std", "var", "sum"):
        signed = tsum(total(lambda x: x))
        if ord == "sum":
            return jnp.abs(signed)
        mean = signed / max(count, 1)
        if count < 2:
            return jnp.full((), jnp.nan, signed.dtype)
        squares = tsum(total(lambda x: jnp.square(x - mean)))
        return safe_sqrt(squares / (count - 1)) if ord == "std" else squares / (count - 1)
    if ord == "mad":
        return tsum(total(jnp.abs)) / max(count, 1)
    if ord == 2.0:
        return safe_sqrt(tsum(total(jnp.square)))
    if ord == 1.0:
        return tsum(total(jnp.abs))
    if ord == 0.0:
        return tsum(total(lambda x: (x != 0).astype(x.dtype)))
    return safe_root(tsum(total(lambda x: jnp.abs(x) ** ord)), ord)


def int_type(dtype) -> jnp.dtype:
    """The signed integer type as wide as the float ``dtype`` (for reading its bits)."""
    return jnp.dtype(jnp.int64) if jnp.dtype(dtype).itemsize == 8 else jnp.dtype(jnp.int32)


def scale(x: jax.Array, factor: jax.Array) -> jax.Array:
    """``x * factor`` computed in the wide dtype and cast back to ``x``'s dtype."""
    if not is_float(x):
        return x
    return (_wide(x) * factor.astype(acc_dtype(x.dtype))).astype(x.dtype)
