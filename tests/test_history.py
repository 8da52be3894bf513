"""Tests for optclip/history.py: reference vectors (drytorch, zclip, autoclip), a scalar oracle,
properties."""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import flax.serialization
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given

import optclip
from optclip import history

enable_x64 = jax.enable_x64

# ---------------------------------------------------------------------------------------------
# The reference input: 40 calls, parameters a (2) and b (2).
G = np.array([
    [0.29, -0.43, 0.21, 0.07], [0.3, -0.41, 0.17, 0.1], [0.26, -0.41, 0.17, 0.08],
    [0.29, -0.37, 0.18, 0.08], [0.31, -0.36, 0.2, 0.09], [0.34, -0.44, 0.22, 0.09],
    [0.27, -0.43, 0.19, 0.12], [0.27, -0.39, 0.21, 0.09], [0.3, -0.43, 0.17, 0.08],
    [1.24, -1.64, 0.76, 0.44], [0.3, -0.42, 0.22, 0.11], [0.28, -0.39, 0.2, 0.12],
    [0.32, -0.42, 0.23, 0.08], [0.29, -0.38, 0.18, 0.1], [0.26, -0.39, 0.22, 0.1],
    [0.33, -0.41, 0.21, 0.11], [0.31, -0.4, 0.22, 0.13], [0.3, -0.39, 0.17, 0.11],
    [0.31, -0.36, 0.22, 0.09], [0.29, -0.39, 0.17, 0.1], [0.27, -0.43, 0.17, 0.12],
    [0.27, -0.42, 0.19, 0.12], [0.27, -0.4, 0.2, 0.12], [1.98, -2.22, 0.19, 0.09],
    [0.29, -0.37, 0.23, 0.08], [0.27, -0.42, 0.18, 0.1], [2.48, -3.36, 0.17, 0.1],
    [0.29, -0.39, 0.23, 0.11], [0.3, -0.39, 0.21, 0.07], [0.33, -0.38, 0.22, 0.12],
    [0.29, -0.41, 0.18, 0.11], [0.26, -0.43, 0.18, 0.08], [0.29, -0.44, 1.7, 0.8],
    [0.27, -0.41, 0.17, 0.12], [0.31, -0.43, 0.19, 0.09], [0.29, -0.43, 0.22, 0.13],
    [0.3, -0.4, 0.18, 0.08], [1.45, -2.1, 1.1, 0.4], [0.026, -0.036, 0.02, 0.008],
    [0.3, -0.44, 0.2, 0.13]])

# Pre-clip global norms (checks the norm itself).
PRE = {1: 0.563914887195, 10: 2.235710178, 24: 2.98211334459, 27: 4.18077743966,
       33: 1.9513328778, 38: 2.80757902827, 39: 0.049355850717, 40: 0.583523778436}

SAME = "="
RTOL64 = 2e-11   # the tables print 12 significant digits
RTOL32 = 2e-6    # the references move by <= 9e-8 (drytorch, ZClip), 1e-6 (autoclip) in float32
RTOL32_AUTOCLIP = 5e-6  # a float32 quantile rank q * (k - 1) is itself off by ~1e-6

zs, ema = optclip.zscore_criterion, optclip.ema_criterion
mx, mn, rc = optclip.max_clipping, optclip.mean_clipping, optclip.reciprocal_clipping

# Global columns: name -> (factory, {call: post-op global norm or SAME}). Calls not listed are
# unchanged (bit-identical).
GLOBAL_COLUMNS = {
    # drytorch HistClipper, N = 20, GradNormClipper(1) warm-up.
    "HC-Z/recip": (lambda: optclip.hist_clip(), {
        10: 0.999999552715, 24: 0.971239679509, 27: 1.18221848549, 33: SAME,
        38: 2.353716193}),
    "HC-Z/max": (lambda: optclip.hist_clip(zs(clip_fn=mx)), {
        10: 0.999999552715, 24: 1.52945231075, 27: 2.00377557614, 38: 2.56641947751}),
    "HC-Z/mean": (lambda: optclip.hist_clip(zs(clip_fn=mn)), {
        10: 0.999999552715, 24: 0.622866635502, 27: 0.684258998198, 38: 0.763756292674}),
    "HC-EMA/max": (lambda: optclip.hist_clip(ema()), {
        10: 0.999999552715, 24: 0.65660161136, 27: 0.700370367282, 33: 0.754956199918,
        38: 0.765441957301}),
    "HC-EMA/recip": (lambda: optclip.hist_clip(ema(clip_fn=rc)), {
        10: 0.999999552715, 24: 0.144570568182, 27: 0.117327166005, 33: 0.292087097166,
        38: 0.208685701375}),
    "HC-EMA/mean ref": (lambda: optclip.hist_clip(ema(clip_fn=mn, parity="reference")), {
        10: 0.999999552715, 24: 0.0, 27: 0.0, 33: 0.0, 38: 0.0}),
    # zclip.
    "Z1": (lambda: optclip.zclip(), {
        10: 0.999999552715, 24: 0.999999664667, 27: 0.99999976081, 33: 0.99999948753,
        38: 0.999999643821}),
    "Z2": (lambda: optclip.zclip(max_grad_norm=None), {27: 1.27361708955, 38: 1.54600617554}),
    "Z3": (lambda: optclip.zclip(max_grad_norm=None, mode="percentile"), {
        27: 2.11084473715, 38: 2.13230036157}),
    "Z4": (lambda: optclip.zclip(max_grad_norm=None, clip_option="mean"), {
        27: 0.704986163287, 38: 0.701688521911}),
    "Z5": (lambda: optclip.zclip(max_grad_norm=None, skip_update_on_spike=True), {
        27: 1.27361708955, 38: 1.52884480415}),
    "Z6": (lambda: optclip.zclip(max_grad_norm=None, clip_factor=0.7), {
        27: 0.891531962683, 38: 1.06122959677}),
    "Z7": (lambda: optclip.zclip(max_grad_norm=None, warmup_steps=20), {
        24: 0.953807076125, 27: 0.833550637582, 33: 1.08963004159, 38: 0.888906767112}),
    # autoclip, global mode.
    "Q": (lambda: optclip.quantile_clip(global_threshold=True), {
        6: 0.556338837835, 10: 0.572077922936, 24: 0.580617699141, 27: 0.593097365994,
        33: 0.602404269105, 38: 1.14337155106}),
    "Q5": (lambda: optclip.quantile_clip(history_length=5, global_threshold=True), {
        6: 0.556338837835, 10: 0.585620950297, 24: 0.548251275345, 27: 2.00828350755,
        33: 0.556863105493, 38: 1.4020739557}),
}
# StandardClip global: every call from 3 on is clipped (A1); call 2 is NaN in the reference
# (A2) and unchanged when fixed.
_S = {3: 0.0267820753282, 4: 0.0434528046818, 5: 0.0487615464977, 6: 0.0434707248697,
      7: 0.0706489809892, 8: 0.0650005253177, 9: 0.0617479113233, 10: 0.0584408309036,
      24: 0.706377416217, 27: 1.14242019231, 33: 1.61221674275, 38: 1.55332261564}
