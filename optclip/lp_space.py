"""Lp-space gradient transforms, parameter projections and Frank-Wolfe (rai_toolbox).

rai_toolbox 0.2.1 wraps an inner torch optimizer to sign, normalize, sparsify or clamp each
gradient slice before the step, and to project the parameters after it. In
optax these become small transforms:

* pre-step transforms (``sign``, ``l1_normalize``, ``l2_normalize``, ``top_q``,
  ``l1q_normalize``, ``clamp``) go *before* the inner optimizer, on the raw gradient, and end with
  ``g * grad_scale + grad_bias``;
* projections (``project_l2_ball``, ``project_linf_ball``, ``clamp_params``) go *last* and need
  ``params``: they return ``P(params + u) - params``;
* Frank-Wolfe (``frank_wolfe`` and the ``l*_frank_wolfe`` family) *replaces* the inner optimizer,
  needs ``params`` and returns ``p_new - p``.

``param_ndim`` cuts each leaf into slices: ``None`` is the whole leaf, ``k >= 0`` the
last ``k`` axes, ``k < 0`` the last ``ndim + k`` axes. It is resolved per leaf by
:func:`optclip._core.axes.reduction_axes`; ``|param_ndim|`` larger than a leaf's rank fails at
``init``. The default ``-1`` makes every element of a 1-D leaf its own slice.

Rounding caveat for projections and Frank-Wolfe: ``optax.apply_updates`` computes
``params + (P(x) - params)``, which can differ from ``P(x)`` by one ulp, so a bound
can be exceeded by one ulp; project again after ``apply_updates`` when it must hold exactly.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip._core import axes as axes_lib
from optclip._core import checks, norms
from optclip._core import stats as stats_lib

__all__ = [
    "ClampParamsState", "ClampState", "FrankWolfeState", "L1NormalizeState",
    "L1qFrankWolfeState", "L1qState", "L2NormalizeState", "LpNormalizeState",
    "ProjectL2BallState", "ProjectLinfBallState", "TopQState",
    "clamp", "clamp_params", "frank_wolfe", "l1_frank_wolfe", "l1_normalize",
    "l1q_frank_wolfe", "l1q_normalize", "l2_frank_wolfe", "l2_normalize", "linf_frank_wolfe",
    "project_l2_ball", "project_linf_ball", "sign", "top_q",
]

# rai_toolbox's ``div_by_zero_eps`` default: float32's smallest normal number, 2**-126.
TINY = float(np.finfo(np.float32).tiny)
# torch's ``renorm`` adds this to the norm in L2ProjectedOptim.
RENORM_EPS = 1e-7


# ---------------------------------------------------------------------------------------------
# States. Every field is an array; per-leaf trees mirror the updates (non-float leaves: None).

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
    q: Any                # per leaf: the drop fraction in force at the last step
    k: Any                # per leaf: entries kept per slice at the last step
    nonfinite: jax.Array


@stats_lib.diagnostic("l1q_normalize", ("q", "k", "nonfinite"), per_leaf=("q", "k"))
class L1qState(NamedTuple):
    key: jax.Array
    q: Any
    k: Any
    nonfinite: jax.Array


@stats_lib.diagnostic("clamp", ("clipped", "nonfinite"), per_leaf=("clipped",))
class ClampState(NamedTuple):
    clipped: Any          # per leaf: whether any element was clamped
    nonfinite: jax.Array
    count: jax.Array      # int32 finite steps: the count that threshold schedules see


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
    key: jax.Array
    q: Any
    k: Any
    nonfinite: jax.Array


# ---------------------------------------------------------------------------------------------
# Validation and small shared pieces.

def _is_number(value: Any) -> bool:
    return isinstance(value, (numbers.Real, np.generic)) and not isinstance(value, bool)


def _check_real(name: str, value: Any) -> None:
    """Any finite-or-infinite real (no range); NaN and non-numbers are rejected."""
    checks.in_range(name, value)


def _check_affine(grad_scale: Any, grad_bias: Any) -> None:
    _check_real("grad_scale", grad_scale)
    _check_real("grad_bias", grad_bias)


def _check_bounds(clamp_min: Any, clamp_max: Any) -> None:
    if clamp_min is None and clamp_max is None:
        raise ValueError("clamp_min and clamp_max cannot both be None; set at least one bound")
    checks.in_range("clamp_min", clamp_min, allow_none=True, allow_schedule=True)
    checks.in_range("clamp_max", clamp_max, allow_none=True, allow_schedule=True)
    if (checks.is_concrete_number(clamp_min) and checks.is_concrete_number(clamp_max)
            and float(np.asarray(clamp_min)) > float(np.asarray(clamp_max))):
        raise ValueError(f"clamp_min must be <= clamp_max, got clamp_min={clamp_min!r} > "
                         f"clamp_max={clamp_max!r}")


def _check_q(q: Any, dq: Any, seed: Any) -> None:
    checks.in_range("q", q, 0.0, 1.0)
    checks.in_range("dq", dq, 0.0, 1.0)
    checks.integer("seed", seed, low=0)


def _slice_axes(x: jax.Array, param_ndim: int | None) -> tuple[int, ...]:
    return axes_lib.reduction_axes(x.ndim, param_ndim=param_ndim)


def _leaf_axes(leaves: list, tree: Any, param_ndim: Any) -> list:
    """Slice axes of every leaf of ``tree`` (``None`` for non-float leaves); ``param_ndim``
    may be per leaf (a pytree matching the parameters or a callable ``(path, leaf) -> k``)."""
    return [_slice_axes(x, k) if norms.is_float(x) else None
            for x, k in zip(leaves, axes_lib.leaf_param_ndims(param_ndim, tree), strict=True)]


def _per_leaf(fn, tree: Any) -> Any:
    """A per-leaf diagnostic tree: ``fn(x)`` for float leaves, ``None`` elsewhere."""
    return jax.tree.map(lambda x: fn(x) if norms.is_float(x) else None, tree)


def _affine(g: jax.Array, grad_scale: Any, grad_bias: Any) -> jax.Array:
    """``g * grad_scale + grad_bias`` in the leaf dtype, skipping a literal 1 / 0."""
    if not (_is_number(grad_scale) and grad_scale == 1):
        g = g * jnp.asarray(grad_scale).astype(g.dtype)
    if not (_is_number(grad_bias) and grad_bias == 0):
        g = g + jnp.asarray(grad_bias).astype(g.dtype)
    return g


def _require_params(params: Any, name: str) -> None:
    if params is None:
        raise ValueError(f"{name} needs the current parameters: call "
                         f"update(updates, state, params) (it must come last in the chain)")


# ---------------------------------------------------------------------------------------------
# Per-slice maths on one leaf.

def _sign(g: jax.Array) -> jax.Array:
    """``sign(g)`` with ``sign(±0) = +0`` (torch); NaN propagates."""
    return jnp.where(g == 0, jnp.zeros_like(g), jnp.sign(g))


def _normalized(g: jax.Array, ord: float, axes: tuple[int, ...], eps: Any,
                split: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """``g / max(||g||, eps)`` per slice, in the wide dtype; returns (output, norm).

    The norm is the plain reduction (the reference's formula in the normal range). Where it
    underflows (``Σg² < tiny`` for L2, ``Σ|g| < tiny`` for L1) or is so large that its
    reciprocal would be subnormal (``>= 1/tiny``, inf included) while the slice is non-zero and
    finite, the slice is first scaled by a power of two that brings its max-abs into [0.5, 1),
    so the output has unit norm: the reference returns 8.5e7 for [1e-30, 0] and [0, 0] for
    [3e38, 3e38]. A zero slice stays zero in every dtype, also for ``eps=0`` (the
    reference gives NaN in float16). XLA turns the division by a per-slice value into a
    multiplication by its reciprocal, so results can differ from the reference by an ulp.
    ``split``: mesh axes the slices are split over (inside ``shard_map``/``pmap``).
    """
    wide = g.astype(norms.acc_dtype(g.dtype))
    norm = norms.slice_norm(wide, ord, axes, split)
    eps = jnp.asarray(eps).astype(wide.dtype)
    # float16 is accumulated in float32, where its norms can neither underflow nor overflow.
    # A zero slice stays zero; dividing it by 1 keeps its derivative finite (0 / eps**2 is NaN).
    plain = jnp.where(norm == 0, 1, jnp.maximum(norm, eps))
    if g.dtype == jnp.float16:
        return wide / plain, norm
    tiny = float(jnp.finfo(wide.dtype).tiny)
    low = tiny if ord == 1.0 else math.sqrt(tiny)
    biggest = norms.across(jnp.max(jnp.abs(wide), axis=axes, keepdims=True, initial=0), "max",
                           split)
    rescale = ((norm < low) | (norm >= 1 / tiny)) & (biggest > 0) & jnp.isfinite(biggest)
    # Scale by 2**-e (exact) in two halves, so that neither factor is subnormal or infinite.
    shift = jnp.where(rescale, -norms.binary_exponent(biggest), 0)
    half = norms.pow2(shift >> 1, wide.dtype)
    unit = wide * half * half * norms.pow2(shift & 1, wide.dtype)
    denom = jnp.where(rescale, norms.slice_norm(unit, ord, axes, split), plain)
    out = unit / jnp.where(denom == 0, 1, denom)
    return out, jnp.where(rescale, norms.ldexp(denom, -shift), norm)


def _explicit_sharding(x: jax.Array):
    """``x``'s sharding when it is sharded under an explicit mesh (``jax.make_mesh``'s default),
    else ``None`` (unsharded, or automatic sharding that XLA propagates by itself)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return sharding if spec is not None and any(s is not None for s in spec) else None


