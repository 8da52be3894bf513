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
    step: jax.Array           # int32 calls so far (the clock of schedule thresholds)
    accepted: jax.Array       # int32 steps fed into the statistics
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

    ``inner`` is computed on every step and its result selected away on a skipped step (one
    scalar select per leaf, no ``lax.cond``), so the cost of a step does not depend on the
    outcome. On a skipped step adamw's weight decay is skipped too.

    Args:
      inner: the transformation to protect, usually the whole optimizer (a chain ending in
        adam, ``inject_hyperparams(adamw)(...)``, ...). Extra arguments are forwarded to it.
      detector: ``"zscore"`` or ``"mad"``.
      threshold: score above which a step is flagged, ``> 0``; a float or a schedule of the
        step count.
      alpha: EMA decay of the z-score statistics, in ``[0, 1)``.
      window: number of accepted norms the ``"mad"`` detector keeps, ``>= 2``.
      warmup_steps: accepted steps before anything but non-finite values is flagged,
        ``>= 2``.
      loss_threshold: the loss score threshold (a float or a schedule); ``None`` uses
        ``threshold``. Only used on steps that pass ``loss=...``.
      max_consecutive: the most steps skipped in a row, ``>= 1``, or ``None`` for no limit.
      eps: added to the spread of the statistics, ``>= 0``.

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
    checks.non_negative("eps", eps)
    if detector == "zscore":
        stats_init, score_fn, stats_update = _zscore_detector(alpha, eps)
    else:
        stats_init, score_fn, stats_update = _mad_detector(window, eps)
    inner = optax.with_extra_args_support(inner)
    loss_threshold = threshold if loss_threshold is None else loss_threshold

    def init_fn(params):
        dtype = norms.stat_dtype(params)
        zero = jnp.zeros((), dtype)
        count = jnp.zeros((), jnp.int32)
        return stats_lib.own_buffers(SkipSpikesState(
            inner=inner.init(params), step=count, accepted=count,
            norm_stats=stats_init(dtype), loss_stats=stats_init(dtype),
            skipped=jnp.zeros((), bool), consecutive=count, total_skipped=count,
            score=zero, threshold=zero, norm=zero, loss_score=zero, forced=count,
            nonfinite=count))

    def judge(stats, value, thresh, ready, accepted):
        score = jnp.where(ready, score_fn(stats, value, accepted), 0).astype(value.dtype)
        # NaN scores (a NaN value) are handled by the finiteness check, not here.
        return score, ready & (score > thresh)

    def update_fn(updates, state, params=None, *, loss=None, **extra_args):
        dtype = state.norm.dtype
        if loss is not None:
            extra_args["loss"] = loss
        out, new_inner = inner.update(updates, state.inner, params, **extra_args)

        norm = norms.global_norm(updates).astype(dtype)
        finite = stats_lib.all_finite(updates)
        ready = state.accepted >= warmup_steps
        thresh = checks.resolve(threshold, state.step, dtype)
        score, spike = judge(state.norm_stats, norm, thresh, ready, state.accepted)
        loss_score, loss_stats = jnp.zeros((), dtype), state.loss_stats
        if loss is not None:
            loss_value = jnp.asarray(loss).astype(dtype).reshape(())
            finite = finite & jnp.isfinite(loss_value)
            loss_score, loss_spike = judge(state.loss_stats, loss_value,
                                           checks.resolve(loss_threshold, state.step, dtype),
                                           ready, state.accepted)
            spike = spike | loss_spike
            loss_stats = stats_update(state.loss_stats, loss_value, state.accepted)

        capped = (jnp.asarray(False) if max_consecutive is None
                  else state.consecutive >= max_consecutive)
        forced = spike & finite & capped
        skip = ~finite | (spike & ~capped)
        keep = lambda new, old: jnp.where(skip, old, new)  # noqa: E731
        new_norm_stats = stats_update(state.norm_stats, norm, state.accepted)
        new_state = SkipSpikesState(
            inner=jax.tree.map(keep, new_inner, state.inner),
            step=state.step + 1,
            accepted=state.accepted + (~skip).astype(jnp.int32),
            norm_stats=jax.tree.map(keep, new_norm_stats, state.norm_stats),
            loss_stats=jax.tree.map(keep, loss_stats, state.loss_stats),
            skipped=skip,
            consecutive=jnp.where(skip, state.consecutive + 1, 0),
            total_skipped=state.total_skipped + skip.astype(jnp.int32),
            score=stats_lib.keep_finite(
                score if loss is None else jnp.maximum(score, loss_score), state.score),
            threshold=thresh,
            norm=stats_lib.keep_finite(norm, state.norm),
            loss_score=stats_lib.keep_finite(loss_score, state.loss_score),
            forced=state.forced + forced.astype(jnp.int32),
            nonfinite=stats_lib.count_nonfinite(state.nonfinite, finite))
        # Integer leaves pass through unchanged, as in every optclip transform.
        out = jax.tree.map(lambda o, u: jnp.where(skip, jnp.zeros_like(o), o)
                           if norms.is_float(u) else u, out, updates)
        return out, new_state

    return checks.transformation(init_fn, update_fn, extra_args=True)
