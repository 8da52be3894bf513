"""Tests for optclip/skip_spikes.py: the inner state is bitwise untouched on a skipped step, the
detectors against a NumPy oracle, the loss rule, non-finite steps, the cap, wrappers."""

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
from tests import hlo
from tests.helpers import nnx_pure

LR = 1e-2
SPIKE_STEP = 7          # 0-based index of the corrupted batch
N_STEPS = 10


def _grads(seed=0, spike=1000.0, n=N_STEPS):
    rng = np.random.default_rng(seed)
    out = []
    for step in range(n):
        g = {"w": rng.normal(size=(4, 3)).astype(np.float32),
             "b": rng.normal(size=(3,)).astype(np.float32)}
        if step == SPIKE_STEP:
            g = {k: v * spike for k, v in g.items()}
        out.append(jax.tree.map(jnp.asarray, g))
    return out


PARAMS = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}


@functools.cache
def _jitted(detector):
    tx = optclip.skip_spikes(optax.adam(LR), detector, warmup_steps=4, window=5)
    return tx, jax.jit(tx.update)


def _run(update, state, grads, **kwargs):
    outs, states = [], [state]
    for g in grads:
        out, state = update(g, state, PARAMS, **kwargs)
        outs.append(out)
        states.append(state)
    return outs, states


