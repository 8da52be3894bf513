"""Moment-aware clipping: clip against the second moment adam already keeps.

Adam's ``nu`` holds a running estimate of every element's squared gradient, so a threshold
built from it needs no memory of its own and follows each element's scale. Each transform here
wraps an adam-style optimizer (``optax.adam``, ``optax.adamw``, a chain that contains one,
``optax.inject_hyperparams(optax.adamw)(...)``) and finds its moments in the wrapped state: the
one state ``NamedTuple`` with fields ``mu`` and ``nu`` (``optax.ScaleByAdamState``, and any
state built the same way). The wrapped state must hold exactly one such state.

* :func:`spam_clip`: SPAM's spike-aware clipping of the gradient against ``theta * nu``, with
  its periodic momentum reset as an option (Huang et al., ICLR 2025).
* :func:`stable_adamw_clip`: StableAdamW's update clipping, each tensor's update divided by
  ``max(1, RMS(g^2 / nu_hat))`` (Wortsman et al., NeurIPS 2023).
* :func:`adamw_clip`: AdamWClip's elementwise clipping at ``sigmas`` standard deviations,
  ``sigmas * sqrt(nu_hat)``.

A step with a NaN/Inf gradient leaves the wrapped state as it was (its moments never take a
non-finite value) and returns NaN updates, which ``optax.apply_if_finite`` drops. The
statistics a transform needs before the adam runs (the clipped fraction, the per-tensor RMS,
the finiteness check) come from one reduction over the gradients and ``nu``, and the
non-finite gate is one ``lax.cond`` on a scalar, not a select over the moments (on a GPU, where a
conditional is a host sync, a select fused into the adam's kernels). The elementwise
clips write the clipped gradients (NaN on a held step) in one pass ahead of the adam, which
reads them as it would the gradients; StableAdamW's per-tensor factor fuses into the adam's
update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip._core import checks, handout, leafvec, norms
from optclip._core import stats as stats_lib

__all__ = ["AdamWClipState", "SpamClipState", "StableAdamWClipState", "adamw_clip",
           "spam_clip", "stable_adamw_clip"]


@stats_lib.diagnostic("spam_clip", ("clipped_fraction", "clip_active", "reset", "resets",
                                    "nonfinite"))
class SpamClipState(NamedTuple):
    inner: Any                  # the wrapped optimizer's state
    count: jax.Array            # int32 steps so far (the clock of the resets)
    clipped_fraction: jax.Array  # fraction of elements clipped at the last step
    clip_active: jax.Array      # bool: clipping was active at the last step
    reset: jax.Array            # bool: the moments were reset at the last step
    resets: jax.Array           # int32 resets so far
    nonfinite: jax.Array        # int32 steps with a NaN/Inf gradient (inner state kept)


@stats_lib.diagnostic("adamw_clip", ("clipped_fraction", "clip_active", "nonfinite"))
class AdamWClipState(NamedTuple):
    inner: Any
    clipped_fraction: jax.Array  # fraction of elements clipped at the last step
    clip_active: jax.Array       # bool: clipping was active at the last step
    nonfinite: jax.Array


@stats_lib.diagnostic("stable_adamw_clip", ("rms", "scale", "clipped", "nonfinite"),
                      per_leaf=("rms", "scale", "clipped"))
class StableAdamWClipState(NamedTuple):
    inner: Any
    rms: jax.Array      # (F,) per leaf: RMS(g^2 / nu_hat) at the last step
    scale: jax.Array    # (F,) per leaf: 1 / max(1, rms), the factor the update was multiplied by
    clipped: jax.Array  # (F,) per leaf: bool, scale < 1
    nonfinite: jax.Array


def _is_moment_state(x: Any) -> bool:
    fields = getattr(x, "_fields", None)
    return isinstance(x, tuple) and fields is not None and "mu" in fields and "nu" in fields


def _moment_state(state: Any) -> Any:
    """The one state ``NamedTuple`` with ``mu`` and ``nu`` fields inside ``state``."""
    found = [x for x in jax.tree.leaves(state, is_leaf=_is_moment_state) if _is_moment_state(x)]
    if len(found) != 1:
        raise ValueError(
            "the wrapped optimizer's state must hold exactly one adam-style state (a NamedTuple "
            f"with fields 'mu' and 'nu', e.g. optax.ScaleByAdamState); found {len(found)}. "
            "Wrap an optimizer such as optax.adam(...) or optax.adamw(...).")
    if "count" not in found[0]._fields:
        raise ValueError(f"{type(found[0]).__name__} has no 'count' field for bias correction")
    return found[0]


def _map_moment_state(fn: Callable[[Any], Any], state: Any) -> Any:
    return jax.tree.map(lambda x: fn(x) if _is_moment_state(x) else x, state,
                        is_leaf=_is_moment_state)


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"inner must be an optax.GradientTransformation (e.g. optax.adam(...)), "
                        f"got {inner!r}")
    return optax.with_extra_args_support(inner)


def _nu_tree(updates: Any, nu: Any) -> Any:
    """``nu`` with the structure of ``updates`` (its entry at every leaf)."""
    treedef = jax.tree.structure(updates)
    try:
        return treedef.unflatten(treedef.flatten_up_to(nu))
    except (ValueError, TypeError) as err:
        raise ValueError("the adam state's 'nu' does not have the structure of the updates; "
                         "wrap the optimizer that sees these updates") from err


def _passthrough(out: Any, updates: Any) -> Any:
    """``out`` with the non-floating leaves of ``updates`` as they were (integer leaves pass
    through every optclip transform; the wrapped optimizer would turn them into floats)."""
    return jax.tree.map(lambda o, u: o if norms.is_float(u) else u, out, updates)


def _sqrt_nu(v: jax.Array, leaf: jax.Array) -> jax.Array:
    """``sqrt(nu)`` of one leaf in its statistics dtype (a root before any product, so a
    threshold times ``nu`` never overflows where ``nu`` itself is finite)."""
    return norms.safe_sqrt(_cast(v, norms.acc_dtype(leaf.dtype)))


def _bias_correction(b2: Any, count: jax.Array) -> jax.Array:
    """``1 - b2**count`` in float32 (1 where ``count`` is 0, so nothing divides by 0)."""
    count = count.astype(jnp.float32)
    return jnp.where(count > 0, 1 - jnp.asarray(b2, jnp.float32) ** count, 1.0)


Limit = Callable[[jax.Array, jax.Array], jax.Array]


def _clip(g: jax.Array, v: jax.Array, limit: Limit, active: jax.Array) -> jax.Array:
    """``g`` clipped elementwise to ``[-c, c]`` with ``c = limit(g, nu)`` where the scalar
    ``active`` holds and ``nu > 0``, else ``g`` as it is. An element whose ``nu`` is 0 has no
    history to be a spike against: its gradients so far were all 0 (an embedding row of a
    token not seen yet, a unit that was inactive), and a threshold of 0 (or of the minimum)
    would cut its first gradients to nothing, which keeps ``nu`` at 0 and the element from
    ever training. Per-leaf arithmetic here and below is written in ``lax`` operations: the
    same operations as ``jnp``'s, which trace several times slower."""
    thr = limit(g, v)
    wide = _cast(g, norms.acc_dtype(g.dtype))
    seen = jax.lax.gt(v, jnp.zeros((), v.dtype))
    over = jax.lax.bitwise_and(jax.lax.bitwise_and(active, seen),
                               jax.lax.gt(jax.lax.abs(wide), thr))
    return _cast(jax.lax.select(over, jax.lax.mul(jax.lax.sign(wide), thr), wide), g.dtype)


