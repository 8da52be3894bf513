"""The shared core: axes resolution, norms, validation and the stats walker."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optclip
from optclip._core import axes, checks, handout, norms


@pytest.mark.parametrize("ndim, kwargs, expected", [
    (2, dict(dim=None), (0, 1)),
    (0, dict(dim=None), ()),                          # a 0-d leaf is one one-element slice
    (0, dict(dim=0), ()),
    (0, dict(dim=1), None),
    (3, dict(dim=1), (1,)),
    (1, dict(dim=1), None),                           # axes beyond the rank are ignored
    (2, dict(dim=-1), (1,)),
    (1, dict(dim=[0, -1]), (0,)),                     # D3: normalised, then de-duplicated
    (2, dict(dim=-1, inverse_dims=True), (0,)),       # D3: not "all axes"
    (2, dict(dim=None, inverse_dims=True), None),     # D2: the inverse of all axes is none
    (3, dict(dim=(0, 2), inverse_dims=True), (1,)),
    (2, dict(dim=-5), None),
    (3, dict(param_ndim=None), (0, 1, 2)),
    (3, dict(param_ndim=0), ()),
    (3, dict(param_ndim=1), (2,)),
    (3, dict(param_ndim=-1), (1, 2)),
    (3, dict(param_ndim=-3), ()),
    (3, dict(param_ndim=3), (0, 1, 2)),
])
def test_reduction_axes(ndim, kwargs, expected):
    assert axes.reduction_axes(ndim, **kwargs) == expected


@pytest.mark.parametrize("param_ndim", [4, -4])
def test_param_ndim_larger_than_rank_makes_the_leaf_one_slice(param_ndim):
    assert axes.reduction_axes(3, param_ndim=param_ndim) == (0, 1, 2)
    assert axes.reduction_axes(0, param_ndim=param_ndim) == ()


@pytest.mark.parametrize("ord, expected", [
    ("l0", 0.0), ("l1", 1.0), ("l2", 2.0), ("l3", 3.0), ("l4", 4.0), ("linf", math.inf),
    (-math.inf, -math.inf), (2, 2.0), ("mad", "mad"), ("std", "std"), ("var", "var"),
    ("sum", "sum")])
def test_canonical_ord(ord, expected):
    assert norms.canonical_ord(ord) == expected


@pytest.mark.parametrize("ord, error", [("l5", ValueError), ("L2", ValueError),
                                         (float("nan"), ValueError), (True, TypeError),
                                         ([2], TypeError), (jnp.asarray(2.0), TypeError)])
def test_bad_ord(ord, error):
    with pytest.raises(error, match="ord"):
        norms.canonical_ord(ord)


@pytest.mark.parametrize("ord", [2, 1, 0, 3, -2, math.inf, -math.inf, "mad", "std", "var", "sum"])
def test_global_norm_equals_the_norm_of_the_concatenation(ord):
    rng = np.random.default_rng(1)
    tree = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,)), "c": np.asarray(0.7)}
    flat = np.concatenate([np.ravel(x) for x in tree.values()])
    if ord == "mad":
        expected = np.mean(np.abs(flat))
    elif ord in ("std", "var"):
        expected = np.std(flat, ddof=1) if ord == "std" else np.var(flat, ddof=1)
    elif ord == "sum":
        expected = abs(flat.sum())
    elif ord == 0:
        expected = np.count_nonzero(flat)
    else:
        expected = np.linalg.norm(flat, ord)
    jtree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    np.testing.assert_allclose(float(norms.global_norm(jtree, norms.canonical_ord(ord))),
                               expected, rtol=2e-6)


def test_norms_accumulate_wide_and_return_wide_dtypes():
    x = jnp.full((4,), 300.0, jnp.float16)
    assert norms.leaf_norm(x, 2.0).dtype == jnp.float32
    assert float(norms.leaf_norm(x, 2.0)) == 600.0
    assert float(norms.global_norm([x, x], 2.0)) == pytest.approx(600.0 * math.sqrt(2))
    assert float(norms.global_norm([], 2.0)) == 0.0
    with jax.enable_x64(True):
        assert norms.leaf_norm(jnp.ones(3, jnp.float64), 2.0).dtype == jnp.float64
        assert norms.stat_dtype() == jnp.float64
    assert norms.stat_dtype() == jnp.float32


def test_scale_multiplies_in_the_wide_dtype():
    x = jnp.asarray([1.0, 3.0], jnp.bfloat16)
    out = norms.scale(x, jnp.asarray(1 / 3, jnp.float32))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(jnp.asarray([1 / 3, 1.0], jnp.bfloat16), np.float32))


@pytest.mark.parametrize("call, message", [
    (lambda: checks.positive("max_norm", -1.0), "max_norm must be > 0, got -1.0"),
    (lambda: checks.in_range("q", 1.5, 0, 1), "q must be >= 0 and <= 1, got 1.5"),
    (lambda: checks.in_range("beta", 1.0, 0, 1, high_inclusive=False), "beta must be >= 0 and < 1"),
    (lambda: checks.positive("max_norm", "1"), "max_norm must be a number, got '1'"),
    (lambda: checks.positive("max_norm", None), "max_norm must be a number, got None"),
    (lambda: checks.positive("max_norm", jnp.ones(2), allow_schedule=True), "must be a scalar"),
    (lambda: checks.integer("history_length", 2.0, low=1), "history_length must be an int"),
    (lambda: checks.integer("history_length", 0, low=1), "history_length must be >= 1, got 0"),
    (lambda: checks.one_of("mode", "z", ("zscore", "percentile")), "mode must be one of"),
    (lambda: checks.boolean("tensorwise", 1), "tensorwise must be a bool"),
])
def test_checks_messages(call, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(")):
        call()


def test_checks_accept_schedules_and_traced_values():
    checks.positive("max_norm", optax.constant_schedule(1.0), allow_schedule=True)
    checks.positive("max_norm", jnp.asarray(1.0), allow_schedule=True)
    checks.positive("max_norm", np.float32(2.0))
    checks.positive("eps", None, allow_none=True)
    assert float(checks.resolve(lambda count: 2.0 * count, jnp.asarray(3), name="x")) == 6.0


# ---------------------------------------------------------------------------------------------
# optclip.stats through every optax wrapper, under jit.

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
GRADS = {"w": jnp.full((2, 3), 2.0), "b": jnp.full(3, 2.0)}   # global norm 6, leaf norms ~4.9, 3.5

WRAPPERS = {
    "chain": lambda: optax.chain(optclip.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "inject_hyperparams": lambda: optax.chain(
        optax.inject_hyperparams(optclip.clip_by_global_norm, static_args="ord")(max_norm=1.0),
        optax.sgd(0.1)),
    "masked": lambda: optax.masked(optclip.clip_by_global_norm(1.0), {"w": True, "b": False}),
    "multi_steps": lambda: optax.MultiSteps(
        optax.chain(optclip.clip_by_global_norm(1.0), optax.sgd(0.1)), every_k_schedule=1),
    "apply_if_finite": lambda: optax.apply_if_finite(
        optax.chain(optclip.clip_by_global_norm(1.0), optax.sgd(0.1)), max_consecutive_errors=3),
    "partition": lambda: optax.partition(
        {"clip": optclip.clip_by_global_norm(1.0), "none": optax.identity()},
        {"w": "clip", "b": "none"}),
    # optclip's own wrappers: what they wrap is reported too.
    "skip_spikes": lambda: optclip.skip_spikes(
        optax.chain(optclip.clip_by_global_norm(1.0), optax.sgd(0.1)), warmup_steps=2),
    "spam_clip": lambda: optclip.spam_clip(
        optax.chain(optclip.clip_by_global_norm(1.0), optax.adam(1e-3))),
    "hist_clip_warm_up": lambda: optclip.hist_clip(
        warmup_transform=optclip.clip_by_global_norm(1.0), warmup_steps=2),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_stats_through_optax_wrappers_under_jit(wrapper):
    tx = WRAPPERS[wrapper]()

    @jax.jit
    def step(state):
        _, state = tx.update(GRADS, state, PARAMS)
        return optclip.stats(state)

    logged = step(tx.init(PARAMS))
    expected_norm = 6.0 if wrapper not in ("masked", "partition") else math.sqrt(24.0)
    np.testing.assert_allclose(float(logged["clip_by_global_norm/norm"]), expected_norm, rtol=1e-6)
    assert bool(logged["clip_by_global_norm/clipped"])
    assert int(logged["clip_by_global_norm/nonfinite"]) == 0
    wrapped_by = {"skip_spikes": "skip_spikes", "spam_clip": "spam_clip",
                  "hist_clip_warm_up": "hist_clip"}
    if wrapper in wrapped_by:   # and the wrapper's own keys
        assert f"{wrapped_by[wrapper]}/nonfinite" in logged


def test_stats_names_repeated_transforms_and_summarises_per_leaf_fields():
    tx = optax.chain(optclip.clip_norm(1.0), optclip.clip_norm(10.0), optclip.clip_value(1.5))
    _, state = tx.update(GRADS, tx.init(PARAMS))
    logged = optclip.stats(state)
    assert set(logged) == {
        "clip_norm/norm_max", "clip_norm/norm_mean", "clip_norm/clipped_frac",
        "clip_norm/nonfinite", "clip_norm_1/norm_max", "clip_norm_1/norm_mean",
        "clip_norm_1/clipped_frac", "clip_norm_1/nonfinite", "clip_value/max_abs_max",
        "clip_value/max_abs_mean", "clip_value/clipped_frac", "clip_value/nonfinite"}
    np.testing.assert_allclose(float(logged["clip_norm/norm_max"]), math.sqrt(24.0), rtol=1e-6)
    assert float(logged["clip_norm/clipped_frac"]) == 1.0
    np.testing.assert_allclose(float(logged["clip_norm_1/norm_max"]), 1.0, rtol=1e-6)
    assert float(logged["clip_norm_1/clipped_frac"]) == 0.0
    assert set(optclip.stats(optax.adam(1e-3).init(PARAMS))) == set()


def test_per_leaf_means_of_huge_finite_values_stay_finite():
    """A per-leaf field of finite values near float32's largest has a finite, right mean
    (summed before dividing, it overflowed to inf)."""
    tx = optclip.clip_value(1.0)
    grads = {"w": jnp.full((8, 4), 3e38, jnp.float32), "b": jnp.full((4,), -2e38, jnp.float32)}
    _, state = tx.update(grads, tx.init(grads))
    logged = optclip.stats(state)
    np.testing.assert_allclose(float(logged["clip_value/max_abs_mean"]), 2.5e38, rtol=1e-6)
    assert float(logged["clip_value/max_abs_max"]) == np.float32(3e38)


@pytest.mark.parametrize("factory", [
    lambda: optclip.clip_norm(1.0, ord="std"), lambda: optclip.normalize(ord="std"),
    lambda: optclip.clip_norm_by_ema(ord="std"), lambda: optclip.normalize_by_ema(ord="std"),
    lambda: optclip.clip_norm_growth(ord="std")], ids=[
    "clip_norm", "normalize", "clip_norm_by_ema", "normalize_by_ema", "clip_norm_growth"])
def test_a_std_whose_mean_overflows_is_counted_as_nonfinite(factory):
    """The documented limit of a plain mean: finite elements whose slice sum leaves float32's
    range (1e35 on 10^4 elements) give a non-finite 'std', and the call is counted in
    ``nonfinite``, never taken silently as a finite step."""
    huge = jnp.asarray(1e35 * (1 + 0.1 * np.random.default_rng(0).normal(size=(100, 100))),
                       jnp.float32)
    assert bool(jnp.all(jnp.isfinite(huge)))
    assert np.sum(np.asarray(huge, np.float64)) > np.finfo(np.float32).max
    tx = factory()
    grads = {"w": huge, "b": jnp.asarray([1.0, 2.0, 4.0])}
    _, state = tx.update(grads, tx.init(grads))
    counted = [v for k, v in optclip.stats(state).items() if k.endswith("/nonfinite")]
    assert [int(v) for v in counted] == [1]


def test_nonfinite_step_keeps_the_last_finite_diagnostics_and_counts():
    tx = optclip.clip_by_global_norm(1.0)
    _, state = tx.update(GRADS, tx.init(PARAMS))
    bad = {"w": GRADS["w"].at[0, 0].set(jnp.inf), "b": GRADS["b"]}
    out, state = tx.update(bad, state)
    logged = optclip.stats(state)
    assert float(logged["clip_by_global_norm/norm"]) == 6.0
    assert int(logged["clip_by_global_norm/nonfinite"]) == 1
    assert np.isnan(np.asarray(out["w"][0, 0]))      # the output follows the formula


@pytest.mark.parametrize("ord", [2, 1, 0, math.inf, -math.inf, "std", "sum", 3])
def test_grouped_reductions_match_one_reduce_per_leaf(ord, monkeypatch):
    rng = np.random.default_rng(2)
    tree = [jnp.asarray(rng.normal(size=shape), dtype) for shape, dtype in
            [((3, 4), jnp.float32)] * 40 + [((5,), jnp.float32)] * 3 + [((5,), jnp.bfloat16),
                                                                        ((0, 2), jnp.float32)]]
    ord = norms.canonical_ord(ord)
    monkeypatch.setattr(norms, "_may_group", lambda: False)
    per_leaf = jax.jit(lambda t: norms.global_norm(t, ord))(tree)
    monkeypatch.setattr(norms, "_may_group", lambda: True)
    grouped = jax.jit(lambda t: norms.global_norm(t, ord))(tree)
    np.testing.assert_allclose(grouped, per_leaf, rtol=1e-6)
    text = jax.jit(lambda t: norms.global_norm(t, ord)).lower(tree).as_text()
    # 45 leaves: a handful of grouped reductions per round, not one per leaf (std: the sum and
    # the squares, and in the overflow branch of the cond the max, sum and squares again).
    assert text.count("stablehlo.reduce") < 30


def test_no_grouping_when_several_devices_are_visible():
    assert jax.device_count() == 8 and not norms._may_group()


def test_transformation_with_extra_args_forwards_them_and_keeps_the_tree_contract():
    seen = {}

    def update_fn(updates, state, params=None, **extra):
        seen.update(extra)
        return updates, state

    tx = checks.transformation(lambda p: {"n": jax.tree.map(jnp.zeros_like, p)}, update_fn,
                               extra_args=True)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    chained = optax.chain(tx, optax.sgd(1.0))
    params = {"w": jnp.ones(2), "t": 1.5}
    out, _ = chained.update(params, chained.init(params), params, loss=jnp.float32(3.0))
    assert float(seen["loss"]) == 3.0
    assert out["t"].shape == ()                   # the Python float arrived as a 0-d array
    with pytest.raises(ValueError, match=r"\bw\b"):
        tx.update({"w": jnp.ones(3), "t": 1.5}, tx.init(params), loss=1.0)
    assert not isinstance(checks.transformation(lambda p: (), update_fn),
                          optax.GradientTransformationExtraArgs)


@pytest.mark.parametrize("group", [True, False])
def test_all_finite_on_per_leaf_scalars_and_grouped_leaves(group, monkeypatch):
    monkeypatch.setattr(norms, "_may_group", lambda: group)
    small = [jnp.ones((3, 4)) * i for i in range(40)]
    big = jnp.ones((norms.GROUP_MAX_ELEMENTS + 1,))
    clean = {"small": small, "big": big, "scalars": [jnp.array(1.0), jnp.ones((1, 1))],
             "int": jnp.array([1, 2]), "bf16": jnp.ones(3, jnp.bfloat16), "empty": jnp.zeros(0)}
    check = jax.jit(lambda t: optclip._core.stats.all_finite(t))    # traced afresh per case
    assert bool(check(clean))
    for path, bad in [(("small", 17), jnp.ones((3, 4)).at[1, 2].set(jnp.nan)),
                      (("big",), big.at[-1].set(-jnp.inf)),
                      (("scalars", 0), jnp.array(jnp.inf)),
                      (("scalars", 1), jnp.full((1, 1), jnp.nan)),
                      (("bf16",), jnp.array([1, jnp.nan, 1], jnp.bfloat16))]:
        tree = jax.tree.map(lambda x: x, clean)
        if len(path) == 2:
            tree[path[0]][path[1]] = bad
        else:
            tree[path[0]] = bad
        assert not bool(check(tree)), path


@pytest.mark.parametrize("gpu_form", [False, True], ids=["conditional", "as-data"])
def test_a_rare_branch_picks_the_same_values_in_both_forms(gpu_form, monkeypatch):
    """``branch.rare``: a ``lax.cond`` here, and on GPUs both branches and a select (run here
    by naming the CPU among the select platforms): the same values, and a conditional in the
    compiled step only in the first form."""
    from optclip._core import branch
    if gpu_form:
        monkeypatch.setattr(branch, "SELECT_PLATFORMS", ("cpu", *branch.SELECT_PLATFORMS))
    step = jax.jit(lambda p, x: branch.rare(
        p, lambda: {"a": x * 3 + 1, "b": jnp.sum(x)}, lambda: {"a": x, "b": -x[0]}))
    x = jnp.arange(1.0, 4.0)
    taken, otherwise = step(True, x), step(False, x)
    np.testing.assert_array_equal(taken["a"], [4.0, 7.0, 10.0])
    assert float(taken["b"]) == 6.0
    np.testing.assert_array_equal(otherwise["a"], x)
    assert float(otherwise["b"]) == -1.0
    compiled = step.lower(True, x).compile().as_text()
    assert (" conditional(" in compiled) == (not gpu_form)


@pytest.mark.parametrize("group", [True, False])
def test_leaf_l2_norms_list_vector_and_builder_agree(group, monkeypatch):
    """One routine for per-leaf L2 norms: the list, the vector and leaf_norm agree, also where a
    plain sum of squares overflows (small leaves: the paired scaled sum; a large leaf: the
    rare branch, which calls the builder again)."""
    monkeypatch.setattr(norms, "_may_group", lambda: group)
    rng = np.random.default_rng(4)
    leaves = [jnp.asarray(rng.normal(size=(3, 4)), jnp.float32) for _ in range(6)]
    leaves += [jnp.asarray(rng.normal(size=(norms.PAIR_MAX_ELEMENTS + 3,)), jnp.float32),
               jnp.zeros((2, 2)), jnp.array(-2.5)]
    for scale in (1.0, 1e30):
        xs = [x * scale for x in leaves]
        expected = np.array([np.linalg.norm(np.asarray(x, np.float64).ravel()) for x in xs])
        built = []

        def build(xs=xs, built=built):
            built.append(1)
            return [x * 1 for x in xs]

        as_list = jax.jit(lambda t: norms.leaf_l2_norms(t))(xs)
        as_vector = jax.jit(lambda t: norms.leaf_l2_norms(t, vector=True))(xs)
        from_builder = jax.jit(lambda: norms.leaf_l2_norms(build))()
        np.testing.assert_allclose(np.asarray(as_list), expected, rtol=2e-6)
        np.testing.assert_allclose(as_vector, expected, rtol=2e-6)
        np.testing.assert_allclose(np.asarray(from_builder), expected, rtol=2e-6)
        np.testing.assert_array_equal(
            np.asarray(jax.jit(lambda t: norms.leaf_norms(t, 2.0))(xs)), as_list)
        # Once for the sums, once inside the overflow branch of each platform's form (a
        # conditional; on GPUs the branch as data: optclip._core.branch).
        assert len(built) == 3
        np.testing.assert_allclose(jax.jit(lambda t: norms.global_norm(t))(xs),
                                   np.sqrt(np.sum(expected ** 2)), rtol=2e-6)


@pytest.mark.parametrize("group", [True, False])
def test_slice_l2_norms_scale_safe_on_small_and_large_arrays(group, monkeypatch):
    """Per-slice L2 norms (one variadic pair for small arrays, plain sums with the scaled ones
    under one overflow cond for large arrays) are right where a plain sum of squares overflows,
    and a NaN/Inf element makes its own slice's norm non-finite and no other."""
    monkeypatch.setattr(norms, "_may_group", lambda: group)
    rng = np.random.default_rng(5)
    arrays = [jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
              jnp.asarray(rng.normal(size=(norms.PAIR_MAX_ELEMENTS // 2 + 1, 3)), jnp.float32),
              jnp.asarray(rng.normal(size=(5,)), jnp.float32)]
    axes = [(0,), (0,), ()]
    norm_fn = jax.jit(lambda xs: norms.slice_l2_norms([(x, a, ()) for x, a in zip(xs, axes)]))
    for scale in (1.0, 1e20, 1e30):
        xs = [x * scale for x in arrays]
        for x, a, got in zip(xs, axes, norm_fn(xs)):
            wide = np.asarray(x, np.float64)
            expected = np.sqrt(np.sum(wide * wide, axis=a, keepdims=True))
            assert got.shape == expected.shape and got.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2e-6)
    bad = [arrays[0].at[2, 1].set(jnp.nan), arrays[1].at[7, 2].set(jnp.inf), arrays[2]]
    finite = [np.isfinite(np.asarray(n)) for n in norm_fn(bad)]
    np.testing.assert_array_equal(finite[0], [[True, False, True, True]])
    np.testing.assert_array_equal(finite[1], [[True, True, False]])
    assert finite[2].all()


def test_one_rule_for_floating_leaves_python_floats_count_once_made_arrays():
    """Which leaves count: arrays of a floating dtype (norms.float_leaves), for norms and the
    finiteness test alike; a Python float leaf counts once a transform's update has made it a
    0-d array."""
    tree = {"w": jnp.array([3.0, 4.0]), "t": float("nan"), "i": jnp.array([1, 2])}
    assert [x is tree["w"] for x in norms.float_leaves(tree)] == [True]
    assert bool(optclip._core.stats.all_finite(tree))
    assert float(norms.global_norm(tree)) == 5.0
    tx = optclip.clip_value(1.0)
    state = tx.init({"w": jnp.zeros(2), "t": 0.0, "i": jnp.zeros(2, jnp.int32)})
    out, state = tx.update(tree, state)
    assert int(state.nonfinite) == 1 and np.isnan(out["t"])


def test_hand_out_returns_every_entry_bit_for_bit_with_derivatives():
    """Per-leaf values handed out from vectors by variadic reduces come back bit for bit
    (signed zeros, NaN, Inf, subnormals, flags, integers), in groups that do not divide the
    entry count; derivatives flow through the float entries, and it batches under vmap."""
    values = np.array([-0.0, 0.0, np.nan, -np.inf, 3.5, -1e-40, 7.0, 1e38, -2.0, 1.0, 5.0],
                      np.float32)
    flags = np.arange(values.size) % 3 == 0
    ints = np.arange(values.size, dtype=np.int32) - 5
    rows = jax.jit(lambda v, f, i: handout.rows((v, f, 2 * v, i)))(values, flags, ints)
    doubled = np.asarray(jax.jit(lambda v: 2 * v)(values))  # XLA:CPU flushes subnormals here
    assert len(rows) == values.size
    for j, (v, f, w, i) in enumerate(rows):
        assert v.shape == () and v.dtype == jnp.float32 and f.dtype == jnp.bool_
        assert np.asarray(v).tobytes() == values[j].tobytes()
        assert bool(f) == flags[j] and int(i) == ints[j] and i.dtype == jnp.int32
        assert np.asarray(w).tobytes() == doubled[j].tobytes()
    weights = np.arange(values.size, dtype=np.float32)

    def total(v):
        return sum(w * r[0] + r[2] for w, r in zip(weights, handout.rows((v, v > 0, v))))

    ones = jnp.ones(values.size)
    np.testing.assert_array_equal(jax.grad(total)(ones), weights + 1)
    np.testing.assert_array_equal(jax.jvp(total, (ones,), (ones,))[1], weights.sum() + 11)
    batched = jax.vmap(lambda v: handout.rows((v, v > 1))[2])(jnp.arange(12.0).reshape(3, 4))
    np.testing.assert_array_equal(batched[0], [2.0, 6.0, 10.0])
    np.testing.assert_array_equal(batched[1], [True, True, True])


def test_hand_out_costs_one_kernel_per_group_of_entries():
    """Seventy entries of three vectors: one variadic reduce per vector and group of entries,
    not one kernel per entry."""
    hlo = jax.jit(lambda v: handout.rows((v, v > 0, 2 * v))).lower(
        jnp.zeros(70)).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    reduces = [line for line in entry.splitlines() if " fusion(" in line and "reduce" in line]
    assert len(reduces) == 3 * -(-70 // handout.GROUP) < 3 * 70


def test_per_leaf_gives_a_state_vector_back_as_a_tree():
    """``optclip.per_leaf``: entry ``j`` at the ``j``-th floating leaf (Python floats count, as
    every transform reads them as 0-d arrays), ``None`` at integer leaves; rows of a 2-d field;
    a vector of the wrong length is refused."""
    params = {"a": jnp.zeros((2, 3)), "i": jnp.arange(3), "t": 0.5, "z": jnp.zeros(4)}
    values = jnp.array([1.0, 2.0, 3.0])
    tree = optclip.per_leaf(values, params)
    assert tree["i"] is None
    assert [float(tree[k]) for k in ("a", "t", "z")] == [1.0, 2.0, 3.0]
    rows = optclip.per_leaf(jnp.arange(6.0).reshape(3, 2), params)
    np.testing.assert_array_equal(rows["z"], [4.0, 5.0])
    jitted = jax.jit(optclip.per_leaf)(values, params)
    assert float(jitted["z"]) == 3.0
    for bad in (jnp.zeros(2), jnp.zeros(4), jnp.asarray(1.0)):
        with pytest.raises(ValueError, match="one entry per floating leaf"):
            optclip.per_leaf(bad, params)


def test_state_vectors_follow_the_leaves_of_init_and_name_a_renamed_leaf():
    """A state pairing per-leaf vectors with leaves by position still refuses a tree whose
    leaves differ from init's, naming them, even where the shapes match."""
    tx = optclip.adagc()
    state = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(3)})
    assert state.gamma.shape == (2,)
    with pytest.raises(ValueError, match=r"\['c'\]"):
        tx.update({"a": jnp.zeros(2), "c": jnp.zeros(3)}, state)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        tx.update({"a": jnp.zeros(2)}, state)
    out, _ = tx.update({"a": jnp.ones(2), "b": jnp.ones(3)}, state)   # the same tree: fine
    assert set(out) == {"a", "b"}
