"""clip_value_growth, clip_norm_growth (torchzero 0.4.4).

Expected values come from torchzero 0.4.4 run in float32 (where torchzero has a defect, the
intended values, worked out by hand below) and from the NumPy oracle, written from torchzero's
formulas.
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
from tests import hlo
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

def oracle_value_growth(seq, *, add=None, mul=1.5, min_value=1e-4, max_decay=2.0):
    """Outputs and stored references per step, elementwise."""
    dtype = seq[0][0].dtype.type
    prev, outs, prevs = None, [], []
    for xs in seq:
        if prev is None or (add is None and mul is None):
            prev = [x.copy() for x in xs]
            outs.append(list(xs))
            prevs.append(prev)
            continue
        out, new_prev = [], []
        for x, p in zip(xs, prev):
            x = x.copy()
            if add is not None:
                grow = np.maximum(np.abs(x) - np.abs(p), 0)
                x = np.where(grow > add, x - (grow - dtype(add)) * np.sign(x), x)
            m = np.abs(p) if min_value is None else np.maximum(np.abs(p), dtype(min_value))
            with np.errstate(divide="ignore", invalid="ignore"):
                r = np.maximum(np.abs(x) / m, dtype(1e-8))
                if mul is not None:
                    x = np.where(r > mul, x / (r / dtype(mul)), x)
            new_prev.append(x if max_decay is None
                            else np.where(r < 1 / max_decay, p / dtype(max_decay), x))
            out.append(x)
        prev = new_prev
        outs.append(out)
        prevs.append(prev)
    return outs, prevs


def oracle_norm_growth(seq, *, add=None, mul=1.5, min_value=1e-4, max_decay=2.0, ord=2,
                       parameterwise=True):
    """Outputs and reference norms per step (torchzero's, with its defects fixed); the global mode
    concatenates the leaves (the definition)."""
    dtype = seq[0][0].dtype.type
    groups = ([[i] for i in range(len(seq[0]))] if parameterwise
              else [list(range(len(seq[0])))])
    prev = [None] * len(groups)
    outs, prevs = [], []
    for xs in seq:
        out = list(xs)
        for k, idx in enumerate(groups):
            flat = np.concatenate([xs[i].ravel() for i in idx])
            if ord in ("std", "var") and flat.size < 2:
                prev[k] = dtype(0)
                continue
            n = np_metric(flat, ord)
            if prev[k] is None:
                prev[k] = n
                continue
            p = prev[k] if min_value is None else max(prev[k], dtype(min_value))
            d = dtype(1)
            with np.errstate(divide="ignore", invalid="ignore"):
                if add is not None and n > p + dtype(add):
                    d = n / (p + dtype(add))
                if mul is not None and n > p * dtype(mul):
                    d = max(d, n / (p * dtype(mul)))
                new = n / d
                if max_decay is not None and n / p < 1 / max_decay:
                    new = p / dtype(max_decay)
            if min_value is not None:
                new = max(new, dtype(min_value))
            prev[k] = new
            for i in idx:
                out[i] = xs[i] / d
        outs.append(out)
        prevs.append(list(prev))
    return outs, prevs


# ---------------------------------------------------------------------------------------------
# torchzero 0.4.4 vectors.

S4 = [[1, -2, 0, 1e-5], [3, -1, 5, 1], [-10, 0.1, 5, 0], [0, 0, 0, 0], [4, 4, 4, 4]]
S5 = [[[3, 4], [1]], [[30, 40], [0]], [[0.3, 0.4], [5]], [[0, 0], [0]], [[6, 8], [1]]]
ZERO_FIRST = [[0, 0], [3, 4], [3, 4]]

VALUE_VECTORS = [
    ("default", {}, S4, [[1, -2, 0, 9.9999997e-06], [1.5, -1, 0.00015000001, 0.00015000001],
                         [-2.2500002, 0.1, 0.00022500001, 0], [0, 0, 0, 0],
                         [1.6875001, 0.375, 0.00016875, 0.00015000001]]),
    ("add_only", dict(add=1, mul=None), S4,
     [[1, -2, 0, 9.9999997e-06], [2, -1, 1, 1], [-3, 0.1, 2, 0], [0, 0, 0, 0],
      [2.5, 1.25, 2, 1.25]]),
    ("no_floor", dict(min_value=None), S4,
     [[1, -2, 0, 9.9999997e-06], [1.5, -1, 0, 1.5000001e-05], [-2.2500002, 0.1, 0, 0],
      [0, 0, 0, 0], [1.6875001, 0.375, 0, 5.6250005e-06]]),
    ("zero_first_step", {}, ZERO_FIRST,
     [[0, 0], [0.00015000001, 0.00015000001], [0.00022500001, 0.00022500001]]),
    ("identity", dict(add=None, mul=None), S4, S4),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name,kwargs,seq,expected", VALUE_VECTORS,
                         ids=[v[0] for v in VALUE_VECTORS])
def test_clip_value_growth_reference_vectors(name, kwargs, seq, expected, jit):
    outs, _ = run(optclip.clip_value_growth(**kwargs), [as_tree(s) for s in seq], jit=jit)
    for step, (out, want) in enumerate(zip(outs, expected)):
        np.testing.assert_allclose(out[0], np.asarray(want, np.float32), rtol=RTOL, atol=ATOL,
                                   err_msg=f"step {step + 1}")


def test_clip_value_growth_stored_reference():
    _, states = run(optclip.clip_value_growth(), [as_tree(s) for s in S4])
    want = [[1, -2, 0, 1e-5], [1.5, -1, 1.5e-4, 1.5e-4], [-2.25, -0.5, 2.25e-4, 7.5e-5],
            [-1.125, -0.25, 1.125e-4, 3.75e-5], [1.6875, 0.375, 1.6875e-4, 1.5e-4]]
    for step, (state, w) in enumerate(zip(states, want)):
        np.testing.assert_allclose(state.prev[0], w, rtol=RTOL, atol=ATOL, err_msg=f"{step}")


NORM_VECTORS = [
    ("default", {}, S5,
     [[[3, 4], [1]], [[4.5, 6], [0]], [[0.30000001, 0.40000001], [0.75]], [[0, 0], [0]],
      [[1.6875, 2.25], [0.5625]]]),
    ("global", dict(parameterwise=False), S5,
     [[[3, 4], [1]], [[4.5891175, 6.1188231], [0]], [[0.30000001, 0.40000001], [5]],
      [[0, 0], [0]], [[2.25, 3], [0.375]]]),
    ("add", dict(add=1), S5,
     [[[3, 4], [1]], [[3.6000001, 4.8000002], [0]], [[0.30000001, 0.40000001], [0.75]],
      [[0, 0], [0]], [[1.3499999, 1.8], [0.5625]]]),
    # † D13: min_value floors the reference only. By hand, leaf 2: p=1; step 2 n=0 decays to
    # max(2/2, 2)=2; step 3 n=5 > 2*1.5 -> d=5/3 -> [3] (torchzero: d=max(5/3, 2) -> [2.5]);
    # step 5 n=1 <= 1.5*2 -> [1] (torchzero [0.5]). Leaf 1 is unaffected by D13.
    ("min_value_2", dict(min_value=2), S5,
     [[[3, 4], [1]], [[4.5, 6], [0]], [[0.30000001, 0.40000001], [3]], [[0, 0], [0]],
      [[1.8000001, 2.4000001], [1]]]),
    # † D14: the floor applies to the first stored norm: p'=1e-4, cap 1.5e-4 -> [3,4]*3e-5.
    ("zero_first_step", {}, [[s] for s in ZERO_FIRST],
     [[[0, 0]], [[9e-05, 0.00012]], [[0.000135, 0.00018]]]),
    # † D15: no caps is the identity (torchzero crashes at step 2).
    ("no_caps", dict(add=None, mul=None), S5, S5),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name,kwargs,seq,expected", NORM_VECTORS,
                         ids=[v[0] for v in NORM_VECTORS])
def test_clip_norm_growth_reference_vectors(name, kwargs, seq, expected, jit):
    outs, _ = run(optclip.clip_norm_growth(**kwargs), [as_tree(s) for s in seq], jit=jit)
    for step, (out, want) in enumerate(zip(outs, expected)):
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, np.asarray(w, np.float32), rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {step + 1}")


@pytest.mark.parametrize("parameterwise,want", [
    (True, [[5, 1], [7.5, 0.5], [3.75, 0.75], [1.875, 0.375], [2.8125, 0.5625]]),
    (False, [[5.0990195], [7.6485291], [5.0249376], [2.5124688], [3.7687032]]),
])
def test_clip_norm_growth_stored_reference(parameterwise, want):
    trees = [as_tree(s) for s in S5]
    _, states = run(optclip.clip_norm_growth(parameterwise=parameterwise), trees)
    for step, (state, w) in enumerate(zip(states, want)):
        np.testing.assert_allclose(per_leaf_np(state.prev_norm, trees[0]), w, rtol=RTOL,
                                   err_msg=f"{step}")
    assert [bool(np.any(per_leaf_np(s.clipped, trees[0]))) for s in states] == [
        False, True, parameterwise, False, True]


# ---------------------------------------------------------------------------------------------
# Against the NumPy oracle.

VALUE_OPTIONS = [dict(), dict(add=0.5), dict(add=0.2, mul=None), dict(min_value=None),
                 dict(max_decay=None), dict(mul=1.1, max_decay=3.0, min_value=1e-2),
                 dict(add=None, mul=None), dict(mul=1e-9), dict(max_decay=1e9)]


@pytest.mark.parametrize("kwargs", VALUE_OPTIONS, ids=str)
def test_clip_value_growth_matches_oracle(kwargs):
    seq = random_sequence(seed=21)
    outs, states = run(optclip.clip_value_growth(**kwargs), [as_tree(s) for s in seq])
    want_outs, want_prevs = oracle_value_growth(seq, **kwargs)
    for step, (out, want, state, prev) in enumerate(zip(outs, want_outs, states, want_prevs)):
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=ORACLE_RTOL, atol=1e-7, err_msg=f"{step}")
        if kwargs.get("mul", 1.5) is not None or kwargs.get("add") is not None:
            for got, p in zip(to_np(state.prev), prev):
                np.testing.assert_allclose(got, p, rtol=ORACLE_RTOL, atol=1e-7)


@pytest.mark.parametrize("kwargs", [dict(), dict(add=0.5, mul=1.1, max_decay=3.0),
                                    dict(min_value=None, mul=1.0, max_decay=1.0)], ids=str)
def test_value_growth_numbers_and_schedules_agree_bit_for_bit(kwargs):
    """A ``mul`` and ``max_decay`` known as numbers leave the tests of the ratio's ``1e-8``
    floor out of the step, and with ``mul >= 1`` read the new reference from the output and
    the old reference; as schedules (known only at the step) they keep the tests and read the
    reference from the update: the same outputs and states, bit for bit."""
    kwargs = {"mul": 1.5, "max_decay": 2.0, **kwargs}
    scheduled = {k: (lambda count, v=v: v) for k, v in kwargs.items()
                 if k in ("mul", "max_decay")}
    seq = [as_tree(s) for s in random_sequence(seed=23)]
    outs, states = run(optclip.clip_value_growth(**kwargs), seq, jit=True)
    want_outs, want_states = run(optclip.clip_value_growth(**{**kwargs, **scheduled}), seq,
                                 jit=True)
    chex.assert_trees_all_equal((outs, states), (want_outs, want_states))


NORM_OPTIONS = [dict(), dict(add=0.5), dict(add=2.0, mul=None), dict(min_value=None),
                dict(max_decay=None), dict(min_value=3.0), dict(mul=0.9, max_decay=4.0)]
NORM_ORDS = [2, 1, math.inf, 0, 3, "mad", "std", "sum"]


@pytest.mark.parametrize("parameterwise", [True, False], ids=["parameterwise", "global"])
@pytest.mark.parametrize("kwargs", NORM_OPTIONS, ids=str)
def test_clip_norm_growth_options_match_oracle(kwargs, parameterwise):
    seq = random_sequence(seed=22)
    trees = [as_tree(s) for s in seq]
    outs, states = run(optclip.clip_norm_growth(parameterwise=parameterwise, **kwargs), trees)
    want_outs, want_prevs = oracle_norm_growth(seq, parameterwise=parameterwise, **kwargs)
    for step, (out, want, state, prev) in enumerate(zip(outs, want_outs, states, want_prevs)):
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=ORACLE_RTOL, atol=1e-7, err_msg=f"{step}")
        np.testing.assert_allclose(per_leaf_np(state.prev_norm, trees[0]), prev,
                                   rtol=ORACLE_RTOL, atol=1e-7)


@pytest.mark.parametrize("parameterwise", [True, False], ids=["parameterwise", "global"])
@pytest.mark.parametrize("ord", NORM_ORDS, ids=str)
def test_clip_norm_growth_ords_match_oracle(ord, parameterwise):
    seq = random_sequence(seed=30 + NORM_ORDS.index(ord))
    outs, _ = run(optclip.clip_norm_growth(ord=ord, add=1.0, parameterwise=parameterwise),
                  [as_tree(s) for s in seq])
    want_outs, _ = oracle_norm_growth(seq, ord=ord, add=1.0, parameterwise=parameterwise)
    for out, want in zip(outs, want_outs):
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=ORACLE_RTOL, atol=1e-7)


@pytest.mark.parametrize("factory,oracle", [
    (optclip.clip_value_growth, oracle_value_growth),
    (functools.partial(optclip.clip_norm_growth, parameterwise=False),
     functools.partial(oracle_norm_growth, parameterwise=False)),
])
def test_float64_matches_oracle(factory, oracle):
    with jax.enable_x64(True):
        seq = random_sequence(seed=8, dtype=np.float64)
        outs, states = run(factory(add=0.3), [as_tree(s, jnp.float64) for s in seq],
                           jit=True)
        want_outs, _ = oracle(seq, add=0.3)
        for out, want in zip(outs, want_outs):
            for got, w in zip(out, want):
                assert got.dtype == jnp.float64
                np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-300)
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(states[-1])
                   if jnp.issubdtype(x.dtype, jnp.floating))


def test_global_mode_never_concatenates_leaves():
    tx = optclip.clip_norm_growth(parameterwise=False)
    tree = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    jaxpr = jax.make_jaxpr(tx.update)(tree, tx.init(tree)).jaxpr
    assert all(size <= 1 for size in concatenated_operand_sizes(jaxpr))


# ---------------------------------------------------------------------------------------------
# Properties: growth bounded by mul (and add) relative to the stored reference.

@functools.cache
def _property_transform(kind, parameterwise=True):
    tx = (optclip.clip_value_growth(add=0.7, mul=1.3) if kind == "value"
          else optclip.clip_norm_growth(add=0.7, mul=1.3, parameterwise=parameterwise))
    return tx, jax.jit(tx.update)


@given(seq=sequences)
def test_value_growth_bounded_by_reference(seq):
    tx, update = _property_transform("value")
    state = tx.init([jnp.asarray(x) for x in seq[0]])
    for t, xs in enumerate(seq):
        before = to_np(state.prev)
        out, state = update([jnp.asarray(x) for x in xs], state)
        if t == 0:
            continue
        for o, x, p in zip(to_np(out), xs, before):
            assert np.all(np.abs(o) <= 1.3 * np.maximum(np.abs(p), 1e-4) * (1 + 1e-5))
            # torchzero's additive step x - (g - add) sign(x) cancels: ulps of |x|, not of |o|.
            slack = 4 * np.finfo(np.float32).eps * np.abs(x)
            assert np.all(np.abs(o) <= (np.abs(p) + 0.7) * (1 + 1e-5) + slack)
            assert np.all(np.abs(o) <= np.abs(x)) and np.all(np.sign(o) * np.sign(x) >= 0)


@pytest.mark.parametrize("parameterwise", [True, False])
@given(seq=sequences)
def test_norm_growth_bounded_by_reference(parameterwise, seq):
    tx, update = _property_transform("norm", parameterwise)
    params = [jnp.asarray(x) for x in seq[0]]
    state = tx.init(params)
    for t, xs in enumerate(seq):
        before = per_leaf_np(state.prev_norm, params)
        out, state = update([jnp.asarray(x) for x in xs], state)
        out_norms = ([np.linalg.norm(o) for o in to_np(out)] if parameterwise
                     else [np.linalg.norm(np.concatenate([o.ravel() for o in to_np(out)]))])
        for got, p in zip(out_norms, before):
            if t > 0:
                p = max(p, 1e-4)
                assert got <= min(1.3 * p, p + 0.7) * (1 + 1e-5)
        assert all(p >= 1e-4 for p in per_leaf_np(state.prev_norm, params)) or t == 0


# ---------------------------------------------------------------------------------------------
# Non-finite steps of the configuration the conformance table (tests/registry.py) does not
# hold (per parameter); its entries go through the whole contract in tests/test_conformance.py.

_norm_parameterwise = functools.cache(lambda: optclip.clip_norm_growth(add=0.5))


@pytest.mark.parametrize("bad_step", [0, 3])
@pytest.mark.parametrize(("index", "poison"), [(0, math.nan), (-1, math.inf)],
                         ids=["nan_first", "inf_last"])
def test_nonfinite_step_leaves_state_unchanged(bad_step, index, poison):
    seq = [as_tree(s) for s in random_sequence(seed=1, steps=6)]
    assert_nonfinite_step_skipped(_norm_parameterwise(), seq, bad_step, index, poison)


@pytest.mark.parametrize("factory", [optclip.clip_value_growth, optclip.clip_norm_growth])
def test_stats_report_clipping(factory):
    tx = factory(add=0.5)
    tree = [jnp.ones((3, 2))]
    logged = optclip.stats(tx.update(tree, tx.init(tree))[1])
    assert any(key.endswith(("/clipped", "/clipped_frac")) for key in logged), sorted(logged)


def test_clip_norm_growth_one_state_class_and_stats_keys():
    """Both layouts share one state class; stats summarises the per-leaf trees and reports the
    global mode's scalars as they are."""
    tree = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, 12.0])}
    by_leaf = optclip.clip_norm_growth()
    whole = optclip.clip_norm_growth(parameterwise=False)
    s1, s2 = by_leaf.init(tree), whole.init(tree)
    assert type(s1) is type(s2)
    logged = optclip.stats(by_leaf.update(tree, s1)[1])
    np.testing.assert_allclose(float(logged["clip_norm_growth/norm_max"]), 12.0, rtol=1e-6)
    np.testing.assert_allclose(float(logged["clip_norm_growth/norm_mean"]), 8.5, rtol=1e-6)
    assert "clip_norm_growth/clipped_frac" in logged
    logged = optclip.stats(whole.update(tree, s2)[1])
    np.testing.assert_allclose(float(logged["clip_norm_growth/norm"]), 13.0, rtol=1e-6)
    assert "clip_norm_growth/clipped" in logged and "clip_norm_growth/norm_max" not in logged


