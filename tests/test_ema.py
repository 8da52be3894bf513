"""clip_norm_by_ema, normalize_by_ema, clip_value_by_ema (torchzero 0.4.4).

Expected values come from torchzero 0.4.4 run in float32, and from the NumPy oracle below,
written from torchzero's formulas (it concatenates leaves for the global mode, which is
the definition; optclip must get the same numbers without concatenating).
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given

import optclip
from tests.helpers import (
    ATOL,
    ORACLE_RTOL,
    RTOL,
    as_tree,
    assert_nonfinite_step_skipped,
    concatenated_operand_sizes,
    np_metric,
    per_leaf_np,
    random_sequence,
    run,
    sequences,
    to_np,
)

# ---------------------------------------------------------------------------------------------
# The NumPy oracle.

def oracle_norm_by_ema(seq, *, normalize, beta=0.99, ord=2, eps=1e-6, tensorwise=True,
                       max_ema_growth=1.5, ema_init="zeros"):
    """Outputs and EMA norms per step; leaves concatenated in the global mode."""
    dtype = seq[0][0].dtype.type
    tiny2 = 2 * np.finfo(dtype).tiny
    ema, ref = None, None
    outs, ema_norms = [], []
    for xs in seq:
        if ema is None:
            ema = [x.copy() if ema_init == "update" else np.zeros_like(x) for x in xs]
        w = dtype(1 - beta)
        ema = [e + w * (x - e) for x, e in zip(xs, ema)]
        groups = [[i] for i in range(len(xs))] if tensorwise else [list(range(len(xs)))]
        if ref is None:
            ref = [None] * len(groups)
        out = list(xs)
        step_norms = []
        for k, idx in enumerate(groups):
            flat = lambda leaves: np.concatenate([leaves[i].ravel() for i in idx])
            if ord in ("std", "var") and flat(xs).size < 2:
                step_norms.append(dtype(0))
                continue
            a, b = np_metric(flat(xs), ord), np_metric(flat(ema), ord)
            if max_ema_growth is not None:
                r = b if ref[k] is None else ref[k]
                allowed = max(dtype(r * dtype(max_ema_growth)), dtype(eps))
                if b > allowed:
                    for i in idx:
                        ema[i] = ema[i] / dtype(b / allowed)
                    b = allowed
                ref[k] = b
            q = dtype(a / max(b, tiny2))
            q = max(q, tiny2) if normalize else max(q, dtype(1))
            for i in idx:
                out[i] = xs[i] / q
            step_norms.append(b)
        outs.append(out)
        ema_norms.append(step_norms)
    return outs, ema_norms


def oracle_clip_value_by_ema(seq, *, beta=0.99, ema_init="zeros", bound_fn=None):
    """``bound_fn(ema, t)`` stands in for ``ema_transform`` (identity when ``None``)."""
    dtype = seq[0][0].dtype.type
    ema, outs = None, []
    for t, xs in enumerate(seq):
        if ema is None:
            ema = [np.abs(x) if ema_init == "update" else np.zeros_like(x) for x in xs]
        ema = [e + dtype(1 - beta) * (np.abs(x) - e) for x, e in zip(xs, ema)]
        bounds = ema if bound_fn is None else bound_fn(ema, t)
        outs.append([np.minimum(np.maximum(x, -b), b) for x, b in zip(xs, bounds)])
    return outs


# ---------------------------------------------------------------------------------------------
# torchzero 0.4.4 vectors, step by step.

S1 = [[3, 4], [0.3, 0.4], [30, 40], [0, 0], [6, 8]]
S2 = [[[3, 4], [1, 0]], [[0.3, 0.4], [2, 0]], [[30, 40], [0, 0]]]
S3 = [[3, -4, 0], [-1, 1, 2], [8, -8, -8], [0, 0, 0]]

S1_HALF = [[1.5, 2], [0.30000001, 0.40000001], [1.3500001, 1.8000002], [0, 0],
           [1.0125002, 1.3500001]]
S1_NORMALIZE_HALF = [[1.5, 2], [0.9000001, 1.2], [1.3500001, 1.8000002], [0, 0],
                     [1.0125002, 1.3500001]]
S1_DEFAULT = [[0.029999999, 0.039999999], [0.032699998, 0.043599997], [0.04905, 0.065400004],
              [0, 0], [0.072839245, 0.097118996]]

NORM_VECTORS = [
    # (id, factory, kwargs, sequence, outputs per step (list of leaves))
    ("clip_beta0.5", optclip.clip_norm_by_ema, dict(beta=0.5), S1, S1_HALF),
    ("normalize_beta0.5", optclip.normalize_by_ema, dict(beta=0.5), S1, S1_NORMALIZE_HALF),
    ("clip_default", optclip.clip_norm_by_ema, {}, S1, S1_DEFAULT),
    ("normalize_default", optclip.normalize_by_ema, {}, S1, S1_DEFAULT),
    ("clip_no_growth_cap", optclip.clip_norm_by_ema, dict(beta=0.5, max_ema_growth=None), S1,
     [[1.5, 2], [0.30000001, 0.40000001], [15.45, 20.6], [0, 0], [6, 8]]),
    ("clip_beta0", optclip.clip_norm_by_ema, dict(beta=0.0), S1,
     [[3, 4], [0.30000001, 0.40000001], [0.45000002, 0.60000002], [0, 0],
      [6.0000002e-07, 8.0000001e-07]]),
    ("clip_two_leaves", optclip.clip_norm_by_ema, dict(beta=0.5), S2,
     [[[1.5, 2], [0.5, 0]], [[0.30000001, 0.40000001], [0.75, 0]],
      [[1.3500001, 1.8000002], [0, 0]]]),
    *[(f"{name}_global", factory, dict(beta=0.5, tensorwise=False), S2,
       [[[1.5, 2], [0.5, 0]], [[0.28413957, 0.37885275], [1.8942637, 0]],
        [[1.7573063, 2.343075], [0, 0]]])
      for name, factory in (("clip", optclip.clip_norm_by_ema),
                            ("normalize", optclip.normalize_by_ema))],
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name,factory,kwargs,seq,expected", NORM_VECTORS,
                         ids=[v[0] for v in NORM_VECTORS])
def test_norm_by_ema_reference_vectors(name, factory, kwargs, seq, expected, jit):
    outs, _ = run(factory(**kwargs), [as_tree(s) for s in seq], jit=jit)
    for step, (out, want) in enumerate(zip(outs, expected)):
        want = as_tree(want) if isinstance(want[0], list) else [want]
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, np.asarray(w, np.float32), rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {step + 1}")


@pytest.mark.parametrize("factory", [optclip.clip_norm_by_ema, optclip.normalize_by_ema])
def test_norm_by_ema_stored_ema_and_norm(factory):
    seq = [as_tree(s) for s in S1]
    _, states = run(factory(beta=0.5), seq)
    ema_norms = [2.5, 1.5000001, 2.2500002, 1.1250001, 1.6875002]
    emas = [[1.5, 2], [0.90000004, 1.2], [1.35, 1.8000002], [0.67500001, 0.9000001],
            [1.0125002, 1.3500001]]
    capped = [False, False, True, False, True]
    for state, r, e, c in zip(states, ema_norms, emas, capped):
        np.testing.assert_allclose(optclip.per_leaf(state.ema_norm, seq[0])[0], r, rtol=RTOL)
        np.testing.assert_allclose(state.ema[0], e, rtol=RTOL)
        assert bool(optclip.per_leaf(state.capped, seq[0])[0]) == c


def test_global_ema_norm_vector():
    _, states = run(optclip.clip_norm_by_ema(beta=0.5, tensorwise=False),
                    [as_tree(s) for s in S2])
    np.testing.assert_allclose([float(s.ema_norm) for s in states],
                               [2.5495098, 1.9525625, 2.9288437], rtol=RTOL)
    assert [bool(s.capped) for s in states] == [False, False, True]
    np.testing.assert_allclose([float(s.norm) for s in states],
                               [math.sqrt(26), math.sqrt(4.25), 50.0], rtol=RTOL)


VALUE_VECTORS = [
    ("beta0.5", dict(beta=0.5), [[1.5, -2, 0], [-1, 1, 1], [4.625, -4.75, -4.5], [0, 0, 0]]),
    # ema_init='update' is torchzero 0.4.4's init=1.
    ("update_init", dict(beta=0.5, ema_init="update"),
     [[3, -4, 0], [-1, 1, 1], [5, -5.25, -4.5], [0, 0, 0]]),
    ("default", {}, [[0.029999999, -0.039999999, 0], [-0.039699998, 0.049599998, 0.02],
                     [0.119303, -0.12910399, -0.099799998], [0, 0, 0]]),
    # exp_avg_tfm=Mul(2): the bound doubles and S3 passes unchanged.
    ("scaled_bound", dict(beta=0.5, ema_transform=optax.scale(2.0)), S3),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name,kwargs,expected", VALUE_VECTORS, ids=[v[0] for v in VALUE_VECTORS])
def test_clip_value_by_ema_reference_vectors(name, kwargs, expected, jit):
    outs, states = run(optclip.clip_value_by_ema(**kwargs), [as_tree(s) for s in S3], jit=jit)
    for step, (out, want) in enumerate(zip(outs, expected)):
        np.testing.assert_allclose(out[0], np.asarray(want, np.float32), rtol=RTOL, atol=ATOL,
                                   err_msg=f"step {step + 1}")
    if kwargs.get("beta") == 0.5 and "ema_init" not in kwargs:   # the stored EMA
        emas = [[1.5, 2, 0], [1.25, 1.5, 1], [4.625, 4.75, 4.5], [2.3125, 2.375, 2.25]]
        for state, e in zip(states, emas):
            np.testing.assert_allclose(state.ema[0], e, rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# Against the NumPy oracle: random sequences with spikes, both modes, several ords.

ORDS = [2, 1, 3, math.inf, 0, "mad", "std", "sum", -1.5]


@pytest.mark.parametrize("normalize", [False, True], ids=["clip", "normalize"])
@pytest.mark.parametrize("tensorwise", [True, False], ids=["tensorwise", "global"])
@pytest.mark.parametrize("ord", ORDS, ids=str)
def test_norm_by_ema_matches_oracle(ord, tensorwise, normalize):
    seq = random_sequence(seed=2 * ORDS.index(ord) + tensorwise)
    kwargs = dict(beta=0.8, ord=ord, tensorwise=tensorwise, max_ema_growth=1.3, eps=1e-3)
    factory = optclip.normalize_by_ema if normalize else optclip.clip_norm_by_ema
    trees = [as_tree(s) for s in seq]
    outs, states = run(factory(**kwargs), trees)
    want_outs, want_norms = oracle_norm_by_ema(seq, normalize=normalize, **kwargs)
    # A negative order is ruled by the smallest |e_i|, which come out of cancellations in the
    # EMA update: an ulp there (FMA or not) is a large relative change of the norm.
    rtol = 1e-3 if isinstance(ord, (int, float)) and ord < 0 else ORACLE_RTOL
    for step, (out, want, state, want_r) in enumerate(zip(outs, want_outs, states, want_norms)):
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=rtol, atol=1e-6, err_msg=f"step {step}")
        np.testing.assert_allclose(per_leaf_np(state.ema_norm, trees[0]), want_r, rtol=rtol,
                                   atol=1e-7)


@pytest.mark.parametrize("kwargs", [
    dict(beta=0.3, ema_init="update"), dict(beta=0.95, max_ema_growth=None),
    dict(beta=0.5, max_ema_growth=0.8, eps=1e-2), dict(beta=0.0, tensorwise=False),
    dict(beta=0.9, ema_init="update", tensorwise=False, ord="linf"),
], ids=str)
@pytest.mark.parametrize("normalize", [False, True], ids=["clip", "normalize"])
def test_norm_by_ema_options_match_oracle(kwargs, normalize):
    seq = random_sequence(seed=7)
    factory = optclip.normalize_by_ema if normalize else optclip.clip_norm_by_ema
    outs, _ = run(factory(**kwargs), [as_tree(s) for s in seq])
    want_outs, _ = oracle_norm_by_ema(seq, normalize=normalize, **kwargs)
    for out, want in zip(outs, want_outs):
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=ORACLE_RTOL, atol=1e-6)


@pytest.mark.parametrize("tensorwise", [True, False])
def test_norm_by_ema_float64_matches_oracle(tensorwise):
    with jax.enable_x64(True):
        seq = random_sequence(seed=3, dtype=np.float64)
        kwargs = dict(beta=0.7, tensorwise=tensorwise, ord=3)
        outs, states = run(optclip.clip_norm_by_ema(**kwargs),
                           [as_tree(s, jnp.float64) for s in seq], jit=True)
        want_outs, _ = oracle_norm_by_ema(seq, normalize=False, **kwargs)
        assert states[-1].ema[0].dtype == jnp.float64
        for out, want in zip(outs, want_outs):
            for got, w in zip(out, want):
                assert got.dtype == jnp.float64
                np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("ema_init", ["zeros", "update"])
def test_clip_value_by_ema_matches_oracle(ema_init):
    seq = random_sequence(seed=11)
    outs, _ = run(optclip.clip_value_by_ema(beta=0.6, ema_init=ema_init),
                  [as_tree(s) for s in seq])
    for out, want in zip(outs, oracle_clip_value_by_ema(seq, beta=0.6, ema_init=ema_init)):
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=ORACLE_RTOL, atol=1e-7)


def test_stateful_ema_transform_keeps_its_state():
    """``optax.ema(0.5, debias=False)`` on the EMA: B_t = B_{t-1}/2 + e_t/2, B_0 = 0."""
    seq = random_sequence(seed=5)

    memory = []

    def bound_fn(ema, t):
        previous = memory[-1] if memory else [np.zeros_like(e) for e in ema]
        memory.append([np.float32(0.5) * p + np.float32(0.5) * e for p, e in zip(previous, ema)])
        return memory[-1]

    tx = optclip.clip_value_by_ema(beta=0.5, ema_transform=optax.ema(0.5, debias=False))
    outs, states = run(tx, [as_tree(s) for s in seq])
    for out, want in zip(outs, oracle_clip_value_by_ema(seq, beta=0.5, bound_fn=bound_fn)):
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=ORACLE_RTOL, atol=1e-7)
    # The stored EMA is the plain EMA of |x| (the transform worked on a copy).
    _, plain = run(optclip.clip_value_by_ema(beta=0.5), [as_tree(s) for s in seq])
    chex.assert_trees_all_close(states[-1].ema, plain[-1].ema, rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# Defects of torchzero 0.4.4 that optclip does not copy.

@pytest.mark.parametrize("ord", ["mad", "std", "l2", "linf", "sum"])
def test_string_ord_works_tensorwise_d12(ord):
    """torchzero raises TypeError here; the intended result uses the same metric for both."""
    seq = random_sequence(seed=2, steps=4)
    outs, _ = run(optclip.clip_norm_by_ema(beta=0.5, ord=ord), [as_tree(s) for s in seq])
    want, _ = oracle_norm_by_ema(seq, normalize=False, beta=0.5, ord=ord)
    for out, w in zip(outs, want):
        for got, ww in zip(out, w):
            np.testing.assert_allclose(got, ww, rtol=ORACLE_RTOL, atol=1e-7)


def test_global_ord0_counts_nonzeros_d6():
    tx = optclip.clip_norm_by_ema(beta=0.5, ord=0, tensorwise=False)
    out, state = tx.update([jnp.array([1.0, 0.0, 2.0]), jnp.array(3.0)],
                           tx.init([jnp.zeros(3), jnp.zeros(())]))
    assert float(state.norm) == 3.0 and float(state.ema_norm) == 3.0   # count of non-zeros
    np.testing.assert_allclose(out[0], [1.0, 0.0, 2.0])


@pytest.mark.parametrize("normalize", [False, True])
def test_single_element_std_leaf_passes_unchanged_d9(normalize):
    factory = optclip.normalize_by_ema if normalize else optclip.clip_norm_by_ema
    tx = factory(beta=0.5, ord="std")
    tree = [jnp.array([3.0]), jnp.array([1.0, 2.0, 4.0])]
    out, state = tx.update(tree, tx.init(tree))
    assert float(out[0][0]) == 3.0
    assert all(np.all(np.isfinite(x)) for x in to_np(state))


@pytest.mark.parametrize("factory", [optclip.clip_norm_by_ema, optclip.normalize_by_ema])
@pytest.mark.parametrize("ord", [2, "std", math.inf])
def test_global_mode_never_concatenates_leaves(factory, ord):
    """Only per-leaf scalars are combined (the reference concatenates all leaves)."""
    tx = factory(tensorwise=False, ord=ord)
    tree = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    jaxpr = jax.make_jaxpr(tx.update)(tree, tx.init(tree)).jaxpr
    assert all(size <= 1 for size in concatenated_operand_sizes(jaxpr))


# ---------------------------------------------------------------------------------------------
# Properties.

@functools.cache
def _property_transforms(tensorwise):
    return {name: (tx, jax.jit(tx.update)) for name, tx in (
        ("clip", optclip.clip_norm_by_ema(beta=0.7, tensorwise=tensorwise)),
        ("normalize", optclip.normalize_by_ema(beta=0.7, tensorwise=tensorwise)))}


@pytest.mark.parametrize("tensorwise", [True, False])
@given(seq=sequences)
def test_output_norm_never_exceeds_and_normalize_equals_ema_norm(tensorwise, seq):
    transforms = _property_transforms(tensorwise)
    for name, (tx, update) in transforms.items():
        state = tx.init([jnp.asarray(x) for x in seq[0]])
        for xs in seq:
            out, state = update([jnp.asarray(x) for x in xs], state)
            out_norms = ([np.linalg.norm(o) for o in to_np(out)] if tensorwise
                         else [np.linalg.norm(np.concatenate([o.ravel() for o in to_np(out)]))])
            ema_norms = per_leaf_np(state.ema_norm, out)
            assert len(ema_norms) == len(out_norms)
            for got, ema_norm in zip(out_norms, ema_norms):
                if name == "clip":
                    assert got <= ema_norm * (1 + 1e-5)
                else:
                    np.testing.assert_allclose(got, ema_norm, rtol=1e-5)


@given(seq=sequences)
def test_clip_value_by_ema_bounded_by_ema(seq):
    tx, update = _value_transform()
    state = tx.init([jnp.asarray(x) for x in seq[0]])
    for xs in seq:
        out, state = update([jnp.asarray(x) for x in xs], state)
        for o, x, e in zip(to_np(out), xs, to_np(state.ema)):
            assert np.all(np.abs(o) <= e) and np.all(np.abs(o) <= np.abs(x))
            assert np.all(np.sign(o) * np.sign(x) >= 0)


@functools.cache
def _value_transform():
    tx = optclip.clip_value_by_ema(beta=0.8)
    return tx, jax.jit(tx.update)


# ---------------------------------------------------------------------------------------------
# Non-finite steps of the configurations the conformance table (tests/registry.py) does not
# hold; its entries go through the whole contract in tests/test_conformance.py.

FAMILY_ONLY = {
    "clip_update_init": functools.cache(lambda: optclip.clip_norm_by_ema(beta=0.6,
                                                                         ema_init="update")),
    "value_transform": functools.cache(lambda: optclip.clip_value_by_ema(
        beta=0.6, ema_transform=optax.ema(0.5, debias=False))),
}


@pytest.mark.parametrize("name", FAMILY_ONLY)
@pytest.mark.parametrize("bad_step", [0, 3])
@pytest.mark.parametrize(("index", "poison"), [(0, math.nan), (-1, math.inf)],
                         ids=["nan_first", "inf_last"])
def test_nonfinite_step_leaves_state_unchanged(name, bad_step, index, poison):
    seq = [as_tree(s) for s in random_sequence(seed=1, steps=6)]
    assert_nonfinite_step_skipped(FAMILY_ONLY[name](), seq, bad_step, index, poison)


@pytest.mark.parametrize("shape", [(8, 4), (64, 128)], ids=["xla_loop", "xnnpack"])
def test_clip_value_by_ema_clamps_the_finite_elements_of_a_nonfinite_step(shape):
    """A non-finite step holds the EMA and its output still follows the formula: the finite
    elements are clamped to the held EMA's bound. On XLA:CPU the (64, 128) leaf is reduced by
    XNNPACK, whose maximum drops NaN, and the (8, 4) one by XLA's own loop, which keeps it."""
    rng = np.random.default_rng(3)
    g1, bad = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    bad[1, 2], bad[0, 3] = np.nan, np.inf
    tx = optclip.clip_value_by_ema(beta=0.5)
    update = jax.jit(tx.update)
    _, state = update(jnp.asarray(g1), tx.init(jnp.zeros(shape)))
    out, _ = update(jnp.asarray(bad), state)
    bound = 0.5 * np.abs(g1)  # the EMA after one step from zeros, held over the bad step
    np.testing.assert_allclose(np.asarray(out), np.clip(bad, -bound, bound), rtol=1e-6)


