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

from optclip._core import checks, handout, leafvec, norms
from optclip._core import stats as stats_lib

__all__ = ["AdaGCState", "adagc"]


@stats_lib.diagnostic("adagc", ("norm", "gamma", "scale", "clipped", "count", "nonfinite"),
                      per_leaf=("norm", "gamma", "scale", "clipped"))
class AdaGCState(NamedTuple):
    count: jax.Array      # int32 finite steps so far (warm-up while < warmup_steps)
    gamma: jax.Array      # (F,) per leaf: EMA (after warm-up) or minimum (warm-up) of the
                          # non-zero clipped norms; 0 until the first one
    norm: jax.Array       # (F,) per leaf: last pre-clip norm
    scale: jax.Array      # (F,) per leaf: factor applied at the last step
    clipped: jax.Array    # (F,) per leaf: bool, scale < 1
    nonfinite: jax.Array  # int32 steps with a NaN/Inf gradient (state left unchanged)


def adagc(
    lambda_abs: checks.ScalarOrSchedule = 1.0,
    lambda_rel: checks.ScalarOrSchedule = 1.05,
    beta: float = 0.98,
    warmup_steps: int = 100,
    eps: float = 1e-8,
    *,
    axis_name: norms.AxisName = None,
) -> optax.GradientTransformation:
    """AdaGC: clip each tensor to ``lambda_rel`` times the EMA of its own past clipped norms.

    With ``g_i`` the gradient of tensor (leaf) ``i`` and ``gamma_i`` its state:

    * warm-up (the first ``warmup_steps`` steps): global clipping at the absolute threshold,
      ``h = min(1, lambda_abs / (||g|| + eps))`` for the global norm ``||g||``,
      ``g_i <- h g_i``, and ``gamma_i <- min(gamma_i, h ||g_i||)`` (the first step sets
      ``gamma_i = h ||g_i||``);
    * afterwards, per tensor: ``h_i = min(1, lambda_rel * gamma_i / (||g_i|| + eps))``,
      ``g_i <- h_i g_i``, and ``gamma_i <- beta * gamma_i + (1 - beta) * h_i ||g_i||``.

    A tensor whose gradient is exactly 0 at a step leaves ``gamma_i`` as it was (it took no
    part in the step), and a tensor without history yet (``gamma_i = 0``: all its gradients so
    far were 0) follows the warm-up's rule, whatever the step, until its first non-zero
    gradient sets ``gamma_i``. Taken literally, the paper's rule freezes such tensors: a
    zero-initialised branch (LoRA's ``A`` while ``B = 0``, adaLN-Zero, ReZero) has a zero
    gradient at the first step, the warm-up's minimum makes its ``gamma_i`` 0, and after the
    warm-up every update of it is 0, for good; a tensor left out of the steps for a while (an
    expert no token was routed to, a layer frozen for a time) would come back clipped to a
    fraction of its scale (``beta`` to the power of the steps it missed) and regain it by
    ``0.1%`` a step.

    The threshold of each tensor follows that tensor's own scale (embeddings, attention and
    MLP tensors differ by orders of magnitude) and its decay over training, which one global
    threshold cannot. A step with a NaN/Inf gradient leaves the state as it was (counted in
    ``nonfinite``). Each step reads the gradients once for all the norms; the scaling fuses
    into the next transformation.

    Args:
      lambda_abs: the warm-up's absolute (global) threshold, ``> 0``; float or schedule.
      lambda_rel: the relative threshold, ``> 0`` (``1.05``: a tensor may grow 5% above its
        average per step); float or schedule.
      beta: EMA decay of the clipped norms, in ``[0, 1)``.
      warmup_steps: steps of global clipping before the per-tensor rule, ``>= 1``.
      eps: added to the norms in the denominators, ``>= 0``.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) (a name or a tuple) the
        leaves are split over: each tensor's norm, and the warm-up's global norm, are combined
        across devices with ``psum``, so every device keeps the same state. Not needed under
        ``jax.jit`` with sharded arrays.

    Returns:
      An ``optax.GradientTransformation``. Its state keeps one scalar per leaf, each field as
      one vector over the floating leaves (``gamma``, ``norm``, ``scale``, ``clipped``;
      :func:`optclip.per_leaf` gives a tree); ``optclip.stats`` reports ``adagc/norm_max``,
      ``norm_mean``, ``gamma_max``, ``gamma_mean``, ``scale_max``, ``scale_mean``,
      ``clipped_frac``, ``count`` and ``nonfinite``.

    References:
      Wang et al., "AdaGC: Enhancing LLM Pretraining Stability via Adaptive Gradient
      Clipping", arXiv 2502.11034; the defaults (``lambda_abs=1.0``, ``lambda_rel=1.05``,
      ``beta=0.98``, ``warmup_steps=100``, ``eps=1e-8``) are the paper's and pytorch-optimizer
      4.1's ``AdaGC``. Differences from pytorch-optimizer's ``AdaGC``: its warm-up covers
      steps ``1 .. warmup_steps - 1`` (here the first ``warmup_steps`` steps) and its
      per-tensor rule clamps ``gamma_i`` and ``||g_i||`` at ``eps`` instead of adding ``eps``
      (the same numbers unless a norm is near ``eps``). Both the paper and
      pytorch-optimizer take a zero gradient into ``gamma_i``; optclip skips it (above).

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
    checks.non_negative("eps", eps, finite=True)
    norms.check_axis_name(axis_name)

    def init_fn(params):
        return AdaGCState(
            count=jnp.zeros((), jnp.int32), gamma=leafvec.full(params, 0.0),
            norm=leafvec.full(params, 0.0), scale=leafvec.full(params, 1.0),
            clipped=leafvec.full(params, False, jnp.bool_), nonfinite=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        floats = [i for i, x in enumerate(leaves) if norms.is_float(x)]
        count = state.count
        vector, global_norm = _norms([leaves[i] for i in floats], updates, axis_name)
        abs_thresh = checks.resolve(lambda_abs, count, global_norm.dtype, name="lambda_abs")
        rule = _Rule(count, count < warmup_steps,
                     jnp.minimum(1.0, abs_thresh / (global_norm + eps)), lambda_rel, beta, eps)
        # A NaN/Inf anywhere makes the global norm non-finite: no separate pass to find it.
        finite = jnp.isfinite(global_norm)
        outputs, fields = list(leaves), {name: [] for name in _PER_LEAF}
        group_list = leafvec.groups(leaves)
        for group in group_list:   # each leaf's numbers in its own statistics dtype
            norm = leafvec.take(vector, group)
            scale, gamma = _decide(norm, leafvec.take(state.gamma, group), rule)
            for name, value in zip(_PER_LEAF, (gamma, norm, scale, scale < 1)):
                fields[name].append(value)
            for i, (factor,) in zip(group.leaves, handout.rows((scale,))):
                outputs[i] = norms.scale(leaves[i], factor)
        committed = {name: jnp.where(finite, leafvec.assemble(parts, group_list, old), old)
                     for name, parts in fields.items() for old in [getattr(state, name)]}
        return treedef.unflatten(outputs), AdaGCState(
            count=stats_lib.step_count(count, finite),
            nonfinite=stats_lib.count_nonfinite(state.nonfinite, finite), **committed)

    return checks.transformation(init_fn, update_fn, pairs_leaves=True)


# The per-leaf state fields, in the order they are handed out.
_PER_LEAF = ("gamma", "norm", "scale", "clipped")


class _Rule(NamedTuple):
    """What a step's per-tensor decisions depend on besides the norms and ``gamma``."""
    count: jax.Array
    warm: jax.Array
    warm_scale: jax.Array
    lambda_rel: checks.ScalarOrSchedule
    beta: float
    eps: float


