"""Tests for optclip/moment_clip.py: SPAM, AdamWClip and StableAdamW clipping against NumPy
oracles of adam + the paper's rule, step by step; wrappers (chain, inject_hyperparams, adamw,
nnx.Optimizer); errors."""

from __future__ import annotations

import functools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given

import optclip
from tests.helpers import nnx_pure

LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8
N_STEPS = 12
SPIKE_STEP = 8


def _grads(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for step in range(N_STEPS):
        g = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=(3,)) * 0.1}
        if step == SPIKE_STEP:
            g["w"][1, 2] *= 1e4         # one element spikes
            g["b"] = g["b"] * 100       # one tensor spikes
        out.append({k: np.asarray(v, np.float32) for k, v in g.items()})
    return out


PARAMS = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}


class _Adam:
    """optax.adam in float64 (m, v, t), one step per call; ``clip(g, m, v, t)`` runs first."""

    def __init__(self):
        self.m = {k: np.zeros(np.shape(v)) for k, v in PARAMS.items()}
        self.v = {k: np.zeros(np.shape(v)) for k, v in PARAMS.items()}
        self.t = 0

    def step(self, g):
        self.t += 1
        out = {}
        for k in g:
            self.m[k] = B1 * self.m[k] + (1 - B1) * g[k]
            self.v[k] = B2 * self.v[k] + (1 - B2) * g[k] ** 2
            m_hat = self.m[k] / (1 - B1 ** self.t)
            v_hat = self.v[k] / (1 - B2 ** self.t)
            out[k] = -LR * m_hat / (np.sqrt(v_hat) + EPS)
        return out


def spam_oracle(grads, theta=5000.0, clip_after=3, reset_interval=None):
    adam, outs, fractions = _Adam(), [], []
    for index, g in enumerate(grads):
        s = index + 1
        g = {k: np.asarray(v, np.float64) for k, v in g.items()}
        if reset_interval and s % reset_interval == 0:
            adam = _Adam()
        in_period = s % reset_interval if reset_interval else s
        hits = 0
        # Not on a reset step (against the zeroed moments), and never where v is 0 (no history).
        if s >= clip_after and in_period >= clip_after and in_period != 0:
            for k in g:
                mask = (g[k] ** 2 > theta * adam.v[k]) & (adam.v[k] > 0)
                g[k] = np.where(mask, np.sign(g[k]) * np.sqrt(theta * adam.v[k]), g[k])
                hits += mask.sum()
        fractions.append(hits / 15)
        outs.append(adam.step(g))
    return outs, fractions


def adamw_clip_oracle(grads, sigmas=3.0, min_threshold=1e-10, warmup=0):
    adam, outs = _Adam(), []
    for g in grads:
        g = {k: np.asarray(v, np.float64) for k, v in g.items()}
        t = adam.t + 1
        if adam.t > 0 and t > warmup:
            for k in g:
                c = np.maximum(sigmas * np.sqrt(adam.v[k] / (1 - B2 ** adam.t)),
                               min_threshold)
                # Where v is 0 (every gradient so far 0) there is no history: no clip.
                g[k] = np.where(adam.v[k] > 0, np.clip(g[k], -c, c), g[k])
        outs.append(adam.step(g))
    return outs


def stable_oracle(grads, eps=1e-6):
    adam, outs, scales = _Adam(), [], []
    for g in grads:
        g = {k: np.asarray(v, np.float64) for k, v in g.items()}
        out = adam.step(g)
        scale = {}
        for k in g:
            v_hat = adam.v[k] / (1 - B2 ** adam.t)
            rms = np.sqrt(np.mean(g[k] ** 2 / np.maximum(v_hat, eps ** 2)))
            scale[k] = 1 / max(1.0, rms)
            out[k] = out[k] * scale[k]
        outs.append(out)
        scales.append(scale)
    return outs, scales


