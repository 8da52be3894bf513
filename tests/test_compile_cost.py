"""Compile cost grows linearly with the number of leaves, for every public transform.

Compile time on a tree of hundreds of leaves is dominated by XLA's passes over the optimized
HLO, and the blow-ups seen so far (a chain of per-leaf scalars copied into every leaf's fusion)
show up as an instruction count growing quadratically with the leaf count while the jaxpr grows
linearly. Instruction counts are exact (no timing noise), so the check compares the optimized
HLO of ``jit(chain(T, adam).update)`` at ``N`` and ``4N`` tiny leaves: linear growth gives about
4x the instructions beyond adam's own, quadratic growth about 16x; the bound sits at 6x.
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
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s", re.M)


def hlo_instructions(tx: optax.GradientTransformation, tree) -> int:
    """Instructions (fused computations included) of the optimized HLO of ``tx.update``."""
    state = tx.init(tree)
    text = jax.jit(tx.update).lower(tree, state, tree).compile().as_text()
    return len(_INSTRUCTION.findall(text))


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
