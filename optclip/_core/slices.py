"""Per-slice machinery shared by the Lp-space transforms, the projections and Frank-Wolfe:
validation, slice axes, sign and Lp normalization of slices, the top-q mask, clamping.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optclip._core import axes as axes_lib
from optclip._core import checks, handout, leafvec, norms, stats

# rai_toolbox's ``div_by_zero_eps`` default: float32's smallest normal number, 2**-126.
TINY = float(np.finfo(np.float32).tiny)


def is_number(value: Any) -> bool:
    return isinstance(value, (numbers.Real, np.generic)) and not isinstance(value, bool)


def check_real(name: str, value: Any) -> None:
    """Any finite real (no range): an infinite scale or bias would make every output
    non-finite; NaN and non-numbers are rejected."""
    checks.in_range(name, value, finite=True)


def check_bounds(clamp_min: Any, clamp_max: Any) -> None:
    if clamp_min is None and clamp_max is None:
        raise ValueError("clamp_min and clamp_max cannot both be None; set at least one bound")
    # An infinite bound on its own side is no bound; on the other side it would set every
    # element to that infinity.
    # The values checked (a schedule's at step 0), None where not known now.
    low = checks.in_range("clamp_min", clamp_min, high=math.inf, high_inclusive=False,
                          allow_none=True, allow_schedule=True)
    high = checks.in_range("clamp_max", clamp_max, low=-math.inf, low_inclusive=False,
                           allow_none=True, allow_schedule=True)
    if low is not None and high is not None and float(np.asarray(low)) > float(np.asarray(high)):
        at = " at step 0" if callable(clamp_min) or callable(clamp_max) else ""
        raise ValueError(f"clamp_min must be <= clamp_max, got clamp_min={float(low)!r} > "
                         f"clamp_max={float(high)!r}{at}")


def check_q(q: Any, dq: Any, seed: Any) -> None:
    checks.in_range("q", q, 0.0, 1.0)
    checks.in_range("dq", dq, 0.0, 1.0)
    checks.integer("seed", seed, low=0)


def slice_axes(x: jax.Array, param_ndim: int | None) -> tuple[int, ...]:
    return axes_lib.reduction_axes(x.ndim, param_ndim=param_ndim)


def leaf_axes(leaves: list, tree: Any, param_ndim: Any) -> list:
    """Slice axes of every leaf of ``tree`` (``None`` for non-float leaves); ``param_ndim``
    may be per leaf (a pytree matching the parameters or a callable ``(path, leaf) -> k``)."""
    return [slice_axes(x, k) if norms.is_float(x) else None
            for x, k in zip(leaves, axes_lib.leaf_param_ndims(param_ndim, tree), strict=True)]


class Slicing(NamedTuple):
    """How every flattened leaf is cut into slices (``None`` entries for non-float leaves)."""
    axes: list     # the reduced axes of each leaf
    split: list    # the mesh axes its slices are split over (inside shard_map/pmap)
    sizes: list    # entries per whole slice (all devices together)


def slicing(leaves: list, tree: Any, param_ndim: Any, axis_name: norms.AxisName) -> Slicing:
    """The :class:`Slicing` of the flattened ``leaves`` of ``tree``.

    One-element slices (no reduced axes) lie whole on one device whatever the leaf's split:
    they are never combined across devices.
    """
    axes_of = leaf_axes(leaves, tree, param_ndim)
    split_of = [split if axes else () for axes, split in
                zip(axes_of, norms.split_axes(leaves, axis_name), strict=True)]
    sizes = [None if axes is None else axes_lib.slice_size(x.shape, axes) * norms.axes_size(s)
             for x, axes, s in zip(leaves, axes_of, split_of)]
    return Slicing(axes_of, split_of, sizes)


def require_params(params: Any, name: str, updates: Any = None) -> None:
    """``params`` is given and (with ``updates``) pairs with the updates leaf for leaf
    (:func:`optclip._core.checks.params_like`)."""
    if params is None:
        raise ValueError(f"{name} needs the current parameters: call "
                         f"update(updates, state, params) (it must come last in the chain)")
    if updates is not None:
        checks.params_like(updates, params, name)


def sign(g: jax.Array) -> jax.Array:
    """``sign(g)`` with ``sign(±0) = +0`` (torch); NaN propagates."""
    return jnp.where(g == 0, jnp.zeros_like(g), jnp.sign(g))


def normalized(g: jax.Array, ord: float, axes: tuple[int, ...], eps: Any,
               split: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """``g / max(||g||, eps)`` per slice, in the wide dtype; returns (output, norm).

    The norm is the plain reduction (the reference's formula in the normal range). Where it
    underflows (``Σg² < tiny`` for L2, ``Σ|g| < tiny`` for L1) or is so large that its
    reciprocal would be subnormal (``>= 1/tiny``, inf included) while the slice is non-zero and
    finite, the slice is first scaled by a fixed power of two (down or up) that brings it into
    range, so the output has unit norm: the reference returns 8.5e7 for [1e-30, 0] and [0, 0] for
    [3e38, 3e38]. A zero slice stays zero in every dtype, also for ``eps=0`` (the
    reference gives NaN in float16). The output is ``g`` times the reciprocal of the divisor
    (what XLA makes of a division by a per-slice value), so results can differ from the
    reference by an ulp. ``split``: mesh axes the slices are split over (inside
    ``shard_map``/``pmap``). :func:`normalized_leaves` does the same for a list of leaves and
    reads each leaf only once for the norm on a step where no slice needs the rescaling.
    """
    if not axes:
        return _elementwise_normalized(g, ord, eps)
    plain = _plain_norms([g], ord, [axes], [split])
    up, down, norm = _rescued(plain[0], _rescaled_norms([g], plain, ord, [axes], [split])[0],
                              ord, eps, g.dtype)
    return _wide(g) * up * down, norm


def _wide(g: jax.Array) -> jax.Array:
    # jnp.asarray: a NumPy leaf (an eager call) is then squared by XLA, not by NumPy, whose
    # overflow warnings would be noise on the rows the rescaling is there for.
    return jnp.asarray(g, norms.acc_dtype(g.dtype))


def _divisor(norm: jax.Array, eps: Any) -> jax.Array:
    """``max(norm, eps)``, and 1 for a zero slice: it stays zero, with a finite derivative
    (0 / eps**2 is NaN)."""
    return jnp.where(norm == 0, 1, jnp.maximum(norm, jnp.asarray(eps).astype(norm.dtype)))


def _limits(ord: float, dtype) -> tuple[float, float]:
    """The norms ``[low, high)`` of the wide ``dtype`` that need no rescaling."""
    tiny = float(jnp.finfo(dtype).tiny)
    return (tiny if ord == 1.0 else math.sqrt(tiny)), 1 / tiny


def _usual(norm: jax.Array, ord: float, dtype) -> jax.Array:
    """Per slice: the plain norm of a slice of ``dtype`` is finite and needs no rescaling
    (float16 never does: its squares cannot under- or overflow in float32; an L1 norm is 0
    only for a zero slice)."""
    if dtype == jnp.float16:
        return jnp.isfinite(norm)
    low, high = _limits(ord, norm.dtype)
    return ((norm >= low) & (norm < high)) | ((norm == 0) if ord == 1.0 else False)


# The power of two a slice whose plain norm is out of range is scaled by before it is measured
# again: 2**-S where the norm is too large, 2**S where it is too small. Either way every element
# lands where its square (or magnitude) can neither overflow in a sum of up to 2**40 elements nor
# underflow below the precision of the norm (float32: a slice whose L2 norm is below 2**-63 holds
# no element above 2**-55, scaled up at most 2**45; its smallest subnormal becomes 2**-49, whose
# square is normal; a norm of 2**126 or more is scaled down to elements at most 2**28).
_RESCUE_SHIFT = {jnp.dtype(jnp.float32): 100, jnp.dtype(jnp.float64): 600}


def _rescue_factor(plain: jax.Array, ord: float) -> jax.Array:
    """Per slice, the power of two the slice is scaled by before it is measured again: down
    where its plain norm is too large (``inf`` included), up where it is too small, else 1."""
    low, high = _limits(ord, plain.dtype)
    shift = _RESCUE_SHIFT[plain.dtype]
    return jnp.where(plain >= high, jnp.asarray(2.0 ** -shift, plain.dtype),
                     jnp.where(plain < low, jnp.asarray(2.0 ** shift, plain.dtype),
                               jnp.ones((), plain.dtype)))


def _rescued(plain: jax.Array, unit: jax.Array, ord: float, eps: Any, dtype
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per slice ``(up, down, norm)`` from the plain norm and ``unit``, the norm of the slice
    scaled by :func:`_rescue_factor` (or anything not above 0 where no slice needed it): the
    output of :func:`normalized` is ``wide(g) * up * down``. A power of two scales exactly,
    so the quotient is the one the unscaled slice would give in exact range."""
    factor = _rescue_factor(plain, ord)
    one = jnp.ones((), plain.dtype)
    # A zero slice (and every float16 slice: its float32 sums neither under- nor overflow)
    # keeps the plain divisor; NaN compares false and is not rescaled.
    rescale = (factor != 1) & (unit > 0) & (jnp.dtype(dtype) != jnp.float16)
    denom = jnp.where(rescale, unit, _divisor(plain, eps))
    up = jnp.where(rescale, factor, one)
    down = 1 / jnp.where(denom == 0, one, denom)
    norm = jnp.where(rescale, unit / factor, plain)     # exact: factor is a power of two
    return up, down, norm


def _rescaled_norms(leaves: list, plain: list, ord: float, axes: list, split: list) -> list:
    """Per leaf, the norm of every slice scaled by :func:`_rescue_factor` (one more read; it
    is finite exactly when the slice is)."""
    return _plain_norms([_wide(g) * _rescue_factor(n, ord) for g, n in zip(leaves, plain)],
                        ord, axes, split)


def _plain_norms(leaves: list, ord: float, axes: list, split: list) -> list:
    """The L1 or L2 norm of every slice of every leaf (keepdims) from one plain sum: ``inf``
    where it overflows, 0 where the squares underflow. Leaf ``i`` is cut along ``axes[i]``
    and split over the mesh axes ``split[i]``."""
    def plain(g, axes, split):
        wide = _wide(g)
        total = norms.across(jnp.sum(jnp.abs(wide) if ord == 1.0 else wide * wide, axis=axes,
                                     keepdims=True), "sum", split)
        return total if ord == 1.0 else norms.safe_sqrt(total)

    return [plain(g, a, s) for g, a, s in zip(leaves, axes, split, strict=True)]


def _elementwise_normalized(g: jax.Array, ord: float, eps: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`normalized` of one-element slices: ``g / max(|g|, eps)``, ``sign(g)`` where the
    reciprocal of ``|g|`` is out of range; the norm is ``|g|``."""
    wide = _wide(g)
    norm = jnp.abs(wide)
    rescale = ~_usual(norm, ord, g.dtype) & (norm > 0) & jnp.isfinite(norm)
    return jnp.where(rescale, jnp.sign(wide), wide / _divisor(norm, eps)), norm


def normalized_leaves(leaves: list, cut: Slicing, ord: float, eps: Any,
                      axis_name: norms.AxisName) -> tuple[list, list, jax.Array]:
    """:func:`normalized` of every float leaf cut by ``cut``; returns (outputs in the wide dtype,
    norms keepdims, whether every element of every float leaf is finite on every device).

    Each leaf is read once, for one plain sum per slice (one-element slices need none). Only
    when some slice's plain norm is zero (L2), non-finite or out of the range where its
    reciprocal is exact (one scalar test for all leaves, ``lax.cond``) are the rescaled
    divisors and the finiteness computed again exactly, as :func:`normalized` does; otherwise
    every norm is finite, and so is every element. The scaling itself is elementwise outside
    the ``cond``, so XLA can fuse it into the next transform.
    """
    reduced = [i for i, axes in enumerate(cut.axes) if axes]
    plain = _plain_norms([leaves[i] for i in reduced], ord, [cut.axes[i] for i in reduced],
                         [cut.split[i] for i in reduced])
    odd = norms.leaf_reductions([(~_usual(n, ord, leaves[i].dtype)).astype(jnp.float32)
                                 for i, n in zip(reduced, plain)], lambda f: f, "max")
    rare = norms.any_true(jnp.any(norms.gather_scalars(odd) > 0) if odd
                          else jnp.asarray(False), axis_name)

    def usual():
        return [jnp.zeros_like(n) for n in plain], jnp.asarray(True)

    def exact():
        units = _rescaled_norms([leaves[i] for i in reduced], plain, ord,
                                [cut.axes[i] for i in reduced], [cut.split[i] for i in reduced])
        return units, stats.all_finite(units, axis_name)

    units, finite = jax.lax.cond(rare, exact, usual)
    outputs, measured = [None] * len(leaves), [None] * len(leaves)
    for i, n, unit in zip(reduced, plain, units):
        up, down, measured[i] = _rescued(n, unit, ord, eps, leaves[i].dtype)
        outputs[i] = _wide(leaves[i]) * up * down
    elementwise = [i for i, axes in enumerate(cut.axes) if axes == ()]
    for i in elementwise:
        outputs[i], measured[i] = _elementwise_normalized(leaves[i], ord, eps)
    others = stats.all_finite([leaves[i] for i in elementwise], axis_name)
    return outputs, measured, finite & others


def explicit_sharding(x: jax.Array):
    """``x``'s sharding when it is sharded under an explicit mesh (``jax.make_mesh``'s default),
    else ``None`` (unsharded, or automatic sharding that XLA propagates by itself)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return sharding if spec is not None and any(s is not None for s in spec) else None


def slice_rows(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """View ``x`` as ``(*batch, D)``: the reduced (trailing) axes merged into one.

    Ranking needs whole slices: where a slice is sharded over devices under an explicit mesh,
    its axes are replicated first (the batch axes keep their sharding).
    """
    n_batch = x.ndim - len(axes)
    if not axes:
        return x[..., None]
    sharding = explicit_sharding(x)
    if sharding is not None:
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        if any(s is not None for s in spec[n_batch:]):
            x = jax.sharding.reshard(x, jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(*spec[:n_batch], *[None] * len(axes))))
    if len(axes) == 1:
        return x
    return x.reshape(*x.shape[:n_batch], axes_lib.slice_size(x.shape, axes))


def slice_mask(mask: jax.Array, like: jax.Array) -> jax.Array:
    """A ``(*batch, D)`` mask back in ``like``'s shape (and explicit sharding)."""
    mask = mask.reshape(like.shape)
    sharding = explicit_sharding(like)
    return mask if sharding is None else jax.sharding.reshard(mask, sharding)


def top_k_masks(rows: list, ks: list) -> list:
    """For each ``(*batch, D)`` array of ``rows``, whether each entry is among the ``k`` largest
    ``|g|`` of its row (``k`` from ``ks``, a Python int or an int32 scalar).

    Stable: ties go to the lowest index first (torch.topk breaks them arbitrarily);
    NaN ranks as the largest (it is kept, as in the reference). No sort (XLA:CPU sorts and
    ``top_k`` with a large ``k`` are slow): the ``k``-th largest magnitude of every row is
    found by a bisection on the bits of ``|g|``, one count per row and round
    (:func:`_largest`), and the entries above it are kept, and those equal to it up to a cut
    index. That index is the row's end unless some row holds more entries equal to it than
    it may keep (one scalar test for all arrays, ``lax.cond``); only then is it found by a
    second bisection, on the index. One loop and one test for all arrays: XLA compiles one
    ``while`` and one ``cond``, not one per leaf. On a single CPU device an array of many rows
    is ranked by blocks of rows instead (:func:`_blockwise_cuts`, whose search stops once
    every row of a block is settled: :func:`_settled_cut`).

    A row with fewer than ``k`` non-zero entries marks all its zeros: every caller keeps the
    marked entries' own values (a zero stays a zero; -0.0 keeps its sign), so the rows of an
    embedding's gradient that no token of the batch touched need no tie-break.
    """
    ranked = [i for i, r in enumerate(rows) if r.shape[-1] > 0]
    arrays = [rows[i] for i in ranked]
    ks = [jnp.asarray(ks[i], jnp.int32) for i in ranked]
    # Rows per block of each array ranked by blocks (by position in ``arrays``).
    blocked = {j: per for j, r in enumerate(arrays) if (per := _block_rows(r))}

    def together(*arrays):
        return _row_cuts([magnitude_bits(r) for r in arrays], ks)

    def by_blocks(*arrays):
        rest = [j for j in range(len(arrays)) if j not in blocked]
        kth, last = [None] * len(arrays), [None] * len(arrays)
        if rest:
            cuts = _row_cuts([magnitude_bits(arrays[j]) for j in rest], [ks[j] for j in rest])
            for j, t, e in zip(rest, *cuts, strict=True):
                kth[j], last[j] = t, e
        for j, per in blocked.items():
            kth[j], last[j] = _blockwise_cuts(arrays[j], ks[j], per)
        return kth, last

    if not ranked:
        kth, last = [], []
    elif blocked:
        # CPUs only: an accelerator runs each round over the whole array at once, and a loop
        # over blocks would add a kernel launch per block and round.
        kth, last = jax.lax.platform_dependent(*arrays, cpu=by_blocks, default=together)
    else:
        kth, last = together(*arrays)
    masks = [jnp.zeros(r.shape, bool) for r in rows]
    for j, i in enumerate(ranked):
        b, t = magnitude_bits(rows[i]), kth[j]
        masks[i] = ((b > t) | ((b == t) & (_row_index(b) <= last[j]))) & (ks[j] > 0)
    return masks


def _row_cuts(bits: list, ks: list, settle: bool = False) -> tuple[list, list]:
    """Per row of every ``(*batch, D)`` array of magnitude ``bits``: the bits of its ``k``-th
    largest magnitude, and the index of the last entry equal to it that is kept (keepdims);
    :func:`top_k_masks`' search, one loop and one ``cond`` for all arrays.

    The per-row values of the arrays of one :func:`_count_groups` group are carried stacked
    (one array per group, counted by one reduce: :func:`_row_counts`), so the loop and the
    ``cond`` hold a fixed number of kernels per group, not per array.

    ``settle`` (one array): the search is :func:`_settled_cut`'s, whose number of rounds
    depends on the data; the cut it returns may be smaller than the ``k``-th largest
    magnitude, with the same entries at or above it.
    """
    groups = _count_groups(bits)
    # Per-row values built from the data carry its sharding under an explicit mesh.
    zeros = [_stacked([jnp.zeros_like(bits[i][..., :1]) for i in g]) for g in groups]
    sizes = [bits[g[0]].shape[-1] for g in groups]
    every = [(z + n).astype(_count_dtype(n)) for z, n in zip(zeros, sizes)]
    ks = [_stacked([jnp.reshape(ks[i], (1,) * bits[i].ndim) for i in g]) for g in groups]
    if settle:
        (b,), (k,) = bits, ks
        cut, at_cut = _settled_cut(b, k[0])
        kth, at_least = [cut[None]], [at_cut[None]]
    else:
        # The largest bit pattern with at least k entries at or above it: the k-th largest.
        kth, at_least = _largest(
            zeros, [_top_bits(bits[g[0]]) + 1 for g in groups],
            [functools.partial(_at_or_above, [bits[i] for i in g]) for g in groups], ks, every)
    # A row whose k-th largest magnitude is 0 keeps every zero: that changes no output.
    exact = [jnp.all((a == k.astype(a.dtype)) | (t == 0)) for a, k, t in zip(at_least, ks, kth)]

    def row_ends():
        return [z.astype(jnp.int32) + n - 1 for z, n in zip(zeros, sizes)]

    def cut_ties():
        # Per row the last index with fewer than `wanted` ties before it: the last tie kept.
        ties = [[bits[i] == t[j] for j, i in enumerate(g)] for g, t in zip(groups, kth)]
        wanted = [1 - k + _row_counts([bits[i] > t[j] for j, i in enumerate(g)]
                                      ).astype(jnp.int32)
                  for g, t, k in zip(groups, kth, ks)]
        counts = [functools.partial(_ties_before, t, [_row_index(x) for x in t]) for t in ties]
        return _largest([z.astype(jnp.int32) for z in zeros], [n + 1 for n in sizes], counts,
                        wanted, [e * 0 for e in every])[0]

    last = jax.lax.cond(jnp.all(norms.gather_scalars(exact)), row_ends, cut_ties)
    return _unstacked(groups, kth, len(bits)), _unstacked(groups, last, len(bits))


# Arrays up to this many entries have their per-row counts taken together with those of
# arrays of the same shape (:func:`_count_groups`), at most ``_COUNT_GROUP`` at a time: a
# variadic reduce is about as fast as one plain reduce per array at 4096 entries, and its
# compile time grows faster than its operand count (top_q on 2000 small leaves, 2-core CPU,
# jax 0.10.2: 65 s to compile one reduce per array, 48 s in groups of 4, 44 s of 8, 55 s of 16).
COUNT_GROUP_MAX_ELEMENTS = 1 << 12
_COUNT_GROUP = 8
# A group saves kernels, and XLA:CPU's time to order a step's kernels grows with the square of
# their number; but a group's own kernels take longer to compile than those of its arrays apart.
# So groups grow with the number of arrays ranked together: one array per ``COUNT_GROUP_PER``
# of them (and at most ``_COUNT_GROUP``). Measured on the benchmark's small leaves (2-core CPU,
# jax 0.10.2, top_q, each compile timed 2-4 times): on 32 leaves groups of 8 compiled in
# 1.9-2.1 s, single arrays in 1.3-1.7 s; on 128 leaves groups of 4 in 2.5-2.9 s, of 8 and
# single arrays in 2.9-3.4 s; on 256 leaves groups of 8 in 5.0-5.3 s, single arrays in
# 5.7-7.2 s; on 1000 leaves groups of 8 in 18.6 s, single arrays in 30.6 s.
COUNT_GROUP_PER = 32


def _count_group_size(arrays: int) -> int:
    """How many same-shape arrays one group holds when ``arrays`` are ranked together."""
    return max(1, min(_COUNT_GROUP, arrays // COUNT_GROUP_PER))


def _count_groups(bits: list) -> list[list[int]]:
    """The indices of ``bits`` in groups whose per-row counts one variadic ``lax.reduce``
    takes: on a single device, arrays of one shape and dtype of up to
    :data:`COUNT_GROUP_MAX_ELEMENTS` entries (at most :func:`_count_group_size` a group);
    every other array alone. With several devices visible every array is alone
    (``norms._may_group``: XLA's SPMD partitioner gathers the operands of a variadic reduce
    over a sharded array)."""
    together = norms._may_group()
    size = _count_group_size(len(bits))
    keyed: dict[Any, list[int]] = {}
    for i, b in enumerate(bits):
        key = (b.shape, b.dtype) if together and b.size <= COUNT_GROUP_MAX_ELEMENTS else i
        keyed.setdefault(key, []).append(i)
    return [members[start:start + size] for members in keyed.values()
            for start in range(0, len(members), size)]


def _stacked(values: list) -> jax.Array:
    """Same-shape per-row values of one group stacked along a new leading axis (one value:
    a leading axis of 1, no copy)."""
    return values[0][None] if len(values) == 1 else jnp.stack(values)


def _unstacked(groups: list, stacked: list, n: int) -> list:
    """Per array (``n`` of them), its entry of its group's stacked value."""
    out: list[Any] = [None] * n
    for g, s in zip(groups, stacked):
        for j, i in enumerate(g):
            out[i] = s[j]
    return out


def _row_counts(flags: list) -> jax.Array:
    """:func:`_row_count` of each array of ``flags`` (one group: same shape), stacked. Several
    arrays are counted by one variadic ``lax.reduce`` in the count dtype: exact integers in
    any order of addition, so the same counts."""
    if len(flags) == 1:
        return _row_count(flags[0])[None]
    dtype = _count_dtype(flags[0].shape[-1])
    axis = flags[0].ndim - 1
    zeros = tuple(jnp.zeros((), dtype) for _ in flags)
    sums = jax.lax.reduce(tuple(f.astype(dtype) for f in flags), zeros,
                          lambda a, b: tuple(jax.lax.add(u, v) for u, v in zip(a, b)), (axis,))
    return jnp.stack([jnp.expand_dims(s, axis) for s in sums])


def _settled_cut(bits: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of a ``(*batch, D)`` array of magnitude ``bits`` (keepdims): a cut with exactly
    ``k`` entries at or above it if there is one, else the ``k``-th largest magnitude; and the
    count of entries at or above the cut.

    A bisection of ``[0, inf]`` that first tries the cut 1 (the smallest non-zero bit pattern:
    a row with fewer than ``k`` non-zero entries, such as an embedding row no token of the
    batch touched, is settled by it at once) and ends as soon as every row is settled, that is
    has exactly ``k`` entries at or above its cut, or a range one bit pattern wide. A
    ``while`` loop of one round per test, one count per row and round: on random rows of 768
    entries a block of 85 rows settles in about 24 rounds, where :func:`_largest` always takes
    31 (63 for float64).
    """
    wanted = k.astype(_count_dtype(bits.shape[-1]))
    zero = jnp.zeros_like(bits[..., :1])

    def halve(low, high, at_low, middle):
        at_middle = _row_count(bits >= middle)
        enough = at_middle >= wanted
        return (jnp.where(enough, middle, low), jnp.where(enough, high, middle),
                jnp.where(enough, at_middle, at_low))

    def middle(low, high):
        return low + jnp.right_shift(high - low, jnp.asarray(1, low.dtype))

    def unsettled(carry):
        _, low, high, at_low = carry
        return jnp.any((at_low != wanted) & (high - low > 1))

    def rounds(carry):
        # One round per test (two or four per test stepped top_q on GPT-2 1-3% slower: the
        # rounds past the last settled row cost more than the tests they save). A settled row
        # stays settled (its count stays k, or its range one pattern wide). The first round
        # tries 1 (in the loop, so that it counts the bits the loop reads, not the leaf once
        # more).
        r, low, high, at_low = carry
        return r + 1, *halve(low, high, at_low, jnp.where(r == 0, low + 1, middle(low, high)))

    start = (jnp.asarray(0, jnp.int32), zero, zero + _top_bits(bits) + 1,
             (zero + bits.shape[-1]).astype(wanted.dtype))
    _, low, _, at_low = jax.lax.while_loop(unsettled, rounds, start)
    return low, at_low


# On one CPU device an array of many rows is ranked by blocks of about this many entries, one
# block after the other: every round of the bisection then reads its block from the core's own
# cache instead of the whole array from memory (measured on a 2-core CPU with 2 MiB of L2 per
# core: GPT-2's embedding, 50257 x 768, ranked in 0.16 s by blocks of 85 rows against 0.63 s
# as one array; blocks of 2**15 or 2**17 entries stepped GPT-2-small 1% and 50% slower).
RANK_BLOCK_ENTRIES = 1 << 16


def single_cpu_device() -> bool:
    """Whether the CPU backend has one device. With several (``jax.distributed``, or
    ``--xla_force_host_platform_device_count``) the compiler may split a leaf's rows over them
    (GSPMD), and a loop over blocks of rows would gather the leaf onto every device."""
    try:
        return jax.device_count("cpu") == 1
    except RuntimeError:   # no CPU backend
        return False


def _block_rows(rows: jax.Array) -> int:
    """Rows per block where ``rows`` (``(*batch, D)``) is ranked by blocks, else 0: arrays of
    at least two blocks, on a single CPU device, not sharded under an explicit mesh."""
    per = max(1, RANK_BLOCK_ENTRIES // max(rows.shape[-1], 1))
    count = math.prod(rows.shape[:-1])
    blockable = count >= 2 * per and explicit_sharding(rows) is None
    return per if blockable and single_cpu_device() else 0


def _blockwise_cuts(rows: jax.Array, k: jax.Array, per: int) -> tuple[jax.Array, jax.Array]:
    """:func:`_row_cuts` of one array, ``per`` rows at a time (one ``fori_loop``).

    The last block ends at the last row (it starts earlier, overlapping the one before it:
    those rows get the same cuts again), so every block has the same shape.
    """
    width = rows.shape[-1]
    flat = rows.reshape(-1, width)
    count = flat.shape[0]
    bits_dtype = norms.int_type(norms.acc_dtype(rows.dtype))

    def block(b, cuts):
        start = jnp.minimum(b * per, count - per)
        part = jax.lax.dynamic_slice_in_dim(flat, start, per)
        (kth,), (last,) = _row_cuts([magnitude_bits(part)], [k], settle=True)
        return tuple(jax.lax.dynamic_update_slice_in_dim(c, v, start, 0)
                     for c, v in zip(cuts, (kth, last)))

    empty = (jnp.zeros((count, 1), bits_dtype), jnp.zeros((count, 1), jnp.int32))
    kth, last = jax.lax.fori_loop(0, -(-count // per), block, empty)
    shape = (*rows.shape[:-1], 1)
    return kth.reshape(shape), last.reshape(shape)


def _row_index(x: jax.Array) -> jax.Array:
    """The index of every entry along the last axis (built from ``x``: its sharding)."""
    return jnp.zeros_like(x, jnp.int32) + jnp.arange(x.shape[-1], dtype=jnp.int32)


def _at_or_above(bits: list, value: jax.Array) -> jax.Array:
    """Per row of each array of one group, how many ``bits`` are at or above its row of the
    stacked ``value`` (stacked)."""
    return _row_counts([b >= value[j] for j, b in enumerate(bits)])


def _ties_before(ties: list, index: list, end: jax.Array) -> jax.Array:
    """Per row of each array of one group, minus how many ``ties`` lie before its row of the
    stacked ``end`` (stacked)."""
    return -_row_counts([t & (x < end[j]) for j, (t, x) in enumerate(zip(ties, index))])


def _float_of(bits: jax.Array):
    return np.float64 if bits.dtype == jnp.int64 else np.float32


def _top_bits(bits: jax.Array) -> int:
    """The largest magnitude :func:`magnitude_bits` gives, NaN's: the bit pattern of ``inf``
    in the float type whose bits ``bits`` holds, plus 1."""
    return int(np.asarray(np.inf, _float_of(bits)).view(bits.dtype)) + 1


def magnitude_bits(g: jax.Array) -> jax.Array:
    """The bits of ``|g|`` in the accumulation dtype, as signed integers: non-negative floats
    order like their bit patterns. Every NaN ranks as the largest, above ``inf``, as in
    ``torch.topk`` (:func:`_top_bits`).

    Integer operations only (the sign bit cleared, NaN patterns lowered to the one above
    ``inf``'s): a float ``abs`` or comparison that XLA:CPU fuses into a kernel with the bit
    patterns' comparisons reads a subnormal as 0, which would rank it with the zeros."""
    wide = g.astype(norms.acc_dtype(g.dtype))
    bits = jax.lax.bitcast_convert_type(wide, norms.int_type(wide.dtype))
    ones = np.iinfo(bits.dtype).max            # every bit but the sign
    return jnp.minimum(bits & jnp.asarray(ones, bits.dtype),
                       jnp.asarray(_top_bits(bits), bits.dtype))


def _row_count(flags: jax.Array) -> jax.Array:
    """How many ``flags`` are set along the last axis (keepdims): :func:`_local_count`."""
    return _local_count(flags, (flags.ndim - 1,))


def _local_count(flags: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """How many ``flags`` are set over ``axes`` (keepdims): summed in float32 (exact up to
    2**24, and XLA:CPU adds floats about twice as fast as integers), int32 for larger slices.

    The float sum takes the flags as bfloat16 (0 and 1 exactly; the sum is still float32):
    XLA:CPU writes the flags out for its reduction kernel, and at half the bytes of float32
    a count takes about 0.6x the time (measured on a 2-core CPU).
    """
    dtype = _count_dtype(math.prod(flags.shape[a] for a in axes))
    if dtype == jnp.float32:
        flags = flags.astype(jnp.bfloat16)
    return jnp.sum(flags, axis=axes, keepdims=True, dtype=dtype)


def _count_dtype(size: int) -> jnp.dtype:
    return jnp.dtype(jnp.float32 if size <= 1 << 24 else jnp.int32)


def _largest(lows: list, widths: list, counts: list, wanted: list, counted: list
             ) -> tuple[list, list]:
    """Per row of every array (or stacked group of arrays: entry ``i`` of each list is one),
    the largest ``v`` in ``[low, low + width)`` with ``count(v) >= wanted``, and that count, by
    bisection: each ``count`` must fall as ``v`` grows, and ``counted = count(low)`` must reach
    ``wanted``. ``ceil(log2(width))`` rounds of one ``count`` each, in one loop per number of
    rounds; round ``r`` tries adding the bit ``2**(rounds - 1 - r)`` to ``v`` (a scalar step:
    no per-row division)."""
    rounds = [(w - 1).bit_length() for w in widths]
    found, found_count = list(lows), list(counted)
    for n in sorted(set(rounds)):
        group = [i for i, r in enumerate(rounds) if r == n]

        def grow(r, carry, group=group, n=n):
            out = []
            for i, (low, best) in zip(group, carry):
                # jnp.asarray, not .astype: under jax.disable_jit() ``r`` is a Python int.
                middle = low + jnp.left_shift(jnp.asarray(1, low.dtype),
                                              jnp.asarray(n - 1 - r, low.dtype))
                at_middle = counts[i](middle)
                enough = at_middle >= jnp.asarray(wanted[i]).astype(at_middle.dtype)
                out.append((jnp.where(enough, middle, low), jnp.where(enough, at_middle, best)))
            return out

        start = [(lows[i], counted[i]) for i in group]
        for i, (low, best) in zip(group, jax.lax.fori_loop(0, n, grow, start)):
            found[i], found_count[i] = low, best
    return found, found_count


def _count(flags: jax.Array, axes: tuple[int, ...], split: tuple[str, ...]) -> jax.Array:
    """Per slice (keepdims), how many ``flags`` are set on all devices along ``split``: each
    device's :func:`_local_count`, added across devices as int32."""
    return norms.across(_local_count(flags, axes).astype(jnp.int32), "sum", split)


def split_top_k(g: jax.Array, axes: tuple[int, ...], k: int | jax.Array,
                split: tuple[str, ...]) -> jax.Array:
    """Whether each entry of ``g`` is among the ``k`` largest ``|g|`` of its slice (``g``'s
    shape), for slices split over the mesh axes ``split`` (inside ``shard_map``/``pmap``),
    without gathering them.

    The ``k``-th largest magnitude of each whole slice is found by a bisection on the bits of
    ``|g|`` (non-negative floats order like their bit patterns): each of the 31 rounds (63 for
    float64) counts the entries at or above a candidate on every device and adds the counts
    across devices (one ``psum`` of one int32 per slice). Entries above it are kept, and of the
    entries equal to it, the first ones in (device index along ``split``, local index) order
    until exactly ``k`` are kept: the global lowest-index rule when the named axes split the
    slice's leading axis (as an FSDP layout does). ``axes`` are trailing (as ``param_ndim``
    gives them).
    """
    bits = magnitude_bits(g)
    k = jnp.asarray(k, jnp.int32)
    top = _top_bits(bits) + 1

    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        enough = _count(bits >= middle, axes, split) >= k
        return jnp.where(enough, middle, low), jnp.where(enough, high, middle)

    # Start from the counts and k, so that the loop's carry has the device-variance type its
    # results have.
    start = (_count(bits >= 0, axes, split) * 0 + k * 0).astype(bits.dtype)
    kth, _ = jax.lax.fori_loop(0, top.bit_length(), halve, (start, start + top))
    above, ties = bits > kth, bits == kth
    wanted = k - _count(above, axes, split)
    local_ties = jnp.sum(ties, axis=axes, keepdims=True, dtype=jnp.int32)
    every_device = jax.lax.all_gather(local_ties, split)
    devices = jnp.arange(every_device.shape[0]).reshape((-1,) + (1,) * g.ndim)
    earlier = jnp.sum(jnp.where(devices < jax.lax.axis_index(split), every_device, 0), axis=0)
    rows = ties.reshape(*ties.shape[:g.ndim - len(axes)], -1)
    rank = earlier + jnp.cumsum(rows, axis=-1, dtype=jnp.int32).reshape(g.shape)
    return (above | (ties & (rank <= wanted))) & (k > 0)


def static_k(q: float, size: int) -> int:
    """``round((1 - q) * D)`` in double precision, half to even."""
    return round((1.0 - float(q)) * size)


def traced_k(q: jax.Array, size: Any) -> jax.Array:
    """``round((1 - q) * D)`` on device, half to even, in float64 under x64 else float32 (for
    one ``q`` and size ``D``, or elementwise for a vector of each)."""
    wide = norms.stat_dtype()
    return jnp.round((1 - q.astype(wide)) * size).astype(jnp.int32)


def top_q_kept(g: jax.Array, axes: tuple[int, ...], k: int | jax.Array,
               split: tuple[str, ...] = ()) -> jax.Array:
    """``g`` with all but the ``k`` largest-``|g|`` entries of every slice set to zero
    (slices split over the mesh axes ``split``, as in :func:`split_top_k`)."""
    return top_q_kept_leaves([g], [axes], [k], [split])[0]


def top_q_kept_leaves(leaves: list, axes_of: list, k_of: list, split_of: list) -> list:
    """:func:`top_q_kept` of every leaf (``None`` axes: the leaf is returned as it is); the
    slices that lie whole on each device are ranked together (:func:`top_k_masks`)."""
    out = list(leaves)
    local = []
    for i, (g, axes, k, split) in enumerate(zip(leaves, axes_of, k_of, split_of, strict=True)):
        if axes is None:
            continue
        size = axes_lib.slice_size(g.shape, axes) * norms.axes_size(split)
        if isinstance(k, int) and k <= 0:
            out[i] = jnp.zeros_like(g)
        elif isinstance(k, int) and k >= size:
            out[i] = g
        elif split:
            out[i] = jnp.where(split_top_k(g, axes, k, split), g, jnp.zeros_like(g))
        else:
            local.append(i)
    for group in _cache_groups(local, [leaves[i].size for i in local]):
        masks = top_k_masks([slice_rows(leaves[i], axes_of[i]) for i in group],
                            [k_of[i] for i in group])
        for i, mask in zip(group, masks):
            out[i] = jnp.where(slice_mask(mask, leaves[i]), leaves[i], jnp.zeros_like(leaves[i]))
    return out


# Leaves are ranked in groups of about this many entries, each group by its own loop: every
# round of a loop reads its leaves again, from the cache where they fit (measured on a 2-core
# CPU with a 32 MiB L3: one loop for all of a GPT-2-sized tree steps about 1.7x slower than one
# loop per large leaf); small leaves share one loop (one loop body to compile).
RANK_GROUP_ENTRIES = 1 << 20


def _cache_groups(items: list, sizes: list) -> list:
    """``items`` in order, cut into consecutive groups of at most ``RANK_GROUP_ENTRIES``
    entries (a larger item is a group of its own)."""
    groups: list[list] = []
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if not groups or total + size > RANK_GROUP_ENTRIES:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size
    return groups


def l1q(g: jax.Array, axes: tuple[int, ...], k: int | jax.Array, eps: Any,
        split: tuple[str, ...] = ()) -> jax.Array:
    """Top-k, sign, L1-normalize: ``±1/c`` on the ``c`` non-zero kept entries (:func:`normalized`
    of the signs, whose L1 norm ``c`` is an exact count: never rescaled)."""
    return l1q_leaves([g], [axes], [k], [split], eps)[0]


def l1q_leaves(leaves: list, axes_of: list, k_of: list, split_of: list, eps: Any) -> list:
    """:func:`l1q` of every leaf (``None`` axes: returned as it is), ranked together as in
    :func:`top_q_kept_leaves`."""
    kept = top_q_kept_leaves(leaves, axes_of, k_of, split_of)
    return [g if axes is None else
            (_wide(sign(x)) / _divisor(_kept_nonzero(g, axes, k, split), eps)).astype(g.dtype)
            for g, x, axes, k, split in zip(leaves, kept, axes_of, k_of, split_of, strict=True)]


def _kept_nonzero(g: jax.Array, axes: tuple[int, ...], k: int | jax.Array,
                  split: tuple[str, ...]) -> jax.Array:
    """How many non-zero entries the top ``k`` of each slice of ``g`` keeps (keepdims, wide
    dtype), as a sum of the kept entries' ``|sign|`` would count them: ``min(k, n)`` for the
    ``n`` non-zero entries of the slice (added across the mesh axes ``split`` the slices are
    split over), 0 for ``k = 0``, NaN where the slice holds a NaN.

    The top ``k`` keeps exactly ``k`` entries, all non-zero where the slice has ``k`` or more
    non-zero entries, and every non-zero entry where it has fewer. A NaN ranks first, so it is
    kept. Where XLA reads a subnormal as 0 (XLA:CPU), both the signs and ``n`` take it as 0:
    a slice whose ``k``-th largest magnitude is subnormal keeps all its ``n`` normal entries
    and counts ``n < k``.

    Counted from the slice itself, not from its kept entries: the count then reads the
    gradient once (one XNNPACK reduction on a CPU), where a count of the kept signs would
    share them with the output and have XLA write them out as an array and read them back.
    """
    n = norms.across(jnp.sum(jnp.abs(jnp.sign(_wide(g))), axis=axes, keepdims=True), "sum",
                     split)
    return jnp.where(jnp.asarray(k) > 0, jnp.minimum(jnp.asarray(k, n.dtype), n), 0)


def logged_q(q: Any, dtype: Any) -> jax.Array:
    """``q`` as drawn (float32, as torch), stored in the statistics dtype ``dtype`` (float64
    when the tree has a float64 leaf, like every statistic; exact)."""
    return jnp.asarray(q, jnp.float32).astype(dtype)


class DropFraction:
    """Static-or-drawn ``q`` per leaf and the matching ``k``.

    The state keeps both as per-leaf vectors (:mod:`optclip._core.leafvec`): ``q`` in the
    tree's statistics dtype, ``k`` as int32."""

    def __init__(self, q: Any, dq: Any, seed: int):
        self.q, self.dq, self.seed = q, dq, seed
        self.static = is_number(q) and is_number(dq) and dq == 0

    def init(self, params: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The key, and the ``q``/``k`` vectors holding ``q`` and 0 until the first step."""
        key = jax.random.PRNGKey(self.seed)
        q = leafvec.full(params, logged_q(self.q, norms.stat_dtype(params)))
        return key, q, leafvec.full(params, 0, jnp.int32)

    def draw(self, key: jax.Array, leaves: list, sizes: list
             ) -> tuple[jax.Array, jax.Array, jax.Array, list]:
        """``(new key, q vector, k vector, k per leaf)`` for flattened ``leaves`` whose slices
        hold ``sizes`` entries (``None`` for non-float leaves): the vectors for the state, one
        entry per float leaf; ``k`` per leaf for the ranking (``None`` at other leaves), Python
        ints when ``q`` is static."""
        floats = [i for i, x in enumerate(leaves) if norms.is_float(x)]
        dtype = norms.stat_dtype(leaves)
        k_of: list[Any] = [None] * len(leaves)
        if self.static:
            for i in floats:
                k_of[i] = static_k(self.q, sizes[i])
            return (key, jnp.full((len(floats),), logged_q(self.q, dtype)),
                    jnp.asarray([k_of[i] for i in floats], jnp.int32), k_of)
        key, subkey = jax.random.split(key)
        u = jax.random.uniform(subkey, (len(floats),), jnp.float32)
        q = jnp.asarray(self.q, jnp.float32)
        dq = jnp.asarray(self.dq, jnp.float32)
        q_lo = jnp.maximum(q - dq, 0.0)
        q_hi = jnp.minimum(q + dq, 1.0)
        # One float32 q per leaf: q_lo + (q_hi - q_lo) * u, as torch forms it. k in the widest
        # float available (the reference uses double; float32 can differ only at exact .5).
        q_t = (q_hi - q_lo) * u + q_lo
        k = traced_k(q_t, np.asarray([sizes[i] for i in floats], norms.stat_dtype()))
        for i, (k_i,) in zip(floats, handout.rows((k,))):
            k_of[i] = k_i
        return key, logged_q(q_t, dtype), k, k_of


def bounds_at(count: jax.Array, low: Any, high: Any) -> tuple[Any, Any]:
    """Float-or-schedule bounds (``None``: unbounded) resolved at ``count``."""
    return tuple(None if b is None else checks.resolve(b, count, name=name)
                 for b, name in ((low, "clamp_min"), (high, "clamp_max")))


def clamped_leaves(tree: Any, low: Any, high: Any, axis_name: norms.AxisName
                   ) -> tuple[Any, jax.Array, jax.Array]:
    """``(clip(tree, low, high), moved, finite)``: with ``moved`` one bool per float leaf, in
    leaf order (whether any element changed, on any device along ``axis_name``) and whether
    every float element is finite (on every device along ``axis_name``), from one reduction of
    each leaf (:func:`excess_flags`). ``moved`` is only meaningful on a finite step (where it
    is not, the step is not committed). The clamp waits for the check: with donated gradients
    XLA would otherwise copy every leaf to keep it for the reductions."""
    moved, local = excess_flags(jax.tree.leaves(tree), low, high, axis_name)
    finite = norms.all_true(local, axis_name)
    low, high = stats.after(finite, (low, high))
    return norms.float_map(lambda x: clip(x, low, high), tree), moved, finite


def excesses(arrays: list[jax.Array], low: Any, high: Any, computed: bool = False
             ) -> list[jax.Array]:
    """Per array, ``Σ (max(x - high, 0) + max(low - x, 0) + (x - x))`` in the wide dtype
    (``None``: no bound): positive (``inf`` included) exactly when some element lies outside
    ``[low, high]``, NaN exactly when some element is NaN or infinite. One reduction of
    arithmetic only, which XLA:CPU fuses into a single read (a comparison would write a mask
    out first); small arrays of one shape share it (``norms.leaf_reductions``: one kernel for
    them all, where a reduction per array costs XLA:CPU up to three, its input written out and
    the sum split in two). Under flush-to-zero, a difference from a bound below ``2**-126``
    counts as none, as it does for the clamp itself.

    ``computed``: the arrays are computed in the step from a value another kernel reads too (a
    projection's ``params + u``, ``u`` the update of the optimizer before it). XLA:CPU's
    XNNPACK reduction takes in only operations no other kernel reads, so it would have ``u``
    written out first and read back (a temporary the size of the leaf, every step); a large
    array of two or more axes is then reduced row by row instead, the excess and the NaN
    marks side by side (a variadic reduce: XLA:CPU's own loop, with the computation of ``u``
    fused in), and the rows summed. On raw inputs XNNPACK's reduction is the faster one. Only
    where a single device is visible: XLA's SPMD partitioner gathers the operands of a variadic
    reduce over a sharded axis (a leaf split by columns would have its rows' partial sums
    gathered instead of one scalar added across devices).
    """
    if not computed or not norms._may_group():
        return norms.leaf_reductions(arrays, lambda x: _excess_terms(x, low, high))
    by_rows = [x.ndim >= 2 and x.size > norms.GROUP_MAX_ELEMENTS for x in arrays]
    rest = iter(excesses([x for x, r in zip(arrays, by_rows) if not r], low, high))
    return [_row_excess(x, low, high) if r else next(rest) for x, r in zip(arrays, by_rows)]


def _row_excess(x: jax.Array, low: Any, high: Any) -> jax.Array:
    """:func:`excesses` of one array, reduced over its last axis first (see there)."""
    wide = x.astype(norms.acc_dtype(x.dtype))
    zero = jnp.zeros((), wide.dtype)
    low, high = (None if b is None else jnp.asarray(b).astype(wide.dtype) for b in (low, high))
    excess = _plus_excess(zero, wide, low, high, zero)
    rows = jax.lax.reduce((jnp.broadcast_to(excess, wide.shape), stats.nan_marks(wide)),
                          (zero, zero), norms._add_pairs, (wide.ndim - 1,))
    return jnp.sum(rows[0]) + jnp.sum(rows[1])


def excess_flags(leaves: list, low: Any, high: Any, axis_name: norms.AxisName,
                 computed: bool = False) -> tuple[jax.Array, jax.Array]:
    """From one :func:`excesses` sum per float leaf of ``leaves`` (``computed``: as there): one
    bool per float leaf, in leaf order, whether any element lies outside ``[low, high]`` on any
    device along ``axis_name`` (meaningful on a finite step only), and whether every float
    element on this device is finite. Both are read off one vector of the sums (a comparison
    per leaf would cost a kernel per leaf)."""
    floats = [x for x in leaves if norms.is_float(x)]
    if not floats:
        return jnp.zeros((0,), bool), jnp.asarray(True)
    sums = norms.gather_scalars(excesses(floats, low, high, computed))
    return norms.any_true(sums != 0, axis_name), jnp.all(~jnp.isnan(sums))


def _excess_terms(x: jax.Array, low: Any, high: Any) -> jax.Array:
    """The summands of :func:`excesses`, in the wide dtype."""
    # The bounds and the zero pass through a barrier with the leaf (norms.apart).
    bounds = [None if b is None else jnp.asarray(b).astype(x.dtype) for b in (low, high)]
    x, (low, high), zero = norms.apart(x, bounds, jnp.zeros((), x.dtype))
    return _plus_excess(stats.nan_marks(x), x, low, high, zero).astype(norms.acc_dtype(x.dtype))


def _plus_excess(terms: jax.Array, x: jax.Array, low: Any, high: Any, zero: jax.Array
                 ) -> jax.Array:
    """``terms + max(x - high, 0) + max(low - x, 0)`` with the bounds in ``x``'s dtype
    (``None``: no bound): how far each element lies outside ``[low, high]``."""
    if high is not None:
        terms = terms + jnp.maximum(x - high, zero)
    if low is not None:
        terms = terms + jnp.maximum(low - x, zero)
    return terms


def clip(x: jax.Array, low: Any, high: Any) -> jax.Array:
    low = None if low is None else jnp.asarray(low).astype(x.dtype)
    high = None if high is None else jnp.asarray(high).astype(x.dtype)
    return jnp.clip(x, low, high)


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
    globally for a zero update).
    """
    if eps is not None:
        return target / (norm + eps)
    return jnp.where(norm > norms.TINY_NORM, target / jnp.where(norm > norms.TINY_NORM, norm, 1), 1)


def _whole_leaf_factors(leaves: list[jax.Array], ord: float | str,
                        multiplier: Callable[[jax.Array], jax.Array],
                        axis_name: norms.AxisName) -> list[tuple[jax.Array, jax.Array]]:
    """``(multiplier(norm), norm)`` per leaf, each 0-d in the leaf's wide dtype.

    Where all leaves share one wide dtype, the norms form one vector, the multiplier runs once
    on it, and :func:`optclip._core.handout.rows` hands each leaf its pair: a fixed number of
    kernels per group of leaves instead of a factor computation per leaf.
    """
    if not norms.one_wide_dtype(leaves):
        each = _leaf_norms(leaves, ord, axis_name)
        return [(multiplier(n), n) for n in each]
    if ord == 2.0:
        vector = norms.leaf_l2_norms(leaves, axis_name, vector=True)
    else:
        vector = norms.gather_scalars(_leaf_norms(leaves, ord, axis_name))
    return handout.rows((multiplier(vector), vector))


def _leaf_norms(leaves: list[jax.Array], ord: float | str, axis_name: norms.AxisName
                ) -> list[jax.Array]:
    """:func:`optclip._core.norms.leaf_norms`; for ``'std'`` the same values from
    :func:`optclip._core.norms.slice_stds` (the deviations are not written out, and their
    scaled sums are taken only on a step where a plain sum overflowed)."""
    if ord != "std":
        return norms.leaf_norms(leaves, ord, axis_name)
    items = [(x, tuple(range(x.ndim)), split)
             for x, split in zip(leaves, norms.split_axes(leaves, axis_name))]
    return [n.reshape(()) for n in norms.slice_stds(items)]


def scale_slices(
    tree: Any,
    ord: float | str,
    multiplier: Callable[[jax.Array], jax.Array],
    *,
    dim: axes_lib.Dim = None,
    inverse_dims: bool = False,
    min_size: int = 1,
    param_ndim=axes_lib._UNSET,
    axis_name: norms.AxisName = None,
) -> tuple[Any, Any]:
    """Scale every slice by ``multiplier(norm)``; returns ``(scaled tree, norms tree)``.

    With ``dim='global'`` all leaves form one slice: one global norm (a scalar) and one factor.
    Otherwise norms come back per leaf in the wide dtype with the reduced axes squeezed out.
    Leaves that the axes rule leaves alone (no axes, or slices smaller than ``min_size``) are
    returned unchanged with a 0-d zero norm; non-float leaves pass through with a ``None`` norm.
    ``axis_name``: the mesh axes (inside ``shard_map``/``pmap``) a leaf's reduced axes are
    split over; per-slice partial reductions are combined across them. ``param_ndim`` (instead
    of ``dim``) may be per leaf like ``dim`` (:func:`optclip._core.axes.leaf_param_ndims`).
    """
    if dim == axes_lib.GLOBAL:
        norm = norms.global_norm(tree, ord, axis_name)
        factor = multiplier(norm)
        return jax.tree.map(lambda x: norms.scale(x, factor), tree), norm

    def leaf_axes(x, leaf_dim, leaf_param_ndim):
        if not norms.is_float(x):
            return None
        axes = axes_lib.reduction_axes(x.ndim, leaf_dim, inverse_dims, param_ndim=leaf_param_ndim)
        if axes is None:
            return None
        size = axes_lib.slice_size(x.shape, axes) * norms.axes_size(leaf_split(x, axes))
        return None if size < min_size else axes

    def leaf_split(x, axes):
        # One-element slices (no reduced axes) are never split across devices.
        return norms.split_axes([x], axis_name)[0] if axes else ()

    def one_leaf(x, axes, whole, norm):
        if not norms.is_float(x):
            return x, None
        if axes is None:
            return x, jnp.zeros((), norms.acc_dtype(x.dtype))
        if whole is not None:  # (factor, norm) of a whole-leaf slice
            return norms.scale(x, whole[0]), whole[1]
        if norm is None:
            norm = norms.slice_norm(x, ord, axes, leaf_split(x, axes))
        return norms.scale(x, multiplier(norm)), jnp.squeeze(norm, axis=axes)

    leaves, treedef = jax.tree.flatten(tree)
    ndims = ([param_ndim] * len(leaves) if param_ndim is axes_lib._UNSET
             else axes_lib.leaf_param_ndims(param_ndim, tree))
    plan = [leaf_axes(x, d, k) for x, d, k in zip(leaves, axes_lib.leaf_dims(dim, tree), ndims)]
    # Whole-leaf slices (at least one reduced axis) are measured together (one overflow test
    # for all of them) and their factors taken on one vector (:func:`_whole_leaf_factors`).
    whole = [i for i, (x, axes) in enumerate(zip(leaves, plan))
             if axes and axes == tuple(range(x.ndim))]
    measured = dict(zip(whole, _whole_leaf_factors([leaves[i] for i in whole], ord, multiplier,
                                                   axis_name)))
    # L2 norms and standard deviations of partial slices (rows, columns) together too: each leaf
    # read once (twice for 'std'), the scaled sums only on a step where some plain sum
    # overflowed (one test for all of them).
    partial = [i for i, (x, axes) in enumerate(zip(leaves, plan))
               if ord in (2.0, "std") and axes and i not in measured and norms.is_float(x)]
    together = norms.slice_l2_norms if ord == 2.0 else norms.slice_stds
    sliced = dict(zip(partial, together(
        [(leaves[i], plan[i], leaf_split(leaves[i], plan[i])) for i in partial])))
    results = [one_leaf(x, axes, measured.get(i), sliced.get(i))
               for i, (x, axes) in enumerate(zip(leaves, plan))]
    return tuple(treedef.unflatten([r[i] for r in results]) for i in range(2))
