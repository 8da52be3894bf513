"""Lp-space gradient transforms (rai_toolbox 0.2.1): sign, l1/l2 normalization, top-q, clamp.

rai_toolbox wraps an inner torch optimizer to sign, normalize, sparsify or clamp each gradient
slice before the step. In optax these are small transforms that go *before* the inner
optimizer, on the raw gradient, and end with ``g * grad_scale + grad_bias``. Projections of the
parameters after the step are in :mod:`optclip.projections`, Frank-Wolfe in
:mod:`optclip.frank_wolfe`.

``param_ndim`` cuts each leaf into slices: ``None`` is the whole leaf, ``k >= 0`` the
last ``k`` axes, ``k < 0`` the last ``ndim + k`` axes. It is resolved per leaf by
:func:`optclip._core.axes.reduction_axes` and may differ per leaf (a pytree matching the
parameters or a callable ``(path, leaf) -> param_ndim``); a leaf of lower rank than
``|param_ndim|`` is one slice. The default ``-1`` makes every element of a 1-D leaf its own
slice. ``axis_name`` (inside ``shard_map``/``pmap``) names the mesh axes the slices are split
over.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import axes as axes_lib
from optclip._core import checks, leafvec, norms, slices
from optclip._core import stats as stats_lib

__all__ = [
    "ClampState", "L1NormalizeState", "L1qState", "L2NormalizeState", "LpNormalizeState",
    "TopQState", "clamp", "l1_normalize", "l1q_normalize", "l2_normalize", "sign", "top_q",
]


class LpNormalizeState(NamedTuple):
    norm: Any             # per leaf: the norm of every slice before normalizing (batch shape)
    nonfinite: jax.Array  # int32 steps whose gradients were not finite


@stats_lib.diagnostic("l1_normalize", ("norm", "nonfinite"), per_leaf=("norm",))
class L1NormalizeState(LpNormalizeState):
    pass


@stats_lib.diagnostic("l2_normalize", ("norm", "nonfinite"), per_leaf=("norm",))
class L2NormalizeState(LpNormalizeState):
    pass


@stats_lib.diagnostic("top_q", ("q", "k", "nonfinite"), per_leaf=("q", "k"))
class TopQState(NamedTuple):
    key: jax.Array        # uint32[2] PRNG key for the random q (used when dq > 0)
    q: jax.Array          # (F,) per leaf: the drop fraction in force at the last step
    k: jax.Array          # (F,) per leaf: int32 entries kept per slice at the last step
    nonfinite: jax.Array


@stats_lib.diagnostic("l1q_normalize", ("q", "k", "nonfinite"), per_leaf=("q", "k"))
class L1qState(NamedTuple):
    key: jax.Array
    q: jax.Array          # (F,) per leaf, as TopQState's
    k: jax.Array          # (F,) per leaf
    nonfinite: jax.Array


@stats_lib.diagnostic("clamp", ("clipped", "nonfinite"), per_leaf=("clipped",))
class ClampState(NamedTuple):
    clipped: jax.Array    # (F,) per leaf: bool, whether any element was clamped
    nonfinite: jax.Array
    count: jax.Array      # int32 finite steps: the count that threshold schedules see


def _check_affine(grad_scale: Any, grad_bias: Any) -> None:
    slices.check_real("grad_scale", grad_scale)
    slices.check_real("grad_bias", grad_bias)


def _affine(g: jax.Array, grad_scale: Any, grad_bias: Any) -> jax.Array:
    """``g * grad_scale + grad_bias`` in the leaf dtype, skipping a literal 1 / 0."""
    if not (slices.is_number(grad_scale) and grad_scale == 1):
        g = g * jnp.asarray(grad_scale).astype(g.dtype)
    if not (slices.is_number(grad_bias) and grad_bias == 0):
        g = g + jnp.asarray(grad_bias).astype(g.dtype)
    return g


def sign(grad_scale: float = 1.0, grad_bias: float = 0.0) -> optax.GradientTransformation:
    """Replace every gradient element by its sign: ``g <- sign(g) * grad_scale + grad_bias``.

    ``sign(±0) = 0``. Elementwise, so no ``param_ndim``; stateless with no diagnostics, so no
    ``axis_name`` either: inside ``shard_map`` it needs nothing combined across devices.

    Args:
      grad_scale: multiplies the signed gradient (a finite real, as is ``grad_bias``).
      grad_bias: then added to every element (zeros included).

    Returns:
      A stateless ``optax.GradientTransformation`` (``optax.EmptyState``). Place it before the
      inner optimizer.

    References:
      rai_toolbox ``SignedGradientOptim``. ``torch.sign(NaN)`` is 0;
      optclip keeps JAX's NaN so that ``optax.apply_if_finite`` can see it.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optax.chain(optclip.sign(), optax.sgd(1.0))
      >>> x = jnp.array([-1.5, 1.5])
      >>> u, _ = tx.update(jnp.array([-2.0, 20.0]), tx.init(x), x)
      >>> optax.apply_updates(x, u).tolist()
      [-0.5, 0.5]
    """
    _check_affine(grad_scale, grad_bias)

    def update_fn(updates, state, params=None):
        del params
        signed = norms.float_map(lambda g: _affine(slices.sign(g), grad_scale, grad_bias), updates)
        return signed, state

    return checks.transformation(lambda params: optax.EmptyState(), update_fn)


def _lp_normalize(ord: float, state_cls: type, name: str, param_ndim: int | None, eps: Any,
                  grad_scale: Any, grad_bias: Any, axis_name: norms.AxisName
                  ) -> optax.GradientTransformation:
    axes_lib.check_param_ndim_spec(param_ndim)
    norms.check_axis_name(axis_name)
    checks.non_negative("eps", eps, finite=True)
    _check_affine(grad_scale, grad_bias)

    def apply(updates):
        leaves, treedef = jax.tree.flatten(updates)
        cut = slices.slicing(leaves, updates, param_ndim, axis_name)
        outputs, measured, finite = slices.normalized_leaves(leaves, cut, ord, eps, axis_name)
        new_leaves = [g if out is None else _affine(out.astype(g.dtype), grad_scale, grad_bias)
                      for g, out in zip(leaves, outputs, strict=True)]
        squeezed = [None if norm is None else jnp.squeeze(norm, axis=axes)
                    for norm, axes in zip(measured, cut.axes, strict=True)]
        return treedef.unflatten(new_leaves), treedef.unflatten(squeezed), finite

    def init_fn(params):
        measured = stats_lib.zeros_like_params(lambda p: apply(p)[1], params)
        return state_cls(measured, jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        new_updates, measured, finite = apply(updates)
        return new_updates, stats_lib.commit(finite, state_cls(measured, state.nonfinite), state)

    return checks.transformation(init_fn, update_fn)


def l1_normalize(param_ndim: int | None = -1, eps: float = slices.TINY, grad_scale: float = 1.0,
                 grad_bias: float = 0.0, *, axis_name: norms.AxisName = None
                 ) -> optax.GradientTransformation:
    """Divide every slice by its L1 norm: ``g <- g / max(Σ|g|, eps) * grad_scale + grad_bias``.

    Args:
      param_ndim: which axes form a slice (``None``: the whole leaf; ``k >= 0``: the last ``k``
        axes; ``k < 0``: the last ``ndim + k``). With the default ``-1`` a 1-D leaf is cut into
        one-element slices, so this becomes ``sign`` there. Also per leaf: a pytree matching
        the parameters or a callable ``(path, leaf) -> param_ndim``.
      eps: lower bound of the divisor (rai_toolbox ``div_by_zero_eps``), ``>= 0``.
      grad_scale: multiplies the normalized gradient.
      grad_bias: then added to every element.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the slices' axes are
        split over; partial norms are combined with ``psum``. Slices that lie whole on each
        device need none.

    Returns:
      An ``optax.GradientTransformation`` whose state logs each slice's L1 ``norm`` before
      normalizing and a ``nonfinite`` step count. A leaf of lower rank than ``|param_ndim|``
      (a 0-d temperature, a 1-D leaf with ``param_ndim=2``) is one slice; rai_toolbox 0.2.1
      raises an error there.

    References:
      rai_toolbox ``L1NormedGradientOptim``. The norm is accumulated in
      float32 (float64 for float64 leaves); where it under- or overflows the slice is rescaled
      by a power of two first, so the output keeps unit norm (the reference returns 0 for
      [3e38, 3e38]); an all-zero slice stays zero in every dtype.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.l1_normalize(param_ndim=None)
      >>> g = jnp.array([2.0, 2.0])
      >>> tx.update(g, tx.init(g))[0].tolist()
      [0.5, 0.5]
    """
    return _lp_normalize(1.0, L1NormalizeState, "l1_normalize", param_ndim, eps, grad_scale,
                         grad_bias, axis_name)


def l2_normalize(param_ndim: int | None = -1, eps: float = slices.TINY, grad_scale: float = 1.0,
                 grad_bias: float = 0.0, *, axis_name: norms.AxisName = None
                 ) -> optax.GradientTransformation:
    """Divide every slice by its L2 norm: ``g <- g / max(||g||₂, eps) * grad_scale + grad_bias``.

    Args:
      param_ndim: which axes form a slice, as in :func:`l1_normalize` (default ``-1``: rows of a
        matrix; each element of a 1-D leaf, which makes this ``sign`` there).
      eps: lower bound of the divisor (rai_toolbox ``div_by_zero_eps``), ``>= 0``.
      grad_scale: multiplies the normalized gradient.
      grad_bias: then added to every element.
      axis_name: as in :func:`l1_normalize`.

    Returns:
      An ``optax.GradientTransformation`` whose state logs each slice's L2 ``norm`` before
      normalizing and a ``nonfinite`` step count.

    References:
      rai_toolbox ``L2NormedGradientOptim``. Differences: the norm is
      accumulated in float32 or wider with a power-of-two rescaled fallback on under/overflow, so
      [1e-30, 0] gives [1, 0] (the reference gives [85070592, 0]); a zero slice stays
      zero in float16 too.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.l2_normalize(param_ndim=1)
      >>> g = jnp.array([[0.0, 0.0], [3.0, -4.0]])
      >>> tx.update(g, tx.init(g))[0].round(6).tolist()
      [[0.0, 0.0], [0.6, -0.8]]
    """
    return _lp_normalize(2.0, L2NormalizeState, "l2_normalize", param_ndim, eps, grad_scale,
                         grad_bias, axis_name)


def _top_q_family(name: str, state_cls: type, q: Any, dq: Any, param_ndim: Any, seed: int,
                  leaves_fn, grad_scale: Any, grad_bias: Any, axis_name: norms.AxisName
                  ) -> optax.GradientTransformation:
    """Shared body of ``top_q`` and ``l1q_normalize``: ``leaves_fn(leaves, axes_of, k_of,
    split_of)`` (``None`` axes for non-float leaves, returned as they are)."""
    axes_lib.check_param_ndim_spec(param_ndim)
    slices.check_q(q, dq, seed)
    _check_affine(grad_scale, grad_bias)
    norms.check_axis_name(axis_name)
    fraction = slices.DropFraction(q, dq, seed)

    def init_fn(params):
        return state_cls(*fraction.init(params), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        cut = slices.slicing(leaves, updates, param_ndim, axis_name)
        key, q, k, k_of = fraction.draw(state.key, leaves, cut.sizes)
        finite = stats_lib.all_finite(updates, axis_name)
        ranked = leaves_fn(leaves, cut.axes, k_of, cut.split)
        # Computed after the finiteness check, which reads the leaves too: with the gradients
        # donated XLA would otherwise copy each leaf to keep it for the check.
        new_leaves = [_affine(stats_lib.after(finite, r), grad_scale, grad_bias)
                      if norms.is_float(g) else g for g, r in zip(leaves, ranked, strict=True)]
        new_state = state_cls(key, q, k, state.nonfinite)
        return treedef.unflatten(new_leaves), stats_lib.commit(finite, new_state, state)

    return checks.transformation(init_fn, update_fn, pairs_leaves=True)


def top_q(q: float, dq: float = 0.0, param_ndim: int | None = -1, grad_scale: float = 1.0,
          grad_bias: float = 0.0, seed: int = 0, *, axis_name: norms.AxisName = None
          ) -> optax.GradientTransformation:
    """Keep the largest ``1 - q`` fraction of every slice (by ``|g|``), zero the rest.

    Per slice of ``D`` entries, ``k = round((1 - q) * D)`` (double precision, half to even: q=0.5
    on D=3 keeps 2, q=0.75 on D=2 keeps none); the ``k`` entries of largest ``|g|`` keep their
    signed values, the others become 0; then ``g * grad_scale + grad_bias``. Ties at the cut-off
    keep the lowest indices, so exactly ``k`` entries survive; NaN ranks above infinity (as in
    ``torch.topk``). With ``dq > 0`` each leaf draws,
    every step, ``q_t ~ U[max(0, q - dq), min(1, q + dq))`` (float32) from a PRNG key held in
    the state; all slices of a leaf share it.

    Under ``jax.jit`` on sharded arrays each slice is ranked where it lives; a slice spread over
    several devices (for example ``param_ndim=None`` on a sharded matrix) is gathered for the
    ranking. Inside ``shard_map``/``pmap`` with ``axis_name`` nothing is gathered: the cut-off
    of every split slice is found by an exact search with counts added across devices.

    Args:
      q: the fraction of every slice that is dropped, in ``[0, 1]`` (required: ``q=0.9`` keeps
        the top 10 %).
      dq: half-width of the random interval around ``q``, in ``[0, 1]``.
      param_ndim: which axes form a slice, as in :func:`l1_normalize` (default ``-1``: with it a
        1-D leaf is all-or-nothing, kept iff ``q < 0.5``).
      grad_scale: multiplies the sparsified gradient.
      grad_bias: then added to every element (zeros included).
      seed: seed of the PRNG key used when ``dq > 0``.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the slices' axes are
        split over. ``k`` then counts the whole slice, and the ``k`` largest entries of the
        whole slice are kept: a bisection on the magnitudes' bits whose 31 rounds (63 for
        float64) each add one count per slice across devices (``psum``). Ties at the cut-off
        keep the lowest (device, local index) first, the global lowest index when the named
        axes split the slice's leading axis.

    Returns:
      An ``optax.GradientTransformation`` whose state holds the PRNG key and logs, per leaf,
      the ``q`` in force and the number ``k`` of entries kept per slice, each as one vector
      over the floating leaves (:func:`optclip.per_leaf` gives a tree).

    References:
      rai_toolbox ``TopQGradientOptimizer``. Differences: ``q`` has no
      silent default of 0.001; ties keep the lowest index (torch.topk: arbitrary);
      the random ``q`` comes from an explicit JAX key instead of torch's global generator, one
      draw per leaf per step as in the reference.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.top_q(0.5, param_ndim=None)
      >>> g = jnp.array([[0.5, 1.0], [-2.5, 0.3]])
      >>> tx.update(g, tx.init(g))[0].tolist()
      [[0.0, 1.0], [-2.5, 0.0]]
    """
    return _top_q_family("top_q", TopQState, q, dq, param_ndim, seed, slices.top_q_kept_leaves,
                         grad_scale, grad_bias, axis_name)


def l1q_normalize(q: float, dq: float = 0.0, param_ndim: int | None = -1, eps: float = slices.TINY,
                  grad_scale: float = 1.0, grad_bias: float = 0.0, seed: int = 0, *,
                  axis_name: norms.AxisName = None) -> optax.GradientTransformation:
    """Top-q, then sign, then L1 normalization of every slice.

    Per slice: keep the ``k = round((1 - q) * D)`` entries of largest ``|g|`` (as
    :func:`top_q`), take their signs, divide by the number ``c`` of non-zero kept entries (an
    exact zero that was kept does not count), so every kept entry becomes ``±1/c`` and a slice
    with ``c > 0`` has L1 norm 1; then ``g * grad_scale + grad_bias``.

    Args:
      q: the fraction of every slice that is dropped, in ``[0, 1]`` (required).
      dq: half-width of the random interval around ``q``, in ``[0, 1]`` (see :func:`top_q`).
      param_ndim: which axes form a slice, as in :func:`l1_normalize` (default ``-1``).
      eps: lower bound of the L1 divisor (rai_toolbox ``div_by_zero_eps``), ``>= 0``.
      grad_scale: multiplies the normalized gradient (the L1 norm of each non-zero slice).
      grad_bias: then added to every element (zeros included).
      seed: seed of the PRNG key used when ``dq > 0``.
      axis_name: as in :func:`top_q` (the count ``c`` is added across devices too).

    Returns:
      An ``optax.GradientTransformation`` whose state holds the PRNG key and logs, per leaf,
      the ``q`` in force and the number ``k`` of entries kept per slice, each as one vector
      over the floating leaves (:func:`optclip.per_leaf` gives a tree).

    References:
      rai_toolbox ``L1qNormedGradientOptim``. Differences as in
      :func:`top_q`; NaN propagates instead of becoming 0 (``torch.sign(NaN) = 0``).

    Example:
      The rai_toolbox documentation's example (keep 70 %, ``param_ndim=None``, SGD with lr 1):

      >>> import jax.numpy as jnp, optax, optclip
      >>> l1q = optclip.l1q_normalize(q=0.30, param_ndim=None, grad_scale=1.8)
      >>> tx = optax.chain(l1q, optax.sgd(1.0))
      >>> x = jnp.array([1.0, 1.0, 1.0])
      >>> g = jnp.array([0.0, 1.0, 2.0])
      >>> l1q.update(g, l1q.init(x))[0].tolist()  # the transformed gradient
      [0.0, 0.8999999761581421, 0.8999999761581421]
      >>> u, _ = tx.update(g, tx.init(x), x)
      >>> optax.apply_updates(x, u).tolist()  # the new x
      [1.0, 0.10000002384185791, 0.10000002384185791]
    """
    checks.non_negative("eps", eps, finite=True)
    return _top_q_family("l1q_normalize", L1qState, q, dq, param_ndim, seed,
                         lambda *cut: slices.l1q_leaves(*cut, eps),
                         grad_scale, grad_bias, axis_name)


def clamp(clamp_min: float | None = None, clamp_max: float | None = None,
          grad_scale: float = 1.0, grad_bias: float = 0.0, *, axis_name: norms.AxisName = None
          ) -> optax.GradientTransformation:
    """Clamp every gradient element, then scale and shift it.

    ``g <- clip(g, clamp_min, clamp_max) * grad_scale + grad_bias``.

    A ``None`` bound is absent. Scale and bias come after, so the output can leave the bounds.

    Args:
      clamp_min: lower bound, ``None`` or an optax schedule ``count -> value`` (``count``:
        finite steps taken).
      clamp_max: upper bound, ``None`` or a schedule (at least one must be set;
        ``clamp_min <= clamp_max``).
      grad_scale: multiplies the clamped gradient.
      grad_bias: then added to every element.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split over:
        the clamping is elementwise; only the per-leaf ``clipped`` flag and the non-finite check
        are combined across devices (``pmax``/``pmin`` of one flag each), so the state is the
        same on every device.

    Returns:
      An ``optax.GradientTransformation`` whose state logs, per leaf, whether any element was
      ``clipped`` (one vector over the floating leaves; :func:`optclip.per_leaf` gives a
      tree), and a ``nonfinite`` step count.

    References:
      rai_toolbox ``ClampedGradientOptimizer``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.clamp(-1.0, 3.0)
      >>> g = jnp.array([-0.5, 10.0])
      >>> tx.update(g, tx.init(g))[0].tolist()
      [-0.5, 3.0]
    """
    slices.check_bounds(clamp_min, clamp_max)
    _check_affine(grad_scale, grad_bias)
    norms.check_axis_name(axis_name)

    def init_fn(params):
        return ClampState(leafvec.full(params, False, jnp.bool_), jnp.zeros([], jnp.int32),
                          jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        low, high = slices.bounds_at(state.count, clamp_min, clamp_max)
        clamped, clipped, finite = slices.clamped_leaves(updates, low, high, axis_name)
        new_state = ClampState(clipped, state.nonfinite, optax.safe_increment(state.count))
        return norms.float_map(lambda g: _affine(g, grad_scale, grad_bias), clamped), (
            stats_lib.commit(finite, new_state, state))

    return checks.transformation(init_fn, update_fn, pairs_leaves=True)