def test_bfloat16_growth_is_limited():
    """A tenfold step in bfloat16 grows by at most ``mul`` (1.5) over the stored reference."""
    for tx in (optclip.clip_value_growth(add=0.5), optclip.clip_norm_growth(add=0.5)):
        tree = {"w": jnp.ones((3, 2), jnp.bfloat16) * 3}
        _, state = tx.update(tree, tx.init(tree))
        out, _ = tx.update(jax.tree.map(lambda x: x * 10, tree), state)
        assert out["w"].dtype == jnp.bfloat16
        assert float(jnp.max(jnp.abs(out["w"].astype(jnp.float32)))) <= 3 * 1.5 * (1 + 1e-2)


def test_traced_hyperparameters_with_inject_hyperparams():
    seq = [as_tree(s) for s in S5]
    plain, _ = run(optclip.clip_norm_growth(add=1.0), seq)
    tx = optax.inject_hyperparams(optclip.clip_norm_growth, static_args=("ord",))(add=1.0)
    injected, _ = run(tx, seq, jit=True)
    chex.assert_trees_all_close(injected, plain, rtol=1e-6)


@pytest.mark.parametrize("kwargs,name", [
    (dict(add=-1.0), "add"), (dict(mul=0.0), "mul"), (dict(mul="x"), "mul"),
    (dict(min_value=-1.0), "min_value"), (dict(max_decay=-2.0), "max_decay"),
])
@pytest.mark.parametrize("factory", [optclip.clip_value_growth, optclip.clip_norm_growth])
def test_growth_rejects_bad_arguments(factory, kwargs, name):
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        factory(**kwargs)


