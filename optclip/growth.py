"""Growth clippers: bound each update by the previous one.

References: torchzero 0.4.4 ``ClipValueGrowth`` and ``ClipNormGrowth``, with the
parameter names of torchzero's documented API (``parameterwise``).

The stored reference (the previous update per element, or its norm) is kept in float32 for
bf16/f16 leaves (float64 for float64 leaves). A step whose updates are not finite leaves the
state as it was, so the next finite step is compared with the last finite one; ``nonfinite``
counts such steps.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip._core import checks, handout, leafvec, norms, trees
from optclip._core import stats as stats_lib
from optclip._core.norms import AxisName, Ord

__all__ = ["ClipNormGrowthState", "ClipValueGrowthState", "clip_norm_growth",
           "clip_value_growth"]

# torchzero floors the elementwise growth ratio here.
_MIN_RATIO = 1e-8


@stats_lib.diagnostic("clip_value_growth", ("max_ratio", "clipped", "nonfinite"),
                      per_leaf=("max_ratio", "clipped"))
class ClipValueGrowthState(NamedTuple):
    count: jax.Array      # int32 finite steps taken (0: the next finite step is stored as is)
    prev: Any             # per leaf: the reference update (a tree, leaf shape, float32 or
                          # wider)
    max_ratio: jax.Array  # (F,) per leaf: largest |x| / max(|prev|, min_value) of the last step
    clipped: jax.Array    # (F,) per leaf: bool, whether any element was limited
    nonfinite: jax.Array  # int32 steps whose updates were not finite (state left unchanged)


_NORM_FIELDS = ("norm", "prev_norm", "divisor", "clipped", "nonfinite")


@stats_lib.diagnostic("clip_norm_growth", _NORM_FIELDS)
class ClipNormGrowthState(NamedTuple):
    """State of :func:`clip_norm_growth`: with ``parameterwise=True`` one value per floating
    leaf, each field one vector of shape ``(F,)`` (entry ``j`` for the ``j``-th floating leaf
    of ``jax.tree.leaves(params)``; :func:`optclip.per_leaf` gives a tree); one scalar each
    with ``parameterwise=False``. ``optclip.stats`` summarises the vectors and reports the
    scalars as they are."""

    count: jax.Array
    prev_norm: jax.Array  # (F,) per leaf, or a scalar: the reference norm for the next step
    norm: jax.Array       # (F,) per leaf, or a scalar: norm of the last finite update
    divisor: jax.Array    # (F,) per leaf, or a scalar: what that update was divided by
    clipped: jax.Array    # (F,) per leaf, or a scalar: bool, divisor > 1
    nonfinite: jax.Array


def _check_growth_args(add, mul, min_value, max_decay) -> None:
    checks.non_negative("add", add, allow_none=True, allow_schedule=True)
    checks.positive("mul", mul, allow_none=True, allow_schedule=True)
    checks.positive("min_value", min_value, allow_none=True, allow_schedule=True)
    checks.positive("max_decay", max_decay, allow_none=True, allow_schedule=True)


class _Limits(NamedTuple):
    """``add``, ``mul``, ``min_value``, ``max_decay`` at one step (``None``: not used)."""
    add: Any
    mul: Any
    min_value: Any
    max_decay: Any


def _limits_at(count: jax.Array, *values) -> _Limits:
    """Each float-or-schedule limit (in :class:`_Limits`'s order) resolved at ``count`` (the
    number of finite steps)."""
    return _Limits(*(None if v is None else checks.resolve(v, count, name=name)
                     for v, name in zip(values, _Limits._fields, strict=True)))


def _may_overflow(max_decay) -> bool:
    """Whether the decayed reference can grow (``max_decay`` below 1, or a schedule)."""
    return max_decay is not None and not (isinstance(max_decay, (int, float))
                                          and max_decay >= 1)


def _const(value, like: jax.Array) -> jax.Array:
    return jnp.asarray(value).astype(like.dtype)


def clip_value_growth(
    add: float | None = None,
    mul: float | None = 1.5,
    min_value: float | None = 1e-4,
    max_decay: float | None = 2.0,
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Limit how fast each element of the updates may grow relative to the previous update.

    The first update passes unchanged and becomes the reference ``p``. Then, elementwise::

        if add:  |x| <- min(|x|, |p| + add)                  (sign kept)
        m = max(|p|, min_value);  r = max(|x| / m, 1e-8)     (measured before the next line)
        if mul and r > mul:  x <- x / (r / mul)              (so |x| = mul * m)
        p <- p / max_decay  if r < 1 / max_decay  else x     (the reference decays slowly)

    With ``add`` and ``mul`` both ``None`` the transform is the identity.

    Each limit (``add``, ``mul``, ``min_value``, ``max_decay``) takes a number or an optax
    schedule ``count -> value``, ``count`` being the number of finite steps taken.

    Args:
      add: ``>= 0`` or ``None``: additive cap, ``|x| <= |p| + add``.
      mul: ``> 0`` or ``None``: multiplicative cap, ``|x| <= mul * max(|p|, min_value)``.
      min_value: ``> 0`` or ``None``: floor of the reference magnitude in the multiplicative cap
        and the decay test. Without it an element whose reference is 0 stays 0.
      max_decay: ``> 0`` or ``None``: the reference shrinks by at most this factor per step
        (the decayed reference keeps its sign and is not floored).
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split
        over: the per-leaf diagnostics and the skip decision for non-finite steps are combined
        across devices (the limit itself is elementwise).

    Returns:
      An ``optax.GradientTransformation`` whose state logs, per leaf, the largest growth ratio
      ``max_ratio`` (before the multiplicative cap) and ``clipped``, each one vector over the
      floating leaves (:func:`optclip.per_leaf` gives a tree), and ``nonfinite``.

    References:
      torchzero ``ClipValueGrowth``; same numbers as 0.4.4. A
      non-finite step leaves the reference unchanged.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.clip_value_growth()
      >>> state = tx.init(jnp.zeros(4))
      >>> for g in ([1.0, -2.0, 0.0, 1e-5], [3.0, -1.0, 5.0, 1.0]):
      ...     out, state = tx.update(jnp.array(g), state)
      ...     print(out.round(5).tolist())
      [1.0, -2.0, 0.0, 1e-05]
      [1.5, -1.0, 0.00015, 0.00015]
    """
    _check_growth_args(add, mul, min_value, max_decay)
    norms.check_axis_name(axis_name)
    identity = add is None and mul is None
    steep = checks.is_concrete_number(mul) and mul >= _MIN_RATIO
    mild = checks.is_concrete_number(max_decay) and max_decay * _MIN_RATIO < 0.5
    # The new reference read from the output (:func:`_reference_of`) where that is exact.
    from_output = not identity and (
        mul is None or max_decay is None or (checks.is_concrete_number(mul) and mul >= 1))

    def init_fn(params):
        prev = stats_lib.zeros_like_params(lambda t: jax.tree.map(
            lambda x: x.astype(norms.acc_dtype(x.dtype)) if norms.is_float(x) else None, t),
            params)
        zero = jnp.zeros([], jnp.int32)
        return stats_lib.own_buffers(ClipValueGrowthState(
            zero, prev, leafvec.full(params, 1.0), leafvec.full(params, False, jnp.bool_),
            zero))

    def leaves_stats(xs, prevs, hp):
        """Per floating leaf, ``(local sum, combined reductions)`` (:func:`_values_stats`)."""
        if identity:    # a ratio of 1 that limits nothing
            sums = norms.leaf_reductions(xs, stats_lib.nan_marks)
            return [(t, (jnp.ones((), p.dtype), t)) for t, p in zip(sums, prevs)]
        return _values_stats(xs, prevs, hp, axis_name)

    def finite_of(total):
        """Whether a leaf's update is finite, from its local sum: ``sum(x - x)`` is 0, the
        marked excess (with ``add``) is not NaN."""
        return total == 0 if add is None else jnp.isfinite(total)

    def update_fn(updates, state, params=None):
        del params
        first = state.count == 0
        hp = _limits_at(state.count, add, mul, min_value, max_decay)
        leaves, (prevs,), treedef = trees.flatten_with(updates, state.prev)
        floats = [i for i, x in enumerate(leaves) if norms.is_float(x)]
        measured = dict(zip(floats, leaves_stats([leaves[i] for i in floats],
                                                 [prevs[i] for i in floats], hp)))
        # The leaves' reductions gathered into vectors, one per statistics dtype: every flag
        # is taken once, on them, and each leaf is handed its own (no kernel per leaf). A
        # leaf counts as finite where it is so on every device along ``axis_name``.
        group_list = leafvec.groups(leaves)
        gathered = [tuple(norms.gather_scalars([pick(measured[i]) for i in group.leaves])
                          for pick in (lambda s: s[0], lambda s: s[1][0], lambda s: s[1][1]))
                    for group in group_list]
        finite = [norms.all_true(finite_of(local), axis_name) for local, _, _ in gathered]
        ok = stats_lib.all_of([jnp.all(f) for f in finite])
        changed_of = {}
        for group, (_, m, total), leaf_finite in zip(group_list, gathered, finite):
            ratio, limited = _ratio_flags(m, total, hp)
            changed = limited | ~leaf_finite
            if hp.mul is None:   # the same flag (a NaN ratio: a NaN update), now read after
                changed = changed | jnp.isnan(ratio)    # the ratio's reduction (see below)
            for i, (flag,) in zip(group.leaves, handout.rows((changed,))):
                changed_of[i] = flag

        def step(i):
            return _value_step(leaves[i], prevs[i], first, hp, changed_of[i], steep, mild)

        if _may_overflow(max_decay):    # a reference growing by 1 / max_decay per step
            stepped = {i: step(i) for i in floats}
            ok = ok & stats_lib.all_finite([stepped[i][1] for i in floats], axis_name)
            outs = [stepped[i][0] for i in floats]
            news = [jnp.where(ok, stepped[i][1], prevs[i]) for i in floats]
        else:
            # One gate (lax.cond; a select on a GPU) on the step's finiteness writes every
            # reference (a held step hands the old ones back untouched).
            # Where the reference is read back from the output (a leaf of the reference's
            # dtype, limits known to allow it: ``from_output``), the gate also writes the
            # output, and a held step hands back the update itself in its place: XLA then
            # writes the output over the donated update (on a CPU a temporary the size of the
            # leaf, new every step, faults in every page: about 2x adam's step on a
            # GPT-2-shaped tree). After the gate, a held step's output is the limit of the
            # update (handed back) against the old reference (kept), which adam's kernels
            # compute as they read the output (a select on the scalar flag).
            # Elsewhere the output leaves through the gate from both branches: it is computed
            # where the reference is read, before it is written over, and the optimizer after
            # this transform reads it instead of computing it again from the update and the old
            # reference (XLA would then copy both first, to write the new reference over the
            # donated buffer). Every output reads the leaf's flag, so the reductions over the
            # update and the old reference come before them.
            # A float32 leaf (the output has the reference's dtype) takes the reference
            # from its output.
            reads_output = {i: from_output and leaves[i].dtype == prevs[i].dtype
                            for i in floats}
            direct = [i for i in floats if reads_output[i]]
            rest = [i for i in floats if not reads_output[i]]

            def output(i, x, p):
                return _value_output(x, p, first, hp, changed_of[i], steep)

            def run():
                stepped = [step(i) for i in rest]
                direct_outs = [output(i, leaves[i], prevs[i]) for i in direct]
                return [o for o, _ in stepped], [n for _, n in stepped], direct_outs, [
                    _reference_of(o, prevs[i], first, hp, mild)
                    for i, o in zip(direct, direct_outs)]

            def hold():
                return ([step(i)[0] for i in rest], [prevs[i] for i in rest],
                        [leaves[i] for i in direct], [prevs[i] for i in direct])

            rest_outs, rest_news, direct_outs, direct_news = stats_lib.run_or_hold(ok, run, hold)
            held_limited = {i: _select(ok, o, output(i, o, r))
                            for i, o, r in zip(direct, direct_outs, direct_news)}
            out_of = {**dict(zip(rest, rest_outs)), **held_limited}
            new_of = {**dict(zip(rest, rest_news)), **dict(zip(direct, direct_news))}
            outs = [out_of[i] for i in floats]
            news = [new_of[i] for i in floats]
        outputs, new_prev = list(leaves), list(prevs)
        for i, out, new_ref in zip(floats, outs, news):
            outputs[i], new_prev[i] = out, new_ref
        # The state's entries, taken once on the gathered vectors.
        def max_ratio(m, total):
            ratio = _ratio_flags(m, total, hp)[0]
            return jnp.where(first, 1, ratio).astype(ratio.dtype)

        fields = stats_lib.keep_if(ok, (
            leafvec.assemble([max_ratio(m, t) for _, m, t in gathered], group_list,
                             state.max_ratio),
            leafvec.assemble([_ratio_flags(m, t, hp)[1] & ~first for _, m, t in gathered],
                             group_list, state.clipped)),
            (state.max_ratio, state.clipped))
        new = ClipValueGrowthState(
            jnp.where(ok, optax.safe_increment(state.count), state.count),
            treedef.unflatten(new_prev), *fields,
            stats_lib.count_nonfinite(state.nonfinite, ok))
        return treedef.unflatten(outputs), new

    return checks.transformation(init_fn, update_fn, pairs_leaves=True)


