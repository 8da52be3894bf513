"""Unit-wise adaptive gradient clipping (AGC) and the unit axes of Flax layouts.

A *unit* is one output unit of a layer: a column of a Flax ``Dense`` kernel ``(in, out)``, one
output channel of a ``Conv`` kernel ``(H, W, in, out)``, one row of an ``Embed`` table
``(vocab, features)``. Gradient centralization and unit-wise norms reduce over the other axes.

References: Brock, De, Smith, Simonyan, "High-Performance Large-Scale Image Recognition Without
Normalization", ICML 2021 (arXiv 2102.06171), §4.1; ``optax.adaptive_grad_clip``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip._core import axes as axes_lib
from optclip._core import checks, handout, leafvec, norms, slices
from optclip._core import stats as stats_lib
from optclip._core.checks import ScalarOrSchedule
from optclip._core.norms import AxisName

__all__ = ["AdaptiveGradClipState", "adaptive_grad_clip", "flax_unit_axes"]


def _last_key(path: tuple) -> str:
    """The name of a leaf: the last dict key or attribute of ``path``, past the ``.value``
    attribute that ``flax.nnx`` variables add at the end."""
    names = [getattr(entry, "key", getattr(entry, "name", None)) for entry in path]
    if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
        names = names[:-1]
    return names[-1] if names and isinstance(names[-1], str) else ""


def flax_unit_axes(stacked: int | Callable[[tuple], int] = 0, *, vectors: bool = True
                   ) -> Callable[[tuple, Any], tuple[int, ...]]:
    """The unit axes of Flax parameters, as a callable ``(path, leaf) -> axes`` for ``dim``.

    Flax (Linen and NNX) stores a ``Dense``/``Linear`` kernel as ``(in, out)``, a ``Conv``
    kernel as ``(..., in, out)`` and an ``Embed`` table as ``(vocab, features)``; PyTorch's
    ``(out, in)`` is the transpose. The returned axes are the ones a unit's norm (or mean)
    reduces over, so a unit is one output feature:

    * ``embedding`` leaves: the last (feature) axis, one unit per row;
    * other leaves of rank 2 or more (kernels): every axis but the last (``(in, out)`` -> ``(0,)``,
      ``(H, W, in, out)`` -> ``(0, 1, 2)``, ``(W, in, out)`` -> ``(0, 1)``);
    * leaves of rank 0 or 1 (biases, scales): the whole leaf, or no axes with
      ``vectors=False`` (a per-slice transform then leaves them alone: gradient
      centralization touches weights only).

    A ``LinearGeneral`` kernel ``(in, heads, head_dim)`` is not told apart from a 1-D
    convolution: give its axes yourself (``dim`` also takes a pytree of axes).

    Args:
      stacked: leading axes that index layers rather than weights (``nn.scan`` /
        ``nnx.scan`` stacks store ``(L, in, out)``): never reduced over. An int for every leaf,
        or a callable ``path -> int`` (e.g. ``lambda path: 1 if "layers" in str(path) else 0``).
      vectors: ``True``: a bias or scale is one unit; ``False``: it has no unit axes.

    Returns:
      A callable for the ``dim`` argument of :func:`adaptive_grad_clip`, :func:`clip_norm`,
      :func:`normalize` and :func:`centralize` (flattening paths come from
      ``jax.tree_util.tree_flatten_with_path``, which works on Linen ``params`` dicts and on
      ``nnx.State``).

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> params = {"Dense_0": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones(4)},
      ...           "layers": {"kernel": jnp.ones((6, 3, 4))}}
      >>> tx = optclip.centralize(dim=optclip.flax_unit_axes(
      ...     stacked=lambda path: 1 if "layers" in str(path) else 0, vectors=False))
      >>> out, _ = tx.update(params, tx.init(params))
      >>> float(abs(out["layers"]["kernel"]).max())   # each layer's columns are constant
      0.0
      >>> out["Dense_0"]["bias"].tolist()              # biases untouched
      [1.0, 1.0, 1.0, 1.0]
    """
    if not callable(stacked):
        checks.integer("stacked", stacked, low=0)
    checks.boolean("vectors", vectors)

    def unit_axes(path: tuple, leaf: Any) -> tuple[int, ...]:
        lead = stacked(path) if callable(stacked) else stacked
        ndim = getattr(leaf, "ndim", 0)
        rank = ndim - lead
        if rank <= 1:
            return tuple(range(lead, ndim)) if vectors else ()
        if _last_key(path) == "embedding":
            return (ndim - 1,)
        return tuple(range(lead, ndim - 1))

    return unit_axes


@stats_lib.diagnostic("adaptive_grad_clip", ("max_ratio", "clipped", "nonfinite"),
                      per_leaf=("max_ratio", "clipped"))
class AdaptiveGradClipState(NamedTuple):
    count: jax.Array      # int32 finite steps taken (for a ``clipping`` schedule)
    max_ratio: jax.Array  # (F,) per leaf: largest ||G_unit|| / max(||W_unit||, eps) (last
                          # finite value)
    clipped: jax.Array    # (F,) per leaf: fraction of units clipped at the last step
    nonfinite: jax.Array  # int32 steps whose gradients were not finite


def adaptive_grad_clip(
    clipping: ScalarOrSchedule,
    eps: float = 1e-3,
    *,
    dim: Any = None,
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Unit-wise adaptive gradient clipping (AGC, Brock et al. 2021).

    For every unit ``i`` (see :func:`flax_unit_axes`) with gradient ``G_i`` and weights ``W_i``::

        max_i = clipping * max(||W_i||, eps)
        G_i  <- G_i * max_i / ||G_i||     if ||G_i|| > max_i, else unchanged

    (Frobenius norms over the unit's axes, accumulated in float32 or wider).

    NFNets leave the final classifier layer unclipped; exclude it with a mask::

        optax.masked(optclip.adaptive_grad_clip(0.01),
                     lambda params: jax.tree_util.tree_map_with_path(
                         lambda path, _: "head" not in jax.tree_util.keystr(path), params))

    Args:
      clipping: ``λ > 0``, the largest allowed ratio of gradient to weight norm, or a schedule
        ``count -> λ`` (NFNets use 0.01-0.16 depending on the batch size).
      eps: ``> 0``, the floor of the weight norm (so zero-initialised units can still move).
      dim: the axes a unit's norm reduces over: default ``None`` is
        ``flax_unit_axes()`` (Flax layouts: all axes but the last; the whole leaf for vectors;
        the feature axis of ``embedding`` tables); any ``dim`` value of :func:`clip_norm`, a
        pytree of them matching the parameters, or a callable ``(path, leaf) -> axes``. For
        PyTorch-style ``(out, in)`` kernels pass ``dim=-1`` with ``(out, in)`` matrices, or
        ``optclip.flax_unit_axes(stacked=1)`` for scanned ``(L, in, out)`` stacks.
      axis_name: inside ``shard_map``/``pmap``, the mesh axis name(s) that split a unit's
        axes; the partial norms are combined with ``psum``. Not needed under ``jax.jit`` with
        sharded arrays.

    Returns:
      An ``optax.GradientTransformation`` whose ``update`` needs ``params``. Its state logs,
      per leaf, the largest gradient-to-weight ratio ``max_ratio`` and the fraction of units
      ``clipped``, each as one vector over the floating leaves (:func:`optclip.per_leaf` gives
      a tree).

    References:
      Brock et al., "High-Performance Large-Scale Image Recognition Without Normalization",
      ICML 2021 (arXiv 2102.06171), §4.1; ``optax.adaptive_grad_clip`` (optax 0.2), which
      reduces over axis 0 of every rank-2/3 leaf (the layer axis of a scanned ``(L, in, out)``
      stack) and over the first three axes of every rank-4 leaf, floors the gradient norm at
      ``1e-6`` and computes in the leaf's dtype; optclip gives the same numbers on Dense and
      Conv kernels and vectors.

    Example:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.adaptive_grad_clip(0.1)
      >>> params = {"kernel": jnp.ones((4, 2))}            # unit weight norms: 2
      >>> grads = {"kernel": jnp.array([[3.0, 0.0]] * 4)}   # unit gradient norms: 6 and 0
      >>> tx.update(grads, tx.init(params), params)[0]["kernel"][0].round(4).tolist()
      [0.1, 0.0]
    """
    checks.positive("clipping", clipping, allow_schedule=True)
    checks.positive("eps", eps, finite=True)
    axes_lib.check_dim(dim, allow_global=False, allow_per_leaf=True)
    norms.check_axis_name(axis_name)
    unit_dim = flax_unit_axes() if dim is None else dim

    def measure(updates, params, bound, like):
        """``(clipped updates, max ratio, clipped fraction, finite)``: a tree, two per-leaf
        vectors of ``like``'s dtype, and whether every unit norm is finite on this device."""
        leaves, treedef = jax.tree.flatten(updates)
        param_leaves = treedef.flatten_up_to(params)
        dims = axes_lib.leaf_dims(unit_dim, params)
        floats = [i for i, g in enumerate(leaves) if norms.is_float(g)]
        slices_ = [(leaves[i], param_leaves[i], _unit_axes(leaves[i], dims[i])) for i in floats]
        split = norms.split_axes([g for g, _, _ in slices_], axis_name)
        unit_norms = norms.slice_l2_norms([(x, axes, sp) for (g, p, axes), sp in zip(slices_, split)
                                           for x in (g, p)])
        clipped = [_clip_leaf(g, unit_norms[2 * k], unit_norms[2 * k + 1], bound, eps)
                   for k, (g, _, _) in enumerate(slices_)]
        # The per-leaf statistics of the unit norms: same-shape leaves share each reduction
        # (one kernel for them all instead of one or more per leaf). Leaves that are one unit
        # need none: their unit norms are gathered, and the ratio and hit taken on vectors.
        several = [k for k, c in enumerate(clipped) if c[1].size != 1]
        parts, peak_parts, hit_parts = [], [], []
        if several:
            parts.append(several)
            peak_parts.append(leafvec.stack(norms.leaf_reductions(
                [clipped[k][1] for k in several], lambda r: r, "max"), like))
            hit_parts.append(leafvec.stack(norms.leaf_reductions(
                [clipped[k][2] for k in several], lambda h: h), like))
        for group in handout.by_dtype({k: unit_norms[2 * k].dtype for k, c in
                                       enumerate(clipped) if c[1].size == 1}).values():
            g_norm, w_norm = (norms.gather_scalars([unit_norms[2 * k + j].reshape(())
                                                    for k in group]) for j in (0, 1))
            _, ratio, hit = _clip_leaf(None, g_norm, w_norm, bound, eps)
            parts.append(group)
            peak_parts.append(ratio)
            hit_parts.append(hit)
        # The parts cover every float leaf once, each at its position in the vectors.
        placed = [leafvec.Group(ks, np.asarray(ks, np.int32), like.dtype,
                                ks == list(range(like.shape[0]))) for ks in parts]
        outs = iter(out for out, _, _ in clipped)
        new_leaves = [next(outs) if norms.is_float(g) else g for g in leaves]
        # The statistics are taken from vectors of these reductions: a per-leaf maximum,
        # division or finiteness test costs a kernel per leaf.
        totals = leafvec.assemble(hit_parts, placed, like)
        units = np.asarray([max(ratio.size, 1) for _, ratio, _ in clipped])
        return (treedef.unflatten(new_leaves),
                jnp.maximum(leafvec.assemble(peak_parts, placed, like), 0),
                _fractions(totals, units, leafvec.groups(leaves), like),
                jnp.all(jnp.isfinite(totals)))

    def init_fn(params):
        return AdaptiveGradClipState(jnp.zeros([], jnp.int32), leafvec.full(params, 0.0),
                                     leafvec.full(params, 0.0), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("adaptive_grad_clip needs the parameters: call "
                             "update(updates, state, params)")
        checks.params_like(updates, params, "adaptive_grad_clip")
        bound = checks.resolve(clipping, state.count, norms.stat_dtype(), name="clipping")
        # The gradient norms see every NaN/Inf: no separate pass over the gradients to find one.
        new_updates, ratio, clipped, finite = measure(updates, params, bound, state.max_ratio)
        finite = norms.all_true(finite, axis_name)
        return new_updates, AdaptiveGradClipState(
            stats_lib.step_count(state.count, finite),
            stats_lib.keep_finite(ratio, state.max_ratio),
            stats_lib.keep_finite(clipped, state.clipped),
            stats_lib.count_nonfinite(state.nonfinite, finite))

    return checks.transformation(init_fn, update_fn, pairs_leaves=True)


def _fractions(totals: jax.Array, units: np.ndarray, group_list: list[leafvec.Group],
               like: jax.Array) -> jax.Array:
    """Per leaf, its entry of ``totals`` (clipped units) over its number of ``units``, divided
    in the leaf's statistics dtype (as the leaf's own value would be), for the whole vector."""
    parts = [leafvec.take(totals, group) / units[group.positions].astype(group.dtype)
             for group in group_list]
    return leafvec.assemble(parts, group_list, like)


def _unit_axes(g: jax.Array, leaf_dim: Any) -> tuple[int, ...]:
    axes = axes_lib.reduction_axes(g.ndim, leaf_dim)
    return () if axes is None else axes


def _clip_leaf(g: jax.Array | None, g_norm: jax.Array, w_norm: jax.Array, bound: jax.Array,
               eps: float) -> tuple[jax.Array | None, jax.Array, jax.Array]:
    """``(clipped g, unit ratios, unit hits)`` for one float leaf from its unit norms: the
    ratios' maximum is the leaf's max ratio, and the hits sum to the number of clipped units
    (NaN exactly where a unit norm of ``g`` is not finite). Without ``g``, only the ratios
    and hits (of the entries of any arrays of unit norms)."""
    w_norm = w_norm.astype(g_norm.dtype)
    floor = jnp.maximum(w_norm, jnp.asarray(eps, g_norm.dtype))
    allowed = bound.astype(g_norm.dtype) * floor
    out = None if g is None else norms.scale(g, slices.clip_multiplier(g_norm, allowed))
    ratio = g_norm / floor
    # One sum counts the clipped units and sees a non-finite norm (``norm * 0`` is NaN there).
    return out, ratio, (g_norm > allowed).astype(g_norm.dtype) + g_norm * 0
