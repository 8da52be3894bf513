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

from optclip._core import slices
from tests import hlo
from tests.registry import ALL_ENTRIES, Entry, with_adam

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


@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=str)
def test_distinct_kernels_per_leaf(entry):
    small = _distinct_excess(entry, COPIES)
    large = _distinct_excess(entry, COPIES * GROWTH)
    leaves = len(jax.tree.leaves(_tree(entry, COPIES)))
    added = leaves * (GROWTH - 1)
    assert (large - small) / added <= MAX_DISTINCT_PER_LEAF, (
        f"{entry.name}: {large - small} more distinct compiled kernels for {added} more leaves "
        f"({(large - small) / added:.1f} per leaf): a per-leaf computation differs from leaf "
        f"to leaf (reads entry j of a vector?), so XLA compiles it once per leaf")


# Kernels each added leaf brings to chain(T, adam)'s step beyond adam's 3 (a wrapper's: to
# the optimizer it wraps; a projection goes after adam, and Frank-Wolfe, which replaces adam,
# is counted alone: tests/registry.py's PLACEMENT), on small leaves of the benchmark's
# shapes, per transform as the registry builds it (tests/hlo.py: kernels), traced as on one
# device, as make bench runs (this suite sees 8 CPU devices, where same-shape leaves are not
# reduced together). XLA:CPU orders the kernels of a step by testing each against the ones
# before it, so this count is the part of compile time that grows with the square of the
# leaf count: 0 where all leaves of one shape share every kernel (global statistics, grouped
# reductions); per-leaf diagnostics, per-leaf scalar decisions and per-leaf conditionals cost
# kernels of their own.
# Exact: a change that adds kernels fails here, and one that saves some lowers the table.
KERNEL_BUDGET = {
    "clip_value": -1, "clip_norm": 3.58, "clip_by_global_norm": 0, "normalize": 4.08,
    "centralize": 0.75, "zscore_normalize": 0.75, "clip_norm_by_ema": 11.92,
    "normalize_by_ema": 4, "clip_value_by_ema": -0.17, "clip_value_growth": 3.67,
    "clip_norm_growth": -0.17, "hist_clip": 0, "param_hist_clip": 0, "zclip": 0,
    "quantile_clip": 0, "standard_clip": 0, "sign": 0, "l1_normalize": 4.5,
    "l2_normalize": 9.33, "top_q": 1.58, "l1q_normalize": 2.75, "clamp": -0.17,
    "project_l2_ball": 7.5, "project_linf_ball": 0.83, "clamp_params": 0.83,
    "frank_wolfe": -2.17, "l1_frank_wolfe": -0.75, "l2_frank_wolfe": 6.33,
    "linf_frank_wolfe": -2.17, "l1q_frank_wolfe": 0.58, "skip_spikes": 4, "adagc": 0,
    "spam_clip": 2.83, "adamw_clip": 2.83, "stable_adamw_clip": 3.83,
    "adaptive_grad_clip": 5,
}


def test_every_transform_has_a_kernel_budget():
    assert set(KERNEL_BUDGET) == {entry.name for entry in ALL_ENTRIES}


def test_kernel_count_measure():
    """adam: 3 kernels per leaf (two moment updates, the update), the identity 1 (a copy of
    the leaf: the inputs are not donated); a reduction per leaf adds kernels, and so do the
    kernels inside a conditional's branches."""
    adam = optax.adam(1e-3)
    assert hlo.extra_kernels_per_leaf(adam, optax.identity()) == 2

    def per_leaf_gate(updates, state, params=None):
        return jax.tree.map(lambda g: jnp.where(jnp.sum(g) > 0, g, 0), updates), state

    def gated_by_cond(updates, state, params=None):
        ok = jnp.sum(jax.tree.leaves(updates)[0]) > 0
        return jax.lax.cond(ok, lambda: jax.tree.map(lambda g: g * 2, updates),
                            lambda: updates), state

    per_leaf = optax.GradientTransformation(optax.identity().init, per_leaf_gate)
    assert hlo.extra_kernels_per_leaf(optax.chain(per_leaf, adam), adam) >= 1
    gated = optax.GradientTransformation(optax.identity().init, gated_by_cond)
    # Counted without the branches' kernels, this is 1.
    assert hlo.extra_kernels_per_leaf(optax.chain(gated, adam), adam) == 2


@pytest.mark.skipif(not hlo.recorded_xla(), reason=f"exact kernel counts of jaxlib "
                    f"{hlo.RECORDED_JAXLIB}'s XLA; checked by the main pins of make test")
@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=str)
def test_kernels_per_leaf_match_budget(entry, one_device, monkeypatch):
    # The top-q ranking's groups as on a large tree (a small one ranks its arrays apart).
    monkeypatch.setattr(slices, "COUNT_GROUP_PER", 1)
    tx, base = with_adam(entry)
    extra = round(hlo.extra_kernels_per_leaf(tx, base), 2)
    budget = KERNEL_BUDGET[entry.name]
    assert extra == budget, (
        f"{entry.name}: each added leaf brings {extra} kernels beyond adam's to the step, the "
        f"budget is {budget}: " + (
            "kernels were added (a per-leaf scalar computed apart? a per-leaf select of a "
            "diagnostic? a per-leaf conditional?); XLA:CPU's compile time grows with their "
            "square" if extra > budget else "kernels were saved: lower the budget"))
