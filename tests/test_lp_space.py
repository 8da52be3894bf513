"""optclip.lp_space: rai_toolbox's gradient transforms, projections and Frank-Wolfe.

Expected numbers come from rai_toolbox 0.2.1 run with torch, or from the NumPy oracles below,
written from rai_toolbox's formulas.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import optclip
from optclip import projections as projections_lib
from optclip._core import norms as norms_lib
from optclip._core import slices as slices_lib

F32 = np.float32
G2 = [[0.5, -1.0, 2.0], [-3.0, 0.25, 1.5]]
X1 = np.ones((2, 3))
G3 = [[[1.0, -2.0], [2.0, 0.5]], [[0.0, 3.0], [-4.0, 0.0]]]
G2B = [[-1.0, 0.5, 0.25], [2.0, -4.0, 1.0]]
X0 = [[0.1, 0.2, -0.3], [0.0, 0.5, 0.2]]
# Reference vectors are printed with 9 significant digits; parameters may differ from torch's fused
# multiply-add by one ulp.
TOL = dict(rtol=3e-7, atol=2e-7)


def arr(x, dtype=jnp.float32):
    return jnp.asarray(np.asarray(x, np.float64), dtype)


def pre_step(tx, x, g, lr=1.0):
    """One rai_toolbox step: the transform, then SGD. Returns (transformed gradient, new x)."""
    x, g = arr(x), arr(g)
    transformed, _ = tx.update(g, tx.init(x))
    sgd = optax.sgd(lr)
    u, _ = sgd.update(transformed, sgd.init(x))
    return transformed, optax.apply_updates(x, u)


def steps(tx, x, grads, dtype=jnp.float32):
    """Run ``tx`` (needs params) over ``grads``; returns the list of parameters after each step."""
    x = arr(x, dtype)
    state = tx.init(x)
    out = []
    for g in grads:
        u, state = tx.update(arr(g, dtype), state, x)
        x = optax.apply_updates(x, u)
        out.append(x)
    return out


# ---------------------------------------------------------------------------------------------
# rai_toolbox L1q (x, g, q, kwargs, param_ndim, lr, g', x'), kwargs = grad_scale / grad_bias.

L1Q_VECTORS = {
    "V1-seed": ([1, 1, 1], [0, 1, 2], 0.3, {"grad_scale": 1.8}, None, 1.0,
                [0, 0.899999976, 0.899999976], [1, 0.100000024, 0.100000024]),
    "V2": ([1, 1, 1], [0, 1, 2], 0.0, {}, None, 1.0, [0, 0.5, 0.5], [1, 0.5, 0.5]),
    "V3": ([1, 1, 1], [0, 1, 2], 1.0, {"grad_bias": 0.25}, None, 1.0, [0.25] * 3, [0.75] * 3),
    "V4": ([1, 1, 1], [0, 1, 2], 0.3, {}, -1, 1.0, [0, 1, 1], [1, 0, 0]),
    **{f"V5[{p}]": (X1, G2, 0.3, {"grad_scale": 1.8}, p, 1.0,
                    [[0, -0.899999976, 0.899999976], [-0.899999976, 0, 0.899999976]],
                    [[1, 1.89999998, 0.100000024], [1.89999998, 1, 0.100000024]])
       for p in (-1, 1)},
    "V6": (X1, G2, 0.3, {"grad_scale": 1.8}, None, 1.0,
           [[0, -0.449999988, 0.449999988], [-0.449999988, 0, 0.449999988]],
           [[1, 1.45000005, 0.550000012], [1.45000005, 1, 0.550000012]]),
    **{f"V7[{p}]": (X1, G2, 0.7, {"grad_scale": 1.8}, p, 1.0,
                    [[0, 0, 1.79999995], [-1.79999995, 0, 0]],
                    [[1, 1, -0.799999952], [2.79999995, 1, 1]]) for p in (-1, 1)},
    "V8": (X1, G2, 0.7, {"grad_scale": 1.8}, None, 1.0, [[0, 0, 0.899999976], [-0.899999976, 0, 0]],
           [[1, 1, 0.100000024], [1.89999998, 1, 1]]),
    "V9": (X1, G2, 0.5, {}, None, 1.0, [[0, 0, 0.333333343], [-0.333333343, 0, 0.333333343]],
           [[1, 1, 0.666666627], [1.33333337, 1, 0.666666627]]),
    "V10": (X1, G2, 0.5, {}, -1, 1.0, [[0, -0.5, 0.5], [-0.5, 0, 0.5]],
            [[1, 1.5, 0.5], [1.5, 1, 0.5]]),
    "V11": (X1, G2, 0.3, {}, 0, 1.0, [[1, -1, 1], [-1, 1, 1]], [[0, 2, 0], [2, 0, 0]]),
    "V12": (X1, G2, 0.5, {}, 0, 1.0, np.zeros((2, 3)), X1),
    "V13": (X1, G2, 0.4, {"grad_scale": 1.8, "grad_bias": 0.1}, None, 0.5,
            [[0.100000001, -0.349999994, 0.550000012], [-0.349999994, 0.100000001, 0.550000012]],
            [[0.949999988, 1.17499995, 0.725000024], [1.17499995, 0.949999988, 0.725000024]]),
    "V14": (X1, [[0, 0, 0], [1, -2, 0]], 0.0, {}, 1, 1.0, [[0, 0, 0], [0.5, -0.5, 0]],
            [[1, 1, 1], [0.5, 1.5, 1]]),
    "V15": (np.zeros((2, 2, 2)), G3, 0.5, {}, -1, 1.0,
            [[[0, -0.5], [0.5, 0]], [[0, 0.5], [-0.5, 0]]], None),
    "V16": (np.zeros((2, 2, 2)), G3, 0.5, {}, 1, 1.0,
            [[[0, -1], [1, 0]], [[0, 1], [-1, 0]]], None),
    "V17": (np.zeros((2, 2, 2)), G3, 0.5, {}, None, 1.0,
            [[[0, -0.25], [0.25, 0]], [[0, 0.25], [-0.25, 0]]], None),
    # Ties at the cut-off: the port keeps the lowest indices.
    "V18": (np.ones((2, 4)), [[1, 1, 1, 1], [2, -1, -1, 0.5]], 0.5, {}, -1, 1.0,
            [[0.5, 0.5, 0, 0], [0.5, -0.5, 0, 0]], None),
}


@pytest.mark.parametrize("case", L1Q_VECTORS, ids=str)
def test_l1q_normalize_reference_vectors(case):
    x, g, q, kwargs, param_ndim, lr, want_g, want_x = L1Q_VECTORS[case]
    got_g, got_x = pre_step(optclip.l1q_normalize(q, param_ndim=param_ndim, **kwargs), x, g, lr)
    np.testing.assert_allclose(got_g, np.asarray(want_g, F32), **TOL)
    if want_x is not None:
        np.testing.assert_allclose(got_x, np.asarray(want_x, F32), **TOL)


def test_l1q_seed_example_bitwise():
    """The rai_toolbox documentation example, exactly as printed by torch."""
    got_g, got_x = pre_step(optclip.l1q_normalize(q=0.30, param_ndim=None, grad_scale=1.8),
                            [1, 1, 1], [0, 1, 2])
    assert np.asarray(got_g).tolist() == [0.0, float(F32(0.9)), float(F32(0.9))]
    step = float(F32(1) - F32(0.9))   # 0.100000024
    assert np.asarray(got_x).tolist() == [1.0, step, step]


# ---------------------------------------------------------------------------------------------
# rai_toolbox top-q (lr = 1): (x, g, q, param_ndim, kwargs, g', x').

G22 = [[0.5, 1.0], [-2.5, 0.3]]
G5 = [1, -2, 3, -4, 5]
G6 = [1, -2, 3, -4, 5, -6]
TOPQ_VECTORS = [
    (np.ones((2, 2)), G22, 0.0, None, {}, G22, [[0.5, 0], [3.5, 0.699999988]]),
    (np.ones((2, 2)), G22, 0.25, None, {}, [[0.5, 1], [-2.5, 0]], [[0.5, 0], [3.5, 1]]),
    (np.ones((2, 2)), G22, 0.5, None, {}, [[0, 1], [-2.5, 0]], [[1, 0], [3.5, 1]]),
    (np.ones((2, 2)), G22, 0.75, None, {}, [[0, 0], [-2.5, 0]], [[1, 1], [3.5, 1]]),
    (np.ones((2, 2)), G22, 1.0, None, {}, np.zeros((2, 2)), np.ones((2, 2))),
    *[(X1, G2, q, p, {}, [[0, -1, 2], [-3, 0, 1.5]], [[1, 2, -1], [4, 1, -0.5]])
      for q in (0.3, 0.5) for p in (-1, 1)],
    *[(X1, G2, 0.7, p, {}, [[0, 0, 2], [-3, 0, 0]], [[1, 1, -1], [4, 1, 1]])
      for p in (-1, 1, None)],
    (X1, G2, 0.3, None, {}, [[0, -1, 2], [-3, 0, 1.5]], [[1, 2, -1], [4, 1, -0.5]]),
    (X1, G2, 0.5, None, {}, [[0, 0, 2], [-3, 0, 1.5]], [[1, 1, -1], [4, 1, -0.5]]),
    (X1, G2, 0.3, 0, {}, G2, [[0.5, 2, -1], [4, 0.75, -0.5]]),
    *[(X1, G2, q, 0, {}, np.zeros((2, 3)), X1) for q in (0.5, 0.7)],
    (X1, G2, 0.5, None, {"grad_scale": 2.0, "grad_bias": 0.5},
     [[0.5, 0.5, 4.5], [-5.5, 0.5, 3.5]], [[0.5, 0.5, -3.5], [6.5, 0.5, -2.5]]),
    *[(np.ones(5), G5, q, None, {}, [0, -2, 3, -4, 5], [1, 3, -2, 5, -4]) for q in (0.1, 0.3)],
    *[(np.ones(5), G5, q, None, {}, [0, 0, 0, -4, 5], [1, 1, 1, 5, -4]) for q in (0.5, 0.7)],
    (np.ones(5), G5, 0.9, None, {}, np.zeros(5), np.ones(5)),
    (np.ones(6), G6, 0.25, None, {}, [0, 0, 3, -4, 5, -6], [1, 1, -2, 5, -4, 7]),
    (np.ones(6), G6, 0.75, None, {}, [0, 0, 0, 0, 5, -6], [1, 1, 1, 1, -4, 7]),
    (np.ones(2), [1, -2], 0.25, None, {}, [1, -2], [0, 3]),
    (np.ones(2), [1, -2], 0.75, None, {}, [0, 0], [1, 1]),
    (np.ones(2), [1, -2], 0.4, -1, {}, [1, -2], [0, 3]),
    (np.ones(2), [1, -2], 0.5, -1, {}, [0, 0], [1, 1]),
]


@pytest.mark.parametrize("case", range(len(TOPQ_VECTORS)))
def test_top_q_reference_vectors(case):
    x, g, q, param_ndim, kwargs, want_g, want_x = TOPQ_VECTORS[case]
    got_g, got_x = pre_step(optclip.top_q(q, param_ndim=param_ndim, **kwargs), x, g)
    np.testing.assert_allclose(got_g, np.asarray(want_g, F32), **TOL)
    np.testing.assert_allclose(got_x, np.asarray(want_x, F32), **TOL)


@pytest.mark.parametrize("size,q,kept", [
    (3, 0.3, 2), (3, 0.5, 2), (3, 0.7, 1), (5, 0.1, 4), (5, 0.3, 4), (5, 0.5, 2), (5, 0.7, 2),
    (5, 0.9, 0), (2, 0.25, 2), (2, 0.75, 0), (1, 0.49, 1), (1, 0.5, 0)])
def test_top_q_count_is_double_precision_half_to_even(size, q, kept):
    """k = round((1 - q) * D) in double, banker's rounding."""
    g = jnp.arange(1.0, size + 1.0)
    tx = optclip.top_q(q, param_ndim=None)
    out, state = tx.update(g, tx.init(g))
    assert int(jnp.sum(out != 0)) == kept
    assert state.k.shape == (1,) and int(optclip.per_leaf(state.k, g)) == kept


