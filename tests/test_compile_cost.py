"""Compile cost grows linearly with the number of leaves, for every public transform.

Compile time on a tree of hundreds of leaves is dominated by XLA's passes over the optimized
HLO, and the blow-ups seen so far (a chain of per-leaf scalars copied into every leaf's fusion)
show up as an instruction count growing quadratically with the leaf count while the jaxpr grows
linearly. Instruction counts are exact (no timing noise), so the check compares the optimized
HLO of ``jit(chain(T, adam).update)`` at ``N`` and ``4N`` tiny leaves: linear growth gives about
4x the instructions beyond adam's own, quadratic growth about 16x; the bound sits at 6x.

XLA:CPU compiles each distinct kernel once and reuses it for identical ones (adam's per-leaf
kernels are compiled once per leaf shape). A per-leaf computation that reads entry ``j`` of a
vector of per-leaf values is distinct for every leaf, so its cost is paid once per leaf: the
second check counts distinct kernels (fused computations up to names) and bounds how many
each added leaf brings.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import optax
import pytest

from tests.registry import ALL_ENTRIES, Entry

COPIES = 2            # copies of the entry's small tree (default: 2 leaves): 4 and 16 leaves
GROWTH = 4            # leaf count ratio between the two trees
MAX_EXCESS_GROWTH = 6.0
# Distinct kernels an added leaf may bring beyond adam's (one small per-leaf read of a vector
# of per-leaf values is 1; reading each of several vectors per leaf, 4 and more).
MAX_DISTINCT_PER_LEAF = 1.5
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s", re.M)
_COMPUTATION = re.compile(r"^%\S+ (\(.*?^})", re.M | re.S)
_METADATA = re.compile(r", metadata=\{[^}]*\}")
_NUMBERED_NAME = re.compile(r"%?[A-Za-z_][\w\-]*(?:\.\d+)+")
_NAME = re.compile(r"%[\w.\-]+")


@functools.cache
def _compiled_text(tx: optax.GradientTransformation, tree_fn, copies: int) -> str:
    tree = {f"t{i}": tree_fn(jnp.float32, i) for i in range(copies)}
    state = tx.init(tree)
    return jax.jit(tx.update).lower(tree, state, tree).compile().as_text()


def hlo_instructions(tx: optax.GradientTransformation, tree) -> int:
    """Instructions (fused computations included) of the optimized HLO of ``tx.update``."""
    state = tx.init(tree)
    text = jax.jit(tx.update).lower(tree, state, tree).compile().as_text()
    return len(_INSTRUCTION.findall(text))


def distinct_kernels(text: str) -> int:
    """Computations of an optimized HLO module that differ other than in names."""
    return len({_NAME.sub("x", _NUMBERED_NAME.sub("x", _METADATA.sub("", body)))
                for body in _COMPUTATION.findall(text)})


def _tree(entry: Entry, copies: int):
    return {f"t{i}": entry.tree(jnp.float32, i) for i in range(copies)}


@functools.cache
def _adam_instructions(tree_fn, copies: int) -> int:
    entry = Entry("adam", lambda: optax.adam(1e-3), tree=tree_fn)
    return hlo_instructions(optax.adam(1e-3), _tree(entry, copies))


def _excess(entry: Entry, copies: int) -> int:
    """Instructions ``chain(T, adam)`` adds to ``adam`` alone on ``copies`` copies of the tree."""
    chained = hlo_instructions(optax.chain(entry.make(), optax.adam(1e-3)), _tree(entry, copies))
    return chained - _adam_instructions(entry.tree, copies)


def test_instruction_count_is_exact():
    """The measure is deterministic (a bound on it cannot be fooled by machine load)."""
    entry = ALL_ENTRIES[0]
    tree = _tree(entry, 1)
    assert hlo_instructions(optax.adam(1e-3), tree) == hlo_instructions(optax.adam(1e-3), tree)
    assert hlo_instructions(optax.adam(1e-3), _tree(entry, 2)) > hlo_instructions(
        optax.adam(1e-3), tree)


@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=str)
def test_compiled_size_grows_linearly_with_leaves(entry):
    small = _excess(entry, COPIES)
    large = _excess(entry, COPIES * GROWTH)
    leaves = len(jax.tree.leaves(_tree(entry, COPIES)))
    assert small > 0
    assert large / small <= MAX_EXCESS_GROWTH, (
        f"{entry.name}: chain(T, adam) adds {small} HLO instructions to adam at {leaves} "
        f"leaves but {large} at {leaves * GROWTH} ({large / small:.1f}x for {GROWTH}x the "
        f"leaves): something per leaf is being copied into every leaf's computation "
        f"(combine per-leaf scalars with optclip._core.norms.gather_scalars)")


def _distinct_excess(entry: Entry, copies: int) -> int:
    chained = optax.chain(entry.make(), optax.adam(1e-3))
    adam = optax.adam(1e-3)
    return (distinct_kernels(_compiled_text(chained, entry.tree, copies))
            - distinct_kernels(_compiled_text(adam, entry.tree, copies)))


def test_distinct_kernels_measure():
    """Identical per-leaf kernels count once: adam's distinct kernels do not grow with leaves."""
    entry = ALL_ENTRIES[0]
    adam = optax.adam(1e-3)
    assert distinct_kernels(_compiled_text(adam, entry.tree, COPIES)) == distinct_kernels(
        _compiled_text(adam, entry.tree, COPIES * GROWTH))


# Per-row top-q ranking still reads per-leaf values by index (measured: 3-4 distinct kernels
# per added leaf). Strict: the mark fails the suite once they are fixed, so it is removed then.
_DISTINCT_PER_LEAF_KNOWN = {"top_q", "l1q_frank_wolfe"}


def _known(entry: Entry):
    if entry.name not in _DISTINCT_PER_LEAF_KNOWN:
        return entry
    return pytest.param(entry, marks=pytest.mark.xfail(
        strict=True, reason="per-leaf kernels distinct per leaf (top-q ranking)"))


@pytest.mark.parametrize("entry", [_known(e) for e in ALL_ENTRIES], ids=str)
def test_distinct_kernels_per_leaf(entry):
    small = _distinct_excess(entry, COPIES)
    large = _distinct_excess(entry, COPIES * GROWTH)
    leaves = len(jax.tree.leaves(_tree(entry, COPIES)))
    added = leaves * (GROWTH - 1)
    assert (large - small) / added <= MAX_DISTINCT_PER_LEAF, (
        f"{entry.name}: {large - small} more distinct compiled kernels for {added} more leaves "
        f"({(large - small) / added:.1f} per leaf): a per-leaf computation differs from leaf "
        f"to leaf (reads entry j of a vector?), so XLA compiles it once per leaf")
