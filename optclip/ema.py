"""EMA-referenced clippers: bound each update by an exponential moving average of past updates.

References: torchzero 0.4.4 ``ClipNormByEMA``, ``NormalizeByEMA``, ``ClipValueByEMA``,
with the parameter names of torchzero's documented API
(``eps``, ``ema_init``).

The EMA is per element with each leaf's shape (float32 for bf16/f16 leaves, float64 for float64
leaves), so it is sharded like the parameters. A step whose updates are not finite leaves the
whole state as it was (the EMA, the stored EMA norm and the step count), so the next finite step
continues as if the bad one had never happened; ``nonfinite`` counts such steps.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip._core import checks, handout, leafvec, norms, running, trees
from optclip._core import stats as stats_lib
from optclip._core.norms import AxisName, Ord

__all__ = [
    "ClipNormByEMAState", "ClipValueByEMAState", "NormalizeByEMAState",
    "clip_norm_by_ema", "clip_value_by_ema", "normalize_by_ema",
]

EMA_INITS = ("zeros", "update")
_NORM_FIELDS = ("norm", "ema_norm", "divisor", "clipped", "capped", "nonfinite")
_FIELD_NAMES = ("ema_norm", "norm", "divisor", "clipped", "capped")


@stats_lib.diagnostic("clip_norm_by_ema", _NORM_FIELDS)
class ClipNormByEMAState(NamedTuple):
    """State of :func:`clip_norm_by_ema`.

    With ``tensorwise=True`` the diagnostics hold one value per floating leaf, each field one
    vector of shape ``(F,)`` (entry ``j`` for the ``j``-th floating leaf of
    ``jax.tree.leaves(params)``; :func:`optclip.per_leaf` gives a tree); with
    ``tensorwise=False`` one scalar each. ``optclip.stats`` summarises the per-leaf vectors and
    reports the scalars as they are.
    """

    count: jax.Array      # int32 finite steps taken (0: the next finite step starts the EMA)
    ema: Any              # per leaf: EMA of the updates (a tree, leaf shape, float32 or wider)
    ema_norm: jax.Array   # (F,) per leaf, or a scalar: norm of the stored EMA after the cap
    norm: jax.Array       # (F,) per leaf, or a scalar: norm of the last finite update
    divisor: jax.Array    # (F,) per leaf, or a scalar: what that update was divided by
    clipped: jax.Array    # (F,) per leaf, or a scalar: bool, divisor > 1 (scaled down)
    capped: jax.Array     # (F,) per leaf, or a scalar: bool, the growth cap rescaled the EMA
    nonfinite: jax.Array  # int32 steps whose updates were not finite (state left unchanged)


@stats_lib.diagnostic("normalize_by_ema", _NORM_FIELDS)
class NormalizeByEMAState(ClipNormByEMAState):
    """State of :func:`normalize_by_ema`: the fields of :class:`ClipNormByEMAState`, one
    vector over the floating leaves each (``tensorwise=True``) or one scalar each
    (``tensorwise=False``)."""


@stats_lib.diagnostic("clip_value_by_ema", ("max_abs", "clipped", "nonfinite"),
                      per_leaf=("max_abs", "clipped"))
class ClipValueByEMAState(NamedTuple):
    count: jax.Array            # int32 finite steps taken
    ema: Any                    # per leaf: EMA of |update| (a tree, leaf shape, float32 or
                                # wider)
    ema_transform_state: Any    # state of ``ema_transform`` (``optax.EmptyState()`` without one)
    max_abs: jax.Array          # (F,) per leaf: largest |update| of the last finite step
    clipped: jax.Array          # (F,) per leaf: bool, whether any element was clamped
    nonfinite: jax.Array


# ---------------------------------------------------------------------------------------------
# Shared pieces.

def _check_ema_args(beta, ema_init) -> None:
    checks.in_range("beta", beta, 0.0, 1.0)
    if not isinstance(ema_init, str):
        raise TypeError(f"ema_init must be 'zeros' or 'update', got {ema_init!r}")
    checks.one_of("ema_init", ema_init, EMA_INITS)


def _ema_weight(beta: Any, dtype) -> Any:
    """The weight ``1 - beta`` of the new value: formed in double for a Python ``beta``, in
    the statistics dtype for a traced one (``inject_hyperparams``)."""
    if isinstance(beta, numbers.Real):
        return 1.0 - float(beta)
    return 1 - jnp.asarray(beta).astype(dtype)


def _double_tiny(dtype) -> jax.Array:
    # torchzero's fixed divisor floor: twice the smallest normal number.
    return jnp.asarray(2 * jnp.finfo(dtype).tiny, dtype)


def _output_divisor(norm: jax.Array, divisor: jax.Array) -> jax.Array:
    """The divisor a zero update is divided by: 1 (it stays zero either way).

    Dividing by the ``2 tiny`` floor would make the derivative NaN (``0 / tiny**2``), so
    ``jax.grad`` through the transform at a zero update would be NaN.
    """
    return jnp.where(norm == 0, jnp.ones_like(divisor), divisor)


def _float_zeros(tree: Any) -> Any:
    """Per float leaf: zeros of its shape in the statistics dtype; ``None`` elsewhere."""
    return stats_lib.zeros_like_params(lambda t: jax.tree.map(
        lambda x: x.astype(norms.acc_dtype(x.dtype)) if norms.is_float(x) else None, t), tree)


# ---------------------------------------------------------------------------------------------
# Norm-referenced: clip_norm_by_ema, normalize_by_ema.

class _Step(NamedTuple):
    """One group's (a leaf's, or the whole tree's) decision at a step."""
    divisor: jax.Array   # what the update is divided by (for the state: before the zero rule)
    output: jax.Array    # what it is actually divided by (1 for a zero update)
    ema_norm: jax.Array  # the moved EMA's norm after the growth cap
    capped: jax.Array    # the growth cap rescaled the EMA
    shrink: jax.Array    # the moved EMA is divided by this (1 where not capped)


