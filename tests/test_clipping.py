"""Stateless clippers and normalizers: reference vectors, intended fixes, an oracle, properties."""

from __future__ import annotations

import math

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import optclip

F32 = dict(rtol=1e-6, atol=1e-9)


def leaves(*xs, dtype=np.float32):
    return [jnp.asarray(np.asarray(x, dtype)) for x in xs]


def apply(tx, grads):
    return tx.update(grads, tx.init(grads))[0]


def assert_leaves(actual, expected, **tol):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                                   **(tol or F32))


# ---------------------------------------------------------------------------------------------
# Vectors from torchzero 0.4.4 (float32), with the intended values in place of the cells where
# torchzero has a defect.

A = [[3, 4], 12.0]
G = [[3, 4], [0.5], [[3, 4], [0, 5]]]
G_MIN = [[0.3, 0.4], [0.5], [[3, 4], [0, 5]]]
WHOLE = [[0.42426407, 0.56568545], [0, 0.70710683]]     # [[3,4],[0,5]] clipped to norm 1

TORCHZERO_VECTORS = [
    # id, transform, input, expected
    ("1-D1", lambda: optclip.normalize(), [[3, 4], [[1, 2], [2, 4]]],
     [[0.6, 0.8], [[0.2, 0.4], [0.4, 0.8]]]),
    ("2", lambda: optclip.normalize(), [[[1, 2], [2, 4]], [3, 4]],
     [[[0.2, 0.40000001], [0.40000001, 0.80000001]], [0.60000002, 0.80000001]]),
    ("3", lambda: optclip.clip_norm(1.0), A, [[0.60000002, 0.80000001], 1]),
    ("4", lambda: optclip.clip_norm(1.0, dim="global"), A,
     [[0.23076925, 0.30769232], 0.92307699]),
    ("5", lambda: optclip.clip_norm(100.0, dim="global"), A, A),
    ("6", lambda: optclip.normalize(2.0, dim="global"), A,
     [[0.46153849, 0.61538464], 1.846154]),
    ("7", lambda: optclip.clip_norm(2.0, dim=1), [[[3, 4], [0.3, 0.4]]],
     [[[1.2, 1.6], [0.30000001, 0.40000001]]]),
    ("8", lambda: optclip.clip_norm(2.0, dim=0), [[[3, 4], [0.3, 0.4]]],
     [[[1.9900744, 1.9900743], [0.19900745, 0.19900744]]]),
    ("9", lambda: optclip.normalize(1.0, dim=0), [[[3, 4], [0.3, 0.4]]],
     [[[0.9950372, 0.99503714], [0.099503726, 0.099503718]]]),
    ("10", lambda: optclip.centralize(), [[1, 2, 6]], [[-2, -1, 3]]),
    ("11", lambda: optclip.centralize(dim=0), [[[1, 2], [3, 8]]], [[[-1, -3], [1, 3]]]),
    ("12", lambda: optclip.centralize(dim=0, inverse_dims=True), [[[1, 2], [3, 8]]],
     [[[-0.5, 0.5], [-2.5, 2.5]]]),
    ("13", lambda: optclip.centralize(), [[[1, 2], [3, 8]]], [[[-2.5, -1.5], [-0.5, 4.5]]]),
    ("14", lambda: optclip.centralize(), [[5], [1, 3]], [[5], [-1, 1]]),
    ("15", lambda: optclip.centralize(dim="global"), [[5], [1, 3]], [[2], [-2, 0]]),
    ("16", lambda: optclip.clip_value(1.0), [[3, -4, 0.5]], [[1, -1, 0.5]]),
    # Intended behaviour where torchzero 0.4.4 has a defect.
    ("D1-centralize-0d", lambda: optclip.centralize(), [3.0, [1, 2, 6]], [3.0, [-2, -1, 3]]),
    ("D2", lambda: optclip.normalize(inverse_dims=True), [[3, 4], [[3, 4], [0, 5]]],
     [[3, 4], [[3, 4], [0, 5]]]),
    ("D3", lambda: optclip.normalize(dim=-1, inverse_dims=True), [[[3, 4], [0, 5]]],
     [[[1, 0.62469506], [0, 0.78086883]]]),
    ("D3-duplicate-axes", lambda: optclip.normalize(dim=[0, -1]), [[3, 4]], [[0.6, 0.8]]),
    ("D4", lambda: optclip.centralize(min_size=1), [3.0, [1, 3]], [0.0, [-1, 1]]),
    ("D5", lambda: optclip.normalize(dim="global"), [[0, 0]], [[0, 0]]),
    ("D6-normalize", lambda: optclip.normalize(1.0, ord=0, dim="global"), [[1, -2, 2, 0]],
     [[0.33333334, -0.66666669, 0.66666669, 0]]),
    ("D6-clip", lambda: optclip.clip_norm(0.5, ord="l0", dim="global"), [[1, -2, 2, 0]],
     [[0.16666667, -0.33333334, 0.33333334, 0]]),
    ("D7-normalize", lambda: optclip.normalize(2.0, ord="sum"), [[1, -4]], [[2 / 3, -8 / 3]]),
    ("D7-normalize-global", lambda: optclip.normalize(2.0, ord="sum", dim="global"), [[1, -4]],
     [[2 / 3, -8 / 3]]),
    ("D7-clip", lambda: optclip.clip_norm(0.5, ord="sum"), [[1, -4]], [[1 / 6, -2 / 3]]),
    ("D7-clip-global", lambda: optclip.clip_norm(5.0, ord="sum", dim="global"), [[1, -4]],
     [[1, -4]]),
    ("D8", lambda: optclip.clip_norm(0.5), [[1e-13, 0]], [[1e-13, 0]]),
    ("D8-normalize", lambda: optclip.normalize(2.0, dim="global"), [[1e-13, 0]], [[1e-13, 0]]),
    ("D9", lambda: optclip.normalize(2.0, ord="std"), [[3.0], [1, 2]],
     [[3.0], [2.8284271, 5.6568542]]),
    ("D10", lambda: optclip.centralize(dim=-1), [3.0, [1, 3]], [3.0, [-1, 1]]),
    ("D17", lambda: optclip.normalize(1.0, ord=-1, dim="global"), [[1, -2, 2, 0]],
     [[1, -2, 2, 0]]),
]


