"""Every public transform, through the same checks (the registry lives in tests/registry/)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import optclip
from tests.registry import ALL_ENTRIES, Entry

# Public names that are not transform factories (functions of trees, clip functions, criteria).
NOT_TRANSFORMS = {
    "stats", "clip_grad_norm", "clip_grad_value", "normalize_grads",
    "max_clipping", "mean_clipping", "reciprocal_clipping", "ema_criterion", "zscore_criterion",
    "flax_unit_axes",
}
STEPS = 3

entries = pytest.mark.parametrize("entry", ALL_ENTRIES, ids=str)


def test_registry_covers_every_public_transform():
    registered = {e.name for e in ALL_ENTRIES}
    public = set(optclip.__all__) - NOT_TRANSFORMS
    assert public - registered == set(), "add a tests/registry entry for each public transform"
    assert registered - public == set()


@functools.cache
def _compiled(name: str):
    """One transform and one jitted update per entry, shared by the checks below."""
    entry = next(e for e in ALL_ENTRIES if e.name == name)
    tx = entry.make()
    return tx, jax.jit(tx.update)


def _grads(entry: Entry, dtype=jnp.float32):
    return [entry.tree(dtype, seed) for seed in range(10, 10 + STEPS)]


def _params(entry: Entry, dtype=jnp.float32):
    return entry.tree(dtype, 1)


def _run(update, state, grads, params):
    outs = []
    for g in grads:
        out, state = update(g, state, params)
        outs.append(out)
    return outs, state


def _float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]


@entries
def test_jit_matches_eager(entry):
    tx, update = _compiled(entry.name)
    params = _params(entry)
    jit_out, jit_state = _run(update, tx.init(params), _grads(entry), params)
    eager_out, eager_state = _run(tx.update, tx.init(params), _grads(entry), params)
    chex.assert_trees_all_close(jit_out, eager_out, rtol=entry.rtol, atol=1e-6)
    chex.assert_trees_all_close(jit_state, eager_state, rtol=entry.rtol, atol=1e-6)


@entries
def test_chain_with_adam_in_a_jitted_train_step(entry):
    tx = optax.chain(entry.make(), optax.adam(1e-2))
    params = _params(entry)
    target = jax.tree.map(lambda p: p * 0.5, params)

    @jax.jit
    def train_step(params, state):
        loss, grads = jax.value_and_grad(
            lambda p: sum(jnp.sum((a - b) ** 2) for a, b in
                          zip(jax.tree.leaves(p), jax.tree.leaves(target))))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, optclip.stats(state)

    state = tx.init(params)
    for _ in range(STEPS):
        new_params, state, loss, logged = train_step(params, state)
        assert np.isfinite(float(loss))
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(new_params))
        assert not all(np.array_equal(a, b) for a, b in
                       zip(jax.tree.leaves(new_params), jax.tree.leaves(params))), "no step taken"
        params = new_params
    assert bool(logged) == entry.has_stats


def _own_state(state):
    """The transform's own state: a wrapper's ``inner`` state belongs to the wrapped optax
    optimizer, which follows optax's rules (dtype, and the shardings ``jax.jit(init)`` gives)."""
    return state._replace(inner=None) if hasattr(state, "inner") else state


@entries
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_dtype_kept_and_statistics_wide(entry, dtype):
    tx = entry.make()
    params = _params(entry, dtype)
    outs, state = _run(jax.jit(tx.update), tx.init(params), _grads(entry, dtype), params)
    for out, g in zip(outs, _grads(entry, dtype)):
        chex.assert_trees_all_equal_dtypes(out, g)
        assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(out))
    # The wrapper's own statistics must be wide (optax.adam keeps its moments in the
    # parameters' dtype).
    for leaf in _float_leaves(_own_state(state)):
        assert jnp.asarray(leaf).dtype not in (jnp.bfloat16, jnp.float16), "narrow statistics"