def _clip_divisor(ratio: jax.Array, floor: jax.Array) -> jax.Array:
    """clip_norm_by_ema: scale down only (``||x|| <= ||e||``)."""
    del floor
    return jnp.maximum(ratio, 1)


def _normalize_divisor(ratio: jax.Array, floor: jax.Array) -> jax.Array:
    """normalize_by_ema: scale to the EMA's norm (``||x|| == ||e||``)."""
    return jnp.maximum(ratio, floor)


def _restart_weight(first: jax.Array, dtype) -> jax.Array:
    """The weight of the old EMA in the moved one's start: 0 on the first step, else 1."""
    return jnp.where(first, 0, 1).astype(dtype)


def _moved(x: jax.Array, e: jax.Array, keep: jax.Array, beta: Any, ema_init: str,
           apart: bool = False) -> jax.Array:
    """The EMA leaf moved toward ``x`` (the update, or its magnitude), restarted on the first
    step at 0 (``'zeros'``) or at ``x`` (``'update'``); ``keep`` is :func:`_restart_weight`.

    The restart is a scalar weight (``e`` and ``x`` are finite wherever the result is kept, so
    a term times 0 is 0), not an elementwise select: XLA:CPU then fuses the whole expression
    into each reduction that reads it instead of writing it out first. With ``apart`` the
    inputs and the weights pass one barrier (``norms.apart``), for a reduction: XLA then shares
    no broadcast of a weight between the reductions of leaves of one shape (it would write the
    broadcast out as an array for them to read).
    """
    weight = _ema_weight(beta, e.dtype)
    value = jnp.asarray(weight, e.dtype)
    if apart:
        x, e, keep, value = norms.apart(x, e, keep, value)
    x = x.astype(e.dtype)
    start = e * keep + (x * (1 - keep) if ema_init == "update" else 0)
    return running.lerp(start, x, weight, value if isinstance(weight, numbers.Real) else None)


def _decide(a, b, r_prev, first, growth, eps, divisor_rule) -> _Step:
    """Growth cap (``growth`` ``None``: none) on the moved EMA's norm ``b``, and the divisor of
    an update of norm ``a``."""
    capped, shrink = jnp.zeros(b.shape, bool), jnp.ones_like(b)
    if growth is not None:
        reference = jnp.where(first, b, r_prev)
        allowed = jnp.maximum(reference * growth.astype(b.dtype), jnp.asarray(eps, b.dtype))
        capped = b > allowed
        shrink = jnp.where(capped, b / allowed, 1)
        b = jnp.where(capped, allowed, b)
    floor = _double_tiny(b.dtype)
    divisor = divisor_rule(a.astype(b.dtype) / jnp.maximum(b, floor), floor)
    return _Step(divisor, _output_divisor(a, divisor), b, capped, shrink)