CASES = {
    "spam": (lambda inner: optclip.spam_clip(inner, clip_after=3),
             lambda grads: spam_oracle(grads)[0]),
    "spam_reset": (lambda inner: optclip.spam_clip(inner, clip_after=3, reset_interval=5),
                   lambda grads: spam_oracle(grads, reset_interval=5)[0]),
    "adamw_clip": (lambda inner: optclip.adamw_clip(inner),
                   adamw_clip_oracle),
    "adamw_clip_warmup": (lambda inner: optclip.adamw_clip(inner, sigmas=1.5, warmup_steps=4),
                          lambda grads: adamw_clip_oracle(grads, 1.5, warmup=4)),
    "stable_adamw": (lambda inner: optclip.stable_adamw_clip(inner),
                     lambda grads: stable_oracle(grads)[0]),
}


@functools.cache
def _jitted(case):
    tx = CASES[case][0](optax.adam(LR))
    return tx, jax.jit(tx.update)


def _run(update, state, grads):
    outs = []
    for g in grads:
        out, state = update(jax.tree.map(jnp.asarray, g), state, PARAMS)
        outs.append(out)
    return outs, state


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_matches_the_numpy_oracle_step_by_step(case, jit):
    tx, jitted = _jitted(case)
    outs, _ = _run(jitted if jit else tx.update, tx.init(PARAMS), _grads())
    for step, (out, want) in enumerate(zip(outs, CASES[case][1](_grads()))):
        chex.assert_trees_all_close(out, jax.tree.map(np.float32, want), rtol=3e-5, atol=1e-7,
                                    custom_message=f"step {step}")


def test_the_spike_step_is_actually_clipped():
    _, fractions = spam_oracle(_grads())
    # The spiked element of "w" and the two of "b" that grew beyond sqrt(5000) RMS.
    assert fractions[SPIKE_STEP] == 3 / 15 and fractions[SPIKE_STEP - 1] == 0
    tx, update = _jitted("spam")
    state = tx.init(PARAMS)
    for g in _grads()[:SPIKE_STEP + 1]:
        _, state = update(jax.tree.map(jnp.asarray, g), state, PARAMS)
    np.testing.assert_allclose(float(state.clipped_fraction), fractions[SPIKE_STEP], rtol=1e-6)
    _, scales = stable_oracle(_grads())
    assert scales[SPIKE_STEP]["b"] < 0.5 and scales[SPIKE_STEP - 1]["b"] == 1.0


def _late_grads():
    """The test gradients with elements first seen late: row 0 of "w" is 0 for the first 5
    steps (an embedding row of a token not seen yet) and "b"[0] until the spike step."""
    grads = _grads(1)
    for step, g in enumerate(grads):
        if step < 5:
            g["w"][0] = 0.0
        if step < SPIKE_STEP:
            g["b"][0] = 0.0
    return grads


@pytest.mark.parametrize(("make", "oracle"), [
    (lambda: optclip.spam_clip(optax.adam(LR), clip_after=1),
     lambda grads: spam_oracle(grads, clip_after=1)[0]),
    (lambda: optclip.spam_clip(optax.adam(LR), clip_after=0, reset_interval=4),
     lambda grads: spam_oracle(grads, clip_after=0, reset_interval=4)[0]),
    (lambda: optclip.adamw_clip(optax.adam(LR)), adamw_clip_oracle),
], ids=["spam", "spam_reset", "adamw_clip"])
def test_an_element_first_seen_late_trains(make, oracle):
    """An element whose gradients were all 0 so far has ``nu = 0``: no history to be a spike
    against. It is not clipped (a threshold of ``sqrt(theta * 0)`` cut SPAM's to 0 forever,
    AdamWClip's ``min_threshold`` to 1e-10 for hundreds of steps)."""
    tx = make()
    outs, _ = _run(jax.jit(tx.update), tx.init(PARAMS), _late_grads())
    for step, (out, want) in enumerate(zip(outs, oracle(_late_grads()))):
        chex.assert_trees_all_close(out, jax.tree.map(np.float32, want), rtol=3e-5, atol=1e-7,
                                    custom_message=f"step {step}")
    # Its first nonzero gradients move it as far as adam moves a fresh element (about half of
    # lr here, with adam's bias correction at a later step); cut, it moved by 0 or 1e-10.
    assert np.all(np.abs(np.asarray(outs[5]["w"][0])) > LR / 4)
    assert abs(float(outs[SPIKE_STEP]["b"][0])) > LR / 4