@pytest.mark.parametrize("factory", [optclip.clip_norm_by_ema, optclip.normalize_by_ema,
                                     optclip.clip_value_by_ema])
def test_stats_report_clipping(factory):
    tx = factory(beta=0.6)
    tree = [jnp.ones((3, 2))]
    logged = optclip.stats(tx.update(tree, tx.init(tree))[1])
    assert any(key.endswith(("/clipped", "/clipped_frac")) for key in logged), sorted(logged)


@pytest.mark.parametrize(("factory", "name"), [(optclip.clip_norm_by_ema, "clip_norm_by_ema"),
                                             (optclip.normalize_by_ema, "normalize_by_ema")])
def test_one_state_class_and_stats_keys_per_layout(factory, name):
    """Both layouts share one state class; stats summarises the per-leaf vectors (a
    single-array parameter's too: one entry) and reports the global mode's scalars as they
    are."""
    tree = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, 12.0])}
    by_leaf = factory(beta=0.5).update(tree, factory(beta=0.5).init(tree))[1]
    whole = factory(beta=0.5, tensorwise=False)
    whole_state = whole.update(tree, whole.init(tree))[1]
    assert type(by_leaf) is type(whole_state)
    logged = optclip.stats(by_leaf)
    # Per-leaf norms 5 and 12: max and mean of the vector, 'clipped' as a fraction.
    np.testing.assert_allclose(float(logged[f"{name}/norm_max"]), 12.0, rtol=1e-6)
    np.testing.assert_allclose(float(logged[f"{name}/norm_mean"]), 8.5, rtol=1e-6)
    assert f"{name}/clipped_frac" in logged and f"{name}/norm" not in logged
    logged = optclip.stats(whole_state)
    np.testing.assert_allclose(float(logged[f"{name}/norm"]), 13.0, rtol=1e-6)   # sqrt(9+16+144)
    assert bool(logged[f"{name}/clipped"]) and f"{name}/norm_max" not in logged
    single = jnp.array([3.0, 4.0])
    logged = optclip.stats(factory(beta=0.5).update(single, factory(beta=0.5).init(single))[1])
    np.testing.assert_allclose(float(logged[f"{name}/norm_max"]), 5.0, rtol=1e-6)
    np.testing.assert_allclose(float(logged[f"{name}/norm_mean"]), 5.0, rtol=1e-6)
    assert f"{name}/norm" not in logged