def _group_step(x, a, b, r_prev, first, growth, divisor_rule, ord, eps, axis_name):
    """``(update norm, _Step, finite)`` of one group (a leaf, or the list of all leaves) whose
    update ``x`` has norm ``a`` and whose moved EMA has norm ``b``.

    ddof=1 metrics of fewer than two elements are NaN in torchzero: such a group reads as norm 0
    here and passes unchanged, and its statistics stay finite.
    """
    measurable = norms.metric_defined(ord, _group_size(x, axis_name))
    if not measurable:
        a, b = jnp.zeros_like(a), jnp.zeros_like(b)
    finite = jnp.isfinite(a) & jnp.isfinite(b)
    if not (measurable and norms.sees_nonfinite(ord)):   # the norms may miss a NaN
        finite = finite & stats_lib.all_finite(x)
    step = _decide(a, b, r_prev, first, growth, eps, divisor_rule)
    if not measurable:
        step = step._replace(divisor=jnp.ones_like(step.divisor),
                             output=jnp.ones_like(step.output))
    return a.astype(b.dtype), step, finite


def _norm_ema_init(params, state_cls, tensorwise: bool, ord) -> Any:
    """The initial state of the norm-referenced EMA clippers."""
    ema = _float_zeros(params)
    if tensorwise:
        scalar = leafvec.full(params, 0.0)
    else:
        scalar = jnp.zeros((), jax.eval_shape(lambda t: norms.global_norm(t, ord), ema).dtype)
    ones, flags = jnp.ones_like(scalar), jnp.zeros_like(scalar, bool)
    zero = jnp.zeros([], jnp.int32)
    return stats_lib.own_buffers(state_cls(zero, ema, scalar, scalar, ones, flags, flags, zero))


def _norm_by_ema(divisor_rule, state_cls, beta, ord, eps, tensorwise, max_ema_growth, ema_init,
                 axis_name):
    """``clip_norm_by_ema`` and ``normalize_by_ema``: they differ in ``divisor_rule`` only."""
    _check_ema_args(beta, ema_init)
    norms.check_axis_name(axis_name)
    ord = norms.canonical_ord(ord)
    checks.non_negative("eps", eps, finite=True)
    checks.boolean("tensorwise", tensorwise)
    checks.positive("max_ema_growth", max_ema_growth, allow_none=True, allow_schedule=True)

    def update_fn(updates, state, params=None):
        del params
        first = state.count == 0
        growth = (None if max_ema_growth is None
                  else checks.resolve(max_ema_growth, state.count, name="max_ema_growth"))
        leaves, (old,), treedef = trees.flatten_with(updates, state.ema)
        floats = [i for i, x in enumerate(leaves) if norms.is_float(x)]

        keep = {dtype: _restart_weight(first, dtype)
                for dtype in {jnp.dtype(old[i].dtype) for i in floats}}

        def move(i, measured=True):
            """Leaf ``i``'s moved EMA, traced anew at each call: its norm, the norm's rare
            rescue branch and the commit's branch each compute it where they read it, so XLA
            never writes it out as an array (a branch would otherwise take it as an operand).
            Where it is ``measured`` its inputs pass a barrier together (``norms.apart``): the
            restart weight's broadcast is then not shared with the reductions of other leaves of
            this shape, which would write it out."""
            return _moved(leaves[i], old[i], keep[jnp.dtype(old[i].dtype)], beta, ema_init,
                          apart=measured)

        rule = _Rule(first, growth, divisor_rule, ord, eps, axis_name)
        if tensorwise:
            ok, rows, fields = _leafwise(leaves, move, state, rule)
        else:
            ok, rows, fields = _whole(leaves, floats, move, state, rule)
        outputs, ema = list(leaves), list(old)
        out_factors = [rows[i][0] for i in floats]

        def commit():
            # The EMA moved again inside the branch (not the measured trace): XLA moves,
            # rescales and writes it in place in one pass over the update and the old EMA. The
            # output factors leave through a select on the predicate (the same values): passed
            # through by both branches, XLA would take them from the operands instead.
            return ([move(i, measured=False) * rows[i][1].astype(old[i].dtype) for i in floats],
                    [jax.lax.select(ok, f, jnp.zeros_like(f)) for f in out_factors])

        def hold():
            return [old[i] for i in floats], out_factors

        # One gate (lax.cond; a select on a GPU) on the step's finiteness commits every EMA
        # leaf (a held step hands the old EMA back untouched). The output factors leave through
        # it, so the outputs (and the optimizer after this transform) are computed after the
        # commit has read the updates: XLA then writes them over the donated updates without
        # copying them first.
        committed, out_factors = stats_lib.run_or_hold(ok, commit, hold)
        for i, e, out_factor in zip(floats, committed, out_factors):
            # Products, not quotients: XLA:CPU fuses a product into each pass that reads it,
            # where it would write a quotient out first (it never copies a division).
            outputs[i] = norms.scale(leaves[i], out_factor)
            ema[i] = e
        new = state._replace(count=jnp.where(ok, optax.safe_increment(state.count), state.count),
                             ema=treedef.unflatten(ema),
                             nonfinite=stats_lib.count_nonfinite(state.nonfinite, ok), **fields)
        return treedef.unflatten(outputs), new

    return checks.transformation(
        lambda params: _norm_ema_init(params, state_cls, tensorwise, ord), update_fn,
        pairs_leaves=tensorwise)


