"""Every public transform, through the same checks (the table lives in tests/registry.py)."""

from __future__ import annotations

import functools
import inspect
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import optclip
from tests.registry import ALL_ENTRIES, PLACEMENT, WRAPPED, Entry, with_adam

# Public names that are not transform factories (functions of trees, clip functions, criteria).
NOT_TRANSFORMS = {
    "stats", "clip_grad_norm", "clip_grad_value", "normalize_grads",
    "max_clipping", "mean_clipping", "reciprocal_clipping", "ema_criterion", "zscore_criterion",
    "flax_unit_axes", "per_leaf",
}
STEPS = 3

entries = pytest.mark.parametrize("entry", ALL_ENTRIES, ids=str)


def test_registry_covers_every_public_transform():
    registered = {e.name for e in ALL_ENTRIES}
    public = set(optclip.__all__) - NOT_TRANSFORMS
    assert public - registered == set(), "add a tests/registry.py entry for each public transform"
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
    """Outside ``jax.jit`` the same outputs and states, the first step from the state as NumPy
    arrays (as a checkpoint read back without jax gives it), the later ones from the JAX arrays
    the first returns."""
    tx, update = _compiled(entry.name)
    params = _params(entry)
    jit_out, jit_state = _run(update, tx.init(params), _grads(entry), params)
    eager_out, eager_state = _run(tx.update, jax.device_get(tx.init(params)), _grads(entry),
                                  params)
    chex.assert_trees_all_close(jit_out, eager_out, rtol=entry.rtol, atol=1e-6)
    chex.assert_trees_all_close(jit_state, eager_state, rtol=entry.rtol, atol=1e-6)


@entries
def test_disable_jit_matches_jit(entry):
    """Under ``jax.disable_jit()`` with ``jax_debug_nans`` (how the docs say to hunt a NaN)
    every operation runs in Python, loop and branch bodies included (a ``fori_loop`` index is
    then a Python int): no NaN formed from finite gradients, and the same outputs and states
    as under ``jax.jit``."""
    tx, update = _compiled(entry.name)
    params = _params(entry)
    grads = _grads(entry)[:2]
    jit_out, jit_state = _run(update, tx.init(params), grads, params)
    with jax.disable_jit(), jax.debug_nans(True):
        out, state = _run(tx.update, tx.init(params), grads, params)
    chex.assert_trees_all_close(out, jit_out, rtol=entry.rtol, atol=1e-6)
    chex.assert_trees_all_close(state, jit_state, rtol=entry.rtol, atol=1e-6)


@entries
def test_finite_gradients_form_no_nan_that_jax_debug_nans_would_flag(entry):
    """``jax_debug_nans`` (JAX's way to find where a NaN first appears) checks every operation
    outside ``jax.jit``: finite gradients never make a transform form a NaN there, not even a
    value a select then discards (a 0/0 where a norm equals its running mean, ``inf - inf``
    from an empty history), which would point the search at the clipper. Steps: the entry's
    gradients, the last one twice more (a norm equal to its running mean), and zeros."""
    tx = entry.make()
    params = _params(entry)
    grads = _grads(entry)
    steps = [*grads, grads[-1], grads[-1], jax.tree.map(jnp.zeros_like, grads[0])]
    with jax.debug_nans(True):
        _run(tx.update, tx.init(params), steps, params)


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
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e5m2])
def test_low_precision_dtype_kept_and_statistics_wide(entry, dtype):
    tx = entry.make()
    params = _params(entry, dtype)
    outs, state = _run(jax.jit(tx.update), tx.init(params), _grads(entry, dtype), params)
    # A wrapper's output is its optimizer's: optax.adam keeps its moments in the parameters'
    # dtype, and in an 8-bit float its own first step already overflows.
    own_output = not (entry.name in WRAPPED and jnp.dtype(dtype).itemsize == 1)
    for out, g in zip(outs, _grads(entry, dtype)):
        chex.assert_trees_all_equal_dtypes(out, g)
        assert not own_output or all(np.all(np.isfinite(np.asarray(x, np.float32)))
                                     for x in jax.tree.leaves(out))
    # The wrapper's own statistics must be wide (optax.adam keeps its moments in the
    # parameters' dtype).
    for leaf in _float_leaves(_own_state(state)):
        assert jnp.asarray(leaf).dtype.itemsize >= 4, "narrow statistics"


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


def _stats_keys(tx, params) -> set[str]:
    """The keys ``optclip.stats`` gives for ``tx``'s state (traced: nothing is compiled)."""
    return set(jax.eval_shape(lambda p: optclip.stats(tx.init(p)), params))


@pytest.mark.parametrize("entry", [e for e in ALL_ENTRIES if e.has_stats], ids=str)
def test_stats_finds_the_transform_inside_wrappers(entry):
    """Convention 3: ``optclip.stats`` reports the transform wherever it sits: where its docs
    place it in a step, inside optax's wrappers and inside optclip's own (``skip_spikes``
    around the whole step, which adds its own keys)."""
    params = _params(entry)
    own = _stats_keys(entry.make(), params)
    step = with_adam(entry)[0]
    outer = len(_stats_keys(optclip.skip_spikes(optax.adam(1e-3)), params))
    for wrapped, added in ((step, 0), (optax.MultiSteps(step, 2), 0),
                           (optax.apply_if_finite(step, 2), 0),
                           (optclip.skip_spikes(step), outer)):
        keys = _stats_keys(wrapped, params)
        assert len(keys) == len(own) + added, sorted(keys)
        if not added:
            assert keys == own


# Transforms whose per-leaf values are per slice (the slices of a leaf, shaped like the leaf
# with the reduced axes removed), as the registry builds them: a leaf of one slice keeps a
# 0-d array in their trees. (clip_norm and normalize keep vectors where every leaf is one
# slice, as the registry's normalize: tests/test_clipping.py checks clip_norm's.)
PER_SLICE = {"clip_norm", "l1_normalize", "l2_normalize", "project_l2_ball"}
assert PER_SLICE <= {e.name for e in ALL_ENTRIES}


@pytest.mark.parametrize("entry", [e for e in ALL_ENTRIES if e.name not in PER_SLICE], ids=str)
def test_values_kept_per_leaf_are_vectors_not_trees_of_scalars(entry):
    """A value kept for every leaf (a norm, a statistic, a flag) is one vector over the
    floating leaves, so the state's number of arrays (each an output of the compiled step,
    which XLA's buffer assignment compares with every other) does not grow with the leaves;
    only per-element state (EMAs, previous updates, an optimizer's moments) and per-slice
    values mirror the parameters."""
    tx = entry.make()

    def scalars(copies):
        tree = {f"{k}{i}": v for i in range(copies) for k, v in _params(entry).items()}
        state = jax.eval_shape(tx.init, tree)
        return sum(1 for x in jax.tree.leaves(state) if x.ndim == 0)

    assert scalars(3) == scalars(1), (
        f"{entry.name}: {scalars(3) - scalars(1)} more 0-d state arrays for twice the leaves")


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
        with pytest.raises((ValueError, TypeError), match=_whole_word(name)):
            factory(**kwargs)