@pytest.mark.parametrize("size", [3, 5000], ids=["small_leaf", "large_leaf"])
def test_norms_beyond_float32_sum_of_squares_stay_right(size):
    """Elements of 1e20 overflow a float32 sum of squares (1e40): the norms are still the true
    ones (small leaves: scaled sums taken alongside; large leaves: taken on overflow only)."""
    x = jnp.full((size,), 1e20, jnp.float32)
    tx = optclip.clip_norm_by_ema(beta=0.5)
    state = tx.init({"w": x})
    out, state = tx.update({"w": x}, state)
    norm = 1e20 * math.sqrt(size)
    np.testing.assert_allclose(float(optclip.per_leaf(state.norm, out)["w"]), norm, rtol=1e-5)
    np.testing.assert_allclose(float(optclip.per_leaf(state.ema_norm, out)["w"]), norm / 2,
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["w"]), np.full(size, 5e19), rtol=1e-5)
    assert int(state.nonfinite) == 0


@pytest.mark.parametrize("ord", [2, "std"])
def test_leaf_norms_equal_the_core_metric_bit_for_bit(ord):
    """The per-leaf norms of the updates and of the moved EMA are the core metric's, bit for bit,
    on leaves reduced alone (> 2**16 elements), in same-shape groups and as small pairs, also on
    a step whose plain sums of squares overflow (1e25 in float32)."""
    from optclip._core import norms

    rng = np.random.default_rng(3)
    shapes = {"alone": (260, 256), "alone2": (260, 256), "mid": (64, 80), "mid2": (64, 80),
              "small": (5, 3)}
    tx = optclip.clip_norm_by_ema(beta=0.5, ord=ord, max_ema_growth=None)
    metric = jax.jit(lambda t: jax.tree.map(lambda x: norms.leaf_norm(x, norms.canonical_ord(
        ord)), t))
    update = jax.jit(tx.update)
    for scale in (1.0, 1e25):
        trees = [{k: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
                  for k, s in shapes.items()} for _ in range(2)]
        state = tx.init(trees[0])
        for step, tree in enumerate(trees):
            _, state = update(tree, state)
            # No growth cap: the stored EMA is the moved one (on the first step, from zeros).
            for name, want in (("norm", metric(tree)), ("ema_norm", metric(state.ema))):
                got = optclip.per_leaf(getattr(state, name), tree)
                for k in shapes:
                    assert np.isfinite(float(want[k])), (name, k)
                    np.testing.assert_array_equal(
                        np.asarray(got[k]), np.asarray(want[k]),
                        err_msg=f"{name}[{k}] at scale {scale}, step {step}")


