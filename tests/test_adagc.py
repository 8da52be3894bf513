"""Tests for optclip/adagc.py: a NumPy oracle of AdaGC (arXiv 2502.11034) step by step, in a
chain with adam, properties, non-finite steps and schedules."""

from __future__ import annotations

import functools

import chex
import flax.serialization
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given

import optclip

WARMUP = 3


def _grads(seed=0, n=10):
    """Per-tensor scales that differ by 100x, a spike in "w" at step 6, a global one at 8."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(n):
        g = {"w": rng.normal(size=(4, 3)) * 0.1, "b": rng.normal(size=(3,)) * 10.0,
             "s": np.float64(rng.normal())}
        if step == 6:
            g["w"] = g["w"] * 20
        if step == 8:
            g = {k: v * 20 for k, v in g.items()}
        out.append({k: np.asarray(v, np.float32) for k, v in g.items()})
    return out


def _oracle(grads, lambda_abs=1.0, lambda_rel=1.05, beta=0.98, warmup=WARMUP, eps=1e-8):
    """AdaGC in float64, one dict of arrays per step: the paper's rule, except that a tensor
    whose gradient is exactly 0 keeps its gamma, and one without history (gamma 0) is clipped
    by the warm-up's rule at any step."""
    gamma = {k: 0.0 for k in grads[0]}
    outs = []
    for t, g in enumerate(grads):
        g = {k: np.asarray(v, np.float64) for k, v in g.items()}
        leaf = {k: np.sqrt(np.sum(v ** 2)) for k, v in g.items()}
        h_abs = min(1.0, lambda_abs / (np.sqrt(sum(n ** 2 for n in leaf.values())) + eps))
        out = {}
        for k, v in g.items():
            if t < warmup or gamma[k] == 0:
                h = h_abs
                new = h * leaf[k] if gamma[k] == 0 else min(gamma[k], h * leaf[k])
            else:
                h = min(1.0, lambda_rel * gamma[k] / (leaf[k] + eps))
                new = beta * gamma[k] + (1 - beta) * h * leaf[k]
            out[k] = h * v
            gamma[k] = new if leaf[k] > 0 else gamma[k]
        outs.append(out)
    return outs, gamma


@functools.cache
def _jitted():
    tx = optclip.adagc(warmup_steps=WARMUP)
    return tx, jax.jit(tx.update)


def _replay_against_the_oracle(tx, update, grads):
    """Runs ``grads`` through ``update`` step by step, each output and the final gamma held to
    the oracle's; returns the last output and state."""
    expected, gamma = _oracle(grads)
    state = tx.init(jax.tree.map(jnp.asarray, grads[0]))
    for g, want in zip(grads, expected):
        out, state = update(jax.tree.map(jnp.asarray, g), state)
        chex.assert_trees_all_close(out, jax.tree.map(np.float32, want), rtol=2e-6, atol=1e-7)
    chex.assert_trees_all_close(optclip.per_leaf(state.gamma, gamma),
                                jax.tree.map(np.float32, gamma), rtol=2e-6)
    return out, state


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_matches_the_numpy_oracle_step_by_step(jit):
    tx, jitted = _jitted()
    grads = _grads()
    _, state = _replay_against_the_oracle(tx, jitted if jit else tx.update, grads)
    # The spike in "w" (step 6) was clipped on its own; "b", 100x larger, was left alone.
    assert int(state.count) == len(grads)


def test_spike_in_one_tensor_is_clipped_while_the_larger_one_passes():
    grads = [{"w": np.full((4, 3), 0.1 * (20.0 if t == 6 else 1.0), np.float32),
              "b": np.array([10.0, 0.0, 0.0], np.float32)} for t in range(8)]
    tx = optclip.adagc(lambda_abs=100.0, warmup_steps=WARMUP)
    state = tx.init(jax.tree.map(jnp.asarray, grads[0]))
    for g in grads[:7]:
        out, state = tx.update(jax.tree.map(jnp.asarray, g), state)
    w_in = np.linalg.norm(grads[6]["w"])
    # The spiked "w" is still smaller than "b"'s ordinary norm: any global threshold that lets
    # "b" through lets this spike through too.
    assert w_in < np.linalg.norm(grads[6]["b"])
    np.testing.assert_allclose(np.linalg.norm(out["w"]), 1.05 * np.linalg.norm(grads[0]["w"]),
                               rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out["b"]), grads[6]["b"])
    clipped = optclip.per_leaf(state.clipped, g)
    assert bool(clipped["w"]) and not bool(clipped["b"])


def _zero_at(grads, key, steps):
    return [{**g, key: np.zeros_like(g[key])} if t in steps else g for t, g in enumerate(grads)]


