"""Which axes of a leaf a per-slice transform reduces over.

Two vocabularies describe the same idea:

* torchzero's ``dim`` / ``inverse_dims`` / ``min_size``: ``dim=None`` means all axes of each leaf,
  an int or a sequence of ints selects axes (negative allowed, axes at or beyond the leaf's rank
  ignored), ``inverse_dims`` takes the complement, ``'global'`` means all leaves as one vector;
* rai_toolbox's ``param_ndim``: ``None`` is the whole leaf, ``k >= 0`` the last ``k`` axes,
  ``k < 0`` the last ``ndim + k`` axes; the leading axes are batch axes.

Both resolve through :func:`reduction_axes`, per leaf, from the static shape (at trace time).
``dim`` may also differ per leaf: a pytree matching the parameters (or a prefix of them) whose
leaves are ``dim`` values, or a callable ``(path, leaf) -> dim``; :func:`leaf_dims` resolves it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from optclip._core import checks

GLOBAL = "global"
Dim = int | Sequence[int] | str | None
_UNSET = object()


def _is_dim_value(value: Any) -> bool:
    """A single ``dim`` (``None``, an int, ``'global'`` or a sequence of ints), not a tree."""
    if value is None or isinstance(value, (numbers.Number, str)):
        return True
    # A sequence of numbers is one (possibly invalid) dim, validated as such; a sequence
    # holding anything else (None, tuples, dicts) is a per-leaf tree.
    return isinstance(value, (tuple, list)) and all(isinstance(v, numbers.Number) for v in value)


def is_per_leaf(dim: Any) -> bool:
    """Whether ``dim`` gives each leaf its own axes (a callable or a pytree of ``dim`` values)."""
    return callable(dim) or not _is_dim_value(dim)


def leaf_dims(dim: Any, tree: Any) -> list:
    """The ``dim`` of every leaf of ``tree`` (in ``jax.tree.leaves`` order).

    ``dim`` is one value for all leaves, a callable ``(path, leaf) -> dim`` or a pytree whose
    structure is a prefix of ``tree``'s (a value there applies to every leaf below it).
    """
    return _per_leaf_values(dim, tree, "dim", lambda d: check_dim(d, allow_global=False))


def leaf_param_ndims(param_ndim: Any, tree: Any) -> list:
    """The ``param_ndim`` of every leaf of ``tree``, per-leaf spellings as in :func:`leaf_dims`."""
    return _per_leaf_values(param_ndim, tree, "param_ndim", check_param_ndim)


def check_param_ndim_spec(param_ndim: Any) -> None:
    """Construction-time validation of ``param_ndim``: an int, ``None``, or per leaf."""
    checks.static("param_ndim", param_ndim)  # an array is neither an int nor a tree of them
    if not is_per_leaf(param_ndim):
        check_param_ndim(param_ndim)


def _per_leaf_values(spec: Any, tree: Any, name: str, check: Callable[[Any], None]) -> list:
    import jax  # local: axes.py stays importable without initialising jax

    if not is_per_leaf(spec):
        return [spec] * len(jax.tree.leaves(tree))
    if callable(spec):
        resolved = [spec(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
    else:
        try:
            per_subtree = jax.tree.map(lambda d, sub: [d] * len(jax.tree.leaves(sub)),
                                       spec, tree, is_leaf=_is_dim_value)
        except ValueError as error:
            raise ValueError(f"a per-leaf {name} must be a pytree matching the parameters (or "
                             f"a prefix of them): {error}") from None
        resolved = [d for ds in jax.tree.leaves(per_subtree, is_leaf=lambda v: isinstance(
            v, list)) for d in ds]
    for d in resolved:
        check(d)
    return resolved


def check_dim(dim: Dim, *, allow_global: bool = True, allow_per_leaf: bool = False) -> None:
    """Construction-time validation of a torchzero-style ``dim``."""
    if dim is None:
        return
    checks.static("dim", dim)  # an array is neither an axis nor a per-leaf tree of axes
    if allow_per_leaf and is_per_leaf(dim):
        return
    if isinstance(dim, str):
        if allow_global and dim == GLOBAL:
            return
        allowed = "None, an int, a sequence of ints" + (" or 'global'" if allow_global else "")
        raise ValueError(f"dim must be {allowed}; got {dim!r}")
    if isinstance(dim, numbers.Integral):
        entries = [dim]
    elif isinstance(dim, Sequence):
        entries = list(dim)
    else:
        raise TypeError(f"dim must be None, an int, a sequence of ints or 'global'; got {dim!r} "
                        f"of type {type(dim).__name__}")
    for entry in entries:
        if isinstance(entry, bool) or not isinstance(entry, numbers.Integral):
            raise TypeError(f"dim must contain ints, got {entry!r} in {dim!r}")


def check_param_ndim(param_ndim: int | None) -> None:
    checks.integer("param_ndim", param_ndim, allow_none=True)


def param_ndim_to_axes(param_ndim: int | None, ndim: int) -> tuple[int, ...]:
    """rai_toolbox's ``param_ndim`` for a leaf of rank ``ndim``."""
    if param_ndim is None:
        return tuple(range(ndim))
    if abs(param_ndim) > ndim:
        # A leaf of lower rank than |param_ndim| (a learned temperature, a bias) is one slice:
        # rai_toolbox 0.2.1 raises an error for it instead.
        return tuple(range(ndim))
    kept = param_ndim if param_ndim >= 0 else ndim + param_ndim
    return tuple(range(ndim - kept, ndim))


def reduction_axes(
    ndim: int, dim: Dim = None, inverse_dims: bool = False, *, param_ndim=_UNSET
) -> tuple[int, ...] | None:
    """Axes of a rank-``ndim`` leaf to reduce over, or ``None`` to leave the leaf alone.

    Pass either the torchzero vocabulary (``dim``, ``inverse_dims``) or ``param_ndim``.
    The returned axes are sorted, non-negative and unique. A 0-d leaf is treated as shape
    ``(1,)`` (one one-element slice): its axes are ``()`` when the resolved set is non-empty.
    Unlike torchzero 0.4.4, ``dim=None`` is resolved per leaf and
    negative axes are normalised before ``inverse_dims`` is applied.
    """
    if param_ndim is not _UNSET:
        return param_ndim_to_axes(param_ndim, ndim)
    if dim == GLOBAL:
        raise ValueError("dim='global' is handled by the global path, not per leaf")
    rank = max(ndim, 1)
    if dim is None:
        selected = set(range(rank))
    else:
        entries = [dim] if isinstance(dim, numbers.Integral) else list(dim)
        # Axes outside [-rank, rank) do not exist on this leaf: ignore them.
        selected = {d % rank for d in entries if -rank <= d < rank}
    if inverse_dims:
        selected = set(range(rank)) - selected
    if not selected:
        return None
    if ndim == 0:
        return ()
    return tuple(sorted(selected))


def slice_size(shape: Sequence[int], axes: Sequence[int]) -> int:
    """Number of elements in one slice reduced over ``axes`` (1 for a 0-d leaf)."""
    return math.prod(shape[a] for a in axes)