@entries
def test_state_is_a_pytree_of_arrays_and_stats_are_scalars(entry):
    tx, update = _compiled(entry.name)
    params = _params(entry)
    _, state = _run(update, tx.init(params), _grads(entry), params)
    for leaf in jax.tree.leaves(state):
        assert isinstance(leaf, (jax.Array, np.ndarray)), type(leaf)
    logged = optclip.stats(state)
    assert bool(logged) == entry.has_stats
    for key, value in logged.items():
        assert jnp.shape(value) == (), key
        assert np.isfinite(np.asarray(value, np.float64)), key


@entries
def test_nonfinite_gradients_do_not_poison_state(entry):
    tx, update = _compiled(entry.name)
    params = _params(entry)
    grads = _grads(entry)
    _, state = _run(update, tx.init(params), grads[:2], params)
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads[2])
    bad = jax.tree.map(lambda g: g.at[(-1,) * g.ndim].set(jnp.inf) if g.ndim else g, bad)
    _, after = update(bad, state, params)
    for before_leaf, after_leaf in zip(_float_leaves(state), _float_leaves(after)):
        was_finite = np.isfinite(np.asarray(before_leaf, np.float64))
        assert np.all(np.isfinite(np.asarray(after_leaf, np.float64))[was_finite])


@entries
def test_bad_hyperparameters_rejected_at_construction(entry):
    assert entry.bad_args, "list at least one bad argument in the registry"
    factory = getattr(optclip, entry.name)
    for kwargs, name in entry.bad_args:
        with pytest.raises((ValueError, TypeError), match=name):
            factory(**kwargs)


# Layouts of the default tree {"w": (8, 4), "b": (4,)}: data/FSDP (w split by rows), tensor
# parallel (w split by columns, b too), and both at once on a 2-D mesh.
LAYOUTS = {
    "fsdp": ((8,), ("x",), {"w": PartitionSpec("x"), "b": PartitionSpec()}),
    "tp": ((2, 4), ("d", "m"), {"w": PartitionSpec(None, "m"), "b": PartitionSpec("m")}),
    "2d": ((2, 4), ("d", "m"), {"w": PartitionSpec("d", "m"), "b": PartitionSpec("m")}),
}


def _shard(tree, mesh, specs):
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), tree, specs)


def _specs(state):
    return [jax.typeof(x).sharding.spec for x in jax.tree.leaves(state)]


@entries
@pytest.mark.parametrize("layout, axis_type", [("fsdp", "explicit"), ("tp", "explicit"),
                                               ("2d", "explicit"), ("2d", "auto")])
