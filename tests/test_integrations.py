"""optclip inside the tools JAX users already use.

flax.nnx.Optimizer, optax.inject_hyperparams, optax.MultiSteps, optax.masked / optax.partition,
optax.apply_if_finite and orbax checkpointing, each with the stateless transforms and with every
stateful transform this version of optclip has. A transform from a family that has not landed
yet is reported as skipped with its name, never dropped silently.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optclip

# name -> factory with small warm-ups / histories so that the adaptive ones act within a few
# steps. Names missing from optclip are skipped with a reason (their family has not landed).
FACTORIES = {
    "clip_by_global_norm": lambda: optclip.clip_by_global_norm(1.0),
    "clip_norm": lambda: optclip.clip_norm(0.5),
    "clip_norm_by_ema": lambda: optclip.clip_norm_by_ema(beta=0.9),
    "clip_norm_growth": lambda: optclip.clip_norm_growth(),
    "hist_clip": lambda: optclip.hist_clip(warmup_steps=3),
    "zclip": lambda: optclip.zclip(warmup_steps=3),
    "quantile_clip": lambda: optclip.quantile_clip(0.5, history_length=4),
}
# One or two per stateful family; the conformance suite runs every public transform through
# jit, chains and sharding, so these tests pick representatives to stay fast.
STATEFUL = ["clip_norm_by_ema", "clip_norm_growth", "hist_clip", "zclip", "quantile_clip"]


def transform_params(names):
    """``pytest.param`` per name; names optclip lacks are skipped with an explicit reason."""
    return [pytest.param(name, marks=() if hasattr(optclip, name) else pytest.mark.skip(
        reason=f"optclip.{name} is not in this branch yet (another family's issue); "
               "runs once it is merged")) for name in names]


NNX = transform_params(["clip_by_global_norm", "clip_norm", "clip_norm_by_ema", "zclip"])
WITH_STATE = transform_params(["clip_by_global_norm", *STATEFUL])


def tree_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def make(name):
    return FACTORIES[name]()


# A tiny regression problem whose gradients vary from step to step, with a spike at step 6.
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.zeros(3)}


def batch(t):
    rng = np.random.default_rng(t)
    x = rng.normal(size=(8, 4)).astype(np.float32) * (20.0 if t == 6 else 1.0)
    return jnp.asarray(x), jnp.asarray(rng.normal(size=(8, 3)).astype(np.float32))


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def grads_at(params, t):
    return jax.grad(loss_fn)(params, *batch(t))


@functools.cache  # one compilation per transformation object
def make_step(tx):
    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def run(tx, steps, params=PARAMS, state=None, start=0):
    step = make_step(tx)
    state = tx.init(params) if state is None else state
    for t in range(start, start + steps):
        params, state = step(params, state, grads_at(params, t))
    return params, state


# ---------------------------------------------------------------------------------------------
# flax.nnx.Optimizer

@pytest.mark.parametrize("name", NNX)
def test_nnx_optimizer(name):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(4, 8, rngs=rngs)
            self.out = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(make(name), optax.adam(1e-2)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss, optclip.stats(optimizer.opt_state)

    # The same chain run by hand on the split parameters must give the same parameters.
    graphdef, params = nnx.split(nnx.clone(model), nnx.Param)
    params = jax.tree.map(jnp.array, params)
    tx = optax.chain(make(name), optax.adam(1e-2))
    state = jax.jit(tx.init)(params)

    @jax.jit
    def reference_step(params, state, x, y):
        grads = jax.grad(lambda p: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for t in range(6):
        x, y = batch(t)
        loss, step_stats = train_step(model, optimizer, x, y)
        params, state = reference_step(params, state, x, y)
        assert np.isfinite(float(loss))
    chex.assert_trees_all_close(nnx.state(model, nnx.Param), params, rtol=1e-5, atol=1e-6)
    # optclip.stats reads the nnx optimizer's state exactly as the raw optax state.
    expected = optclip.stats(state)
    assert set(step_stats) == set(expected)
    for key in expected:
        np.testing.assert_allclose(np.asarray(step_stats[key], np.float64),
                                   np.asarray(expected[key], np.float64), rtol=1e-5, atol=1e-6)
    assert expected, f"optclip.stats found nothing for {name}"


def test_stats_of_nnx_optimizer_and_nnx_state():
    """``stats(optimizer)`` reads ``optimizer.opt_state``; ``nnx.state(optimizer)`` has lost the
    optax state types, so ``stats`` says what to pass instead of returning ``{}``."""
    from flax import nnx

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(optclip.clip_by_global_norm(1.0),
                                                 optax.adam(1e-2)), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2))) ** 2))(model)
    optimizer.update(model, grads)
    expected = optclip.stats(optimizer.opt_state)
    assert float(expected["clip_by_global_norm/norm"]) > 0
    got = nnx.jit(optclip.stats)(optimizer)
    assert set(got) == set(expected)
    for key in expected:
        assert float(got[key]) == float(expected[key]), key
    with pytest.raises(TypeError, match=r"optimizer\.opt_state"):
        optclip.stats(nnx.state(optimizer))


# ---------------------------------------------------------------------------------------------
# optax.inject_hyperparams

# factory, scheduled hyperparameter, static arguments, how to read the bound that was applied.
# inject_hyperparams turns every int/float argument (defaults included) into an array; the
# structural ones (``ord``, ``min_size``) must be named in ``static_args``.
THRESHOLDS = {
    "clip_by_global_norm": (lambda: optclip.clip_by_global_norm, "max_norm", ("ord",),
                            tree_norm),
    "clip_norm": (lambda: optclip.clip_norm, "max_norm", ("ord", "min_size"),
                  lambda out: jnp.linalg.norm(out["w"])),
    "clip_value": (lambda: optclip.clip_value, "value", (),
                   lambda out: jnp.max(jnp.abs(out["w"]))),
    "normalize": (lambda: optclip.normalize, "norm_value", ("ord", "min_size"),
                  lambda out: jnp.linalg.norm(out["w"])),
}


@pytest.mark.parametrize("name", transform_params(THRESHOLDS))
def test_inject_hyperparams_schedules_threshold(name):
    factory, hyper, static, applied = THRESHOLDS[name]
    schedule = optax.linear_schedule(2.0, 0.5, transition_steps=4)
    injected = optax.inject_hyperparams(factory(), static_args=static)(**{hyper: schedule})
    native = factory()(schedule)  # optclip thresholds also take a schedule directly
    grads = {"w": jnp.full((4, 3), 10.0), "b": jnp.full(3, 10.0)}
    state_i, state_n = injected.init(PARAMS), native.init(PARAMS)
    update_i, update_n = jax.jit(injected.update), jax.jit(native.update)
    for t in range(6):
        out_i, state_i = update_i(grads, state_i)
        out_n, state_n = update_n(grads, state_n)
        np.testing.assert_allclose(float(applied(out_i)), float(schedule(t)), rtol=1e-5)
        chex.assert_trees_all_close(out_i, out_n, rtol=1e-6)
        np.testing.assert_allclose(float(state_i.hyperparams[hyper]), float(schedule(t)))
    # stats sees through the InjectHyperparamsState wrapper.
    assert optclip.stats(state_i).keys() == optclip.stats(state_n).keys()


def test_inject_hyperparams_changed_by_hand():
    tx = optax.inject_hyperparams(optclip.clip_by_global_norm, static_args="ord")(max_norm=1.0)
    grads = {"w": jnp.full((4, 3), 10.0)}
    state = tx.init(grads)
    state.hyperparams["max_norm"] = jnp.asarray(0.25)
    out, _ = jax.jit(tx.update)(grads, state)
    np.testing.assert_allclose(float(tree_norm(out)), 0.25, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# optax.MultiSteps: the clipper sees the accumulated (mean) gradient once per k micro-steps.

@pytest.mark.parametrize("name", WITH_STATE)
def test_multisteps_clips_accumulated_gradient(name):
    k = 3
    inner = optax.chain(make(name), optax.sgd(0.1))
    multi = optax.MultiSteps(inner, every_k_schedule=k)
    # Reference: accumulate by hand, then one inner step on the mean.
    params_m, state_m = PARAMS, multi.init(PARAMS)
    params_r, state_r = PARAMS, inner.init(PARAMS)
    multi_update, inner_update = jax.jit(multi.update), jax.jit(inner.update)
    for macro in range(4):
        micro = [grads_at(params_r, 10 * macro + i) for i in range(k)]
        for i, g in enumerate(micro):
            updates, state_m = multi_update(g, state_m, params_m)
            params_m = optax.apply_updates(params_m, updates)
            if i < k - 1:  # nothing moves between the boundaries
                chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
        mean = jax.tree.map(lambda *gs: sum(gs) / k, *micro)
        updates, state_r = inner_update(mean, state_r, params_r)
        params_r = optax.apply_updates(params_r, updates)
        chex.assert_trees_all_close(params_m, params_r, rtol=1e-5, atol=1e-6)
    # The inner state advanced once per macro step, and stats reads it through MultiSteps.
    expected = optclip.stats(state_r)
    got = optclip.stats(state_m)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(np.asarray(got[key], np.float64),
                                   np.asarray(expected[key], np.float64), rtol=1e-5, atol=1e-6)


def test_multisteps_norm_is_that_of_the_mean():
    k = 2
    multi = optax.MultiSteps(optclip.clip_by_global_norm(100.0), every_k_schedule=k)
    g1 = {"w": jnp.array([3.0, 0.0])}
    g2 = {"w": jnp.array([-3.0, 8.0])}
    state = multi.init(g1)
    _, state = multi.update(g1, state)
    _, state = multi.update(g2, state)
    # mean = [0, 4]: norm 4, not the norms 3 or 8.544 of the micro-batches.
    assert float(optclip.stats(state)["clip_by_global_norm/norm"]) == 4.0


# ---------------------------------------------------------------------------------------------
# optax.masked / optax.partition

@pytest.mark.parametrize("name", WITH_STATE)
def test_masked_leaves_untouched(name):
    mask = {"w": True, "b": False}
    tx = optax.masked(make(name), mask)
    alone = make(name)
    grads = [grads_at(PARAMS, t) for t in range(8)]
    state, state_w = tx.init(PARAMS), alone.init({"w": PARAMS["w"]})
    update, update_w = jax.jit(tx.update), jax.jit(alone.update)
    for g in grads:
        out, state = update(g, state, PARAMS)
        out_w, state_w = update_w({"w": g["w"]}, state_w, {"w": PARAMS["w"]})
        chex.assert_trees_all_equal(out["b"], g["b"])  # masked out: untouched
        chex.assert_trees_all_close(out["w"], out_w["w"], rtol=1e-6)
    assert optclip.stats(state).keys() == optclip.stats(state_w).keys()


@pytest.mark.parametrize("name", WITH_STATE)
def test_partition(name):
    labels = {"w": "clipped", "b": "plain"}
    tx = optax.partition({"clipped": optax.chain(make(name), optax.adam(1e-2)),
                          "plain": optax.sgd(1e-2)}, labels)
    params, state = run(tx, 8)
    # Run the clipped half alone on the same gradient sequence.
    sub = optax.chain(make(name), optax.adam(1e-2))
    sub_state = sub.init({"w": PARAMS["w"]})
    p = PARAMS
    for t in range(8):
        g = grads_at(p, t)
        u, sub_state = sub.update({"w": g["w"]}, sub_state, {"w": p["w"]})
        p = {"w": p["w"] + u["w"], "b": p["b"] - 1e-2 * g["b"]}
    chex.assert_trees_all_close(params, p, rtol=1e-5, atol=1e-6)
    assert optclip.stats(state).keys() == optclip.stats(sub_state).keys()


# ---------------------------------------------------------------------------------------------
# optax.apply_if_finite around a chain with stateful optclip transforms

@pytest.mark.parametrize("name", WITH_STATE)
def test_apply_if_finite_skips_nan_step(name):
    tx = optax.apply_if_finite(optax.chain(make(name), optax.adam(1e-2)),
                               max_consecutive_errors=5)
    step = make_step(tx)
    nan_at = 4
    clean_params, clean_state = PARAMS, tx.init(PARAMS)
    params, state = PARAMS, tx.init(PARAMS)
    for t in range(10):
        g = grads_at(params, t)
        if t == nan_at:
            bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), g)
            new_params, new_state = step(params, state, bad)
            chex.assert_trees_all_equal(new_params, params)  # update skipped
            chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
            assert int(new_state.notfinite_count) == 1
            assert int(new_state.total_notfinite) == 1
            params, state = new_params, new_state
        params, state = step(params, state, grads_at(params, t))
        clean_params, clean_state = step(clean_params, clean_state,
                                         grads_at(clean_params, t))
    # The NaN step left no trace: same parameters and optimizer state as the clean run.
    chex.assert_trees_all_close(params, clean_params, rtol=1e-6)
    chex.assert_trees_all_close(state.inner_state, clean_state.inner_state, rtol=1e-6)
    assert optclip.stats(state).keys() == optclip.stats(clean_state).keys()


# ---------------------------------------------------------------------------------------------
# orbax: save mid-training, restore in a fresh process state, continue identically

@pytest.mark.parametrize("name", WITH_STATE)
def test_orbax_checkpoint_round_trip(name, tmp_path):
    import orbax.checkpoint as ocp

    tx = optax.chain(make(name), optax.adam(1e-2))
    full_params, full_state = run(tx, 12)
    params, state = run(tx, 7)

    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"params": params, "opt_state": state})
    target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                           target))
    restored_state = jax.tree.unflatten(jax.tree.structure(target["opt_state"]),
                                        jax.tree.leaves(restored["opt_state"]))
    chex.assert_trees_all_equal(restored_state, state)
    params, state = run(tx, 5, restored["params"], restored_state, start=7)
    chex.assert_trees_all_equal(params, full_params)
    chex.assert_trees_all_equal(state, full_state)