def _numeric_parameters(factory) -> list[str]:
    """The factory's parameters that take a number: those with a float default or annotated
    as a float (or schedule), and the required ones other than a wrapped optimizer."""
    return [name for name, p in inspect.signature(factory).parameters.items()
            if isinstance(p.default, float)
            or re.search(r"\bfloat\b|ScalarOrSchedule", str(p.annotation))
            or (p.default is inspect.Parameter.empty and name != "inner")]


def _valid_kwargs(factory) -> dict:
    """Arguments that build ``factory``'s transform with its defaults: the required ones, and
    the optional numbers that are off by default (None), which some constructions need one of
    (clamp's bounds), at 0.5; a wrapped optimizer is ``optax.adam``."""
    numeric = _numeric_parameters(factory)
    return {name: optax.adam(1e-2) if name == "inner" else 0.5
            for name, p in inspect.signature(factory).parameters.items()
            if p.default is inspect.Parameter.empty or (p.default is None and name in numeric)}


@entries
def test_an_extreme_hyperparameter_is_rejected_or_keeps_the_outputs_finite(entry):
    """Any numeric hyperparameter at ``±inf``, 0, a float32 subnormal (``1e-40``) or ``1e30``
    is either an error at construction naming the parameter, or keeps finite gradients' outputs
    finite, on all-zero and constant gradients too: an infinite bound is no bound (a clip
    threshold of ``inf`` clips nothing), but an infinite ``eps``, scale or target norm, or one
    that rounds to 0 in float32 and divides 0 by 0, is a silent wrong answer."""
    factory = _factory(entry)
    numeric = _numeric_parameters(factory)
    base = _valid_kwargs(factory)
    factory(**base)
    params, grads = _params(entry), _grads(entry)
    steps = [jax.tree.map(jnp.zeros_like, grads[0]),
             jax.tree.map(lambda g: jnp.full_like(g, 0.25), grads[0]), *grads]
    for name in numeric:
        for value in (math.inf, -math.inf, 0.0, 1e-40, 1e30):
            try:
                tx = factory(**{**base, name: value})
            except (ValueError, TypeError) as error:
                assert re.search(_whole_word(name), str(error)), (name, value, error)
                continue
            assert not (name == "eps" and math.isinf(value)), "a stabilizer must be finite"
            outs, _ = _run(jax.jit(tx.update), tx.init(params), steps, params)
            assert all(np.all(np.isfinite(np.asarray(x, np.float32)))
                       for out in outs for x in _float_leaves(out)), (name, value)


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


# The transforms that rank the entries of a slice: a slice split across devices is gathered
# whole for the ranking under jit (docs/sharding.md; inside shard_map only counts cross).
RANKS_SLICES = {"top_q", "l1q_normalize", "l1q_frank_wolfe", "l1_frank_wolfe"}


@entries
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_sharded_step_gathers_nothing(entry, axis_type):
    """No leaf is gathered: the step where the docs place the transform (``with_adam``), on a
    2-D mesh (FSDP by rows, tensor parallel by columns) and leaves past every size limit of
    the single-device paths, compiles to collectives of statistics only. A ranking transform
    needs whole slices: its leaf is split by rows only, and nothing is gathered either."""
    if jax.device_count() < 8:
        pytest.fail("the sharding check needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    kind = (jax.sharding.AxisType.Explicit if axis_type == "explicit"
            else jax.sharding.AxisType.Auto)
    mesh = jax.make_mesh((2, 4), ("d", "m"), axis_types=(kind,) * 2)
    columns = None if entry.name in RANKS_SLICES else "m"
    specs = {"w": PartitionSpec("d", columns), "b": PartitionSpec(columns)}
    tx = with_adam(entry)[0]
    with jax.set_mesh(mesh):
        tree = {name: jax.ShapeDtypeStruct(shape, jnp.float32,
                                           sharding=NamedSharding(mesh, specs[name]))
                for name, shape in (("w", (512, 256)), ("b", (256,)))}
        hlo = jax.jit(tx.update).lower(tree, jax.eval_shape(tx.init, tree), tree).compile()
    moved = [line.split("=", 1)[1].strip()[:80] for line in hlo.as_text().splitlines()
             if any(f" {op}(" in line or f" {op}-start(" in line
                    for op in ("all-gather", "all-to-all", "collective-permute"))]
    assert moved == [], moved


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


# The second-round contract (conventions 10-13 and the defects they came from).

def _factory(entry: Entry):
    return getattr(optclip, entry.name)


def _whole_word(name: str) -> str:
    return rf"\b{name}\b"


def _loss_weights(tree):
    return jax.tree.map(lambda x: jnp.linspace(0.5, 1.5, x.size).reshape(x.shape), tree)


@entries
def test_bad_hyperparameters_rejected_as_array_scalars_too(entry):
    """Convention 12: a concrete 0-d array is validated like the float it holds."""
    factory = _factory(entry)
    numeric = [(kwargs, name) for kwargs, name in entry.bad_args
               if isinstance(kwargs.get(name), float) and not np.isnan(kwargs[name])]
    for kwargs, name in numeric:
        for wrap in (jnp.asarray, np.asarray):
            with pytest.raises((ValueError, TypeError), match=_whole_word(name)):
                factory(**{**kwargs, name: wrap(kwargs[name])})


# The bad values of parameters that take a schedule: (entry, the bad arguments, the name).
_SCHEDULED_BAD = [(e, kwargs, name) for e in ALL_ENTRIES for kwargs, name in e.bad_args
                  if name in e.thresholds and isinstance(kwargs.get(name), float)]


@pytest.mark.parametrize(("entry", "kwargs", "name"), _SCHEDULED_BAD,
                         ids=[f"{e.name}-{n}" for e, _, n in _SCHEDULED_BAD])