GLOBAL_COLUMNS["S ref"] = (
    lambda: optclip.standard_clip(global_threshold=True, parity="reference"),
    {2: math.nan, **_S})
GLOBAL_COLUMNS["S"] = (lambda: optclip.standard_clip(global_threshold=True), {2: SAME, **_S})

# Per-parameter columns: name -> (factory, {call: (‖a‖, ‖b‖)}).
LOCAL_COLUMNS = {
    "PHC": (lambda: optclip.param_hist_clip(), {
        10: (0.999999513623, SAME), 24: (0.859965433064, SAME), 27: (1.10283526661, SAME),
        33: (SAME, 0.303783022333), 38: (2.27636902146, 0.884417347947)}),
    "Qloc": (lambda: optclip.quantile_clip(), {
        5: (SAME, 0.214119877816), 6: (0.514404507159, 0.2205415827),
        10: (0.530658507421, 0.23031774957), 17: (SAME, 0.244740737637),
        24: (0.527673522586, SAME), 27: (0.542036221344, SAME), 28: (SAME, 0.244495579962),
        30: (SAME, 0.247763188473), 33: (SAME, 0.250135968169), 36: (SAME, 0.253209307212),
        38: (0.540479407338, 0.255185826101)}),
}
_SLOC = {
    3: (0.0150142040423, 0.0341228216129), 4: (0.0338702386478, 0.0345468776597),
    5: (0.0437900788734, 0.0286792054167), 6: (0.0421202108049, 0.0298215783148),
    7: (0.0648081875235, 0.0379973009207), 8: (0.059307593783, 0.0364103329034),
    9: (0.0585338491522, 0.0356261947839), 10: (0.0572090031549, 0.037663952582),
    24: (0.651144067319, SAME), 27: (1.12801867231, SAME), 30: (SAME, 0.247139982847),
    33: (SAME, 0.23575371991), 38: (1.50825784438, 0.582214521088)}
LOCAL_COLUMNS["Sloc ref"] = (lambda: optclip.standard_clip(parity="reference"),
                             {2: (math.nan, math.nan), **_SLOC})
LOCAL_COLUMNS["Sloc"] = (lambda: optclip.standard_clip(), {2: (SAME, SAME), **_SLOC})


def g_tree(rows, dtype):
    rows = np.asarray(rows)
    return {"a": jnp.asarray(rows[..., :2], dtype), "b": jnp.asarray(rows[..., 2:], dtype)}


@functools.cache
def multi_scanner(makes: tuple):
    """One jitted scan running the transforms built by ``makes`` side by side (cached), each on
    its own stacked inputs: ``go(inputs) -> (outputs, states after every call)``, per transform.
    """
    txs = [make() for make in makes]

    @jax.jit
    def go(inputs):
        def step(states, gs):
            outs, new = zip(*(tx.update(g, s) for tx, g, s in zip(txs, gs, states, strict=True)),
                            strict=True)
            return new, (outs, new)

        init = tuple(tx.init(jax.tree.map(lambda x: x[0], g))
                     for tx, g in zip(txs, inputs, strict=True))
        return jax.lax.scan(step, init, tuple(inputs))[1]

    return go


def scanner(makes: tuple):
    """Like ``multi_scanner``, every transform on the same inputs: ``go(grads)``."""
    go = multi_scanner(makes)
    return lambda grads: go((grads,) * len(makes))


def run_scan(make, grads):
    """Outputs of every call and the final state of ``make()`` run over ``grads``' leading axis."""
    outs, states = scanner((make,))(grads)
    return outs[0], jax.tree.map(lambda x: x[-1], states[0])


def rows(tree):
    """The calls of a stacked tree, one tree per call."""
    length = len(jax.tree.leaves(tree)[0])
    return [jax.tree.map(lambda x, t=t: x[t], tree) for t in range(length)]


def run_loop(tx, seq, update=None):
    update = update or tx.update
    state = tx.init(seq[0])
    outs = []
    for g in seq:
        out, state = update(g, state)
        outs.append(out)
    return outs, state


def leaf_norms(tree):
    return {k: np.sqrt(np.sum(np.asarray(v, np.float64) ** 2, axis=-1)) for k, v in tree.items()}


def check_column(name, got, pre, table, rtol):
    for t in range(1, len(got) + 1):
        want = table.get(t, SAME)
        if want is SAME:
            assert got[t - 1] == pre[t - 1], (name, t, got[t - 1], pre[t - 1])
        elif math.isnan(want):
            assert math.isnan(got[t - 1]), (name, t, got[t - 1])
        else:
            np.testing.assert_allclose(got[t - 1], want, rtol=rtol, atol=1e-300,
                                       err_msg=f"{name} call {t}")


DTYPES = [pytest.param(jnp.float64, id="f64"), pytest.param(jnp.float32, id="f32")]


def column_tolerance(name, dtype):
    if dtype == jnp.float64:
        return RTOL64
    return RTOL32_AUTOCLIP if name.startswith(("Q", "S")) else RTOL32


