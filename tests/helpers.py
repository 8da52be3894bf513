"""Helpers shared by test modules (test modules import from here, never from each other)."""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st


def nnx_pure(tree: Any) -> Any:
    """``tree`` (an ``nnx.State`` or optimizer state) with every flax ``Variable`` replaced by
    its array, on every supported flax (``nnx.as_pure`` is newer than the floor, 0.12.0)."""
    from flax import nnx

    if hasattr(nnx, "as_pure"):
        return nnx.as_pure(tree)
    variable_types = tuple(t for t in (getattr(nnx, "Variable", None),
                                       getattr(nnx, "VariableState", None)) if t is not None)
    return jax.tree.map(lambda x: x.value if isinstance(x, variable_types) else x, tree,
                        is_leaf=lambda x: isinstance(x, variable_types))


# ---------------------------------------------------------------------------------------------
# The torchzero families (tests/test_ema.py, tests/test_growth.py): reference inputs as lists of
# leaves, runs step by step, the reference metric, random spiky sequences.

RTOL, ATOL = 1e-6, 1e-9          # the published float32 vectors
ORACLE_RTOL = 2e-5               # float32 oracle over long random sequences (ulp drift)


def as_tree(step, dtype=jnp.float32):
    """A reference input (one leaf, or a list of leaves) as a list of arrays."""
    if isinstance(step[0], (list, tuple)) or len(step) and isinstance(step[0], np.ndarray):
        return [jnp.asarray(leaf, dtype) for leaf in step]
    return [jnp.asarray(step, dtype)]


def run(tx, steps, *, jit=False, state=None):
    """Outputs and states after each step (inputs: lists of leaves)."""
    update = jitted(tx) if jit else tx.update
    state = tx.init(steps[0]) if state is None else state
    outs, states = [], []
    for g in steps:
        out, state = update(g, state)
        outs.append(out)
        states.append(state)
    return outs, states


_JIT_CACHE: dict = {}


def jitted(tx):
    """One jitted ``update`` per transform object, shared between the tests that use it."""
    key = id(tx)
    if key not in _JIT_CACHE:
        _JIT_CACHE[key] = (tx, jax.jit(tx.update))
    return _JIT_CACHE[key][1]


def np_metric(v: np.ndarray, ord) -> np.floating:
    """The metric of a flat vector, from its definition ('sum' as |Σ|)."""
    a = np.abs(v)
    if isinstance(ord, (int, float)) and ord < 0:
        with np.errstate(divide="ignore"):
            return (a ** ord).sum() ** (1 / ord)
    if ord in ("l0", "l1", "l2", "l3", "l4"):
        ord = float(ord[1])
    if ord == "linf":
        ord = math.inf
    if ord == "mad":
        return a.sum() / v.size
    if ord == "var":
        return ((v - v.mean()) ** 2).sum() / (v.size - 1)
    if ord == "std":
        return np.sqrt(((v - v.mean()) ** 2).sum() / (v.size - 1))
    if ord == "sum":
        return abs(v.sum())
    if ord == 0:
        return v.dtype.type(np.count_nonzero(v))
    if ord == math.inf:
        return a.max(initial=0)
    if ord == -math.inf:
        return a.min(initial=math.inf)
    return (a ** ord).sum() ** (1 / ord)


def random_sequence(seed, shapes=((3, 4), (5,), ()), steps=12, dtype=np.float32):
    """Random updates with spikes (x100), collapses (x1e-3) and an all-zero step."""
    rng = np.random.default_rng(seed)
    seq = []
    for t in range(steps):
        scale = np.exp(rng.normal() * 0.7)
        if t in (4, 9):
            scale *= 100.0
        if t == 6:
            scale *= 1e-3
        seq.append([np.asarray(rng.normal(size=s) * scale * (t != 7), dtype) for s in shapes])
    return seq


def to_np(tree):
    """The leaves of ``tree`` as NumPy arrays."""
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def per_leaf_np(values, like):
    """A state field's values as NumPy arrays in leaf order: each floating leaf's entry of a
    per-leaf vector (``optclip.per_leaf``), or a global mode's one scalar."""
    import optclip

    return to_np(optclip.per_leaf(values, like) if jnp.ndim(values) else values)


def concatenated_operand_sizes(jaxpr) -> list[int]:
    """The sizes of every operand of every ``concatenate`` in ``jaxpr`` and its sub-jaxprs
    (a transform that only combines per-leaf scalars gives sizes of at most 1)."""
    sizes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "concatenate":
            sizes += [math.prod(v.aval.shape) for v in eqn.invars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    sizes += concatenated_operand_sizes(sub)
    return sizes


# Hypothesis: sequences of one to six steps of two leaves, scales from 1e-3 to 1e3.
sequences = st.lists(
    st.tuples(st.floats(-3, 3), st.integers(0, 2**16)).map(
        lambda p: [(np.random.default_rng(p[1]).normal(size=s) * 10.0 ** p[0]).astype(np.float32)
                   for s in ((4, 3), (5,))]),
    min_size=1, max_size=6)


def assert_nonfinite_step_skipped(tx, seq, bad_step, index, poison):
    """Step ``bad_step`` of ``seq`` (lists of leaves) poisoned with ``poison`` at element
    ``(index,) * ndim`` of every leaf: ``tx``'s state is unchanged but for its ``nonfinite``
    counter, and every later output is exactly the run's without that step."""
    update = jitted(tx)
    clean_outs, _ = run(tx, seq, jit=True)
    state = tx.init(seq[0])
    outs = []
    for t, g in enumerate(seq):
        if t == bad_step:
            bad = [x.at[(index,) * x.ndim].set(poison) for x in g]
            _, after = update(bad, state)
            assert int(after.nonfinite) == int(state.nonfinite) + 1
            chex.assert_trees_all_equal(after._replace(nonfinite=state.nonfinite), state)
            state = after
        out, state = update(g, state)
        outs.append(out)
    chex.assert_trees_all_equal(outs, clean_outs)