def test_a_schedule_out_of_range_at_its_first_step_is_rejected(entry, kwargs, name):
    """Convention 7 for schedules: a threshold's schedule is checked at step 0 when the
    transform is built, so a schedule of the wrong sign is an error naming the parameter (it
    clipped to a negative bound, flipping the updates, or ignored a NaN bound)."""
    factory = _factory(entry)
    bad = kwargs[name]
    with pytest.raises(ValueError, match=_whole_word(name) + ".* at step 0"):
        factory(**{**kwargs, name: lambda count: jnp.asarray(bad) + 0 * count})
    # Only step 0: a schedule that leaves the range later is the run's to keep within it.
    good = entry.thresholds[name]
    if math.isfinite(bad):
        factory(**{**good, name: optax.linear_schedule(good[name], bad, 10)})


def test_validation_messages_are_readable():
    with pytest.raises(TypeError, match=r"\bdim\b.*int"):
        optclip.clip_norm(1.0, dim=1.5)
    with pytest.raises(ValueError, match=r"\bgrad_scale\b must be a number, got nan"):
        optclip.sign(grad_scale=float("nan"))
    with pytest.raises(ValueError, match=r"\bmax_norm\b"):
        optclip.clip_by_global_norm(jnp.array(-1.0))
    with pytest.raises(ValueError, match=r"\bvalue\b"):
        optclip.clip_value(jnp.array(-1.0))


@entries
def test_donated_opt_state_in_a_jitted_chain_step(entry):
    """The memory-saving train step: params and optimizer state donated to ``jax.jit``."""
    tx = optax.chain(entry.make(), optax.sgd(1e-2))
    params = _params(entry)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for grads in _grads(entry):
        ids = [id(x) for x in jax.tree.leaves(state)]
        assert len(ids) == len(set(ids)), "one array object in several state fields"
        params, state = step(params, state, grads)
    assert all(np.all(np.isfinite(np.asarray(x, np.float64))) for x in _float_leaves(params))


def _renamed(tree):
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {f"renamed_{i}": x for i, (_, x) in enumerate(leaves)}


@entries
def test_update_on_another_tree_names_the_leaf(entry):
    """Convention 10: a changed structure or shape is an error naming the leaf.

    Checked wherever the state ``init`` builds depends on the change (a transform whose state
    holds only global scalars has nothing to pair up and accepts any tree), and for a renamed
    leaf wherever the state depends on the leaves at all: per-leaf values kept as one vector
    (same shapes after the rename) must not be re-paired silently either.
    """
    tx = entry.make()
    params = _params(entry)
    state = tx.init(params)
    grads = _grads(entry)[0]
    # A fresh transform reads the shapes: one whose init has seen a tree accepts its leaves.
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype),
                                       jax.eval_shape(entry.make().init, tree))
    cases = [("w", lambda t: {**t, "w": t["w"][:3, :2]}),
             ("c", lambda t: {"w": t["w"], "c": t["b"]}),
             ("b", lambda t: {"w": t["w"]})]
    pairs = shapes({"w": params["w"]}) != shapes(params)
    for leaf, change in cases:
        if shapes(change(params)) == shapes(params) and not (leaf == "c" and pairs):
            continue
        with pytest.raises((ValueError, TypeError), match=_whole_word(leaf)):
            jax.eval_shape(tx.update, change(grads), state, change(params))


def _threshold_cases():
    return [pytest.param(e, name, id=f"{e.name}-{name}")
            for e in ALL_ENTRIES for name in e.thresholds]


# Parameters that take a schedule but that the conformance steps never read: skip_spikes's
# loss rule needs the loss extra argument (tests/test_skip_spikes.py holds its schedule).
_SCHEDULES_READ_ELSEWHERE = {("skip_spikes", "loss_threshold")}


@entries
def test_registry_lists_every_parameter_that_takes_a_schedule(entry):
    """The schedule rules below run over ``Entry.thresholds``: every numeric parameter that
    accepts an optax schedule is listed there, so none escapes them."""
    factory = _factory(entry)
    valid = _valid_kwargs(factory)
    signature = inspect.signature(factory).parameters
    takes = []
    for name in _numeric_parameters(factory):
        value = valid.get(name, signature[name].default)
        try:
            factory(**{**valid, name: optax.constant_schedule(0.5 if value is None else value)})
        except (TypeError, ValueError):
            continue
        takes.append(name)
    unlisted = {n for n in takes if (entry.name, n) not in _SCHEDULES_READ_ELSEWHERE}
    assert unlisted - set(entry.thresholds) == set(), "add them to the entry's thresholds"


@pytest.mark.parametrize(("entry", "name"), _threshold_cases())
def test_every_threshold_takes_a_schedule(entry, name):
    """Convention 12: a constant schedule gives what the float gives."""
    kwargs = entry.thresholds[name]
    value = kwargs[name]
    plain = _factory(entry)(**kwargs)
    scheduled = _factory(entry)(**{**kwargs, name: optax.constant_schedule(value)})
    params = _params(entry)
    plain_out, _ = _run(jax.jit(plain.update), plain.init(params), _grads(entry), params)
    sched_out, _ = _run(jax.jit(scheduled.update), scheduled.init(params), _grads(entry), params)
    chex.assert_trees_all_close(sched_out, plain_out, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("entry", "name"), _threshold_cases())
def test_a_schedule_that_returns_an_array_is_an_error_naming_the_threshold(entry, name):
    """A schedule must give a scalar: an array would broadcast against the leaves or change
    the state's shapes. The error names the parameter, raised when the transform is built
    (its value at step 0), or while tracing ``update`` where that value is not known then."""
    kwargs = entry.thresholds[name]
    value = kwargs[name]
    params = _params(entry)
    with pytest.raises(TypeError, match=_whole_word(name) + ".*scalar.* at step 0"):
        _factory(entry)(**{**kwargs, name: lambda count: jnp.full((2,), value)})
    @jax.jit
    def build_and_trace(grads):
        # A schedule of traced values (grads[0]): unknown when the transform is built.
        tx = _factory(entry)(**{**kwargs, name: lambda count: jnp.full((2,), value)
                                + 0 * grads[0]})
        return tx.update(grads[1], tx.init(params), params)

    with pytest.raises(TypeError, match=_whole_word(name) + ".*scalar"):
        jax.eval_shape(build_and_trace, (jnp.zeros(()), _grads(entry)[0]))


