"""Frank-Wolfe over Lp balls (rai_toolbox 0.2.1 ``FrankWolfe``, ``L1FrankWolfe``,
``L2FrankWolfe``, ``LinfFrankWolfe``, ``L1qFrankWolfe``).

Frank-Wolfe *replaces* the inner optimizer: it needs ``params`` and returns ``p_new - p``, the
step towards the linear minimization oracle's vertex with the schedule ``alpha = 2 / (t + 2)``.

Rounding caveat: ``optax.apply_updates`` computes ``params + (p_new - params)``, which can differ
from ``p_new`` by one ulp.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import axes as axes_lib
from optclip._core import checks, norms, slices
from optclip._core import stats as stats_lib

__all__ = [
    "FrankWolfeState", "L1qFrankWolfeState", "frank_wolfe", "l1_frank_wolfe", "l1q_frank_wolfe",
    "l2_frank_wolfe", "linf_frank_wolfe",
]


@stats_lib.diagnostic("frank_wolfe", ("count", "alpha", "nonfinite"))
class FrankWolfeState(NamedTuple):
    count: jax.Array      # int32 Frank-Wolfe steps taken (t of the step-size schedule)
    alpha: jax.Array      # step size of the last step
    nonfinite: jax.Array


@stats_lib.diagnostic("l1q_frank_wolfe", ("count", "alpha", "q", "k", "nonfinite"),
                       per_leaf=("q", "k"))
class L1qFrankWolfeState(NamedTuple):
    count: jax.Array
    alpha: jax.Array
    key: jax.Array        # uint32[2] PRNG key for the random q (used when dq > 0)
    q: jax.Array          # (F,) per leaf: the drop fraction in force at the last step
    k: jax.Array          # (F,) per leaf: int32 entries kept per slice at the last step
    nonfinite: jax.Array


def _l1_lmo(g: jax.Array, axes: tuple[int, ...], split: tuple[str, ...], first: Any
            ) -> jax.Array:
    """One-hot ``sign(g_i*) e_i*`` at the first largest ``|g|`` of every flattened slice, from
    ``first``, the index ``i*`` per row measured by :func:`_l1_measure` (``None``: ranked here,
    as :func:`top_q` ranks, also for slices split over devices).

    rai_toolbox 0.2.1 takes the argmax along the first reduced axis only, which is wrong for
    slices of two or more axes.
    """
    if first is not None:
        rows = slices.slice_rows(g, axes)
        index = jax.lax.broadcasted_iota(jnp.int32, rows.shape, rows.ndim - 1,
                                         out_sharding=jax.typeof(rows).sharding)
        return jnp.where(slices.slice_mask(index == first, g), slices.sign(g),
                         jnp.zeros_like(g))
    if axes_lib.slice_size(g.shape, axes) * norms.axes_size(split) <= 1:
        return slices.sign(g)
    return slices.sign(slices.top_q_kept(g, axes, 1, split))


def _first_largest(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(i*, finite)`` per row (keepdims): the first index of the largest ``|g|`` (NaN ranked
    as the largest), and whether the row is finite, read off the largest magnitude found (NaN
    and ±Inf rank above every finite magnitude). One argmax of the magnitudes' bits that also
    returns the maximum: on XLA:CPU an integer argmax runs in one read of the row (a float
    argmax, a float key or a ranking by bisection take several), and no second kernel reads
    the row for the entry found."""
    bits = slices.magnitude_bits(rows)
    # The index type of jnp.argmax (64 bits under jax_enable_x64): the same kernels.
    kind = jax.dtypes.canonicalize_dtype(jnp.int64)
    # The indices sharded as the rows (under an explicit mesh): with a replicated operand
    # beside a sharded one, XLA's partitioner gathers the reduction's per-row results.
    index = jax.lax.broadcasted_iota(kind, bits.shape, bits.ndim - 1,
                                     out_sharding=jax.typeof(bits).sharding)
    low = jnp.asarray(jnp.iinfo(bits.dtype).min, bits.dtype)
    peak, first = jax.lax.reduce((bits, index), (low, jnp.zeros((), kind)), _first_max,
                                 (bits.ndim - 1,))
    inf = jax.lax.bitcast_convert_type(jnp.asarray(jnp.inf, norms.acc_dtype(rows.dtype)),
                                       bits.dtype)
    return first[..., None].astype(jnp.int32), (peak < inf)[..., None]