def _slice_rows(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """View ``x`` as ``(*batch, D)``: the reduced (trailing) axes merged into one.

    Ranking needs whole slices: where a slice is sharded over devices under an explicit mesh,
    its axes are replicated first (the batch axes keep their sharding).
    """
    n_batch = x.ndim - len(axes)
    if not axes:
        return x[..., None]
    sharding = _explicit_sharding(x)
    if sharding is not None:
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        if any(s is not None for s in spec[n_batch:]):
            x = jax.sharding.reshard(x, jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(*spec[:n_batch], *[None] * len(axes))))
    if len(axes) == 1:
        return x
    return x.reshape(*x.shape[:n_batch], axes_lib.slice_size(x.shape, axes))


def _slice_mask(mask: jax.Array, like: jax.Array) -> jax.Array:
    """A ``(*batch, D)`` mask back in ``like``'s shape (and explicit sharding)."""
    mask = mask.reshape(like.shape)
    sharding = _explicit_sharding(like)
    return mask if sharding is None else jax.sharding.reshard(mask, sharding)


def _top_k_mask(g: jax.Array, axes: tuple[int, ...], k: int | jax.Array) -> jax.Array:
    """Whether each entry is among the ``k`` largest ``|g|`` of its slice, shape ``(*batch, D)``.

    Stable: ties go to the lowest index first (torch.topk breaks them arbitrarily);
    NaN ranks as the largest (it is kept, as in the reference). One sort of
    ``(-|g|, index)`` per slice finds the ``k``-th entry; an entry is kept when it comes before
    it in that order (no second sort to rank every entry).
    """
    magnitude = jnp.abs(_slice_rows(g, axes))
    magnitude = jnp.where(jnp.isnan(magnitude), jnp.inf, magnitude)
    if magnitude.shape[-1] == 0:
        return jnp.zeros(magnitude.shape, bool)
    # Built from a zeros_like so that it carries the slices' sharding under an explicit mesh.
    index = jnp.zeros_like(magnitude, jnp.int32) + jnp.arange(magnitude.shape[-1],
                                                               dtype=jnp.int32)
    if isinstance(k, int) and 0 < k < magnitude.shape[-1]:
        # top_k orders equal values by index too, and needs no full sort.
        values, order = jax.lax.top_k(magnitude, k)
        last, last_index = values[..., -1:], order[..., -1:]
    else:
        keys, order = jax.lax.sort((-magnitude, index), dimension=magnitude.ndim - 1,
                                   num_keys=2)
        at = jnp.clip(jnp.asarray(k) - 1, 0, magnitude.shape[-1] - 1)
        last = -jax.lax.dynamic_index_in_dim(keys, at, axis=-1)
        last_index = jax.lax.dynamic_index_in_dim(order, at, axis=-1)
    keep = (magnitude > last) | ((magnitude == last) & (index <= last_index))
    return keep & (k > 0)