@entries
def test_inject_hyperparams_traces_every_number_or_names_the_static_ones(entry):
    """Convention 4: ``optax.inject_hyperparams`` turns every numeric argument, defaults
    included, into an array that ``update`` sees traced. Each one either works traced (the
    steps equal the plain transform's) or is structural, and then building it says so,
    naming it and ``static_args``; listed there, the transform works."""
    factory = _factory(entry)
    signature = inspect.signature(factory).parameters
    # Those of the first threshold too (some take an int, which must then be static).
    required = {**_valid_kwargs(factory), **next(iter(entry.thresholds.values()), {})}
    params = _params(entry)
    static: list[str] = []
    while True:
        injected = optax.inject_hyperparams(factory, static_args=tuple(static))(**required)
        try:
            state = injected.init(params)
            break
        except TypeError as err:
            named = re.match(r"(\w+) is static configuration", str(err))
            assert named and named[1] in signature and named[1] not in static, str(err)
            assert f"static_args=('{named[1]}',)" in str(err)
            static.append(named[1])
    plain = factory(**required)
    outs, _ = _run(jax.jit(injected.update), state, _grads(entry), params)
    plain_outs, _ = _run(jax.jit(plain.update), plain.init(params), _grads(entry), params)
    chex.assert_trees_all_close(outs, plain_outs, rtol=1e-6, atol=1e-7)


def _rising(value, shift: int = 0):
    """The schedule of the step-count rules: from half of ``value`` towards ``value``."""
    return lambda count: value * (count + 1 + shift) / (count + 2 + shift)


@pytest.mark.parametrize(("entry", "name"), _threshold_cases())
def test_a_nonfinite_step_does_not_advance_a_schedule(entry, name):
    """The step after a skipped (non-finite) one sees the threshold of the skipped step."""
    kwargs = entry.thresholds[name]
    tx = _factory(entry)(**{**kwargs, name: _rising(kwargs[name])})
    params = _params(entry)
    grads = _grads(entry)
    bad = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), grads[1])
    update = jax.jit(tx.update)
    clean, _ = _run(update, tx.init(params), grads, params)
    skipped, _ = _run(update, tx.init(params), [grads[0], bad, *grads[1:]], params)
    chex.assert_trees_all_close(skipped[-1], clean[-1], rtol=1e-6, atol=1e-7)


def _moved(a, b, rtol: float = 1e-6, atol: float = 1e-7) -> bool:
    """Whether trees ``a`` and ``b`` differ by ten times the tolerance the schedule rules
    compare with, so a rule that compares them would notice."""
    diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(_float_leaves(a), _float_leaves(b)))
    size = max(float(jnp.max(jnp.abs(y))) for y in _float_leaves(b))
    return diff > 10 * (atol + rtol * size)


@pytest.mark.parametrize(("entry", "name"), _threshold_cases())
def test_every_registered_threshold_is_read_by_the_rules_steps(entry, name):
    """The schedule rules above can only fail on a threshold the conformance steps read: each
    entry of ``Entry.thresholds`` is built so that, on the suite's three steps, halving its
    value changes the outputs (a constant schedule read wrongly would show), and advancing its
    rising schedule by one step changes the last output (a schedule advanced on a skipped step
    would show). A warm-up, a cap that never binds or a reference that never decays leaves the
    rules vacuous."""
    kwargs = entry.thresholds[name]
    value = kwargs[name]
    params = _params(entry)
    grads = _grads(entry)

    def steps(threshold):
        tx = _factory(entry)(**{**kwargs, name: threshold})
        return _run(jax.jit(tx.update), tx.init(params), grads, params)[0]

    assert any(_moved(a, b) for a, b in zip(steps(value / 2), steps(value))), "never read"
    assert _moved(steps(_rising(value, 1))[-1], steps(_rising(value))[-1]), "not read last"


def _nonfinite_count(state) -> int:
    logged = optclip.stats(state)
    counts = [int(v) for k, v in logged.items() if k.endswith("/nonfinite")]
    assert counts, f"no nonfinite counter in {sorted(logged)}"
    return sum(counts)


@entries
def test_nonfinite_steps_are_counted(entry):
    if not entry.has_stats:
        return
    tx, update = _compiled(entry.name)
    params = _params(entry)
    grads = _grads(entry)
    _, state = _run(update, tx.init(params), grads[:1], params)
    assert _nonfinite_count(state) == 0
    for poison in (jnp.nan, jnp.inf, -jnp.inf):
        bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(poison), grads[1])
        before = _nonfinite_count(state)
        _, state = update(bad, state, params)
        assert _nonfinite_count(state) == before + 1, poison


def _large_tree(seed: int) -> dict:
    """A (64, 128) leaf and a (128,) one: XLA:CPU reduces arrays from about 8192 elements with
    XNNPACK, whose maximum drops NaN (the (8, 4) trees above take XLA's own loops)."""
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(64, 128)) * 0.01, jnp.float32),
            "b": jnp.asarray(rng.normal(size=(128,)) * 0.01, jnp.float32)}


# The int32 scalars of the states that count steps or events without a bound of their own.
_COUNTERS = ("count", "step", "nonfinite", "spikes", "accepted", "total_skipped", "forced",
             "resets")
_INT32_MAX = int(np.iinfo(np.int32).max)


def _is_counter(path, x) -> bool:
    return (bool(path) and getattr(path[-1], "name", None) in _COUNTERS
            and x.dtype == jnp.int32 and not x.ndim)


def _counter_at(state, value):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, value) if _is_counter(path, x) else x, state)


def _counters(state) -> dict[str, int]:
    return {jax.tree_util.keystr(path): int(x)
            for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
            if _is_counter(path, x)}


@pytest.mark.parametrize("entry", [e for e in ALL_ENTRIES if e.has_stats], ids=str)
def test_counters_saturate_instead_of_wrapping(entry):
    """Every stateful transform's step and event counters saturates at the int32 maximum, as
    ``optax.safe_increment`` does: none wraps to a negative number (which would restart a
    warm-up or a schedule), and the steps go on giving finite updates."""
    tx, params, grads = entry.make(), _params(entry), _grads(entry)
    update = jax.jit(tx.update)
    _, state = update(grads[0], tx.init(params), params)
    state = _counter_at(state, _INT32_MAX)
    assert _counters(state), "no counter found"
    nan = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan)
                       if jnp.issubdtype(x.dtype, jnp.inexact) and x.size else x, grads[1])
    for step, g in enumerate((grads[1], nan, grads[2])):
        out, state = update(g, state, params)
        counters = _counters(state)
        assert min(counters.values()) >= 0, (step, counters)
        if step != 1:
            assert all(bool(jnp.all(jnp.isfinite(x))) for x in _float_leaves(out))
    nonfinite = [n for key, n in counters.items() if key.endswith(".nonfinite")]
    assert nonfinite and all(n == _INT32_MAX for n in nonfinite), counters