# ---------------------------------------------------------------------------------------------
# rai_toolbox L1 / L2 normalization.

L1_ROWS = [[0.142857149, -0.285714298, 0.571428597],
           [-0.631578922, 0.0526315793, 0.315789461]]
L1_WHOLE = [[0.0606060624, -0.121212125, 0.24242425], [-0.363636374, 0.0303030312, 0.181818187]]
L2_ROWS = [[0.21821788, -0.436435759, 0.872871518], [-0.891952991, 0.0743294135, 0.445976496]]
L2_WHOLE = [[0.122859031, -0.245718062, 0.491436124], [-0.737154186, 0.0614295155, 0.368577093]]
SIGNS = [[1, -1, 1], [-1, 1, 1]]
NORMALIZE_VECTORS = [
    *[("l1", X1, G2, p, {}, L1_ROWS) for p in (-1, 1)],
    *[("l1", X1, G2, p, {}, L1_WHOLE) for p in (None, 2)],
    *[(o, X1, G2, p, {}, SIGNS) for o in ("l1", "l2") for p in (0, -2)],
    *[("l2", X1, G2, p, {}, L2_ROWS) for p in (-1, 1)],
    ("l2", X1, G2, None, {}, L2_WHOLE),
    ("l1", [-1, 1], [2, 2], None, {}, [0.5, 0.5]),
    ("l2", [-1, 1], [2, 2], None, {}, [0.707106769, 0.707106769]),
    *[(o, [-1, 1], [2, -0.5], -1, {}, [1, -1]) for o in ("l1", "l2")],
    ("l1", X1, [[0, 0, 0], [1, -1, 2]], -1, {"grad_scale": 3.0, "grad_bias": -0.5},
     [[-0.5, -0.5, -0.5], [0.25, -1.25, 1]]),
    ("l2", X1, [[0, 0, 0], [3, -4, 0]], 1, {"grad_scale": 0.5},
     [[0, 0, 0], [0.300000012, -0.400000006, 0]]),
    *[("l2", np.zeros((2, 2, 2)), G3, p, {},
       [[[0.328797966, -0.657595932], [0.657595932, 0.164398983]],
        [[0, 0.600000024], [-0.800000012, 0]]]) for p in (-1, 2)],
    *[("l2", np.zeros((2, 2, 2)), G3, p, {},
       [[[0.44721359, -0.89442718], [0.970142543, 0.242535636]], [[0, 1], [-1, 0]]])
      for p in (1, -2)],
    *[("l2", np.zeros((2, 2, 2)), G3, p, {}, [[[1, -1], [1, 1]], [[0, 1], [-1, 0]]])
      for p in (0, -3)],
    *[("l2", np.zeros((2, 2, 2)), G3, p, {},
       [[[0.170871541, -0.341743082], [0.341743082, 0.0854357705]],
        [[0, 0.512614608], [-0.683486164, 0]]]) for p in (None, 3)],
]
NORMALIZERS = {"l1": optclip.l1_normalize, "l2": optclip.l2_normalize}


@pytest.mark.parametrize("case", range(len(NORMALIZE_VECTORS)))
def test_normalize_reference_vectors(case):
    kind, x, g, param_ndim, kwargs, want = NORMALIZE_VECTORS[case]
    got_g, got_x = pre_step(NORMALIZERS[kind](param_ndim=param_ndim, **kwargs), x, g)
    np.testing.assert_allclose(got_g, np.asarray(want, F32), **TOL)
    np.testing.assert_allclose(got_x, arr(x) - got_g, **TOL)


@pytest.mark.parametrize("kind,want_x", [
    ("l2", [[0.78178215, 1.4364357, 0.127128482], [1.89195299, 0.925670564, 0.554023504]]),
    ("l1", [[0.857142866, 1.28571427, 0.428571403], [1.63157892, 0.947368443, 0.684210539]]),
])
def test_normalize_spec_parameters(kind, want_x):
    _, got_x = pre_step(NORMALIZERS[kind](-1), X1, G2)
    np.testing.assert_allclose(got_x, np.asarray(want_x, F32), **TOL)


@pytest.mark.parametrize("kind,g,want", [
    ("l2", [1e-30, 0.0], [1.0, 0.0]),              # reference: [85070592, 0] (its defect)
    ("l2", [1e-20, 1e-20], [0.70710677, 0.70710677]),
    ("l2", [3e38, 3e38], [0.70710677, 0.70710677]),  # reference: [0, 0]
    ("l1", [3e38, 3e38], [0.5, 0.5]),
    ("l1", [1e38, 1e37], [0.909090936, 0.0909090936]),   # 1/ν would be subnormal (XLA: 0)
    ("l2", [0.0, 0.0], [0.0, 0.0]),
    ("l1", [0.0, 0.0], [0.0, 0.0]),
])
def test_normalize_survives_norm_underflow_and_overflow(kind, g, want):
    tx = NORMALIZERS[kind](param_ndim=None)
    out, _ = tx.update(arr(g), tx.init(arr(g)))
    np.testing.assert_allclose(out, np.asarray(want, F32), rtol=1e-6)


# Rows at the edges of each dtype's range: norms below the smallest in-range norm (squares that
# underflow), sums that overflow while every element is finite, and both ends in one row.
# Subnormal elements are left out: XLA:CPU may flush them to zero.
_EDGE_ROWS = {
    np.float32: [[1e-20, 1e-20, -3e-21], [3e-38, -4e-38, 0.0], [2e19, -3e19, 1e-30],
                 [3e38, -3e38, 3e38], [1e38, 1e37, -2e36], [3.0, 4.0, 0.0]],
    np.float64: [[1e-200, -1e-200, 5e-201], [3e-308, 4e-308, 0.0], [1e160, -1e160, 1e-300],
                 [1.7e308, -1.7e308, 1e300], [3.0, 4.0, 0.0]],
}