@pytest.mark.parametrize("scale", [1.0, 1e25])
def test_global_norms_equal_the_core_metric_bit_for_bit(scale):
    """``tensorwise=False``: the norm of all updates and of the whole moved EMA are the core
    global metric's, bit for bit, on leaves reduced alone (> 2**16 elements) and a small one,
    on two steps, also where the plain sums of squares overflow (1e25 in float32)."""
    from optclip._core import norms

    rng = np.random.default_rng(4)
    shapes = {"alone": (260, 256), "alone2": (260, 256), "small": (5, 3)}
    tx = optclip.normalize_by_ema(beta=0.5, tensorwise=False, max_ema_growth=None)
    metric = jax.jit(norms.global_norm)
    update = jax.jit(tx.update)
    state = tx.init({k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()})
    for step in range(2):
        tree = {k: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
                for k, s in shapes.items()}
        _, state = update(tree, state)
        for name, want in (("norm", metric(tree)), ("ema_norm", metric(state.ema))):
            assert np.isfinite(float(want)), name
            np.testing.assert_array_equal(np.asarray(getattr(state, name)), np.asarray(want),
                                          err_msg=f"{name} at step {step}")


def test_traced_hyperparameters_with_inject_hyperparams():
    seq = [as_tree(s) for s in S1]
    plain, _ = run(optclip.clip_norm_by_ema(beta=0.5), seq)
    tx = optax.inject_hyperparams(optclip.clip_norm_by_ema, static_args=("ord", "ema_init"))(
        beta=0.5)
    injected, _ = run(tx, seq, jit=True)
    chex.assert_trees_all_close(injected, plain, rtol=1e-6)