@entries
def test_one_nonfinite_element_in_a_large_leaf_is_a_skipped_step(entry):
    """One NaN, inf or -inf among 8192 elements is a non-finite step on XLA:CPU's fast
    reduction path too: counted, and none of it in the running state (the later outputs are
    those of the run without it)."""
    tx = entry.make()
    update = jax.jit(tx.update)
    params = _large_tree(1)
    grads = [_large_tree(seed) for seed in (10, 11, 12, 13)]
    clean, _ = _run(update, tx.init(params), grads, params)
    run = [grads[0]]
    for g, (poison, where) in zip(grads[1:], ((jnp.nan, (5, 77)), (jnp.inf, (63, 0)),
                                              (-jnp.inf, (31, 127)))):
        run += [{**g, "w": g["w"].at[where].set(poison)}, g]
    outs, state = _run(update, tx.init(params), run, params)
    chex.assert_trees_all_equal(outs[2::2], clean[1:])
    if entry.has_stats:
        assert _nonfinite_count(state) == 3


def _ord_cases():
    return [pytest.param(e, o, id=f"{e.name}-{o}") for e in ALL_ENTRIES
            if e.ord_kwargs is not None for o in (0, "l0", -1, -np.inf, np.inf, "mad")]


@pytest.mark.parametrize(("entry", "ord"), _ord_cases())
def test_infinite_gradient_counted_as_nonfinite_for_every_ord(entry, ord):
    tx = _factory(entry)(**entry.ord_kwargs, ord=ord)
    params = _params(entry)
    grads = _grads(entry)
    update = jax.jit(tx.update)
    _, state = update(grads[0], tx.init(params), params)
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grads[1])
    _, state = update(bad, state, params)
    assert _nonfinite_count(state) == 1


def _zero_leaf_tree(entry):
    tree = entry.tree(jnp.float32, 5)
    return {**tree, "b": jnp.zeros_like(tree["b"])}


@entries
@pytest.mark.parametrize("where", ["all_zero", "one_zero_leaf"])
def test_meta_gradient_is_finite_at_zero(entry, where):
    """``jax.grad`` through ``update`` (learned clipping, meta-learning) at a zero gradient."""
    tx = entry.make()
    params = _params(entry)
    grads = _grads(entry)[0]
    probe = (jax.tree.map(jnp.zeros_like, grads) if where == "all_zero"
             else _zero_leaf_tree(entry))
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    weights = _loss_weights(probe)

    def loss(updates, params):
        out, _ = tx.update(updates, state, params)
        return sum(jnp.sum(o * w) for o, w in zip(jax.tree.leaves(out),
                                                   jax.tree.leaves(weights)))

    zero_params = jax.tree.map(jnp.zeros_like, params) if where == "all_zero" else params
    for g in jax.tree.leaves(jax.grad(loss, argnums=(0, 1))(probe, zero_params)):
        assert np.all(np.isfinite(np.asarray(g))), where


# Above norms.GROUP_MAX_ELEMENTS (and slices.RANK_BLOCK_ENTRIES): a leaf this large takes the
# large-leaf forms of the reductions (variadic and compensated sums, blocks of rows).
_LARGE_LEAF = (260, 256)


@entries
@pytest.mark.parametrize("devices", ["one", "eight"])
def test_meta_gradient_matches_finite_differences_with_a_large_leaf(entry, devices, request):
    """``jax.grad`` through ``update``, with respect to the updates and the params, is the
    derivative of the step: a central difference in float64 along a random direction agrees,
    on a tree with a leaf large enough for the large-leaf forms of the reductions (those of
    one visible device too: variadic and compensated sums, the ranking by blocks of rows)."""
    if devices == "one":
        request.getfixturevalue("one_device")
    with jax.enable_x64(True):
        rng = np.random.default_rng(4)
        base = {**entry.tree(jnp.float64, 3), "large": rng.normal(size=_LARGE_LEAF) * 2}
        # Kept away from 0, where adam's own g / (sqrt(nu) + eps) bends on a scale of eps.
        grads = jax.tree.map(lambda x: jnp.where(x < 0, x - 0.1, x + 0.1), base)
        params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), grads)
        weights, dg, dp = (jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), grads)
                           for _ in range(3))
        tx = entry.make()
        # One step first: the derivative is taken where running statistics are in play.
        _, state = jax.jit(tx.update)(jax.tree.map(lambda x: x / 2, grads), tx.init(params),
                                      params)

        @jax.jit
        def loss(updates, params):
            out, _ = tx.update(updates, state, params)
            return sum(jnp.sum(jnp.sin(o) * w) for o, w in zip(jax.tree.leaves(out),
                                                                jax.tree.leaves(weights)))

        by_grads, by_params = jax.jit(jax.grad(loss, argnums=(0, 1)))(grads, params)
        slope = sum(float(jnp.vdot(a, b)) for a, b in zip(
            jax.tree.leaves((by_grads, by_params)), jax.tree.leaves((dg, dp))))
        h = 1e-7

        def moved(sign):
            return loss(*jax.tree.map(lambda x, d: x + sign * h * d, (grads, params), (dg, dp)))

        difference = float(moved(1) - moved(-1)) / (2 * h)
        np.testing.assert_allclose(slope, difference, rtol=1e-5, atol=1e-6)


def _huge(entry, dtype, magnitude):
    tree = entry.tree(jnp.float32, 7)
    return jax.tree.map(lambda x: (x / jnp.max(jnp.abs(x)) * magnitude).astype(dtype), tree)


@entries
@pytest.mark.parametrize(("dtype", "magnitude"), [(jnp.float32, 1e20), (jnp.float16, 6e4)],
                         ids=["f32-1e20", "f16-6e4"])
def test_norms_are_scale_safe(entry, dtype, magnitude):
    """Convention 13: finite gradients up to the dtype's range give finite, clipped outputs.

    A wrapper of optax.adam is run around an adam that sees bounded gradients
    (``Entry.scale_make``): adam's own moments overflow in the parameters' dtype.
    """
    tx = (entry.scale_make or entry.make)()
    params = _params(entry, dtype)
    # Enough steps for the warm-ups of the registry's history-based entries to end.
    factors = (1.0, 1 / 3, 1 / 2, 1.0)
    update = jax.jit(tx.update)
    outs, state = _run(update, tx.init(params), [_huge(entry, dtype, magnitude * f)
                                                 for f in factors], params)
    # The same steps at magnitude ~1: a leaf that comes out non-zero there must not be zeroed.
    plain, _ = _run(update, tx.init(params), [_huge(entry, dtype, f) for f in factors], params)
    for out, reference in zip(outs, plain):
        for name, leaf in out.items():
            assert np.all(np.isfinite(np.asarray(leaf, np.float64))), name
            if np.any(np.asarray(reference[name]) != 0):
                assert np.any(np.asarray(leaf) != 0), f"{name} zeroed"
        assert entry.bound is None or entry.bound(out)
    for leaf in _float_leaves(state):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))