def _decide(norm: jax.Array, gamma: jax.Array, rule: _Rule) -> tuple[jax.Array, jax.Array]:
    """The factors and the new ``gamma`` of a group of leaves, as vectors (one entry per leaf,
    in the group's statistics dtype)."""
    rel_thresh = checks.resolve(rule.lambda_rel, rule.count, gamma.dtype, name="lambda_rel")
    local = jnp.minimum(1.0, rel_thresh * gamma / (norm + rule.eps))
    # A tensor without history (every gradient so far exactly 0) follows the warm-up's rule
    # at any step: its relative threshold would be 0 and would keep it at 0 for good.
    fresh = ~(gamma > 0)
    global_rule = rule.warm | fresh
    scale = jnp.where(global_rule, rule.warm_scale.astype(gamma.dtype), local)
    clipped_norm = scale * norm
    warm_gamma = jnp.where(fresh, clipped_norm, jnp.minimum(gamma, clipped_norm))
    ema = rule.beta * gamma + (1 - rule.beta) * clipped_norm
    # A gradient of exactly 0 (the tensor took no part in the step) says nothing of its scale.
    return scale, jnp.where(norm > 0, jnp.where(global_rule, warm_gamma, ema), gamma)


def _norms(leaves: list[jax.Array], updates: Any, axis_name: norms.AxisName
           ) -> tuple[jax.Array, jax.Array]:
    """Per-leaf L2 norms of the floating ``leaves`` as one vector (in the tree's statistics
    dtype) and the global norm.

    One pass over the gradients (:func:`optclip._core.norms.leaf_l2_norms`, combined across
    the devices each leaf's elements are split over). The global norm is combined from the
    leaf norms, scaled by the largest, so it needs no second pass and cannot overflow either.
    """
    dtype = norms.stat_dtype(updates)
    if not leaves:
        return jnp.zeros((0,), dtype), jnp.zeros((), dtype)
    vector = norms.leaf_l2_norms(leaves, axis_name, vector=True).astype(dtype)
    peak = jnp.max(vector)
    unit = jnp.where((peak > 0) & jnp.isfinite(peak), peak, jnp.ones_like(peak))
    total = unit * norms.safe_sqrt(jnp.sum(jnp.square(vector / unit)))
    return vector, total