def _clipped(updates: Any, nu: Any, limit: Limit, active: jax.Array,
             finite: jax.Array) -> Any:
    """:func:`_clip` of every floating leaf of ``updates`` against its ``nu``, NaN everywhere
    unless the scalar ``finite`` holds (the updates of a held step)."""
    return jax.tree.map(lambda g, v: _nan_unless(finite, _clip(g, v, limit, active))
                        if norms.is_float(g) else g, updates, nu)


def _squared_excess(g: jax.Array, v: jax.Array, inv_width: jax.Array,
                    floor: jax.Array) -> jax.Array:
    """``(g / w)**2 - max(min(nu, M), f)`` (``M`` the largest value of the dtype): positive
    exactly where ``|g| > w sqrt(nu)`` (or ``> w sqrt(f)``), up to rounding at the threshold,
    for the scalars ``1 / w`` and ``f``. No root and no absolute value (the cheap operations
    of XLA:CPU's fast reduction).
    Never NaN for a finite ``g``: a square that overflows is an element far above the
    threshold, and an adam's ``nu`` that overflowed to ``inf`` (gradients above about
    ``1.8e19`` in float32) counts as ``M`` (a product ``inf * 0`` or a difference
    ``inf - inf`` would be NaN, which XLA's own reduction keeps and XNNPACK's maximum drops:
    the step's decision would depend on the leaf's size). The one approximation: such an
    element with a square above ``M`` too counts as clipped, where :func:`_clip` leaves it (its
    threshold is ``inf``)."""
    # Through a barrier with the leaf (norms.apart): no broadcast of these scalars is shared
    # with the reductions of other leaves of this shape.
    dtype = norms.acc_dtype(g.dtype)
    g, v, inv_width, floor, cap = norms.apart(g, v, inv_width, floor,
                                              np.array(np.finfo(dtype).max, dtype))
    wide = _cast(g, dtype)
    return jax.lax.sub(jax.lax.square(jax.lax.mul(wide, _cast(inv_width, dtype))),
                       jax.lax.max(jax.lax.min(_cast(v, dtype), cap), _cast(floor, dtype)))