@entries
def test_the_bound_holds(entry):
    if entry.bound is None:
        return
    tx, update = _compiled(entry.name)
    params = _params(entry)
    outs, _ = _run(update, tx.init(params), _grads(entry), params)
    assert all(entry.bound(out) for out in outs)


def _odd_leaves(entry):
    tree = entry.tree(jnp.float32, 3)
    return {**tree, "t": jnp.asarray(1.7, jnp.float32), "i": jnp.arange(3, dtype=jnp.int32)}


@entries
def test_python_float_and_zero_d_leaves(entry):
    """Convention 11: a Python float is clipped like a 0-d array; a 0-d leaf is one slice."""
    tx = entry.make()
    as_array = _odd_leaves(entry)
    as_float = {**as_array, "t": 1.7}
    params = _odd_leaves(entry)
    out_array, _ = jax.jit(tx.update)(as_array, tx.init(params), params)
    out_float, _ = tx.update(as_float, tx.init({**params, "t": 1.7}), {**params, "t": 1.7})
    np.testing.assert_array_equal(out_array["i"], as_array["i"])
    assert out_array["i"].dtype == jnp.int32
    chex.assert_trees_all_close(jax.tree.map(jnp.asarray, out_float), out_array,
                                rtol=1e-6, atol=1e-7)


@entries
def test_an_integer_parameter_after_adam_is_passed_on_or_named(entry):
    """An integer parameter whose update comes from an optimizer before the transform
    (``optax.adam`` gives it a floating-point one): a projection, whose state follows the
    parameters, passes that update on as it was; any other transform either runs or refuses
    the step with an error naming the leaf and the way out (``optax.masked``)."""
    adam = optax.adam(1e-2)
    tx = optax.chain(adam, entry.make())
    params = _odd_leaves(entry)
    grads = {**entry.tree(jnp.float32, 4), "t": jnp.asarray(0.3, jnp.float32),
             "i": jnp.zeros(3, jnp.int32)}
    state = tx.init(params)
    try:
        out, _ = jax.jit(tx.update)(grads, state, params)
    except ValueError as err:
        assert PLACEMENT.get(entry.name) != "after", f"a projection refused the step: {err}"
        assert re.search(_whole_word("i"), str(err)) and "optax.masked" in str(err), str(err)
        return
    if PLACEMENT.get(entry.name) == "after":
        adam_out, _ = adam.update(grads, adam.init(params), params)
        np.testing.assert_array_equal(out["i"], adam_out["i"])
        assert out["i"].dtype == adam_out["i"].dtype


@entries
def test_complex_leaves_keep_their_imaginary_part_or_are_rejected(entry):
    tx = entry.make()
    tree = entry.tree(jnp.float32, 3)
    tree = {**tree, "w": (tree["w"] + 1j * tree["w"][::-1]).astype(jnp.complex64)}
    try:
        out, _ = tx.update(tree, tx.init(tree), tree)
    except (TypeError, ValueError) as err:
        assert "complex" in str(err)
        return
    assert out["w"].dtype == jnp.complex64
    assert np.any(np.imag(np.asarray(out["w"])) != 0), "imaginary part dropped"


@entries
def test_float64_leaves_see_float64_thresholds_and_statistics(entry):
    """Convention 5/12 under x64: float64 leaves keep float64 statistics and outputs."""
    with jax.enable_x64(True):
        tx = entry.make()
        params = _params(entry, jnp.float64)
        outs, state = _run(jax.jit(tx.update), tx.init(params), _grads(entry, jnp.float64),
                           params)
        for out in outs:
            chex.assert_trees_all_equal_dtypes(out, params)
        for leaf in _float_leaves(state):
            assert jnp.asarray(leaf).dtype == jnp.float64
        # One rule: float32 leaves keep float32 statistics, x64 or not.
        params = _params(entry, jnp.float32)
        _, state = _run(jax.jit(tx.update), tx.init(params), _grads(entry, jnp.float32)[:1],
                        params)
        for leaf in _float_leaves(state):
            assert jnp.asarray(leaf).dtype == jnp.float32


def test_zclip_constant_warm_up_guard_survives_rounding():
    """25 identical warm-up norms leave a float32 variance of ~1e-16: still "constant"."""
    tx = optclip.zclip(max_grad_norm=None)
    update = jax.jit(tx.update)
    state = tx.init(jnp.zeros(1))
    for _ in range(25):
        _, state = update(jnp.array([0.1]), state)
    out, _ = update(jnp.array([0.2]), state)
    np.testing.assert_allclose(out, [0.2], rtol=1e-6)


@pytest.mark.parametrize("make", [lambda: optclip.clip_value(0.07),
                                  lambda: optclip.clip_by_global_norm(0.07),
                                  lambda: optclip.clip_norm(0.07)], ids=["value", "global", "norm"])
def test_float64_leaves_are_clipped_to_the_float64_threshold(make):
    with jax.enable_x64(True):
        tx = make()
        g = jnp.asarray([3.0], jnp.float64)
        out, _ = jax.jit(tx.update)(g, tx.init(g))
        assert out.dtype == jnp.float64
        assert float(out[0]) == 0.07


def test_zclip_with_its_default_cap_is_scale_safe():
    """ZClip's warm-up cap (``max_grad_norm=1.0``) on float32 elements of 1e20."""
    tx = optclip.zclip(warmup_steps=2)
    g = {"w": jnp.full((4, 4), 1e20, jnp.float32)}
    state = tx.init(g)
    for _ in range(3):
        out, state = jax.jit(tx.update)(g, state)
        np.testing.assert_allclose(optax.tree.norm(out), 1.0, rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: optclip.clip_by_global_norm(1.0), lambda: optclip.clip_norm(1.0),
    lambda: optclip.normalize(1.0), lambda: optclip.clip_value(0.8),
    lambda: optclip.project_l2_ball(1.0, exact=True), lambda: optclip.l2_normalize(),
], ids=["global", "norm", "normalize", "value", "l2_ball_exact", "l2_normalize"])
@pytest.mark.parametrize("point", [[0.6, 0.8], [0.0, 0.0]], ids=["boundary", "zero"])
def test_meta_gradient_is_finite_at_the_clipping_boundary(make, point):
    """At ``||g|| == max_norm`` (and ``|g| == value``) and at zero, ``jax.grad`` is finite."""
    tx = make()
    g = jnp.asarray(point)
    params = jnp.zeros(2)
    state = tx.init(params)
    grads = jax.grad(lambda u, p: jnp.sum(tx.update(u, state, p)[0] * jnp.array([1.0, 2.0])),
                     argnums=(0, 1))(g, params)
    for leaf in grads:
        assert np.all(np.isfinite(np.asarray(leaf)))