def _static_k(q: float, size: int) -> int:
    """``round((1 - q) * D)`` in double precision, half to even."""
    return round((1.0 - float(q)) * size)


def _traced_k(q: jax.Array, size: int) -> jax.Array:
    """``round((1 - q) * D)`` on device, half to even, in float64 under x64 else float32."""
    wide = norms.stat_dtype()
    return jnp.round((1 - q.astype(wide)) * size).astype(jnp.int32)


def _top_q_kept(g: jax.Array, axes: tuple[int, ...], k: int | jax.Array) -> jax.Array:
    """``g`` with all but the ``k`` largest-``|g|`` entries of every slice set to zero."""
    size = axes_lib.slice_size(g.shape, axes)
    if isinstance(k, int):
        if k <= 0:
            return jnp.zeros_like(g)
        if k >= size:
            return g
    keep = _slice_mask(_top_k_mask(g, axes, k), g)
    return jnp.where(keep, g, jnp.zeros_like(g))


def _l1q(g: jax.Array, axes: tuple[int, ...], k: int | jax.Array, eps: Any) -> jax.Array:
    """Top-k, sign, L1-normalize: ``±1/c`` on the ``c`` non-zero kept entries."""
    signs = _sign(_top_q_kept(g, axes, k))
    return _normalized(signs, 1.0, axes, eps)[0].astype(g.dtype)