def _clip_fraction(updates: Any, nu: Any, excess: Limit, active: jax.Array,
                   axis_name: norms.AxisName) -> tuple[jax.Array, jax.Array]:
    """The fraction of elements that :func:`_clip` changes, and whether every gradient is
    finite, from one reduction per leaf (of ``g`` and ``nu``, nothing written out).

    Each element adds ``sign(max(excess(g, nu), 0)) * sign(nu)`` (1 where ``excess``, a
    :func:`_squared_excess`, is positive and ``nu > 0``, as :func:`_clip` decides, else 0) and
    ``g * 0`` (NaN for a NaN/Inf element,
    else 0): arithmetic that XLA:CPU fuses into its fast reduction, where a comparison or a
    select would first be written out as an array the size of the leaf. ``active`` applies
    after the sum.
    """
    pairs = [(g, v) for g, v in zip(jax.tree.leaves(updates), jax.tree.leaves(nu))
             if norms.is_float(g)]
    split = norms.split_axes([g for g, _ in pairs], axis_name)

    def hits(g, v):
        wide = _cast(g, norms.acc_dtype(g.dtype))
        # The zero through a barrier with the leaf, as in _squared_excess.
        wide, zero = norms.apart(wide, np.zeros((), wide.dtype))
        seen = jax.lax.sign(_cast(v, wide.dtype))
        return _cast(jax.lax.add(jax.lax.mul(jax.lax.sign(jax.lax.max(excess(g, v), zero)), seen),
                                 stats_lib.nan_marks(wide)), jnp.float32)

    partials = norms.leaf_reductions([hits(g, v) for g, v in pairs], lambda x: x)
    total = norms.tree_sum(partials, split)
    size = sum(g.size * norms.axes_size(axes) for (g, _), axes in zip(pairs, split))
    fraction = jnp.where(active, total / max(size, 1), jnp.zeros_like(total))
    return fraction.astype(norms.stat_dtype(updates)), jnp.isfinite(total)