# ---------------------------------------------------------------------------------------------
# Non-finite steps skipped, checkpoints, odd and empty trees: rules every transform keeps (the
# families' own tests check their numbers, not these again).

def _poisoned(tree):
    """NaN in the first element of every leaf, inf in the last."""
    tree = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), tree)
    return jax.tree.map(lambda g: g.at[(-1,) * g.ndim].set(jnp.inf) if g.ndim else g, tree)


@entries
@pytest.mark.parametrize("bad_step", [0, 1])
def test_a_nonfinite_step_is_skipped(entry, bad_step):
    """After a NaN/inf step (the first one, or a later one) every later output is the one the
    run without that step gives: nothing of it entered the running state."""
    tx, update = _compiled(entry.name)
    params = _params(entry)
    grads = _grads(entry)
    clean, _ = _run(update, tx.init(params), grads, params)
    with_bad = [*grads[:bad_step], _poisoned(grads[bad_step]), *grads[bad_step:]]
    outs, _ = _run(update, tx.init(params), with_bad, params)
    chex.assert_trees_all_equal(outs[bad_step + 1:], clean[bad_step:])


@entries
def test_checkpoint_round_trip_continues_identically(entry):
    """The state serialised (flax msgpack) after a step, restored into ``init``'s state, gives
    the same state and the same later outputs."""
    import flax.serialization

    tx, update = _compiled(entry.name)
    params = _params(entry)
    grads = _grads(entry)
    _, state = _run(update, tx.init(params), grads[:1], params)
    restored = flax.serialization.from_bytes(tx.init(params), flax.serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored, state)
    expected, _ = _run(update, state, grads[1:], params)
    got, _ = _run(update, restored, grads[1:], params)
    chex.assert_trees_all_equal(got, expected)


def _with_odd_leaves(tree):
    return {**tree, "none": None, "masked": optax.MaskedNode(), "empty": jnp.zeros((0, 2)),
            "i": jnp.arange(3, dtype=jnp.int32)}


@entries
def test_none_masked_and_empty_leaves_pass_through(entry):
    """``None`` and ``optax.MaskedNode`` leaves come back as they were, a zero-size leaf keeps
    its shape, and none of them makes a statistic non-finite or counts as a non-finite step."""
    tx = entry.make()
    params = _with_odd_leaves(_params(entry))
    update = jax.jit(tx.update)
    state = tx.init(params)
    for g in _grads(entry)[:2]:
        out, state = update(_with_odd_leaves(g), state, params)
    assert out["none"] is None and isinstance(out["masked"], optax.MaskedNode)
    assert out["empty"].shape == (0, 2) and out["empty"].dtype == jnp.float32
    np.testing.assert_array_equal(out["i"], params["i"])
    assert all(np.all(np.isfinite(np.asarray(x, np.float64))) for x in _float_leaves(out))
    assert all(np.all(np.isfinite(np.asarray(x, np.float64))) for x in _float_leaves(state))
    if entry.has_stats:
        assert _nonfinite_count(state) == 0


# Float leaves of two dtypes in runs of three, so per-leaf values travel in one vector per dtype
# (a hand-out group of more than 32 entries is tested on its own in tests/test_core.py).
_MANY_SHAPES = ((3, 4), (4,), (2, 1, 3), (), (5, 1))
_MANY_DTYPES = (jnp.float32, jnp.bfloat16)
_MANY = 12


