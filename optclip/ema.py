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

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import checks, norms, running
from optclip._core import stats as stats_lib
from optclip._core.norms import AxisName, Ord

__all__ = [
    "ClipNormByEMAGlobalState", "ClipNormByEMAState", "ClipValueByEMAState",
    "NormalizeByEMAGlobalState", "NormalizeByEMAState",
    "clip_norm_by_ema", "clip_value_by_ema", "normalize_by_ema",
]

EMA_INITS = ("zeros", "update")
_NORM_FIELDS = ("norm", "ema_norm", "divisor", "clipped", "capped", "nonfinite")
_PER_LEAF = ("norm", "ema_norm", "divisor", "clipped", "capped")


@stats_lib.diagnostic("clip_norm_by_ema", _NORM_FIELDS, per_leaf=_PER_LEAF)
class ClipNormByEMAState(NamedTuple):
    """State of :func:`clip_norm_by_ema` with ``tensorwise=True`` (per-leaf scalars)."""

    count: jax.Array      # int32 finite steps taken (0: the next finite step starts the EMA)
    ema: Any              # per leaf: EMA of the updates (leaf shape, float32 or wider)
    ema_norm: Any         # per leaf: norm of the stored EMA after the growth cap
    norm: Any             # per leaf: norm of the last finite update
    divisor: Any          # what that update was divided by
    clipped: Any          # divisor > 1: the update was scaled down
    capped: Any           # the growth cap rescaled the stored EMA
    nonfinite: jax.Array  # int32 steps whose updates were not finite (state left unchanged)


# The other layouts share the fields; separate classes give each its own ``optclip.stats`` name
# and keep the logged keys independent of the number of leaves.
@stats_lib.diagnostic("clip_norm_by_ema", _NORM_FIELDS)
class ClipNormByEMAGlobalState(ClipNormByEMAState):
    """State of :func:`clip_norm_by_ema` with ``tensorwise=False`` (one scalar each)."""


@stats_lib.diagnostic("normalize_by_ema", _NORM_FIELDS, per_leaf=_PER_LEAF)
class NormalizeByEMAState(ClipNormByEMAState):
    """State of :func:`normalize_by_ema` with ``tensorwise=True``."""


@stats_lib.diagnostic("normalize_by_ema", _NORM_FIELDS)
class NormalizeByEMAGlobalState(ClipNormByEMAState):
    """State of :func:`normalize_by_ema` with ``tensorwise=False``."""


@stats_lib.diagnostic("clip_value_by_ema", ("max_abs", "clipped", "nonfinite"),
                      per_leaf=("max_abs", "clipped"))
class ClipValueByEMAState(NamedTuple):
    count: jax.Array            # int32 finite steps taken
    ema: Any                    # per leaf: EMA of |update| (leaf shape, float32 or wider)
    ema_transform_state: Any    # state of ``ema_transform`` (``optax.EmptyState()`` without one)
    max_abs: Any                # per leaf: largest |update| of the last finite step
    clipped: Any                # per leaf: whether any element was clamped
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

