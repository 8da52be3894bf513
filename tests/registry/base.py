"""What the conformance suite needs to know about a public transform."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def default_tree(dtype=jnp.float32, seed: int = 0) -> dict[str, Any]:
    """Small gradients: a (8, 4) matrix (sharded along axis 0 in the sharding check), a vector."""
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(8, 4)) * 3, dtype),
            "b": jnp.asarray(rng.normal(size=(4,)), dtype)}


def _f64(tree) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


# Bounds are checked in float64 with a tolerance that covers float16 outputs.
BOUND_RTOL = 1e-2


def max_abs_at_most(bound: float) -> Callable[[Any], bool]:
    return lambda out: all(np.all(np.abs(x) <= bound) for x in _f64(out))


def global_norm_at_most(bound: float) -> Callable[[Any], bool]:
    return lambda out: np.sqrt(sum(np.sum(x ** 2) for x in _f64(out))) <= bound * (1 + BOUND_RTOL)


def row_norms_at_most(bound: float, leaf: str) -> Callable[[Any], bool]:
    return lambda out: np.all(np.linalg.norm(np.asarray(out[leaf], np.float64), axis=-1)
                              <= bound * (1 + BOUND_RTOL))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public transform in the conformance suite.

    name: the public name (``optclip.<name>``); used as the test id and for ``bad_args``.
    make: builds the transform with representative arguments.
    bad_args: ``(kwargs, parameter name)`` pairs that must raise ``ValueError``/``TypeError``
      at construction, with the parameter name in the message.
    needs_params: ``update`` needs ``params`` (projections, Frank-Wolfe).
    has_stats: ``optclip.stats`` reports at least one entry for its state.
    tree: makes the gradient tree (``dtype, seed -> tree``).
    rtol: tolerance for jit == eager and sharded == unsharded.
    axis_make: builds the transform with ``axis_name`` (``axis_name -> transform``), configured
      so that its statistics reduce over axis 0 of every leaf (the axis ``shard_map`` splits);
      ``None`` for transforms without ``axis_name``.
    ones_norm: the global norm of the output for ``ones(8, 4)`` on the first step, for the
      transforms that act on the global norm then (``None``: not checked).
    thresholds: parameter name -> keyword arguments that build the transform with that
      parameter as a number; every threshold also takes an optax schedule (``count -> value``).
    ord_kwargs: keyword arguments that build the transform when it takes an ``ord`` (the suite
      adds each ``ord``); ``None`` when it has none.
    bound: a property every output must have (the clipping bound holding), ``out -> bool``.
    scale_make: builds the transform for the scale-safety check when ``make`` wraps an optax
      optimizer whose own arithmetic is not scale-safe (``optax.adam`` squares gradients in the
      parameters' dtype: its ``nu`` overflows at float32 elements of 1e20 or float16 ones of
      6e4, and its ``eps=1e-8`` is 0 in float16): the same wrapper around an adam that sees
      bounded gradients, so the wrapper's own statistics still meet the huge ones. ``None``:
      ``make``.
    """

    name: str
    make: Callable[[], optax.GradientTransformation]
    bad_args: tuple[tuple[dict, str], ...] = ()
    needs_params: bool = False
    has_stats: bool = True
    tree: Callable[..., Any] = default_tree
    rtol: float = 1e-5
    axis_make: Callable[[Any], optax.GradientTransformation] | None = None
    ones_norm: float | None = None
    thresholds: dict[str, dict] = dataclasses.field(default_factory=dict)
    ord_kwargs: dict | None = None
    bound: Callable[[Any], bool] | None = None
    scale_make: Callable[[], optax.GradientTransformation] | None = None

    def __str__(self) -> str:
        return self.name