class _Rule(NamedTuple):
    """What the decision of a step depends on besides the norms."""
    first: jax.Array
    growth: Any
    divisor_rule: Any
    ord: Any
    eps: float
    axis_name: AxisName


def _whole(leaves, floats, move, state, rule: _Rule):
    """All leaves as one vector: ``(ok, per-leaf (output factor, EMA factor), state fields)``,
    the state fields committed (the previous ones kept when ``ok`` fails)."""
    xs = [leaves[i] for i in floats]
    norm, step, finite = _group_step(
        xs, norms.global_norm(xs, rule.ord, rule.axis_name),
        norms.global_norm([move(i) for i in floats], rule.ord, rule.axis_name,
                          build=lambda: [move(i) for i in floats]),
        state.ema_norm, rule.first, rule.growth, rule.divisor_rule, rule.ord, rule.eps,
        rule.axis_name)
    ok = norms.all_true(finite, rule.axis_name) if floats else jnp.asarray(True)
    fields = _fields(norm, step)
    fields = {k: jnp.where(ok, v, getattr(state, k)) for k, v in fields.items()}
    factors = (1 / step.output, 1 / step.shrink)
    return ok, {i: factors for i in floats}, fields


def _fields(norm, step: _Step) -> dict:
    """The state's diagnostics of a step (per group)."""
    return {"ema_norm": step.ema_norm, "norm": norm, "divisor": step.divisor,
            "clipped": step.divisor > 1, "capped": step.capped}


def _leafwise(leaves, move, state, rule: _Rule):
    """Each leaf against its own EMA: ``(ok, per-leaf (output factor, EMA factor), committed
    state fields)``, the fields as per-leaf vectors (:mod:`optclip._core.leafvec`).

    The per-leaf decisions are taken on vectors (one entry per leaf, one vector per statistics
    dtype), so they cost a fixed number of kernels whatever the leaf count; the state keeps
    these vectors, and only each leaf's two factors are handed out by
    :func:`optclip._core.handout.rows` (one kernel per group of leaves).
    """
    group_list = leafvec.groups(leaves)
    decided = [_decide_group(leaves, group, move, state, rule) for group in group_list]
    ok = stats_lib.all_of([f for _, _, flags in decided for f in flags], rule.axis_name)
    rows, parts = {}, {name: [] for name in _FIELD_NAMES}
    for group, (norm, step, _) in zip(group_list, decided):
        for name, value in _fields(norm, step).items():
            parts[name].append(value)
        for i, row in zip(group.leaves, handout.rows((1 / step.output, 1 / step.shrink))):
            rows[i] = row
    return ok, rows, {name: jnp.where(ok, leafvec.assemble(p, group_list, kept), kept)
                      for name, p in parts.items() for kept in [getattr(state, name)]}