@pytest.mark.parametrize("kwargs,name", [(dict(ord="l5"), "ord"),
                                         (dict(parameterwise="no"), "parameterwise")])
def test_clip_norm_growth_rejects_bad_arguments(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        optclip.clip_norm_growth(**kwargs)


@pytest.mark.parametrize("parameterwise", [True, False])
@pytest.mark.parametrize("ord", ["mad", -math.inf], ids=str)
def test_empty_leaves_keep_reference_finite(ord, parameterwise):
    tx = optclip.clip_norm_growth(ord=ord, parameterwise=parameterwise)
    tree = [jnp.zeros((0, 3)), jnp.array([3.0, 4.0])] if parameterwise else [jnp.zeros((0, 3))]
    state = tx.init(tree)
    for _ in range(2):
        out, state = tx.update(tree, state)
    assert int(state.count) == 2 and int(state.nonfinite) == 0
    assert all(np.all(np.isfinite(x)) for x in to_np(out))


@pytest.mark.parametrize("factory", [functools.partial(optclip.clip_value_growth, add=0.3),
                                     optclip.clip_norm_growth])
def test_leaves_of_two_statistics_dtypes_each_against_their_own_reference(factory):
    """float32 and float64 leaves (their per-leaf decisions taken on one vector per statistics
    dtype) give what each leaf gives alone."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        dtypes = {"a": jnp.float32, "b": jnp.float64, "c": jnp.float32, "d": jnp.float64}
        seq = [{k: jnp.asarray(rng.normal(size=(3,)) * s * (i + 1), d)
                for i, (k, d) in enumerate(dtypes.items())} | {"n": jnp.arange(2)}
               for s in (1.0, 9.0, 0.1, 4.0)]
        tx = factory()
        update = jax.jit(tx.update)
        state = tx.init(seq[0])
        alone = {k: (tx.init(seq[0][k]), []) for k in dtypes}
        for g in seq:
            out, state = update(g, state)
            for k, (s, outs) in alone.items():
                o, s = update(g[k], s)
                alone[k] = (s, outs + [o])
                np.testing.assert_array_equal(out[k], o)
                assert out[k].dtype == dtypes[k]
        for k, (s, _) in alone.items():
            for field in s._fields[1:-1]:   # per-leaf vectors: the tree's are float64
                both, one = getattr(state, field), getattr(s, field)
                if field != "prev":
                    both, one = optclip.per_leaf(both, seq[0]), optclip.per_leaf(one, seq[0][k])
                np.testing.assert_array_equal(both[k], one)
        np.testing.assert_array_equal(out["n"], seq[-1]["n"])


# ---------------------------------------------------------------------------------------------
# clip_value_growth's statistics (each read off one reduction over the update and reference).

def _second_step(tx, first, second):
    update = jax.jit(tx.update)
    _, state = update(jnp.asarray(first), tx.init(jnp.asarray(first)))
    return update(jnp.asarray(second), state)


@pytest.mark.parametrize(("second", "clipped", "ratio"), [
    # |-3| - |-2| = 1 > add: -3 becomes -2.5, whose ratio 2.5 / 2 = 1.25 is the largest.
    ([1.2, -3.0, 0.0], True, [np.float32(2.5) / np.float32(2.0)]),
    # Nothing grows by more than add: unchanged; 0.25 over the floor 1e-4 is the largest.
    ([1.2, -2.4, 0.25], False, [np.float32(0.25) / np.float32(1e-4)]),
], ids=["limited", "unlimited"])
def test_value_growth_additive_cap_flag_and_ratio(second, clipped, ratio):
    """``clipped`` holds exactly when the additive cap limits an element (no multiplicative
    cap), and ``max_ratio`` is measured after the additive cap."""
    out, state = _second_step(optclip.clip_value_growth(add=0.5, mul=None), [1.0, -2.0, 0.0],
                              second)
    want = [1.2, -2.5, 0.0] if clipped else second
    np.testing.assert_array_equal(out, np.asarray(want, np.float32))
    assert bool(optclip.per_leaf(state.clipped, out)) is clipped
    assert float(optclip.per_leaf(state.max_ratio, out)) == float(ratio[0])


@pytest.mark.parametrize(("second", "ratio", "out"), [
    ([0.0, 2.5], 1.25, [0.0, 2.5]),           # 0 over a zero reference has no ratio
    ([1.0, 2.5], math.inf, [0.0, 2.5]),       # anything else over a zero reference stays 0
])
def test_value_growth_zero_reference_without_floor(second, ratio, out):
    got, state = _second_step(optclip.clip_value_growth(min_value=None), [0.0, 2.0], second)
    np.testing.assert_array_equal(got, np.asarray(out, np.float32))
    assert float(optclip.per_leaf(state.max_ratio, got)) == ratio
    assert bool(optclip.per_leaf(state.clipped, got)) is (ratio > 1.5)


@pytest.mark.parametrize(("index", "poison"), [(0, math.nan), (-1, -math.inf)])
def test_value_growth_additive_nonfinite_step_leaves_state_unchanged(index, poison):
    """With ``add``, one sum gives both the finiteness and the additive-cap flag."""
    seq = [as_tree(s) for s in random_sequence(seed=2, steps=5)]
    assert_nonfinite_step_skipped(optclip.clip_value_growth(add=0.1, mul=None), seq, 2, index,
                                  poison)


@pytest.mark.skipif(not hlo.recorded_xla(), reason="exact pass counts of one XLA version")
def test_value_growth_step_passes():
    """Beyond adam's passes: the ratio reduction reads the update and the reference (2), the
    finiteness sum the update (1; with ``add`` also the reference: 2); one conditional on the
    step's finiteness writes the output from the update and the reference over the update
    (3), and the new reference from the output and the old reference over the old one (3);
    adam's two kernels that read the output also read the new reference (2: a held step's
    output is limited there). Where the reference cannot be read from the output
    (``mul < 1``), the output leaves through the conditional from both branches and is
    written to a temporary (3), whose new reference also reads the update (4). No copy: the
    conditional orders the in-place writes after every read of what they overwrite.
    """
    for kwargs, extra in (({}, 11), ({"add": 0.5, "mul": None}, 12), ({"min_value": None}, 11),
                          ({"mul": 0.5}, 10)):
        tx = optax.chain(optclip.clip_value_growth(**kwargs), optax.adam(1e-3))
        assert hlo.extra_passes(tx, optax.adam(1e-3)) == extra, kwargs


@pytest.mark.skipif(not hlo.recorded_xla(), reason="buffer assignment of one XLA version")
@pytest.mark.parametrize("kwargs, writes_temporary", [
    ({}, False), ({"add": 0.5, "mul": None}, False), ({"mul": 0.5}, True)], ids=str)
def test_value_growth_output_over_the_donated_update(kwargs, writes_temporary):
    """With the reference read from the output, a held step hands the update back in the
    output's place, so XLA writes the output over the donated update: the compiled step of
    ``chain(clip_value_growth, adam)`` needs no temporary the size of a leaf (on a CPU such a
    temporary, new every step, faults in every page). The through-the-gate form (``mul < 1``)
    writes one per leaf."""
    tx = optax.chain(optclip.clip_value_growth(**kwargs), optax.adam(1e-3))
    leaf_bytes = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(hlo.TREE))
    temporary = hlo.compiled_step(tx, hlo.TREE).memory_analysis().temp_size_in_bytes
    assert (temporary >= hlo.LARGE * leaf_bytes) == writes_temporary, temporary
