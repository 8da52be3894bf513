"""Growth clippers: bound each update by the previous one.

References: torchzero 0.4.4 ``ClipValueGrowth`` and ``ClipNormGrowth``, with the
parameter names of torchzero's documented API (``parameterwise``).

The stored reference (the previous update per element, or its norm) is kept in float32 for
bf16/f16 leaves (float64 for float64 leaves). A step whose updates are not finite leaves the
state as it was, so the next finite step is compared with the last finite one; ``nonfinite``
counts such steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import checks, norms
from optclip._core import stats as stats_lib
from optclip._core.norms import AxisName, Ord

__all__ = ["ClipNormGrowthGlobalState", "ClipNormGrowthState", "ClipValueGrowthState",
           "clip_norm_growth", "clip_value_growth"]

# torchzero floors the elementwise growth ratio here.
_MIN_RATIO = 1e-8


@stats_lib.diagnostic("clip_value_growth", ("max_ratio", "clipped", "nonfinite"),
                      per_leaf=("max_ratio", "clipped"))
class ClipValueGrowthState(NamedTuple):
    count: jax.Array      # int32 finite steps taken (0: the next finite step is stored as is)
    prev: Any             # per leaf: the reference update (leaf shape, float32 or wider)
    max_ratio: Any        # per leaf: largest |x| / max(|prev|, min_value) of the last step
    clipped: Any          # per leaf: whether any element was limited
    nonfinite: jax.Array  # int32 steps whose updates were not finite (state left unchanged)


_NORM_FIELDS = ("norm", "prev_norm", "divisor", "clipped", "nonfinite")


@stats_lib.diagnostic("clip_norm_growth", _NORM_FIELDS,
                      per_leaf=("norm", "prev_norm", "divisor", "clipped"))
class ClipNormGrowthState(NamedTuple):
    """State of :func:`clip_norm_growth` with ``parameterwise=True`` (per-leaf scalars)."""

    count: jax.Array
    prev_norm: Any        # per leaf: the reference norm for the next step
    norm: Any             # per leaf: norm of the last finite update
    divisor: Any          # what that update was divided by
    clipped: Any          # divisor > 1
    nonfinite: jax.Array


@stats_lib.diagnostic("clip_norm_growth", _NORM_FIELDS)
class ClipNormGrowthGlobalState(ClipNormGrowthState):
    """State of :func:`clip_norm_growth` with ``parameterwise=False`` (one scalar each)."""


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
    """Each float-or-schedule limit resolved at ``count`` (the number of finite steps)."""
    return _Limits(*(None if v is None else checks.resolve(v, count) for v in values))


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
      ``max_ratio`` (before the multiplicative cap), ``clipped`` and ``nonfinite``.

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

    def one_leaf(x, prev, first, hp):
        """Returns ``(output, new reference, max ratio, clipped)`` for one float leaf."""
        wide = x.astype(prev.dtype)
        if identity:
            return x, wide, jnp.ones((), prev.dtype), jnp.zeros((), bool)
        reference = jnp.abs(prev)
        y = wide
        if add is not None:
            excess = jnp.maximum(jnp.abs(y) - reference, 0) - _const(hp.add, y)
            y = jnp.where(excess > 0, y - excess * jnp.sign(y), y)
        floor = reference if min_value is None else jnp.maximum(reference,
                                                                _const(hp.min_value, y))
        ratio = jnp.maximum(jnp.abs(y) / floor, _const(_MIN_RATIO, y))
        if mul is not None:
            y = jnp.where(ratio > _const(hp.mul, y), y / (ratio / _const(hp.mul, y)), y)
        new_prev = y
        if max_decay is not None:
            decay = _const(hp.max_decay, y)
            new_prev = jnp.where(ratio < 1 / decay, prev / decay,
                                 y)
        clipped = norms.any_true(jnp.any(y != wide), axis_name)
        # 0/0 (no floor, zero reference and update) has no ratio; torchzero leaves it alone.
        max_ratio = norms.leaf_norm(jnp.where(jnp.isnan(ratio), 0, ratio), float("inf"),
                                    axis_name).astype(ratio.dtype)
        y = jnp.where(first, wide, y)
        return (y.astype(x.dtype), jnp.where(first, wide, new_prev),
                jnp.where(first, 1, max_ratio).astype(prev.dtype), clipped & ~first)

    def init_fn(params):
        prev = stats_lib.zeros_like_params(lambda t: jax.tree.map(
            lambda x: x.astype(norms.acc_dtype(x.dtype)) if norms.is_float(x) else None, t),
            params)
        ratio = jax.tree.map(lambda p: jnp.ones((), p.dtype), prev)
        zero = jnp.zeros([], jnp.int32)
        return stats_lib.own_buffers(ClipValueGrowthState(
            zero, prev, ratio, jax.tree.map(lambda r: jnp.zeros((), bool), ratio), zero))

    def update_fn(updates, state, params=None):
        del params
        leaves, (prevs,), treedef = norms.flatten_with(updates, state.prev)
        first = state.count == 0
        hp = _limits_at(state.count, add, mul, min_value, max_decay)
        results = [one_leaf(x, p, first, hp) if norms.is_float(x) else (x, None, None, None)
                   for x, p in zip(leaves, prevs)]
        outputs, new_prev, max_ratio, clipped = (
            treedef.unflatten([r[k] for r in results]) for k in range(4))
        ok = stats_lib.all_finite((updates, new_prev), axis_name)
        new = ClipValueGrowthState(optax.safe_increment(state.count), new_prev, max_ratio,
                                   clipped, state.nonfinite)
        return outputs, stats_lib.commit(ok, new, state)

    return checks.transformation(init_fn, update_fn)


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
      per leaf, or scalars when ``parameterwise=False``.

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
      ...     print(out.round(4).tolist(), float(state.prev_norm))
      [3.0, 4.0] 5.0
      [4.5, 6.0] 7.5
      [0.3, 0.4] 3.75
    """
    _check_growth_args(add, mul, min_value, max_decay)
    ord = norms.canonical_ord(ord)
    checks.boolean("parameterwise", parameterwise)
    norms.check_axis_name(axis_name)
    state_cls = ClipNormGrowthState if parameterwise else ClipNormGrowthGlobalState

    def divisor_and_reference(n, prev, first, measurable, hp):
        """Divisor ``d`` and the next reference norm for a group of norm ``n``."""
        if not measurable:
            return jnp.ones_like(n), prev
        p = prev if min_value is None else jnp.maximum(prev, _const(hp.min_value, prev))
        d = jnp.ones_like(n)
        if add is not None:
            cap = p + _const(hp.add, p)
            d = jnp.where(n > cap, n / cap, d)
        if mul is not None:
            cap = p * _const(hp.mul, p)
            d = jnp.where(n > cap, jnp.maximum(d, n / cap), d)
        # torchzero also floors d at min_value here: min_value floors the reference only.
        new_prev = n / d
        if max_decay is not None:
            decay = _const(hp.max_decay, p)
            new_prev = jnp.where(n / p < 1 / decay, p / decay,
                                 new_prev)
        if min_value is not None:
            new_prev = jnp.maximum(new_prev, _const(hp.min_value, new_prev))
        # The first norm is stored as measured; the min_value floor applies when it is used.
        return jnp.where(first, 1, d), jnp.where(first, n, new_prev)

    def init_fn(params):
        if parameterwise:
            scalar = jax.tree.map(lambda x: jnp.zeros((), norms.acc_dtype(x.dtype))
                                  if norms.is_float(x) else None, params)
        else:
            scalar = jnp.zeros((), jax.eval_shape(lambda t: norms.global_norm(t, ord),
                                                  params).dtype)
        zero = jnp.zeros([], jnp.int32)
        return stats_lib.own_buffers(state_cls(
            zero, scalar, scalar, jax.tree.map(jnp.ones_like, scalar),
            jax.tree.map(lambda s: jnp.zeros((), bool), scalar), zero))

    def update_fn(updates, state, params=None):
        del params
        first = state.count == 0
        hp = _limits_at(state.count, add, mul, min_value, max_decay)
        leaves, treedef = jax.tree.flatten(updates, is_leaf=lambda x: x is None)
        floats = [x for x in leaves if norms.is_float(x)]
        if parameterwise:
            prevs = treedef.flatten_up_to(state.prev_norm)
            per_leaf = [None] * len(leaves)
            for i, (x, prev) in enumerate(zip(leaves, prevs)):
                if norms.is_float(x):
                    measurable = norms.metric_defined(ord, x.size)
                    n = norms.leaf_norm(x, ord, axis_name) if measurable else jnp.zeros_like(prev)
                    per_leaf[i] = (n, *divisor_and_reference(n, prev, first, measurable, hp))
            norm, divisor, prev_norm = (
                treedef.unflatten([p[k] if p else None for p in per_leaf]) for k in range(3))
            outputs = [norms.divide(x, p[1]) if p else x for x, p in zip(leaves, per_leaf)]
        else:
            measurable = norms.metric_defined(ord, sum(x.size for x in floats))
            norm = (norms.global_norm(floats, ord, axis_name).astype(state.prev_norm.dtype)
                    if measurable
                    else jnp.zeros_like(state.prev_norm))
            divisor, prev_norm = divisor_and_reference(norm, state.prev_norm, first, measurable,
                                                       hp)
            outputs = [norms.divide(x, divisor) for x in leaves]

        clipped = jax.tree.map(lambda d: d > 1, divisor)
        ok = stats_lib.all_finite((updates, norm, prev_norm), axis_name)
        new = state_cls(optax.safe_increment(state.count), prev_norm, norm, divisor, clipped,
                        state.nonfinite)
        return treedef.unflatten(outputs), stats_lib.commit(ok, new, state)

    return checks.transformation(init_fn, update_fn)