def _bitwise_equal(a, b):
    chex.assert_trees_all_equal_structs(a, b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("detector", ["zscore", "mad"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_spike_leaves_adam_state_bitwise_and_next_step_is_the_clean_run(detector, jit):
    tx, jitted = _jitted(detector)
    update = jitted if jit else tx.update
    grads = _grads()
    outs, states = _run(update, tx.init(PARAMS), grads)
    skipped = [bool(s.skipped) for s in states[1:]]
    assert skipped == [i == SPIKE_STEP for i in range(N_STEPS)]
    # The flagged step: zero updates, adam's mu, nu and count bitwise as before.
    _bitwise_equal(outs[SPIKE_STEP], jax.tree.map(jnp.zeros_like, grads[SPIKE_STEP]))
    before, after = states[SPIKE_STEP].inner, states[SPIKE_STEP + 1].inner
    _bitwise_equal(after, before)
    adam_state = after[0]
    assert int(adam_state.count) == SPIKE_STEP
    # Every later step equals plain adam on the sequence without the corrupted batch.
    adam = optax.adam(LR)
    clean = grads[:SPIKE_STEP] + grads[SPIKE_STEP + 1:]
    adam_update = jax.jit(adam.update) if jit else adam.update
    clean_outs, clean_states = _run(adam_update, adam.init(PARAMS), clean)
    for step in range(SPIKE_STEP + 1, N_STEPS):
        _bitwise_equal(outs[step], clean_outs[step - 1])
        _bitwise_equal(states[step + 1].inner, clean_states[step])
    for step in range(SPIKE_STEP):
        _bitwise_equal(outs[step], clean_outs[step])


# ---------------------------------------------------------------------------------------------
# NumPy oracle of the detectors (float64), written from the documented rules.

def _oracle(norms, detector, warmup, threshold=6.0, alpha=0.98, window=5, eps=1e-8,
            max_consecutive=5):
    mean = var = 0.0
    history: list[float] = []
    accepted = consecutive = 0
    scores, skips = [], []
    for n in norms:
        ready = accepted >= warmup
        if detector == "zscore":
            score = (n - mean) / (np.sqrt(var) + eps) if ready else 0.0
        else:
            recent = np.array(history[-window:])
            med = np.median(recent) if ready else 0.0
            mad = np.median(np.abs(recent - med)) if ready else 0.0
            score = (n - med) / (1.4826 * mad + eps) if ready else 0.0
        flagged = ready and score > threshold
        skip = flagged and consecutive < max_consecutive
        if not skip:
            weight = max(1.0 / (accepted + 1), 1 - alpha)
            delta = n - mean
            mean += weight * delta
            var = (1 - weight) * (var + weight * delta ** 2)
            history.append(n)
            accepted += 1
        consecutive = consecutive + 1 if skip else 0
        scores.append(score)
        skips.append(skip)
    return np.array(scores), skips


# A slow drift, two spikes (one of them a run of three) and a return to normal.
NORM_SEQUENCE = [1.0, 1.2, 0.9, 1.1, 1.0, 1.05, 30.0, 1.0, 0.95, 40.0, 45.0, 50.0, 1.1, 1.0,
                 1.3, 1.2]


@pytest.mark.parametrize("detector", ["zscore", "mad"])
def test_scores_and_decisions_match_the_numpy_oracle(detector):
    tx = optclip.skip_spikes(optax.sgd(1.0), detector, warmup_steps=4, window=5,
                             max_consecutive=2)
    update = jax.jit(tx.update)
    state = tx.init({"g": jnp.zeros(2)})
    scores, skips = [], []
    for n in NORM_SEQUENCE:
        _, state = update({"g": jnp.array([0.6, 0.8], jnp.float32) * n}, state)
        scores.append(float(state.score))
        skips.append(bool(state.skipped))
    expected_scores, expected_skips = _oracle(NORM_SEQUENCE, detector, 4, max_consecutive=2)
    assert skips == expected_skips
    np.testing.assert_allclose(scores, expected_scores, rtol=2e-5, atol=1e-5)
    assert sum(expected_skips) >= 3 and int(state.forced) == 1   # the run of three hit the cap
    assert int(state.total_skipped) == sum(expected_skips)


def test_loss_spike_skips_a_step_with_ordinary_gradients():
    tx = optclip.skip_spikes(optax.adam(LR), warmup_steps=4, loss_threshold=5.0)
    grads = _grads(spike=1.0)
    losses = [2.0, 2.1, 1.9, 2.0, 1.95, 2.05, 1.9, 80.0, 1.9, 1.85]
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    for step, (g, loss) in enumerate(zip(grads, losses)):
        _, state = update(g, state, PARAMS, loss=jnp.float32(loss))
        assert bool(state.skipped) == (step == SPIKE_STEP)
        if step == SPIKE_STEP:
            assert float(state.loss_score) > 5.0 and float(state.score) > 5.0
    assert int(state.total_skipped) == 1
    assert set(optclip.stats(state)) == {
        f"skip_spikes/{key}" for key in ("skipped", "consecutive", "total_skipped", "score",
                                         "threshold", "norm", "loss_score", "forced",
                                         "nonfinite")}


def test_loss_threshold_takes_a_schedule_checked_at_its_first_step():
    """The loss rule's threshold as a schedule (the conformance rules run without a loss):
    constant, it gives the float's decisions; one that has risen past the spike's score by
    then skips nothing; one out of range at step 0 is an error naming it."""
    grads = _grads(spike=1.0)
    losses = [2.0, 2.1, 1.9, 2.0, 1.95, 2.05, 1.9, 80.0, 1.9, 1.85]

    def decisions(loss_threshold):
        tx = optclip.skip_spikes(optax.adam(LR), warmup_steps=4, loss_threshold=loss_threshold)
        state, update, skipped = tx.init(PARAMS), jax.jit(tx.update), []
        for g, loss in zip(grads, losses):
            _, state = update(g, state, PARAMS, loss=jnp.float32(loss))
            skipped.append(bool(state.skipped))
        return skipped

    assert decisions(optax.constant_schedule(5.0)) == decisions(5.0)
    assert decisions(5.0)[SPIKE_STEP]
    # A threshold that has grown past every score by the spike step skips nothing.
    assert not any(decisions(lambda count: 5.0 + 1e6 * count))
    with pytest.raises(ValueError, match=r"\bloss_threshold\b.* at step 0"):
        optclip.skip_spikes(optax.adam(LR), loss_threshold=lambda count: -1.0 + 0 * count)


@pytest.mark.parametrize("bad", ["grads", "loss"])
def test_nonfinite_steps_are_skipped_and_counted(bad):
    tx = optclip.skip_spikes(optax.adam(LR), warmup_steps=4)
    state = tx.init(PARAMS)
    g = _grads(spike=1.0)[0]
    loss = jnp.float32(1.0)
    _, state = tx.update(g, state, PARAMS, loss=loss)
    if bad == "grads":
        g = jax.tree.map(lambda x: x.at[0].set(jnp.nan), g)
    else:
        loss = jnp.float32(jnp.inf)
    out, after = tx.update(g, state, PARAMS, loss=loss)   # during warm-up: still skipped
    assert bool(after.skipped) and int(after.nonfinite) == 1
    _bitwise_equal(after.inner, state.inner)
    _bitwise_equal(out, jax.tree.map(jnp.zeros_like, g))
    _bitwise_equal((after.norm_stats, after.loss_stats), (state.norm_stats, state.loss_stats))


def test_nonfinite_steps_ignore_the_cap():
    tx = optclip.skip_spikes(optax.sgd(1.0), warmup_steps=2, max_consecutive=1)
    state = tx.init({"g": jnp.zeros(2)})
    for _ in range(4):
        _, state = tx.update({"g": jnp.array([jnp.nan, 1.0])}, state)
    assert int(state.total_skipped) == 4 and int(state.forced) == 0


def test_inner_with_injected_hyperparams_and_schedule_is_untouched():
    schedule = optax.linear_schedule(1e-2, 0.0, 100)
    tx = optclip.skip_spikes(
        optax.chain(optax.clip_by_global_norm(1.0),
                    optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)),
        warmup_steps=4)
    grads = _grads()
    _, states = _run(jax.jit(tx.update), tx.init(PARAMS), grads)
    _bitwise_equal(states[SPIKE_STEP + 1].inner, states[SPIKE_STEP].inner)
    injected = states[-1].inner[1]
    assert int(injected.count) == N_STEPS - 1    # the schedule's clock skipped the spike too


def test_inside_a_chain_with_loss_passed_through():
    tx = optax.chain(optclip.skip_spikes(optax.adam(LR), warmup_steps=4),
                     optax.scale(1.0))
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    for g in _grads():
        _, state = update(g, state, PARAMS, loss=jnp.float32(1.0))
    assert int(optclip.stats(state)["skip_spikes/total_skipped"]) == 1


def test_nnx_optimizer_passes_loss_through():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, optclip.skip_spikes(optax.adam(LR), warmup_steps=2, loss_threshold=3.0),
        wrt=nnx.Param)
    x = jnp.ones((4, 3))
    loss_fn = lambda m: jnp.mean(m(x) ** 2)  # noqa: E731
    for loss_value in [1.0, 1.1, 0.9, 1.0, 500.0]:
        grads = nnx.grad(loss_fn)(model)
        before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        optimizer.update(model, grads, loss=jnp.float32(loss_value))
    logged = optclip.stats(nnx_pure(optimizer.opt_state))
    assert bool(logged["skip_spikes/skipped"]) and int(logged["skip_spikes/total_skipped"]) == 1
    _bitwise_equal(nnx_pure(nnx.state(model, nnx.Param)), nnx_pure(before))


@given(st.lists(st.floats(0.1, 1e4), min_size=6, max_size=12))
def test_every_step_is_either_exactly_inner_or_zero(scales):
    tx, inner = optclip.skip_spikes(optax.adam(LR), warmup_steps=3), optax.adam(LR)
    state, inner_state = tx.init(PARAMS), inner.init(PARAMS)
    update, inner_update = _property_updates()
    for scale in scales:
        g = jax.tree.map(lambda x: x * scale, _grads(spike=1.0, n=1)[0])
        out, state = update(g, state, PARAMS)
        expected, candidate = inner_update(g, inner_state, PARAMS)
        if bool(state.skipped):
            _bitwise_equal(out, jax.tree.map(jnp.zeros_like, g))
        else:
            _bitwise_equal(out, expected)
            inner_state = candidate
        _bitwise_equal(state.inner, inner_state)


@functools.cache
def _property_updates():
    return (jax.jit(optclip.skip_spikes(optax.adam(LR), warmup_steps=3).update),
            jax.jit(optax.adam(LR).update))


def test_threshold_schedule_counts_the_accepted_steps():
    """The threshold's schedule reads the steps accepted so far: a skipped step (a spike or a
    NaN) does not advance it, as it does not advance the inner optimizer's count."""
    tx = optclip.skip_spikes(optax.adam(LR), threshold=lambda count: 20.0 + count,
                             warmup_steps=4)
    update = jax.jit(tx.update)
    grads = _grads(spike=1000.0)
    nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads[0])
    state = tx.init(PARAMS)
    for g in grads[:SPIKE_STEP]:
        _, state = update(g, state, PARAMS)
    assert not bool(state.skipped) and float(state.threshold) == 20.0 + SPIKE_STEP - 1
    for g in (grads[SPIKE_STEP], nan):
        _, state = update(g, state, PARAMS)
        assert bool(state.skipped) and float(state.threshold) == 20.0 + SPIKE_STEP
    _, state = update(grads[SPIKE_STEP + 1], state, PARAMS)
    assert not bool(state.skipped) and float(state.threshold) == 20.0 + SPIKE_STEP
    assert int(state.inner[0].count) == SPIKE_STEP + 1



def test_shard_map_loss_that_differs_between_devices_is_averaged():
    """With ``axis_name``, a per-device loss enters the statistics as its mean over the devices,
    so the state is the same everywhere (declared replicated, which JAX checks)."""
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = optclip.skip_spikes(optax.sgd(1.0), warmup_steps=2, axis_name="x")

    def body(g, loss):
        _, state = tx.update(g, tx.init(g), loss=loss[0])
        return state.loss_stats.mean, state.norm

    mean, norm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                                       out_specs=(P(), P())))(jnp.ones((8, 4)), jnp.arange(8.0))
    assert float(mean) == 3.5 and float(norm) == pytest.approx(32 ** 0.5)


def test_a_donated_step_writes_the_state_in_place():
    """With the gradients and the state donated, no buffer the size of a leaf is copied: the
    skipped branch hands its operands back and the updates are zeroed after the cond (a cond
    whose branch builds new zeros makes XLA copy the updates, or the moments, after it)."""
    tx = optclip.skip_spikes(optax.adam(LR), warmup_steps=2)
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
    text = hlo.compiled_step(tx, params).as_text()
    copies = [line for line in text.splitlines()
              if " copy(" in line and ("f32[64,32]" in line or "f32[32]" in line)]
    assert not copies, copies
