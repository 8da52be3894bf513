"""Skip spike steps: a wrapper that leaves the whole optimizer untouched on a flagged step.

Clipping in front of adam still writes the (clipped) spike into adam's moments, and the damage
lasts about ``1 / (1 - b2)`` steps. :func:`skip_spikes` instead wraps the optimizer (typically
the whole ``optax.chain(..., adam)``): on a step its detector flags, it returns zero updates and
the wrapped state, moments, step counts and schedules included, bitwise as it was. Otherwise it
is exactly the wrapped transformation.

The detectors follow the large JAX training stacks (MaxText's skip-step-on-spikes, Levanter's
skip-bad-steps, AXLearn's drop-norm; ``optax.apply_if_finite`` for non-finite values) and the
z-score statistics of ZClip (arXiv 2504.02507).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import checks, norms, running
from optclip._core import stats as stats_lib

__all__ = ["SkipSpikesState", "skip_spikes"]

Detector = Literal["zscore", "mad"]
_DETECTORS = ("zscore", "mad")
# The MAD of a normal sample times this is its standard deviation: robust scores read like
# z-scores.
_MAD_TO_STD = 1.4826


class ZScoreStats(NamedTuple):
    mean: jax.Array   # exponentially weighted mean of the accepted values
    std: jax.Array    # square root of the exponentially weighted variance of the accepted values


class WindowStats(NamedTuple):
    history: jax.Array  # (window,) ring buffer of the last accepted values


@stats_lib.diagnostic("skip_spikes", ("skipped", "consecutive", "total_skipped", "score",
                                      "threshold", "norm", "loss_score", "forced",
                                      "nonfinite"))
class SkipSpikesState(NamedTuple):
    inner: Any                # the wrapped transformation's state (unchanged on skipped steps)
    accepted: jax.Array       # int32 steps accepted (fed into the statistics and to ``inner``;
                              # the clock of schedule thresholds)
    norm_stats: Any           # ZScoreStats or WindowStats of the global gradient norm
    loss_stats: Any           # the same statistics of the ``loss`` extra argument
    skipped: jax.Array        # bool: the last step was skipped
    consecutive: jax.Array    # int32 skipped steps in a row, up to the last one
    total_skipped: jax.Array  # int32 skipped steps so far
    score: jax.Array          # last step's norm score (the larger of the two with ``loss``)
    threshold: jax.Array      # the gradient-norm score threshold in force at the last step
    norm: jax.Array           # last step's global gradient norm
    loss_score: jax.Array     # last step's loss score (0 without ``loss``)
    forced: jax.Array         # int32 flagged steps accepted because of ``max_consecutive``
    nonfinite: jax.Array      # int32 steps skipped for NaN/Inf gradients or loss


def _zscore_detector(alpha: float, eps: float):
    def init(dtype):
        return ZScoreStats(jnp.zeros((), dtype), jnp.zeros((), dtype))

    def score(stats, value, accepted):
        del accepted
        return (value - stats.mean) / (stats.std + eps)

    def update(stats, value, accepted):
        # Running mean and variance while fewer than 1 / (1 - alpha) values were seen (no
        # zero-initialisation bias), an EMA with weight 1 - alpha after that.
        weight = jnp.maximum(1.0 / (accepted + 1).astype(value.dtype), 1 - alpha)
        delta = value - stats.mean
        mean = stats.mean + weight * delta
        # var <- (1 - w) (var + w delta^2), kept as its root and computed relative to the larger
        # of std and |delta|: norms near the dtype's range (whose squares overflow) give the
        # same scores as small ones.
        top = jnp.maximum(stats.std, jnp.abs(delta))
        top = jnp.where((top > 0) & jnp.isfinite(top), top, jnp.ones_like(top))
        std = top * norms.safe_sqrt((1 - weight) * (jnp.square(stats.std / top)
                                                    + weight * jnp.square(delta / top)))
        return ZScoreStats(mean.astype(stats.mean.dtype), std.astype(stats.std.dtype))

    return init, score, update


def _mad_detector(window: int, eps: float):
    def init(dtype):
        return WindowStats(jnp.zeros((window,), dtype))

    def score(stats, value, accepted):
        filled = jnp.minimum(accepted, window)
        median = running.history_quantile(stats.history, filled, 0.5)
        mad = running.history_quantile(jnp.abs(stats.history - median), filled, 0.5)
        return (value - median) / (_MAD_TO_STD * mad + eps)

    def update(stats, value, accepted):
        return WindowStats(stats.history.at[accepted % window].set(value))

    return init, score, update


def skip_spikes(
    inner: optax.GradientTransformation,
    detector: Detector = "zscore",
    threshold: checks.ScalarOrSchedule = 6.0,
    *,
    alpha: float = 0.98,
    window: int = 100,
    warmup_steps: int = 20,
    loss_threshold: checks.ScalarOrSchedule | None = None,
    max_consecutive: int | None = 5,
    eps: float = 1e-8,
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """Skip the steps whose gradient norm (or loss) spikes; leave ``inner`` untouched on them.

    Each step computes the global gradient norm ``n`` and a score against the statistics of
    the norms of earlier accepted steps:

    * ``detector="zscore"``: ``s = (n - mean) / (std + eps)`` with an exponentially weighted
      mean and variance (decay ``alpha``; a plain running mean and variance over the first
      ``1 / (1 - alpha)`` accepted steps), the z-score of ZClip and AXLearn.
    * ``detector="mad"``: ``s = (n - median) / (1.4826 * MAD + eps)`` over the last ``window``
      accepted norms, a robust rolling-window rule in the spirit of MaxText and Levanter
      (``1.4826 * MAD`` is the standard deviation of normal data, so thresholds read alike).

    A step is flagged when ``s > threshold`` (once ``warmup_steps`` steps were accepted), when
    a ``loss`` extra argument is passed and its own score (same detector, separate statistics)
    exceeds ``loss_threshold``, or when the gradients or the loss hold a NaN/Inf. A flagged
    step returns zero updates and leaves ``inner``'s state bitwise unchanged; every other step
    is exactly ``inner``. Skipped steps never enter the statistics. After ``max_consecutive``
    skipped steps in a row the next flagged step with finite values is accepted (it enters the
    statistics, so the detector follows a genuine change of scale) and counted in ``forced``;
    non-finite steps are always skipped.

    The decision is taken on scalars before ``inner`` runs, and one ``lax.cond`` on it either
    runs ``inner`` (updating its state in place) or hands the state back as it was; the updates
    are then zeroed on a skipped step by an elementwise select, which fuses into the next pass
    over them (``optax.apply_updates``). An accepted step costs ``inner`` plus one read of the
    gradients for their norm, a skipped step almost nothing (under ``jax.vmap`` the cond
    becomes a select and both run). On a GPU, where a conditional is a host sync, the gate is a
    select fused into ``inner``'s kernels: ``inner`` runs every step and a skipped one keeps
    its old state. On a skipped step adamw's weight decay is skipped too.

    Args:
      inner: the transformation to protect, usually the whole optimizer (a chain ending in
        adam, ``inject_hyperparams(adamw)(...)``, ...). Extra arguments are forwarded to it.
      detector: ``"zscore"`` or ``"mad"``.
      threshold: score above which a step is flagged, ``> 0``; a float or a schedule of the
        number of steps accepted so far (a skipped step does not advance it, as it does not
        advance the inner optimizer's count).
      alpha: EMA decay of the z-score statistics, in ``[0, 1)``.
      window: number of accepted norms the ``"mad"`` detector keeps, ``>= 2``.
      warmup_steps: accepted steps before anything but non-finite values is flagged,
        ``>= 2``.
      loss_threshold: the loss score threshold (a float or a schedule); ``None`` uses
        ``threshold``. Only used on steps that pass ``loss=...``.
      max_consecutive: the most steps skipped in a row, ``>= 1``, or ``None`` for no limit.
      eps: added to the spread of the statistics, ``>= 0``.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) (a name or a tuple) the
        gradients are split over: the norm is combined across devices with ``psum`` and a
        ``loss`` that differs between devices is averaged over them, so every device takes the
        same decision and keeps the same state. ``inner`` gets its own ``axis_name`` where it
        needs one. Not needed under ``jax.jit`` with sharded arrays.

    Returns:
      An ``optax.GradientTransformationExtraArgs``: ``update(updates, state, params=None,
      *, loss=None, **extra_args)``. ``optclip.stats`` reports ``skip_spikes/skipped``,
      ``consecutive``, ``total_skipped``, ``score``, ``threshold``, ``norm``, ``loss_score``,
      ``forced`` and ``nonfinite``.

    References:
      ``optax.apply_if_finite`` (non-finite steps only); MaxText ``skip_step_on_spikes``;
      Levanter ``skip_bad_steps``; Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM
      Pre-Training", arXiv 2504.02507 (the z-score of the gradient norm).

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.skip_spikes(optax.adam(0.1), warmup_steps=3)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for g in [1.0, 1.1, 0.9, 1.0, 50.0]:
      ...     updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
      >>> updates["w"].tolist(), int(state.total_skipped)
      ([0.0, 0.0], 1)
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"inner must be an optax.GradientTransformation, got {inner!r}")
    checks.static("detector", detector)
    checks.one_of("detector", detector, _DETECTORS)
    checks.positive("threshold", threshold, allow_schedule=True)
    checks.positive("loss_threshold", loss_threshold, allow_schedule=True, allow_none=True)
    checks.in_range("alpha", alpha, 0.0, 1.0, high_inclusive=False)
    checks.integer("window", window, low=2)
    checks.integer("warmup_steps", warmup_steps, low=2)
    checks.integer("max_consecutive", max_consecutive, low=1, allow_none=True)
    checks.non_negative("eps", eps, finite=True)
    norms.check_axis_name(axis_name)
    make = _zscore_detector(alpha, eps) if detector == "zscore" else _mad_detector(window, eps)
    rule = _Rule(*make, warmup_steps=warmup_steps, threshold=threshold,
                 loss_threshold=threshold if loss_threshold is None else loss_threshold,
                 max_consecutive=max_consecutive)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        dtype = norms.stat_dtype(params)
        zero = jnp.zeros((), dtype)
        count = jnp.zeros((), jnp.int32)
        return stats_lib.own_buffers(SkipSpikesState(
            inner=inner.init(params), accepted=count,
            norm_stats=rule.init(dtype), loss_stats=rule.init(dtype),
            skipped=jnp.zeros((), bool), consecutive=count, total_skipped=count,
            score=zero, threshold=zero, norm=zero, loss_score=zero, forced=count,
            nonfinite=count))

    def update_fn(updates, state, params=None, *, loss=None, **extra_args):
        dtype = state.norm.dtype
        # The gradient norm also tells whether every element is finite (a NaN/Inf makes it
        # non-finite): no separate pass over the gradients.
        norm = norms.global_norm(updates, 2.0, axis_name).astype(dtype)
        loss_value = None
        if loss is not None:
            extra_args["loss"] = loss
            loss_value = _common_loss(loss, dtype, axis_name)
        verdict = rule.judge(state, norm, loss_value)
        out, new_inner = _gated_update(inner, verdict.skip, updates, state.inner, params,
                                       extra_args)
        return out, rule.record(state, verdict, new_inner, norm)

    return checks.transformation(init_fn, update_fn, extra_args=True)