def _norm_by_ema(normalize, beta, ord, eps, tensorwise, max_ema_growth, ema_init, axis_name):
    _check_ema_args(beta, ema_init)
    norms.check_axis_name(axis_name)
    ord = norms.canonical_ord(ord)
    checks.non_negative("eps", eps)
    checks.boolean("tensorwise", tensorwise)
    state_cls = {(False, True): ClipNormByEMAState, (False, False): ClipNormByEMAGlobalState,
                 (True, True): NormalizeByEMAState,
                 (True, False): NormalizeByEMAGlobalState}[normalize, bool(tensorwise)]
    checks.positive("max_ema_growth", max_ema_growth, allow_none=True, allow_schedule=True)

    def cap_and_divide(a, b, r_prev, first, ema, measurable, growth):
        """Growth cap on the EMA norm ``b`` and the divisor for an update of norm ``a``.

        Returns ``(divisor, capped b, capped flag, rescaled EMA leaves)``.
        """
        capped = jnp.zeros(b.shape, bool)
        if max_ema_growth is not None:
            reference = jnp.where(first, b, r_prev)
            allowed = jnp.maximum(reference * growth.astype(b.dtype),
                                  jnp.asarray(eps, b.dtype))
            capped = b > allowed
            shrink = jnp.where(capped, b / allowed, 1)
            ema = [e / shrink.astype(e.dtype) for e in ema]
            b = jnp.where(capped, allowed, b)
        floor = _double_tiny(b.dtype)
        ratio = a.astype(b.dtype) / jnp.maximum(b, floor)
        divisor = jnp.maximum(ratio, floor) if normalize else jnp.maximum(ratio, 1)
        if not measurable:
            divisor = jnp.ones_like(divisor)
        return divisor, b, capped, ema

    def _norms_or_zeros(size, groups):
        """Norms of the update and of the EMA (one leaf, or all leaves when not tensorwise).

        ddof=1 metrics of fewer than two elements are NaN in torchzero: such a
        group reads as norm 0 here and passes unchanged, and its statistics stay finite.
        """
        measure = norms.leaf_norm if tensorwise else norms.global_norm
        a, b = (measure(group, ord, axis_name) for group in groups)
        if not norms.metric_defined(ord, size):
            return jnp.zeros_like(a), jnp.zeros_like(b), False
        return a, b, True

    def init_fn(params):
        ema = _float_zeros(params)
        if tensorwise:
            scalar = jax.tree.map(lambda e: jnp.zeros((), e.dtype), ema)
        else:
            scalar = jnp.zeros((), jax.eval_shape(lambda t: norms.global_norm(t, ord), ema).dtype)
        ones = jax.tree.map(jnp.ones_like, scalar)
        flags = jax.tree.map(lambda s: jnp.zeros((), bool), scalar)
        zero = jnp.zeros([], jnp.int32)
        return stats_lib.own_buffers(
            state_cls(zero, ema, scalar, scalar, ones, flags, flags, zero))

    def update_fn(updates, state, params=None):
        del params
        leaves, (old_ema,), treedef = norms.flatten_with(updates, state.ema)
        first = state.count == 0
        growth = None if max_ema_growth is None else checks.resolve(max_ema_growth, state.count)
        is_float = [norms.is_float(x) for x in leaves]
        ema = []
        for x, e, f in zip(leaves, old_ema, is_float):
            if not f:
                ema.append(None)
                continue
            x = x.astype(e.dtype)
            start = jnp.where(first, x if ema_init == "update" else jnp.zeros_like(x), e)
            ema.append(running.lerp(start, x, _ema_weight(beta, start.dtype)))

        if tensorwise:
            old_r = treedef.flatten_up_to(state.ema_norm)
            per_leaf = [None] * len(leaves)
            for i, (x, e, r, f) in enumerate(zip(leaves, ema, old_r, is_float)):
                if not f:
                    continue
                size = x.size * norms.axes_size(norms.split_axes([x], axis_name)[0])
                a, b, measurable = _norms_or_zeros(size, (x, e))
                divisor, b, capped, (e,) = cap_and_divide(a, b, r, first, [e], measurable,
                                                          growth)
                ema[i] = e
                per_leaf[i] = (norms.divide(x, _output_divisor(a, divisor)), a.astype(b.dtype), b,
                               divisor, capped)
            new_updates = treedef.unflatten(
                [p[0] if p else x for p, x in zip(per_leaf, leaves)])
            norm, ema_norm, divisor, capped = (
                treedef.unflatten([p[k] if p else None for p in per_leaf]) for k in range(1, 5))
        else:
            floats = [e for e in ema if e is not None]
            size = sum(e.size * norms.axes_size(a)
                       for e, a in zip(floats, norms.split_axes(floats, axis_name)))
            a, b, measurable = _norms_or_zeros(size, (leaves, ema))
            divisor, ema_norm, capped, floats = cap_and_divide(
                a, b, state.ema_norm, first, floats, measurable, growth)
            rescaled = iter(floats)
            ema = [next(rescaled) if f else None for f in is_float]
            norm = a.astype(ema_norm.dtype)
            new_updates = treedef.unflatten(
                [norms.divide(x, _output_divisor(a, divisor)) if f else x
                 for x, f in zip(leaves, is_float)])

        clipped = jax.tree.map(lambda d: d > 1, divisor)
        ok = stats_lib.all_finite((updates, norm, ema_norm), axis_name)
        new = state_cls(optax.safe_increment(state.count), treedef.unflatten(ema), ema_norm,
                        norm, divisor, clipped, capped, state.nonfinite)
        return new_updates, stats_lib.commit(ok, new, state)

    return checks.transformation(init_fn, update_fn)


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
      rescaled the EMA) and ``nonfinite``; per leaf, or scalars when ``tensorwise=False``.

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
      ...     print(out.round(4).tolist(), round(float(state.ema_norm), 4))
      [1.5, 2.0] 2.5
      [0.3, 0.4] 1.5
      [1.35, 1.8] 2.25
    """
    return _norm_by_ema(False, beta, ord, eps, tensorwise, max_ema_growth, ema_init, axis_name)


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
      (``clipped`` means the update was scaled down).

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
    return _norm_by_ema(True, beta, ord, eps, tensorwise, max_ema_growth, ema_init, axis_name)


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
      clamping (``max_abs``), ``clipped`` and ``nonfinite``.

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

    def max_abs(x):
        return norms.leaf_norm(x, float("inf"), axis_name)

    def init_fn(params):
        ema = _float_zeros(params)
        per_leaf = jax.tree.map(lambda e: jnp.zeros((), e.dtype), ema)
        zero = jnp.zeros([], jnp.int32)
        return stats_lib.own_buffers(ClipValueByEMAState(
            zero, ema, transform.init(ema), per_leaf,
            jax.tree.map(lambda s: jnp.zeros((), bool), per_leaf), zero))

    def update_fn(updates, state, params=None):
        leaves, (old_ema,), treedef = norms.flatten_with(updates, state.ema)
        first = state.count == 0
        ema = []
        for x, e in zip(leaves, old_ema):
            if not norms.is_float(x):
                ema.append(None)
                continue
            magnitude = jnp.abs(x.astype(e.dtype))
            start = jnp.where(first, magnitude if ema_init == "update" else jnp.zeros_like(e), e)
            ema.append(running.lerp(start, magnitude, _ema_weight(beta, start.dtype)))
        ema_tree = treedef.unflatten(ema)
        bound, transform_state = transform.update(ema_tree, state.ema_transform_state, params)
        bounds = treedef.flatten_up_to(bound)

        outputs, measured, clipped = [], [], []
        for x, b in zip(leaves, bounds):
            if not norms.is_float(x):
                outputs.append(x)
                measured.append(None)
                clipped.append(None)
                continue
            wide = x.astype(b.dtype)
            # Lower clamp first, then the upper one: where B < 0 the result is B.
            outputs.append(jnp.minimum(jnp.maximum(wide, -b), b).astype(x.dtype))
            measured.append(max_abs(x))
            clipped.append(norms.any_true(jnp.any(jnp.abs(wide) > b), axis_name))

        ok = stats_lib.all_finite(updates, axis_name)
        new = ClipValueByEMAState(optax.safe_increment(state.count), ema_tree, transform_state,
                                  treedef.unflatten(measured), treedef.unflatten(clipped),
                                  state.nonfinite)
        return treedef.unflatten(outputs), stats_lib.commit(ok, new, state)

    return checks.transformation(init_fn, update_fn)