def _many_leaves(seed: int, order: list[int], interleaved: bool) -> dict:
    """Float leaf ``j`` (shape and dtype fixed by ``j``) under a key that sorts at position
    ``order.index(j)``; ``interleaved`` adds int32, ``None`` and masked leaves between them."""
    rng = np.random.default_rng(seed)
    values = [rng.normal(size=_MANY_SHAPES[j % len(_MANY_SHAPES)]) * 2.0 ** (j % 4 + seed % 3)
              for j in range(_MANY)]
    tree = {}
    for position, j in enumerate(order):
        tree[f"{position:02d}_leaf{j:02d}"] = jnp.asarray(values[j], _MANY_DTYPES[j // 3 % 2])
        if interleaved and position % 4 == 1:
            tree[f"{position:02d}_int"] = jnp.arange(3, dtype=jnp.int32)
        if interleaved and position % 7 == 3:
            tree[f"{position:02d}_none"] = None
            tree[f"{position:02d}_masked"] = optax.MaskedNode()
    return tree


def _by_leaf(tree: dict) -> dict:
    return {k.split("_", 1)[1]: np.asarray(v, np.float64) for k, v in tree.items()
            if "_leaf" in k}


@entries
def test_the_leaves_order_and_other_leaves_change_no_leaf_output(entry):
    """Each float leaf of a tree of mixed dtypes gets the same output at the second step (its
    state carried from the first) whether the tree lists the leaves in order, or shuffled with
    integer, ``None`` and masked leaves between them: per-leaf values go to the leaf they
    belong to.

    Shuffled, global sums add in another order: equal to a few units in the last place of each
    dtype. A transform that draws a random value per leaf, in the tree's order, keeps the order
    and is compared bit for bit.
    """
    tx = entry.make()
    init, update = jax.jit(tx.init), jax.jit(tx.update)
    forward = list(range(_MANY))
    other = forward if entry.draws_per_leaf else [7, 2, 11, 0, 5, 9, 3, 10, 1, 6, 8, 4]
    outputs = []
    for order, interleaved in ((forward, False), (other, True)):
        params = _many_leaves(1, order, interleaved)
        state = init(params)
        for seed in (9, 10):
            out, state = update(_many_leaves(seed, order, interleaved), state, params)
        outputs.append(_by_leaf(out))
    expected, got = outputs
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        dtype = _MANY_DTYPES[int(name[4:]) // 3 % 2]
        rtol = 0 if entry.draws_per_leaf else {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}[dtype]
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=rtol * 1e-3, err_msg=name)


def _same_shape_leaves(seed: int, nan: bool = False) -> dict:
    """16 small float leaves, two of each shape in each dtype (float32 and bfloat16), so each
    pair can share a reduction, and an int32 leaf; ``nan``: a NaN in one of them."""
    rng = np.random.default_rng(seed)
    tree = {f"leaf{j:02d}": jnp.asarray(rng.normal(size=_MANY_SHAPES[j % 4]) * 2.0 ** (j % 3),
                                        _MANY_DTYPES[j // 8])
            for j in range(16)}
    if nan:
        tree["leaf05"] = tree["leaf05"].at[0].set(jnp.nan)
    return dict(tree, count=jnp.arange(3, dtype=jnp.int32))


@entries
def test_leaves_reduced_together_on_one_device_match_leaves_reduced_apart(entry, monkeypatch):
    """On one device, small leaves of one shape share their reductions (one variadic reduce
    per group; the top-q ranking's counts in groups): outputs and state are those of every
    leaf reduced on its own, as on several devices (this suite sees 8, so no other check takes
    the groups), over a step with a NaN too. Grouped sums add in another order: equal to a few
    units in the last place of each dtype."""
    from optclip._core import norms, slices
    tx = entry.make()
    params = _same_shape_leaves(1)
    steps = [_same_shape_leaves(9), _same_shape_leaves(10, nan=True), _same_shape_leaves(11)]
    runs = []
    for together in (False, True):
        monkeypatch.setattr(norms, "_may_group", lambda together=together: together)
        monkeypatch.setattr(slices, "COUNT_GROUP_PER", 1)
        update = jax.jit(lambda g, s, p: tx.update(g, s, p))     # traced afresh per run
        runs.append(jax.tree.leaves(_run(update, tx.init(params), steps, params)))
    apart, together = runs
    assert len(apart) == len(together)
    for want, got in zip(apart, together):
        rtol = 2e-2 if jnp.asarray(want).dtype == jnp.bfloat16 else max(entry.rtol, 1e-5)
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                   rtol=rtol, atol=rtol * 1e-3)


# Conditionals a step keeps on a GPU, where XLA's runtime copies each one's predicate to the
# host and waits for the device before it goes on: a host sync in every step. Every other
# transform has none there (optclip._core.branch): the scale-safe norms' rescaled sums are
# reduced as data on a GPU, beside the plain ones, whose read XLA shares with them, and the
# gate that holds per-element state (an EMA, the previous update, a wrapped adam's moments)
# on a rejected step is a select, which XLA fuses into the kernels that write that state.
GPU_CONDITIONALS = {
    # A slice whose norm is zero, non-finite or out of the range where its reciprocal is
    # exact gets its norm again from the data scaled by a factor taken from the first read:
    # computed every step, that would be one more read of the gradients.
    "l1_normalize": 1, "l2_normalize": 1,
    # Likewise the rescaled norms of params + u where a plain sum overflowed.
    "project_l2_ball": 1, "l2_frank_wolfe": 1,
    # The top-q ranking's tie-break, which only rows with ties at the cut need.
    "top_q": 1, "l1q_normalize": 1, "l1q_frank_wolfe": 1,
}


@entries
def test_a_step_lowered_for_a_gpu_holds_no_conditional(entry):
    """``chain(T, adam)`` (a wrapper: itself) lowered for CUDA, counted exactly (no GPU
    needed): no conditional, apart from the listed ones."""
    from tests import hlo
    tx, _ = with_adam(entry)
    assert hlo.gpu_conditionals(tx, hlo.TREE) == GPU_CONDITIONALS.get(entry.name, 0)


def _overflowing(seed: int) -> dict:
    """:func:`_same_shape_leaves` with float32 leaves of 1e20 (their plain sums of squares
    overflow float32) and a bfloat16 one of 1e30."""
    tree = _same_shape_leaves(seed)
    tree["leaf01"] = tree["leaf01"] * 1e20
    tree["leaf06"] = tree["leaf06"] * 1e20
    tree["leaf09"] = tree["leaf09"] * 1e30
    return tree


@entries
def test_rare_branches_computed_as_data_match_the_conditionals(entry, monkeypatch):
    """On a GPU the scale-safe norms' rare branch runs every step (``optclip._core.branch``);
    run here in that form, every output and state leaf equals the one of the conditionals over
    steps that take the rare branches: plain sums of squares that overflow, a NaN (running
    state held: a corrupted state would show in the steps after it), and a clean step after
    them. XLA fuses the two forms differently, so the
    arithmetic of a step may round apart in the last place (adam's update, an EMA)."""
    from optclip._core import branch
    tx = entry.make()
    params = _same_shape_leaves(1)
    steps = [_same_shape_leaves(9), _overflowing(10), _same_shape_leaves(11, nan=True),
             _same_shape_leaves(12)]
    runs = []
    for platforms in (branch.SELECT_PLATFORMS, ("cpu", *branch.SELECT_PLATFORMS)):
        monkeypatch.setattr(branch, "SELECT_PLATFORMS", platforms)
        update = jax.jit(lambda g, s, p: tx.update(g, s, p))     # traced afresh per run
        runs.append(jax.tree.leaves(_run(update, tx.init(params), steps, params)))
    with_conditionals, as_data = runs
    assert len(as_data) == len(with_conditionals)
    for want, got in zip(with_conditionals, as_data):
        rtol = {jnp.bfloat16: 8e-3, jnp.float32: 1e-6}.get(jnp.asarray(want).dtype.type, 0)
        want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
        scale = np.max(np.abs(want[np.isfinite(want)]), initial=0.0)   # a difference of terms
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


@entries
@pytest.mark.parametrize("tree", [{}, [], {"a": None}], ids=["dict", "list", "none"])
def test_a_tree_without_arrays_comes_back_as_it_was(entry, tree):
    tx = entry.make()
    out, state = tx.update(tree, tx.init(tree), tree)
    assert out == tree
    optclip.stats(state)


@pytest.mark.parametrize("entry", [e for e in ALL_ENTRIES if e.needs_params], ids=str)
def test_update_without_params_names_the_transform_and_params(entry):
    """No params, params of another tree, or a params leaf of another shape than its update
    (which could broadcast into a silent wrong answer): an error naming the transform (and
    the leaf)."""
    tx = entry.make()
    params = _params(entry)
    grads = _grads(entry)[0]
    with pytest.raises(ValueError, match=rf"\b{entry.name}\b.*\bparams\b"):
        tx.update(grads, tx.init(params))
    with pytest.raises(ValueError, match=rf"\b{entry.name}\b.*\bparams\b.*structure"):
        jax.eval_shape(tx.update, grads, tx.init(params), {**params, "extra": params["b"]})
    with pytest.raises(ValueError, match=rf"\b{entry.name}\b.*\bparams\['b'\]"):
        jax.eval_shape(tx.update, grads, tx.init(params), {**params, "b": params["b"][:, None]})