class _Verdict(NamedTuple):
    skip: jax.Array         # bool: leave everything as it was
    finite: jax.Array       # bool: the gradients (and the loss) are finite
    forced: jax.Array       # bool: flagged, but accepted because of the cap
    score: jax.Array        # the norm's score (the larger of the two with a loss)
    threshold: jax.Array    # the norm's threshold in force
    loss_score: jax.Array   # the loss's score (0 without a loss)
    loss_stats: Any         # the loss statistics after accepting this step


class _Rule(NamedTuple):
    """The detector's statistics and the skip decision, on scalars only."""

    init: Callable
    score: Callable
    update: Callable
    warmup_steps: int
    threshold: checks.ScalarOrSchedule
    loss_threshold: checks.ScalarOrSchedule
    max_consecutive: int | None

    def _flag(self, stats, value, threshold, state):
        ready = state.accepted >= self.warmup_steps
        score = jnp.where(ready, self.score(stats, value, state.accepted), 0).astype(value.dtype)
        # A NaN score (a NaN value) is left to the finiteness check.
        return score, ready & (score > threshold)

    def judge(self, state, norm, loss) -> _Verdict:
        dtype = norm.dtype
        # The schedules' clock: the steps accepted so far, which a skipped step does not advance
        # (as it does not advance the inner optimizer's count).
        thresh = checks.resolve(self.threshold, state.accepted, dtype, name="threshold")
        score, spike = self._flag(state.norm_stats, norm, thresh, state)
        finite = jnp.isfinite(norm)
        loss_score, loss_stats = jnp.zeros((), dtype), state.loss_stats
        if loss is not None:
            finite = finite & jnp.isfinite(loss)
            loss_thresh = checks.resolve(self.loss_threshold, state.accepted, dtype,
                                         name="loss_threshold")
            loss_score, loss_spike = self._flag(state.loss_stats, loss, loss_thresh, state)
            spike = spike | loss_spike
            loss_stats = self.update(state.loss_stats, loss, state.accepted)
        capped = (jnp.asarray(False) if self.max_consecutive is None
                  else state.consecutive >= self.max_consecutive)
        if loss is not None:
            score = jnp.maximum(score, loss_score)
        return _Verdict(skip=~finite | (spike & ~capped), finite=finite,
                        forced=spike & finite & capped, score=score, threshold=thresh,
                        loss_score=loss_score, loss_stats=loss_stats)

    def record(self, state, verdict, new_inner, norm) -> SkipSpikesState:
        skip = verdict.skip
        keep = functools.partial(stats_lib.keep_if, ~skip)
        return SkipSpikesState(
            inner=new_inner,
            accepted=stats_lib.tally(state.accepted, ~skip),
            norm_stats=keep(self.update(state.norm_stats, norm, state.accepted),
                            state.norm_stats),
            loss_stats=keep(verdict.loss_stats, state.loss_stats),
            skipped=skip,
            consecutive=jnp.where(skip, optax.safe_increment(state.consecutive), 0),
            total_skipped=stats_lib.tally(state.total_skipped, skip),
            score=stats_lib.keep_finite(verdict.score, state.score),
            threshold=verdict.threshold,
            norm=stats_lib.keep_finite(norm, state.norm),
            loss_score=stats_lib.keep_finite(verdict.loss_score, state.loss_score),
            forced=stats_lib.tally(state.forced, verdict.forced),
            nonfinite=stats_lib.count_nonfinite(state.nonfinite, verdict.finite))