def _first_max(a: tuple, b: tuple) -> tuple:
    """Combiner of the argmax: the larger value, and on ties the lower index (jnp.argmax's)."""
    (value_a, index_a), (value_b, index_b) = a, b
    pick = value_a > value_b
    pick_index = pick | ((value_a == value_b) & (index_a < index_b))
    return (jax.lax.select(pick, value_a, value_b),
            jax.lax.select(pick_index, index_a, index_b))


def _l1_measure(leaves: list, cut: slices.Slicing, axis_name: norms.AxisName
                ) -> tuple[list, list]:
    """Per leaf the first index of the largest ``|g|`` of every row (:func:`_first_largest`;
    ``None`` where :func:`_l1_lmo` ranks the leaf itself: one-element slices, slices split over
    devices), and finiteness flags, read off the same pass where it ranks (the rows' flags of
    same-shape leaves reduced together)."""
    out: list[Any] = [None] * len(leaves)
    ranked, others = [], []
    for i, (g, axes, split) in enumerate(zip(leaves, cut.axes, cut.split, strict=True)):
        if axes is None:
            continue
        if axes and not split and axes_lib.slice_size(g.shape, axes) > 1:
            ranked.append(i)
        else:
            others.append(leaves[i])
    finite = []
    for i in ranked:
        out[i], ok = _first_largest(slices.slice_rows(leaves[i], cut.axes[i]))
        finite.append(ok.astype(jnp.float32))
    # Each row's finiteness, all rows of a leaf (same-shape leaves together) in one minimum
    # (+inf for a leaf of no rows).
    flags = [m > 0 for m in norms.leaf_reductions(finite, lambda f: f, "min")]
    return out, flags + [stats_lib.all_finite(others)]


