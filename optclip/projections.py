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
    projected: Any        # per leaf: whether any element of params + u was moved
    nonfinite: jax.Array
    count: jax.Array


@stats_lib.diagnostic("clamp_params", ("projected", "nonfinite"), per_leaf=("projected",))
class ClampParamsState(NamedTuple):
    projected: Any
    nonfinite: jax.Array
    count: jax.Array


def _projection(name: str, project, state_cls: type, limits, axis_name: norms.AxisName
                ) -> optax.GradientTransformation:
    """``project(x, limits(count)) -> (P(x), *diagnostic trees)`` on the tree
    ``x = params + u``, ``limits`` resolving the float-or-schedule radius or bounds at the
    count of finite steps."""
    norms.check_axis_name(axis_name)

    def init_fn(params):
        zero = jnp.zeros([], jnp.int32)
        diag = stats_lib.zeros_like_params(lambda p: tuple(project(p, limits(zero))[1:]), params)
        return state_cls(*diag, zero, jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        slices.require_params(params, name)
        targets = jax.tree.map(lambda u, p: (p + u).astype(p.dtype) if norms.is_float(u) else p,
                               updates, params)
        projected, *diag = project(targets, limits(state.count))
        new_updates = jax.tree.map(
            lambda u, px, p: (px - p).astype(u.dtype) if norms.is_float(u) else u,
            updates, projected, params)
        new_state = state_cls(*diag, state.nonfinite, optax.safe_increment(state.count))
        finite = stats_lib.all_finite(targets, axis_name)
        return new_updates, stats_lib.commit(finite, new_state, state)

    return checks.transformation(init_fn, update_fn)


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

    def project(targets, radius):
        def multiplier(norm):
            bound = jnp.asarray(radius).astype(norm.dtype)
            return jnp.where(norm > bound, bound / (norm + jnp.asarray(renorm_eps, norm.dtype)), 1)

        projected, measured = slices.scale_slices(targets, 2.0, multiplier, param_ndim=param_ndim,
                                                 axis_name=axis_name)
        outside = jax.tree.map(lambda n: n > jnp.asarray(radius).astype(n.dtype), measured)
        return projected, measured, outside

    return _projection("project_l2_ball", project, ProjectL2BallState,
                       lambda count: checks.resolve(epsilon, count), axis_name)


def _box_projection(name: str, state_cls: type, bounds, axis_name: norms.AxisName
                    ) -> optax.GradientTransformation:
    """``bounds(count) -> (low, high)``."""
    return _projection(name, lambda x, at: slices.clamp_tree(x, *at, axis_name), state_cls,
                       bounds, axis_name)


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
      ``projected``.

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
        radius = checks.resolve(epsilon, count)
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
      ``projected``.

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