@pytest.mark.parametrize("kwargs,name", [
    (dict(beta=1.5), "beta"), (dict(beta="a"), "beta"), (dict(eps=-1.0), "eps"),
    (dict(ord="l9"), "ord"), (dict(tensorwise=None), "tensorwise"),
    (dict(max_ema_growth=-1.0), "max_ema_growth"), (dict(ema_init="ones"), "ema_init"),
])
@pytest.mark.parametrize("factory", [optclip.clip_norm_by_ema, optclip.normalize_by_ema])
def test_norm_by_ema_rejects_bad_arguments(factory, kwargs, name):
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        factory(**kwargs)


@pytest.mark.parametrize("kwargs,name", [
    (dict(beta=-0.5), "beta"), (dict(ema_init="zero"), "ema_init"),
    (dict(ema_transform=optax.scale), "ema_transform"),
])
def test_clip_value_by_ema_rejects_bad_arguments(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        optclip.clip_value_by_ema(**kwargs)


@pytest.mark.parametrize("tensorwise", [True, False])
@pytest.mark.parametrize("ord", ["mad", -math.inf, -1.5, "std"], ids=str)
def test_empty_leaves_keep_statistics_finite(ord, tensorwise):
    """An empty leaf has no metric ('mad' would be 0/0): it must not block the state."""
    tx = optclip.normalize_by_ema(beta=0.5, ord=ord, tensorwise=tensorwise)
    tree = [jnp.zeros((0, 3)), jnp.array([3.0, 4.0])] if tensorwise else [jnp.zeros((0, 3))]
    state = tx.init(tree)
    for _ in range(2):
        out, state = tx.update(tree, state)
    assert int(state.count) == 2 and int(state.nonfinite) == 0
    assert all(np.all(np.isfinite(x)) for x in to_np(out))
