"""AutoClip: clip at a quantile, or mean + k std, of the history of gradient norms.

References: autoclip 0.2.1 ``QuantileClip`` and ``StandardClip`` (Seetharaman et al.,
"AutoClip: Adaptive Gradient Clipping for Source Separation Networks", 2020). The history is a
fixed-size ring buffer (global, or one row per leaf); a non-finite norm never enters it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import checks, norms, running
from optclip._core import stats as stats_lib

__all__ = [
    "QuantileClipState", "StandardClipState", "quantile_clip", "standard_clip",
]


_AUTOCLIP_FIELDS = ("norm", "threshold", "scale", "clipped", "filled", "nonfinite")


@stats_lib.diagnostic("quantile_clip", _AUTOCLIP_FIELDS)
class QuantileClipState(NamedTuple):
    pos: jax.Array        # int32 next write slot of the ring buffer, in [0, history_length)
    filled: jax.Array     # int32 norms held, <= history_length
    history: jax.Array    # (history_length,) global, or (F, history_length) per leaf
    norm: jax.Array       # pre-clip norm: scalar (global) or (F,), one entry per leaf
    threshold: jax.Array  # threshold in force (the norm itself while there is none), like norm
    scale: jax.Array      # factor applied, like norm
    clipped: jax.Array    # bool, like norm
    nonfinite: jax.Array  # int32 calls with a non-finite norm (state left unchanged)
    step: jax.Array       # int32 finite calls: the count that a ``quantile`` schedule sees


@stats_lib.diagnostic("standard_clip", _AUTOCLIP_FIELDS)
class StandardClipState(NamedTuple):
    pos: jax.Array
    filled: jax.Array
    history: jax.Array
    norm: jax.Array
    threshold: jax.Array
    scale: jax.Array
    clipped: jax.Array
    nonfinite: jax.Array
    step: jax.Array


def _history_mean_std(history: jax.Array, filled: jax.Array, min_filled: int
                      ) -> tuple[jax.Array, jax.Array]:
    """Mean and unbiased std of the valid slots over the last axis, where at least
    ``min_filled`` (1 or 2) are: with 1, the std of one slot is NaN (torch's). Below it both
    are 0, a value the caller discards: no 0/0 is formed for ``jax_debug_nans`` to flag."""
    valid = jnp.arange(history.shape[-1]) < filled
    k = filled.astype(history.dtype)
    mean = jnp.sum(jnp.where(valid, history, 0), axis=-1) / jnp.maximum(k, 1)
    squares = jnp.sum(jnp.where(valid, (history - mean[..., None]) ** 2, 0), axis=-1)
    return mean, norms.safe_sqrt(squares / jnp.where(k >= min_filled, k - 1, 1))


def _autoclip(threshold_fn, history_length, global_threshold, state_cls, axis_name):
    norms.check_axis_name(axis_name)
    checks.integer("history_length", history_length, low=1)
    checks.boolean("global_threshold", global_threshold)
    per_leaf = not global_threshold

    def init_fn(params):
        dtype = norms.stat_dtype(params)
        batch = () if global_threshold else (len(norms.float_leaves(params)),)
        zeros = jnp.zeros(batch, dtype)
        return stats_lib.own_buffers(state_cls(
            jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32),
            jnp.zeros(batch + (history_length,), dtype),
            zeros, zeros, zeros + 1, zeros > 0,
            jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)))

    def update_fn(updates, state, params=None):
        del params
        dtype = state.history.dtype
        if global_threshold:
            norm = norms.global_norm(updates, 2.0, axis_name).astype(dtype)
        else:
            norm = running.leaf_norms(updates, dtype, axis_name)
        # The threshold comes from past norms only; none while the history is
        # empty, so call 1 is never clipped.
        threshold = jnp.where(
            state.filled > 0, threshold_fn(state.history, state.filled, state.step),
            jnp.inf).astype(dtype)
        scale = running.torch_clip_factor(threshold, norm).astype(dtype)
        history = state.history.at[..., state.pos].set(norm)
        finite = jnp.all(jnp.isfinite(norm))
        # autoclip records inf/NaN norms, poisoning the window for history_length calls.
        keep = lambda new, old: jnp.where(finite, new, old)
        new_updates, diag = running.apply_scale(
            updates, scale, state._asdict(), norm=norm, scale=scale,
            threshold=jnp.where(jnp.isinf(threshold), norm, threshold))
        return new_updates, state_cls(
            pos=keep((state.pos + 1) % history_length, state.pos),
            filled=keep(jnp.minimum(state.filled + 1, history_length), state.filled),
            history=keep(history, state.history), **diag,
            nonfinite=stats_lib.count_nonfinite(state.nonfinite, finite),
            step=stats_lib.step_count(state.step, finite))

    return checks.transformation(init_fn, update_fn, pairs_leaves=per_leaf)


def quantile_clip(
    quantile: float = 0.9,
    history_length: int = 1000,
    global_threshold: bool = False,
    *,
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformation:
    """AutoClip: clip to a quantile of the recent history of gradient norms.

    ``g <- g * min(1, c / (n + 1e-6))`` with ``c`` the ``quantile`` (linear interpolation, as
    ``torch.quantile``) of the pre-clip norms of the previous ``history_length`` calls
    (``c = inf`` on the first call). Per leaf by default (each leaf has its own history and
    is judged on its own norm); ``global_threshold=True`` uses the global norm.

    Args:
      quantile: in ``[0, 1]`` (a fraction, not a percentile), or an optax schedule
        ``count -> value`` (``count``: finite calls so far, ``state.step``).
      history_length: ``L``, the window (a ring buffer of ``L`` norms, per leaf in local mode).
      global_threshold: one history of the global norm instead of one per leaf.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) (a name or a tuple) the
        leaves are split over: the norms are combined across devices with ``psum``, so every
        device takes the same decision and keeps the same state. Not needed under ``jax.jit``
        with sharded arrays.

    Returns:
      An ``optax.GradientTransformation`` whose state logs ``norm``, ``threshold`` (the norm
      itself while there is none), ``scale``, ``clipped`` (per leaf in local mode: one vector
      over the floating leaves, :func:`optclip.per_leaf` gives a tree), ``filled`` and
      ``nonfinite``.

    References:
      autoclip 0.2.1 ``QuantileClip``; Seetharaman et al., "AutoClip:
      Adaptive Gradient Clipping for Source Separation Networks", MLSP 2020 (arXiv
      2007.14469), which includes the current norm and keeps an unbounded history; optclip,
      like autoclip, uses the past ``L`` norms only. Differences: a non-finite norm is not
      recorded (the reference's window then yields NaN for ``L`` calls); all leaves advance
      together; no host syncs.
      A window dominated by zero norms gives a threshold of 0, as the reference.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.quantile_clip(0.5, global_threshold=True)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for s in [1.0, 3.0, 5.0, 4.0]:
      ...     out, state = tx.update({"w": jnp.array([0.6, 0.8]) * s}, state)
      >>> round(float(optax.tree.norm(out)), 5)
      3.0
    """
    checks.in_range("quantile", quantile, 0.0, 1.0, allow_schedule=True)

    def threshold_fn(history, filled, step):
        q = checks.resolve(quantile, step, history.dtype, name="quantile")
        return running.history_quantile(history, filled, q)

    return _autoclip(threshold_fn, history_length, global_threshold, QuantileClipState,
                     axis_name)


def standard_clip(
    deviations: float = 2.0,
    history_length: int = 1000,
    global_threshold: bool = False,
    *,
    add_mean: bool = False,
    parity: running.Parity = "fixed",
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformation:
    """AutoClip's StandardClip: clip to ``deviations`` standard deviations of the norm history.

    ``g <- g * min(1, c / (n + 1e-6))`` with ``c = deviations * std(h)`` (unbiased) over the
    pre-clip norms ``h`` of the previous ``history_length`` calls; ``c = inf`` until the
    history holds two norms. Note the reference's threshold has no mean term: with typical
    norms (std much smaller than the mean) it clips nearly every call to a small norm;
    ``add_mean=True`` uses ``mean(h) + deviations * std(h)`` instead.

    Args:
      deviations: ``>= 0``, or an optax schedule ``count -> value`` (``count``: finite calls
        so far, ``state.step``).
      history_length: ``L``, the window (a ring buffer of ``L`` norms, per leaf in local mode).
      global_threshold: one history of the global norm instead of one per leaf.
      add_mean: threshold ``mean + deviations * std`` instead of autoclip's ``deviations *
        std``.
      parity: ``"fixed"`` (default) does not clip while the history holds one norm;
        ``"reference"`` reproduces autoclip, whose std of one sample is NaN, turning every
        gradient of the second call into NaN.
      axis_name: as in :func:`quantile_clip`.

    Returns:
      An ``optax.GradientTransformation`` whose state logs what :func:`quantile_clip`'s does.

    References:
      autoclip 0.2.1 ``StandardClip``. Differences as for
      :func:`quantile_clip`. A constant history (or ``deviations=0``) gives a threshold of 0 and
      zeroes the gradients, as the reference.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.standard_clip(global_threshold=True, add_mean=True)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for s in [1.0, 1.2, 0.8, 1.0, 9.0]:
      ...     out, state = tx.update({"w": jnp.array([0.6, 0.8]) * s}, state)
      >>> round(float(state.threshold), 4), round(float(optax.tree.norm(out)), 4)
      (1.3266, 1.3266)
    """
    checks.non_negative("deviations", deviations, allow_schedule=True)
    checks.boolean("add_mean", add_mean)
    running.check_parity(parity)
    min_filled = 1 if parity == "reference" else 2

    def threshold_fn(history, filled, step):
        mean, std = _history_mean_std(history, filled, min_filled)
        spread = checks.resolve(deviations, step, history.dtype, name="deviations") * std
        threshold = mean + spread if add_mean else spread
        return jnp.where(filled >= min_filled, threshold, jnp.inf)

    return _autoclip(threshold_fn, history_length, global_threshold, StandardClipState,
                     axis_name)