def _gated_step(inner, finite, updates, inner_state, params, extra_args, prepare=None, *,
                held_nan=False):
    """``inner.update`` on ``updates`` and the ``prepare``'d state where ``finite`` holds; else
    NaN updates (``optax.apply_if_finite`` drops them) and ``inner_state`` as it was.

    One ``lax.cond`` (:func:`optclip._core.stats.run_or_hold`; a select on a GPU), no pass
    over the moments. The held branch hands its operands back unchanged: XLA then keeps every
    output in the buffer of the operand it replaces (with donated buffers, a branch that
    builds new arrays makes XLA copy outputs after the cond). The NaN updates come from a
    select after the cond, or, with ``held_nan``, from ``updates`` themselves (the caller wrote
    them NaN on a held step in a pass it makes anyway). The held branch takes its output types
    from the traced update when that was traced first (the wrapped optimizer is traced once).
    """
    traced = []

    def run():
        s = inner_state if prepare is None else prepare(inner_state)
        result = inner.update(updates, s, params, **extra_args)
        traced.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                                  jnp.result_type(x)), result))
        return result

    def hold():
        shapes = traced[0] if traced else jax.eval_shape(run)
        return (stats_lib.cast_like(shapes[0], updates),
                stats_lib.cast_like(shapes[1], inner_state))

    out, new_inner = stats_lib.run_or_hold(finite, run, hold)
    if not held_nan:
        out = jax.tree.map(lambda o: _nan_unless(finite, o) if norms.is_float(o) else o, out)
    return _passthrough(out, updates), new_inner


