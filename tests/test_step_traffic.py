"""Step cost, structurally: the memory passes every public transform adds to adam's step.

On a model of realistic size a training step is bound by memory bandwidth, so its time is
about the number of passes over parameter-sized buffers times the time of one pass. That number
is exact in the optimized HLO (``tests/hlo.py``): this suite holds every transform of the
conformance table to its budget, the passes ``chain(T, adam)`` reads and writes beyond
``adam`` alone (for a wrapper of an optimizer, beyond the wrapped optimizer). Adam itself makes
9 (reads g, mu, nu; writes mu, nu, the update; reads mu and nu again for the update).

The budgets are exact, not upper bounds: a change that adds a pass (a re-read of the
gradients, a temporary the size of the parameters) fails here, and a change that saves one
updates the table, so the table stays the record of what each step costs. The floor of a
transform is what it cannot avoid: an elementwise one with no diagnostics 0; a reduction over
the gradients (a norm, a finiteness check) 1 read; a per-element state buffer 1 read + 1 write;
reading the parameters 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from tests.hlo import Traffic, traffic
from tests.registry import ALL_ENTRIES, Entry

# One leaf the size of a small layer (the buffers counted are the ones at least this large)
# and a small one.
TREE = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32),
        "b": jax.ShapeDtypeStruct((512,), jnp.float32)}

# Wrappers of an optimizer: measured against the optimizer they wrap (as built in the registry).
WRAPPED = {"skip_spikes": lambda: optax.adam(1e-2), "spam_clip": lambda: optax.adam(1e-2),
           "adamw_clip": lambda: optax.adamw(1e-2),
           "stable_adamw_clip": lambda: optax.adam(1e-2)}

# Passes beyond adam's, per transform as the registry builds it.
BUDGET = {
    # Elementwise, with per-leaf diagnostics: the max-|g| and the finiteness reductions.
    "clip_value": 2,
    "clamp": 1,
    "sign": 0,
    # A per-leaf or global statistic: one read for it, one for the finiteness check.
    "clip_norm": 2,
    "clip_by_global_norm": 2,
    "normalize": 3,
    "centralize": 1,
    "zscore_normalize": 3,
    "clip_norm_growth": 1,
    "hist_clip": 3,
    "param_hist_clip": 2,
    "zclip": 2,
    "quantile_clip": 2,
    "standard_clip": 2,
    "adagc": 2,
    "l1_normalize": 3,
    "l2_normalize": 3,
    # Per-element state (an EMA, the previous update): floor 2 (one read, one write) + stats.
    "clip_norm_by_ema": 22,
    "normalize_by_ema": 10,
    "clip_value_by_ema": 13,
    "clip_value_growth": 25,
    # Per-row ranking (a sort of |g| per row).
    "top_q": 20,
    "l1q_normalize": 23,
    "l1q_frank_wolfe": 23,
    # Reading the parameters.
    "project_l2_ball": 6,
    "project_linf_ball": 4,
    "clamp_params": 4,
    "frank_wolfe": 3,
    "l1_frank_wolfe": 3,
    "l2_frank_wolfe": 4,
    "linf_frank_wolfe": 3,
    "adaptive_grad_clip": 4,
    # Wrappers of adam.
    "skip_spikes": 4,
    "spam_clip": 8,
    "adamw_clip": 8,
    "stable_adamw_clip": 4,
}


def _extra(entry: Entry) -> int:
    if entry.name in WRAPPED:
        return traffic(entry.make(), TREE).passes - traffic(WRAPPED[entry.name](), TREE).passes
    return (traffic(optax.chain(entry.make(), optax.adam(1e-3)), TREE).passes
            - traffic(optax.adam(1e-3), TREE).passes)


def test_every_transform_has_a_budget():
    assert set(BUDGET) == {entry.name for entry in ALL_ENTRIES}


def _stateless(fn) -> optax.GradientTransformation:
    return optax.GradientTransformation(optax.identity().init,
                                        lambda updates, state, params=None: (fn(updates), state))


def test_measure_counts_passes():
    """Adam: read g, mu, nu; write mu, nu; read them again; write the update. A transform that
    fuses into adam's kernels costs nothing; one that writes a temporary (here a sort, which no
    elementwise kernel can absorb) costs that write and one read."""
    assert traffic(optax.adam(1e-3), TREE) == Traffic(reads=6, writes=3)
    identity = _stateless(lambda u: jax.tree.map(lambda g: -g, u))
    assert traffic(optax.chain(identity, optax.adam(1e-3)), TREE) == Traffic(6, 3)
    row_sort = _stateless(lambda u: jax.tree.map(lambda g: jnp.sort(g, axis=-1), u))
    assert traffic(optax.chain(row_sort, optax.adam(1e-3)), TREE) == Traffic(7, 4)


@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=str)
def test_step_passes_match_budget(entry):
    extra = _extra(entry)
    assert extra == BUDGET[entry.name], (
        f"{entry.name}: chain(T, adam) makes {extra} passes over parameter-sized buffers beyond "
        f"adam's, the budget is {BUDGET[entry.name]}: "
        + ("a pass was added (a re-read of the gradients? a temporary the size of the "
           "parameters?)" if extra > BUDGET[entry.name] else "a pass was saved: lower the "
           "budget"))