def test_sharded_run_matches_unsharded(entry, layout, axis_type):
    """Under jit on sharded arrays: same numbers; outputs keep the gradients' shardings; the
    state that ``jax.jit(tx.init)`` returns has the shardings ``update`` returns (no second
    compilation; a ``lax.scan`` carry type-checks)."""
    if jax.device_count() < 8:
        pytest.fail("the sharding check needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    axis = jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto
    shape, names, specs = LAYOUTS[layout]
    mesh = jax.make_mesh(shape, names, axis_types=(axis,) * len(shape))
    tx, update = _compiled(entry.name)
    params = _params(entry)
    plain_out, plain_state = _run(update, tx.init(params), _grads(entry), params)
    with jax.set_mesh(mesh):
        sharded_params = _shard(params, mesh, specs)
        sharded_grads = [_shard(g, mesh, specs) for g in _grads(entry)]
        sharded_update = jax.jit(tx.update)
        init_state = jax.jit(tx.init)(sharded_params)
        sharded_out, sharded_state = _run(sharded_update, init_state, sharded_grads,
                                          sharded_params)
    chex.assert_trees_all_close(sharded_out, plain_out, rtol=entry.rtol, atol=1e-6)
    chex.assert_trees_all_close(sharded_state, plain_state, rtol=entry.rtol, atol=1e-6)
    for out, g in zip(jax.tree.leaves(sharded_out[-1]), jax.tree.leaves(sharded_grads[-1])):
        assert out.sharding.is_equivalent_to(g.sharding, g.ndim), (out.sharding, g.sharding)
    init_state, sharded_state = _own_state(init_state), _own_state(sharded_state)
    for before, after in zip(jax.tree.leaves(init_state), jax.tree.leaves(sharded_state)):
        assert before.sharding.is_equivalent_to(after.sharding, before.ndim), (
            before.sharding, after.sharding)
    assert _specs(init_state) == _specs(sharded_state)


@entries
def test_vmap_per_example_inside_scan_matches_the_loop(entry):
    """Convention 1: per-example use under ``jax.vmap``, steps under ``jax.lax.scan``."""
    tx, update = _compiled(entry.name)
    params = _params(entry)
    examples = [_grads(entry), [entry.tree(jnp.float32, seed) for seed in range(20, 20 + STEPS)]]
    expected = [_run(update, tx.init(params), grads, params)[0] for grads in examples]

    batch = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    stacked = batch([batch(grads) for grads in examples])            # (example, step, ...)
    steps_first = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), stacked)
    batched_params = batch([params, params])
    state = jax.vmap(tx.init)(batched_params)

    def body(state, grads):
        out, state = jax.vmap(tx.update)(grads, state, batched_params)
        return state, out

    _, outs = jax.jit(lambda s, g: jax.lax.scan(body, s, g))(state, steps_first)
    for example, loop_outs in enumerate(expected):
        for step, loop_out in enumerate(loop_outs):
            chex.assert_trees_all_close(jax.tree.map(lambda x: x[step, example], outs), loop_out,
                                        rtol=entry.rtol, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Convention 14: inside shard_map, transforms with ``axis_name`` give the global answer.

axis_entries = pytest.mark.parametrize(
    "entry", [e for e in ALL_ENTRIES if e.axis_make is not None], ids=str)


@entries
def test_axis_name_is_registered_exactly_where_the_factory_takes_it(entry):
    import inspect
    takes = "axis_name" in inspect.signature(getattr(optclip, entry.name)).parameters
    assert takes == (entry.axis_make is not None), "set Entry.axis_make for axis_name"


def _auto_mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def _shard_map_steps(tx, params, grads, specs):
    """``STEPS`` updates inside ``shard_map``; returns each step's outputs and the last stats
    (declared replicated, so JAX checks that every device holds the same values)."""
    def body(params, *steps):
        state = tx.init(params)
        outs = []
        for g in steps:
            out, state = tx.update(g, state, params)
            outs.append(out)
        return outs, optclip.stats(state)

    mapped = jax.shard_map(body, mesh=_auto_mesh(), in_specs=(specs,) * (1 + len(grads)),
                           out_specs=([specs] * len(grads), PartitionSpec()))
    return jax.jit(mapped)(params, *grads)


@axis_entries
def test_shard_map_with_axis_name_matches_the_unsharded_run(entry):
    """"w" split 8 ways along axis 0, "b" replicated (counted once): same outputs and stats."""
    grads = _grads(entry)
    specs = {"w": PartitionSpec("x"), "b": PartitionSpec()}
    params = _params(entry)
    outs, logged = _shard_map_steps(entry.axis_make("x"), params, grads, specs)
    plain = entry.axis_make(None)
    expected_outs, state = _run(jax.jit(plain.update), plain.init(params), grads, params)
    chex.assert_trees_all_close(outs, expected_outs, rtol=1e-5, atol=1e-6)
    expected = optclip.stats(state)
    assert logged.keys() == expected.keys()
    chex.assert_trees_all_close(logged, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entry", [e for e in ALL_ENTRIES if e.ones_norm is not None], ids=str)
def test_shard_map_ones_clipped_by_their_global_norm(entry):
    """``ones(8, 4)`` split 8 ways: the global norm is sqrt(32), not each shard's 2."""
    outs, logged = _shard_map_steps(entry.axis_make("x"), jnp.ones((8, 4)), [jnp.ones((8, 4))],
                                    PartitionSpec("x"))
    np.testing.assert_allclose(float(optax.tree.norm(outs[0])), entry.ones_norm, rtol=1e-5)
    norms = [v for k, v in logged.items() if k.endswith(("/norm", "/norm_max"))]
    assert norms, logged.keys()
    np.testing.assert_allclose(np.asarray(norms, np.float64), np.sqrt(32.0), rtol=1e-6)
