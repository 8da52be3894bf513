"""Mesh axes: which named axes (inside ``shard_map``/``pmap``) a leaf is split over, and the
one place optclip combines partial reductions and step-wide flags across devices."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

AxisName = str | tuple[str, ...] | None


def check_axis_name(axis_name: Any) -> None:
    """Construction-time validation of ``axis_name``: ``None``, a name or a tuple of names."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not all(isinstance(n, str) and n for n in names):
        raise TypeError("axis_name must be None, a mesh axis name (str) or a tuple of names; "
                        f"got {axis_name!r}")


def _varying(x: Any) -> frozenset:
    """The manual mesh axes ``x``'s type says it varies over (empty where jax does not track)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def split_axes(leaves: list, axis_name: AxisName) -> list[tuple[str, ...]]:
    """Per leaf, the named mesh axes its elements are split over (inside shard_map or pmap).

    Where jax tracks which values vary across devices (``shard_map`` with its default
    ``check_vma=True``), a leaf that does not vary over a named axis (a replicated bias, say)
    holds the same elements on every device and is counted once. Where it does not track
    (``pmap``, ``check_vma=False``) every leaf is taken to be split over all named axes.
    Outside ``shard_map``/``pmap`` (axis names unbound, e.g. ``init`` called on the global
    arrays) nothing is split.
    """
    if axis_name is None:
        return [()] * len(leaves)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    try:
        index = jax.lax.axis_index(names)
    except NameError:  # not inside shard_map/pmap: the arrays are whole
        return [()] * len(leaves)
    if not _varying(index):
        return [names] * len(leaves)
    return [tuple(n for n in names if n in _varying(x)) for x in leaves]


def axes_size(split: tuple[str, ...]) -> int:
    """Number of devices along the named mesh axes (1 for none)."""
    return math.prod(jax.lax.axis_size(n) for n in split)


def across(value: jax.Array, kind: str, split: tuple[str, ...]) -> jax.Array:
    """Combine a partial ``kind`` reduction (``'sum'``, ``'max'``, ``'min'``) across devices.

    The one place optclip issues a collective: ``psum``/``pmax``/``pmin`` over the named mesh
    axes, so every device ends with the same value (and the same state).
    """
    if not split:
        return value
    return {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[kind](value, split)


def _flag_across(flag: jax.Array, kind: str, axis_name: AxisName) -> jax.Array:
    split = split_axes([flag], axis_name)[0] if axis_name is not None else ()
    if not split:
        return flag
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return across(flag.astype(jnp.int32), kind, names).astype(bool)


def all_true(flag: jax.Array, axis_name: AxisName = None) -> jax.Array:
    """A bool that holds on every device along ``axis_name`` (a step-wide decision)."""
    return _flag_across(flag, "min", axis_name)


def any_true(flag: jax.Array, axis_name: AxisName = None) -> jax.Array:
    """A bool that holds on some device along ``axis_name``."""
    return _flag_across(flag, "max", axis_name)
