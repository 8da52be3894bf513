"""ZClip: z-score spike clipping of the global gradient norm against its EMA statistics.

Reference: zclip 1.0.0 ``ZClip`` (Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM
Pre-Training", arXiv 2504.02507). Statistics in float32 (float64 under x64); a non-finite norm
leaves the state as it was and is counted in ``nonfinite``. ``parity="reference"`` reproduces
the reference's own numbers where they differ from the paper's intent.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import checks, norms, running
from optclip._core import stats as stats_lib

__all__ = [
    "ZClipState", "zclip",
]


@stats_lib.diagnostic("zclip", ("norm", "threshold", "scale", "clipped", "mean", "var",
                                "count", "spikes", "nonfinite"))
class ZClipState(NamedTuple):
    count: jax.Array         # int32 calls with a finite norm (the warm-up lasts while < W)
    warmup_norms: jax.Array  # (max(warmup_steps, 1),) raw warm-up norms
    mean: jax.Array          # EMA of the norm (0 until the warm-up ends)
    var: jax.Array           # EMA of the squared deviation (0 until the warm-up ends)
    norm: jax.Array          # pre-clip global norm (last finite value)
    threshold: jax.Array     # norm above which this call clips (the norm itself when no limit)
    scale: jax.Array         # factor the updates were multiplied by
    clipped: jax.Array       # bool
    spikes: jax.Array        # int32 detected spikes
    nonfinite: jax.Array     # int32 calls with a non-finite norm (state left unchanged)
    step: jax.Array          # int32 finite calls: the count that threshold schedules see


def zclip(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | None = 1.0,
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str | None = "adaptive_scaling",
    clip_factor: float = 1.0,
    skip_update_on_spike: bool = False,
    *,
    parity: running.Parity = "fixed",
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformation:
    """ZClip: z-score spike detection on the global norm with EMA statistics.

    Warm-up (calls 1..W, ``W = warmup_steps``): the norms are buffered and the updates clipped
    with torch's rule ``min(1, max_grad_norm / (n + 1e-6))`` (none when ``max_grad_norm`` is
    ``None``); at the end of call W, ``mean`` and the population ``var`` of the buffer start the
    EMAs. Then, with ``std = sqrt(var)``:

    * ``mode="zscore"``: ``z = (n - mean) / (std + eps)``; spike iff ``z > z_thresh``; the
      threshold is ``clip_factor * (mean + z_thresh**2 * std / z)`` (``"adaptive_scaling"``)
      or ``mean`` (``"mean"``);
    * ``mode="percentile"``: threshold ``mean + z_thresh * std``; spike iff ``n`` exceeds it.

    ``eff = min(threshold if spike else n, max_grad_norm)``; ``g <- g * eff / (n + 1e-6)`` if
    ``n > eff``. The EMAs are then fed ``x`` = the (uncapped) threshold on a spike, else ``n``:
    ``mean <- alpha * mean + (1 - alpha) * x``, ``var <- alpha * var + (1 - alpha) *
    (x - mean)**2`` (new mean); with ``skip_update_on_spike`` a spike leaves them unchanged.

    Args:
      alpha: EMA decay, the weight of the old value, in ``[0, 1]``.
      z_thresh: z-score threshold (std multiplier in percentile mode), ``> 0``. This,
        ``max_grad_norm`` and ``clip_factor`` also take an optax schedule ``count -> value``,
        ``count`` being the number of finite calls (``state.step``).
      max_grad_norm: cap on the threshold after the warm-up and clip norm during it, ``> 0``,
        or ``None`` for neither. The default 1.0 (zclip 1.0.0's code; its README says ``None``)
        makes ZClip also a fixed clip at 1.0 on every call.
      eps: added to the std in the z-score denominator, ``>= 0``.
      warmup_steps: W, ``>= 2`` (``>= 0`` with ``parity="reference"``, where 0 and 1 both mean
        1 and start with a variance of 0).
      mode: ``"zscore"`` or ``"percentile"`` (case-insensitive; "percentile" is a
        mean + k·std rule, not a percentile).
      clip_option: ``"adaptive_scaling"`` or ``"mean"`` (case-insensitive); ignored in
        percentile mode.
      clip_factor: ``> 0``; multiplies the whole adaptive threshold, mean included, and that
        scaled value is what the EMA sees (the reference's code; its docstring says only the
        ``z_thresh * std`` term).
      skip_update_on_spike: leave the EMAs untouched on a spike.
      parity: ``"fixed"`` (default) detects spikes only once ``std`` exceeds rounding noise,
        ``16 eps |mean|`` (with a variance of 0 the reference pins every larger norm to the
        mean, or to 0 after all-zero warm-up gradients, for good; identical warm-up norms
        of 0.1 leave a float32 variance of about 1e-16, which counts as 0 here);
        ``"reference"`` reproduces that and allows ``warmup_steps < 2``. A variance beyond
        the statistics dtype's range (norms near 1e20 in float32) is kept at its largest
        finite value.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) (a name or a tuple) the
        leaves are split over: the norms are combined across devices with ``psum``, so every
        device takes the same decision and keeps the same state. Not needed under ``jax.jit``
        with sharded arrays.

    Returns:
      An ``optax.GradientTransformation``. Its state logs ``norm`` (pre-clip), ``threshold``
      (on a spike the norm the update was clipped to, ``eff``; otherwise the norm above which
      this call would have clipped: ``min(mean + z_thresh * (std + eps), max_grad_norm)``, or
      ``mean + z_thresh * std`` in percentile mode; during the warm-up, or before ``std > 0``,
      ``max_grad_norm``, or the norm itself when that is ``None``: no limit), ``scale``,
      ``clipped``, ``mean``, ``var``, ``count`` (calls with a finite norm, warm-up included),
      ``spikes`` and ``nonfinite``.

    References:
      zclip 1.0.0 ``ZClip``; Kumar et al., "ZClip: Adaptive Spike
      Mitigation for LLM Pre-Training", arXiv 2504.02507. Differences: a non-finite norm is
      neither buffered nor fed to the EMAs (the reference's statistics become NaN for good);
      the norm is accumulated in float32 or wider, not in the first parameter's dtype;
      ``mode`` and ``clip_option`` are validated alike; no host sync. How it differs
      from drytorch's ``zscore_criterion`` in :func:`hist_clip`: see the history-based
      clipping guide.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.zclip(max_grad_norm=None, warmup_steps=3)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for g in [[0.3, 0.4], [0.3, 0.5], [0.4, 0.4], [0.3, 0.4], [3.0, 4.0]]:
      ...     out, state = tx.update({"w": jnp.array(g)}, state)
      >>> round(float(optax.tree.norm(out)), 3), int(state.spikes)
      (0.55, 1)
    """
    mode, clip_option = _check_args(alpha, z_thresh, max_grad_norm, eps, warmup_steps, mode,
                                    clip_option, clip_factor, skip_update_on_spike, parity,
                                    axis_name)
    fixed = parity == "fixed"
    steps = max(warmup_steps, 1)
    rule = functools.partial(_rule, z_thresh=z_thresh, mode=mode, eps=eps,
                             clip_option=clip_option, clip_factor=clip_factor, fixed=fixed)

    def init_fn(params):
        dtype = norms.stat_dtype(params)
        zero = jnp.zeros([], dtype)
        return stats_lib.own_buffers(ZClipState(
            jnp.zeros([], jnp.int32), jnp.zeros((steps,), dtype), zero, zero, zero, zero,
            zero + 1, jnp.zeros([], bool), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32),
            jnp.zeros([], jnp.int32)))

    def update_fn(updates, state, params=None):
        del params
        dtype = state.mean.dtype
        norm = norms.global_norm(updates, 2.0, axis_name).astype(dtype)
        warm = state.count < steps
        cap = (None if max_grad_norm is None
               else checks.resolve(max_grad_norm, state.step, dtype, name="max_grad_norm"))
        mean, var = state.mean, state.var
        std = norms.safe_sqrt(var)
        spike, threshold, detect = rule(norm, mean, std, state.step, dtype)
        limit, scale = _limit_and_scale(norm, spike, threshold, detect, warm, cap,
                                        fixed and _constant(mean, std))
        fed = jnp.where(spike, threshold, norm)
        buffer, new_mean, new_var = _statistics(state, norm, fed, spike, alpha, steps,
                                                skip_update_on_spike)
        new = ZClipState(
            count=optax.safe_increment(state.count), warmup_norms=buffer,
            mean=new_mean.astype(dtype), var=new_var.astype(dtype), norm=norm,
            threshold=jnp.where(jnp.isinf(limit), norm, limit).astype(dtype), scale=scale,
            clipped=scale < 1, spikes=stats_lib.tally(state.spikes, ~warm & spike),
            nonfinite=state.nonfinite, step=optax.safe_increment(state.step))
        finite = jnp.isfinite(norm)
        # The step's own scale and flag are logged even when its norm was not finite.
        return running.scale_leaves(updates, scale), stats_lib.commit(finite, new, state)._replace(
            scale=stats_lib.keep_finite(scale, state.scale), clipped=scale < 1)

    return checks.transformation(init_fn, update_fn)


def _rule(norm, mean, std, step, dtype, *, z_thresh, mode, eps, clip_option, clip_factor,
          fixed):
    """(spike, threshold, detect) of the active phase: whether this norm is a spike, the norm
    a spike is clipped to, and the norm above which a call counts as one."""
    z_limit = checks.resolve(z_thresh, step, dtype, name="z_thresh")
    if mode == "percentile":
        threshold = mean + z_limit * std
        spike, detect = norm > threshold, threshold
    else:
        detect = mean + z_limit * (std + eps)  # spike iff z > z_limit iff norm > detect
        z = (norm - mean) / (std + eps)
        spike = z > z_limit
        # Only read on a spike, where z > z_limit: elsewhere z_limit stands in for z, so that
        # no 0/0 is formed (z = 0 where the norm equals the mean) for jax_debug_nans to flag.
        z_spike = jnp.maximum(z, z_limit)
        threshold = (mean if clip_option == "mean" else checks.resolve(
            clip_factor, step, dtype, name="clip_factor") * (
                mean + z_limit * std / (z_spike / z_limit)))
    if fixed:  # a variance of 0 carries no information; detect nothing yet.
        spike = spike & ~_constant(mean, std)
    return spike, threshold, detect


def _limit_and_scale(norm, spike, threshold, detect, warm, cap, constant):
    """The logged threshold and the factor the updates are multiplied by.

    During the warm-up only the cap ``max_grad_norm`` acts (torch's rule); afterwards a spike
    is clipped to ``threshold`` and every norm to the cap. The logged threshold is the norm
    above which this call clips (infinite, then replaced by the norm, when nothing would).
    """
    dtype = norm.dtype
    adaptive = jnp.where(spike, threshold, norm)
    # Python min(adaptive, cap): the first argument wins ties and NaN.
    eff = adaptive if cap is None else jnp.where(cap < adaptive, cap, adaptive)
    limit = jnp.where(constant, jnp.inf, jnp.where(spike, threshold, detect))
    limit = limit if cap is None else jnp.minimum(limit, cap)
    limit = jnp.where(warm, jnp.inf if cap is None else cap, limit)
    warm_scale = jnp.ones((), dtype) if cap is None else running.torch_clip_factor(cap, norm)
    active_scale = jnp.where(norm > eff, eff / (norm + running.TORCH_EPS), 1)
    return limit, jnp.where(warm, warm_scale, active_scale).astype(dtype)


def _check_args(alpha, z_thresh, max_grad_norm, eps, warmup_steps, mode, clip_option,
                clip_factor, skip_update_on_spike, parity, axis_name) -> tuple[str, str | None]:
    """Construction-time validation; returns ``mode`` and ``clip_option`` lower-cased."""
    checks.in_range("alpha", alpha, 0.0, 1.0)
    checks.positive("z_thresh", z_thresh, allow_schedule=True)
    checks.positive("max_grad_norm", max_grad_norm, allow_none=True, allow_schedule=True)
    checks.non_negative("eps", eps, finite=True)
    checks.positive("clip_factor", clip_factor, allow_schedule=True)
    checks.boolean("skip_update_on_spike", skip_update_on_spike)
    running.check_parity(parity)
    norms.check_axis_name(axis_name)
    checks.integer("warmup_steps", warmup_steps, low=2 if parity == "fixed" else 0)
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string, got {mode!r}")
    mode = mode.lower()
    checks.one_of("mode", mode, ("zscore", "percentile"))
    if mode == "zscore":
        if not isinstance(clip_option, str):
            raise TypeError(f"clip_option must be a string in zscore mode, got {clip_option!r}")
        clip_option = clip_option.lower()
        checks.one_of("clip_option", clip_option, ("adaptive_scaling", "mean"))
    return mode, clip_option


def _statistics(state: ZClipState, norm: jax.Array, fed: jax.Array, spike: jax.Array,
                alpha: float, steps: int, skip_update_on_spike: bool) -> tuple[jax.Array, ...]:
    """The warm-up buffer and the EMAs after this call.

    During the warm-up the norm is buffered; the call that fills the buffer starts the EMAs with
    its mean and population variance. Afterwards the EMAs are fed ``fed``.
    """
    count, mean, var = state.count, state.mean, state.var
    warm = count < steps
    buffer = jnp.where(warm, state.warmup_norms.at[jnp.minimum(count, steps - 1)].set(norm),
                       state.warmup_norms)
    init_mean = jnp.sum(buffer) / steps
    init_var = running.saturate(jnp.sum((buffer - init_mean) ** 2) / steps)
    completes = warm & (count + 1 == steps)
    new_mean = alpha * mean + (1 - alpha) * fed
    new_var = running.saturate(alpha * var + (1 - alpha) * (fed - new_mean) ** 2)
    if skip_update_on_spike:
        new_mean = jnp.where(spike, mean, new_mean)
        new_var = jnp.where(spike, var, new_var)
    new_mean = jnp.where(warm, jnp.where(completes, init_mean, mean), new_mean)
    new_var = jnp.where(warm, jnp.where(completes, init_var, var), new_var)
    return buffer, new_mean, new_var


def _constant(mean: jax.Array, std: jax.Array) -> jax.Array:
    """Whether ``std`` is rounding noise of a constant history (zclip's warm-up guard).

    Identical warm-up norms of 0.1 leave a float32 variance of about 1e-16, not 0: a spread
    below 16 ulps of the mean counts as none, so the guard holds despite rounding.
    """
    return std <= 16 * jnp.finfo(std.dtype).eps * jnp.abs(mean)