def _nan_unless(ok: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` where the scalar ``ok`` holds, else NaN: ``x`` times ``1/1`` or ``0/0`` (exact,
    ``-0.0`` included). No NaN is formed on a finite step, which ``jax_debug_nans`` would flag
    outside ``jax.jit``, as it would an array of NaN made for a select."""
    flag = jnp.asarray(ok, x.dtype)
    return x * (flag / flag)


def _commit(finite: jax.Array, new: Any, old: Any) -> Any:
    """:func:`optclip._core.stats.commit` of the wrapper's own fields; the wrapped state was
    gated by :func:`_gated_step` already."""
    own = stats_lib.commit(finite, new._replace(inner=None), old._replace(inner=None))
    return own._replace(inner=new.inner)


def _reset_moments(moments):
    """SPAM's momentum reset: the adam's ``mu``, ``nu`` and ``count`` zeroed."""
    return moments._replace(mu=optax.tree.zeros_like(moments.mu),
                            nu=optax.tree.zeros_like(moments.nu),
                            count=jnp.zeros_like(moments.count))


def spam_clip(
    inner: optax.GradientTransformation,
    threshold: checks.ScalarOrSchedule = 5000.0,
    clip_after: int = 20,
    reset_interval: int | None = None,
    *,
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """SPAM's spike-aware clipping (and optional momentum reset) in front of an adam.

    With ``nu`` the wrapped adam's second moment before this step (the raw EMA of ``g**2``,
    as SPAM), every element with ``g**2 > threshold * nu`` and ``nu > 0`` is a spike and is
    replaced by ``sign(g) * sqrt(threshold * nu)``; the clipped gradient then updates the
    adam. An element whose ``nu`` is 0 (all its gradients so far were 0) has no history to
    spike against and is not clipped. The
    threshold is relative to each element's own history: ``threshold=5000`` lets an element
    reach ``sqrt(5000) ~ 71`` times its RMS. Clipping is active from step ``clip_after`` on
    (1-based; ``nu`` needs some steps to mean anything).

    With ``reset_interval=K``, every ``K``-th step (1-based) first zeroes the adam's ``mu``,
    ``nu`` and ``count`` (SPAM's momentum reset, which flushes whatever a spike left in the
    moments), and clipping pauses for the first ``clip_after`` steps of each period, as SPAM
    (the reset step itself, against the zeroed moments, is never clipped).

    Args:
      inner: an adam-style optimizer (``optax.adam``, ``optax.adamw``, a chain containing one,
        ``inject_hyperparams`` of one); extra arguments are forwarded to it.
      threshold: ``theta``, ``> 0``; a float or a schedule of the step count.
      clip_after: the first (1-based) step of each period with clipping, ``>= 0``.
      reset_interval: the period of the momentum reset, ``>= 1``, or ``None`` (no reset).
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) (a name or a tuple) the
        leaves are split over: the clipped fraction and the finiteness check are combined
        across devices with ``psum``, so every device keeps the same state. Not needed under
        ``jax.jit`` with sharded arrays.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``optclip.stats`` reports
      ``spam_clip/clipped_fraction`` (of all elements, last step), ``clip_active``, ``reset``,
      ``resets`` and ``nonfinite``.

    References:
      Huang et al., "SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM Training",
      ICLR 2025 (arXiv 2501.06842); defaults as its reference code and pytorch-optimizer
      4.1's ``SPAM`` (``threshold=5000``, ``grad_accu_steps=20``, reset every 500 steps
      there). Differences: the reset also zeroes adam's ``count``, so bias correction restarts
      with the moments (SPAM keeps its step count, which makes the first updates after a reset
      too large, and damps them with a cosine warm-up of the learning rate instead); an
      element with ``nu = 0`` is not clipped (the reference clips it to
      ``sqrt(threshold * 0) = 0``, which keeps its ``nu`` at 0: an element whose gradients
      were 0 up to step ``clip_after``, an embedding row of a token not seen yet, never
      trains until a reset); SPAM's sparse-momentum masks are not part of this transform.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.spam_clip(optax.adam(1e-3), clip_after=2)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for g in [[1.0, 1.0], [1.0, 1.0], [1.0, 1e4]]:
      ...     _, state = tx.update({"w": jnp.array(g)}, state, params)
      >>> round(float(optclip.stats(state)["spam_clip/clipped_fraction"]), 2)
      0.5
    """
    inner = _check_inner(inner)
    checks.positive("threshold", threshold, allow_schedule=True)
    checks.integer("clip_after", clip_after, low=0)
    checks.integer("reset_interval", reset_interval, low=1, allow_none=True)
    norms.check_axis_name(axis_name)

    def init_fn(params):
        inner_state = inner.init(params)
        _moment_state(inner_state)
        zero = jnp.zeros((), jnp.int32)
        return stats_lib.own_buffers(SpamClipState(
            inner_state, zero, jnp.zeros((), norms.stat_dtype(params)), jnp.zeros((), bool),
            jnp.zeros((), bool), zero, zero))

    def update_fn(updates, state, params=None, **extra_args):
        step = optax.safe_increment(state.count)
        reset = (jnp.zeros((), bool) if reset_interval is None
                 else step % reset_interval == 0)
        in_period = step if reset_interval is None else step % reset_interval
        # A reset step clips nothing: against the zeroed moments no element has a history.
        active = (step >= clip_after) & (in_period >= clip_after) & ~reset
        root_theta = norms.safe_sqrt(checks.resolve(threshold, state.count,
                                                    norms.stat_dtype(updates), name="threshold"))
        nu = _nu_tree(updates, _moment_state(state.inner).nu)

        inv_width, zero = 1 / root_theta, jnp.zeros_like(root_theta)

        def limit(g, v):
            s = _sqrt_nu(v, g)
            return jax.lax.mul(_cast(root_theta, s.dtype), s)

        def excess(g, v):
            return _squared_excess(g, v, inv_width, zero)

        def prepare(inner_state):
            if reset_interval is None:
                return inner_state
            return stats_lib.keep_if(reset, _map_moment_state(_reset_moments, inner_state),
                                     inner_state)

        fraction, finite = _clip_fraction(updates, nu, excess, active, axis_name)
        out, new_inner = _gated_step(inner, finite, _clipped(updates, nu, limit, active, finite),
                                     state.inner, params, extra_args, prepare, held_nan=True)
        return out, _commit(finite, SpamClipState(
            inner=new_inner, count=step, clipped_fraction=fraction, clip_active=active,
            reset=reset, resets=stats_lib.tally(state.resets, reset),
            nonfinite=state.nonfinite), state)

    return checks.transformation(init_fn, update_fn, extra_args=True)


def adamw_clip(
    inner: optax.GradientTransformation,
    sigmas: checks.ScalarOrSchedule = 3.0,
    min_threshold: float = 1e-10,
    warmup_steps: int = 0,
    b2: float = 0.999,
    *,
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """AdamWClip: clip each element at ``sigmas`` times its RMS from adam's second moment.

    ``g <- clip(g, -c, c)`` elementwise with ``c = max(sigmas * sqrt(nu / (1 - b2**t)),
    min_threshold)``, where ``nu`` is the wrapped adam's second moment before this step and
    ``t`` the number of gradients it holds (so ``nu / (1 - b2**t)`` is its bias-corrected
    value), for every element with ``nu > 0`` (one whose gradients so far were all 0 has no
    history and is not clipped); the clipped gradient then updates the adam. The threshold
    scales with the gradients (it is equivariant to rescaling them), so one ``sigmas`` suits
    every model, and it costs no memory beyond adam's own.

    Args:
      inner: an adam-style optimizer (see :func:`spam_clip`); extra arguments are forwarded.
      sigmas: the threshold in standard deviations, ``> 0``; a float or a schedule of the
        adam's step count.
      min_threshold: the smallest threshold, ``>= 0``.
      warmup_steps: the first steps without clipping, ``>= 0``.
      b2: the wrapped adam's ``b2`` (for the bias correction of ``nu``), in ``[0, 1)``.
      axis_name: as in :func:`spam_clip`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``optclip.stats`` reports
      ``adamw_clip/clipped_fraction``, ``clip_active`` and ``nonfinite``.

    References:
      AdamWClip 0.1.4 (github.com/wandeln/AdamWClip, PyTorch), parameters ``clip_grad_adapt``
      (``sigmas``), ``clip_grad_min`` and ``clip_grad_warm_up``. Difference: the reference
      also clips where ``nu`` is 0 (at its first step every element, later any element whose
      gradients were all 0 so far) and so cuts such a gradient to ``min_threshold`` (1e-10),
      after which its threshold grows about 2% a step (below 1e-3 for about a thousand steps,
      a gradient of unit size); here an element with ``nu = 0`` is never clipped.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.adamw_clip(optax.adam(1e-3), sigmas=3.0)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for g in [[1.0, 1.0], [1.0, 50.0]]:
      ...     _, state = tx.update({"w": jnp.array(g)}, state, params)
      >>> float(optclip.stats(state)["adamw_clip/clipped_fraction"])
      0.5
    """
    inner = _check_inner(inner)
    checks.positive("sigmas", sigmas, allow_schedule=True)
    checks.non_negative("min_threshold", min_threshold)
    checks.integer("warmup_steps", warmup_steps, low=0)
    checks.in_range("b2", b2, 0.0, 1.0, high_inclusive=False)
    norms.check_axis_name(axis_name)

    def init_fn(params):
        inner_state = inner.init(params)
        _moment_state(inner_state)
        return AdamWClipState(inner_state, jnp.zeros((), norms.stat_dtype(params)),
                              jnp.zeros((), bool), jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        moments = _moment_state(state.inner)
        seen = moments.count  # gradients the adam has seen before this step
        active = (seen > 0) & (seen + 1 > warmup_steps)
        stat = norms.stat_dtype(updates)
        root_correction = jnp.sqrt(_bias_correction(b2, seen)).astype(stat)
        width = checks.resolve(sigmas, seen, stat, name="sigmas") / root_correction
        nu = _nu_tree(updates, moments.nu)

        def limit(g, v):
            s = _sqrt_nu(v, g)
            return jax.lax.max(jax.lax.mul(_cast(width, s.dtype), s),
                               jnp.asarray(min_threshold, s.dtype))

        inv_width = 1 / width
        # Capped at the dtype's largest value: an overflow to inf (a tiny sigmas) would make
        # the test inf - inf, NaN, and hold the step.
        floor = jnp.minimum(jnp.square(jnp.asarray(min_threshold, stat) * inv_width),
                            jnp.finfo(stat).max)

        def excess(g, v):
            return _squared_excess(g, v, inv_width, floor)

        fraction, finite = _clip_fraction(updates, nu, excess, active, axis_name)
        out, new_inner = _gated_step(inner, finite, _clipped(updates, nu, limit, active, finite),
                                     state.inner, params, extra_args, held_nan=True)
        return out, _commit(finite, AdamWClipState(
            inner=new_inner, clipped_fraction=fraction, clip_active=active,
            nonfinite=state.nonfinite), state)

    return checks.transformation(init_fn, update_fn, extra_args=True)


def stable_adamw_clip(
    inner: optax.GradientTransformation,
    b2: float = 0.999,
    eps: float = 1e-6,
    *,
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """StableAdamW's update clipping: divide each tensor's update by ``max(1, RMS)``.

    After the wrapped adam has taken the gradient ``g`` into its second moment ``nu`` (count
    ``t``), each tensor (leaf) ``i`` gets ``RMS_i = sqrt(mean(g_i**2 / max(nu_hat_i, eps**2)))``
    with ``nu_hat = nu / (1 - b2**t)``, and its update is multiplied by ``1 / max(1, RMS_i)``.
    ``RMS_i`` is about 1 when the gradient matches its history and grows when a tensor's
    gradient suddenly exceeds what ``nu`` has seen, which is when adam's update would be too
    large (Adafactor's update clipping, moved into AdamW as a per-tensor learning-rate factor).
    The gradient itself, and so adam's state, is not changed.

    The new ``nu`` is formed here as the adam forms it, ``b2 * nu + (1 - b2) * g**2`` from the
    ``nu`` before the step, in one read of ``g`` and ``nu`` ahead of the adam's pass, so the
    factor fuses into the adam's update (``b2`` must be the adam's; an adam that sees a
    different gradient, e.g. behind a clip inside the wrapped chain, is measured against ``g``).

    Args:
      inner: an adam-style optimizer (see :func:`spam_clip`); extra arguments are forwarded.
      b2: the wrapped adam's ``b2`` (it forms ``nu_hat``), in ``[0, 1)``.
      eps: floor of ``sqrt(nu_hat)`` in the ratio, ``>= 0`` (below the smallest normal
        number of the statistics dtype, that number: a zero gradient has ratio 0).
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) (a name or a tuple) the
        leaves are split over: each tensor's sum of squared ratios is combined across
        devices with ``psum``, so every device keeps the same state. Not needed under
        ``jax.jit`` with sharded arrays.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. Its state keeps ``rms``, ``scale`` and
      ``clipped`` per leaf, each as one vector over the floating leaves
      (:func:`optclip.per_leaf` gives a tree); ``optclip.stats`` reports
      ``stable_adamw_clip/rms_max``, ``rms_mean``, ``scale_max``, ``scale_mean``,
      ``clipped_frac`` (of the leaves) and ``nonfinite``.

    References:
      Wortsman et al., "Stable and low-precision training for large-scale vision-language
      models", NeurIPS 2023 (arXiv 2304.13013), StableAdamW; optimi 0.2 ``StableAdamW``.
      With ``optax.adamw`` the factor also scales the weight decay of that tensor, as a
      per-tensor learning rate does in optimi.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.stable_adamw_clip(optax.adam(1e-3))
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for g in [[1.0, 1.0], [1.0, 1.0], [30.0, 30.0]]:
      ...     _, state = tx.update({"w": jnp.array(g)}, state, params)
      >>> bool(state.clipped[0]), round(float(state.scale[0]), 3)
      (True, 0.578)
    """
    inner = _check_inner(inner)
    checks.in_range("b2", b2, 0.0, 1.0, high_inclusive=False)
    checks.non_negative("eps", eps, finite=True)
    norms.check_axis_name(axis_name)

    def init_fn(params):
        inner_state = inner.init(params)
        _moment_state(inner_state)
        return StableAdamWClipState(inner_state, leafvec.full(params, 0.0),
                                    leafvec.full(params, 1.0),
                                    leafvec.full(params, False, jnp.bool_),
                                    jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        moments = _moment_state(state.inner)
        correction = _bias_correction(b2, moments.count + 1)
        rms = _update_rms(updates, _nu_tree(updates, moments.nu), b2, correction, eps,
                          axis_name)
        # Each leaf's RMS and factor in its own statistics dtype, taken on the vectors; each
        # leaf is handed its factor (no kernel per leaf for them).
        leaves, treedef = jax.tree.flatten(updates)
        group_list = leafvec.groups(leaves)
        rms_parts = [leafvec.take(rms, group) for group in group_list]
        scale_parts = [1 / jnp.maximum(1.0, r) for r in rms_parts]
        rms_vector = leafvec.assemble(rms_parts, group_list, state.rms)
        # The RMS sees every NaN/Inf of the gradients: no separate pass to find them.
        finite = jnp.all(jnp.isfinite(rms_vector))
        out, new_inner = _gated_step(inner, finite, updates, state.inner, params, extra_args)
        outs = treedef.flatten_up_to(out)
        for group, part in zip(group_list, scale_parts):
            for i, (factor,) in zip(group.leaves, handout.rows((part,))):
                outs[i] = norms.scale(outs[i], factor)
        scale = leafvec.assemble(scale_parts, group_list, state.scale)
        return treedef.unflatten(outs), _commit(finite, StableAdamWClipState(
            inner=new_inner, rms=rms_vector, scale=scale,
            clipped=scale < 1, nonfinite=state.nonfinite), state)

    return checks.transformation(init_fn, update_fn, extra_args=True, pairs_leaves=True)


def _update_rms(updates: Any, nu: Any, b2: float, correction: jax.Array, eps: float,
                axis_name: norms.AxisName) -> jax.Array:
    """Per floating leaf, ``RMS(g / max(sqrt(nu_hat), eps))`` with ``nu_hat`` the adam's second
    moment after it takes ``g`` in, ``(b2 nu + (1 - b2) g**2) / correction``, computed from
    ``g`` and the ``nu`` before the step: one read of both, before the adam's own pass, so that
    the per-leaf factor fuses into the adam's update. One vector over the floating leaves, in
    the tree's statistics dtype: the leaves' sums gathered, then finished once.

    Plain sums of squares cannot overflow here: ``nu_new >= (1 - b2) g**2``, so every ratio is
    at most ``sqrt(correction / (1 - b2))`` in magnitude (about 32 for ``b2 = 0.999``), and a
    ``g**2`` beyond the dtype's range makes ``nu_new`` infinite and the ratio 0. ``eps`` is
    taken as at least the dtype's smallest normal number: with ``eps = 0`` an all-zero
    gradient would be ``0 / 0``.
    """
    def ratio(g, v):
        # lax operations, as in _clip. The root of the correction is taken per leaf: one root
        # shared by every leaf compiled to results differing from these in the last bit.
        wide = norms.acc_dtype(g.dtype)
        # The scalars through a barrier with the leaf, as in _squared_excess.
        g, v, b2_, rest, root_c, eps_ = norms.apart(
            g, v, jnp.asarray(b2, wide), jnp.asarray(1 - b2, wide),
            _cast(jax.lax.sqrt(correction), wide),
            jnp.maximum(jnp.asarray(eps, wide), jnp.finfo(wide).tiny))
        x = _cast(g, wide)
        v_new = jax.lax.add(jax.lax.mul(b2_, _cast(v, wide)), jax.lax.mul(rest, jax.lax.square(x)))
        root = jax.lax.div(norms.safe_sqrt(v_new), root_c)
        return jax.lax.div(x, jax.lax.max(root, eps_))

    pairs = [(g, v) for g, v in zip(jax.tree.leaves(updates), jax.tree.leaves(nu))
             if norms.is_float(g)]
    dtype = norms.stat_dtype(updates)
    if not pairs:
        return jnp.zeros((0,), dtype)
    split = norms.split_axes([g for g, _ in pairs], axis_name)
    sizes = np.asarray([max(g.size * norms.axes_size(axes), 1)
                        for (g, _), axes in zip(pairs, split)], dtype)
    partials = norms.leaf_reductions([ratio(g, v) for g, v in pairs], jnp.square)
    sums = norms.gather_scalars([norms.across(p, "sum", axes).astype(dtype)
                                 for p, axes in zip(partials, split)])
    return norms.safe_sqrt(sums / sizes)


def _cast(x: jax.Array, dtype) -> jax.Array:
    """``x`` in ``dtype`` (no operation when it is already)."""
    return x if x.dtype == dtype else jax.lax.convert_element_type(x, dtype)