def _fw_coefficients(count: jax.Array, learning_rate: Any, scaling: Any, schedule: bool,
                     eps: Any, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(alpha, a, b)`` with ``a = 1 - alpha`` and ``b = -alpha * c``.

    The reference forms ``alpha``, ``1 - alpha`` and ``-alpha * c`` in double precision and casts
    them once. With the schedule, ``alpha = lr / d`` with ``d = max(eps, lr + t)``;
    ``1 - alpha = (d - lr) / d`` and ``-alpha * c = -(lr * c) / d`` are single divisions of
    exactly representable numbers, so they round once, like the reference.
    """
    if schedule:
        lr = jnp.asarray(learning_rate, dtype)
        denom = jnp.maximum(jnp.asarray(eps, dtype), lr + count.astype(dtype))
        constant = slices.is_number(learning_rate) and slices.is_number(scaling)
        lr_c = (learning_rate * scaling if constant
                else lr * jnp.asarray(scaling, dtype))
        return lr / denom, (denom - lr) / denom, -jnp.asarray(lr_c, dtype) / denom
    one_minus = 1.0 - learning_rate if slices.is_number(learning_rate) else 1 - jnp.asarray(
        learning_rate, dtype)
    lr_c = (learning_rate * scaling if slices.is_number(learning_rate) and slices.is_number(scaling)
            else jnp.asarray(learning_rate, dtype) * jnp.asarray(scaling, dtype))
    return (jnp.asarray(learning_rate, dtype), jnp.asarray(one_minus, dtype),
            -jnp.asarray(lr_c, dtype))


def _fw_step(p: jax.Array, direction: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``p_new - p`` with ``p_new = fl(fl(p * a) + fl(b * direction))`` in the leaf dtype."""
    p_new = p * a.astype(p.dtype) + b.astype(p.dtype) * direction.astype(p.dtype)
    return p_new - p


def _check_fw(learning_rate: Any, use_default_lr_schedule: Any, eps: Any,
              axis_name: Any) -> None:
    checks.boolean("use_default_lr_schedule", use_default_lr_schedule)
    high = None if use_default_lr_schedule else 1.0
    checks.in_range("learning_rate", learning_rate, 0.0, high, finite=True)
    checks.non_negative("eps", eps, finite=True)
    norms.check_axis_name(axis_name)


def _check_ball(epsilon: Any, learning_rate: Any, use_default_lr_schedule: Any, param_ndim: Any,
                eps: Any, axis_name: Any) -> None:
    """Validation shared by the Frank-Wolfe transforms over a ball of radius ``epsilon``."""
    checks.non_negative("epsilon", epsilon, allow_schedule=True, finite=True)
    _check_fw(learning_rate, use_default_lr_schedule, eps, axis_name)
    axes_lib.check_param_ndim_spec(param_ndim)


def _l2_measure(leaves: list, cut: slices.Slicing, eps: Any, axis_name: norms.AxisName
                ) -> tuple[list, list]:
    """Per leaf the LMO direction ``g / max(||g||₂, eps)`` per slice, exactly
    :func:`l2_normalize`'s output (:func:`slices.normalized_leaves`: one plain sum of squares
    per slice, measured again rescaled only on a step where some slice's norm is out of range),
    and the step's finiteness read off the same reads."""
    directions, _, finite = slices.normalized_leaves(leaves, cut, 2.0, eps, axis_name)
    return directions, [finite]


def _l2_direction(g: jax.Array, axes: Any, split: Any, direction: jax.Array) -> jax.Array:
    """The direction :func:`_l2_measure` formed, in ``g``'s dtype."""
    return direction.astype(g.dtype)


def _fw_leaves(updates: Any, params: Any, lmo, cut: slices.Slicing, k_of: list, a: jax.Array,
               b: jax.Array) -> Any:
    """``p_new - p`` for every float leaf, with ``direction = lmo(g, axes, split, k)``."""
    leaves, treedef = jax.tree.flatten(updates)
    steps = [_fw_step(p, lmo(g, axes, split, k), a, b).astype(g.dtype) if norms.is_float(g) else g
             for g, p, axes, split, k in zip(leaves, treedef.flatten_up_to(params), cut.axes,
                                             cut.split, k_of, strict=True)]
    return treedef.unflatten(steps)


def _frank_wolfe(name: str, lmo, scaling: Any, learning_rate: Any, schedule: bool,
                 fw_eps: Any, param_ndim: Any, axis_name: norms.AxisName,
                 fraction: slices.DropFraction | None = None,
                 measure=None, joint=None, scaling_name: str = "epsilon"
                 ) -> optax.GradientTransformation:
    """Frank-Wolfe with ``direction = lmo(g, axes, split, k)``; ``fraction`` draws the L1q
    ``k`` per leaf (its state is :class:`L1qFrankWolfeState`); ``measure(leaves, cut,
    axis_name) -> (k per leaf, per-leaf finiteness flags)`` instead measures what the LMO needs
    and reads the finiteness of the step off the same pass; ``joint(leaves, cut, k per leaf)
    -> per leaf k'`` forms what the LMO needs for all leaves together (one ranking loop for
    the tree instead of one per leaf), and the LMO receives ``k'``."""

    def init_fn(params):
        head = (jnp.zeros([], jnp.int32), jnp.zeros([], norms.stat_dtype(params)))
        if fraction is None:
            return FrankWolfeState(*head, jnp.zeros([], jnp.int32))
        return L1qFrankWolfeState(*head, *fraction.init(params), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        slices.require_params(params, name, updates)
        # A schedule for the radius is resolved at the count of finite steps; a number keeps
        # the double-precision products of _fw_coefficients.
        scale_now = (checks.resolve(scaling, state.count, name=scaling_name) if callable(scaling)
                     else scaling)
        alpha, a, b = _fw_coefficients(state.count, learning_rate, scale_now, schedule, fw_eps,
                                       state.alpha.dtype)
        leaves = jax.tree.leaves(updates)
        cut = slices.slicing(leaves, updates, param_ndim, axis_name)
        head = (optax.safe_increment(state.count), alpha)
        if measure is not None:
            k_of, flags = measure(leaves, cut, axis_name)
            finite = stats_lib.all_of(flags, axis_name)
        else:
            finite = stats_lib.all_finite(updates, axis_name)
        if fraction is None:
            k_of = k_of if measure is not None else [None] * len(leaves)
            new_state = FrankWolfeState(*head, state.nonfinite)
        else:
            key, q, k, k_of = fraction.draw(state.key, leaves, cut.sizes)
            new_state = L1qFrankWolfeState(*head, key, q, k, state.nonfinite)
        if joint is not None:
            k_of = joint(leaves, cut, k_of)
        # The updates wait for the check: no copy of the donated updates buffers for it.
        new_updates = _fw_leaves(updates, params, lmo, cut, k_of, *stats_lib.after(finite, (a, b)))
        return new_updates, stats_lib.commit(finite, new_state, state)

    return checks.transformation(init_fn, update_fn, pairs_leaves=fraction is not None)


def frank_wolfe(lmo_scaling_factor: float = 1.0, learning_rate: float = 2.0,
                use_default_lr_schedule: bool = True, eps: float = slices.TINY, *,
                axis_name: norms.AxisName = None) -> optax.GradientTransformation:
    """The Frank-Wolfe step on updates that already hold the (negative) LMO direction ``ĝ``.

    ``p <- (1 - α) p - α c ĝ`` with ``c = lmo_scaling_factor`` and, with the default schedule,
    ``α_t = lr / max(eps, lr + t)`` (``lr = 2``: 1, 2/3, 1/2, 2/5, ...; ``α_0 = 1`` for every
    ``lr > 0``, so the starting point is discarded), else ``α = lr``. ``t`` counts the steps
    taken. Computed as ``fl(fl(p * (1 - α)) + fl(-α c * ĝ))`` in the leaf dtype; returns
    ``p_new - p``, so ``optax.apply_updates`` gives ``p_new`` up to one ulp.

    This *replaces* the inner optimizer (do not chain ``optax.sgd`` after it) and needs
    ``params``. Put a direction transform before it (``sign``, ``l2_normalize``,
    ``l1q_normalize``...), or use :func:`l1_frank_wolfe` and friends.

    Args:
      lmo_scaling_factor: ``c``, the radius of the constraint set (any finite real).
      learning_rate: ``lr``, ``>= 0`` (``<= 1`` when the schedule is off).
      use_default_lr_schedule: use ``α_t = lr / (lr + t)`` instead of a constant ``lr``.
      eps: lower bound of the schedule's divisor, ``>= 0``.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split over:
        the step is elementwise; only the non-finite check is combined across devices, so
        ``count`` is the same on every device.

    Returns:
      An ``optax.GradientTransformation`` whose state holds the step ``count`` and logs the
      last step size ``alpha``.

    References:
      rai_toolbox ``FrankWolfe``. A non-finite step does not advance
      ``count`` (optclip convention; the reference has no such notion).

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.frank_wolfe(lmo_scaling_factor=1.0)
      >>> x = jnp.array([1.0, -2.0])
      >>> state = tx.init(x)
      >>> for g in ([1.0, 1.0], [0.5, -0.5], [0.0, 1.0]):
      ...     u, state = tx.update(jnp.array(g), state, x)
      ...     x = optax.apply_updates(x, u)
      >>> x.round(6).tolist()
      [-0.333333, -0.5]
    """
    slices.check_real("lmo_scaling_factor", lmo_scaling_factor)
    _check_fw(learning_rate, use_default_lr_schedule, eps, axis_name)
    return _frank_wolfe("frank_wolfe", lambda g, axes, split, k: g, lmo_scaling_factor,
                        learning_rate, use_default_lr_schedule, eps, None, axis_name,
                        scaling_name="lmo_scaling_factor")


def l1_frank_wolfe(epsilon: float, learning_rate: float = 2.0,
                   use_default_lr_schedule: bool = True, param_ndim: int | None = -1,
                   eps: float = slices.TINY, *, axis_name: norms.AxisName = None
                   ) -> optax.GradientTransformation:
    """Frank-Wolfe over the L1 ball of radius ``epsilon`` (per slice).

    LMO direction ``ĝ = sign(g_i*) e_i*`` with ``i*`` the first index of the largest ``|g|`` of
    each slice (a zero slice gives 0); then :func:`frank_wolfe` with ``c = ε``:
    ``p <- (1 - α) p - α ε ĝ``.

    Args:
      epsilon: the radius ``ε`` of the ball, ``>= 0`` (required);
        also an optax schedule ``count -> value`` (``count``: finite steps taken).
      learning_rate: ``lr`` of the step size, ``>= 0`` (``<= 1`` when the schedule is off).
      use_default_lr_schedule: ``α_t = lr / (lr + t)`` (default) or a constant ``α = lr``.
      param_ndim: which axes form a slice, as in :func:`l1_normalize` (default ``-1``: on a 1-D
        leaf every element is a slice, so the LMO is ``sign``, the L∞ one).
      eps: lower bound of the schedule's divisor, ``>= 0``.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the slices' axes are
        split over; the LMO then spans the whole slice (as in :func:`l1_normalize` and
        :func:`top_q`).

    Returns:
      An ``optax.GradientTransformation`` (replaces the inner optimizer; needs ``params``)
      whose state holds the step ``count`` and logs ``alpha``.

    References:
      rai_toolbox ``L1FrankWolfe``. The reference takes the argmax along
      the first reduced axis only, wrong for slices of two or more axes; optclip
      flattens each slice. ``epsilon`` must be ``>= 0``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.l1_frank_wolfe(epsilon=1.8, param_ndim=None)
      >>> x = jnp.array([1.0, 1.0])
      >>> u, _ = tx.update(jnp.array([1.0, 2.0]), tx.init(x), x)
      >>> optax.apply_updates(x, u).tolist()
      [0.0, -1.7999999523162842]
    """
    _check_ball(epsilon, learning_rate, use_default_lr_schedule, param_ndim, eps, axis_name)
    return _frank_wolfe("l1_frank_wolfe", _l1_lmo, epsilon, learning_rate,
                        use_default_lr_schedule, eps, param_ndim, axis_name, measure=_l1_measure)


def l2_frank_wolfe(epsilon: float, learning_rate: float = 2.0,
                   use_default_lr_schedule: bool = True, param_ndim: int | None = -1,
                   eps: float = slices.TINY, *, axis_name: norms.AxisName = None
                   ) -> optax.GradientTransformation:
    """Frank-Wolfe over the L2 ball of radius ``epsilon`` (per slice).

    LMO direction ``ĝ = g / max(||g||₂, eps)`` per slice (as :func:`l2_normalize`); then
    :func:`frank_wolfe` with ``c = ε``: ``p <- (1 - α) p - α ε ĝ``.

    Args:
      epsilon: the radius ``ε`` of the ball, ``>= 0`` (required);
        also an optax schedule ``count -> value`` (``count``: finite steps taken).
      learning_rate: ``lr`` of the step size, ``>= 0`` (``<= 1`` when the schedule is off).
      use_default_lr_schedule: ``α_t = lr / (lr + t)`` (default) or a constant ``α = lr``.
      param_ndim: which axes form a slice, as in :func:`l1_normalize` (default ``-1``).
      eps: lower bound of the normalization's divisor, ``>= 0`` (the schedule uses ``tiny``).
      axis_name: as in :func:`l1_frank_wolfe` (partial norms combined with ``psum``).

    Returns:
      An ``optax.GradientTransformation`` (replaces the inner optimizer; needs ``params``)
      whose state holds the step ``count`` and logs ``alpha``.

    References:
      rai_toolbox ``L2FrankWolfe``; normalization as in
      :func:`l2_normalize`; ``epsilon`` must be ``>= 0``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.l2_frank_wolfe(epsilon=1.8, param_ndim=None)
      >>> x = jnp.array([1.0, 1.0])
      >>> u, _ = tx.update(jnp.array([1.0, 2.0]), tx.init(x), x)
      >>> optax.apply_updates(x, u).round(6).tolist()
      [-0.804984, -1.609969]
    """
    _check_ball(epsilon, learning_rate, use_default_lr_schedule, param_ndim, eps, axis_name)

    return _frank_wolfe("l2_frank_wolfe", _l2_direction, epsilon, learning_rate,
                        use_default_lr_schedule, slices.TINY, param_ndim, axis_name,
                        measure=lambda leaves, cut, names: _l2_measure(leaves, cut, eps, names))


def linf_frank_wolfe(epsilon: float, learning_rate: float = 2.0,
                     use_default_lr_schedule: bool = True, param_ndim: int | None = -1,
                     eps: float = slices.TINY, *, axis_name: norms.AxisName = None
                     ) -> optax.GradientTransformation:
    """Frank-Wolfe over the L∞ ball of radius ``epsilon``.

    LMO direction ``ĝ = sign(g)`` (elementwise); then :func:`frank_wolfe` with ``c = ε``:
    ``p <- (1 - α) p - α ε sign(g)``.

    Args:
      epsilon: the radius ``ε`` of the ball, ``>= 0`` (required);
        also an optax schedule ``count -> value`` (``count``: finite steps taken).
      learning_rate: ``lr`` of the step size, ``>= 0`` (``<= 1`` when the schedule is off).
      use_default_lr_schedule: ``α_t = lr / (lr + t)`` (default) or a constant ``α = lr``.
      param_ndim: only validated (the LMO is elementwise); kept for parity with the reference,
        which rejects 0-d leaves with the default ``-1``.
      eps: lower bound of the schedule's divisor, ``>= 0``.
      axis_name: as in :func:`frank_wolfe` (the LMO is elementwise; only the non-finite check
        is combined across devices).

    Returns:
      An ``optax.GradientTransformation`` (replaces the inner optimizer; needs ``params``)
      whose state holds the step ``count`` and logs ``alpha``.

    References:
      rai_toolbox ``LinfFrankWolfe``. Its docstring example builds
      ``L2FrankWolfe``; ``epsilon`` must be ``>= 0``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.linf_frank_wolfe(epsilon=1.8, param_ndim=None)
      >>> x = jnp.array([1.0, 1.0])
      >>> u, _ = tx.update(jnp.array([1.0, 2.0]), tx.init(x), x)
      >>> optax.apply_updates(x, u).tolist()
      [-1.7999999523162842, -1.7999999523162842]
    """
    _check_ball(epsilon, learning_rate, use_default_lr_schedule, param_ndim, eps, axis_name)
    return _frank_wolfe("linf_frank_wolfe", lambda g, axes, split, k: slices.sign(g), epsilon,
                        learning_rate, use_default_lr_schedule, eps, param_ndim, axis_name,
                        measure=_sign_measure)


def _sign_measure(leaves: list, cut: slices.Slicing, axis_name: norms.AxisName
                  ) -> tuple[list, list]:
    """Nothing for the sign LMO, and the finiteness of the updates from ``sum(g - g)`` (0 for
    finite ``g``, NaN otherwise) rather than ``sum(g * 0)``: the zero that ``sign`` compares
    with is then no constant shared with the check, which XLA:CPU would write out as a buffer
    of the leaf's size for the check's reduction to read."""
    del cut, axis_name  # the flag is combined across devices by the caller
    return [None] * len(leaves), [stats_lib.all_finite(leaves)]


def l1q_frank_wolfe(q: float, epsilon: float, dq: float = 0.0, learning_rate: float = 2.0,
                    use_default_lr_schedule: bool = True, param_ndim: int | None = -1,
                    eps: float = slices.TINY, seed: int = 0, *,
                    axis_name: norms.AxisName = None) -> optax.GradientTransformation:
    """Frank-Wolfe with the L1q direction: a point on the L1 sphere of radius ``epsilon``.

    LMO direction ``ĝ`` = :func:`l1q_normalize`'s output (``±1/c`` on the signs of the top
    ``k = round((1 - q) D)`` entries of each slice); then :func:`frank_wolfe` with ``c = ε``.

    Args:
      q: the fraction of every slice that is dropped, in ``[0, 1]`` (required).
      epsilon: the radius ``ε``, ``>= 0`` (required);
        also an optax schedule ``count -> value`` (``count``: finite steps taken).
      dq: half-width of the random interval around ``q`` (see :func:`top_q`).
      learning_rate: ``lr`` of the step size, ``>= 0`` (``<= 1`` when the schedule is off).
      use_default_lr_schedule: ``α_t = lr / (lr + t)`` (default) or a constant ``α = lr``.
      param_ndim: which axes form a slice, as in :func:`l1_normalize` (default ``-1``).
      eps: lower bound of the L1 divisor, ``>= 0`` (the schedule uses ``tiny``).
      seed: seed of the PRNG key used when ``dq > 0``.
      axis_name: as in :func:`top_q` (exact ranking of split slices without gathering them).

    Returns:
      An ``optax.GradientTransformation`` (replaces the inner optimizer; needs ``params``)
      whose state holds the step ``count`` and the PRNG key and logs ``alpha`` and, per leaf,
      ``q`` and ``k``, each as one vector over the floating leaves (:func:`optclip.per_leaf`
      gives a tree).

    References:
      rai_toolbox ``L1qFrankWolfe``; top-q differences as in
      :func:`top_q`; ``epsilon`` must be ``>= 0``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.l1q_frank_wolfe(q=0.3, epsilon=1.8, param_ndim=None)
      >>> x = jnp.array([1.0, 1.0, 1.0])
      >>> u, _ = tx.update(jnp.array([0.0, 1.0, 2.0]), tx.init(x), x)
      >>> optax.apply_updates(x, u).tolist()
      [0.0, -0.8999999761581421, -0.8999999761581421]
    """
    slices.check_q(q, dq, seed)
    _check_ball(epsilon, learning_rate, use_default_lr_schedule, param_ndim, eps, axis_name)
    return _frank_wolfe("l1q_frank_wolfe", lambda g, axes, split, direction: direction, epsilon,
                        learning_rate, use_default_lr_schedule, slices.TINY, param_ndim,
                        axis_name, slices.DropFraction(q, dq, seed),
                        joint=lambda leaves, cut, k_of: slices.l1q_leaves(
                            leaves, cut.axes, k_of, cut.split, eps))