def test_spam_reset_zeroes_moments_and_count():
    tx = optclip.spam_clip(optax.adam(LR), reset_interval=4)
    state = tx.init(PARAMS)
    for g in _grads()[:4]:
        _, state = tx.update(jax.tree.map(jnp.asarray, g), state, PARAMS)
    adam_state = state.inner[0]
    assert int(adam_state.count) == 1 and bool(state.reset) and int(state.resets) == 1
    # After the reset the adam holds exactly one step of the 4th gradient.
    np.testing.assert_allclose(np.asarray(adam_state.nu["w"]),
                               (1 - B2) * _grads()[3]["w"] ** 2, rtol=1e-6)


def test_spam_reset_count_saturates_instead_of_wrapping():
    """With ``reset_interval=1`` every step resets: the ``resets`` count stops at the int32
    maximum, as the other counters do, instead of wrapping to a negative number."""
    tx = optclip.spam_clip(optax.adam(LR), reset_interval=1)
    state = tx.init(PARAMS)._replace(resets=jnp.asarray(np.iinfo(np.int32).max - 1, jnp.int32))
    for g in _grads()[:2]:
        _, state = tx.update(jax.tree.map(jnp.asarray, g), state, PARAMS)
        assert bool(state.reset)
    assert int(state.resets) == np.iinfo(np.int32).max


@pytest.mark.parametrize("case", ["spam", "adamw_clip", "stable_adamw"])
def test_wrapping_adamw_chain_and_inject_hyperparams_gives_the_same_updates(case):
    make = CASES[case][0]
    plain = make(optax.adamw(LR, weight_decay=1e-2))
    wrapped = [
        make(optax.inject_hyperparams(optax.adamw)(learning_rate=LR, weight_decay=1e-2)),
        make(optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(1e-2),
                         optax.scale(-LR))),
    ]
    params = jax.tree.map(lambda x: x + 1.0, PARAMS)
    expected, _ = _run_with(plain, params)
    for tx in wrapped:
        got, state = _run_with(tx, params)
        chex.assert_trees_all_close(got, expected, rtol=2e-5, atol=1e-7)
        assert optclip.stats(state)


def _run_with(tx, params):
    state = tx.init(params)
    update = jax.jit(tx.update)
    outs = []
    for g in _grads():
        out, state = update(jax.tree.map(jnp.asarray, g), state, params)
        outs.append(out)
    return outs, state


def test_inside_a_chain_after_a_global_clip():
    tx = optax.chain(optclip.clip_by_global_norm(1e3), optclip.stable_adamw_clip(optax.adam(LR)))
    grads = [jax.tree.map(jnp.asarray, g) for g in _grads()]
    state = tx.init(PARAMS)
    for g in grads:
        _, state = tx.update(g, state, PARAMS)
    assert {"clip_by_global_norm/norm", "stable_adamw_clip/scale_mean"} <= set(
        optclip.stats(state))


def test_nnx_optimizer():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    reference = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optclip.stable_adamw_clip(optax.adamw(LR)), wrt=nnx.Param)
    tx = optclip.stable_adamw_clip(optax.adamw(LR))
    params = nnx_pure(nnx.state(reference, nnx.Param))
    state = tx.init(params)
    x = jnp.arange(12.0).reshape(4, 3)
    loss_fn = lambda m: jnp.mean(m(x) ** 2)  # noqa: E731
    for _ in range(3):
        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)
        pure_grads = nnx_pure(nnx.state(grads, nnx.Param))
        updates, state = tx.update(pure_grads, state, params)
        params = optax.apply_updates(params, updates)
    chex.assert_trees_all_close(nnx_pure(nnx.state(model, nnx.Param)), params, rtol=1e-6)
    assert "stable_adamw_clip/rms_max" in optclip.stats(nnx_pure(optimizer.opt_state))