def _select(which: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.where(which, a, b)`` for arrays of one shape and dtype (``which`` of that shape or
    a scalar), as one ``lax.select``: the same values, without tracing ``jnp.where`` per leaf."""
    return jax.lax.select(which, a, b)


def _columns(rows: list[list], width: int) -> list[list]:
    """``rows`` (one list of vectors per statistics dtype) as ``width`` columns (one list per
    state field), empty columns for no rows."""
    return [[row[k] for row in rows] for k in range(width)]


def _value_limit(wide: jax.Array, prev: jax.Array, hp: _Limits, steep: bool = False):
    """clip_value_growth, elementwise: ``(limited update, |y| before the multiplicative cap,
    its floor m, additive excess)`` (the excess ``None`` without ``add``).

    The ratio ``r = max(|y| / m, 1e-8)`` is compared as products (``r > mul`` where
    ``|y| > mul m``) and ``y / (r / mul)`` is ``sign(y) mul m``: XLA:CPU never copies an
    elementwise division into several passes, it writes it out first. ``steep``: ``mul`` is
    known to be at least the ratio's floor ``1e-8`` (a number, not a schedule), so the
    floor's case is left out of the trace.
    """
    reference = jnp.abs(prev)
    y, excess = wide, None
    if hp.add is not None:
        excess = jnp.maximum(jnp.abs(wide) - reference, 0) - _const(hp.add, wide)
        y = _select(excess > 0, wide - excess * jnp.sign(wide), wide)
    floor = _floor(reference, hp)
    size = jnp.abs(y)
    if hp.mul is not None:
        m, tiny = _const(hp.mul, y), _const(_MIN_RATIO, y)
        if steep:   # mul >= 1e-8: the ratio's floor never binds where the cap does
            y = _select(size > m * floor, jnp.sign(y) * (m * floor), y)
        else:
            capped = _select(size >= tiny * floor, jnp.sign(y) * (m * floor), y * (m / tiny))
            y = _select((size > m * floor) | (m < tiny), capped, y)
    return y, size, floor, excess


def _values_stats(xs: list[jax.Array], prevs: list[jax.Array], hp: _Limits,
                  axis_name: AxisName) -> list[tuple]:
    """Per leaf, ``(local sum, (largest ratio, sum))`` before anything is written, the two
    reductions combined across devices as :func:`_ratio_flags` reads them (the update is
    finite where the local sum is 0 without ``add``, not NaN with it).

    Two reductions per leaf, each reading its update and reference at most once: the largest
    growth ratio, and a sum that is NaN exactly when an update is not finite and otherwise
    counts the elements the additive cap limits (``sum(x - x)`` of the update without
    ``add``). Small leaves of one shape share each reduction (``norms.leaf_reductions``): one
    kernel for them all instead of several per leaf (XLA:CPU splits a plain reduction of a
    leaf into two kernels and writes its input out first).
    """
    split = norms.split_axes(xs, axis_name)
    maxima = norms.leaf_reductions(
        [_ratios(x, p, hp) for x, p in zip(xs, prevs)], lambda r: r, "max")
    if hp.add is None:
        sums = norms.leaf_reductions([norms.apart(x) for x in xs], stats_lib.nan_marks)
    else:
        sums = norms.leaf_reductions([_marked_excess(x, p, hp) for x, p in zip(xs, prevs)],
                                     lambda t: t)
    stats = []
    for m, total, sp in zip(maxima, sums, split):
        if hp.add is None:
            stats.append((total, (norms.across(m, "max", sp), total)))
        else:   # across devices, the sum as 1 where some device's is ~(t <= 0), else 0
            marks = total if not sp else norms.across(
                (~(total <= 0)).astype(total.dtype), "max", sp)
            stats.append((total, (norms.across(m, "max", sp), marks)))
    return stats


def _ratio_flags(m: jax.Array, total: jax.Array, hp: _Limits) -> tuple[jax.Array, jax.Array]:
    """``(max ratio, limited somewhere)`` from a leaf's combined reductions
    (:func:`_values_stats`), elementwise: of one leaf, or of vectors of them."""
    ratio = jnp.maximum(m, _const(_MIN_RATIO, m))
    limited = jnp.zeros(ratio.shape, bool)
    if hp.mul is not None:     # ~(m <= mul): also where a NaN was kept in the maximum
        limited = ~(ratio <= _const(hp.mul, ratio))
    if hp.add is not None:     # ~(t <= 0): also where the sum is NaN
        limited = limited | ~(total <= 0)
    return ratio, limited


def _marked_excess(x: jax.Array, prev: jax.Array, hp: _Limits) -> jax.Array:
    """Per element, 1 where the additive cap limits the update, else 0; NaN where the update is
    not finite (summed, :func:`_values_stats`'s flags)."""
    w, p, add, zero = norms.apart(x, prev, hp.add, jnp.zeros((), prev.dtype))
    w = w.astype(p.dtype)
    excess = jnp.maximum(jnp.abs(w) - jnp.abs(p), zero) - _const(add, w)
    return w * zero + jnp.sign(jnp.maximum(excess, zero))


def _ratios(x: jax.Array, prev: jax.Array, hp: _Limits) -> jax.Array:
    """``|y| / m`` per element (:func:`_value_limit`), from operations XLA:CPU's reduction
    kernel fuses (no compare or select): the same values as the elementwise limit."""
    w, p, hp, zero, one = norms.apart(x, prev, hp, jnp.zeros((), prev.dtype),
                                      jnp.ones((), prev.dtype))
    w = w.astype(p.dtype)
    reference = jnp.abs(p)
    size = jnp.abs(w)
    if hp.add is not None:     # a zero excess subtracts ±0: the same |y|
        excess = jnp.maximum(size - reference, zero) - _const(hp.add, w)
        size = jnp.abs(w - jnp.maximum(excess, zero) * jnp.sign(w))
    if hp.min_value is None:   # 0/0 (zero reference and update) has no ratio; torchzero
        return size / (reference + (one - jnp.sign(size)))   # leaves it alone: 0 / 1
    return size / jnp.maximum(reference, _const(hp.min_value, w))


def _floor(reference: jax.Array, hp: _Limits) -> jax.Array:
    """``max(|p|, min_value)`` from ``reference = |p|`` (``|p|`` without ``min_value``)."""
    if hp.min_value is None:
        return reference
    return jnp.maximum(reference, _const(hp.min_value, reference))


def _decays(size: jax.Array, floor: jax.Array, hp: _Limits, mild: bool) -> jax.Array:
    """Where the reference decays: ``r < 1 / max_decay`` with ``r = size / floor``, as
    products (``mild``: the ratio's floor ``1e-8`` is known not to decide)."""
    decay = _const(hp.max_decay, size)
    slow = size * decay < floor
    if not mild:
        slow = slow & (decay * _const(_MIN_RATIO, size) < 1)
    return slow


def _chosen(x: jax.Array, wide: jax.Array, y: jax.Array, first: jax.Array,
            changed: jax.Array) -> jax.Array:
    """One leaf's output from the update (``wide``: in the reference's dtype) and its limit
    ``y``: the update where nothing changes (the first step, or no element limited)."""
    return _select(first | ~changed, wide, y).astype(x.dtype)


def _value_output(x: jax.Array, prev: jax.Array, first: jax.Array, hp: _Limits,
                  changed: jax.Array, steep: bool = False) -> jax.Array:
    """One leaf's output (:func:`_chosen`) of the limit :func:`_value_limit`."""
    wide = x.astype(prev.dtype)
    return _chosen(x, wide, _value_limit(wide, prev, hp, steep)[0], first, changed)


def _reference_of(out: jax.Array, prev: jax.Array, first: jax.Array, hp: _Limits,
                  mild: bool = False) -> jax.Array:
    """One leaf's new reference from its output and the old reference: the output, or the old
    reference shrunk by ``max_decay`` where the output is that much smaller than its floor.

    The decay test reads ``|output|`` where :func:`_value_step` reads ``|y|`` before the
    multiplicative cap: the same where the cap did not bind, and false for both where it did
    when ``mul >= 1`` and ``max_decay >= 1`` (the capped ``|output| = mul m >= m``)."""
    if hp.max_decay is None:
        return out
    slow = _decays(jnp.abs(out), _floor(jnp.abs(prev), hp), hp, mild)
    return _select(first, out, _select(slow, prev / _const(hp.max_decay, out), out))


def _value_step(x: jax.Array, prev: jax.Array, first: jax.Array, hp: _Limits,
                changed: jax.Array, steep: bool = False, mild: bool = False):
    """``(output, new reference)`` of one leaf. ``changed`` (a per-leaf flag that holds
    wherever the limit changes an element) makes the output read the leaf's statistics,
    so XLA computes them before it writes over the donated updates. ``steep`` and ``mild``
    say what is known while tracing: ``mul >= 1e-8`` and ``max_decay < 5e7`` (numbers), so
    the ratio's floor ``1e-8`` never decides and its tests are left out (``mild`` with a
    margin for float32 rounding)."""
    wide = x.astype(prev.dtype)
    if hp.add is None and hp.mul is None:   # the identity
        return x, wide
    y, size, floor, _ = _value_limit(wide, prev, hp, steep)
    new_prev = y
    if hp.max_decay is not None:   # r < 1 / max_decay
        new_prev = _select(_decays(size, floor, hp, mild), prev / _const(hp.max_decay, y), y)
    out = _chosen(x, wide, y, first, changed)
    # On the first step the output is the update; where it has the reference's dtype, the
    # reference is taken from the output (the same values), so that XLA computes the output
    # before it writes the new reference over the old one that both read.
    start = out if out.dtype == wide.dtype else wide
    return out, _select(first, start, new_prev)


def clip_norm_growth(
    add: float | None = None,
    mul: float | None = 1.5,
    min_value: float | None = 1e-4,
    max_decay: float | None = 2.0,
    ord: Ord = 2,
    parameterwise: bool = True,
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Limit how fast the norm of the updates may grow relative to the previous norm.

    Per leaf (``parameterwise=True``) or for all leaves as one vector: the first update passes
    unchanged and its norm becomes the reference ``p``. Then, with ``n = ||x||`` and
    ``p' = max(p, min_value)``::

        d = max(1, n / (p' + add), n / (p' * mul))     (terms with a None cap left out)
        x <- x / d
        p <- max(p' / max_decay if n / p' < 1 / max_decay else n / d, min_value)

    so ``||x_out|| <= min(p' + add, p' * mul)``. With ``add`` and ``mul`` both ``None`` the
    transform is the identity.

    Each limit (``add``, ``mul``, ``min_value``, ``max_decay``) takes a number or an optax
    schedule ``count -> value``, ``count`` being the number of finite steps taken.

    Args:
      add: ``>= 0`` or ``None``: additive cap on the norm.
      mul: ``> 0`` or ``None``: multiplicative cap on the norm.
      min_value: ``> 0`` or ``None``: floor of the reference norm. Without it a zero reference
        turns every later update into zeros.
      max_decay: ``> 0`` or ``None``: the reference norm shrinks by at most this factor per step.
      ord: the metric: any number or ``'l0'``-``'l4'``, ``'linf'``, ``'mad'``, ``'std'``,
        ``'var'``, ``'sum'`` (as ``|Σx|``).
      parameterwise: ``True``: each leaf against its own reference; ``False``: all leaves as one
        vector (the global norm combined from per-leaf partial reductions).
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split
        over: norms and the skip decision are combined across devices (``psum``).

    Returns:
      An ``optax.GradientTransformation`` whose state logs the update ``norm``, the reference
      ``prev_norm`` for the next step, the ``divisor`` applied, ``clipped`` and ``nonfinite``;
      per leaf, each field one vector over the floating leaves (:func:`optclip.per_leaf` gives
      a tree), or scalars when ``parameterwise=False``.

    References:
      torchzero ``ClipNormGrowth`` (0.4.4 calls ``parameterwise``
      ``tensorwise``). Differences from torchzero 0.4.4: ``min_value`` floors only the
      reference, not the divisor (which halves small updates when ``min_value > 1``);
      the floor also applies to the first stored norm (a zero first update no longer
      shrinks the second one to zero); ``add=None, mul=None`` is the identity (it crashes
      at the second step); the global mode never concatenates leaves; string ``ord`` values
      work; a non-finite step leaves the reference unchanged.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.clip_norm_growth()
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in ([3.0, 4.0], [30.0, 40.0], [0.3, 0.4]):
      ...     out, state = tx.update(jnp.array(g), state)
      ...     print(out.round(4).tolist(), float(state.prev_norm[0]))  # one leaf
      [3.0, 4.0] 5.0
      [4.5, 6.0] 7.5
      [0.3, 0.4] 3.75
    """
    _check_growth_args(add, mul, min_value, max_decay)
    ord = norms.canonical_ord(ord)
    checks.boolean("parameterwise", parameterwise)
    norms.check_axis_name(axis_name)
    state_cls = ClipNormGrowthState

    group_step = functools.partial(_group_step, ord=ord)

    def update_fn(updates, state, params=None):
        del params
        first = state.count == 0
        hp = _limits_at(state.count, add, mul, min_value, max_decay)
        if not parameterwise:
            floats = norms.float_leaves(updates)
            n, divisor, reference, ok = group_step(
                floats, norms.global_norm(floats, ord, axis_name), state.prev_norm, first, hp)
            new = state_cls(optax.safe_increment(state.count), reference, n, divisor,
                            divisor > 1, state.nonfinite)
            outputs = jax.tree.map(lambda x: norms.scale(x, 1 / divisor), updates)
            return outputs, stats_lib.commit(norms.all_true(ok, axis_name), new, state)
        return _leafwise(updates, state, first, hp, ord, axis_name)

    return checks.transformation(
        lambda params: _norm_growth_init(params, state_cls, parameterwise, ord), update_fn,
        pairs_leaves=parameterwise)


def _leafwise(updates, state: ClipNormGrowthState, first, hp: _Limits, ord, axis_name):
    """clip_norm_growth with ``parameterwise=True``: ``(outputs, committed state)``.

    The norms of the leaves of one statistics dtype form one vector; the divisors, the next
    references and the commit of a finite step are taken on these vectors, which the state
    keeps (:mod:`optclip._core.leafvec`), and :func:`optclip._core.handout.rows` hands each
    leaf only its factor.
    """
    leaves, _, treedef = trees.flatten_with(updates)
    group_list = leafvec.groups(leaves)
    new, flags = [], []
    for group in group_list:
        n, divisor, reference, finite = _vector_step(
            [leaves[i] for i in group.leaves], leafvec.take(state.prev_norm, group), first, hp,
            ord, axis_name)
        new.append([reference, n, divisor])
        flags += finite
    ok = stats_lib.all_of(flags, axis_name)
    fields = [leafvec.assemble(parts, group_list, old) for parts, old in
              zip(_columns(new, 3), (state.prev_norm, state.norm, state.divisor))]
    # ``clipped`` is ``divisor > 1`` in every state that init and update make, so it is read
    # off the committed divisor.
    committed = stats_lib.commit(ok, ClipNormGrowthState(
        optax.safe_increment(state.count), *fields, state.clipped, state.nonfinite), state)
    outputs = list(leaves)
    for group, (_, _, divisor) in zip(group_list, new):
        # A product, not x / d: XLA:CPU fuses it into each pass of the next transform, where
        # it would write a quotient out first (it never copies a division).
        for i, (factor,) in zip(group.leaves, handout.rows((1 / divisor,))):
            if norms.metric_defined(ord, leaves[i].size):   # else the divisor is 1
                outputs[i] = norms.scale(leaves[i], factor)
    return treedef.unflatten(outputs), committed._replace(clipped=committed.divisor > 1)


def _vector_step(xs: list[jax.Array], prev: jax.Array, first, hp: _Limits, ord, axis_name):
    """:func:`_group_step` of each leaf in ``xs`` (one statistics dtype) on vectors with one
    entry per leaf: ``(norms, divisors, next references, finiteness flags)``."""
    measurable = np.array([norms.metric_defined(ord, x.size) for x in xs])
    if ord == 2.0:
        n = norms.leaf_l2_norms(xs, axis_name, vector=True)
    else:
        n = norms.gather_scalars(norms.leaf_norms(xs, ord, axis_name))
    n = n.astype(prev.dtype)
    if measurable.all():
        divisor, reference = _norm_limit(n, prev, first, hp)
    else:
        n = jnp.where(measurable, n, 0)
        divisor, reference = _norm_limit(n, prev, first, hp)
        divisor = jnp.where(measurable, divisor, 1)
        reference = jnp.where(measurable, reference, prev)
    flags = [jnp.all(jnp.isfinite(n) & jnp.isfinite(reference))]
    sees = norms.sees_nonfinite(ord)
    unsure = [x for x, m in zip(xs, measurable) if not (m and sees)]
    if unsure:    # the norm may miss a NaN
        flags.append(stats_lib.all_finite(unsure))
    return n, divisor, reference, flags


def _group_step(x, n, prev, first, hp, *, ord):
    """``(divisor, next reference, finite)`` of a group (a leaf or the list of all leaves)
    of norm ``n``."""
    group = x if isinstance(x, list) else [x]
    measurable = norms.metric_defined(ord, sum(g.size for g in group))
    n = n.astype(prev.dtype) if measurable else jnp.zeros_like(prev)
    divisor, reference = _norm_limit(n, prev, first, hp) if measurable else (
        jnp.ones_like(n), prev)
    finite = jnp.isfinite(n) & jnp.isfinite(reference)
    if not (measurable and norms.sees_nonfinite(ord)):   # the norm may miss a NaN
        finite = finite & stats_lib.all_finite(group)
    return n, divisor, reference, finite


def _norm_growth_init(params, state_cls, parameterwise: bool, ord) -> Any:
    """The initial state of :func:`clip_norm_growth`."""
    if parameterwise:
        scalar = leafvec.full(params, 0.0)
    else:
        scalar = jnp.zeros((), jax.eval_shape(lambda t: norms.global_norm(t, ord), params).dtype)
    zero = jnp.zeros([], jnp.int32)
    return stats_lib.own_buffers(state_cls(
        zero, scalar, scalar, jnp.ones_like(scalar), jnp.zeros_like(scalar, bool), zero))


def _norm_limit(n: jax.Array, prev: jax.Array, first: jax.Array, hp: _Limits
                ) -> tuple[jax.Array, jax.Array]:
    """clip_norm_growth's rule for a group of norm ``n`` whose reference is ``prev``: the
    divisor ``d`` and the next reference (limits that are ``None`` in ``hp`` are not used)."""
    p = prev if hp.min_value is None else jnp.maximum(prev, _const(hp.min_value, prev))
    d = jnp.ones_like(n)
    if hp.add is not None:
        cap = p + _const(hp.add, p)
        d = jnp.where(n > cap, n / cap, d)
    if hp.mul is not None:
        cap = p * _const(hp.mul, p)
        d = jnp.where(n > cap, jnp.maximum(d, n / cap), d)
    # torchzero also floors d at min_value here: min_value floors the reference only.
    new_prev = n / d
    if hp.max_decay is not None:
        decay = _const(hp.max_decay, p)
        new_prev = jnp.where(n / p < 1 / decay, p / decay, new_prev)
    if hp.min_value is not None:
        new_prev = jnp.maximum(new_prev, _const(hp.min_value, new_prev))
    # The first norm is stored as measured; the min_value floor applies when it is used.
    return jnp.where(first, 1, d), jnp.where(first, n, new_prev)