def _common_loss(loss: Any, dtype, axis_name: norms.AxisName) -> jax.Array:
    """The loss as a scalar, averaged over the devices along ``axis_name`` where it differs
    between them, so that every device takes the same decision and keeps the same state."""
    value = jnp.asarray(loss).astype(dtype).reshape(())
    split = norms.split_axes([value], axis_name)[0]
    return norms.across(value, "sum", split) / norms.axes_size(split)


def _gated_update(inner, skip, updates, inner_state, params, extra_args):
    """``inner.update`` on an accepted step; zeros and ``inner_state`` as it was on a skipped one.

    One gate on the scalar ``skip`` (:func:`optclip._core.stats.run_or_hold`; a select on a GPU): an
    accepted step runs exactly ``inner``, a skipped one touches nothing. The skipped branch
    hands its operands back unchanged, the gradients included, and the updates are zeroed by
    a select after the cond: XLA then keeps every output in the buffer of the operand it
    replaces (with donated buffers, a branch that builds new zeros makes XLA copy the updates,
    and more, after the cond), and the select fuses into whatever reads the updates next.
    """
    def accept():
        return inner.update(updates, inner_state, params, **extra_args)

    def hold():
        shapes = jax.eval_shape(accept)
        return stats_lib.cast_like(shapes[0], updates), stats_lib.cast_like(shapes[1],
                                                                             inner_state)

    out, new_inner = stats_lib.run_or_hold(~skip, accept, hold)
    # Integer leaves pass through unchanged, as in every optclip transform.
    return jax.tree.map(lambda o, u: jnp.where(skip, jnp.zeros((), o.dtype), o)
                        if norms.is_float(u) else u, out, updates), new_inner
