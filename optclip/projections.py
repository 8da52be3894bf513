"""Projections of the parameters after the step (rai_toolbox 0.2.1 ``L2ProjectedOptim``,
``LinfProjectedOptim``, ``ClampedParameterOptimizer``).

They go *last* in a chain and need ``params``: they return ``P(params + u) - params``.

Rounding caveat: ``optax.apply_updates`` computes ``params + (P(x) - params)``, which can differ
from ``P(x)`` by one ulp, so a bound can be exceeded by one ulp; project again after
``apply_updates`` when it must hold exactly.
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
    "ClampParamsState", "ProjectL2BallState", "ProjectLinfBallState", "RENORM_EPS", "clamp_params",
    "project_l2_ball", "project_linf_ball",
]


# torch's ``renorm`` adds this to the norm in L2ProjectedOptim.
RENORM_EPS = 1e-7


@stats_lib.diagnostic("project_l2_ball", ("norm", "projected", "nonfinite"),
                       per_leaf=("norm", "projected"))
class ProjectL2BallState(NamedTuple):
    norm: Any             # per leaf: the norm of every slice of params + u before projecting
    projected: Any        # per leaf: per slice, whether it was scaled into the ball
    nonfinite: jax.Array
    count: jax.Array      # int32 finite steps: the count that an ``epsilon`` schedule sees


@stats_lib.diagnostic("project_linf_ball", ("projected", "nonfinite"), per_leaf=("projected",))
class ProjectLinfBallState(NamedTuple):
    projected: jax.Array  # (F,) per leaf: bool, whether any element of params + u was moved
    nonfinite: jax.Array
    count: jax.Array


@stats_lib.diagnostic("clamp_params", ("projected", "nonfinite"), per_leaf=("projected",))
class ClampParamsState(NamedTuple):
    projected: jax.Array  # (F,) per leaf: bool, as ProjectLinfBallState's
    nonfinite: jax.Array
    count: jax.Array


def _projection(name: str, measure, apply, state_cls: type, limits, axis_name: norms.AxisName,
                pairs_leaves: bool = False) -> optax.GradientTransformation:
    """A post-step projection of ``x = params + u``.

    ``measure(build, at) -> (diagnostics, finiteness flags, measured)`` holds every reduction
    over ``x = build()`` (the finiteness of the step is read off the same pass; a rarely taken
    branch rebuilds ``x`` instead of having it written out); the diagnostics are trees (per
    slice) or per-leaf vectors, the flags (per leaf, or one for all leaves) hold on this
    device. ``apply(x, at, measured) -> P(x)`` is elementwise. ``limits(count)`` resolves the
    float-or-schedule radius or bounds ``at`` at the count of finite steps. ``pairs_leaves``:
    the diagnostics are per-leaf vectors (:func:`optclip._core.checks.transformation`).
    """
    norms.check_axis_name(axis_name)

    def init_fn(params):
        zero = jnp.zeros([], jnp.int32)
        diag = stats_lib.zeros_like_params(
            lambda p: tuple(measure(lambda for_reduction=False: p, limits(zero))[0]), params)
        return state_cls(*diag, zero, jnp.zeros([], jnp.int32))

    def projected_leaf(u, p):
        # The parameter's dtype decides, as in init: an integer parameter is not projected,
        # whatever update (float, after adam) it gets; nor is a float one given no float update.
        return norms.is_float(p) and norms.is_float(u)

    def update_fn(updates, state, params=None):
        slices.require_params(params, name, updates)
        def build(for_reduction=False):
            # ``u - (-p)`` is ``p + u`` exactly, written differently: XLA would otherwise share
            # one sum between the reductions and the update and write it out (a temporary the
            # size of the leaf); as two expressions, each is fused into its own pass.
            def target(u, p):
                return (u - (-p) if for_reduction else p + u).astype(p.dtype)
            return jax.tree.map(lambda u, p: target(u, p) if projected_leaf(u, p) else p,
                                updates, params)

        at = limits(state.count)
        diag, flags, measured = measure(build, at)
        finite = stats_lib.all_of(flags, axis_name)
        # The updates wait for the check: no copy of the donated updates buffers for it.
        projected = apply(build(), stats_lib.after(finite, at), measured)
        new_updates = jax.tree.map(
            lambda u, px, p: (px - p).astype(u.dtype) if projected_leaf(u, p) else u,
            updates, projected, params)
        new_state = state_cls(*diag, state.nonfinite, optax.safe_increment(state.count))
        return new_updates, stats_lib.commit(finite, new_state, state)

    return checks.transformation(init_fn, update_fn, pairs_leaves=pairs_leaves,
                                 state_follows_params=True)


# The longest slice whose sums of squares come from one variadic reduce (_slice_norms): its
# scaled sum, read where the plain one overflowed, is added in sequence, within about
# sqrt(n) roundings on random data (n of them at worst); longer slices keep the rescaled
# re-read, whose sums XLA adds in a tree.
PAIRED_SLICE_MAX = 1 << 16


def _slice_norms(build, cut: slices.Slicing, axis_name: norms.AxisName) -> tuple[list, list]:
    """``(norm of every slice per leaf of build(), [finiteness of the step])`` (``None`` norms
    for non-float leaves; the one flag is the same on every device along ``axis_name``).

    One read of each leaf: the plain sums of squares of its slices; one-element slices
    (``axes=()``) get their exact norm ``|x|``. Only where some norm came out infinite or NaN
    (a sum of squares overflowed, or the step is not finite: one scalar test for the whole
    tree) are the leaves read again, for the sums scaled down by a power of two
    (:func:`optclip._core.norms.overflowed_sums`); otherwise every norm is finite and so is
    every leaf. The step's finiteness is read off the sums: a
    NaN element makes its slice's plain sum NaN, an infinite one both sums infinite, and no
    finite slice overflows the scaled sum.

    ``build()`` computes the leaves from the optimizer's update, which the projection's output
    reads too. XLA:CPU's XNNPACK reduction takes in only operations that no other kernel
    reads, and a branch that reads the leaves again has them passed in: either way the update
    would be written out and read back, a temporary the size of the leaf every step. A large
    leaf (more than ``GROUP_MAX_ELEMENTS``) of slices of at most ``PAIRED_SLICE_MAX`` elements
    on a single device gets both sums at once instead, from one variadic reduce (XLA:CPU's own
    loop, with the update's computation fused in), the plain sum compensated
    (:func:`optclip._core.norms.compensated_squares`), and needs no second read. Several
    devices keep the plain sums: XLA's SPMD partitioner gathers the operands of a variadic
    reduce over a sharded axis.
    """
    xs = build()
    reduced = [i for i, axes in enumerate(cut.axes) if axes]
    single = [i for i, axes in enumerate(cut.axes) if axes == ()]
    paired = [i for i in reduced if norms._may_group() and xs[i].size > norms.GROUP_MAX_ELEMENTS
              and axes_lib.slice_size(xs[i].shape, cut.axes[i]) <= PAIRED_SLICE_MAX]
    plain = [i for i in reduced if i not in paired]

    def wide(i):
        return xs[i].astype(norms.acc_dtype(xs[i].dtype))

    both = [tuple(jnp.expand_dims(s, cut.axes[i])
                  for s in norms.compensated_squares(wide(i), cut.axes[i])) for i in paired]
    totals = [norms.across(jnp.sum(jnp.square(wide(i)), axis=cut.axes[i], keepdims=True), "sum",
                           cut.split[i]) for i in plain]
    exact_norms = [norms.slice_norm(xs[i], 2.0, (), cut.split[i]) for i in single]
    # A paired leaf is finite exactly when its scaled sums are.
    sure = stats_lib.all_finite(exact_norms + [s for _, s in both])
    local = stats_lib.all_finite([norms.safe_sqrt(t) for t in totals]) & sure
    clean = norms.all_true(local, axis_name)

    def usual():
        return [jnp.zeros_like(t) for t in totals], clean

    def rescued():
        again = build()
        scaled = [norms.overflowed_sums(again[i].astype(total.dtype), total, cut.axes[i],
                                        cut.split[i]) for i, total in zip(plain, totals)]
        picked = [jnp.where(t == jnp.inf, q, t) for t, q in zip(totals, scaled)]
        ok = stats_lib.all_finite(picked) & sure
        return scaled, norms.all_true(ok, axis_name)

    # One flag for the tree, the same on every device in both branches.
    scaled, finite = jax.lax.cond(clean, usual, rescued) if plain else ([], clean)
    measured = [None] * len(xs)
    for i, total, q in [*zip(plain, totals, scaled), *((i, *s) for i, s in zip(paired, both))]:
        measured[i] = norms.root_of_squares(total, q, norms.SCALE_SHIFT[total.dtype])
    for i, n in zip(single, exact_norms):
        measured[i] = n
    return measured, [finite]


def project_l2_ball(epsilon: float, param_ndim: int | None = -1, *, exact: bool = False,
                    axis_name: norms.AxisName = None) -> optax.GradientTransformation:
    """Project every slice of the updated parameters onto the L2 ball of radius ``epsilon``.

    With ``x = params + u`` and ``ν = ||x||₂`` per slice: ``P(x) = x * ε / (ν + 1e-7)`` where
    ``ν > ε``, else ``x`` (torch's ``renorm``, which lands slightly inside the sphere; with
    ``exact=True`` the factor is ``ε / ν``). Returns ``P(x) - params``.

    Place it last, after the inner optimizer, and pass ``params`` to ``update``.
    ``optax.apply_updates`` then gives ``params + (P(x) - params)``, which can differ from
    ``P(x)`` by one ulp per element.

    Args:
      epsilon: the radius, ``>= 0`` (required);
        also an optax schedule ``count -> value`` (``count``: finite steps taken).
      param_ndim: which axes of each parameter form a slice, as in :func:`l1_normalize`.
      exact: use ``ε / ν`` instead of ``ε / (ν + 1e-7)`` (keyword only; an optclip addition).
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the slices' axes are
        split over; partial norms are combined with ``psum`` (as in :func:`l1_normalize`).

    Returns:
      An ``optax.GradientTransformation`` whose state logs each slice's ``norm`` before the
      projection and whether it was ``projected``.

    References:
      rai_toolbox ``L2ProjectedOptim``'s post-step projection.
      Use ``optax.chain(optclip.l2_normalize(param_ndim), optax.sgd(lr),
      optclip.project_l2_ball(epsilon, param_ndim))`` for the whole optimizer. Unlike
      ``optax.projections.projection_l2_ball`` it acts per slice and keeps the ``1e-7``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.project_l2_ball(1.0)
      >>> x = jnp.array([[3.0, 4.0], [0.6, 0.8]])
      >>> u, _ = tx.update(jnp.zeros_like(x), tx.init(x), x)
      >>> optax.apply_updates(x, u).round(6).tolist()
      [[0.6, 0.8], [0.6, 0.8]]
    """
    axes_lib.check_param_ndim_spec(param_ndim)
    checks.non_negative("epsilon", epsilon, allow_schedule=True)
    checks.boolean("exact", exact)
    renorm_eps = 0.0 if exact else RENORM_EPS

    def measure(build, radius):
        targets = build()
        leaves, treedef = jax.tree.flatten(targets)
        cut = slices.slicing(leaves, targets, param_ndim, axis_name)
        measured, flags = _slice_norms(lambda: jax.tree.leaves(build(True)), cut, axis_name)
        squeezed = [None if n is None else jnp.squeeze(n, axis=axes) for n, axes in
                    zip(measured, cut.axes, strict=True)]
        outside = [None if n is None else n > jnp.asarray(radius).astype(n.dtype)
                   for n in squeezed]
        return (treedef.unflatten(squeezed), treedef.unflatten(outside)), flags, measured

    def apply(targets, radius, measured):
        leaves, treedef = jax.tree.flatten(targets)
        return treedef.unflatten([x if n is None else norms.scale(x, multiplier(n, radius))
                                  for x, n in zip(leaves, measured, strict=True)])

    def multiplier(norm, radius):
        bound = jnp.asarray(radius).astype(norm.dtype)
        return jnp.where(norm > bound, bound / (norm + jnp.asarray(renorm_eps, norm.dtype)), 1)

    return _projection("project_l2_ball", measure, apply, ProjectL2BallState,
                       lambda count: checks.resolve(epsilon, count, name="epsilon"), axis_name)


def _box_projection(name: str, state_cls: type, bounds, axis_name: norms.AxisName
                    ) -> optax.GradientTransformation:
    """``clip(x, low, high)`` with ``bounds(count) -> (low, high)`` (``None``: unbounded)."""

    def measure(build, at):
        moved, finite = slices.excess_flags(jax.tree.leaves(build(True)), *at, axis_name,
                                            computed=True)
        return (moved,), [finite], None

    def apply(targets, at, measured):
        return norms.float_map(lambda x: slices.clip(x, *at), targets)

    return _projection(name, measure, apply, state_cls, bounds, axis_name, pairs_leaves=True)


def project_linf_ball(epsilon: float, *, axis_name: norms.AxisName = None
                      ) -> optax.GradientTransformation:
    """Clamp the updated parameters into ``[-epsilon, epsilon]``.

    ``P(x) = clip(x, -ε, ε)`` elementwise with ``x = params + u``; returns ``P(x) - params``.
    Place it last and pass ``params`` to ``update``; ``optax.apply_updates`` then gives
    ``P(params + u)`` up to one ulp (re-project if the bound must hold exactly).

    Args:
      epsilon: the radius, ``>= 0`` (required);
        also an optax schedule ``count -> value`` (``count``: finite steps taken).
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) the leaves are split over:
        the projection is elementwise; only the per-leaf ``projected`` flag and the non-finite
        check are combined across devices, so the state is the same on every device.

    Returns:
      An ``optax.GradientTransformation`` whose state logs, per leaf, whether any element was
      ``projected`` (one vector over the floating leaves; :func:`optclip.per_leaf` gives a
      tree).

    References:
      rai_toolbox ``LinfProjectedOptim``'s post-step projection; the
      whole optimizer is ``optax.chain(optclip.sign(), optax.sgd(lr),
      optclip.project_linf_ball(epsilon))``. Its docstring calls ``epsilon`` an L2 radius.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optax.chain(optclip.sign(), optax.sgd(1.0), optclip.project_linf_ball(1.8))
      >>> x = jnp.array([-1.0, 0.5])
      >>> u, _ = tx.update(jnp.array([2.0, -2.0]), tx.init(x), x)
      >>> optax.apply_updates(x, u).tolist()
      [-1.7999999523162842, 1.5]
    """
    checks.non_negative("epsilon", epsilon, allow_schedule=True)

    def bounds(count):
        radius = checks.resolve(epsilon, count, name="epsilon")
        return -radius, radius

    return _box_projection("project_linf_ball", ProjectLinfBallState, bounds, axis_name)


def clamp_params(clamp_min: float | None = None, clamp_max: float | None = None, *,
                 axis_name: norms.AxisName = None) -> optax.GradientTransformation:
    """Clamp the updated parameters into ``[clamp_min, clamp_max]``.

    ``P(x) = clip(x, clamp_min, clamp_max)`` with ``x = params + u``; returns ``P(x) - params``.
    A ``None`` bound is absent. Place it last and pass ``params`` to ``update``;
    ``optax.apply_updates`` gives ``P(params + u)`` up to one ulp.

    Args:
      clamp_min: lower bound, ``None`` or an optax schedule ``count -> value`` (``count``:
        finite steps taken).
      clamp_max: upper bound, ``None`` or a schedule (at least one must be set;
        ``clamp_min <= clamp_max``).
      axis_name: as in :func:`project_linf_ball`.

    Returns:
      An ``optax.GradientTransformation`` whose state logs, per leaf, whether any element was
      ``projected`` (one vector over the floating leaves; :func:`optclip.per_leaf` gives a
      tree).

    References:
      rai_toolbox ``ClampedParameterOptimizer``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optax.chain(optax.sgd(1.0), optclip.clamp_params(-1.0, 3.0))
      >>> x = jnp.array([1.0, 1.0])
      >>> u, _ = tx.update(jnp.array([0.5, -10.0]), tx.init(x), x)
      >>> optax.apply_updates(x, u).tolist()
      [0.5, 3.0]
    """
    slices.check_bounds(clamp_min, clamp_max)
    return _box_projection("clamp_params", ClampParamsState,
                           lambda count: slices.bounds_at(count, clamp_min, clamp_max), axis_name)