def _decide_group(leaves, group: leafvec.Group, move, state, rule: _Rule):
    """``(update norms, _Step, finiteness flags)`` of the leaves of ``group`` (one statistics
    dtype), as vectors with one entry per leaf."""
    idx = group.leaves
    xs = [leaves[i] for i in idx]
    dtype = norms.acc_dtype(xs[0].dtype)
    split = norms.split_axes(xs, rule.axis_name)
    measurable = np.array([norms.metric_defined(rule.ord, x.size * norms.axes_size(axes))
                           for x, axes in zip(xs, split)])

    a, b = _leaf_metrics(xs, lambda j: move(idx[j]), rule)
    a, b = a.astype(dtype), b.astype(dtype)
    if not measurable.all():
        a, b = jnp.where(measurable, a, 0), jnp.where(measurable, b, 0)
    step = _decide(a, b, leafvec.take(state.ema_norm, group), rule.first, rule.growth,
                   rule.eps, rule.divisor_rule)
    if not measurable.all():
        step = step._replace(divisor=jnp.where(measurable, step.divisor, 1),
                             output=jnp.where(measurable, step.output, 1))
    sees = norms.sees_nonfinite(rule.ord)
    flags = [stats_lib.leaf_finite(x) for x, m in zip(xs, measurable) if not (m and sees)]
    flags.append(jnp.all(jnp.isfinite(a) & jnp.isfinite(b)))
    return a, step, flags


def _leaf_metrics(xs: list[jax.Array], moved_at: Callable[[int], jax.Array], rule: _Rule
                  ) -> tuple[jax.Array, jax.Array]:
    """The metric (``norms.leaf_norm``) of each update ``xs`` and of each moved EMA
    (``moved_at(j)`` traces that of ``xs[j]``), as two vectors."""
    if rule.ord == 2.0:
        return _leaf_l2_norms(xs, moved_at, rule.axis_name)
    ms = [moved_at(j) for j in range(len(xs))]
    if rule.ord == "std":
        both = _leaf_stds(xs, rule.axis_name) + _leaf_stds(ms, rule.axis_name)
    else:
        both = norms.leaf_norms(xs + ms, rule.ord, rule.axis_name)
    both = norms.gather_scalars(both)
    return both[:len(xs)], both[len(xs):]


def _leaf_l2_norms(xs: list[jax.Array], moved_at: Callable[[int], jax.Array],
                   axis_name: AxisName) -> tuple[jax.Array, jax.Array]:
    """``norms.leaf_l2_norms(xs + ms, vector=True)`` as two vectors (``ms[j] = moved_at(j)``,
    traced again inside the rescue branch of an overflowed sum: XLA then reads the update and
    the old EMA there instead of keeping the moved EMA for it), the same values from fewer
    passes.

    Leaves that are reduced alone whatever their neighbours (larger than the same-shape groups
    of ``norms.leaf_reductions``) are measured by one call for the updates and one for the
    EMAs: each call has its own branch for an overflowed sum of squares, and two branches share
    no constant (inside one, XLA would write a constant out as an array the size of a leaf for
    the reductions of both to read). The other leaves stay in one call, reduced in the same
    groups as before.
    """
    alone = [j for j, x in enumerate(xs) if x.size > norms.GROUP_MAX_ELEMENTS]
    grouped = [j for j, x in enumerate(xs) if x.size <= norms.GROUP_MAX_ELEMENTS]
    parts = []
    if grouped:
        both = norms.leaf_l2_norms(lambda: [xs[j] for j in grouped]
                                   + [moved_at(j) for j in grouped], axis_name, vector=True)
        parts.append((both[:len(grouped)], both[len(grouped):]))
    if alone:
        parts.append((norms.leaf_l2_norms([xs[j] for j in alone], axis_name, vector=True),
                      norms.leaf_l2_norms(lambda: [moved_at(j) for j in alone], axis_name,
                                          vector=True)))
    if len(parts) == 1:
        return parts[0]
    order = np.argsort(grouped + alone)
    return tuple(jnp.concatenate([p[k] for p in parts])[order] for k in range(2))