@pytest.mark.parametrize("kind", ["l1", "l2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_normalize_rows_at_the_range_edges_match_a_long_double_oracle(kind, dtype):
    """Every non-zero finite row comes out with unit norm, as ``g / ||g||`` computed in long
    double (exponent range far beyond float64), and the logged norm is that norm rounded to
    the dtype (``inf`` where it exceeds the dtype's range). ``eps`` is the dtype's smallest
    normal number (the default, float32's, would floor float64 norms at 1e-38)."""
    rows = np.asarray(_EDGE_ROWS[dtype], dtype)
    wide = rows.astype(np.longdouble)
    norm = (np.abs(wide).sum(-1, keepdims=True) if kind == "l1"
            else np.sqrt((wide * wide).sum(-1, keepdims=True)))
    with jax.enable_x64(dtype == np.float64):
        tx = NORMALIZERS[kind](param_ndim=1, eps=float(np.finfo(dtype).tiny))
        out, state = jax.jit(tx.update)(jnp.asarray(rows), tx.init(jnp.asarray(rows)))
        out, logged = np.asarray(out), np.asarray(state.norm)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, (wide / norm).astype(dtype), rtol=4 * np.finfo(dtype).eps,
                               atol=0)
    with np.errstate(over="ignore"):
        want = norm[:, 0].astype(dtype)
    np.testing.assert_allclose(logged, want, rtol=4 * np.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("factory", [
    lambda: optclip.l2_normalize(param_ndim=1), lambda: optclip.l1_normalize(param_ndim=1),
    lambda: optclip.l1q_normalize(1.0, param_ndim=1)])
def test_zero_slice_stays_zero_in_half_precision(factory, dtype):
    """float32's tiny rounds to 0 in float16, and the reference returns NaN."""
    g = arr([[0.0, 0.0], [3.0, -4.0]], dtype)
    tx = factory()
    out, _ = tx.update(g, tx.init(g))
    assert out.dtype == dtype
    assert np.all(np.asarray(out[0], np.float32) == 0)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_normalize_eps_zero_keeps_zero_slice():
    tx = optclip.l2_normalize(param_ndim=1, eps=0.0)
    out, _ = tx.update(arr([[0.0, 0.0], [3.0, 4.0]]), tx.init(arr(np.zeros((2, 2)))))
    np.testing.assert_allclose(out, [[0, 0], [0.6, 0.8]], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# rai_toolbox sign, projections, clamps, chains: (name, make, x, g, g' or None, x').

def l2_projected(eps, param_ndim, lr):
    return optax.chain(optclip.l2_normalize(param_ndim), optax.sgd(lr),
                       optclip.project_l2_ball(eps, param_ndim))


def linf_projected(eps, lr):
    return optax.chain(optclip.sign(), optax.sgd(lr), optclip.project_linf_ball(eps))


CHAIN_VECTORS = {
    "signed": (lambda: optax.chain(optclip.sign(), optax.sgd(1.0)), [-1.5, 1.5], [-2, 20],
               [-0.5, 0.5]),
    "signed-scale-bias": (
        lambda: optax.chain(optclip.sign(grad_scale=2.0, grad_bias=0.1), optax.sgd(0.5)), X1,
        [[0.5, -1, 0], [-3, 0.25, -0.0]],
        [[-0.0499999523, 1.95000005, 0.949999988], [1.95000005, -0.0499999523, 0.949999988]]),
    "l2proj-whole": (lambda: l2_projected(0.8, None, 1.0), [-1, 1], [2, 2],
                     [-0.788478851, 0.135281593]),
    "l2proj-rows": (lambda: l2_projected(1.0, -1, 1.0), X1, G2,
                    [[0.476599604, 0.875697553, 0.0775016248],
                     [0.868700981, 0.425026894, 0.254383028]]),
    "l2proj-none": (lambda: l2_projected(1.0, None, 1.0), X1, G2,
                    [[0.334476352, 0.475024194, 0.193928435],
                     [0.662421465, 0.357900977, 0.240777731]]),
    "l2proj-elementwise": (lambda: l2_projected(1.0, 0, 1.0), X1, G2, [[0, 1, 0], [1, 0, 0]]),
    "l2proj-lr0": (lambda: l2_projected(1.0, -1, 0.0), [[3, 4], [0.6, 0.8], [6, 8]],
                   np.zeros((3, 2)), [[0.600000024, 0.800000012]] * 3),
    "linf": (lambda: linf_projected(1.8, 1.0), [-1, 0.5], [2, -2], [-1.79999995, 1.5]),
    "linf-rows": (lambda: linf_projected(0.5, 0.75), X1, G2,
                  [[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]]),
    "clamped-grad": (lambda: optax.chain(optclip.clamp(-1.0, 3.0), optax.sgd(1.0)), [1, 1],
                     [-0.5, 10], [1.5, -2]),
    "clamped-grad-min": (lambda: optax.chain(optclip.clamp(clamp_min=-0.5, grad_scale=2.0),
                                             optax.sgd(1.0)), X1, G2,
                         [[0, 2, -3], [2, 0.5, -2]]),
    "clamped-grad-max": (lambda: optax.chain(optclip.clamp(clamp_max=0.5), optax.sgd(1.0)), X1,
                         G2, [[0.5, 2, 0.5], [4, 0.75, 0.5]]),
    "clamped-param": (lambda: optax.chain(optax.sgd(1.0), optclip.clamp_params(-1.0, 3.0)),
                      [1, 1], [0.5, -10], [0.5, 3]),
    "clamped-param-max": (lambda: optax.chain(optax.sgd(1.0), optclip.clamp_params(
        clamp_max=0.5)), X1, G2, [[0.5, 0.5, -1], [0.5, 0.5, -0.5]]),
    "topq-then-clamp": (lambda: optax.chain(optclip.top_q(0.33, param_ndim=None),
                                            optclip.clamp(clamp_max=2.8), optax.sgd(1.0)),
                        np.ones(3), [1, 2, 3], [1, -1, -1.79999995]),
    "sign-then-clamp": (lambda: optax.chain(optclip.sign(), optclip.clamp(
        clamp_min=0.0, grad_scale=3.0, grad_bias=-1.0), optax.sgd(1.0)), np.ones(3),
                        [-2, 0.5, 0], [2, -1, 2]),
    "clamp-then-l2proj": (lambda: optax.chain(
        optclip.l2_normalize(None), optax.sgd(0.0), optclip.clamp_params(clamp_max=2.0),
        optclip.project_l2_ball(1.0, None)), [3, 4, 12], [0, 0, 0], [0.577350259] * 3),
    "l2proj-then-clamp": (lambda: optax.chain(
        optclip.l2_normalize(None), optax.sgd(0.0), optclip.project_l2_ball(1.0, None),
        optclip.clamp_params(clamp_max=0.2)), [3, 4, 12], [0, 0, 1], [0.200000003] * 3),
}


@pytest.mark.parametrize("case", CHAIN_VECTORS, ids=str)
def test_sign_clamp_projection_chain_reference_vectors(case):
    make, x, g, want_x = CHAIN_VECTORS[case]
    (got_x,) = steps(make(), x, [g])
    np.testing.assert_allclose(got_x, np.asarray(want_x, F32), **TOL)


def test_l2_projection_lands_inside_the_sphere_and_exact_option():
    """The 1e-7 of torch's renorm, and the exact ε/ν option."""
    x = arr([0.003, 0.004])
    for exact, want in [(False, [0.000599988038, 0.000799984089]), (True, [0.0006, 0.0008])]:
        tx = optclip.project_l2_ball(0.001, param_ndim=None, exact=exact)
        u, state = tx.update(jnp.zeros(2), tx.init(x), x)
        np.testing.assert_allclose(optax.apply_updates(x, u), np.asarray(want, F32), rtol=2e-7)
        assert bool(state.projected) and float(state.norm) == pytest.approx(0.005)
    tx = optclip.project_l2_ball(1e-9, param_ndim=None)
    p = arr([1e-8, 0.0])
    u, _ = tx.update(jnp.zeros(2), tx.init(p), p)
    # p + (P(x) - p) is only within an ulp of p = 1e-8 (the caveat); P(x) itself is 9.09e-11.
    np.testing.assert_allclose(optax.apply_updates(p, u)[0], F32(9.09090858e-11),
                               atol=np.spacing(F32(1e-8)))
    np.testing.assert_allclose(u[0] + p[0], F32(9.09090858e-11) - F32(1e-8) + F32(1e-8),
                               rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# rai_toolbox Frank-Wolfe.

FW = {"l1": optclip.l1_frank_wolfe, "l2": optclip.l2_frank_wolfe,
      "linf": optclip.linf_frank_wolfe}


@pytest.mark.parametrize("make,x0,g,want", [
    (lambda: optclip.l1_frank_wolfe(1.8, param_ndim=None), [1, 1], [1, 2], [0, -1.79999995]),
    (lambda: optclip.l2_frank_wolfe(1.8, param_ndim=None), [1, 1], [1, 2],
     [-0.80498445, -1.6099689]),
    (lambda: optclip.linf_frank_wolfe(1.8, param_ndim=None), [1, 1], [1, 2],
     [-1.79999995, -1.79999995]),
    (lambda: optclip.l1q_frank_wolfe(0.3, 1.8, param_ndim=None), [1, 1, 1], [0, 1, 2],
     [0, -0.899999976, -0.899999976]),
])
def test_frank_wolfe_documented_single_steps(make, x0, g, want):
    (got,) = steps(make(), x0, [g])
    np.testing.assert_allclose(got, np.asarray(want, F32), **TOL)


FW_THREE_STEPS = {
    "l1-rows": (lambda: optclip.l1_frank_wolfe(1.5),
                [[[0, 0, -1.5], [1.5, 0, 0]], [[1, 0, -0.5], [0.5, 1, 0]],
                 [[0.5, 0, -1], [1, 0.5, 0]]]),
    # The reference's L1 LMO is wrong for 2-axis slices: this is the intended row.
    "l1-whole": (lambda: optclip.l1_frank_wolfe(1.5, param_ndim=None),
                 [[[0, 0, 0], [1.5, 0, 0]], [[0, 0, 0], [0.5, 1, 0]],
                  [[0, 0, 0], [1, 0.5, 0]]]),
    **{f"linf[{p}]": (lambda p=p: optclip.linf_frank_wolfe(1.5, param_ndim=p),
                      [[[-1.5, 1.5, -1.5], [1.5, -1.5, -1.5]],
                       [[0.5, -0.5, -1.5], [-0.5, 0.5, -1.5]],
                       [[-0.5, 0.5, -1.5], [0.5, -0.5, -1.5]]]) for p in (-1, None)},
    "l2-rows": (lambda: optclip.l2_frank_wolfe(1.5),
                [[[-0.327326834, 0.654653668, -1.30930734],
                  [1.33792949, -0.111494124, -0.668964744]],
                 [[0.763762593, -0.218217865, -0.654653668],
                  [0.00954073668, 0.83570683, -0.441206127]],
                 [[0.21821788, 0.218217909, -0.981980503],
                  [0.673735142, 0.362106353, -0.555085421]]]),
    "l2-whole": (lambda: optclip.l2_frank_wolfe(1.5, param_ndim=None),
                 [[[-0.184288546, 0.368577093, -0.737154186],
                   [1.10573125, -0.0921442732, -0.552865624]],
                  [[0.150272936, 0.0170078054, -0.298643678],
                   [-0.0548278093, 0.816095054, -0.395990998]],
                  [[-0.0170078054, 0.192792445, -0.517898917],
                   [0.52545172, 0.361975402, -0.474428296]]]),
    "l2-whole-constant-lr": (
        lambda: optclip.l2_frank_wolfe(1.5, learning_rate=0.5, use_default_lr_schedule=False,
                                       param_ndim=None),
        [[[-0.0421442725, 0.284288555, -0.518577099], [0.552865624, 0.20392786, -0.176432818]],
         [[0.1377047, 0.0627558604, -0.298982769], [-0.041120857, 0.737071276, -0.246993244]],
         [[-0.0232919231, 0.215666473, -0.518068492],
          [0.532305181, 0.322463512, -0.399929434]]]),
    "l1q-rows": (lambda: optclip.l1q_frank_wolfe(0.5, 1.5),
                 [[[0, 0.75, -0.75], [0.75, 0, -0.75]], [[0.5, -0.25, -0.25], [-0.25, 0.5, -0.25]],
                  [[0.25, 0.25, -0.5], [0.25, 0.25, -0.5]]]),
    "l1q-whole": (lambda: optclip.l1q_frank_wolfe(0.5, 1.5, param_ndim=None),
                  [[[0, 0, -0.5], [0.5, 0, -0.5]],
                   [[0.333333343, 0, -0.166666672], [-0.166666672, 0.333333343, -0.166666672]],
                   [[0.166666672, 0, -0.333333343], [0.166666657, 0.166666672, -0.333333343]]]),
}


@pytest.mark.parametrize("case", FW_THREE_STEPS, ids=str)
def test_frank_wolfe_three_step_reference_vectors(case):
    make, want = FW_THREE_STEPS[case]
    got = steps(make(), X0, [G2, G2B, G2])
    for step, (got_x, want_x) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(got_x, np.asarray(want_x, F32), **TOL, err_msg=f"step {step}")


def test_l2_frank_wolfe_lr_one_schedule():
    got = steps(optclip.l2_frank_wolfe(1.5, learning_rate=1.0, param_ndim=None), X0,
                [G2, G2B, G2])
    np.testing.assert_allclose(got[1], np.asarray(
        [[0.0666325614, 0.104900129, -0.408271313], [0.235311955, 0.589035213, -0.435209632]],
        F32), **TOL)
    np.testing.assert_allclose(got[2], np.asarray(FW_THREE_STEPS["l2-whole"][1][2], F32), **TOL)


def test_project_l2_ball_rows_whose_sum_of_squares_overflows():
    """A finite row whose plain sum of squares overflows is projected onto the
    ball, and the step counts as finite; a row with inf does not."""
    tx = optclip.project_l2_ball(1.0)
    x = {"a": np.array([[1e30, 1e30], [0.3, 0.4]], F32), "b": np.array([[0.0, 2.0]], F32)}
    zeros = jax.tree.map(jnp.zeros_like, x)
    u, state = tx.update(x, tx.init(zeros), zeros)
    np.testing.assert_allclose(u["a"], [[0.70710677, 0.70710677], [0.3, 0.4]], **TOL)
    np.testing.assert_allclose(u["b"], [[0.0, 1.0]], **TOL)
    assert int(state.nonfinite) == 0 and int(state.count) == 1
    assert state.projected["a"].tolist() == [True, False]
    bad = {"a": x["a"], "b": np.array([[np.inf, 0.0]], F32)}
    _, state = tx.update(bad, state, zeros)
    assert int(state.nonfinite) == 1 and int(state.count) == 1


def test_l2_frank_wolfe_direction_has_unit_norm_for_tiny_huge_and_zero_rows():
    """Rows whose plain sum of squares underflows or overflows take the rare exact branch,
    also when only one leaf of the tree has such a row; the other rows are unaffected."""
    rare = np.array([[1e-30, 0, 0], [3e38, 3e38, 0], [0, 0, 0], [3, 4, 0], [1e20, -1e20, 0]],
                    F32)
    plain = np.array([[0, 0, 2], [1, 0, 0]], F32)
    want_rare = [[1, 0, 0], [0.70710677, 0.70710677, 0], [0, 0, 0], [0.6, 0.8, 0],
                 [0.70710677, -0.70710677, 0]]
    want_plain = [[0, 0, 1], [1, 0, 0]]
    tx = optclip.l2_frank_wolfe(1.0)     # alpha_0 = 1: p_new = -direction
    for grads, wants in (({"a": rare, "b": plain}, (want_rare, want_plain)),
                         ({"b": plain}, (want_plain,))):
        params = jax.tree.map(jnp.zeros_like, grads)
        u, state = tx.update(grads, tx.init(params), params)
        for got, want in zip(jax.tree.leaves(u), wants, strict=True):
            np.testing.assert_allclose(got, -np.asarray(want, F32), **TOL)
        assert int(state.nonfinite) == 0 and int(state.count) == 1


@pytest.mark.parametrize("param_ndim,want", [
    (-1, [[-2, 2, -2], [-0.666666687, 0.666666687, -0.666666687]]),   # 1-D: the L∞ LMO (S1)
    (None, [[0, 2, 0], [0, 0.666666687, 0]]),
])
def test_l1_frank_wolfe_on_a_vector(param_ndim, want):
    got = steps(optclip.l1_frank_wolfe(2.0, param_ndim=param_ndim), [0.5, -0.25, 1],
                [[1, -3, 2], [0, 0, 0]])
    np.testing.assert_allclose(np.stack(got), np.asarray(want, F32), **TOL)


def test_l1_lmo_flattens_two_axis_slices():
    """One-hot at the first argmax of the flattened slice."""
    got = steps(optclip.l1_frank_wolfe(1.0, param_ndim=None), np.zeros((2, 3)),
                [[[0.1, -5, 0.2], [0.3, 0.4, -0.6]]])
    np.testing.assert_allclose(got[0], [[0, 1, 0], [0, 0, 0]])
    # (b) 2x2x3 with the default -1 raises IndexError in the reference; here each row is a slice.
    g = np.arange(12.0).reshape(2, 2, 3) - 5
    (got,) = steps(optclip.l1_frank_wolfe(1.0), np.zeros((2, 2, 3)), [g])
    np.testing.assert_array_equal(got, [[[1, 0, 0], [0, 0, 0]], [[0, 0, 0], [0, 0, -1]]])


def test_l1_lmo_ties_and_nan_take_the_first_index():
    """Tied largest magnitudes in one leaf send the tree through the argmax branch; the first
    index wins, and NaN ranks as the largest."""
    tx = optclip.l1_frank_wolfe(1.0)     # alpha_0 = 1: the update is -direction at p = 0
    tied = np.array([[2, -2, 1], [0.5, -3, 3], [0, 0, 0]], F32)
    plain = np.array([[1, 4, -2]], F32)
    for grads, wants in (({"a": tied, "b": plain},
                          ([[1, 0, 0], [0, -1, 0], [0, 0, 0]], [[0, 1, 0]])),
                         ({"b": plain}, ([[0, 1, 0]],))):
        params = jax.tree.map(jnp.zeros_like, grads)
        u, _ = tx.update(grads, tx.init(params), params)
        for got, want in zip(jax.tree.leaves(u), wants, strict=True):
            np.testing.assert_array_equal(got, -np.asarray(want, F32))
    g = {"b": np.array([[1, np.nan, 3, np.nan]], F32)}
    params = {"b": jnp.ones((1, 4))}
    u, state = tx.update(g, tx.init(params), params)
    np.testing.assert_array_equal(np.isnan(u["b"]), [[False, True, False, False]])
    assert int(state.nonfinite) == 1


def test_l1_lmo_infinite_entry_ranks_first_and_marks_the_step():
    """An infinite magnitude is the largest of its row (the one-hot lands on it) and makes the
    step non-finite, also when it lies in a row of its own among finite rows."""
    tx = optclip.l1_frank_wolfe(1.0)
    g = {"b": np.array([[1, -np.inf, 3, -np.inf], [0, 0, 0, 0], [1, 2, -2, 0]], F32)}
    params = {"b": jnp.zeros((3, 4))}
    u, state = tx.update(g, tx.init(params), params)
    np.testing.assert_array_equal(u["b"], [[0, 1, 0, 0], [0, 0, 0, 0], [0, -1, 0, 0]])
    assert int(state.nonfinite) == 1 and int(state.count) == 0


@pytest.mark.parametrize("learning_rate,want", [
    (2.0, [[-1, -1], [-0.666666687, 0], [-0.333333343, -0.5]]),
    (0.0, [[1, -2]] * 3),
])
def test_bare_frank_wolfe(learning_rate, want):
    tx = optclip.frank_wolfe(1.0, learning_rate=learning_rate)
    got = steps(tx, [1, -2], [[1, 1], [0.5, -0.5], [0, 1]])
    np.testing.assert_allclose(np.stack(got), np.asarray(want, F32), **TOL)
    state = tx.init(arr([1, -2]))
    for g in ([1, 1], [0.5, -0.5]):
        _, state = tx.update(arr(g), state, arr([1, -2]))
    assert int(state.count) == 2   # the counter advances also when lr = 0


def test_frank_wolfe_alpha_schedule_and_stats():
    tx = optclip.frank_wolfe(1.0)
    x = arr([1.0])
    state = tx.init(x)
    alphas = []
    for _ in range(5):
        _, state = tx.update(arr([1.0]), state, x)
        alphas.append(float(optclip.stats(state)["frank_wolfe/alpha"]))
    np.testing.assert_allclose(alphas, [1, 2 / 3, 1 / 2, 2 / 5, 1 / 3], rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# NumPy oracles, written from rai_toolbox's formulas (slicing, normalizations, top-q, projections,
# Frank-Wolfe).

def oracle_slices(x, param_ndim):
    """The (B, D) view of a leaf: B slices of D entries."""
    n = x.ndim
    k = n if param_ndim is None else (param_ndim if param_ndim >= 0 else n + param_ndim)
    batch = int(np.prod(x.shape[: n - k]))
    return x.reshape(batch, -1)


def oracle_normalize(g, ord, param_ndim, eps=2.0**-126):
    rows = oracle_slices(np.asarray(g, np.float64), param_ndim)
    norm = np.sum(np.abs(rows), 1) if ord == 1 else np.sqrt(np.sum(rows**2, 1))
    return (rows / np.maximum(norm, eps)[:, None]).reshape(np.shape(g))


def oracle_top_q(g, q, param_ndim):
    rows = oracle_slices(np.asarray(g, np.float64), param_ndim).copy()
    keep = round((1 - q) * rows.shape[1])
    for row in rows:   # NaN first (above inf, as torch.topk), ties to the lowest index
        order = sorted(range(row.size), key=lambda i: (not np.isnan(row[i]),
                                                       0 if np.isnan(row[i]) else -abs(row[i]), i))
        row[order[keep:]] = 0
    return rows.reshape(np.shape(g))


def oracle_l1q(g, q, param_ndim):
    kept = oracle_slices(oracle_top_q(g, q, param_ndim), param_ndim)
    signs = np.sign(kept)
    count = np.sum(signs != 0, 1, keepdims=True)
    return (signs / np.maximum(count, 1)).reshape(np.shape(g))


def oracle_project_l2(x, eps, param_ndim):
    rows = oracle_slices(np.asarray(x, np.float64), param_ndim)
    norm = np.sqrt(np.sum(rows**2, 1, keepdims=True))
    return np.where(norm > eps, rows * eps / (norm + 1e-7), rows).reshape(np.shape(x))


def oracle_l1_lmo(g, param_ndim):
    rows = oracle_slices(np.asarray(g, np.float64), param_ndim)
    out = np.zeros_like(rows)
    first = np.argmax(np.abs(rows), 1)
    out[np.arange(len(rows)), first] = np.sign(rows[np.arange(len(rows)), first])
    return out.reshape(np.shape(g))


def oracle_frank_wolfe(lmo, x, grads, eps, lr=2.0):
    x = np.asarray(x, np.float64)
    out = []
    for t, g in enumerate(grads):
        alpha = lr / (lr + t)
        x = (1 - alpha) * x - alpha * eps * lmo(g)
        out.append(x)
    return out


SHAPES_AND_PARAM_NDIMS = [((5,), None), ((5,), -1), ((3, 4), 0), ((3, 4), 1), ((3, 4), -2),
                          ((2, 3, 4), None), ((2, 3, 4), 2), ((2, 3, 4), -1)]


def rng_array(shape, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) * rng.uniform(0.1, 3)).astype(dtype)


@pytest.mark.parametrize("shape,param_ndim", SHAPES_AND_PARAM_NDIMS, ids=str)
def test_pre_step_transforms_match_numpy_oracle(shape, param_ndim):
    g = rng_array(shape, 7)
    cases = [
        (optclip.l1_normalize(param_ndim), oracle_normalize(g, 1, param_ndim)),
        (optclip.l2_normalize(param_ndim, grad_scale=1.5, grad_bias=0.25),
         oracle_normalize(g, 2, param_ndim) * 1.5 + 0.25),
        (optclip.top_q(0.6, param_ndim=param_ndim), oracle_top_q(g, 0.6, param_ndim)),
        (optclip.l1q_normalize(0.3, param_ndim=param_ndim, grad_scale=2.0),
         oracle_l1q(g, 0.3, param_ndim) * 2.0),
    ]
    for tx, want in cases:
        out, _ = tx.update(arr(g), tx.init(arr(g)))
        np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("shape,param_ndim", SHAPES_AND_PARAM_NDIMS, ids=str)
def test_projection_and_frank_wolfe_match_numpy_oracle(shape, param_ndim):
    x = rng_array(shape, 1) * 2
    u = rng_array(shape, 2)
    tx = optclip.project_l2_ball(1.5, param_ndim)
    out, _ = tx.update(arr(u), tx.init(arr(x)), arr(x))
    np.testing.assert_allclose(arr(x) + out, oracle_project_l2(x + u, 1.5, param_ndim),
                               rtol=2e-6, atol=1e-6)
    grads = [rng_array(shape, s) for s in (3, 4, 5, 6)]
    lmos = {
        "l1": (optclip.l1_frank_wolfe(0.7, param_ndim=param_ndim),
               lambda g: oracle_l1_lmo(g, param_ndim)),
        "l2": (optclip.l2_frank_wolfe(0.7, param_ndim=param_ndim),
               lambda g: oracle_normalize(g, 2, param_ndim)),
        "linf": (optclip.linf_frank_wolfe(0.7, param_ndim=param_ndim), np.sign),
        "l1q": (optclip.l1q_frank_wolfe(0.4, 0.7, param_ndim=param_ndim),
                lambda g: oracle_l1q(g, 0.4, param_ndim)),
    }
    for name, (tx, lmo) in lmos.items():
        got = steps(tx, x, grads)
        want = oracle_frank_wolfe(lmo, x, grads, 0.7)
        np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


# A leaf large enough (more than norms.GROUP_MAX_ELEMENTS, two axes) that the box projections
# reduce it row by row (slices.excesses(computed=True)) and project_l2_ball takes both sums of
# squares in one read, where one device is visible (the ``one_device`` fixture of
# conftest.py), and a small one reduced whole.
BIG_SHAPE = (300, 256)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_box_projections_flag_large_leaves_row_by_row(dtype, one_device):
    """The projected flags and the finiteness of a step, against NumPy, where the large leaf's
    statistic is taken row by row: an element outside a bound in the last row, one exactly
    on the bound, a one-sided bound, a NaN and an infinity (held steps counted)."""
    assert math.prod(BIG_SHAPE) > norms_lib.GROUP_MAX_ELEMENTS
    p = {"big": rng_array(BIG_SHAPE, 1) * 0.1, "small": rng_array((4, 8), 2) * 0.1}
    base = {"big": rng_array(BIG_SHAPE, 3) * 0.1, "small": rng_array((4, 8), 4) * 0.1}
    for tx, low, high in [(optclip.clamp_params(-1.0, 1.0), -1.0, 1.0),
                          (optclip.project_linf_ball(0.75), -0.75, 0.75),
                          (optclip.clamp_params(None, 1.0), None, 1.0)]:
        update = jax.jit(tx.update)
        state = tx.init({k: arr(v, dtype) for k, v in p.items()})
        nonfinite = 0
        for where, value in [(None, 0.0), ((-1, -1), 5.0), ((-1, 3), -5.0), ((7, 0), 1.0),
                             ((0, 0), np.nan), ((-1, -1), np.inf)]:
            u = {k: v.copy() for k, v in base.items()}
            if where is not None:
                u["big"][where] = value - p["big"][where]
            params = {k: arr(v, dtype) for k, v in p.items()}
            grads = {k: arr(v, dtype) for k, v in u.items()}
            _, state = update(grads, state, params)
            x = {k: np.asarray(params[k], np.float64) + np.asarray(grads[k], np.float64)
                 for k in p}
            if not np.isfinite(x["big"]).all():
                nonfinite += 1
                assert int(state.nonfinite) == nonfinite, (low, high, where)
                continue
            want = [bool(((x[k] > high) | ((x[k] < low) if low is not None else False)).any())
                    for k in ("big", "small")]
            assert np.asarray(state.projected).tolist() == want, (low, high, where, value)


def test_excesses_row_by_row_agree_with_the_whole_reduction(one_device):
    """Both forms of slices.excesses: positive on the same arrays, NaN on the same."""
    x = rng_array(BIG_SHAPE, 5)
    cases = [x, np.clip(x, -1, 1), np.where(np.arange(x.size).reshape(x.shape) == 9999, np.nan, x),
             np.where(np.arange(x.size).reshape(x.shape) == 5, -np.inf, np.clip(x, -1, 1))]
    for a in cases:
        for low, high in [(-1.0, 1.0), (None, 1.0), (-1.0, None), (-1.5, -1.5)]:
            whole, rows = (float(slices_lib.excesses([arr(a)], low, high, computed=c)[0])
                           for c in (False, True))
            assert np.isnan(whole) == np.isnan(rows), (low, high)
            assert (whole > 0) == (rows > 0), (low, high, whole, rows)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_project_l2_ball_norms_large_leaves_in_one_pass(dtype, one_device):
    """The slice norms of a large leaf from one variadic reduce (the plain sum compensated, the
    scaled one beside it) against NumPy's in float64: within two roundings of float32 (a sum
    added in sequence without its error term is off by more); a row whose squares overflow
    float32 (its norm from the scaled sum, added in sequence: within n roundings, the row
    projected into the ball), a zero row; the output against the formula; a NaN and an
    infinity hold the step."""
    assert math.prod(BIG_SHAPE) > norms_lib.GROUP_MAX_ELEMENTS
    radius = 2.3
    p = {"big": rng_array(BIG_SHAPE, 6) * 0.1, "small": rng_array((4, 8), 7) * 0.1}
    base = {"big": rng_array(BIG_SHAPE, 8) * 0.1, "small": rng_array((4, 8), 9) * 0.1}
    tx = optclip.project_l2_ball(radius)
    update = jax.jit(tx.update)
    params = {k: arr(v, dtype) for k, v in p.items()}
    state = tx.init(params)
    held = 0
    for row, value in [(None, 0.0), (5, 3e20), (9, 0.0), (0, np.nan), (-1, np.inf)]:
        u = {k: v.copy() for k, v in base.items()}
        if row is not None:
            u["big"][row] = value - p["big"][row]
        grads = {k: arr(v, dtype) for k, v in u.items()}
        out, state = update(grads, state, params)
        x = {k: np.asarray(params[k], np.float64) + np.asarray(grads[k], np.float64) for k in p}
        if not np.isfinite(x["big"]).all():
            held += 1
            assert int(state.nonfinite) == held, row
            continue
        for k in p:
            norm = np.linalg.norm(x[k], axis=-1)
            # The row whose squares overflow float32 is measured by the scaled sum.
            scaled = (np.arange(len(norm)) == row) & (k == "big" and value > 1e19)
            got = np.asarray(state.norm[k], np.float64)
            np.testing.assert_allclose(got[~scaled], norm[~scaled], rtol=2.4e-7, atol=0,
                                       err_msg=f"{k} {row}")
            np.testing.assert_allclose(got[scaled], norm[scaled],
                                       rtol=x[k].shape[-1] * 2.0 ** -24, atol=0)
            factor = np.where(norm > radius, radius / (norm + 1e-7), 1.0)[:, None]
            landed = np.asarray(out[k], np.float64) + np.asarray(params[k], np.float64)
            atol = 2.0 ** -8 if dtype == jnp.bfloat16 else 1e-7     # an ulp of bfloat16 at 1
            np.testing.assert_allclose(landed, x[k] * factor, rtol=2e-6, atol=atol,
                                       err_msg=f"{k} {row}")
        assert np.asarray(state.projected["big"]).sum() > 10


def test_project_l2_ball_rereads_only_long_slices(one_device):
    """Slices of a large leaf up to PAIRED_SLICE_MAX elements get their scale-safe sums from the
    first read (no rescue branch in the step); a longer slice, whose scaled sum added in
    sequence would lose too much, keeps the rescaled re-read under a ``lax.cond``."""
    leaf = jnp.zeros(BIG_SHAPE)
    assert BIG_SHAPE[-1] <= projections_lib.PAIRED_SLICE_MAX < leaf.size
    for param_ndim, rescue in [(-1, False), (None, True)]:
        tx = optclip.project_l2_ball(1.0, param_ndim)
        jaxpr = jax.make_jaxpr(tx.update)(leaf, tx.init(leaf), leaf)
        assert ("cond[" in str(jaxpr)) == rescue, param_ndim


def test_float64_matches_oracle_under_x64():
    with jax.enable_x64(True):
        g = rng_array((3, 4), 11)
        tx = optclip.l2_normalize(-1)
        out, state = tx.update(jnp.asarray(g), tx.init(jnp.asarray(g)))
        assert out.dtype == jnp.float64 and state.norm.dtype == jnp.float64
        np.testing.assert_allclose(out, oracle_normalize(g, 2, -1), rtol=1e-14)
        got = steps(optclip.linf_frank_wolfe(0.7), X0, [G2, G2B], jnp.float64)
        want = oracle_frank_wolfe(np.sign, X0, [G2, G2B], 0.7)
        np.testing.assert_allclose(got[-1], want[-1], rtol=1e-15)
        # V1 in float64: exactly 0.9.
        tx = optclip.l1q_normalize(0.3, param_ndim=None, grad_scale=1.8)
        g = jnp.asarray([0.0, 1.0, 2.0])
        assert tx.update(g, tx.init(g))[0].tolist() == [0.0, 0.9, 0.9]


# ---------------------------------------------------------------------------------------------
# Properties.

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
nonzero = finite.filter(lambda v: abs(v) > 1e-3)


@st.composite
def slices(draw, elements=finite):
    shape = draw(st.sampled_from([(3, 5), (2, 2, 3)]))
    values = draw(st.lists(elements, min_size=math.prod(shape), max_size=math.prod(shape)))
    param_ndim = draw(st.sampled_from([None, -1]))
    return np.asarray(values, np.float32).reshape(shape), param_ndim


@given(slices(nonzero), st.floats(0, 1), st.floats(0.1, 5))
def test_l1q_output_slices_have_l1_norm_grad_scale(case, q, grad_scale):
    g, param_ndim = case
    tx = optclip.l1q_normalize(q, param_ndim=param_ndim, grad_scale=grad_scale)
    out, _ = tx.update(jnp.asarray(g), tx.init(jnp.asarray(g)))
    rows = oracle_slices(np.asarray(out, np.float64), param_ndim)
    norms_ = np.sum(np.abs(rows), 1)
    k = round((1 - q) * rows.shape[1])
    np.testing.assert_allclose(norms_, grad_scale if k else 0.0, rtol=1e-5)


@given(slices(nonzero), st.floats(0, 1))
def test_top_q_keeps_exactly_k_entries_per_slice(case, q):
    g, param_ndim = case
    tx = optclip.top_q(q, param_ndim=param_ndim)
    out, _ = tx.update(jnp.asarray(g), tx.init(jnp.asarray(g)))
    rows = oracle_slices(np.asarray(out), param_ndim)
    k = round((1 - q) * rows.shape[1])
    assert np.all(np.sum(rows != 0, 1) == k)
    kept_min = np.min(np.where(rows != 0, np.abs(rows), np.inf), 1)
    dropped_max = np.max(np.where(rows == 0, np.abs(oracle_slices(g, param_ndim)), -np.inf), 1)
    assert np.all(kept_min >= dropped_max)


def caveat(p, step):
    """The rounding of ``apply_updates``: half an ulp of the larger of ``|p|`` and ``|P(x) - p|``,
    doubled for safety."""
    return np.spacing(np.maximum(np.abs(np.asarray(p)), np.abs(np.asarray(step))))


@given(slices(), slices(), st.floats(0.0, 10.0))
def test_projections_land_inside_the_ball(p_case, u_case, epsilon):
    """Up to the rounding caveat of apply_updates (module docstring)."""
    p, param_ndim = p_case
    u = np.resize(u_case[0], p.shape)
    p, u = jnp.asarray(p), jnp.asarray(u)
    radius = F32(epsilon)   # the float32 bound the projections use

    def l2_inside(x, slack):
        rows = oracle_slices(np.asarray(x, np.float64), param_ndim)
        slack = np.sqrt(np.sum(oracle_slices(slack.astype(np.float64), param_ndim) ** 2, 1))
        return np.sqrt(np.sum(rows**2, 1)) <= epsilon * (1 + 1e-6) + slack

    for tx, inside in [
        (optclip.project_l2_ball(epsilon, param_ndim), l2_inside),
        (optclip.project_linf_ball(epsilon), lambda x, slack: np.abs(x) <= radius + slack),
        (optclip.clamp_params(-epsilon, 2 * epsilon),
         lambda x, slack: (x >= -radius - slack) & (x <= F32(2 * epsilon) + slack)),
    ]:
        out, _ = tx.update(u, tx.init(p), p)
        applied = np.asarray(optax.apply_updates(p, out))
        assert np.all(inside(applied, caveat(p, out)))
        # Re-projecting the applied parameters lands exactly inside.
        again, _ = tx.update(jnp.zeros_like(p), tx.init(p), jnp.asarray(applied))
        reprojected = np.asarray(optax.apply_updates(jnp.asarray(applied), again))
        assert np.all(inside(reprojected, caveat(applied, again)))


def test_one_ulp_caveat_of_projection_updates():
    """apply_updates may land one ulp outside the bound."""
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.uniform(-1, 1, 4096), jnp.float32)
    u = jnp.asarray(rng.normal(size=4096), jnp.float32)
    epsilon = 0.3
    tx = optclip.project_linf_ball(epsilon)
    out, _ = tx.update(u, tx.init(p), p)
    applied = np.asarray(optax.apply_updates(p, out))
    exact = np.clip(np.asarray(p + u), -F32(epsilon), F32(epsilon))
    assert np.all(np.abs(applied - exact) <= caveat(p, out) / 2)
    assert np.any(np.abs(applied) > F32(epsilon)), "the caveat is real"
    assert np.all(np.abs(applied) <= F32(epsilon) + caveat(p, out) / 2)


# ---------------------------------------------------------------------------------------------
# Random q (dq > 0).

def test_random_q_draws_stay_in_range_differ_between_steps_and_set_k():
    q, dq = 0.5, 0.3
    tx = optclip.top_q(q, dq=dq, seed=123)
    tree = {"a": jnp.asarray(rng_array((2, 10), 1), jnp.float32),
            "b": jnp.asarray(rng_array((10,), 2), jnp.float32)}
    update = jax.jit(tx.update)
    state = tx.init(tree)
    drawn = []
    for _ in range(40):
        out, state = update(tree, state)
        q_of, k_of = optclip.per_leaf(state.q, tree), optclip.per_leaf(state.k, tree)
        for name, size in (("a", 10), ("b", 1)):
            q_t = np.float32(q_of[name])
            assert q - dq <= q_t < q + dq
            k = round((1 - float(q_t)) * size)   # the reference forms k in double
            assert int(k_of[name]) == k
            kept = np.sum(oracle_slices(np.asarray(out[name]), -1) != 0, 1)
            assert np.all(kept == k)
        drawn.append((float(q_of["a"]), float(q_of["b"])))
    a, b = np.asarray(drawn).T
    assert len(set(a)) == len(a) and not np.array_equal(a, b)   # steps and leaves differ
    assert abs(np.mean(a) - q) < 0.06 and np.std(a) > 0.1        # roughly uniform on [0.2, 0.8)


@pytest.mark.parametrize("q_t,size,k", [
    (0.377667189, 10, 6), (0.509937406, 1, 0), (0.351002455, 10, 6), (0.613134086, 1, 0),
    (0.244383484, 10, 8), (0.719913185, 1, 0)])
def test_drawn_q_to_k_matches_the_reference_draws(q_t, size, k):
    """The q_t torch drew for the top-q vectors (seed 123) and the k it used."""
    from optclip._core.slices import traced_k as _traced_k
    assert int(_traced_k(jnp.float32(q_t), size)) == k
    # The state's vector of k (one entry per leaf) is formed the same way, elementwise.
    assert _traced_k(jnp.float32([q_t, 0.5]), np.array([size, 3])).tolist() == [k, 2]


def test_random_q_edges_clip_to_unit_interval_and_seed_matters():
    tree = jnp.arange(1.0, 11.0)
    q_values = []
    for seed in (0, 1):
        tx = optclip.l1q_normalize(0.9, dq=0.5, param_ndim=None, seed=seed)
        update = jax.jit(tx.update)
        state = tx.init(tree)
        for _ in range(30):
            out, state = update(tree, state)
            assert 0.4 <= float(optclip.per_leaf(state.q, tree)) <= 1.0
        q_values.append(float(optclip.per_leaf(state.q, tree)))
    assert q_values[0] != q_values[1]


def test_dq_zero_consumes_no_randomness():
    tx = optclip.top_q(0.5, seed=5)
    state = tx.init(jnp.ones(4))
    _, new_state = tx.update(jnp.ones(4), state)
    np.testing.assert_array_equal(new_state.key, state.key)


# ---------------------------------------------------------------------------------------------
# Chains, odd leaves, validation (the conformance suite holds every public name to the
# contract: jit, non-finite steps, checkpoints, odd and empty trees).

def test_chain_with_adam_in_jitted_step_and_stats():
    tx = optax.chain(optclip.l1q_normalize(0.5, grad_scale=1.0), optax.adam(1e-2),
                     optclip.project_l2_ball(2.0))
    params = {"w": jnp.ones((4, 6))}

    @jax.jit
    def train_step(params, state):
        grads = jax.grad(lambda p: jnp.sum((p["w"] - 3.0) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for _ in range(50):
        params, state = train_step(params, state)
    row_norms = np.linalg.norm(np.asarray(params["w"]), axis=1)
    assert np.all(row_norms <= 2.0 + 1e-5) and np.all(row_norms > 1.9)
    logged = optclip.stats(state)
    assert {"l1q_normalize/q_mean", "l1q_normalize/k_max", "project_l2_ball/norm_max",
            "project_l2_ball/projected_frac"} <= set(logged)


@pytest.mark.parametrize("factory", [
    lambda: optclip.l2_normalize(), lambda: optclip.top_q(0.5), lambda: optclip.l1_normalize(2),
    lambda: optclip.project_l2_ball(1.0, param_ndim=-2), lambda: optclip.l1_frank_wolfe(1.0),
    lambda: optclip.linf_frank_wolfe(1.0), lambda: optclip.l1q_frank_wolfe(0.5, 1.0)])
def test_a_leaf_of_lower_rank_than_param_ndim_is_one_slice(factory):
    """A learned temperature (0-d) next to matrices: the same as ``param_ndim=None`` on it."""
    tx = factory()
    tree = {"w": jnp.arange(1.0, 7.0).reshape(2, 3), "scale": jnp.asarray(-0.7)}
    whole = {"w": jnp.arange(1.0, 7.0).reshape(2, 3), "scale": jnp.full((1,), -0.7)}
    out, _ = tx.update(tree, tx.init(tree), tree)
    out_whole, _ = tx.update(whole, tx.init(whole), whole)
    np.testing.assert_allclose(out["scale"], out_whole["scale"][0], rtol=1e-6)


def test_scalar_leaves_work_with_param_ndim_none():
    tx = optclip.l2_normalize(param_ndim=None)
    out, _ = tx.update({"s": jnp.asarray(-3.0)}, tx.init({"s": jnp.asarray(1.0)}))
    assert float(out["s"]) == -1.0


def test_masked_leaves_pass_and_the_others_move():
    params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    for tx in (optclip.l1q_normalize(0.5), optclip.l2_frank_wolfe(1.0),
               optclip.project_l2_ball(0.5)):
        masked = optax.masked(tx, {"w": True, "b": False})
        out, _ = masked.update(params, masked.init(params), params)
        np.testing.assert_array_equal(out["b"], params["b"])
        assert not np.array_equal(out["w"], params["w"])


@pytest.mark.parametrize("call,match", [
    (lambda: optclip.top_q(), "q"),                                  # q is required
    (lambda: optclip.l1q_normalize(), "q"),
    (lambda: optclip.project_l2_ball(), "epsilon"),
    (lambda: optclip.project_linf_ball(), "epsilon"),
    (lambda: optclip.l2_frank_wolfe(), "epsilon"),
    (lambda: optclip.l1q_frank_wolfe(0.5), "epsilon"),
    (lambda: optclip.top_q(1.1), "q must be"),
    (lambda: optclip.top_q(0.5, dq=1.5), "dq"),
    (lambda: optclip.clamp(), "clamp_min"),
    (lambda: optclip.clamp(1.0, -1.0), "clamp_min must be <= clamp_max"),
    (lambda: optclip.clamp_params(clamp_min=3.0, clamp_max=2.0), "clamp_min"),
    (lambda: optclip.l1_frank_wolfe(-1.0), "epsilon"),               # ascent in the reference (D8)
    (lambda: optclip.frank_wolfe(learning_rate=1.5, use_default_lr_schedule=False),
     "learning_rate"),
    (lambda: optclip.l2_normalize(param_ndim=True), "param_ndim"),
    (lambda: optclip.sign(grad_scale="2"), "grad_scale"),
])
def test_bad_hyperparameters_fail_at_construction(call, match):
    with pytest.raises((TypeError, ValueError), match=rf"\b{match}\b"):
        call()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_outputs_keep_dtype_and_match_float32(dtype):
    g = rng_array((3, 8), 3)
    for make in (lambda: optclip.l2_normalize(-1), lambda: optclip.l1q_normalize(0.5),
                 lambda: optclip.top_q(0.25)):
        tx = make()
        low, state = tx.update(arr(g, dtype), tx.init(arr(g, dtype)))
        high, _ = tx.update(arr(g, dtype).astype(jnp.float32), tx.init(arr(g)))
        assert low.dtype == dtype
        np.testing.assert_allclose(np.asarray(low, np.float32), np.asarray(high), rtol=1e-2,
                                   atol=1e-3)


def test_inject_hyperparams_traced_q_and_scale():
    """With traced ``q`` the count is formed on device (float32 in the default config)."""
    tx = optax.inject_hyperparams(optclip.l1q_normalize, static_args=("param_ndim", "seed"))(
        q=0.3, param_ndim=None, grad_scale=1.8)
    g = arr([0, 1, 2])
    state = tx.init(g)
    out, state = jax.jit(tx.update)(g, state)
    np.testing.assert_allclose(out, [0, 0.9, 0.9], rtol=1e-7)
    state.hyperparams["q"] = jnp.asarray(0.7)
    out, _ = jax.jit(tx.update)(g, state)
    np.testing.assert_allclose(out, [0, 0, 1.8], rtol=1e-7)
    fw = optax.inject_hyperparams(optclip.l2_frank_wolfe, static_args=(
        "use_default_lr_schedule", "param_ndim"))(epsilon=1.8, param_ndim=None)
    x = arr([1, 1])
    u, _ = fw.update(arr([1, 2]), fw.init(x), x)
    np.testing.assert_allclose(optax.apply_updates(x, u), [-0.80498445, -1.6099689], rtol=1e-6)


@pytest.mark.parametrize("make", [lambda: optclip.top_q(0.5, param_ndim=None),
                                  lambda: optclip.l1_frank_wolfe(1.0, param_ndim=None)],
                         ids=["top_q", "l1_fw"])
def test_whole_leaf_ranking_under_sharding_gives_the_same_numbers(make):
    """A slice spread over devices is gathered for the ranking (docs); the numbers agree."""
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.make_mesh((8,), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x", None))
    tx = make()
    g = jnp.asarray(rng_array((8, 4), 3), jnp.float32)
    p = jnp.asarray(rng_array((8, 4), 4), jnp.float32)
    update = jax.jit(tx.update)
    plain, _ = update(g, tx.init(p), p)
    sharded, _ = update(jax.device_put(g, rows), tx.init(p), jax.device_put(p, rows))
    np.testing.assert_array_equal(sharded, plain)
    assert sharded.sharding.is_equivalent_to(rows, 2)


def test_top_q_keeps_the_first_k_in_stable_order_with_ties_and_nan():
    """One sort finds the k-th entry: the same entries as ranking every entry (numpy oracle)."""
    rng = np.random.default_rng(7)
    g = rng.integers(-2, 3, (5, 7)).astype(np.float32)
    g[0, 3] = np.nan
    g[1, :] = 1.0
    g[2, 2] = -np.inf
    g[3, :3] = [np.inf, -np.inf, np.nan]        # NaN ranks above inf (torch.topk)
    ranks = _magnitude_ranks(g)
    for q in (0.0, 0.3, 0.5, 0.75, 1.0):
        k = round((1 - q) * 7)
        expected = np.where(ranks < k, g, 0.0)
        tx = optclip.top_q(q)
        out = tx.update(jnp.asarray(g), tx.init(jnp.asarray(g)))[0]
        np.testing.assert_array_equal(out, expected)
        traced = jax.jit(lambda g, k: optclip._core.slices.top_q_kept(g, (1,), k))(g, k)
        np.testing.assert_array_equal(traced, expected)


def _magnitude_ranks(g):
    """Each entry's place in its row by descending |g|: NaN first (above inf, as torch.topk),
    ties to the lowest index."""
    magnitude = np.where(np.isnan(g), np.inf, np.abs(g))
    index = np.broadcast_to(np.arange(g.shape[-1]), g.shape)
    order = np.lexsort((index, -magnitude, ~np.isnan(g)), axis=-1)
    return np.argsort(order, axis=-1, kind="stable")


def _top_k_oracle(g, k):
    """The k entries of largest |g| per row (NaN largest, ties to the lowest index), others 0."""
    return np.where(_magnitude_ranks(g) < k, g, 0.0)


@pytest.mark.parametrize("dq", [0.0, 0.2])
def test_top_q_ranks_a_tree_of_leaves_together_ties_in_one_leaf_only(dq):
    """All leaves share one bisection and one tie test: a leaf whose cut-off falls inside a run
    of equal magnitudes (zero rows, repeated values, ±0, subnormals, huge values) is cut at the
    lowest indices while a leaf of distinct values next to it keeps exactly its top k (static
    k with dq=0, k drawn on device with dq>0)."""
    rng = np.random.default_rng(11)
    ties = rng.choice([0.0, -0.0, 1.0, -1.0, 2.0, 1e-45, -3e38], (6, 9)).astype(F32)
    ties[0] = 0.0
    ties[1] = -3.0
    grads = {"ties": ties, "distinct": rng.normal(size=(4, 16)).astype(F32),
             "vector": rng.normal(size=(5,)).astype(F32)}
    tx = optclip.top_q(0.3, dq=dq, param_ndim=-1, seed=5)
    step = jax.jit(tx.update)
    state = tx.init(grads)
    for _ in range(3):
        out, state = step(grads, state)
        k_of = optclip.per_leaf(state.k, grads)
        for name in ("ties", "distinct"):
            want = _top_k_oracle(grads[name], int(k_of[name]))
            np.testing.assert_array_equal(np.asarray(out[name]), want, err_msg=name)
        # One-element slices (a vector with param_ndim=-1): kept iff k rounds to 1.
        np.testing.assert_array_equal(out["vector"], grads["vector"] * int(k_of["vector"]))


@pytest.mark.parametrize("kind,norm", [("l2", lambda x: np.sqrt(np.sum(x * x))),
                                       ("l1", lambda x: np.sum(np.abs(x)))])
def test_normalize_tree_rescues_some_leaves_and_counts_finite_steps(kind, norm):
    """One step where one leaf's norm underflows and another's plain sum overflows, next to an
    ordinary leaf: all have unit norm, the logged norms are the true ones, and the step counts
    as finite (finiteness is not read off an overflowed sum). NaN or inf in any leaf is
    counted as non-finite and leaves the logged norms as they were."""
    grads = {"tiny": [1e-30, 0.0, -1e-30], "big": [1e38, -1e38], "plain": G2}
    grads64 = {k: np.asarray(v, np.float64) for k, v in grads.items()}
    tx = NORMALIZERS[kind](param_ndim=None)
    step = jax.jit(tx.update)
    g = {k: arr(v) for k, v in grads.items()}
    out, state = step(g, tx.init(g))
    for name, x in grads64.items():
        np.testing.assert_allclose(np.asarray(out[name]), x / norm(x), rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(float(state.norm[name]), norm(x), rtol=1e-6, err_msg=name)
    assert int(state.nonfinite) == 0
    for name, bad in (("plain", np.nan), ("big", -np.inf), ("tiny", np.nan)):
        broken = dict(g, **{name: g[name].at[0].set(bad)})
        _, after = step(broken, state)
        assert int(after.nonfinite) == 1, name
        for leaf in grads:
            np.testing.assert_array_equal(after.norm[leaf], state.norm[leaf])


def test_clamp_flags_and_finiteness_per_leaf():
    """The per-leaf clipped flag and the finite test come from one sum per leaf: a NaN or an
    inf anywhere skips the state update (count and flags) while the output is still clamped."""
    tx = optclip.clamp(-1.0, 1.0)
    step = jax.jit(tx.update)
    g = {"a": arr([0.5, 3.0]), "b": arr([0.1, -0.2]), "c": arr([[-4.0, 0.0]])}
    clipped = lambda state: [bool(v) for v in optclip.per_leaf(state.clipped, g).values()]
    out, state = step(g, tx.init(g))
    assert clipped(state) == [True, False, True]
    assert (int(state.count), int(state.nonfinite)) == (1, 0)
    np.testing.assert_array_equal(out["a"], [0.5, 1.0])
    for bad in (np.nan, np.inf, -np.inf):
        out, after = step(dict(g, b=arr([bad, 0.0])), state)
        assert (int(after.count), int(after.nonfinite)) == (1, 1), bad
        assert clipped(after) == [True, False, True]
        np.testing.assert_array_equal(out["a"], [0.5, 1.0])
    out, state = step({"a": arr([0.5, 0.0]), "b": arr([2.0, 0.0]), "c": arr([[1.0, -1.0]])},
                      state)
    assert clipped(state) == [False, True, False]
    assert (int(state.count), int(state.nonfinite)) == (2, 0)


# ---------------------------------------------------------------------------------------------
# Per-leaf param_ndim: a pytree matching the parameters, or a callable (path, leaf) -> k.

PER_LEAF = {
    "l1_normalize": lambda k: optclip.l1_normalize(k),
    "l2_normalize": lambda k: optclip.l2_normalize(k),
    "top_q": lambda k: optclip.top_q(0.5, param_ndim=k),
    "l1q_normalize": lambda k: optclip.l1q_normalize(0.5, param_ndim=k),
    "project_l2_ball": lambda k: optclip.project_l2_ball(1.0, param_ndim=k),
    "l1_frank_wolfe": lambda k: optclip.l1_frank_wolfe(1.5, param_ndim=k),
    "l2_frank_wolfe": lambda k: optclip.l2_frank_wolfe(1.5, param_ndim=k),
    "l1q_frank_wolfe": lambda k: optclip.l1q_frank_wolfe(0.5, 1.5, param_ndim=k),
}


@pytest.mark.parametrize("spelling", ["pytree", "callable"])
@pytest.mark.parametrize("name", sorted(PER_LEAF))
def test_per_leaf_param_ndim_acts_as_each_leaf_alone(name, spelling):
    """{"w": None, "b": -1} (whole matrix; each element of the vector): every leaf is
    transformed as a one-leaf tree with its own ``param_ndim`` would be."""
    ks = {"w": None, "b": -1}
    spec = ks if spelling == "pytree" else (lambda path, leaf: ks[path[0].key])
    grads = {"w": arr(G2), "b": arr([0.5, -2.0, 0.0])}
    params = {"w": arr(X0), "b": arr([1.0, 3.0, -0.5])}
    tx = PER_LEAF[name](spec)
    out, _ = tx.update(grads, tx.init(params), params)
    for leaf, k in ks.items():
        alone = PER_LEAF[name](k)
        want, _ = alone.update(grads[leaf], alone.init(params[leaf]), params[leaf])
        np.testing.assert_allclose(np.asarray(out[leaf]), np.asarray(want), rtol=1e-6,
                                   err_msg=leaf)


def test_l2_frank_wolfe_one_element_slices_below_eps_and_out_of_range():
    """Each element of a 1-D leaf is a slice (param_ndim=-1): g / max(|g|, eps), except where
    |g| under- or overflows the reciprocal's range, which gives sign(g) whatever eps."""
    tx = optclip.l2_frank_wolfe(1.0, eps=1e-3)   # alpha_0 = 1: the update is -direction at 0
    g = np.array([1e-30, -1e-4, 2.0, 0.0, -3e38], F32)
    u, state = tx.update(g, tx.init(jnp.zeros(5)), jnp.zeros(5))
    want = -np.array([1, np.float32(-1e-4) / np.float32(1e-3), 1, 0, -1], F32)
    np.testing.assert_array_equal(u, want)
    assert int(state.nonfinite) == 0


def test_top_q_ranked_in_groups_matches_one_group(monkeypatch):
    """Leaves ranked by one loop per group of leaves give what one loop for all gives."""
    rng = np.random.default_rng(7)
    grads = {"a": rng.normal(size=(6, 5)).astype(F32), "b": rng.normal(size=(3,)).astype(F32),
             "c": rng.normal(size=(4, 9)).astype(F32), "d": rng.normal(size=(2, 3, 4)).astype(F32)}
    grads["c"][1, :4] = 2.0   # ties at the cut-off in one row
    tx = optclip.l1q_normalize(0.6)
    joint = tx.update(grads, tx.init(grads))[0]
    monkeypatch.setattr(slices_lib, "RANK_GROUP_ENTRIES", 1)
    grouped = tx.update(grads, tx.init(grads))[0]
    for name in grads:
        np.testing.assert_array_equal(grouped[name], joint[name])



@pytest.mark.parametrize("make", [lambda: optclip.top_q(0.4, param_ndim=1),
                                  lambda: optclip.l1q_normalize(0.4, param_ndim=1),
                                  lambda: optclip.l1q_frank_wolfe(0.4, 1.5, param_ndim=1)],
                         ids=["top_q", "l1q_normalize", "l1q_frank_wolfe"])
def test_top_q_counts_of_same_shape_leaves_taken_together_match_apart(make, monkeypatch):
    """On one device the per-row counts of same-shape small leaves are taken in groups (one
    variadic reduce per group, the search's values stacked): the same outputs and state as one
    count per leaf, with groups filled, split and left with one leaf, ties, zero rows, NaN, Inf
    and bfloat16 leaves."""
    rng = np.random.default_rng(11)
    grads = {f"w{i}": rng.normal(size=(5, 7)).astype(F32) for i in range(10)}
    grads["w1"][2] = 0.0
    grads["w2"][1, :5] = -1.5                        # ties at the cut
    grads["w3"][0, 3] = np.nan
    grads["w4"][4, 0] = -np.inf
    grads["w5"][3] = [0.0, -0.0, 1e-45, 0.0, 3e38, -3e38, 1.0]
    grads.update({f"h{i}": jnp.asarray(rng.normal(size=(3, 4)), jnp.bfloat16) for i in range(3)})
    grads["n"] = np.arange(6, dtype=np.int32)
    params = jax.tree.map(lambda g: jnp.full_like(g, 0.25 if g.dtype != np.int32 else 1), grads)
    tx = make()

    def run():
        step = jax.jit(lambda g, s, p: tx.update(g, s, p))   # traced afresh per run
        out, state = step(grads, tx.init(params), params)
        return step(jax.tree.map(lambda g: jnp.asarray(g) * 3, grads), state, params), step.lower(
            grads, state, params).as_text().count("stablehlo.reduce")

    monkeypatch.setattr(norms_lib, "_may_group", lambda: False)
    apart, reduces_apart = run()
    monkeypatch.setattr(norms_lib, "_may_group", lambda: True)
    monkeypatch.setattr(slices_lib, "COUNT_GROUP_PER", 1)
    together, reduces_together = run()
    assert reduces_together < reduces_apart       # the groups were taken
    for a, b in zip(jax.tree.leaves(apart), jax.tree.leaves(together), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_top_q_groups_grow_with_the_arrays_ranked_together(monkeypatch):
    """Few arrays are counted apart (a group's kernels compile slower than its arrays' own);
    groups of same-shape small arrays grow with the number ranked together, to at most 8."""
    monkeypatch.setattr(norms_lib, "_may_group", lambda: True)

    def group_sizes(shapes):
        groups = slices_lib._count_groups([jnp.zeros(s, jnp.uint32) for s in shapes])
        assert sorted(i for g in groups for i in g) == list(range(len(shapes)))
        return sorted(len(g) for g in groups)

    assert group_sizes([(4, 4)] * 32) == [1] * 32
    assert group_sizes([(4, 4)] * 41 + [(2, 3)] * 23) == [1, 1] + [2] * 31
    assert group_sizes([(4, 4)] * 128) == [4] * 32
    assert group_sizes([(4, 4)] * 250 + [(4097,)] * 6) == [1] * 6 + [2] + [8] * 31
    assert group_sizes([(4, 4)] * 2000) == [8] * 250

# Magnitudes that tie, cross the zero, overflow, underflow and are not numbers.
_RANK_VALUES = [0.0, -0.0, 1.0, -1.0, 2.0, 0.5, 1e-45, -3e38, np.inf, -np.inf, np.nan]


def test_ranking_by_blocks_keeps_the_oracles_entries_whatever_the_values():
    """The search by blocks of rows stops once every row of a block is settled (exactly k
    entries at or above its cut, or a cut one bit pattern wide) and keeps every zero of a row
    with fewer than k non-zero entries: on rows drawn from ties, signed zeros, subnormals,
    infinities and NaN, with every k from 0 to the row's length, the outputs are the oracle's
    (ties to the lowest index, NaN largest), bit for bit up to the sign of a zero."""
    from hypothesis.extra.numpy import arrays

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slices_lib, "single_cpu_device", lambda: True)   # the suite has 8
        patch.setattr(slices_lib, "RANK_BLOCK_ENTRIES", 12)
        assert slices_lib._block_rows(jnp.zeros((12, 6))) == 2       # 6 blocks of 2 rows
        ranked = jax.jit(lambda g, k: slices_lib.top_q_kept(g, (1,), k))

        @given(arrays(F32, (12, 6), elements=st.sampled_from(_RANK_VALUES)),
               st.integers(0, 6), st.randoms(use_true_random=False))
        def check(g, k, random):
            # Half the rows distinct random values: rows that settle early next to rows that
            # need the whole search and the tie-break.
            for row in random.sample(range(12), 6):
                g[row] = np.asarray([random.uniform(-4, 4) for _ in range(6)], F32)
            np.testing.assert_array_equal(ranked(g, jnp.int32(k)), _top_k_oracle(g, k))

        check()


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
def test_a_subnormal_outranks_zeros(monkeypatch, blocks):
    """The ranking reads magnitudes as integer bit patterns: a subnormal (which a fused float
    comparison on a CPU reads as 0) ranks above the zeros of its row and below 1.0."""
    monkeypatch.setattr(slices_lib, "single_cpu_device", lambda: True)   # the suite has 8
    monkeypatch.setattr(slices_lib, "RANK_BLOCK_ENTRIES", 12 if blocks else 1 << 30)
    g = np.zeros((4, 6), F32)
    g[:, 1], g[:, 3], g[2, 5] = 1e-45, -1e-40, 1.0
    for q, kept in ((0.8, 1), (0.6, 2)):         # k = 1, then 2
        out = jax.jit(optclip.top_q(q).update)(g, optclip.top_q(q).init(g))[0]
        want = _top_k_oracle(g, kept)
        np.testing.assert_array_equal(out, want)
        assert np.count_nonzero(want[0]) == kept and np.count_nonzero(want[2]) == kept


@pytest.mark.parametrize("dq", [0.0, 0.2], ids=["fixed_k", "drawn_k"])
def test_top_q_ranked_by_blocks_of_rows_matches_the_oracle(monkeypatch, dq):
    """With blocks of 12 entries, the (7, 5) leaf is ranked in 4 blocks of 2 rows, the last
    overlapping the one before it, and the (2, 3, 4) leaf in 2 blocks of 3 rows; (2, 5)
    has too few rows and is ranked with the vectors. Ties at the cut-off (the lowest
    indices kept), a NaN and a zero row: the same outputs as one search over the whole leaf,
    jitted and not, with a fixed and with a drawn count, and the oracle's."""
    rng = np.random.default_rng(11)
    grads = {"a": rng.normal(size=(7, 5)).astype(F32), "b": rng.normal(size=(3,)).astype(F32),
             "c": rng.normal(size=(2, 3, 4)).astype(F32), "d": rng.normal(size=(2, 5)).astype(F32)}
    grads["a"][6] = 2.0          # a tied row in the last, overlapping block
    grads["a"][2, [0, 3]] = np.nan
    grads["c"][1, 2] = 0.0
    grads["c"][0, 1, 1:] = -3.0
    tx = optclip.top_q(0.5, dq=dq, seed=3)
    monkeypatch.setattr(slices_lib, "single_cpu_device", lambda: True)  # the suite has 8
    monkeypatch.setattr(slices_lib, "RANK_BLOCK_ENTRIES", 1 << 30)
    whole = tx.update(grads, tx.init(grads))[0]
    monkeypatch.setattr(slices_lib, "RANK_BLOCK_ENTRIES", 12)
    assert [slices_lib._block_rows(jnp.zeros(s)) for s in [(7, 5), (2, 3, 4), (2, 5)]] == [
        2, 3, 0]
    state = tx.init(grads)
    for update in (tx.update, jax.jit(tx.update)):
        blocks = update(grads, state)[0]
        for name in grads:
            np.testing.assert_array_equal(blocks[name], whole[name], err_msg=name)
    if dq == 0.0:
        for name, g in grads.items():   # NaN ranks as the largest magnitude
            want = oracle_top_q(g, 0.5, -1)
            np.testing.assert_array_equal(blocks[name], want, err_msg=name)


def _l1q_oracle(g, k, eps=slices_lib.TINY):
    """NumPy l1q of every row: the signs of the top k (as ``_top_k_oracle``) over their count
    of non-zero entries; a kept NaN makes that count, and so its row, NaN."""
    kept = _top_k_oracle(g, k)
    signs = np.where(kept == 0, 0.0, np.sign(kept))
    count = np.abs(signs).sum(axis=-1, keepdims=True)
    return signs / np.where(count == 0, 1.0, np.maximum(count, eps))


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
def test_l1q_divides_by_the_count_of_kept_non_zero_entries(monkeypatch, blocks):
    """l1q counts a row's non-zero entries n, not its kept signs: min(k, n). The NumPy oracle
    counts the kept signs: rows with a NaN (kept, so the whole row is NaN, also when fewer than
    k entries are non-zero, and when it ties with infinities by magnitude), with fewer non-zero
    entries than k, with signed zeros and an infinity, ties at the cut; k = 0 (no row NaN), k
    static and traced, jitted and not, by blocks of rows and whole."""
    g = np.random.default_rng(5).normal(size=(8, 6)).astype(F32)
    g[0, 2] = np.nan                                   # kept, cut > 0: the row is NaN
    g[1] = [0.0, -0.0, 3.0, 0.0, -0.0, 0.0]            # fewer non-zero entries than k
    g[2] = [0.0, np.nan, 0.0, 0.0, 0.0, -0.0]          # a NaN, the cut 0
    g[3, 4] = -np.inf
    g[4] = [1.0, -1.0, 1.0, 2.0, -1.0, 1.0]            # ties at the cut
    g[5] = 0.0
    g[6] = [np.inf, -np.inf, np.nan, 1.0, 2.0, np.inf]  # the NaN ties with the infinities
    if blocks:
        monkeypatch.setattr(slices_lib, "single_cpu_device", lambda: True)  # the suite has 8
        monkeypatch.setattr(slices_lib, "RANK_BLOCK_ENTRIES", 12)
        assert slices_lib._block_rows(jnp.asarray(g)) == 2
    traced = jax.jit(lambda g, k: slices_lib.l1q(g, (1,), k, slices_lib.TINY))
    for k in (0, 1, 2, 4, 6):
        want = _l1q_oracle(g, k)
        assert np.isnan(want[0]).all() == (k > 0) and np.isnan(want[2]).all() == (k > 0)
        tx = optclip.l1q_normalize(1 - k / 6)
        for update in (tx.update, jax.jit(tx.update)):
            np.testing.assert_array_equal(update(g, tx.init(g))[0], want, err_msg=str(k))
        np.testing.assert_array_equal(traced(g, k), want, err_msg=f"traced {k}")


def test_l1q_counts_the_signs_kept_where_the_cut_is_subnormal():
    """XLA:CPU's float operations read a subnormal as 0: its sign is 0. A row whose cut is a
    subnormal magnitude keeps entries whose sign is 0, and counts only the others, so every
    row with a non-zero sign has L1 norm 1 (NumPy, which does not flush subnormals, cannot
    serve as the oracle here)."""
    tiny = np.finfo(F32).tiny
    g = np.array([[tiny / 4, -tiny / 2, 0.0, 0.0, 5.0, 0.0],      # cut tiny / 4: subnormal
                  [1.0, -2.0, 0.0, 3.0, tiny / 8, 0.0]], F32)
    for update in (optclip.l1q_normalize(0.5).update, jax.jit(optclip.l1q_normalize(0.5).update)):
        out = np.asarray(update(g, optclip.l1q_normalize(0.5).init(g))[0])
        np.testing.assert_array_equal(out[:, 2:4], [[0, 0], [0, F32(1) / 3]])
        np.testing.assert_allclose(np.abs(out).sum(axis=1), 1.0, rtol=1e-6)
