"""Checks shared by torchzero's stateful families (EMA-referenced and growth clippers).

Each runs over representative configurations of both families (``ALL_EMA``, ``ALL_GROWTH``).
"""

from __future__ import annotations

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optclip
from optclip._core import norms
from tests.test_ema import ALL_EMA, _jitted, as_tree, random_sequence, run
from tests.test_growth import ALL_GROWTH

ALL = ALL_EMA + [(f"growth_{name}", make) for name, make in ALL_GROWTH]
GROWTH_MAKERS = {make for _, make in ALL_GROWTH}
stateful = pytest.mark.parametrize("make", [m for _, m in ALL], ids=[n for n, _ in ALL])

POISONS = {"nan_first": ((0,), jnp.nan), "inf_last": ((-1,), jnp.inf)}


@stateful
@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("bad_step", [0, 3])
def test_nonfinite_step_leaves_state_unchanged(make, bad_step, poison):
    tx = make()
    update = _jitted(tx)
    index, value = POISONS[poison]
    seq = [as_tree(s) for s in random_sequence(seed=1, steps=6)]
    bad = [x.at[index * x.ndim].set(value) for x in seq[bad_step]]
    clean_outs, _ = run(tx, seq, jit=True)
    state = tx.init(seq[0])
    outs = []
    for t, g in enumerate(seq):
        if t == bad_step:
            _, after = update(bad, state)
            assert int(after.nonfinite) == int(state.nonfinite) + 1
            chex.assert_trees_all_equal(after._replace(nonfinite=state.nonfinite), state)
            state = after
        out, state = update(g, state)
        outs.append(out)
    chex.assert_trees_all_close(outs, clean_outs, rtol=0, atol=0)
    assert int(state.nonfinite) == 1


@stateful
def test_checkpoint_round_trip_continues_identically(make):
    tx = make()
    seq = [as_tree(s) for s in random_sequence(seed=4, steps=6)]
    outs, states = run(tx, seq, jit=True)
    restored = flax.serialization.from_bytes(tx.init(seq[0]),
                                             flax.serialization.to_bytes(states[2]))
    resumed, _ = run(tx, seq[3:], jit=True, state=restored)
    chex.assert_trees_all_close(resumed, outs[3:], rtol=0, atol=0)


@stateful
def test_bf16_statistics_in_float32_and_odd_trees(make):
    tx = make()
    tree = {"w": jnp.ones((3, 2), jnp.bfloat16) * 3, "i": jnp.arange(3), "none": None,
            "masked": optax.MaskedNode(), "s": jnp.array(2.0, jnp.bfloat16),
            "empty": jnp.zeros((0, 2))}
    state, update = tx.init(tree), _jitted(tx)
    for scale in (1.0, 10.0):
        out, state = update(jax.tree.map(lambda x: x * scale if norms.is_float(x) else x, tree),
                            state)
    assert out["w"].dtype == jnp.bfloat16 and out["s"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out["i"], tree["i"])
    assert out["none"] is None and isinstance(out["masked"], optax.MaskedNode)
    assert out["empty"].shape == (0, 2)
    if make in GROWTH_MAKERS:
        assert float(jnp.max(jnp.abs(out["w"].astype(jnp.float32)))) < 30.0   # growth limited
    else:
        assert state.ema["w"].dtype == jnp.float32 and state.ema["w"].shape == (3, 2)
    for leaf in jax.tree.leaves(state):
        assert leaf.dtype not in (jnp.bfloat16, jnp.float16)
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    assert tx.update({}, tx.init({}))[0] == {}


@stateful
def test_in_chain_with_adam_and_stats(make):
    tx = optax.chain(make(), optax.adam(1e-2))
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2) + jnp.sum((p["b"] - 1) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, optclip.stats(state)

    state = tx.init(params)
    for _ in range(3):
        params, state, logged = step(params, state)
    assert any(key.endswith("/nonfinite") for key in logged)
    assert any(key.endswith("/clipped") or key.endswith("/clipped_frac") for key in logged)
    assert all(np.isfinite(np.asarray(v, np.float64)) for v in logged.values())