def _l1_lmo(g: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """One-hot ``sign(g_i*) e_i*`` at the first argmax of ``|g|`` of every flattened slice.

    rai_toolbox 0.2.1 takes the argmax along the first reduced axis only, which is wrong for
    slices of two or more axes.
    """
    rows = _slice_rows(g, axes)
    if rows.shape[-1] == 0:
        return g
    first = jnp.argmax(jnp.abs(rows), axis=-1, keepdims=True)
    onehot = _slice_mask(jnp.arange(rows.shape[-1]) == first, g)
    return jnp.where(onehot, _sign(g), jnp.zeros_like(g))


# ---------------------------------------------------------------------------------------------
# The random drop fraction (dq > 0): one draw per float leaf per step, from a key in the state.

def _logged_q(q: Any, leaf: jax.Array) -> jax.Array:
    """``q`` as drawn (float32, as torch), stored in the leaf's statistics dtype (float64 for a
    float64 leaf, like every statistic)."""
    return jnp.asarray(q, jnp.float32).astype(norms.acc_dtype(leaf.dtype))


class _DropFraction:
    """Static-or-drawn ``q`` per leaf and the matching ``k``."""

    def __init__(self, q: Any, dq: Any, seed: int):
        self.q, self.dq, self.seed = q, dq, seed
        self.static = _is_number(q) and _is_number(dq) and dq == 0

    def init(self, params: Any) -> tuple[jax.Array, Any, Any]:
        """The key, and ``q``/``k`` trees holding ``q`` and 0 until the first step."""
        key = jax.random.PRNGKey(self.seed)
        q = _per_leaf(lambda x: _logged_q(self.q, x), params)
        k = _per_leaf(lambda x: jnp.zeros((), jnp.int32), params)
        return key, q, k

    def draw(self, key: jax.Array, leaves: list, axes_of: list) -> tuple[jax.Array, list, list]:
        """``(new key, q per leaf, k per leaf)`` for flattened ``leaves`` with slice axes
        ``axes_of`` (``None`` for non-float leaves); ``k`` holds Python ints when ``q`` is
        static."""
        floats = [i for i, x in enumerate(leaves) if norms.is_float(x)]
        sizes = {i: axes_lib.slice_size(leaves[i].shape, axes_of[i]) for i in floats}
        q_of: list[Any] = [None] * len(leaves)
        k_of: list[Any] = [None] * len(leaves)
        if self.static:
            for i in floats:
                q_of[i] = _logged_q(self.q, leaves[i])
                k_of[i] = _static_k(self.q, sizes[i])
            return key, q_of, k_of
        key, subkey = jax.random.split(key)
        u = jax.random.uniform(subkey, (len(floats),), jnp.float32)
        q = jnp.asarray(self.q, jnp.float32)
        dq = jnp.asarray(self.dq, jnp.float32)
        q_lo = jnp.maximum(q - dq, 0.0)
        q_hi = jnp.minimum(q + dq, 1.0)
        # One float32 q per leaf: q_lo + (q_hi - q_lo) * u, as torch forms it. k in the widest
        # float available (the reference uses double; float32 can differ only at exact .5).
        q_t = (q_hi - q_lo) * u + q_lo
        for j, i in enumerate(floats):
            q_of[i] = _logged_q(q_t[j], leaves[i])
            k_of[i] = _traced_k(q_t[j], sizes[i])
        return key, q_of, k_of


def _k_arrays(k_of: list) -> list:
    return [None if k is None else jnp.asarray(k, jnp.int32) for k in k_of]


# ---------------------------------------------------------------------------------------------
# Pre-step gradient transforms.

def sign(grad_scale: float = 1.0, grad_bias: float = 0.0) -> optax.GradientTransformation:
    """Replace every gradient element by its sign: ``g <- sign(g) * grad_scale + grad_bias``.

    ``sign(±0) = 0``. Elementwise, so no ``param_ndim``.

    Args:
      grad_scale: multiplies the signed gradient.
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
        return norms.float_map(lambda g: _affine(_sign(g), grad_scale, grad_bias), updates), state

    return checks.transformation(lambda params: optax.EmptyState(), update_fn)


def _lp_normalize(ord: float, state_cls: type, name: str, param_ndim: int | None, eps: Any,
                  grad_scale: Any, grad_bias: Any, axis_name: norms.AxisName
                  ) -> optax.GradientTransformation:
    axes_lib.check_param_ndim_spec(param_ndim)
    norms.check_axis_name(axis_name)
    checks.non_negative("eps", eps)
    _check_affine(grad_scale, grad_bias)

    def leaf(g, axes):
        out, norm = _normalized(g, ord, axes, eps, norms.split_axes([g], axis_name)[0])
        return _affine(out.astype(g.dtype), grad_scale, grad_bias), jnp.squeeze(norm, axis=axes)

    def apply(updates):
        leaves, treedef = jax.tree.flatten(updates)
        results = [leaf(g, axes) if norms.is_float(g) else (g, None)
                   for g, axes in zip(leaves, _leaf_axes(leaves, updates, param_ndim))]
        return tuple(treedef.unflatten([r[i] for r in results]) for i in range(2))

    def init_fn(params):
        measured = stats_lib.zeros_like_params(lambda p: apply(p)[1], params)
        return state_cls(measured, jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        new_updates, measured = apply(updates)
        finite = stats_lib.all_finite(updates, axis_name)
        return new_updates, state_cls(stats_lib.keep_if(finite, measured, state.norm),
                                      stats_lib.count_nonfinite(state.nonfinite, finite))

    return checks.transformation(init_fn, update_fn)


def l1_normalize(param_ndim: int | None = -1, eps: float = TINY, grad_scale: float = 1.0,
                 grad_bias: float = 0.0, *, axis_name: norms.AxisName = None
                 ) -> optax.GradientTransformation:
    """Divide every slice by its L1 norm: ``g <- g / max(Σ|g|, eps) * grad_scale + grad_bias``.

    Args:
      param_ndim: which axes form a slice (``None``: the whole leaf; ``k >= 0``: the last ``k``
        axes; ``k < 0``: the last ``ndim + k``). With the default ``-1`` a 1-D leaf is cut into
        one-element slices, so this becomes ``sign`` there.
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
      float32 (float64 for float64 leaves); where it under- or overflows the slice is rescaled by
      its max-abs first, so the output keeps unit norm (the reference returns 0 for [3e38, 3e38]);
      an all-zero slice stays zero in every dtype.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.l1_normalize(param_ndim=None)
      >>> g = jnp.array([2.0, 2.0])
      >>> tx.update(g, tx.init(g))[0].tolist()
      [0.5, 0.5]
    """
    return _lp_normalize(1.0, L1NormalizeState, "l1_normalize", param_ndim, eps, grad_scale,
                         grad_bias, axis_name)


def l2_normalize(param_ndim: int | None = -1, eps: float = TINY, grad_scale: float = 1.0,
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
      accumulated in float32 or wider with a max-abs rescaled fallback on under/overflow, so
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


def _top_q_family(name: str, state_cls: type, q: Any, dq: Any, param_ndim: int | None,
                  seed: int, leaf_fn, grad_scale: Any, grad_bias: Any
                  ) -> optax.GradientTransformation:
    """Shared body of ``top_q`` and ``l1q_normalize``: ``leaf_fn(g, axes, k)``."""
    axes_lib.check_param_ndim_spec(param_ndim)
    _check_q(q, dq, seed)
    _check_affine(grad_scale, grad_bias)
    fraction = _DropFraction(q, dq, seed)

    def init_fn(params):
        return state_cls(*fraction.init(params), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        axes_of = _leaf_axes(leaves, updates, param_ndim)
        key, q_of, k_of = fraction.draw(state.key, leaves, axes_of)
        new_leaves = [_affine(leaf_fn(g, axes, k), grad_scale, grad_bias)
                      if norms.is_float(g) else g
                      for g, axes, k in zip(leaves, axes_of, k_of, strict=True)]
        finite = stats_lib.all_finite(updates)
        new_state = state_cls(key, treedef.unflatten(q_of), treedef.unflatten(_k_arrays(k_of)),
                              state.nonfinite)
        new_state = stats_lib.keep_if(finite, new_state, state)
        return treedef.unflatten(new_leaves), new_state._replace(
            nonfinite=stats_lib.count_nonfinite(state.nonfinite, finite))

    return checks.transformation(init_fn, update_fn)


def top_q(q: float, dq: float = 0.0, param_ndim: int | None = -1, grad_scale: float = 1.0,
          grad_bias: float = 0.0, seed: int = 0) -> optax.GradientTransformation:
    """Keep the largest ``1 - q`` fraction of every slice (by ``|g|``), zero the rest.

    Per slice of ``D`` entries, ``k = round((1 - q) * D)`` (double precision, half to even: q=0.5
    on D=3 keeps 2, q=0.75 on D=2 keeps none); the ``k`` entries of largest ``|g|`` keep their
    signed values, the others become 0; then ``g * grad_scale + grad_bias``. Ties at the cut-off
    keep the lowest indices, so exactly ``k`` entries survive. With ``dq > 0`` each leaf draws,
    every step, ``q_t ~ U[max(0, q - dq), min(1, q + dq))`` (float32) from a PRNG key held in
    the state; all slices of a leaf share it.

    Under sharding each slice is ranked where it lives; a slice spread over several devices
    (for example ``param_ndim=None`` on a sharded matrix) is gathered for the ranking.

    Args:
      q: the fraction of every slice that is dropped, in ``[0, 1]`` (required: ``q=0.9`` keeps
        the top 10 %).
      dq: half-width of the random interval around ``q``, in ``[0, 1]``.
      param_ndim: which axes form a slice, as in :func:`l1_normalize` (default ``-1``: with it a
        1-D leaf is all-or-nothing, kept iff ``q < 0.5``).
      grad_scale: multiplies the sparsified gradient.
      grad_bias: then added to every element (zeros included).
      seed: seed of the PRNG key used when ``dq > 0``.

    Returns:
      An ``optax.GradientTransformation`` whose state holds the PRNG key and logs, per leaf,
      the ``q`` in force and the number ``k`` of entries kept per slice.

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
    return _top_q_family("top_q", TopQState, q, dq, param_ndim, seed, _top_q_kept, grad_scale,
                         grad_bias)


def l1q_normalize(q: float, dq: float = 0.0, param_ndim: int | None = -1, eps: float = TINY,
                  grad_scale: float = 1.0, grad_bias: float = 0.0, seed: int = 0
                  ) -> optax.GradientTransformation:
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

    Returns:
      An ``optax.GradientTransformation`` whose state holds the PRNG key and logs, per leaf,
      the ``q`` in force and the number ``k`` of entries kept per slice.

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
    checks.non_negative("eps", eps)
    return _top_q_family("l1q_normalize", L1qState, q, dq, param_ndim, seed,
                         lambda g, axes, k: _l1q(g, axes, k, eps), grad_scale, grad_bias)


def clamp(clamp_min: float | None = None, clamp_max: float | None = None,
          grad_scale: float = 1.0, grad_bias: float = 0.0) -> optax.GradientTransformation:
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

    Returns:
      An ``optax.GradientTransformation`` whose state logs, per leaf, whether any element was
      ``clipped``, and a ``nonfinite`` step count.

    References:
      rai_toolbox ``ClampedGradientOptimizer``.

    Example:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.clamp(-1.0, 3.0)
      >>> g = jnp.array([-0.5, 10.0])
      >>> tx.update(g, tx.init(g))[0].tolist()
      [-0.5, 3.0]
    """
    _check_bounds(clamp_min, clamp_max)
    _check_affine(grad_scale, grad_bias)

    def init_fn(params):
        return ClampState(_per_leaf(lambda x: jnp.zeros((), bool), params),
                          jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        low, high = _bounds_at(state.count, clamp_min, clamp_max)
        clamped = norms.float_map(lambda g: _clip(g, low, high), updates)
        clipped = jax.tree.map(lambda g, c: jnp.any(g != c) if norms.is_float(g) else None,
                               updates, clamped)
        finite = stats_lib.all_finite(updates)
        new_state = ClampState(stats_lib.keep_if(finite, clipped, state.clipped),
                               stats_lib.count_nonfinite(state.nonfinite, finite),
                               stats_lib.step_count(state.count, finite))
        return norms.float_map(lambda g: _affine(g, grad_scale, grad_bias), clamped), new_state

    return checks.transformation(init_fn, update_fn)


def _bounds_at(count: jax.Array, low: Any, high: Any) -> tuple[Any, Any]:
    """Float-or-schedule bounds (``None``: unbounded) resolved at ``count``."""
    return tuple(None if b is None else checks.resolve(b, count) for b in (low, high))


def _clip(x: jax.Array, low: Any, high: Any) -> jax.Array:
    low = None if low is None else jnp.asarray(low).astype(x.dtype)
    high = None if high is None else jnp.asarray(high).astype(x.dtype)
    return jnp.clip(x, low, high)


# ---------------------------------------------------------------------------------------------
# Parameter projections: the last transform of a chain; ``P(params + u) - params``.

def _projection(name: str, project, init_diag, state_cls: type, limits
                ) -> optax.GradientTransformation:
    """``project(x, limits(count)) -> (P(x), *diagnostics)`` per float leaf of
    ``x = params + u``, ``limits`` resolving the float-or-schedule radius or bounds at the
    count of finite steps; ``init_diag(params)`` gives the initial diagnostic trees."""
    n_diag = len(state_cls._fields) - 2

    def init_fn(params):
        return state_cls(*init_diag(params), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        _require_params(params, name)
        at = limits(state.count)
        targets = jax.tree.map(lambda u, p: (p + u).astype(p.dtype) if norms.is_float(u) else p,
                               updates, params)
        projected, *diag = norms.tree_unzip(
            lambda x: project(x, at) if norms.is_float(x) else (x,) + (None,) * n_diag,
            targets, 1 + n_diag)
        new_updates = jax.tree.map(
            lambda u, px, p: (px - p).astype(u.dtype) if norms.is_float(u) else u,
            updates, projected, params)
        finite = stats_lib.all_finite(targets)
        kept = stats_lib.keep_if(finite, tuple(diag), tuple(state[:n_diag]))
        return new_updates, state_cls(*kept, stats_lib.count_nonfinite(state.nonfinite, finite),
                                      stats_lib.step_count(state.count, finite))

    return checks.transformation(init_fn, update_fn)


def project_l2_ball(epsilon: float, param_ndim: int | None = -1, *, exact: bool = False
                    ) -> optax.GradientTransformation:
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
    axes_lib.check_param_ndim(param_ndim)
    checks.non_negative("epsilon", epsilon, allow_schedule=True)
    checks.boolean("exact", exact)
    renorm_eps = 0.0 if exact else RENORM_EPS

    def project(x, at):
        axes = _slice_axes(x, param_ndim)
        norm = norms.slice_norm(x, 2.0, axes)
        radius = jnp.asarray(at).astype(norm.dtype)
        outside = norm > radius
        factor = jnp.where(outside, radius / (norm + jnp.asarray(renorm_eps, norm.dtype)), 1)
        return (norms.scale(x, factor), jnp.squeeze(norm, axis=axes),
                jnp.squeeze(outside, axis=axes))

    def init_diag(params):
        return stats_lib.zeros_like_params(lambda p: norms.tree_unzip(
            lambda x: project(x, epsilon_at(jnp.zeros([], jnp.int32)))[1:] if norms.is_float(x)
            else (None, None), p, 2), params)

    def epsilon_at(count):
        return checks.resolve(epsilon, count)

    return _projection("project_l2_ball", project, init_diag, ProjectL2BallState, epsilon_at)


def _box_projection(name: str, state_cls: type, bounds) -> optax.GradientTransformation:
    """``bounds(count) -> (low, high)``."""
    def project(x, at):
        clipped = _clip(x, *at)
        return clipped, jnp.any(clipped != x)

    def init_diag(params):
        return (_per_leaf(lambda x: jnp.zeros((), bool), params),)

    return _projection(name, project, init_diag, state_cls, bounds)


def project_linf_ball(epsilon: float) -> optax.GradientTransformation:
    """Clamp the updated parameters into ``[-epsilon, epsilon]``.

    ``P(x) = clip(x, -ε, ε)`` elementwise with ``x = params + u``; returns ``P(x) - params``.
    Place it last and pass ``params`` to ``update``; ``optax.apply_updates`` then gives
    ``P(params + u)`` up to one ulp (re-project if the bound must hold exactly).

    Args:
      epsilon: the radius, ``>= 0`` (required);
        also an optax schedule ``count -> value`` (``count``: finite steps taken).

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

    return _box_projection("project_linf_ball", ProjectLinfBallState, bounds)


def clamp_params(clamp_min: float | None = None, clamp_max: float | None = None
                 ) -> optax.GradientTransformation:
    """Clamp the updated parameters into ``[clamp_min, clamp_max]``.

    ``P(x) = clip(x, clamp_min, clamp_max)`` with ``x = params + u``; returns ``P(x) - params``.
    A ``None`` bound is absent. Place it last and pass ``params`` to ``update``;
    ``optax.apply_updates`` gives ``P(params + u)`` up to one ulp.

    Args:
      clamp_min: lower bound, ``None`` or an optax schedule ``count -> value`` (``count``:
        finite steps taken).
      clamp_max: upper bound, ``None`` or a schedule (at least one must be set;
        ``clamp_min <= clamp_max``).

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
    _check_bounds(clamp_min, clamp_max)
    return _box_projection("clamp_params", ClampParamsState,
                           lambda count: _bounds_at(count, clamp_min, clamp_max))


# ---------------------------------------------------------------------------------------------
# Frank-Wolfe.

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
        lr_c = (learning_rate * scaling if _is_number(learning_rate) and _is_number(scaling)
                else lr * jnp.asarray(scaling, dtype))
        return lr / denom, (denom - lr) / denom, -jnp.asarray(lr_c, dtype) / denom
    one_minus = 1.0 - learning_rate if _is_number(learning_rate) else 1 - jnp.asarray(
        learning_rate, dtype)
    lr_c = (learning_rate * scaling if _is_number(learning_rate) and _is_number(scaling)
            else jnp.asarray(learning_rate, dtype) * jnp.asarray(scaling, dtype))
    return (jnp.asarray(learning_rate, dtype), jnp.asarray(one_minus, dtype),
            -jnp.asarray(lr_c, dtype))


def _fw_step(p: jax.Array, direction: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``p_new - p`` with ``p_new = fl(fl(p * a) + fl(b * direction))`` in the leaf dtype."""
    p_new = p * a.astype(p.dtype) + b.astype(p.dtype) * direction.astype(p.dtype)
    return p_new - p


def _check_fw(learning_rate: Any, use_default_lr_schedule: Any, eps: Any) -> None:
    checks.boolean("use_default_lr_schedule", use_default_lr_schedule)
    high = None if use_default_lr_schedule else 1.0
    checks.in_range("learning_rate", learning_rate, 0.0, high)
    checks.non_negative("eps", eps)


def _frank_wolfe(name: str, lmo, scaling: Any, learning_rate: Any, schedule: bool,
                 fw_eps: Any, param_ndim: int | None, fraction: _DropFraction | None
                 ) -> optax.GradientTransformation:
    """Frank-Wolfe with ``direction = lmo(g, axes, k)``; ``fraction`` for the L1q LMO only."""

    def init_fn(params):
        head = (jnp.zeros([], jnp.int32), jnp.zeros([], norms.stat_dtype(params)))
        if fraction is None:
            return FrankWolfeState(*head, jnp.zeros([], jnp.int32))
        return L1qFrankWolfeState(*head, *fraction.init(params), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        _require_params(params, name)
        # A schedule for the radius is resolved at the count of finite steps; a number keeps
        # the double-precision products of _fw_coefficients.
        scale_now = checks.resolve(scaling, state.count) if callable(scaling) else scaling
        alpha, a, b = _fw_coefficients(state.count, learning_rate, scale_now, schedule, fw_eps,
                                       state.alpha.dtype)
        leaves, treedef = jax.tree.flatten(updates)
        param_leaves = treedef.flatten_up_to(params)
        axes_of = _leaf_axes(leaves, updates, param_ndim)
        finite = stats_lib.all_finite(updates)
        if fraction is None:
            k_of = [None] * len(leaves)
            new_state = FrankWolfeState(optax.safe_increment(state.count), alpha,
                                        state.nonfinite)
        else:
            key, q_of, k_of = fraction.draw(state.key, leaves, axes_of)
            new_state = L1qFrankWolfeState(
                optax.safe_increment(state.count), alpha, key, treedef.unflatten(q_of),
                treedef.unflatten(_k_arrays(k_of)), state.nonfinite)
        new_leaves = [_fw_step(p, lmo(g, axes, k), a, b).astype(g.dtype)
                      if norms.is_float(g) else g
                      for g, axes, k, p in zip(leaves, axes_of, k_of, param_leaves, strict=True)]
        new_state = stats_lib.keep_if(finite, new_state, state)
        return treedef.unflatten(new_leaves), new_state._replace(
            nonfinite=stats_lib.count_nonfinite(state.nonfinite, finite))

    return checks.transformation(init_fn, update_fn)


def frank_wolfe(lmo_scaling_factor: float = 1.0, learning_rate: float = 2.0,
                use_default_lr_schedule: bool = True, eps: float = TINY
                ) -> optax.GradientTransformation:
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
      lmo_scaling_factor: ``c``, the radius of the constraint set (any real).
      learning_rate: ``lr``, ``>= 0`` (``<= 1`` when the schedule is off).
      use_default_lr_schedule: use ``α_t = lr / (lr + t)`` instead of a constant ``lr``.
      eps: lower bound of the schedule's divisor, ``>= 0``.

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
    _check_real("lmo_scaling_factor", lmo_scaling_factor)
    _check_fw(learning_rate, use_default_lr_schedule, eps)
    return _frank_wolfe("frank_wolfe", lambda g, axes, k: g, lmo_scaling_factor, learning_rate,
                        use_default_lr_schedule, eps, None, None)


def _fw_family(name: str, lmo, epsilon, learning_rate, use_default_lr_schedule, param_ndim,
               eps, *, eps_to_fw: bool, fraction: _DropFraction | None = None
               ) -> optax.GradientTransformation:
    checks.non_negative("epsilon", epsilon, allow_schedule=True)
    _check_fw(learning_rate, use_default_lr_schedule, eps)
    axes_lib.check_param_ndim_spec(param_ndim)
    return _frank_wolfe(name, lmo, epsilon, learning_rate, use_default_lr_schedule,
                        eps if eps_to_fw else TINY, param_ndim, fraction)


def l1_frank_wolfe(epsilon: float, learning_rate: float = 2.0,
                   use_default_lr_schedule: bool = True, param_ndim: int | None = -1,
                   eps: float = TINY) -> optax.GradientTransformation:
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
    return _fw_family("l1_frank_wolfe", lambda g, axes, k: _l1_lmo(g, axes), epsilon,
                      learning_rate, use_default_lr_schedule, param_ndim, eps, eps_to_fw=True)


def l2_frank_wolfe(epsilon: float, learning_rate: float = 2.0,
                   use_default_lr_schedule: bool = True, param_ndim: int | None = -1,
                   eps: float = TINY) -> optax.GradientTransformation:
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
    return _fw_family("l2_frank_wolfe",
                      lambda g, axes, k: _normalized(g, 2.0, axes, eps)[0].astype(g.dtype),
                      epsilon, learning_rate, use_default_lr_schedule, param_ndim, eps,
                      eps_to_fw=False)


def linf_frank_wolfe(epsilon: float, learning_rate: float = 2.0,
                     use_default_lr_schedule: bool = True, param_ndim: int | None = -1,
                     eps: float = TINY) -> optax.GradientTransformation:
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
    return _fw_family("linf_frank_wolfe", lambda g, axes, k: _sign(g), epsilon, learning_rate,
                      use_default_lr_schedule, param_ndim, eps, eps_to_fw=True)


def l1q_frank_wolfe(q: float, epsilon: float, dq: float = 0.0, learning_rate: float = 2.0,
                    use_default_lr_schedule: bool = True, param_ndim: int | None = -1,
                    eps: float = TINY, seed: int = 0) -> optax.GradientTransformation:
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

    Returns:
      An ``optax.GradientTransformation`` (replaces the inner optimizer; needs ``params``)
      whose state holds the step ``count`` and the PRNG key and logs ``alpha``, ``q``, ``k``.

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
    _check_q(q, dq, seed)
    return _fw_family("l1q_frank_wolfe", lambda g, axes, k: _l1q(g, axes, k, eps), epsilon,
                      learning_rate, use_default_lr_schedule, param_ndim, eps, eps_to_fw=False,
                      fraction=_DropFraction(q, dq, seed))
