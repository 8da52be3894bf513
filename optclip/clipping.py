"""Stateless clippers and normalizers, and the functional helpers.

References: torchzero 0.4.4 ``ClipValue``, ``ClipNorm``, ``Normalize``, ``Centralize`` and the
helpers ``clip_grad_norm_``, ``clip_grad_value_``, ``normalize_grads_``;
drytorch ``GradNormClipper``, ``GradValueClipper``, ``GradParamNormalizer``,
``GradZScoreNormalizer``; declearn ``L2Clipping``, ``L2GlobalClipping``.

"Stateless" means the maths keeps no history; the states below hold only a step count (for
threshold schedules) and the diagnostics of the last step.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip._core import axes as axes_lib
from optclip._core import checks, leafvec, norms, slices
from optclip._core import stats as stats_lib
from optclip._core.axes import Dim
from optclip._core.checks import ScalarOrSchedule
from optclip._core.norms import AxisName, Ord

__all__ = [
    "ClipNormState", "ClipValueState", "GlobalClipState", "GlobalNormalizeState", "NormalizeState",
    "centralize", "clip_by_global_norm", "clip_grad_norm", "clip_grad_value", "clip_norm",
    "clip_value", "normalize", "normalize_grads", "zscore_normalize",
]


@stats_lib.diagnostic("clip_value", ("max_abs", "clipped", "nonfinite"),
                      per_leaf=("max_abs", "clipped"))
class ClipValueState(NamedTuple):
    count: jax.Array      # int32 steps taken (for a ``value`` schedule)
    max_abs: jax.Array    # (F,) per leaf: largest |g| before clipping (last finite step)
    clipped: jax.Array    # (F,) per leaf: bool, whether any element was clipped
    nonfinite: jax.Array  # int32 steps whose gradients were not finite


@stats_lib.diagnostic("clip_norm", ("norm", "clipped", "nonfinite"), per_leaf=("norm", "clipped"))
class ClipNormState(NamedTuple):
    count: jax.Array
    norm: Any             # per leaf: the pre-clip norm of every slice (reduced axes removed)
    clipped: Any          # per leaf: per slice, whether it was scaled down
    nonfinite: jax.Array


@stats_lib.diagnostic("clip_by_global_norm", ("norm", "scale", "clipped", "nonfinite"))
class GlobalClipState(NamedTuple):
    count: jax.Array
    norm: jax.Array       # pre-clip global norm
    scale: jax.Array      # factor every leaf was multiplied by
    clipped: jax.Array    # bool
    nonfinite: jax.Array


@stats_lib.diagnostic("normalize", ("norm", "nonfinite"), per_leaf=("norm",))
class NormalizeState(NamedTuple):
    count: jax.Array
    norm: Any             # per leaf: the norm of every slice before scaling
    nonfinite: jax.Array


@stats_lib.diagnostic("normalize", ("norm", "nonfinite"))
class GlobalNormalizeState(NamedTuple):
    count: jax.Array
    norm: jax.Array       # the global norm before scaling
    nonfinite: jax.Array


def _finite(ord: float | str, updates: Any, measured: Any, axis_name=None) -> jax.Array:
    """Whether the step was finite: from the measured norms where ``ord`` sees every NaN/Inf,
    else (``ord`` 0, negative, ``-inf``: an Inf leaves them finite) from the updates too."""
    finite = stats_lib.all_finite(measured, axis_name)
    if norms.sees_nonfinite(ord):
        return finite
    return finite & stats_lib.all_finite(updates, axis_name)


def _advance(state, finite: jax.Array, **fields):
    """The next state, committed by ``stats.commit``: a non-finite step leaves every field as it
    was (``count`` too, so a threshold schedule continues where the last finite step left it)
    and counts in ``nonfinite``."""
    new = state._replace(count=optax.safe_increment(state.count), **fields)
    return stats_lib.commit(finite, new, state)


def _check_slices(ord: Ord, dim: Dim, inverse_dims: bool, min_size: int,
                  axis_name: AxisName = None) -> float | str:
    norms.check_axis_name(axis_name)
    axes_lib.check_dim(dim, allow_per_leaf=True)
    checks.boolean("inverse_dims", inverse_dims)
    checks.integer("min_size", min_size, low=0)
    return norms.canonical_ord(ord)


# ---------------------------------------------------------------------------------------------
# Functional helpers (torchzero clip_grad_norm_, clip_grad_value_, normalize_grads_).

def clip_grad_value(grads: Any, value: ScalarOrSchedule) -> Any:
    """Clamp every element to ``[-value, value]``; returns a new tree.

    ``g <- min(max(g, -value), value)``. NaN stays NaN; integer leaves pass through.

    Args:
      grads: a pytree of arrays.
      value: the bound, ``> 0`` (torchzero 0.4.4 sets every element to ``value`` when it is
        negative; optclip rejects it).

    Returns:
      The clamped tree (each leaf keeps its dtype).

    References:
      torchzero ``clip_grad_value_``; drytorch ``GradValueClipper``; ``optax.clip``.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> optclip.clip_grad_value({"w": jnp.array([3.0, -4.0, 0.5])}, 1.0)["w"].tolist()
      [1.0, -1.0, 0.5]
    """
    checks.positive("value", value)
    return norms.float_map(lambda g: _clamp(g, value), grads)


def _clamp(g: jax.Array, value) -> jax.Array:
    bound = jnp.asarray(value).astype(g.dtype)
    return jnp.clip(g, -bound, bound)


def _read_first(bound, peak: jax.Array, finite: jax.Array) -> jax.Array:
    """The clamp bound of a leaf whose largest ``|g|`` is ``peak``: ``bound``, or ``peak`` where
    that is smaller and the leaf finite, which clamps the same (no ``|g|`` exceeds ``peak``).

    Why: the clamp then reads the leaf's statistics, so XLA computes them before it writes the
    output; otherwise, with the gradients donated, it copies every gradient first to keep them
    for the reductions.
    """
    bound = jnp.asarray(bound).astype(peak.dtype)
    return jnp.where(finite & (peak < bound), peak, bound)


def _exceeds(values: jax.Array, bound, group_list: list[leafvec.Group], like: jax.Array
             ) -> jax.Array:
    """Per leaf, whether its entry of the per-leaf vector ``values`` exceeds ``bound``, compared
    in the leaf's statistics dtype (as the leaf's own value would be): one comparison of the
    vector, not one kernel per leaf."""
    return leafvec.assemble([leafvec.take(values, group) > bound for group in group_list],
                            group_list, like)


def _whole_leaves(measured: Any) -> bool:
    """Whether every floating leaf is one slice (its measured norm is 0-d): the per-slice
    values are then kept as one vector over the floating leaves, not as a tree of 0-d arrays
    (a step whose state has one output per leaf and field compiles in time quadratic in the
    leaves)."""
    return all(jnp.ndim(n) == 0 for n in jax.tree.leaves(measured))


def _slice_zeros(zeros: Any, params: Any) -> Any:
    """The initial per-slice values: ``zeros`` (a tree of per-slice zeros), or, where every
    leaf is one slice, a per-leaf vector of zeros."""
    return leafvec.full(params, 0.0) if _whole_leaves(zeros) else zeros


def _maxima_and_marks(floats: list[jax.Array], axis_name: AxisName) -> tuple[list, list]:
    """Per float leaf, the largest ``|g|`` (wide dtype; on every device along ``axis_name``;
    ``-inf`` for an empty leaf) and the sum of its NaN marks on this device (0 exactly when
    the leaf is finite). Small leaves of one shape share one reduction of each kind
    (:func:`optclip._core.norms.leaf_reductions`)."""
    split = norms.split_axes(floats, axis_name)
    maxima = norms.leaf_reductions(floats, lambda g: jnp.abs(g.astype(norms.acc_dtype(g.dtype))),
                                   "max")
    return ([norms.across(m, "max", sp) for m, sp in zip(maxima, split)],
            norms.leaf_reductions(floats, stats_lib.nan_marks))


def _clip_grad_norm(grads, max_norm, ord, dim, inverse_dims, min_size, min_norm, axis_name=None):
    """Returns ``(clipped tree, norms)``; shared by the helper and ``clip_norm``."""
    def multiplier(norm):
        hi = (slices.clip_multiplier(norm, jnp.asarray(max_norm, norm.dtype))
              if max_norm is not None else jnp.ones_like(norm))
        if min_norm is None:
            return hi
        lo = jnp.asarray(min_norm, norm.dtype)
        # torchzero scales tiny (<= 1e-12) slices by min_norm: leave them.
        grow = (norm > norms.TINY_NORM) & (norm < lo)
        return hi * jnp.where(grow, lo / jnp.where(grow, norm, 1), 1)

    return slices.scale_slices(grads, ord, multiplier, dim=dim, inverse_dims=inverse_dims,
                              min_size=min_size, axis_name=axis_name)


def clip_grad_norm(
    grads: Any,
    max_norm: float | None,
    ord: Ord = 2,
    dim: Dim = None,
    inverse_dims: bool = False,
    min_size: int = 2,
    min_norm: float | None = None,
    axis_name: AxisName = None,
) -> Any:
    """Clip each slice's norm into ``[min_norm, max_norm]``; returns a new tree.

    ``g <- g * min(1, max_norm / ||g||) * max(1, min_norm / ||g||)`` per slice (see the axes
    vocabulary), or over all leaves with ``dim='global'``. Per leaf by default (unlike
    ``torch.nn.utils.clip_grad_norm_``), and with ``min_size=2`` one-element slices are left
    alone. ``min_norm`` never scales up a slice whose norm is at most ``1e-12``.

    Args:
      grads: a pytree of arrays.
      max_norm: upper bound (``> 0``) or ``None`` for none.
      ord: the metric (any number or ``'l0'``-``'l4'``, ``'linf'``, ``'mad'``, ``'std'``,
        ``'var'``, ``'sum'``).
      dim, inverse_dims, min_size: which axes form a slice (``optclip`` axes vocabulary).
      min_norm: lower bound (``> 0``): smaller slices are scaled up to it; ``None`` for none.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the reduced axes are
        split over; partial norms are combined across devices with ``psum``.

    Returns:
      The clipped tree (each leaf keeps its dtype).

    References:
      torchzero ``clip_grad_norm_``.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> optclip.clip_grad_norm([jnp.array([3.0, 4.0])], 1.0)[0].tolist()
      [0.6000000238418579, 0.800000011920929]
    """
    ord = _check_slices(ord, dim, inverse_dims, min_size, axis_name)
    checks.positive("max_norm", max_norm, allow_none=True)
    checks.positive("min_norm", min_norm, allow_none=True)
    return _clip_grad_norm(grads, max_norm, ord, dim, inverse_dims, min_size, min_norm,
                           axis_name)[0]


def _normalized(grads, norm_value, ord, dim, inverse_dims, min_size, eps, axis_name=None):
    """Returns ``(normalized tree, norms)``; shared by the helper and ``normalize``."""
    def multiplier(norm):
        return slices.normalize_multiplier(norm, jnp.asarray(norm_value, norm.dtype), eps)

    return slices.scale_slices(grads, ord, multiplier, dim=dim, inverse_dims=inverse_dims,
                              min_size=min_size, axis_name=axis_name)


def normalize_grads(
    grads: Any,
    norm_value: float,
    ord: Ord = 2,
    dim: Dim = None,
    inverse_dims: bool = False,
    min_size: int = 1,
    axis_name: AxisName = None,
) -> Any:
    """Scale each slice to norm ``norm_value``; returns a new tree.

    ``g <- g * norm_value / ||g||`` per slice (or globally with ``dim='global'``); slices whose
    norm is ``<= 1e-12`` are left unchanged.

    Args:
      grads: a pytree of arrays.
      norm_value: the target norm, ``> 0``.
      ord, dim, inverse_dims, min_size, axis_name: as in :func:`clip_grad_norm`.

    Returns:
      The normalized tree (each leaf keeps its dtype).

    References:
      torchzero ``normalize_grads_``.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> optclip.normalize_grads([jnp.array([3.0, 4.0])], 2.0)[0].tolist()
      [1.2000000476837158, 1.600000023841858]
    """
    ord = _check_slices(ord, dim, inverse_dims, min_size, axis_name)
    checks.positive("norm_value", norm_value, finite=True)
    return _normalized(grads, norm_value, ord, dim, inverse_dims, min_size, None, axis_name)[0]


# ---------------------------------------------------------------------------------------------
# Transforms.

def clip_value(value: ScalarOrSchedule, axis_name: AxisName = None
               ) -> optax.GradientTransformation:
    """Clamp every element of the updates to ``[-value, value]``.

    ``g <- min(max(g, -value), value)``; NaN stays NaN.

    Args:
      value: the bound, ``> 0``, or a schedule ``count -> value``.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split over:
        the logged per-leaf ``max_abs`` is then the maximum over all devices.

    Returns:
      An ``optax.GradientTransformation``. Its state logs, per leaf, the largest ``|g|`` seen
      before clipping (``max_abs``) and whether anything was ``clipped``, each as one vector
      over the floating leaves (:func:`optclip.per_leaf` gives a tree).

    References:
      torchzero ``ClipValue``; drytorch ``GradValueClipper``. torchzero turns every
      element into ``value`` when ``value`` is negative; optclip rejects a non-positive ``value``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.clip_value(1.0)
      >>> g = {"w": jnp.array([3.0, -4.0, 0.5])}
      >>> tx.update(g, tx.init(g))[0]["w"].tolist()
      [1.0, -1.0, 0.5]
    """
    checks.positive("value", value, allow_schedule=True)
    norms.check_axis_name(axis_name)

    def init_fn(params):
        return ClipValueState(jnp.zeros([], jnp.int32), leafvec.full(params, 0.0),
                              leafvec.full(params, False, jnp.bool_), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        bound = checks.resolve(value, state.count, name="value")
        # Step time: on large leaves XLA:CPU's integer maximum of the magnitude bits (one
        # NaN-exact reduction) ran about 2x slower than a float maximum plus a finiteness sum.
        leaves, treedef = jax.tree.flatten(updates)
        maxima, marks = _maxima_and_marks([g for g in leaves if norms.is_float(g)], axis_name)
        # The finiteness and the diagnostics are taken from vectors of the leaves' reductions:
        # each leaf's own scalars are then read only by its clamp, which they fuse into (a
        # per-leaf comparison or maximum feeding the vectors costs a kernel per leaf).
        finite = norms.all_true(jnp.all(leafvec.stack(marks, state.max_abs) == 0), axis_name)
        limits = iter([_read_first(bound, jnp.maximum(m, 0), s == 0)
                       for m, s in zip(maxima, marks)])
        new_leaves = [_clamp(g, next(limits)) if norms.is_float(g) else g for g in leaves]
        max_abs = jnp.maximum(leafvec.stack(maxima, state.max_abs), 0)
        clipped = _exceeds(max_abs, bound, leafvec.groups(leaves), state.clipped)
        return treedef.unflatten(new_leaves), _advance(state, finite, max_abs=max_abs,
                                                       clipped=clipped)

    return checks.transformation(init_fn, update_fn, pairs_leaves=True)


def clip_by_global_norm(max_norm: ScalarOrSchedule = 1.0, ord: Ord = 2,
                        axis_name: AxisName = None) -> optax.GradientTransformation:
    """Scale all updates by one factor so that their global norm is at most ``max_norm``.

    ``g <- g * min(1, max_norm / N)`` with ``N`` the metric of all leaves as one vector,
    computed from per-leaf partial sums (accumulated in float32 or wider).

    Args:
      max_norm: the bound, ``> 0``, or a schedule ``count -> bound``.
      ord: the metric, as in :func:`clip_norm`.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) (a name or a tuple) the
        leaves are split over: per-device partial sums are combined with ``psum`` (``pmax`` /
        ``pmin`` for ``±inf``), so every device clips by the global norm and keeps the same
        state. Not needed under ``jax.jit`` with sharded arrays.

    Returns:
      An ``optax.GradientTransformation`` whose state logs ``norm`` (pre-clip), ``scale``,
      ``clipped`` and ``nonfinite``.

    References:
      drytorch ``GradNormClipper``, declearn ``L2GlobalClipping``, torchzero
      ``ClipNorm(dim='global')``. drytorch (through ``torch.nn.utils.clip_grad_norm_``)
      multiplies by ``max_norm / (N + 1e-6)``; optclip clips exactly to ``max_norm``
      (a relative difference of about ``1e-6 / N``). Unlike ``optax.clip_by_global_norm``
      the norm of bf16/f16 trees is accumulated in float32.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.clip_by_global_norm(1.0)
      >>> g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array(12.0)}
      >>> out, state = tx.update(g, tx.init(g))
      >>> round(float(optax.tree.norm(out)), 5), float(state.norm)
      (1.0, 13.0)
    """
    checks.positive("max_norm", max_norm, allow_schedule=True)
    ord = norms.canonical_ord(ord)
    norms.check_axis_name(axis_name)

    def init_fn(params):
        zero = jnp.zeros([], norms.stat_dtype(params))
        return GlobalClipState(jnp.zeros([], jnp.int32), zero, jnp.ones_like(zero),
                               jnp.zeros([], bool), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        bound = checks.resolve(max_norm, state.count, norms.stat_dtype(), name="max_norm")
        norm = norms.global_norm(updates, ord, axis_name)
        factor = slices.clip_multiplier(norm, bound.astype(norm.dtype))
        new_updates = jax.tree.map(lambda g: norms.scale(g, factor), updates)
        norm = norm.astype(state.norm.dtype)
        return new_updates, _advance(
            state, _finite(ord, updates, norm), norm=stats_lib.keep_finite(norm, state.norm),
            scale=stats_lib.keep_finite(factor.astype(state.scale.dtype), state.scale),
            clipped=norm > bound)

    return checks.transformation(init_fn, update_fn)


def clip_norm(
    max_norm: ScalarOrSchedule,
    ord: Ord = 2,
    dim: Dim = None,
    inverse_dims: bool = False,
    min_size: int = 1,
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Clip the norm of every slice of every leaf to at most ``max_norm``.

    ``g <- g * min(1, max_norm / ||g||)`` per slice; the factor is exactly 1 whenever
    ``||g|| <= max_norm``. ``dim=None`` (default) makes each leaf one slice; ``dim='global'``
    is :func:`clip_by_global_norm`.

    Args:
      max_norm: the bound, ``> 0``, or a schedule ``count -> bound``.
      ord: the metric: any number (``0`` counts non-zeros, ``±inf`` max/min ``|g|``) or
        ``'l0'``-``'l4'``, ``'linf'``, ``'mad'``, ``'std'``, ``'var'``, ``'sum'`` (as ``|Σg|``).
      dim: the axes that form a slice: ``None`` (all axes of each leaf), an int or ints
        (negative allowed; axes beyond a leaf's rank ignored) or ``'global'``.
      inverse_dims: reduce over the complement of ``dim`` instead.
      min_size: slices with fewer elements are left alone.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) over which the reduced
        axes of the leaves are split (with ``dim='global'`` or whole-leaf slices: the axes the
        leaves are split over); partial norms are combined with ``psum``. Slices that lie
        whole on each device need none.

    Returns:
      An ``optax.GradientTransformation`` whose state logs the per-slice pre-clip ``norm`` and
      ``clipped`` flags (``optclip.stats`` reports their max and the clipped fraction): per
      leaf, with the reduced axes removed, or, where every leaf is one slice (``dim=None``),
      one vector over the floating leaves each (:func:`optclip.per_leaf` gives a tree).

    References:
      torchzero ``ClipNorm``, declearn ``L2Clipping``. Differences
      from torchzero 0.4.4: ``dim=None`` is resolved per leaf; negative axes are
      normalised before ``inverse_dims``; a slice at or below ``max_norm`` is never scaled
      (torchzero shrinks slices below ``1e-12``); ``'sum'`` never flips signs;
      ``'std'``/``'var'`` slices of one element are left alone.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.clip_norm(2.0, dim=1)
      >>> g = jnp.array([[3.0, 4.0], [0.3, 0.4]])
      >>> tx.update(g, tx.init(g))[0].round(4).tolist()
      [[1.2, 1.6], [0.3, 0.4]]
    """
    if dim == axes_lib.GLOBAL:
        return clip_by_global_norm(max_norm, ord, axis_name)
    checks.positive("max_norm", max_norm, allow_schedule=True)
    ord = _check_slices(ord, dim, inverse_dims, min_size, axis_name)

    def measure(tree, bound):
        return _clip_grad_norm(tree, bound, ord, dim, inverse_dims, min_size, None, axis_name)

    def init_fn(params):
        zeros = stats_lib.zeros_like_params(lambda p: measure(p, 1.0)[1], params)
        norm = _slice_zeros(zeros, params)
        return ClipNormState(jnp.zeros([], jnp.int32), norm, jax.tree.map(lambda z: z > 0, norm),
                             jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        bound = checks.resolve(max_norm, state.count, norms.stat_dtype(), name="max_norm")
        new_updates, measured = measure(updates, bound)
        finite = _finite(ord, updates, measured, axis_name)
        if _whole_leaves(measured):
            norm = leafvec.stack(jax.tree.leaves(measured), state.norm)
            clipped = _exceeds(norm, bound, leafvec.groups(jax.tree.leaves(updates)),
                               state.clipped)
        else:
            norm = measured
            clipped = jax.tree.map(lambda n: n > bound.astype(n.dtype), measured)
        return new_updates, _advance(state, finite, norm=norm, clipped=clipped)

    return checks.transformation(init_fn, update_fn, pairs_leaves=True)


def normalize(
    norm_value: ScalarOrSchedule = 1.0,
    ord: Ord = 2,
    dim: Dim = None,
    inverse_dims: bool = False,
    min_size: int = 1,
    eps: float | None = None,
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Scale every slice (or, with ``dim='global'``, all updates) to norm ``norm_value``.

    ``g <- g * norm_value / ||g||``; slices with norm ``<= 1e-12`` are left unchanged.
    With ``eps``: ``g <- g * norm_value / (||g|| + eps)`` (zero stays zero, no threshold).

    Args:
      norm_value: the target norm, ``> 0``, or a schedule.
      ord, dim, inverse_dims, min_size: as in :func:`clip_norm`.
      eps: ``None`` (torchzero) or a positive number added to the norm (drytorch
        ``GradParamNormalizer`` is ``normalize(1.0, eps=1e-8)``).
      axis_name: as in :func:`clip_norm`.

    Returns:
      An ``optax.GradientTransformation`` whose state logs the measured ``norm`` (per slice, as
      :func:`clip_norm` keeps it: one vector over the floating leaves where every leaf is one
      slice).

    References:
      torchzero ``Normalize``; drytorch ``GradParamNormalizer``.
      Differences from torchzero 0.4.4: as for :func:`clip_norm`, plus
      a zero update is left unchanged in the global path too (it returns NaN).

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.normalize(2.0, dim="global")
      >>> g = [jnp.array([3.0, 4.0]), jnp.array(12.0)]
      >>> [x.round(5).tolist() for x in tx.update(g, tx.init(g))[0]]
      [[0.46154, 0.61538], 1.84615]
    """
    checks.positive("norm_value", norm_value, allow_schedule=True, finite=True)
    checks.positive("eps", eps, allow_none=True, finite=True)
    ord = _check_slices(ord, dim, inverse_dims, min_size, axis_name)

    def measure(tree, target):
        return _normalized(tree, target, ord, dim, inverse_dims, min_size, eps, axis_name)

    per_slice = dim != axes_lib.GLOBAL
    state_cls = NormalizeState if per_slice else GlobalNormalizeState

    def init_fn(params):
        zeros = stats_lib.zeros_like_params(lambda p: measure(p, 1.0)[1], params)
        norm = _slice_zeros(zeros, params) if per_slice else zeros
        return state_cls(jnp.zeros([], jnp.int32), norm, jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        target = checks.resolve(norm_value, state.count, norms.stat_dtype(), name="norm_value")
        new_updates, measured = measure(updates, target)
        finite = _finite(ord, updates, measured, axis_name)
        if per_slice and _whole_leaves(measured):
            measured = leafvec.stack(jax.tree.leaves(measured), state.norm)
        return new_updates, _advance(state, finite, norm=measured)

    return checks.transformation(init_fn, update_fn, pairs_leaves=per_slice)


def centralize(dim: Dim = None, inverse_dims: bool = False, min_size: int = 2,
               axis_name: AxisName = None) -> optax.GradientTransformation:
    """Subtract the mean of every slice (gradient centralization).

    ``g <- g - mean(g)`` over the slice's axes; with ``dim='global'`` the mean of all elements
    of all leaves is subtracted everywhere. Slices smaller than ``min_size`` are left alone.

    Args:
      dim, inverse_dims, min_size: as in :func:`clip_norm` (``min_size`` defaults to 2, so
        single-element leaves such as scalars are untouched). Gradient centralization as in
        Yong et al. (2020) is ``centralize(dim=0, inverse_dims=True)``: one mean per output row,
        1-D biases untouched.
      axis_name: as in :func:`clip_norm` (the means are combined across devices).

    Returns:
      An ``optax.GradientTransformation`` (no state).

    References:
      torchzero ``Centralize``. Differences from torchzero 0.4.4:
      ``dim=None`` per leaf; 0-d leaves are treated as one element.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.centralize()
      >>> g = jnp.array([1.0, 2.0, 6.0])
      >>> tx.update(g, tx.init(g))[0].tolist()
      [-2.0, -1.0, 3.0]
    """
    axes_lib.check_dim(dim, allow_per_leaf=True)
    checks.boolean("inverse_dims", inverse_dims)
    checks.integer("min_size", min_size, low=0)
    norms.check_axis_name(axis_name)

    def centre(g, mean):
        return (g.astype(mean.dtype) - mean).astype(g.dtype)

    def one_leaf(g, leaf_dim):
        if not norms.is_float(g):
            return g
        axes = axes_lib.reduction_axes(g.ndim, leaf_dim, inverse_dims)
        split = norms.split_axes([g], axis_name)[0]
        if axes is None or axes_lib.slice_size(g.shape, axes) * norms.axes_size(split) < min_size:
            return g
        total = norms.across(jnp.sum(g.astype(norms.acc_dtype(g.dtype)), axis=axes,
                                     keepdims=True), "sum", split)
        return centre(g, total / (axes_lib.slice_size(g.shape, axes) * norms.axes_size(split)))

    def update_fn(updates, state, params=None):
        del params
        if dim != axes_lib.GLOBAL:
            leaves, treedef = jax.tree.flatten(updates)
            return treedef.unflatten([one_leaf(g, d) for g, d in zip(
                leaves, axes_lib.leaf_dims(dim, updates))]), state
        leaves = [g for g in jax.tree.leaves(updates) if norms.is_float(g)]
        split = norms.split_axes(leaves, axis_name)
        total = norms.tree_sum([jnp.sum(g.astype(norms.acc_dtype(g.dtype))) for g in leaves],
                               split)
        mean = total / max(sum(g.size * norms.axes_size(a) for g, a in zip(leaves, split)), 1)
        return norms.float_map(lambda g: centre(g, mean), updates), state

    return checks.transformation(lambda params: optax.EmptyState(), update_fn)


def zscore_normalize(eps: float = 1e-8, axis_name: AxisName = None
                     ) -> optax.GradientTransformation:
    """Standardise every leaf: ``g <- (g - mean(g)) / (std(g) + eps)``.

    ``std`` is the unbiased (ddof=1) standard deviation over all elements of the leaf. A leaf
    of one element has no spread: its std is taken as 0, so it becomes 0.

    Args:
      eps: added to the std, ``> 0``.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split
        over (mean and std are combined across devices).

    Returns:
      An ``optax.GradientTransformation`` (no state).

    References:
      drytorch ``GradZScoreNormalizer``, which turns one-element and
      0-d gradients into NaN.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.zscore_normalize()
      >>> g = jnp.array([1.24, -1.64])
      >>> tx.update(g, tx.init(g))[0].round(6).tolist()
      [0.707107, -0.707107]
    """
    checks.positive("eps", eps, finite=True)
    norms.check_axis_name(axis_name)

    def measured(g):
        return norms.is_float(g) and g.size > 0

    def update_fn(updates, state, params=None):
        del params
        wide = [g.astype(norms.acc_dtype(g.dtype)) for g in jax.tree.leaves(updates)
                if measured(g)]
        split = norms.split_axes(wide, axis_name)
        sizes = [g.size * norms.axes_size(axes) for g, axes in zip(wide, split)]
        # Sums of small leaves of one shape share one reduce (norms.leaf_reductions).
        means = [norms.across(total, "sum", axes) / size for total, axes, size in
                 zip(norms.leaf_reductions(wide, lambda g: g), split, sizes)]
        # std = ||g - mean|| / sqrt(n - 1), the 2-norms of all leaves reduced once each (finite
        # derivative at a constant leaf, no overflow for huge elements). drytorch divides by an
        # unbiased std of NaN for one element: use 0.
        spreads = norms.leaf_norms(lambda: _centred(wide, means), 2.0, axis_name)
        outputs = iter([(g - mean) / (_std(spread, size) + eps)
                        for g, mean, spread, size in zip(wide, means, spreads, sizes)])
        return jax.tree.map(lambda g: next(outputs).astype(g.dtype) if measured(g) else g,
                            updates), state

    return checks.transformation(lambda params: optax.EmptyState(), update_fn)


def _std(spread: jax.Array, size: int) -> jax.Array:
    """The unbiased std from ``||g - mean||`` over ``size`` elements (0 for one element)."""
    return spread / math.sqrt(size - 1) if size > 1 else jnp.zeros_like(spread)


def _centred(wide: list[jax.Array], means: list[jax.Array]) -> list[jax.Array]:
    """``g - mean`` per leaf, for a reduction only.

    Behind a barrier per leaf (``norms.apart``): XLA would otherwise share ``g - mean``
    between the reduction and the output and, on CPU, write it out first.
    """
    pairs = [norms.apart(g, mean) for g, mean in zip(wide, means)]
    return [g - m for g, m in pairs]