@pytest.mark.parametrize("case", ["spam", "adamw_clip", "stable_adamw"])
def test_nonfinite_gradients_leave_the_adam_state_unchanged(case):
    tx, update = _jitted(case)
    state = tx.init(PARAMS)
    g = jax.tree.map(jnp.asarray, _grads()[0])
    _, state = update(g, state, PARAMS)
    out, after = update({**g, "b": g["b"].at[0].set(jnp.inf)}, state, PARAMS)
    chex.assert_trees_all_equal(after.inner, state.inner)
    assert int(after.nonfinite) == 1
    # Every update is NaN (optax.apply_if_finite drops the step), not only the bad element's.
    assert all(bool(jnp.isnan(x).all()) for x in jax.tree.leaves(out))


@pytest.mark.parametrize("shape", [(8, 4), (64, 128)], ids=["xla_loop", "xnnpack"])
@pytest.mark.parametrize("make", [
    lambda: optclip.spam_clip(optax.adam(1e-2), clip_after=1, reset_interval=2),
    lambda: optclip.adamw_clip(optax.adamw(1e-2), sigmas=1.0)], ids=["spam", "adamw_clip"])
def test_finite_gradients_that_overflow_the_adams_nu_are_not_a_nonfinite_step(make, shape):
    """An element of 3e38 makes the wrapped adam's ``nu`` infinite. The later steps are finite
    steps (counted, not held) on both of XLA:CPU's reduction paths, also SPAM's reset steps,
    which test against zero moments: ``inf * 0`` and ``inf - inf`` would be NaN, kept by XLA's
    own reduction of the (8, 4) leaf and dropped by XNNPACK's maximum on the (64, 128) one."""
    g = np.random.default_rng(4).normal(size=shape).astype(np.float32) * 1e-2
    g[1, 2] = 3e38
    tx = make()
    update = jax.jit(tx.update)
    params = {"w": jnp.zeros(shape)}
    state = tx.init(params)
    for _ in range(4):
        out, state = update({"w": jnp.asarray(g)}, state, params)
        assert np.all(np.isfinite(np.asarray(out["w"])))
    assert int(state.nonfinite) == 0


@pytest.mark.parametrize("factory", [optclip.spam_clip, optclip.adamw_clip,
                                     optclip.stable_adamw_clip])
def test_an_inner_without_adam_moments_is_a_clear_error(factory):
    with pytest.raises(ValueError, match="exactly one adam-style state"):
        factory(optax.sgd(0.1)).init(PARAMS)
    with pytest.raises(ValueError, match="found 2"):
        factory(optax.chain(optax.adam(0.1), optax.adam(0.1))).init(PARAMS)


@functools.cache
def _stable_updates():
    return (jax.jit(optclip.stable_adamw_clip(optax.adam(LR)).update),
            jax.jit(optax.adam(LR).update))


@given(st.lists(st.floats(1e-3, 1e3), min_size=2, max_size=8))
def test_stable_adamw_scales_adam_by_a_factor_bounded_by_the_rms_limit(scales):
    update, adam_update = _stable_updates()
    tx, adam = optclip.stable_adamw_clip(optax.adam(LR)), optax.adam(LR)
    state, adam_state = tx.init(PARAMS), adam.init(PARAMS)
    base = jax.tree.map(jnp.asarray, _grads()[0])
    for t, s in enumerate(scales, start=1):
        g = jax.tree.map(lambda x: x * s, base)
        out, state = update(g, state, PARAMS)
        plain, adam_state = adam_update(g, adam_state, PARAMS)
        scales, rms = optclip.per_leaf(state.scale, g), optclip.per_leaf(state.rms, g)
        for key in g:
            scale = float(scales[key])
            assert 0 < scale <= 1
            assert float(rms[key]) <= np.sqrt((1 - B2 ** t) / (1 - B2)) * (1 + 1e-5)
            np.testing.assert_allclose(np.asarray(out[key]), np.asarray(plain[key]) * scale,
                                       rtol=1e-5, atol=1e-9)