@pytest.mark.parametrize("make, inputs, expected", [v[1:] for v in TORCHZERO_VECTORS],
                         ids=[v[0] for v in TORCHZERO_VECTORS])
def test_torchzero_vectors(make, inputs, expected):
    assert_leaves(apply(make(), leaves(*inputs)), expected)


HELPER_VECTORS = [
    ("17", lambda g: optclip.clip_grad_value(g, 1.0), [[3, -4], [0.5]], [[1, -1], [0.5]]),
    ("18-D1", lambda g: optclip.clip_grad_norm(g, 1.0), G, [[0.6, 0.8], [0.5], WHOLE]),
    ("19", lambda g: optclip.clip_grad_norm(g, 1.0, dim="global"), G,
     [[0.34583426, 0.46111232], [0.057639040], [[0.34583426, 0.46111232], [0, 0.57639039]]]),
    ("20-D1", lambda g: optclip.clip_grad_norm(g, 1.0, min_norm=2.0), G_MIN,
     [[1.2, 1.6], [0.5], WHOLE]),
    ("21", lambda g: optclip.clip_grad_norm(g, 1.0, min_norm=2.0, dim="global"), G_MIN,
     [[0.042215854, 0.056287803], [0.070359752],
      [[0.42215851, 0.56287801], [0, 0.70359755]]]),
    ("22-D1", lambda g: optclip.normalize_grads(g, 2.0), G,
     [[1.2, 1.6], [2], [[2 * x for x in row] for row in WHOLE]]),
    ("23", lambda g: optclip.normalize_grads(g, 2.0, dim="global"), G,
     [[0.69166851, 0.92222464], [0.11527808], [[0.69166851, 0.92222464], [0, 1.1527808]]]),
    ("min-norm-only", lambda g: optclip.clip_grad_norm(g, None, min_norm=2.0), G_MIN,
     [[1.2, 1.6], [0.5], [[3, 4], [0, 5]]]),
]