def _leaf_stds(arrays: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """``norms.leaf_norm(x, 'std')`` of each array, the same values from fewer passes
    (:func:`optclip._core.norms.slice_stds`: the deviations are not written out)."""
    split = norms.split_axes(arrays, axis_name)
    stds = norms.slice_stds([(x, tuple(range(x.ndim)), sp) for x, sp in zip(arrays, split)])
    return [s.reshape(()) for s in stds]


def _group_size(group: Any, axis_name: AxisName) -> int:
    """Elements in a leaf or a list of leaves, counted over the mesh axes they are split on."""
    leaves = group if isinstance(group, list) else [group]
    return sum(x.size * norms.axes_size(a)
               for x, a in zip(leaves, norms.split_axes(leaves, axis_name)))


def clip_norm_by_ema(
    beta: float = 0.99,
    ord: Ord = 2,
    eps: float = 1e-6,
    tensorwise: bool = True,
    max_ema_growth: float | None = 1.5,
    ema_init: str = "zeros",
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Clip the norm of the updates to the norm of their exponential moving average.

    Per step, with update ``x`` and EMA ``e`` (per leaf, or all leaves as one vector when
    ``tensorwise=False``)::

        e <- e + (1 - beta) (x - e)                      # no bias correction
        if max_ema_growth:                               # cap the growth of ||e|| (stored)
            allowed = max(max_ema_growth * r, eps)       # r: ||e|| kept from the previous step
            if ||e|| > allowed: e <- e / (||e|| / allowed)
            r <- ||e||
        x <- x / max(||x|| / max(||e||, 2 tiny), 1)

    so ``||x||`` never exceeds ``||e||``. ``tiny`` is the smallest normal number of the
    statistics dtype. On the first step ``r`` is the norm of the new EMA.

    Args:
      beta: EMA decay in ``[0, 1]``; the EMA moves toward each update with weight ``1 - beta``.
      ord: the metric: any number or ``'l0'``-``'l4'``, ``'linf'``, ``'mad'``, ``'std'``,
        ``'var'``, ``'sum'`` (as ``|Σx|``).
      eps: ``>= 0``, floor of the allowed EMA norm in the growth cap (torchzero 0.4.4's
        ``min_norm``); unused when ``max_ema_growth`` is ``None``.
      tensorwise: ``True``: each leaf against its own EMA; ``False``: all leaves as one vector
        (global norms from per-leaf partial reductions).
      max_ema_growth: ``> 0``, ``None`` or an optax schedule ``count -> value`` (``count``:
        finite steps taken): the EMA norm may grow at most by this factor per step; larger
        EMAs are rescaled in the state.
      ema_init: ``'zeros'`` (the first output is ``(1 - beta) x``) or ``'update'`` (the EMA
        starts at the first update, which passes unchanged).
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split
        over: norms and the skip decision for non-finite steps are combined across devices
        (``psum``), so every device keeps the same state.

    Returns:
      An ``optax.GradientTransformation``. Its state logs the update ``norm``, the ``ema_norm``
      it was clipped to, the ``divisor`` applied, ``clipped``, ``capped`` (the growth cap
      rescaled the EMA) and ``nonfinite``; per leaf, each field one vector over the floating
      leaves (:func:`optclip.per_leaf` gives a tree), or scalars when ``tensorwise=False``.

    References:
      torchzero ``ClipNormByEMA``; parameter names of its documented
      API. Differences from torchzero 0.4.4: a string ``ord`` works with
      ``tensorwise=True``; ``tensorwise=False`` never concatenates leaves and
      ``ord=0`` counts non-zeros instead of raising; ``'sum'`` is ``|Σx|``;
      ``'std'``/``'var'`` groups of fewer than two elements pass unchanged;
      ``ema_init='update'`` (documented, absent from 0.4.4); a non-finite step leaves the state
      unchanged. torchzero's ``init`` (a constant fill) and ``inner`` are not offered
      (chain transforms instead); the documented ``eps`` is 0.4.4's ``min_norm``, and the divisor
      floor stays at ``2 tiny``.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.clip_norm_by_ema(beta=0.5)
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in ([3.0, 4.0], [0.3, 0.4], [30.0, 40.0]):
      ...     out, state = tx.update(jnp.array(g), state)
      ...     print(out.round(4).tolist(), round(float(state.ema_norm[0]), 4))  # one leaf
      [1.5, 2.0] 2.5
      [0.3, 0.4] 1.5
      [1.35, 1.8] 2.25
    """
    return _norm_by_ema(_clip_divisor, ClipNormByEMAState, beta, ord, eps, tensorwise,
                        max_ema_growth, ema_init, axis_name)


def normalize_by_ema(
    beta: float = 0.99,
    ord: Ord = 2,
    eps: float = 1e-6,
    tensorwise: bool = True,
    max_ema_growth: float | None = 1.5,
    ema_init: str = "zeros",
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Scale the updates to the norm of their exponential moving average.

    As :func:`clip_norm_by_ema`, with the last line replaced by::

        x <- x / max(||x|| / max(||e||, 2 tiny), 2 tiny)

    so ``||x|| == ||e||`` (a zero update stays zero).

    Args:
      beta, ord, eps, tensorwise, max_ema_growth, ema_init, axis_name: as in
        :func:`clip_norm_by_ema`.

    Returns:
      An ``optax.GradientTransformation`` with the diagnostics of :func:`clip_norm_by_ema`
      (``clipped`` means the update was scaled down): per leaf, each field one vector over the
      floating leaves (:func:`optclip.per_leaf` gives a tree), or scalars when
      ``tensorwise=False``.

    References:
      torchzero ``NormalizeByEMA``; the differences from torchzero
      0.4.4 are those of :func:`clip_norm_by_ema`.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.normalize_by_ema(beta=0.5)
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in ([3.0, 4.0], [0.3, 0.4]):
      ...     out, state = tx.update(jnp.array(g), state)
      ...     print(out.round(4).tolist())
      [1.5, 2.0]
      [0.9, 1.2]
    """
    return _norm_by_ema(_normalize_divisor, NormalizeByEMAState, beta, ord, eps, tensorwise,
                        max_ema_growth, ema_init, axis_name)


# ---------------------------------------------------------------------------------------------
# Value-referenced: clip_value_by_ema.

def clip_value_by_ema(
    beta: float = 0.99,
    ema_init: str = "zeros",
    ema_transform: optax.GradientTransformation | None = None,
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Clamp every element to the EMA of its own absolute value.

    Per step, elementwise, with update ``x`` and EMA ``e``::

        e <- e + (1 - beta) (|x| - e)        # e starts at 0 ('zeros') or |x_1| ('update')
        B <- ema_transform(e)                # on a copy; B = e without a transform
        x <- min(max(x, -B), B)

    Args:
      beta: EMA decay in ``[0, 1]``.
      ema_init: ``'zeros'`` (the first output is ``(1 - beta) x``) or ``'update'`` (the EMA
        starts at ``|x_1|``, so the first step is the identity).
      ema_transform: any ``optax.GradientTransformation`` (for example ``optax.scale(2.0)``),
        applied each step to a copy of the EMA to give the bound ``B``; its state is carried in
        this transform's state. The stored EMA is not modified.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split
        over: the per-leaf diagnostics and the skip decision for non-finite steps are combined
        across devices (the clamping itself is elementwise).

    Returns:
      An ``optax.GradientTransformation`` whose state logs, per leaf, the largest ``|x|`` before
      clamping (``max_abs``) and ``clipped``, each one vector over the floating leaves
      (:func:`optclip.per_leaf` gives a tree), and ``nonfinite``.

    References:
      torchzero ``ClipValueByEMA``, documented parameter names
      (``ema_init``, ``ema_tfm``). ``ema_init='update'`` is 0.4.4's ``init=1``; the
      ``inner`` option is not offered (chain transforms instead). A non-finite step leaves the
      EMA and the ``ema_transform`` state unchanged.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.clip_value_by_ema(beta=0.5)
      >>> state = tx.init(jnp.zeros(3))
      >>> for g in ([3.0, -4.0, 0.0], [-1.0, 1.0, 2.0]):
      ...     out, state = tx.update(jnp.array(g), state)
      ...     print(out.tolist())
      [1.5, -2.0, 0.0]
      [-1.0, 1.0, 1.0]
    """
    _check_ema_args(beta, ema_init)
    if ema_transform is not None and not isinstance(ema_transform, optax.GradientTransformation):
        raise TypeError("ema_transform must be an optax.GradientTransformation or None, got "
                        f"{ema_transform!r}")
    transform = ema_transform if ema_transform is not None else optax.identity()
    norms.check_axis_name(axis_name)

    def init_fn(params):
        ema = _float_zeros(params)
        zero = jnp.zeros([], jnp.int32)
        return stats_lib.own_buffers(ClipValueByEMAState(
            zero, ema, transform.init(ema), leafvec.full(params, 0.0),
            leafvec.full(params, False, jnp.bool_), zero))

    def update_fn(updates, state, params=None):
        first = state.count == 0
        keep = functools.cache(lambda dtype: _restart_weight(first, dtype))
        leaves, (old,), treedef = trees.flatten_with(updates, state.ema)
        floats = [i for i, x in enumerate(leaves) if norms.is_float(x)]
        xs = [leaves[i] for i in floats]
        # The step's statistics first: a non-finite step leaves the EMA as it was. The
        # reductions of the peaks (finite wherever the updates are) are tested with them: the
        # output then depends on every reduction over the updates, so XLA takes them all
        # before it writes the output and needs no copy of the donated updates.
        local, peaks = _peaks(xs, axis_name)
        ok = stats_lib.all_finite(xs + [p for p, x in zip(local, xs) if x.size], axis_name)
        ema = trees.unflatten_at(treedef, {i: jax.lax.select(ok, _moved(
            _magnitude(leaves[i]), old[i], keep(old[i].dtype), beta, ema_init), old[i])
            for i in floats})
        bound, transform_state = transform.update(ema, state.ema_transform_state, params)
        (bounds,) = trees.flatten_with(updates, bound)[1]
        outputs, excess = _clamped(xs, [bounds[i] for i in floats], axis_name)
        new = ClipValueByEMAState(
            optax.safe_increment(state.count), ema, transform_state,
            leafvec.from_scalars(dict(zip(floats, peaks)), leaves, state.max_abs,
                                 lambda p: jnp.maximum(p, 0.0)),
            leafvec.from_scalars(dict(zip(floats, excess)), leaves, state.clipped,
                                 lambda e: norms.any_true(e > 0, axis_name)),
            state.nonfinite)
        # The EMA was committed above (the bound reads it): not a second select over it.
        outputs = dict(zip(floats, outputs))
        return (treedef.unflatten([outputs.get(i, x) for i, x in enumerate(leaves)]),
                stats_lib.commit(ok, new, state)._replace(ema=ema))

    return checks.transformation(init_fn, update_fn, pairs_leaves=True)


def _magnitude(x: jax.Array) -> jax.Array:
    """``|x|`` (bit for bit, NaN included) by clearing the sign bit.

    Each reduction over the updates (the largest ``|x|``, the clamp test) and the EMA's move
    take ``|x|`` in a different form: XLA merges equal expressions, and XLA:CPU's fast reduction
    kernel takes in only the operations that no other kernel reads, so one shared ``|x|`` would
    be written out as an array and read back by each of them.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    sign = np.array(1 << (8 * x.dtype.itemsize - 1), bits.dtype)
    return jax.lax.bitcast_convert_type(bits & ~sign, x.dtype)


def _peaks(xs: list[jax.Array], axis_name: AxisName
           ) -> tuple[list[jax.Array], list[jax.Array]]:
    """Largest ``|x|`` of each leaf: this device's reductions (same-shape leaves reduced
    together, :func:`optclip._core.norms.leaf_reductions`), and these combined across devices
    (``-inf`` for an empty leaf: ``norms.leaf_norm(x, inf)`` is their maximum with 0, taken on
    the state's vector)."""
    local = norms.leaf_reductions(xs, lambda x: jnp.abs(x.astype(norms.acc_dtype(x.dtype))),
                                  "max")
    return local, [norms.across(p, "max", split)
                   for p, split in zip(local, norms.split_axes(xs, axis_name))]


def _clamped(xs: list[jax.Array], bounds: list[jax.Array], axis_name: AxisName
             ) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per leaf of ``xs``: the leaf clamped to ``[-B, B]`` (its bound), and this device's
    largest ``|x| - B`` (the leaf was clamped where it is ``> 0`` on some device).

    The clamp is applied where the leaf was clamped somewhere (elsewhere it is the identity),
    so XLA computes that flag before it writes the output, and can write the output over the
    donated updates instead of copying them first. The flags come from one float maximum
    (XLA:CPU's fast path) per group of same-shape leaves: ``|x| - B > 0`` exactly when
    ``|x| > B``.
    """
    wide = [x.astype(b.dtype) for x, b in zip(xs, bounds)]
    # |x| as |-x| here (the same values): see _magnitude.
    excess = norms.leaf_reductions([jnp.abs(-w) - b for w, b in zip(wide, bounds)],
                                   lambda v: v, "max")
    outputs = []
    for x, w, b, e in zip(xs, wide, bounds, excess):
        # Not ``e > 0``: on a non-finite step ``e`` may be NaN (XLA's own maximum keeps it,
        # XNNPACK's drops it), and the leaf's other elements are clamped all the same.
        flag = norms.any_true(~(e <= 0), axis_name)
        # Lower clamp first, then the upper one: where B < 0 the result is B.
        clamped = jnp.minimum(jnp.maximum(w, -b), b).astype(x.dtype)
        outputs.append(jax.lax.select(flag, clamped, x))
    return outputs, excess
