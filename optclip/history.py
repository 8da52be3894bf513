"""drytorch's history-based clipping: criteria, ``hist_clip`` and ``param_hist_clip``.

References: drytorch 0.1.0rc11 ``max_clipping``, ``mean_clipping``, ``reciprocal_clipping``,
``EMACriterion``, ``ZStatCriterion``, ``HistClipper``, ``ParamHistClipper``. The JAX formulation
uses fixed-size buffers, a step counter, masks instead of Python branches, statistics in float32
(float64 under x64).

Every transform owns its state (drytorch's default ``HistClipper`` instances share one criterion
object). A non-finite norm never enters a buffer or a statistic, and does not advance the
warm-up: the whole state stays as it was, the step is counted in ``nonfinite``, and the output
follows the formula so that ``optax.apply_if_finite`` can drop it.

Reference defects that change ordinary numbers are fixed behind one keyword, ``parity``:
``"fixed"`` (default) is the behaviour a user wants, ``"reference"`` reproduces the reference
(in :func:`ema_criterion` and :func:`hist_clip`). Documented reference behaviour that is a
design choice rather than a bug (raw-norm feedback, the variance prior, ``clip_factor``, torch's
``max_norm / (norm + 1e-6)`` rule) is kept; options select the alternatives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import checks, norms, running
from optclip._core import stats as stats_lib

__all__ = [
    "Criterion", "EMACriterionState", "HistClipState", "ParamHistClipState",
    "ZScoreCriterionState", "ema_criterion", "hist_clip", "max_clipping", "mean_clipping",
    "param_hist_clip", "reciprocal_clipping", "zscore_criterion",
]


# drytorch ZStatCriterion's eps in the z-score denominator.
_ZSTAT_EPS = 1e-8


def max_clipping(z: jax.Array, z_thresh: jax.Array | float) -> jax.Array:
    """drytorch's ``max_clipping``: returns ``z_thresh`` whatever ``z`` is.

    With :func:`zscore_criterion` a detected spike is clipped to ``mean + z_thresh * std``; with
    :func:`ema_criterion` to ``r_thresh * mean``.

    Args:
      z: the statistic the criterion passes in (any shape; traceable).
      z_thresh: the criterion's threshold.

    Returns:
      ``z_thresh`` broadcast to the shape of ``z``.

    References:
      drytorch ``max_clipping``.

    Example:
      >>> import optclip
      >>> float(optclip.max_clipping(7.0, 2.5))
      2.5
    """
    return jnp.zeros_like(jnp.asarray(z)) + z_thresh


def mean_clipping(z: jax.Array, z_thresh: jax.Array | float) -> jax.Array:
    """drytorch's ``mean_clipping``: returns 0 whatever its arguments are.

    With :func:`zscore_criterion` a spike is clipped to the running mean (a z-score of 0). With
    :func:`ema_criterion` the reference multiplies the mean by this 0 and zeroes the gradients;
    ``ema_criterion`` treats ``mean_clipping`` as "clip to the mean" unless
    ``parity="reference"``.

    Args:
      z: the statistic the criterion passes in (any shape; traceable).
      z_thresh: the criterion's threshold (ignored).

    Returns:
      Zeros of the shape of ``z``.

    References:
      drytorch ``mean_clipping``.

    Example:
      >>> import optclip
      >>> float(optclip.mean_clipping(7.0, 2.5))
      0.0
    """
    del z_thresh
    return jnp.zeros_like(jnp.asarray(z))


def reciprocal_clipping(z: jax.Array, z_thresh: jax.Array | float) -> jax.Array:
    """drytorch's ``reciprocal_clipping``: ``z_thresh**2 / z`` (ZClip's reciprocal rule).

    For ``z > z_thresh`` the result lies in ``(0, z_thresh)``: a new z-score (with
    :func:`zscore_criterion`, clip value ``mean + z_thresh**2 * std / |z|``) or a new ratio to
    the mean (with :func:`ema_criterion`, clip value ``r_thresh**2 * mean**2 / norm``). It is not
    a factor in (0, 1) as the reference's docstring says.

    Args:
      z: the statistic the criterion passes in (any shape; traceable).
      z_thresh: the criterion's threshold.

    Returns:
      ``z_thresh**2 / z``.

    References:
      drytorch ``reciprocal_clipping``; arXiv 2504.02507.

    Example:
      >>> import optclip
      >>> float(optclip.reciprocal_clipping(5.0, 2.5))
      1.25
    """
    return jnp.asarray(z_thresh) ** 2 / jnp.asarray(z)


@dataclasses.dataclass(frozen=True)
class Criterion:
    """A clipping criterion: pure functions over an array state (drytorch ``ClippingCriterion``).

    The object is immutable and holds no statistics: the state lives in the transform's state,
    so one criterion can be given to several transforms without any sharing. Every function is
    elementwise: :func:`param_hist_clip` calls them with one entry per leaf.

    Attributes:
      init: ``dtype -> state``, the fresh state (a pytree of 0-d arrays).
      set_statistics: ``(state, mean, variance) -> state``, called once with the warm-up mean
        and unbiased variance (1.0 for fewer than two warm-up norms).
      should_clip: ``(state, norm) -> bool``.
      clip_value: ``(state, norm) -> norm to clip to`` (used where ``should_clip``).
      update: ``(state, value) -> state``, called on every call after the warm-up.
      name: a label for repr and docs.

    Example:
      A fixed-multiple criterion (clip to twice the running mean of the norm; its state is
      just the mean):

      >>> import jax.numpy as jnp, optax, optclip
      >>> twice_mean = optclip.history.Criterion(
      ...     init=lambda dtype: jnp.zeros((), dtype),
      ...     set_statistics=lambda old_mean, mean, variance: mean,
      ...     should_clip=lambda mean, norm: norm > 2 * mean,
      ...     clip_value=lambda mean, norm: 2 * mean,
      ...     update=lambda mean, norm: 0.9 * mean + 0.1 * norm,
      ...     name="twice_mean")
      >>> tx = optclip.hist_clip(twice_mean, warmup_steps=2)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for s in [1.0, 1.0, 1.0, 5.0]:
      ...     out, state = tx.update({"w": jnp.array([0.6, 0.8]) * s}, state)
      >>> round(float(optax.tree.norm(out)), 4), round(float(state.criterion), 4)
      (2.0, 1.4)
    """

    init: Callable[[Any], Any]
    set_statistics: Callable[[Any, jax.Array, jax.Array], Any]
    should_clip: Callable[[Any, jax.Array], jax.Array]
    clip_value: Callable[[Any, jax.Array], jax.Array]
    update: Callable[[Any, jax.Array], Any]
    name: str = "criterion"


class EMACriterionState(NamedTuple):
    mean: jax.Array       # EMA of the norm (0 = no information yet)
    step: jax.Array       # int32 updates since the warm-up (the clock of a threshold schedule)


class ZScoreCriterionState(NamedTuple):
    mean: jax.Array       # EMA of the norm (0 = no information yet)
    var: jax.Array        # EMA of the squared deviation; starts at 1.0
    step: jax.Array       # int32 updates since the warm-up (the clock of a threshold schedule)


def _check_clip_fn(clip_fn: Any) -> None:
    if not callable(clip_fn):
        raise TypeError(f"clip_fn must be a callable (z, z_thresh) -> factor, got {clip_fn!r}")


def ema_criterion(
    alpha: float = 0.98,
    r_thresh: float = 1.05,
    clip_fn: Callable[[jax.Array, Any], jax.Array] = max_clipping,
    *,
    parity: running.Parity = "fixed",
) -> Criterion:
    """drytorch's ``EMACriterion``: clip when the norm exceeds ``r_thresh`` times its EMA.

    With ``mu`` the EMA of the norm: clip iff ``mu != 0`` and ``n / mu > r_thresh``; the clip
    value is ``mu * clip_fn(n / mu, r_thresh)`` (``max_clipping``: ``r_thresh * mu``;
    ``reciprocal_clipping``: ``r_thresh**2 * mu**2 / n``; ``mean_clipping``: ``mu``). After
    the warm-up ``mu`` starts at the warm-up mean; every later call does
    ``mu <- alpha * mu + (1 - alpha) * value`` (no bias correction).

    Args:
      alpha: EMA decay, the weight of the old value, in ``[0, 1]``.
      r_thresh: ratio threshold, ``> 0``, or an optax schedule ``count -> value`` (``count``:
        the criterion's updates since the warm-up ended, ``state.step``).
      clip_fn: ``(ratio, r_thresh) -> new ratio``; one of :func:`max_clipping`,
        :func:`mean_clipping`, :func:`reciprocal_clipping` or your own traceable function.
      parity: ``"fixed"`` (default) or ``"reference"``. ``"fixed"`` clips to the mean with
        ``mean_clipping`` (the reference multiplies the mean by its 0 and zeroes the gradients),
        and starts the EMA at the first norm it sees while ``mu == 0`` (the reference
        averages in from 0 and then clips almost every call to a fraction of the norm).

    Returns:
      A :class:`Criterion` for :func:`hist_clip` / :func:`param_hist_clip`.

    References:
      drytorch ``EMACriterion``. ``alpha`` is validated (the
      reference does not check it).

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> crit = optclip.ema_criterion()
      >>> state = crit.set_statistics(crit.init(jnp.float32), jnp.float32(2.0), 1.0)
      >>> bool(crit.should_clip(state, 3.0)), float(crit.clip_value(state, 3.0))
      (True, 2.1)
    """
    checks.in_range("alpha", alpha, 0.0, 1.0)
    checks.positive("r_thresh", r_thresh, allow_schedule=True)
    _check_clip_fn(clip_fn)
    running.check_parity(parity)
    fixed = parity == "fixed"
    # mean_clipping's 0 is a z-score ("the mean"); as a ratio the mean is 1.
    to_mean = fixed and clip_fn is mean_clipping

    def init(dtype) -> EMACriterionState:
        return EMACriterionState(jnp.zeros((), dtype), jnp.zeros((), jnp.int32))

    def set_statistics(state, mean, variance):
        del variance
        return state._replace(mean=jnp.asarray(mean, state.mean.dtype))

    def ratio(mean, norm):
        return norm / jnp.where(mean != 0, mean, 1)

    def threshold(state):
        return checks.resolve(r_thresh, state.step, state.mean.dtype, name="r_thresh")

    def should_clip(state, norm):
        return (state.mean != 0) & (ratio(state.mean, norm) > threshold(state))

    def clip_value(state, norm):
        mean = state.mean
        factor = (jnp.ones_like(mean) if to_mean
                  else clip_fn(ratio(mean, norm), threshold(state)))
        return jnp.where(mean != 0, mean * factor, norm)

    def update(state, value):
        mean = alpha * state.mean + (1 - alpha) * value
        if fixed:  # an EMA started at 0 without bias correction; start at `value`.
            mean = jnp.where(state.mean != 0, mean, value)
        return EMACriterionState(mean.astype(state.mean.dtype), optax.safe_increment(state.step))

    return Criterion(init, set_statistics, should_clip, clip_value, update, "ema")


def zscore_criterion(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    clip_fn: Callable[[jax.Array, Any], jax.Array] = reciprocal_clipping,
) -> Criterion:
    """drytorch's ``ZStatCriterion``: clip when the norm's z-score exceeds ``z_thresh``.

    ``z = (n - mu) / (sqrt(v) + 1e-8)`` with EMAs ``mu`` (mean) and ``v`` (variance); clip iff
    ``mu != 0`` and ``|z| > z_thresh`` (two-sided, as the reference: a low-side detection gives
    a clip value above the norm, so it changes nothing); clip value
    ``mu + clip_fn(|z|, z_thresh) * sqrt(v)`` (``reciprocal_clipping``:
    ``mu + z_thresh**2 * sqrt(v) / |z|``, the ZClip rule). The warm-up installs the mean and the
    unbiased variance (a variance of 0 is ignored: ``v`` keeps its initial 1.0). Each later
    call does ``v <- alpha * v + (1 - alpha) * (x - mu)**2`` and then
    ``mu <- alpha * mu + (1 - alpha) * x`` (deviation from the old mean).

    Args:
      alpha: EMA decay, the weight of the old value, in ``[0, 1]``.
      z_thresh: z-score threshold, ``> 0``, or an optax schedule ``count -> value``
        (``count``: the criterion's updates since the warm-up ended, ``state.step``).
      clip_fn: ``(|z|, z_thresh) -> new z-score``; :func:`reciprocal_clipping` (default),
        :func:`max_clipping`, :func:`mean_clipping` or your own traceable function.

    Returns:
      A :class:`Criterion` for :func:`hist_clip` / :func:`param_hist_clip`.

    References:
      drytorch ``ZStatCriterion``. How it differs from ZClip: see
      :func:`zclip` and the history-based clipping guide.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> crit = optclip.zscore_criterion()
      >>> state = crit.set_statistics(crit.init(jnp.float32), jnp.float32(1.0), 0.04)
      >>> bool(crit.should_clip(state, 3.0)), round(float(crit.clip_value(state, 3.0)), 4)
      (True, 1.125)
    """
    checks.in_range("alpha", alpha, 0.0, 1.0)
    checks.positive("z_thresh", z_thresh, allow_schedule=True)
    _check_clip_fn(clip_fn)

    def init(dtype) -> ZScoreCriterionState:
        return ZScoreCriterionState(jnp.zeros((), dtype), jnp.ones((), dtype),
                                    jnp.zeros((), jnp.int32))

    def set_statistics(state, mean, variance):
        variance = jnp.asarray(variance, state.var.dtype)
        # drytorch keeps the old variance unless the new one is > 0 (NaN fails too).
        return state._replace(mean=jnp.asarray(mean, state.mean.dtype),
                              var=jnp.where(variance > 0, variance, state.var))

    def abs_z(state, norm):
        return jnp.abs((norm - state.mean) / (jnp.sqrt(state.var) + _ZSTAT_EPS))

    def threshold(state):
        return checks.resolve(z_thresh, state.step, state.mean.dtype, name="z_thresh")

    def should_clip(state, norm):
        return (state.mean != 0) & (abs_z(state, norm) > threshold(state))

    def clip_value(state, norm):
        z = abs_z(state, norm)
        limit = threshold(state)
        clipped = state.mean + clip_fn(z, limit) * jnp.sqrt(state.var)
        return jnp.where((state.mean != 0) & ~(z <= limit), clipped, norm)

    def update(state, value):
        var = running.saturate(alpha * state.var + (1 - alpha) * (value - state.mean) ** 2)
        mean = alpha * state.mean + (1 - alpha) * value
        return ZScoreCriterionState(mean.astype(state.mean.dtype), var.astype(state.var.dtype),
                                    optax.safe_increment(state.step))

    return Criterion(init, set_statistics, should_clip, clip_value, update, "zscore")


_HIST_FIELDS = ("norm", "threshold", "scale", "clipped", "count", "spikes", "nonfinite")


@stats_lib.diagnostic("hist_clip", _HIST_FIELDS)
class HistClipState(NamedTuple):
    count: jax.Array         # int32 calls recorded, saturating at warmup_steps + 1
    warmup_norms: jax.Array  # (max(warmup_steps, 1),) raw warm-up norms
    criterion: Any           # the criterion's state
    warmup_state: Any        # the warm-up transform's state (advanced only during warm-up)
    norm: jax.Array          # pre-clip global norm (last finite value)
    threshold: jax.Array     # the criterion's clip value (the norm itself when not detected)
    scale: jax.Array         # factor the updates were multiplied by (1 during a custom warm-up)
    clipped: jax.Array       # bool: scale < 1
    spikes: jax.Array        # int32 calls clipped by the criterion
    nonfinite: jax.Array     # int32 calls with a non-finite norm (state left unchanged)


@stats_lib.diagnostic("param_hist_clip", _HIST_FIELDS)
class ParamHistClipState(NamedTuple):
    count: jax.Array         # int32, shared by all leaves, saturating at warmup_steps + 1
    warmup_norms: jax.Array  # (F, max(warmup_steps, 1)): row j = j-th float leaf
    criterion: Any           # criterion state, every entry of shape (F,)
    warmup_state: Any        # tuple of the warm-up transform's per-leaf states
    norm: jax.Array          # (F,) per leaf: pre-clip norm
    threshold: jax.Array     # (F,) per leaf: the criterion's clip value
    scale: jax.Array         # (F,) per leaf: factor applied
    clipped: jax.Array       # (F,) per leaf: bool
    spikes: jax.Array        # int32 (leaf, call) pairs clipped by the criterion
    nonfinite: jax.Array     # int32 calls with a non-finite leaf norm (state left unchanged)


def _warmup_statistics(buffer: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    """Warm-up mean and unbiased variance over the last axis (1.0 for < 2 samples)."""
    if steps == 0:
        shape = buffer.shape[:-1]
        return jnp.zeros(shape, buffer.dtype), jnp.ones(shape, buffer.dtype)
    mean = jnp.sum(buffer, axis=-1) / steps
    if steps == 1:
        return mean, jnp.ones_like(mean)
    return mean, running.saturate(jnp.sum((buffer - mean[..., None]) ** 2, axis=-1) / (steps - 1))


def _check_hist_args(criterion, warmup_transform, warmup_steps, feedback, parity, axis_name
                     ) -> Criterion:
    """Construction-time validation; returns the criterion (a fresh default for ``None``)."""
    norms.check_axis_name(axis_name)
    if criterion is None:
        criterion = zscore_criterion()
    if not isinstance(criterion, Criterion):
        raise TypeError(f"criterion must be an optclip.Criterion (e.g. zscore_criterion()), "
                        f"got {criterion!r}")
    if warmup_transform is not None and not isinstance(
            warmup_transform, optax.GradientTransformation):
        raise TypeError("warmup_transform must be an optax.GradientTransformation or None, got "
                        f"{warmup_transform!r}")
    running.check_parity(parity)
    # drytorch accepts 0 warm-up steps and starts the statistics from 0.
    checks.integer("warmup_steps", warmup_steps, low=1 if parity == "fixed" else 0)
    checks.one_of("feedback", feedback, ("raw", "clip_value"))
    return criterion


def _per_leaf_warmup(transform, updates, inner_states: tuple, params) -> tuple[Any, tuple]:
    """``transform`` applied to every float leaf on its own (one inner state per leaf)."""
    floats = norms.float_leaves(updates)
    param_leaves = (norms.float_leaves(params) if params is not None
                    else [None] * len(inner_states))
    results = [transform.update(x, s, p) for x, s, p in zip(floats, inner_states, param_leaves)]
    outs = iter([out for out, _ in results])
    new_updates = jax.tree.map(lambda x: next(outs) if norms.is_float(x) else x, updates)
    return new_updates, tuple(s for _, s in results)


def _judge(criterion: Criterion, state, norm: jax.Array, steps: int, feedback: str):
    """The criterion's verdict on ``norm`` after the warm-up and its state after this call.

    Call N + 1 installs the warm-up statistics and is the first judged. Returns
    ``(criterion state, should clip, scale, clip value)``.
    """
    dtype = state.warmup_norms.dtype
    count, warm = state.count, state.count < steps
    mean, variance = _warmup_statistics(state.warmup_norms, steps)
    crit = stats_lib.keep_if(count == steps,
                             criterion.set_statistics(state.criterion, mean, variance),
                             state.criterion)
    should = criterion.should_clip(crit, norm)
    value = criterion.clip_value(crit, norm)
    scale = jnp.where(should, running.torch_clip_factor(value, norm), 1).astype(dtype)
    # drytorch feeds the raw norm back; "clip_value" feeds ZClip-style the clip value.
    fed = jnp.where(should, value, norm) if feedback == "clip_value" else norm
    crit = stats_lib.keep_if(warm, state.criterion, criterion.update(crit, fed))
    return crit, should, scale, value.astype(dtype)


def _hist_init(params, criterion, warmup_transform, steps, per_leaf):
    """The fresh state of :func:`hist_clip` (``per_leaf=False``) or :func:`param_hist_clip`."""
    state_cls = ParamHistClipState if per_leaf else HistClipState
    dtype = norms.stat_dtype(params)
    batch = (len(norms.float_leaves(params)),) if per_leaf else ()
    if warmup_transform is None:
        inner = optax.EmptyState()
    elif per_leaf:
        inner = tuple(warmup_transform.init(x) for x in norms.float_leaves(params))
    else:
        inner = warmup_transform.init(params)
    zeros = jnp.zeros(batch, dtype)
    diag = (zeros, zeros + 1, zeros > 0)
    return stats_lib.own_buffers(state_cls(
        count=jnp.zeros([], jnp.int32),
        warmup_norms=jnp.zeros(batch + (max(steps, 1),), dtype),
        criterion=jax.tree.map(lambda x: jnp.broadcast_to(x, batch + x.shape),
                               criterion.init(dtype)),
        warmup_state=inner, norm=diag[0], threshold=diag[0], scale=diag[1],
        clipped=diag[2], spikes=jnp.zeros([], jnp.int32), nonfinite=jnp.zeros([], jnp.int32)))


def _hist_clip(criterion, warmup_transform, warmup_steps, feedback, parity, per_leaf,
               axis_name=None):
    criterion = _check_hist_args(criterion, warmup_transform, warmup_steps, feedback, parity,
                                 axis_name)
    steps = warmup_steps

    def measure(updates, dtype):
        if per_leaf:
            return running.leaf_norms(updates, dtype, axis_name)
        return norms.global_norm(updates, 2.0, axis_name).astype(dtype)

    def init_fn(params):
        return _hist_init(params, criterion, warmup_transform, steps, per_leaf)

    def warm_phase(updates, state, params, norm, crit_scale, threshold):
        """Output, inner state, scale and threshold, each picked for warm-up or not."""
        warm = state.count < steps
        if warmup_transform is None:  # drytorch GradNormClipper(1): torch's rule at 1.0
            scale = jnp.where(warm, running.torch_clip_factor(jnp.ones_like(norm), norm),
                              crit_scale)
            threshold = jnp.where(warm, jnp.ones_like(threshold), threshold)
            return None, state.warmup_state, scale, threshold
        if per_leaf:
            warm_updates, inner = _per_leaf_warmup(warmup_transform, updates,
                                                   state.warmup_state, params)
        else:
            warm_updates, inner = warmup_transform.update(updates, state.warmup_state, params)
        crit_updates = running.scale_leaves(updates, crit_scale)
        out = jax.tree.map(
            lambda w, c: jnp.where(warm, w.astype(c.dtype), c) if norms.is_float(c) else c,
            warm_updates, crit_updates)
        return (out, stats_lib.keep_if(warm, inner, state.warmup_state),
                jnp.where(warm, jnp.ones_like(crit_scale), crit_scale),
                jnp.where(warm, norm, threshold))

    def update_fn(updates, state, params=None):
        dtype = state.warmup_norms.dtype
        norm = measure(updates, dtype)
        count, warm = state.count, state.count < steps
        buffer = state.warmup_norms  # warm-up: record the raw norm; no criterion involved
        if steps >= 1:
            buffer = jnp.where(warm, buffer.at[..., jnp.minimum(count, steps - 1)].set(norm),
                               buffer)
        crit, should, crit_scale, threshold = _judge(criterion, state, norm, steps, feedback)
        out, inner, scale, threshold = warm_phase(updates, state, params, norm, crit_scale,
                                                  threshold)
        new_updates, diag = running.apply_scale(
            updates, scale, state._asdict(), norm=norm, threshold=threshold,
            scale=scale)
        new = state._replace(
            count=jnp.minimum(optax.safe_increment(count), steps + 1), warmup_norms=buffer,
            criterion=crit, warmup_state=inner,
            spikes=stats_lib.tally(state.spikes, jnp.sum(~warm & should & (scale < 1),
                                                          dtype=jnp.int32)))
        # A non-finite norm leaves the statistics as they were (only counted); the
        # diagnostics keep their last finite entries.
        committed = stats_lib.commit(jnp.all(jnp.isfinite(norm)), new, state)
        return (new_updates if out is None else out), committed._replace(**diag)

    return checks.transformation(init_fn, update_fn, pairs_leaves=per_leaf)


def hist_clip(
    criterion: Criterion | None = None,
    warmup_transform: optax.GradientTransformation | None = None,
    warmup_steps: int = 20,
    *,
    feedback: Literal["raw", "clip_value"] = "raw",
    parity: running.Parity = "fixed",
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformation:
    """drytorch's ``HistClipper``: warm up on a fixed buffer of norms, then let a criterion clip.

    With ``n`` the global L2 norm of the updates and ``N = warmup_steps``:

    * calls 1..N (warm-up): ``n`` is written to the buffer and the output is
      ``warmup_transform(updates)``; by default ``g <- g * min(1, 1 / (n + 1e-6))``;
    * call N + 1 installs the buffer's mean and unbiased variance in the criterion
      (``set_statistics``) and is the first call judged;
    * every call from N + 1 on: ``g <- g * min(1, c / (n + 1e-6))`` if
      ``criterion.should_clip(n)``, with ``c = criterion.clip_value(n)``, else unchanged; then
      ``criterion.update(n)`` (the raw norm, clipped or not).

    Args:
      criterion: a :class:`Criterion`; default ``zscore_criterion()`` (a fresh one, owned by
        this transform's state).
      warmup_transform: any optax transformation applied during the warm-up (a stateful one
        keeps its state inside this state and advances only during the warm-up);
        ``optax.identity()`` is drytorch's ``NoOp``. Default ``None``: torch's rule at 1.0,
        ``min(1, 1 / (n + 1e-6))``, which is drytorch's default ``GradNormClipper(1)`` exactly.
        ``optclip.clip_by_global_norm(1.0)`` clips exactly to 1, a
        relative difference of about ``1e-6 / n`` on clipped warm-up calls; pass it if you
        prefer that.
      warmup_steps: ``N``, the number of warm-up calls, ``>= 1`` (``>= 0`` with
        ``parity="reference"``: drytorch then starts the statistics from a mean of 0).
      feedback: ``"raw"`` (default, drytorch) updates the statistics with the unclipped norm;
        ``"clip_value"`` updates them with the clip value on clipped calls (ZClip's feedback,
        so one spike does not inflate the variance and hide the next).
      parity: ``"fixed"`` (default) or ``"reference"`` (allows ``warmup_steps=0``). Give
        ``ema_criterion(parity="reference")`` too for the reference's zero-start EMA.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) (a name or a tuple) the
        leaves are split over: the norms are combined across devices with ``psum``, so every
        device takes the same decision and keeps the same state. Not needed under ``jax.jit``
        with sharded arrays.
        A ``warmup_transform`` that measures norms needs the same ``axis_name``.

    Returns:
      An ``optax.GradientTransformation``. Its state logs the pre-clip ``norm``, the
      ``threshold`` (the criterion's clip value, which is the norm itself when the
      z-score criterion detects nothing; 1.0 during the default warm-up, the norm during a
      custom one),
      ``scale``, ``clipped``, ``count`` (saturates at N + 1), ``spikes`` and ``nonfinite``.

    References:
      drytorch ``HistClipper``. Differences: each transform owns
      its criterion state (the reference's default instances share one criterion); a
      non-finite norm is not recorded, does not update the statistics or advance the warm-up
      (the reference's statistics become inf/NaN for good); norms are accumulated in
      float32 or wider; no host syncs.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.hist_clip(warmup_steps=3)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for g in [[0.3, 0.4], [0.3, 0.5], [0.4, 0.4], [0.3, 0.4], [3.0, 4.0]]:
      ...     out, state = tx.update({"w": jnp.array(g)}, state)
      >>> round(float(optax.tree.norm(out)), 3), int(state.spikes)
      (0.551, 1)
    """
    return _hist_clip(criterion, warmup_transform, warmup_steps, feedback, parity, False,
                      axis_name)


def param_hist_clip(
    criterion: Criterion | None = None,
    warmup_transform: optax.GradientTransformation | None = None,
    warmup_steps: int = 20,
    *,
    feedback: Literal["raw", "clip_value"] = "raw",
    parity: running.Parity = "fixed",
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformation:
    """drytorch's ``ParamHistClipper``: :func:`hist_clip` run independently on every leaf.

    Each floating leaf has its own warm-up buffer and criterion statistics and is judged on its
    own L2 norm ``n_i``: ``g_i <- g_i * min(1, c_i / (n_i + 1e-6))`` when its criterion
    detects a spike. The warm-up transform is applied to each leaf on its own (default: every
    leaf clipped to norm 1 by itself with torch's rule). All leaves advance together (one shared
    ``count``).

    Args:
      criterion, warmup_transform, warmup_steps, feedback, parity, axis_name: as in
        :func:`hist_clip`.

    Returns:
      An ``optax.GradientTransformation``. Per-leaf diagnostics (``norm``, ``threshold``,
      ``scale``, ``clipped``) and the statistics are stored stacked, entry ``j`` belonging to
      the ``j``-th floating leaf of ``jax.tree.leaves`` (:func:`optclip.per_leaf` gives a
      diagnostic as a tree).

    References:
      drytorch ``ParamHistClipper``. Differences: state is keyed by
      pytree position and all leaves advance together (the reference keys by ``id(param)`` and
      skips ``None`` gradients); every leaf starts from a fresh criterion state; a
      non-finite leaf norm leaves the whole state unchanged.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.param_hist_clip(warmup_steps=3)
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for s in [1.0, 1.1, 0.9, 1.0, 8.0]:
      ...     out, state = tx.update({"a": jnp.array([0.3, 0.4]) * s,
      ...                             "b": jnp.array([0.3, 0.4])}, state)
      >>> clipped = optclip.per_leaf(state.clipped, params)
      >>> [bool(clipped[k]) for k in ("a", "b")]
      [True, False]
    """
    return _hist_clip(criterion, warmup_transform, warmup_steps, feedback, parity, True,
                      axis_name)