@pytest.mark.parametrize("call, inputs, expected", [v[1:] for v in HELPER_VECTORS],
                         ids=[v[0] for v in HELPER_VECTORS])
def test_torchzero_helper_vectors(call, inputs, expected):
    assert_leaves(call(leaves(*inputs)), expected)


ORD_SWEEP = [  # torchzero 0.4.4, input [1, -2, 2, 0]: (ord, Normalize(1), ClipNorm(0.5))
    (2, [0.33333334, -0.66666669, 0.66666669, 0], [0.16666667, -0.33333334, 0.33333334, 0]),
    ("l2", [0.33333334, -0.66666669, 0.66666669, 0], [0.16666667, -0.33333334, 0.33333334, 0]),
    (1, [0.2, -0.40000001, 0.40000001, 0], [0.1, -0.2, 0.2, 0]),
    (0, [0.33333334, -0.66666669, 0.66666669, 0], [0.16666667, -0.33333334, 0.33333334, 0]),
    ("l0", [0.33333334, -0.66666669, 0.66666669, 0], [0.16666667, -0.33333334, 0.33333334, 0]),
    (3, [0.3889111, -0.7778222, 0.7778222, 0], [0.19445555, -0.3889111, 0.3889111, 0]),
    (math.inf, [0.5, -1, 1, 0], [0.25, -0.5, 0.5, 0]),
    ("linf", [0.5, -1, 1, 0], [0.25, -0.5, 0.5, 0]),
    (-1, [1, -2, 2, 0], [1, -2, 2, 0]),
    ("mad", [0.80000001, -1.6, 1.6, 0], [0.40000001, -0.80000001, 0.80000001, 0]),
    ("std", [0.58554, -1.17108, 1.17108, 0], [0.29277, -0.58554, 0.58554, 0]),
    ("var", [0.34285712, -0.68571424, 0.68571424, 0], [0.17142856, -0.34285712, 0.34285712, 0]),
    ("sum", [1, -2, 2, 0], [0.5, -1, 1, 0]),
]


@pytest.mark.parametrize("dim", [None, "global"])
@pytest.mark.parametrize("ord, normalized, clipped", ORD_SWEEP, ids=[str(r[0]) for r in ORD_SWEEP])
def test_ord_sweep(ord, normalized, clipped, dim):
    g = leaves([1, -2, 2, 0])
    tol = dict(rtol=1e-5, atol=1e-9) if ord == "std" else F32
    assert_leaves(apply(optclip.normalize(1.0, ord=ord, dim=dim), g), [normalized], **tol)
    assert_leaves(apply(optclip.clip_norm(0.5, ord=ord, dim=dim), g), [clipped], **tol)


# Vectors from drytorch (float64).
DRYTORCH_IN = [[1.24, -1.64], [0.76, 0.44], [0.5]]
DRYTORCH_VECTORS = [
    ("GradValueClipper", optclip.clip_value(0.5), [[0.5, -0.5], [0.5, 0.44], [0.5]], 1e-15),
    ("GradParamNormalizer", optclip.normalize(1.0, eps=1e-8),
     [[0.603108271938362, -0.79765932740235], [0.865426275626355, 0.50103626483631],
      [0.99999998]], 1e-13),
    # D13 fixed: a one-element tensor becomes 0 instead of NaN.
    ("GradZScoreNormalizer", optclip.zscore_normalize(),
     [[0.707106777714325, -0.707106777714325], [0.707106749936549, -0.707106749936549], [0.0]],
     1e-13),
    # torch's clip_grad_norm_ multiplies by 1 / (n + 1e-6); optclip clips exactly (rtol 1e-6).
    ("GradNormClipper", optclip.clip_by_global_norm(1.0),
     [[0.541262615956801, -0.715863459813833], [0.331741603328362, 0.192060928242736],
      [0.218251054821291]], 1e-6),
]