@functools.cache
def run_columns(table_id: str, dtype):
    """Run every column of a reference table over G in one scan: (inputs, outputs, states)."""
    table = {"global": GLOBAL_COLUMNS, "local": LOCAL_COLUMNS}[table_id]
    with enable_x64(dtype == jnp.float64):
        grads = g_tree(G, dtype)
        outs, states = scanner(tuple(make for make, _ in table.values()))(grads)
        return grads, dict(zip(table, outs, strict=True)), dict(zip(table, states, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(GLOBAL_COLUMNS))
def test_spec_global_columns(name, dtype):
    grads, outs, _ = run_columns("global", dtype)
    outs, table = outs[name], GLOBAL_COLUMNS[name][1]
    norm = lambda tree: np.sqrt(sum(v ** 2 for v in leaf_norms(tree).values()))
    got, pre = norm(outs), norm(grads)
    if dtype == jnp.float64:
        for t, want in PRE.items():
            np.testing.assert_allclose(pre[t - 1], want, rtol=RTOL64)
    # "=" cells and unlisted calls: the gradients themselves are unchanged.
    unchanged = np.array([t for t in range(1, 41) if table.get(t, SAME) is SAME]) - 1
    for k in ("a", "b"):
        np.testing.assert_array_equal(np.asarray(outs[k])[unchanged],
                                      np.asarray(grads[k])[unchanged])
    check_column(name, got, pre, table, column_tolerance(name, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(LOCAL_COLUMNS))
def test_spec_local_columns(name, dtype):
    grads, outs, _ = run_columns("local", dtype)
    got, pre = leaf_norms(outs[name]), leaf_norms(grads)
    for i, k in enumerate(("a", "b")):
        column = {t: cells[i] for t, cells in LOCAL_COLUMNS[name][1].items()}
        check_column(f"{name} {k}", got[k], pre[k], column, column_tolerance(name, dtype))


# Internal checkpoints of the references: (column, state after call, field getter, expected).
CHECKPOINTS = [
    ("HC-Z/recip", 21, lambda s: (s.criterion.mean, s.criterion.var),
     (0.627966117336, 0.139308001496)),
    ("HC-Z/recip", 23, lambda s: (s.criterion.mean, s.criterion.var),
     (0.6228668443698645, 0.13150370204622697)),
    ("HC-Z/recip", 32, lambda s: (s.criterion.mean, s.criterion.var),
     (0.75493501941843189, 0.55435512071042614)),
    ("HC-EMA/max", 21, lambda s: (s.criterion.mean,), (0.6287830278573616,)),
    ("HC-EMA/max", 23, lambda s: (s.criterion.mean,), (0.6253350776572671,)),
    ("Z2", 25, lambda s: (s.mean, s.var), (0.7100861385291458, 0.32516967586876694)),
    ("Z2", 26, lambda s: (s.mean, s.var), (0.70498633191294036, 0.31623028402924064)),
    ("Z2", 27, lambda s: (s.mean, s.var, s.threshold),
     (0.72204526378105038, 0.31587032995945685, 1.2736173941832742)),
    ("Z2", 32, lambda s: (s.mean, s.var), (0.69730585433289827, 0.274867075041693)),
    ("Z7", 20, lambda s: (s.mean, s.var), (0.6304168489007209, 0.1362395966220858)),
    ("Z7", 33, lambda s: (s.threshold,), (1.0896305999917657,)),
]


@pytest.mark.parametrize("column,call,get,want", CHECKPOINTS,
                         ids=[f"{c[0]}@{c[1]}" for c in CHECKPOINTS])
def test_spec_checkpoints(column, call, get, want):
    _, _, states = run_columns("global", jnp.float64)
    state = jax.tree.map(lambda x: x[call - 1], states[column])
    np.testing.assert_allclose(np.array(get(state), np.float64), want, rtol=1e-11)


def test_spec_install_statistics():
    """The default HistClipper installs mean 0.6304..., unbiased variance 0.1434...."""
    _, _, states = run_columns("global", jnp.float64)
    state = jax.tree.map(lambda x: x[19], states["HC-Z/recip"])
    with enable_x64(True):
        mean, var = history._warmup_statistics(state.warmup_norms, 20)
    np.testing.assert_allclose([mean, var], [0.63041684890072092, 0.14341010170745874],
                               rtol=1e-13)
    assert int(state.count) == 20


# Edge cases: a single leaf [x, 0] plus a zero second leaf, so the global norm is x.
EDGE = [
    ("E1", lambda: optclip.hist_clip(warmup_transform=optax.identity(), warmup_steps=3),
     [2, 2, 2, 2, 6, 6], [2, 2, 2, 2, 3.5156244294514356, 4.408820160686574]),
    ("E2 ref", lambda: optclip.zclip(warmup_steps=3, max_grad_norm=None, parity="reference"),
     [2, 2, 2, 2, 2.1, 6, 1.5, 2.0000001],
     [2, 2, 2, 2, 1.999999047619501, 1.9999996666667221, 1.5, 2.0000001]),
    ("E3 ref", lambda: optclip.hist_clip(ema(parity="reference"), warmup_steps=0,
                                         parity="reference"),
     [1, 1, 1, 1], [1, 0.02099997900002102, 0.04157995842004162, 0.06174833825166181]),
    ("E4 ref zscore", lambda: optclip.zclip(warmup_steps=3, max_grad_norm=None,
                                            parity="reference"),
     [0, 0, 0, 1, 1, 1, 0.5], [0, 0, 0, 0, 0, 0, 0]),
    ("E4 ref percentile", lambda: optclip.zclip(warmup_steps=3, max_grad_norm=None,
                                                mode="percentile", parity="reference"),
     [0, 0, 0, 1, 1, 1, 0.5], [0, 0, 0, 0, 0, 0, 0]),
    ("E5", lambda: optclip.hist_clip(warmup_transform=optax.identity(), warmup_steps=1),
     [1, 1, 9, 1], [1, 1, 1.7578123123819414, 1]),
    ("E6 ref W=0", lambda: optclip.zclip(warmup_steps=0, max_grad_norm=None, parity="reference"),
     [1, 1.5, 9], [1, 0.9999993333337779, 0.9999998888889013]),
    ("E6 ref W=1", lambda: optclip.zclip(warmup_steps=1, max_grad_norm=None, parity="reference"),
     [1, 1.5, 9], [1, 0.9999993333337779, 0.9999998888889013]),
    ("E7 ref", lambda: optclip.standard_clip(global_threshold=True, parity="reference"),
     [1, 1, 1, 1], [1, math.nan, 0, 0]),
    ("E7", lambda: optclip.standard_clip(global_threshold=True), [1, 1, 1, 1], [1, 1, 0, 0]),
    ("E9", lambda: optclip.quantile_clip(history_length=1, global_threshold=True),
     [1, 2, 0.5, 3], [1, 0.99999950000025, 0.5, 0.4999998333333889]),
    ("E10 q0", lambda: optclip.quantile_clip(0.0, global_threshold=True),
     [1, 3, 5, 4], [1, 0.9999996666667778, 0.99999980000004, 0.9999997500000625]),
    ("E10 q.5", lambda: optclip.quantile_clip(0.5, global_threshold=True),
     [1, 3, 5, 4], [1, 0.9999996666667778, 1.99999960000008, 2.9999992500001875]),
    ("E10 q1", lambda: optclip.quantile_clip(1.0, global_threshold=True),
     [1, 3, 5, 4], [1, 0.9999996666667778, 2.99999940000012, 4]),
    ("E13", lambda: optclip.quantile_clip(global_threshold=True),
     [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0.6999993000007002, 0.9999990000010001]),
    # D7 reproducer: a low-side detection (z = -9.138) changes nothing.
    ("D7", lambda: optclip.hist_clip(warmup_transform=optax.identity(), warmup_steps=3),
     [1, 1.1, 0.9, 1, 0.1], [1, 1.1, 0.9, 1, 0.1]),
    # Fixed behaviour: with zero variance ZClip detects nothing until the variance grows (Z1).
    ("E2 fixed", lambda: optclip.zclip(warmup_steps=3, max_grad_norm=None),
     [2, 2, 2, 2, 2.1, 6, 1.5, 2.0000001], None),
    ("E4 fixed", lambda: optclip.zclip(warmup_steps=3, max_grad_norm=None),
     [0, 0, 0, 1, 1, 1, 0.5], None),
]


EDGE.append(("E3 fixed", lambda: optclip.hist_clip(ema(), optax.identity(), 1),
             [0, 1, 1, 1], [0, 1, 1, 1]))
# E8, E11, E12 with the non-finite fix: the inf/NaN call's own output follows the formula
# (inf * 0 = NaN), and the call is not recorded, so later calls match the run without it.
_E11 = [1, 1.2, 0.9, 1.1, math.inf, 1, 5]
EDGE += [
    ("E11 fixed", lambda: optclip.hist_clip(warmup_transform=optax.identity(), warmup_steps=3),
     _E11, None),
    ("E11 NaN fixed", lambda: optclip.hist_clip(warmup_transform=optax.identity(),
                                                warmup_steps=3),
     _E11[:4] + [math.nan] + _E11[5:], None),
    # E12: the warm-up outputs, call 4 and the capped call 7 are the reference's own numbers.
    ("E12 fixed", lambda: optclip.zclip(warmup_steps=3),
     _E11, [0.9999990000010001, 0.9999991666673611, 0.9, 0.9999990909099175, math.nan, 1,
            0.99999980000004]),
    ("E12 nocap fixed", lambda: optclip.zclip(warmup_steps=3, max_grad_norm=None), _E11, None),
    ("E8 fixed", lambda: optclip.quantile_clip(history_length=3, global_threshold=True),
     [1, 1.1, math.inf, 1, 0.9, 1.2, 1], None),
]
EDGE_CALLS = 8


def edge_seq(xs, dtype):
    """Gradient [x, 0] plus a zero leaf, so the global norm is x; padded to EDGE_CALLS calls
    (later calls cannot change earlier outputs)."""
    xs = list(xs) + [1.0] * (EDGE_CALLS - len(xs))
    return {"x": jnp.asarray([[x, 0.0] for x in xs], dtype),
            "zero": jnp.zeros((len(xs), 3), dtype)}


@functools.cache
def run_edges():
    """Every EDGE case on its own inputs, in one jitted scan (float64)."""
    with enable_x64(True):
        outs, states = multi_scanner(tuple(make for _, make, _, _ in EDGE))(
            tuple(edge_seq(xs, jnp.float64) for _, _, xs, _ in EDGE))
    return {case[0]: (np.asarray(out["x"])[:, 0], state)
            for case, out, state in zip(EDGE, outs, states, strict=True)}


def edge_state(name, call):
    return jax.tree.map(lambda x: x[call - 1], run_edges()[name][1])


@pytest.mark.parametrize("name,make,inputs,want", EDGE, ids=[e[0] for e in EDGE])
def test_spec_edge_cases(name, make, inputs, want):
    got = run_edges()[name][0][:len(inputs)]
    if want is None:
        want = oracle(name, inputs)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0, equal_nan=True)


FINAL_STATISTICS = [
    ("E1", 6, lambda s: (s.criterion.mean, s.criterion.var), (2.2364, 1.829905), 1e-5),
    ("E2 ref", 8, lambda s: (s.mean, s.var), (1.985450003, 0.006851398659681284), 1e-9),
    ("E3 ref", 4, lambda s: (s.criterion.mean,), (0.07763184,), 1e-7),
    ("E3 fixed", 4, lambda s: (s.criterion.mean,), (1.0,), 0),  # D4 fixed: starts at 1
    ("E6 ref W=0", 3, lambda s: (s.mean, s.var), (1.0, 0.0), 0),
]


@pytest.mark.parametrize("name,call,get,want,rtol", FINAL_STATISTICS,
                         ids=[f[0] for f in FINAL_STATISTICS])
def test_spec_edge_final_statistics(name, call, get, want, rtol):
    np.testing.assert_allclose(np.array(get(edge_state(name, call)), np.float64), want,
                               rtol=rtol)


def test_shared_state_reproducer_separate():
    """Two default hist_clip instances used alternately behave like separate ones."""
    with enable_x64(True):
        first, second = optclip.hist_clip(), optclip.hist_clip()
        seq = [g_tree(row, jnp.float64) for row in G]
        s1, s2 = first.init(seq[0]), second.init(seq[0])
        u1, u2 = jax.jit(first.update), jax.jit(second.update)
        got = {}
        for t, g in enumerate(seq, 1):
            o1, s1 = u1(g, s1)
            o2, s2 = u2(jax.tree.map(lambda x: 10 * x, g), s2)
            got[t] = (float(optax.tree.norm(o1)), float(optax.tree.norm(o2)))
        np.testing.assert_allclose(got[24], (0.971239679509, 9.71239963982), rtol=RTOL64)
        np.testing.assert_allclose(got[27], (1.18221848549, 11.822187315), rtol=RTOL64)


# ---------------------------------------------------------------------------------------------
# An independent scalar oracle, written from the references' formulas (Python floats, one call at a
# time), for random sequences with spikes.

def tclip(c, n):
    return min(1.0, c / (n + 1e-6))


CLIP_FNS = {"max": lambda z, t: t, "mean": lambda z, t: 0.0, "recip": lambda z, t: t * t / z}


def oracle_hist(ns, crit="zscore", fn="recip", steps=20, alpha=0.97, thr=2.5, warm=1.0,
                feedback="raw", parity="fixed"):
    """drytorch HistClipper on norms ``ns``; returns the scale per call."""
    f = CLIP_FNS[fn]
    mu, v, buf, count, out = 0.0, 1.0, [], 0, []
    for n in ns:
        if not math.isfinite(n):
            out.append(None)
            continue
        if count < steps:
            buf.append(n)
            count += 1
            out.append(tclip(warm, n) if warm else 1.0)
            continue
        if count == steps:
            mu = sum(buf) / steps if steps else 0.0
            var = sum((x - mu) ** 2 for x in buf) / (steps - 1) if steps > 1 else 1.0
            if var > 0:
                v = var
            count += 1
        if crit == "zscore":
            z = (n - mu) / (math.sqrt(v) + 1e-8)
            should = mu != 0 and abs(z) > thr
            c = mu + f(abs(z), thr) * math.sqrt(v) if should else n
        else:
            should = mu != 0 and n / mu > thr
            ratio = 1.0 if (fn == "mean" and parity == "fixed") else (
                f(n / mu, thr) if mu != 0 else 0.0)
            c = mu * ratio if mu != 0 else n
        out.append(tclip(c, n) if should else 1.0)
        x = c if (feedback == "clip_value" and should) else n
        if crit == "zscore":
            v = alpha * v + (1 - alpha) * (x - mu) ** 2
            mu = alpha * mu + (1 - alpha) * x
        else:
            mu = x if (parity == "fixed" and mu == 0) else alpha * mu + (1 - alpha) * x
    return out


def oracle_zclip(ns, alpha=0.97, z_thresh=2.5, cap=1.0, eps=1e-6, warmup=25, mode="zscore",
                 option="adaptive_scaling", factor=1.0, skip=False, parity="fixed"):
    """zclip ZClip.step on norms ``ns``; returns the scale per call."""
    buf, init, mean, var, out = [], False, None, None, []
    for n in ns:
        if not math.isfinite(n):
            out.append(None)
            continue
        if not init:
            buf.append(n)
            if len(buf) >= max(warmup, 1):
                mean = sum(buf) / len(buf)
                var = sum((x - mean) ** 2 for x in buf) / len(buf)
                init, buf = True, []
            out.append(tclip(cap, n) if cap is not None else 1.0)
            continue
        std = math.sqrt(var)
        if mode == "percentile":
            thr = mean + z_thresh * std
            spike = n > thr
        else:
            z = (n - mean) / (std + eps)
            spike = z > z_thresh
        if parity == "fixed" and std == 0:
            spike = False
        if spike and mode == "zscore":
            thr = mean if option == "mean" else factor * (mean + z_thresh * std / (z / z_thresh))
        adaptive = thr if spike else n
        eff = adaptive if cap is None else min(adaptive, cap)
        out.append(eff / (n + 1e-6) if n > eff else 1.0)
        if not (spike and skip):
            x = thr if spike else n
            mean = alpha * mean + (1 - alpha) * x
            var = alpha * var + (1 - alpha) * (x - mean) ** 2
    return out


def oracle_autoclip(ns, kind="quantile", q=0.9, dev=2.0, length=1000, add_mean=False,
                    parity="fixed"):
    """autoclip QuantileClip/StandardClip step on norms ``ns``; scales per call."""
    hist, out = [], []
    for n in ns:
        if not math.isfinite(n):
            out.append(None)
            continue
        if not hist:
            c = math.inf
        elif kind == "quantile":
            c = float(np.quantile(np.array(hist), q))
        elif len(hist) == 1:
            c = math.nan if parity == "reference" else math.inf
        else:
            c = dev * float(np.std(hist, ddof=1)) + (float(np.mean(hist)) if add_mean else 0.0)
        out.append(tclip(c, n))
        hist = (hist + [n])[-length:]
    return out


def oracle(name, inputs):
    """Expected first-element outputs of an EDGE case (NaN where the formula gives inf * 0)."""
    scales = {
        "E2 fixed": lambda: oracle_zclip(inputs, cap=None, warmup=3),
        "E4 fixed": lambda: oracle_zclip(inputs, cap=None, warmup=3),
        "E11 fixed": lambda: oracle_hist(inputs, steps=3, warm=None),
        "E11 NaN fixed": lambda: oracle_hist(inputs, steps=3, warm=None),
        "E12 nocap fixed": lambda: oracle_zclip(inputs, cap=None, warmup=3),
        "E8 fixed": lambda: oracle_autoclip(inputs, q=0.9, length=3),
    }[name]()
    return [math.nan if s is None else x * s for x, s in zip(inputs, scales, strict=True)]


def spiky_norms(rng, length, spikes):
    ns = 1.0 + 0.1 * rng.standard_normal(length)
    ns[spikes] *= rng.uniform(5, 20, len(spikes))
    return ns


def grads_with_norms(rng, ns, leaves=2):
    """Random directions with the given global norms (tree {'w': (T, 3, 2), 'b': (T, 4)})."""
    w = rng.standard_normal((len(ns), 3, 2))
    b = rng.standard_normal((len(ns), 4))
    total = np.sqrt((w ** 2).sum((1, 2)) + (b ** 2).sum(1))
    k = np.asarray(ns) / total
    return {"w": w * k[:, None, None], "b": b * k[:, None]}


ORACLE_CASES = [
    ("hist zscore/recip", lambda: optclip.hist_clip(warmup_steps=8),
     lambda ns: oracle_hist(ns, steps=8)),
    ("hist zscore/max clip_value", lambda: optclip.hist_clip(
        zs(0.9, 2.0, mx), warmup_steps=5, feedback="clip_value"),
     lambda ns: oracle_hist(ns, fn="max", steps=5, alpha=0.9, thr=2.0, feedback="clip_value")),
    ("hist zscore/mean identity", lambda: optclip.hist_clip(
        zs(clip_fn=mn), optax.identity(), 6),
     lambda ns: oracle_hist(ns, fn="mean", steps=6, warm=None)),
    ("hist ema/max", lambda: optclip.hist_clip(ema(), warmup_steps=4),
     lambda ns: oracle_hist(ns, "ema", "max", 4, 0.98, 1.05)),
    ("hist ema/mean fixed", lambda: optclip.hist_clip(ema(0.9, 1.5, mn), warmup_steps=4),
     lambda ns: oracle_hist(ns, "ema", "mean", 4, 0.9, 1.5)),
    ("hist ema/recip", lambda: optclip.hist_clip(ema(0.9, 1.2, rc), warmup_steps=3),
     lambda ns: oracle_hist(ns, "ema", "recip", 3, 0.9, 1.2)),
    ("zclip default", lambda: optclip.zclip(warmup_steps=6),
     lambda ns: oracle_zclip(ns, warmup=6)),
    ("zclip nocap", lambda: optclip.zclip(max_grad_norm=None, warmup_steps=6),
     lambda ns: oracle_zclip(ns, cap=None, warmup=6)),
    ("zclip percentile", lambda: optclip.zclip(0.9, 2.0, 5.0, warmup_steps=5,
                                               mode="Percentile"),
     lambda ns: oracle_zclip(ns, 0.9, 2.0, 5.0, warmup=5, mode="percentile")),
    ("zclip mean skip", lambda: optclip.zclip(max_grad_norm=3.0, warmup_steps=5,
                                              clip_option="MEAN", skip_update_on_spike=True),
     lambda ns: oracle_zclip(ns, cap=3.0, warmup=5, option="mean", skip=True)),
    ("zclip factor eps", lambda: optclip.zclip(max_grad_norm=None, eps=0.1, warmup_steps=4,
                                               clip_factor=0.8),
     lambda ns: oracle_zclip(ns, cap=None, eps=0.1, warmup=4, factor=0.8)),
    ("quantile L7", lambda: optclip.quantile_clip(0.7, 7, True),
     lambda ns: oracle_autoclip(ns, q=0.7, length=7)),
    ("quantile L50", lambda: optclip.quantile_clip(0.25, 50, True),
     lambda ns: oracle_autoclip(ns, q=0.25, length=50)),
    ("standard L6", lambda: optclip.standard_clip(1.5, 6, True),
     lambda ns: oracle_autoclip(ns, "std", dev=1.5, length=6)),
    ("standard add_mean", lambda: optclip.standard_clip(3.0, 10, True, add_mean=True),
     lambda ns: oracle_autoclip(ns, "std", dev=3.0, length=10, add_mean=True)),
]


@functools.cache
def run_oracle_cases(seed):
    """All ORACLE_CASES side by side in one scan over a random spiky sequence."""
    rng = np.random.default_rng(seed)
    ns = spiky_norms(rng, 60, rng.choice(np.arange(10, 60), 6, replace=False))
    grads = grads_with_norms(rng, ns)
    with enable_x64(True):
        outs, _ = scanner(tuple(make for _, make, _ in ORACLE_CASES))(
            jax.tree.map(jnp.asarray, grads))
    return ns, grads, {case[0]: out for case, out in zip(ORACLE_CASES, outs, strict=True)}


@pytest.mark.parametrize("name,make,expect", ORACLE_CASES, ids=[c[0] for c in ORACLE_CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_against_oracle(name, make, expect, seed):
    ns, grads, outs = run_oracle_cases(seed)
    outs = outs[name]
    scales = expect(list(ns))
    for k in grads:
        want = grads[k] * np.reshape(scales, (-1,) + (1,) * (grads[k].ndim - 1))
        np.testing.assert_allclose(outs[k], want, rtol=1e-12, atol=1e-15, err_msg=name)


PER_LEAF_ORACLE = [
    ("param_hist zscore", lambda: optclip.param_hist_clip(warmup_steps=6),
     lambda ns: oracle_hist(ns, steps=6)),
    ("param_hist ema", lambda: optclip.param_hist_clip(ema(0.95, 1.3), warmup_steps=4),
     lambda ns: oracle_hist(ns, "ema", "max", 4, 0.95, 1.3)),
    ("quantile local", lambda: optclip.quantile_clip(0.8, 9),
     lambda ns: oracle_autoclip(ns, q=0.8, length=9)),
    ("standard local", lambda: optclip.standard_clip(2.0, 8),
     lambda ns: oracle_autoclip(ns, "std", dev=2.0, length=8)),
]


@functools.cache
def run_per_leaf_cases():
    rng = np.random.default_rng(3)
    grads = {"w": rng.standard_normal((50, 3, 2)), "b": rng.standard_normal((50, 4)),
             "count": np.zeros((50, 2), np.int32)}
    grads["w"][[12, 30, 41]] *= 15
    grads["b"][[20, 30, 44]] *= 12
    with enable_x64(True):
        outs, states = scanner(tuple(make for _, make, _ in PER_LEAF_ORACLE))(
            jax.tree.map(jnp.asarray, grads))
    return grads, {case[0]: (out, jax.tree.map(lambda x: x[-1], state))
                   for case, out, state in zip(PER_LEAF_ORACLE, outs, states, strict=True)}


@pytest.mark.parametrize("name,make,expect", PER_LEAF_ORACLE, ids=[c[0] for c in PER_LEAF_ORACLE])
def test_per_leaf_against_oracle(name, make, expect):
    grads, results = run_per_leaf_cases()
    outs, state = results[name]
    np.testing.assert_array_equal(outs["count"], grads["count"])
    for k in ("w", "b"):
        ns = np.sqrt((grads[k] ** 2).reshape(50, -1).sum(1))
        scales = np.asarray(expect(list(ns)))
        want = grads[k] * scales.reshape((-1,) + (1,) * (grads[k].ndim - 1))
        np.testing.assert_allclose(outs[k], want, rtol=1e-12, atol=1e-15, err_msg=k)
        # The state's per-leaf norms: the last step's, one entry per floating leaf.
        np.testing.assert_allclose(optclip.per_leaf(state.norm, grads)[k], ns[-1], rtol=1e-12)
    assert state.norm.shape == (2,) and optclip.per_leaf(state.norm, grads)["count"] is None


# ---------------------------------------------------------------------------------------------
# Behaviour across the family.

FAMILY = {
    "hist_clip": lambda: optclip.hist_clip(warmup_steps=5),
    "hist_clip stateful warm-up": lambda: optclip.hist_clip(
        warmup_transform=optax.chain(optclip.clip_by_global_norm(1.0), optax.scale_by_adam()),
        warmup_steps=5),
    "param_hist_clip": lambda: optclip.param_hist_clip(ema(), warmup_steps=5),
    "param_hist_clip stateful warm-up": lambda: optclip.param_hist_clip(
        warmup_transform=optax.scale_by_rms(), warmup_steps=5),
    "zclip": lambda: optclip.zclip(max_grad_norm=None, warmup_steps=5),
    "zclip capped": lambda: optclip.zclip(warmup_steps=5, max_grad_norm=2.0),
    "quantile_clip global": lambda: optclip.quantile_clip(history_length=6,
                                                          global_threshold=True),
    "quantile_clip local": lambda: optclip.quantile_clip(history_length=6),
    "standard_clip": lambda: optclip.standard_clip(history_length=6, add_mean=True),
    "standard_clip local": lambda: optclip.standard_clip(history_length=6),
}
EAGER = ("hist_clip stateful warm-up", "param_hist_clip", "zclip capped", "standard_clip local")
DEFAULTS = [optclip.hist_clip, optclip.param_hist_clip, optclip.zclip, optclip.quantile_clip,
            optclip.standard_clip]


def family_seq(rng, length=16):
    ns = spiky_norms(rng, length, [9, 13])
    return rows(jax.tree.map(jnp.asarray, grads_with_norms(rng, ns)))


DIAGNOSTICS = ("norm", "threshold", "scale", "clipped", "nonfinite")


@pytest.mark.parametrize("name", list(FAMILY))
def test_jit_eager_nonfinite_checkpoint(name):
    """jit == eager; a NaN/inf step leaves the state as it was (later outputs equal the run
    without that step); a checkpoint round trip continues identically."""
    rng = np.random.default_rng(7)
    seq = family_seq(rng)
    tx = FAMILY[name]()
    update = jax.jit(tx.update)
    clean_outs, clean_state = run_loop(tx, seq, update)
    keys = {k.split("_max")[0].split("_mean")[0].split("_frac")[0]
            for k in optclip.stats(clean_state)}
    prefix = name.split()[0]
    assert {f"{prefix}/norm", f"{prefix}/clipped", f"{prefix}/nonfinite"} <= keys, keys

    if name in EAGER:  # the conformance suite checks jit == eager on every registry entry
        eager, _ = run_loop(tx, seq[:8])
        chex.assert_trees_all_close(eager, clean_outs[:8], rtol=1e-6, atol=1e-7)

    for bad in (math.nan, math.inf):
        poisoned = jax.tree.map(lambda x: x.at[0].set(bad), seq[7])
        outs, state = run_loop(tx, seq[:7] + [poisoned] + seq[7:], update)
        for got, want in zip(outs[8:], clean_outs[7:], strict=True):
            chex.assert_trees_all_equal(got, want)
        assert int(state.nonfinite) == 1
        chex.assert_trees_all_equal(
            {k: v for k, v in state._asdict().items() if k not in DIAGNOSTICS},
            {k: v for k, v in clean_state._asdict().items() if k not in DIAGNOSTICS})
        assert optclip.stats(state)

    # Checkpoint after 8 calls, restore into a fresh init, continue identically.
    _, state = run_loop(tx, seq[:8], update)
    restored = flax.serialization.from_bytes(tx.init(seq[0]),
                                             flax.serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored, state)
    for g in seq[8:]:
        o1, state = update(g, state)
        o2, restored = update(g, restored)
        chex.assert_trees_all_equal(o1, o2)


@pytest.mark.parametrize("make", DEFAULTS, ids=lambda f: f.__name__)
def test_default_instances_share_no_state(make):
    """Two instances built with defaults, used alternately, behave like separate ones (D1)."""
    rng = np.random.default_rng(11)
    ns = spiky_norms(rng, 30, [9, 13, 27])
    seq = jax.tree.map(jnp.asarray, grads_with_norms(rng, ns))
    big = jax.tree.map(lambda x: 10 * x, seq)
    # Four instances side by side in one scan, each call updating all of them: the first two
    # interleaved on G and 10 G, the last two on their own.
    outs, _ = multi_scanner((make,) * 4)((seq, big, seq, big))
    chex.assert_trees_all_equal(outs[0], outs[2])
    chex.assert_trees_all_equal(outs[1], outs[3])


def test_criterion_is_immutable():
    crit = optclip.zscore_criterion()
    with pytest.raises(dataclasses.FrozenInstanceError):
        crit.name = "x"


SPIKY_CASES = [
    # (transform, largest norm a spike may keep)
    ("zclip", lambda: optclip.zclip(max_grad_norm=None), 1.5),
    ("hist_clip feedback=clip_value", lambda: optclip.hist_clip(feedback="clip_value"), 1.5),
    # drytorch's raw-norm feedback inflates the variance after each spike (D2): every spike is
    # cut, but later ones less (the 9.0 one only to 8.75); the first is held near the mean.
    ("hist_clip", lambda: optclip.hist_clip(), None),
]


@functools.cache
def run_spiky():
    rng = np.random.default_rng(0)
    length, spikes = 120, [40, 55, 71, 90, 104]
    ns = 1.0 + 0.05 * rng.standard_normal(length)
    ns[spikes] = [8.0, 12.0, 6.0, 20.0, 9.0]
    grads = jax.tree.map(jnp.asarray, grads_with_norms(rng, ns))
    outs, states = scanner(tuple(make for _, make, _ in SPIKY_CASES))(grads)
    norm = lambda t: np.sqrt(np.asarray(t["w"] ** 2).sum((1, 2)) + np.asarray(t["b"] ** 2).sum(1))
    return spikes, norm(grads), [(norm(o), int(s.spikes[-1])) for o, s in zip(outs, states,
                                                                                strict=True)]


@pytest.mark.parametrize("case", range(len(SPIKY_CASES)), ids=[c[0] for c in SPIKY_CASES])
def test_spiky_sequence_cuts_spikes_leaves_ordinary_steps(case):
    """zclip and hist_clip cut spikes on a synthetic spiky norm sequence; other steps untouched."""
    spikes, in_norms, results = run_spiky()
    out_norms, detected = results[case]
    bound = SPIKY_CASES[case][2]
    ordinary = np.setdiff1d(np.arange(30, len(in_norms)), spikes)
    np.testing.assert_array_equal(out_norms[ordinary], in_norms[ordinary])
    assert detected == len(spikes)
    assert np.all(out_norms[spikes] < in_norms[spikes]), out_norms[spikes]
    assert out_norms[spikes[0]] < 1.5
    if bound is not None:
        assert np.all(out_norms[spikes] < bound), out_norms[spikes]


PROPERTY_CRITERIA = {
    "zscore/recip": lambda: optclip.hist_clip(zs(), optax.identity(), 4),
    "zscore/max": lambda: optclip.hist_clip(zs(clip_fn=mx), optax.identity(), 4),
    "zscore/mean": lambda: optclip.hist_clip(zs(clip_fn=mn), optax.identity(), 4),
    "ema/max": lambda: optclip.hist_clip(ema(), optax.identity(), 4),
    "ema/mean": lambda: optclip.hist_clip(ema(clip_fn=mn), optax.identity(), 4),
    "ema/recip": lambda: optclip.hist_clip(ema(clip_fn=rc), optax.identity(), 4),
    "zclip": lambda: optclip.zclip(max_grad_norm=None, warmup_steps=4),
}
norm_lists = st.lists(st.floats(0.05, 50.0), min_size=24, max_size=24)


WARMUP_CASES = [
    (lambda: optclip.hist_clip(warmup_transform=optax.identity(), warmup_steps=10),
     lambda n: n),
    (lambda: optclip.hist_clip(warmup_steps=10), lambda n: n * np.minimum(1, 1 / (n + 1e-6))),
    (lambda: optclip.param_hist_clip(warmup_transform=optax.identity(), warmup_steps=10),
     lambda n: n),
    (lambda: optclip.zclip(warmup_steps=10, max_grad_norm=None), lambda n: n),
    (lambda: optclip.zclip(warmup_steps=10, max_grad_norm=2.0),
     lambda n: n * np.minimum(1, 2 / (n + 1e-6))),
]
PROPERTY_MAKES = tuple(PROPERTY_CRITERIA.values()) + tuple(make for make, _ in WARMUP_CASES)


def trace(ns):
    """Input norms, and per transform of PROPERTY_MAKES the output norms and per-call states,
    on gradients of norms ``ns`` (one compiled scan for all of them)."""
    grads = {"w": jnp.asarray(np.asarray(ns, np.float32)[:, None] * np.array([0.6, 0.8],
                                                                           np.float32))}
    outs, states = scanner(PROPERTY_MAKES)(grads)
    norm = lambda x: np.sqrt(np.sum(np.asarray(x, np.float64) ** 2, axis=-1))
    return norm(grads["w"]), [(norm(o["w"]), s) for o, s in zip(outs, states, strict=True)]


@given(norm_lists)
def test_property_threshold_not_below_mean(ns):
    """A clipped call never goes below the running mean (every clip value is >= the mean;
    ema/recip: >= r**2 mean**2 / n), and nothing is ever scaled up."""
    pre, results = trace(ns)
    for kind, (out, states) in zip(PROPERTY_CRITERIA, results, strict=False):
        means = np.asarray(states.mean if kind == "zclip" else states.criterion.mean, np.float64)
        means = np.concatenate([[np.mean(pre[:4])], means[4:-1]])  # in force at calls 5..24
        floors = 1.05 ** 2 * means ** 2 / pre[4:] if kind == "ema/recip" else means
        assert np.all(out[4:] >= np.minimum(pre[4:], floors) * (1 - 1e-5) - 1e-6), kind
        assert np.all(out <= pre * (1 + 1e-6)), kind


@given(norm_lists)
def test_property_warmup_only_warmup_transform(ns):
    """During the warm-up nothing but the warm-up transform acts."""
    pre, results = trace(ns)
    for (_, warm), (out, _) in zip(WARMUP_CASES, results[len(PROPERTY_CRITERIA):], strict=True):
        np.testing.assert_allclose(out[:10], warm(pre[:10]), rtol=1e-5)


def test_float16_norm_accumulates_wide():
    """D9/Z7: a float16 gradient [300, 0] has norm 300, not inf; statistics stay float32."""
    g = {"w": jnp.array([300.0, 0.0], jnp.float16), "v": jnp.array([0.0], jnp.float32)}
    txs = (optclip.hist_clip(), optclip.zclip(), optclip.param_hist_clip(),
           optclip.quantile_clip(global_threshold=True))
    outs, states = jax.jit(lambda g: tuple(zip(*(tx.update(g, tx.init(g)) for tx in txs),
                                               strict=True)))(g)
    for out, state in zip(outs, states, strict=True):
        norm = optclip.per_leaf(state.norm, g)["w"] if state.norm.ndim else state.norm
        assert norm.dtype == jnp.float32
        assert float(norm) == 300.0
        assert out["w"].dtype == jnp.float16
        assert np.isfinite(np.asarray(out["w"], np.float32)).all()


BAD_ARGS = [
    (optclip.ema_criterion, {"alpha": 1.5}, "alpha"),
    (optclip.ema_criterion, {"r_thresh": 0.0}, "r_thresh"),
    (optclip.ema_criterion, {"clip_fn": 3}, "clip_fn"),
    (optclip.ema_criterion, {"parity": "torch"}, "parity"),
    (optclip.zscore_criterion, {"z_thresh": -1.0}, "z_thresh"),
    (optclip.hist_clip, {"warmup_steps": 0}, "warmup_steps"),
    (optclip.hist_clip, {"warmup_steps": 2.5}, "warmup_steps"),
    (optclip.hist_clip, {"criterion": "zscore"}, "criterion"),
    (optclip.hist_clip, {"warmup_transform": lambda g: g}, "warmup_transform"),
    (optclip.hist_clip, {"feedback": "clipped"}, "feedback"),
    (optclip.param_hist_clip, {"warmup_steps": -1, "parity": "reference"}, "warmup_steps"),
    (optclip.zclip, {"warmup_steps": 1}, "warmup_steps"),
    (optclip.zclip, {"mode": "quantile"}, "mode"),
    (optclip.zclip, {"clip_option": "median"}, "clip_option"),
    (optclip.zclip, {"max_grad_norm": 0.0}, "max_grad_norm"),
    (optclip.zclip, {"clip_factor": -1.0}, "clip_factor"),
    (optclip.zclip, {"eps": -1.0}, "eps"),
    (optclip.zclip, {"skip_update_on_spike": 1}, "skip_update_on_spike"),
    (optclip.quantile_clip, {"quantile": 1.5}, "quantile"),
    (optclip.quantile_clip, {"history_length": 0}, "history_length"),
    (optclip.standard_clip, {"deviations": -1.0}, "deviations"),
    (optclip.standard_clip, {"history_length": 2.0}, "history_length"),
]


@pytest.mark.parametrize("make,kwargs,name", BAD_ARGS,
                         ids=[f"{m.__name__}-{n}" for m, _, n in BAD_ARGS])
def test_bad_arguments(make, kwargs, name):
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        make(**kwargs)


def test_clip_functions():
    z = jnp.array([1.0, 4.0, 10.0])
    np.testing.assert_array_equal(optclip.max_clipping(z, 2.5), [2.5, 2.5, 2.5])
    np.testing.assert_array_equal(optclip.mean_clipping(z, 2.5), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(optclip.reciprocal_clipping(z, 2.5), [6.25, 1.5625, 0.625])


def test_ema_mean_clipping_fixed_clips_to_mean():
    """D5 fixed: ema_criterion + mean_clipping clips to the mean instead of zeroing."""
    crit = ema(clip_fn=mn)
    state = crit.set_statistics(crit.init(jnp.float32), jnp.float32(2.0), 1.0)
    assert float(crit.clip_value(state, 5.0)) == 2.0
    ref = ema(clip_fn=mn, parity="reference")
    assert float(ref.clip_value(state, 5.0)) == 0.0


@pytest.mark.parametrize("make", [optclip.hist_clip, optclip.param_hist_clip],
                         ids=lambda f: f.__name__)
def test_stateful_warmup_transform_advances_only_during_warmup(make):
    """The warm-up transform's state lives inside ours; its outputs during the warm-up equal
    the transform run on its own (per leaf for param_hist_clip), and it stops afterwards."""
    inner = optax.scale_by_adam()
    tx = make(optclip.zscore_criterion(), inner, 3)
    seq = family_seq(np.random.default_rng(2))[:6]
    outs, state = run_loop(tx, seq, jax.jit(tx.update))
    if make is optclip.param_hist_clip:
        alone = {k: run_loop(inner, [g[k] for g in seq[:3]])[0] for k in ("w", "b")}
        alone = [{k: alone[k][t] for k in alone} for t in range(3)]
        counts = [int(s.count) for s in state.warmup_state]
    else:
        alone = run_loop(inner, seq[:3])[0]
        counts = [int(state.warmup_state.count)]
    chex.assert_trees_all_close(outs[:3], alone, rtol=1e-6)
    assert counts == [3] * len(counts)


@pytest.mark.parametrize("cap", [None, 1.3])
def test_zclip_logs_its_threshold_and_counts_every_call(cap):
    """``threshold`` is the norm above which a call clips (not the norm of a quiet call), capped
    at ``max_grad_norm``; on a spike it is the norm clipped to. ``count`` keeps counting after
    the warm-up; a non-finite call is not counted."""
    tx = optclip.zclip(max_grad_norm=cap, warmup_steps=3)
    update = jax.jit(tx.update)
    state = tx.init({"w": jnp.zeros(1)})
    logged = []
    for n in [1.0, 1.2, 0.8, 1.0, 1.1, np.nan, 9.0]:
        _, state = update({"w": jnp.array([n], jnp.float32)}, state)
        logged.append({k: float(v) for k, v in optclip.stats(state).items()})
    assert [s["zclip/count"] for s in logged] == [1, 2, 3, 4, 5, 5, 6]
    # Warm-up ends with mean 1 and population variance 0.08/3; call 4 (norm 1) leaves the mean.
    alpha, var = 0.97, 0.08 / 3
    want = [1.0 + 2.5 * (math.sqrt(var) + 1e-6)]
    var = alpha * var
    want.append(1.0 + 2.5 * (math.sqrt(var) + 1e-6))  # call 5
    limit = [w if cap is None else min(w, cap) for w in want]
    np.testing.assert_allclose([logged[3]["zclip/threshold"], logged[4]["zclip/threshold"]],
                               limit, rtol=1e-5)
    assert not logged[3]["zclip/clipped"] and not logged[4]["zclip/clipped"]
    assert logged[5]["zclip/threshold"] == logged[4]["zclip/threshold"]  # NaN call: unchanged
    assert logged[6]["zclip/clipped"] and logged[6]["zclip/spikes"] == 1
    np.testing.assert_allclose(logged[6]["zclip/threshold"], 9.0 * logged[6]["zclip/scale"],
                               rtol=1e-5)
    first = [s["zclip/threshold"] for s in logged[:3]]
    np.testing.assert_allclose(first, [1.0, 1.2, 0.8] if cap is None else [cap] * 3,
                               rtol=1e-6)  # the warm-up: no limit, or the cap


@pytest.mark.parametrize("make", [
    lambda t: optclip.zscore_criterion(z_thresh=t), lambda t: optclip.ema_criterion(r_thresh=t),
], ids=["zscore", "ema"])
def test_criterion_thresholds_take_schedules(make):
    """A constant schedule gives what the float gives; the clock is the criterion's ``step``
    (updates since the warm-up), so a schedule that rises after two updates stops clipping."""
    norms = [1.0, 1.2, 0.9, 1.1, 6.0, 1.0, 7.0]
    grads = [{"w": jnp.array([0.6, 0.8]) * n} for n in norms]

    def run(threshold):
        tx = optclip.hist_clip(make(threshold), warmup_steps=3)
        state = tx.init({"w": jnp.zeros(2)})
        update, outs = jax.jit(tx.update), []
        for g in grads:
            out, state = update(g, state)
            outs.append(float(optax.tree.norm(out)))
        return outs, state

    fixed, state = run(2.5)
    scheduled, _ = run(optax.constant_schedule(2.5))
    np.testing.assert_allclose(scheduled, fixed, rtol=1e-6)
    assert fixed[4] < 6.0 and fixed[6] < 7.0            # both spikes clipped at 2.5
    assert int(state.criterion.step) == len(norms) - 3   # the clock: updates after the warm-up
    late, _ = run(lambda step: jnp.where(step < 2, 2.5, 1e6))
    np.testing.assert_allclose(late[:5], fixed[:5], rtol=1e-6)
    np.testing.assert_allclose(late[6], 7.0, rtol=1e-6)  # the raised threshold: not clipped