@pytest.mark.parametrize("steps", [{0}, {0, 1, 2, 3, 4}, {4, 5, 6}],
                         ids=["first-step", "whole-warm-up", "left-out-after-warm-up"])
def test_a_tensor_with_zero_gradients_trains_on_afterwards(steps):
    """A zero gradient (a zero-initialised branch at the first step, a tensor left out of some
    steps) leaves the tensor's gamma as it was: the paper's warm-up minimum made it 0, and every
    later update of that tensor 0; after the warm-up its EMA decayed towards 0."""
    out, _ = _replay_against_the_oracle(*_jitted(), _zero_at(_grads(n=12), "w", steps))
    # After the zeros, "w" moves about as far as in a run without them, not 0 or a sliver.
    clean, _ = _oracle(_grads(n=12))
    assert np.linalg.norm(out["w"]) > 0.5 * np.linalg.norm(clean[-1]["w"])


def test_in_a_chain_with_adam_matches_adam_on_the_oracle_gradients():
    grads = _grads()
    expected, _ = _oracle(grads)
    params = jax.tree.map(jnp.zeros_like, jax.tree.map(jnp.asarray, grads[0]))
    tx = optax.chain(optclip.adagc(warmup_steps=WARMUP), optax.adam(1e-2))
    adam = optax.adam(1e-2)
    state, adam_state = tx.init(params), adam.init(params)
    update = jax.jit(tx.update)
    for g, clipped in zip(grads, expected):
        out, state = update(jax.tree.map(jnp.asarray, g), state, params)
        want, adam_state = adam.update(jax.tree.map(jnp.float32, clipped), adam_state, params)
        chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-7)
    logged = optclip.stats(state)
    assert {"adagc/gamma_max", "adagc/scale_mean", "adagc/clipped_frac", "adagc/count"} <= set(
        logged)


@given(st.lists(st.floats(1e-3, 1e3), min_size=WARMUP + 2, max_size=10),
       st.floats(0.5, 2.0))
def test_outputs_respect_the_thresholds(scales, lambda_abs):
    tx = optclip.adagc(lambda_abs=lambda_abs, warmup_steps=WARMUP)
    base = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[0.5, -0.5]])}
    state = tx.init(base)
    update = _property_update(lambda_abs)
    for t, s in enumerate(scales):
        g = {"a": base["a"] * s, "b": base["b"] * (2.0 / s)}
        previous = optclip.per_leaf(state.gamma, base)
        out, state = update(g, state)
        if t < WARMUP:
            assert float(optax.tree.norm(out)) <= lambda_abs * (1 + 1e-5)
        else:
            for key in g:
                assert float(jnp.linalg.norm(out[key])) <= 1.05 * float(previous[key]) * (
                    1 + 1e-5) + 1e-7


@functools.cache
def _property_update(lambda_abs):
    return jax.jit(optclip.adagc(lambda_abs=lambda_abs, warmup_steps=WARMUP).update)


def test_schedules_integer_leaves_and_float64():
    tx = optclip.adagc(lambda_abs=optax.constant_schedule(0.5),
                       lambda_rel=lambda count: 1.0 + 0.0 * count, warmup_steps=1)
    tree = {"w": jnp.array([3.0, 4.0]), "i": jnp.arange(2)}
    state = tx.init(tree)
    out, state = tx.update(tree, state)
    np.testing.assert_allclose(np.asarray(out["w"]), [0.3, 0.4], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out["i"]), [0, 1])
    out, _ = tx.update({"w": jnp.array([30.0, 40.0]), "i": jnp.arange(2)}, state)
    np.testing.assert_allclose(np.asarray(out["w"]), [0.3, 0.4], rtol=1e-6)
    with jax.enable_x64(True):
        tree = {"w": jnp.array([3.0, 4.0], jnp.float64)}
        state = tx.init(tree)
        out, state = tx.update(tree, state)
        assert out["w"].dtype == jnp.float64 and state.gamma.dtype == jnp.float64


def test_inject_hyperparams_and_checkpoint_round_trip():
    tx = optax.inject_hyperparams(optclip.adagc, static_args=("warmup_steps",))(
        lambda_abs=1.0, lambda_rel=1.05, beta=0.98, warmup_steps=WARMUP)
    plain = optclip.adagc(warmup_steps=WARMUP)
    grads = [jax.tree.map(jnp.asarray, g) for g in _grads()]
    state, plain_state = tx.init(grads[0]), plain.init(grads[0])
    for step, g in enumerate(grads):
        if step == 5:  # restore from bytes mid-run
            state = flax.serialization.from_bytes(state, flax.serialization.to_bytes(state))
        out, state = tx.update(g, state)
        want, plain_state = plain.update(g, plain_state)
        chex.assert_trees_all_close(out, want, rtol=1e-6)
    assert optclip.stats(state)["adagc/count"] == len(grads)
