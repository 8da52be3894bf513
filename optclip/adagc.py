"""AdaGC: per-tensor clipping against the EMA of each tensor's own past clipped norms.

Wang et al., "AdaGC: Enhancing LLM Pretraining Stability via Adaptive Gradient Clipping",
arXiv 2502.11034 (ICML 2026). Global clipping at one absolute threshold for the whole model
lets a spike in one tensor through as long as the global norm stays below it, and the spike
then lives in adam's moments. AdaGC bounds each tensor's gradient norm by a multiple of its own
recent history, with one scalar of state per tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import checks, norms
from optclip._core import stats as stats_lib

__all__ = ["AdaGCState", "adagc"]


@stats_lib.diagnostic("adagc", ("norm", "gamma", "scale", "clipped", "count", "nonfinite"),
                      per_leaf=("norm", "gamma", "scale", "clipped"))
class AdaGCState(NamedTuple):
    count: jax.Array      # int32 finite steps so far (warm-up while < warmup_steps)
    gamma: Any            # per leaf: EMA (after warm-up) or minimum (warm-up) of clipped norms
    norm: Any             # per leaf: last pre-clip norm
    scale: Any            # per leaf: factor applied at the last step
    clipped: Any          # per leaf: bool, scale < 1
    nonfinite: jax.Array  # int32 steps with a NaN/Inf gradient (state left unchanged)


def _per_leaf(tree: Any, value: float, dtype=None) -> Any:
    """A 0-d array per floating leaf (in its statistics dtype), ``None`` for the others."""
    return jax.tree.map(
        lambda x: jnp.full((), value, dtype or norms.acc_dtype(x.dtype))
        if norms.is_float(x) else None, tree)


def adagc(
    lambda_abs: checks.ScalarOrSchedule = 1.0,
    lambda_rel: checks.ScalarOrSchedule = 1.05,
    beta: float = 0.98,
    warmup_steps: int = 100,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """AdaGC: clip each tensor to ``lambda_rel`` times the EMA of its own past clipped norms.

    With ``g_i`` the gradient of tensor (leaf) ``i`` and ``gamma_i`` its state:

    * warm-up (the first ``warmup_steps`` steps): global clipping at the absolute threshold,
      ``h = min(1, lambda_abs / (||g|| + eps))`` for the global norm ``||g||``,
      ``g_i <- h g_i``, and ``gamma_i <- min(gamma_i, h ||g_i||)`` (the first step sets
      ``gamma_i = h ||g_i||``);
    * afterwards, per tensor: ``h_i = min(1, lambda_rel * gamma_i / (||g_i|| + eps))``,
      ``g_i <- h_i g_i``, and ``gamma_i <- beta * gamma_i + (1 - beta) * h_i ||g_i||``.

    The threshold of each tensor follows that tensor's own scale (embeddings, attention and
    MLP tensors differ by orders of magnitude) and its decay over training, which one global
    threshold cannot. A step with a NaN/Inf gradient leaves the state as it was.

    Args:
      lambda_abs: the warm-up's absolute (global) threshold, ``> 0``; float or schedule.
      lambda_rel: the relative threshold, ``> 0`` (``1.05``: a tensor may grow 5% above its
        average per step); float or schedule.
      beta: EMA decay of the clipped norms, in ``[0, 1)``.
      warmup_steps: steps of global clipping before the per-tensor rule, ``>= 1``.
      eps: added to the norms in the denominators, ``>= 0``.

    Returns:
      An ``optax.GradientTransformation``. Its state keeps one scalar per leaf; ``optclip.stats``
      reports ``adagc/norm_max``, ``norm_mean``, ``gamma_max``, ``gamma_mean``, ``scale_max``,
      ``scale_mean``, ``clipped_frac``, ``count`` and ``nonfinite``.

    References:
      Wang et al., "AdaGC: Enhancing LLM Pretraining Stability via Adaptive Gradient
      Clipping", arXiv 2502.11034; the defaults (``lambda_abs=1.0``, ``lambda_rel=1.05``,
      ``beta=0.98``, ``warmup_steps=100``, ``eps=1e-8``) are the paper's and pytorch-optimizer
      4.1's ``AdaGC``. Differences from pytorch-optimizer's ``AdaGC``: its warm-up covers
      steps ``1 .. warmup_steps - 1`` (here the first ``warmup_steps`` steps) and its
      per-tensor rule clamps ``gamma_i`` and ``||g_i||`` at ``eps`` instead of adding ``eps``
      (the same numbers unless a norm is near ``eps``).

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.adagc(warmup_steps=2)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for s in [0.5, 0.4, 0.5, 4.0]:
      ...     out, state = tx.update({"w": jnp.array([0.6, 0.8]) * s}, state)
      >>> round(float(optax.tree.norm(out)), 4)  # 1.05 * gamma, gamma = 0.4004
      0.4204
    """
    checks.positive("lambda_abs", lambda_abs, allow_schedule=True)
    checks.positive("lambda_rel", lambda_rel, allow_schedule=True)
    checks.in_range("beta", beta, 0.0, 1.0, high_inclusive=False)
    checks.integer("warmup_steps", warmup_steps, low=1)
    checks.non_negative("eps", eps)

    def init_fn(params):
        return AdaGCState(
            count=jnp.zeros((), jnp.int32), gamma=_per_leaf(params, 0.0),
            norm=_per_leaf(params, 0.0), scale=_per_leaf(params, 1.0),
            clipped=_per_leaf(params, False, jnp.bool_), nonfinite=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        leaves, (gammas,), treedef = norms.flatten_with(updates, state.gamma)
        count = state.count
        warm = count < warmup_steps
        floats = [x for x in leaves if norms.is_float(x)]
        leaf_norms = [norms.leaf_norm(x, 2.0) for x in floats]
        global_norm = norms.global_norm(updates)
        finite = stats_lib.all_finite(updates)
        abs_thresh = checks.resolve(lambda_abs, count, global_norm.dtype)
        warm_scale = jnp.minimum(1.0, abs_thresh / (global_norm + eps))

        outs, new_gammas, scales, leaf_norm_out = [], [], [], []
        float_norms = iter(leaf_norms)
        for x, gamma in zip(leaves, gammas):
            if not norms.is_float(x):
                outs.append(x)
                new_gammas.append(None)
                scales.append(None)
                leaf_norm_out.append(None)
                continue
            norm = next(float_norms).astype(gamma.dtype)
            rel_thresh = checks.resolve(lambda_rel, count, gamma.dtype)
            local_scale = jnp.minimum(1.0, rel_thresh * gamma / (norm + eps))
            scale = jnp.where(warm, warm_scale.astype(gamma.dtype), local_scale)
            clipped_norm = scale * norm
            warm_gamma = jnp.where(count == 0, clipped_norm, jnp.minimum(gamma, clipped_norm))
            ema_gamma = beta * gamma + (1 - beta) * clipped_norm
            new_gamma = jnp.where(warm, warm_gamma, ema_gamma)
            outs.append(norms.scale(x, scale))
            new_gammas.append(jnp.where(finite, new_gamma, gamma))
            scales.append(scale)
            leaf_norm_out.append(norm)

        keep = lambda new, old: stats_lib.keep_finite(new, old)  # noqa: E731
        scale_tree = treedef.unflatten(scales)
        return treedef.unflatten(outs), AdaGCState(
            count=jnp.where(finite, count + 1, count),
            gamma=treedef.unflatten(new_gammas),
            norm=jax.tree.map(keep, treedef.unflatten(leaf_norm_out), state.norm),
            scale=jax.tree.map(keep, scale_tree, state.scale),
            clipped=jax.tree.map(lambda s: s < 1, scale_tree),
            nonfinite=stats_lib.count_nonfinite(state.nonfinite, finite))

    return checks.transformation(init_fn, update_fn)