@pytest.mark.parametrize("tx, expected, rtol", [v[1:] for v in DRYTORCH_VECTORS],
                         ids=[v[0] for v in DRYTORCH_VECTORS])
def test_drytorch_vectors_float64(tx, expected, rtol):
    with jax.enable_x64(True):
        out = apply(tx, leaves(*DRYTORCH_IN, dtype=np.float64))
        assert all(x.dtype == jnp.float64 for x in out)
        assert_leaves(out, expected, rtol=rtol, atol=1e-15)


def test_drytorch_global_clip_is_exact_to_max_norm():
    with jax.enable_x64(True):
        out = apply(optclip.clip_by_global_norm(1.0), leaves(*DRYTORCH_IN, dtype=np.float64))
        np.testing.assert_allclose(float(optax.tree.norm(out)), 1.0, rtol=1e-15)


# Vectors from declearn: L2Clipping = clip_norm, L2GlobalClipping = clip_by_global_norm.
DECLEARN_IN = {"w": [[3.0, 4.0], [0.0, 0.0]], "b": [0.5, -0.5], "s": [0.1, 0.2, 0.2]}
DECLEARN = [
    (1.0, "clip_norm", {"w": [[0.6, 0.8], [0, 0]]}),
    (1.0, "clip_by_global_norm", {
        "w": [[0.593042901287, 0.790723868382], [0, 0]],
        "b": [0.0988404835478, -0.0988404835478],
        "s": [0.0197680967096, 0.0395361934191, 0.0395361934191]}),
    (0.5, "clip_norm", {"w": [[0.3, 0.4], [0, 0]], "b": [0.353553390593, -0.353553390593]}),
    (0.5, "clip_by_global_norm", {
        "w": [[0.296521450643, 0.395361934191], [0, 0]],
        "b": [0.0494202417739, -0.0494202417739],
        "s": [0.00988404835478, 0.0197680967096, 0.0197680967096]}),
    (10.0, "clip_norm", {}),
    (10.0, "clip_by_global_norm", {}),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("max_norm, name, changed", DECLEARN)
def test_declearn_vectors(max_norm, name, changed, dtype):
    expected = {**DECLEARN_IN, **changed}
    with jax.enable_x64(dtype == np.float64):
        grads = {k: jnp.asarray(np.asarray(v, dtype)) for k, v in DECLEARN_IN.items()}
        out = apply(getattr(optclip, name)(max_norm), grads)
        tol = dict(rtol=1e-11, atol=1e-14) if dtype == np.float64 else dict(rtol=2e-7, atol=1e-9)
        for key in DECLEARN_IN:
            assert out[key].dtype == dtype
            np.testing.assert_allclose(out[key], expected[key], **tol)


def test_declearn_boundary_and_zero_edge_cases():
    assert_leaves(apply(optclip.clip_norm(5.0), leaves([3, 4])), [[3, 4]])
    assert_leaves(apply(optclip.clip_by_global_norm(5.0), leaves([3, 4])), [[3, 4]])
    zeros_and_one = leaves([0, 0, 0], [1, 0, 0])
    assert_leaves(apply(optclip.clip_norm(1.0), zeros_and_one), [[0, 0, 0], [1, 0, 0]])


# ---------------------------------------------------------------------------------------------
# Independent NumPy oracle over every ord x axes setting x leaf shapes.

ORDS = [2, 1, 0, 3, 0.5, -1, math.inf, -math.inf, "l4", "mad", "std", "var", "sum"]
AXES = [dict(dim=None), dict(dim=0), dict(dim=-1), dict(dim=(0, -1)), dict(dim=5),
        dict(dim=0, inverse_dims=True), dict(dim=-1, inverse_dims=True),
        dict(dim=None, min_size=4), dict(dim="global")]
SHAPES = [(), (5,), (3, 4), (2, 3, 2, 2), (0, 3)]


def np_metric(x, ord, axes):
    k = int(np.prod([x.shape[a] for a in axes]))
    a = np.abs(x)
    if ord == "mad":
        return a.sum(axis=axes, keepdims=True) / k
    if ord in ("std", "var"):
        if k < 2:
            return np.full(np.sum(x, axis=axes, keepdims=True).shape, np.nan)
        var = np.var(x, axis=axes, keepdims=True, ddof=1)
        return np.sqrt(var) if ord == "std" else var
    if ord == "sum":
        return np.abs(x.sum(axis=axes, keepdims=True))
    p = {"l4": 4.0}.get(ord, ord)
    if p == 0:
        return (x != 0).sum(axis=axes, keepdims=True).astype(float)
    if p == math.inf:
        return a.max(axis=axes, keepdims=True, initial=0.0)
    if p == -math.inf:
        return a.min(axis=axes, keepdims=True, initial=math.inf)
    with np.errstate(divide="ignore"):
        return (a ** p).sum(axis=axes, keepdims=True) ** (1 / p)


def np_axes(ndim, dim=None, inverse_dims=False):
    rank = max(ndim, 1)
    chosen = set(range(rank)) if dim is None else {
        d % rank for d in np.atleast_1d(dim) if -rank <= d < rank}
    if inverse_dims:
        chosen = set(range(rank)) - chosen
    return tuple(sorted(chosen)) if chosen else None


def np_transform(tree, ord, mode, bound, dim=None, inverse_dims=False, min_size=1):
    def factor(n):
        with np.errstate(divide="ignore", invalid="ignore"):
            if mode == "clip":
                return np.where(n > bound, bound / n, 1.0)
            return np.where(n > 1e-12, bound / n, 1.0)

    if dim == "global":
        flat = np.concatenate([x.ravel() for x in tree])
        f = factor(np_metric(flat, ord, (0,)))[0]
        return [x * f for x in tree]
    out = []
    for x in tree:
        axes = np_axes(x.ndim, dim, inverse_dims)
        y = x.reshape(x.shape or (1,))
        if axes is None or np.prod([y.shape[a] for a in axes]) < min_size:
            out.append(x)
            continue
        out.append((y * factor(np_metric(y, ord, axes))).reshape(x.shape))
    return out


@pytest.mark.parametrize("axes", AXES, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
@pytest.mark.parametrize("ord", ORDS, ids=str)
def test_numpy_oracle(ord, axes):
    rng = np.random.default_rng(0)
    tree = [rng.normal(size=s) * 2 for s in SHAPES]
    tree[2][0, 1] = 0.0                      # exact zeros matter for ord 0 and negative ords
    grads = [jnp.asarray(x, jnp.float32) for x in tree]
    tol = dict(rtol=3e-5, atol=1e-6)
    for mode, bound, tx in [("clip", 0.7, optclip.clip_norm(0.7, ord=ord, **axes)),
                            ("normalize", 1.5, optclip.normalize(1.5, ord=ord, **axes))]:
        expected = np_transform([x.astype(np.float32).astype(np.float64) for x in tree],
                                ord, mode, bound, **axes)
        assert_leaves(apply(tx, grads), expected, **tol)


# ---------------------------------------------------------------------------------------------
# Properties.

DTYPES = {"bfloat16": (jnp.bfloat16, 2e-2), "float16": (jnp.float16, 2e-3),
          "float32": (jnp.float32, 1e-5), "float64": (jnp.float64, 1e-12)}
finite_arrays = hnp.arrays(
    np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5),
    elements=st.floats(-300, 300, allow_nan=False, width=32))
bounds = st.floats(1e-2, 1e3)


def _norm(x):
    return float(np.linalg.norm(np.asarray(x, np.float64).ravel()))


@given(x=finite_arrays, max_norm=bounds, dtype=st.sampled_from(sorted(DTYPES)))
def test_clip_norm_properties(x, max_norm, dtype):
    jdtype, tol = DTYPES[dtype]
    with jax.enable_x64(dtype == "float64"):
        g = jnp.asarray(x, jdtype)
        x_in = np.asarray(g, np.float64)
        out = apply(optclip.clip_norm(max_norm), [g])[0]
        assert out.dtype == jdtype                                        # dtype kept
        y = np.asarray(out, np.float64)
        assert np.all(np.isfinite(y))                                     # finite in, finite out
        assert _norm(y) <= max(max_norm, 0) * (1 + tol) + 1e-30 or _norm(y) <= _norm(x_in) * (
            1 + tol)
        assert _norm(y) <= max_norm * (1 + tol) + tol * 1e-3 or _norm(x_in) <= max_norm
        assert _norm(y) <= _norm(x_in) * (1 + tol) + 1e-30                 # never raises a norm
        # direction kept: y = c * x with one c in [0, 1]
        c = _norm(y) / _norm(x_in) if _norm(x_in) > 0 else 1.0
        np.testing.assert_allclose(y, c * x_in, rtol=2 * tol, atol=2 * tol * np.abs(x_in).max())
        again = apply(optclip.clip_norm(max_norm), [out])[0]              # idempotent
        np.testing.assert_allclose(np.asarray(again, np.float64), y, rtol=2 * tol, atol=1e-30)


@given(x=finite_arrays, max_norm=bounds)
def test_global_clip_bound_and_idempotence(x, max_norm):
    tree = {"a": jnp.asarray(x, jnp.float32), "b": jnp.asarray(x[..., :1] * 3, jnp.float32)}
    tx = optclip.clip_by_global_norm(max_norm)
    out = apply(tx, tree)
    before, after = float(optax.tree.norm(tree)), float(optax.tree.norm(out))
    assert after <= min(before, max_norm) * (1 + 1e-5) or after <= before * (1 + 1e-6)
    chex.assert_trees_all_close(apply(tx, out), out, rtol=1e-5)


@given(x=finite_arrays, value=bounds)
def test_clip_value_bound_and_idempotence(x, value):
    g = jnp.asarray(x, jnp.float32)
    out = apply(optclip.clip_value(value), g)
    assert float(jnp.max(jnp.abs(out))) <= np.float32(value)
    np.testing.assert_array_equal(apply(optclip.clip_value(value), out), out)
    np.testing.assert_array_equal(np.sign(out), np.sign(g))


@given(x=finite_arrays, target=bounds)
def test_normalize_reaches_target_norm(x, target):
    g = jnp.asarray(x, jnp.float32)
    out = apply(optclip.normalize(target), g)
    if _norm(np.asarray(g)) > 1e-12:
        np.testing.assert_allclose(_norm(out), target, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Precision: float32 accumulation for narrow dtypes.

def test_many_bf16_leaves_give_the_true_global_norm():
    rng = np.random.default_rng(0)
    tree = [jnp.asarray(rng.normal(size=(64,)) * 0.01, jnp.bfloat16) for _ in range(960)]
    true = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in tree))
    state = optclip.clip_by_global_norm(1e-9).init(tree)
    _, state = jax.jit(optclip.clip_by_global_norm(1e-9).update)(tree, state)
    np.testing.assert_allclose(float(state.norm), true, rtol=1e-5)


def test_float16_gradients_of_magnitude_300_are_clipped_not_zeroed():
    g = [jnp.asarray([300.0, 0.0], jnp.float16)]
    tx = optclip.clip_by_global_norm(1.0)
    out, state = tx.update(g, tx.init(g))
    assert float(state.norm) == 300.0
    np.testing.assert_allclose(np.asarray(out[0], np.float32), [1.0, 0.0], rtol=1e-3)
    out = apply(optclip.clip_norm(1.0), g)
    np.testing.assert_allclose(np.asarray(out[0], np.float32), [1.0, 0.0], rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# Schedules and hyperparameter injection.

def test_threshold_schedule_is_followed():
    schedule = optax.linear_schedule(4.0, 1.0, transition_steps=3)
    g = [jnp.asarray([30.0, 40.0])]
    for tx in (optclip.clip_norm(schedule), optclip.clip_by_global_norm(schedule)):
        state = tx.init(g)
        update = jax.jit(tx.update)
        for step in range(4):
            out, state = update(g, state)
            np.testing.assert_allclose(_norm(out[0]), float(schedule(step)), rtol=1e-6)


def test_inject_hyperparams_needs_static_configuration_listed():
    with pytest.raises(TypeError, match="min_size is static configuration"):
        optax.inject_hyperparams(optclip.clip_norm, static_args=("ord",))(max_norm=1.0).init(
            [jnp.ones(2)])


def test_inject_hyperparams_with_a_schedule_and_a_static_ord():
    tx = optax.inject_hyperparams(
        optclip.clip_norm, static_args=("ord", "min_size", "inverse_dims"))(
        max_norm=optax.linear_schedule(2.0, 1.0, transition_steps=1), ord="linf")
    g = [jnp.asarray([3.0, -4.0])]
    state = tx.init(g)
    update = jax.jit(tx.update)
    out, state = update(g, state)
    np.testing.assert_allclose(out[0], [1.5, -2.0], rtol=1e-6)
    out, state = update(g, state)
    np.testing.assert_allclose(out[0], [0.75, -1.0], rtol=1e-6)
    assert float(optclip.stats(state)["clip_norm/norm_max"]) == 4.0


@pytest.mark.parametrize("factory, kwargs, message", [
    (optclip.clip_norm, dict(max_norm=-1.0), "max_norm must be > 0, got -1.0"),
    (optclip.clip_norm, dict(max_norm=1.0, ord="l5"), "ord must be a number or one of"),
    (optclip.clip_norm, dict(max_norm=1.0, ord=None), "ord must be a number or a string"),
    (optclip.clip_norm, dict(max_norm=1.0, dim=[0, 1.5]), "dim must contain ints"),
    (optclip.clip_by_global_norm, dict(max_norm=float("nan")), "max_norm must be > 0"),
    (optclip.clip_by_global_norm, dict(max_norm=True), "max_norm must be a number"),
    (optclip.clip_value, dict(value=0.0), "value must be > 0"),
    (optclip.normalize, dict(eps=0.0), "eps must be > 0"),
    (optclip.centralize, dict(min_size=-2), "min_size must be >= 0"),
    (optclip.zscore_normalize, dict(eps="small"), "eps must be a number"),
])
def test_bad_hyperparameters_name_the_parameter(factory, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(")):
        factory(**kwargs)


def test_helpers_validate_and_pass_integer_leaves():
    with pytest.raises(ValueError, match="value must be > 0"):
        optclip.clip_grad_value([jnp.ones(2)], -1.0)
    with pytest.raises(ValueError, match="min_norm must be > 0"):
        optclip.clip_grad_norm([jnp.ones(2)], 1.0, min_norm=-1.0)
    out = optclip.normalize_grads({"i": jnp.arange(3), "f": jnp.asarray([0.0, 2.0])}, 1.0)
    np.testing.assert_array_equal(out["i"], jnp.arange(3))
    np.testing.assert_array_equal(out["f"], [0.0, 1.0])


@pytest.mark.parametrize("make", [lambda: optclip.clip_value(1.0),
                                  lambda: optclip.clip_norm(1.0, ord=math.inf),
                                  lambda: optclip.clip_value_by_ema(),
                                  lambda: optclip.clip_value_growth()],
                         ids=["clip_value", "clip_norm_inf", "clip_value_by_ema",
                              "clip_value_growth"])
def test_a_nan_in_a_large_leaf_is_counted_as_nonfinite(make):
    # XLA:CPU's fast maximum over large arrays skips NaN: finiteness is not read off a maximum.
    tx = make()
    grads = {"w": jnp.ones((512, 512)).at[300, 7].set(jnp.nan)}
    update = jax.jit(tx.update)
    _, state = update(grads, tx.init(grads))
    logged = optclip.stats(state)
    assert [int(v) for k, v in logged.items() if k.endswith("/nonfinite")] == [1]


@pytest.mark.parametrize("group", [True, False])
def test_clip_value_logs_exact_peaks_and_counts_an_inf_among_grouped_leaves(group, monkeypatch):
    """Same-shape leaves share one reduction on a single device: the logged max_abs is exact per
    leaf, and an Inf (or NaN) in any one of them makes the step non-finite."""
    from optclip._core import norms
    monkeypatch.setattr(norms, "_may_group", lambda: group)
    rng = np.random.default_rng(7)
    grads = {f"w{i}": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32) for i in range(12)}
    tx = optclip.clip_value(0.5)
    update = jax.jit(lambda g, s: tx.update(g, s))        # traced afresh per case
    out, state = update(grads, tx.init(grads))
    max_abs = optclip.per_leaf(state.max_abs, grads)
    clipped = optclip.per_leaf(state.clipped, grads)
    for k, g in grads.items():
        assert float(max_abs[k]) == float(np.abs(np.asarray(g)).max())
        assert bool(clipped[k]) == bool(np.abs(np.asarray(g)).max() > 0.5)
        np.testing.assert_array_equal(out[k], np.clip(np.asarray(g), -0.5, 0.5))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        broken = dict(grads, w5=grads["w5"].at[2, 1].set(bad))
        _, after = update(broken, state)
        assert int(after.nonfinite) == int(state.nonfinite) + 1
        assert float(optclip.per_leaf(after.max_abs, grads)["w5"]) == float(max_abs["w5"])


@pytest.mark.parametrize("make", [lambda: optclip.clip_norm(1.0),
                                  lambda: optclip.normalize(2.0)], ids=["clip_norm", "normalize"])
def test_whole_leaf_norms_are_kept_as_one_vector_per_field(make):
    """With dim=None every leaf is one slice: its norm (and clip_norm's flag) is one entry of a
    vector over the floating leaves, not a tree of 0-d arrays (one output of the compiled step
    per leaf and field); per_leaf gives the tree back, and a non-finite step keeps it."""
    tx = make()
    grads = {"b": jnp.asarray([3.0, 4.0]), "n": jnp.arange(3), "s": jnp.asarray(0.5),
             "w": jnp.asarray([[0.1, 0.2], [0.2, 0.4]], jnp.bfloat16)}
    update = jax.jit(tx.update)
    state = tx.init(grads)
    assert state.norm.shape == (3,)
    out, state = update(grads, state)
    norms_ = optclip.per_leaf(state.norm, grads)
    assert norms_["n"] is None
    for k in ("b", "s", "w"):
        want = np.linalg.norm(np.asarray(grads[k], np.float64).ravel())
        np.testing.assert_allclose(float(norms_[k]), want, rtol=1e-6, err_msg=k)
        assert out[k].dtype == grads[k].dtype
    if hasattr(state, "clipped"):
        assert state.clipped.dtype == jnp.bool_
        assert optclip.per_leaf(state.clipped, grads) == {"b": True, "n": None, "s": False,
                                                          "w": False}
    eager = tx.update(grads, tx.init(grads))[1]
    chex.assert_trees_all_close(eager, state, rtol=1e-6)
    logged = {k.split("/")[1]: float(v) for k, v in optclip.stats(state).items()}
    assert logged["norm_max"] == pytest.approx(5.0)
    assert logged["norm_mean"] == pytest.approx(float(np.mean(state.norm)))
    bad = dict(grads, b=jnp.asarray([jnp.nan, 1.0]))
    _, after = update(bad, state)
    np.testing.assert_array_equal(after.norm, state.norm)
    assert int(after.nonfinite) == int(state.nonfinite) + 1
