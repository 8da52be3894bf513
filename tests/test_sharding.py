"""Sharding: shard_map/pmap with ``axis_name``, explicit and automatic meshes, state shardings,
scan carries, collectives in the compiled HLO, and a two-process run."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import optclip
from optclip._core import slices as slices_lib

P = PartitionSpec


def _norm(tree) -> float:
    """Global L2 norm on the host (the arrays may carry shardings of different meshes)."""
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                             for x in jax.tree.leaves(tree))))


def _mesh(shape, names, axis_type):
    kind = jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def test_pmap_combines_every_leaf_across_the_named_axis():
    """pmap does not track replication: every leaf counts as split, as documented."""
    tx = optclip.clip_by_global_norm(1.0, axis_name="i")

    def step(g):
        out, state = tx.update(g, tx.init(g))
        return out, state.norm

    out, norm = jax.pmap(step, axis_name="i")({"w": jnp.ones((8, 4))})
    np.testing.assert_allclose(np.asarray(norm), np.sqrt(32.0), rtol=1e-6)
    np.testing.assert_allclose(_norm(out), 1.0, rtol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_replicated_leaf_counted_once_only_where_jax_tracks_it(check_vma):
    """With ``check_vma`` a replicated leaf is counted once; without it every leaf is split."""
    tx = optclip.clip_by_global_norm(1.0, axis_name="x")
    mesh = _mesh((8,), ("x",), "auto")

    def norm(g):
        return tx.update(g, tx.init(g))[1].norm

    mapped = jax.shard_map(norm, mesh=mesh, in_specs=({"w": P("x"), "b": P()},),
                           out_specs=P(), check_vma=check_vma)
    got = float(jax.jit(mapped)({"w": jnp.ones((8, 4)), "b": jnp.ones(4)}))
    expected = np.sqrt(32.0 + 4.0) if check_vma else np.sqrt(32.0 + 8 * 4.0)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_two_dimensional_mesh_axis_name_tuple():
    mesh = _mesh((2, 4), ("data", "model"), "auto")
    tx = optclip.clip_by_global_norm(1.0, axis_name=("data", "model"))

    def step(g):
        out, state = tx.update(g, tx.init(g))
        return out, state.norm

    g = {"w": jnp.ones((8, 4)), "v": jnp.ones((4, 8))}
    specs = {"w": P("data", "model"), "v": P(None, "model")}
    out, norm = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs,),
                                      out_specs=(specs, P())))(g)
    np.testing.assert_allclose(float(norm), np.sqrt(64.0), rtol=1e-6)
    np.testing.assert_allclose(_norm(out), 1.0, rtol=1e-6)


def test_bad_axis_name_rejected_at_construction():
    with pytest.raises(TypeError, match="axis_name"):
        optclip.clip_by_global_norm(1.0, axis_name=3)
    with pytest.raises(TypeError, match="axis_name"):
        optclip.zclip(axis_name=("x", None))


# ---------------------------------------------------------------------------------------------
# Under jit on sharded arrays (GSPMD): scan carries and the collectives XLA emits.

def _tree(seed):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}


SPECS_2D = {"w": P("d", "m"), "b": P("m")}


def _place(tree, mesh, specs):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


@pytest.mark.parametrize("make", [
    lambda: optclip.clip_norm(1.0, dim=1),
    lambda: optclip.top_q(0.5),
    lambda: optclip.clip_norm_by_ema(beta=0.5),
    lambda: optclip.zclip(warmup_steps=2),
], ids=["clip_norm_dim1", "top_q", "clip_norm_by_ema", "zclip"])
def test_lax_scan_carries_the_state_on_an_explicit_2d_mesh(make):
    tx = make()
    mesh = _mesh((2, 4), ("d", "m"), "explicit")
    steps = [_tree(s) for s in range(3)]
    expected_state = tx.init(steps[0])
    expected = []
    for g in steps:
        out, expected_state = tx.update(g, expected_state)
        expected.append(out)
    with jax.set_mesh(mesh):
        stacked = _place(jax.tree.map(lambda *xs: jnp.stack(xs), *steps), mesh,
                         jax.tree.map(lambda s: P(None, *s), SPECS_2D))
        state = jax.jit(tx.init)(_place(steps[0], mesh, SPECS_2D))

        @jax.jit
        def run(state, grads):
            return jax.lax.scan(lambda s, g: tx.update(g, s)[::-1], state, grads)

        state, outs = run(state, stacked)
    for i, out in enumerate(expected):
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], outs), out, rtol=1e-5,
                                    atol=1e-6)
    chex.assert_trees_all_close(state, expected_state, rtol=1e-5, atol=1e-6)


def _collectives(hlo: str) -> dict[str, list[str]]:
    """Result shapes of every cross-device collective in an optimized HLO module."""
    found: dict[str, list[str]] = {}
    for line in hlo.splitlines():
        for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute",
                   "reduce-scatter"):
            if f" {op}(" in line or f" {op}-start(" in line:
                found.setdefault(op, []).append(line.split("=", 1)[1].split(op)[0].strip())
    return found


@pytest.mark.parametrize("make", [
    lambda: optclip.clip_by_global_norm(1.0),
    lambda: optclip.normalize(dim="global"),
    lambda: optclip.clip_norm(1.0),
    lambda: optclip.zclip(),
    lambda: optclip.hist_clip(),
    lambda: optclip.quantile_clip(global_threshold=True, history_length=8),
    lambda: optclip.clip_norm_by_ema(tensorwise=False),
    lambda: optclip.clip_norm_growth(parameterwise=False),
], ids=["clip_by_global_norm", "normalize_global", "clip_norm", "zclip", "hist_clip",
        "quantile_clip", "clip_norm_by_ema", "clip_norm_growth"])
def test_global_clippers_exchange_only_scalars(make):
    """FSDP and TP on a 2-D mesh under jit: only scalar all-reduces, nothing gathered."""
    tx = make()
    mesh = _mesh((2, 4), ("d", "m"), "auto")
    with jax.set_mesh(mesh):
        g = _place(_tree(0), mesh, SPECS_2D)
        state = jax.jit(tx.init)(g)
        hlo = jax.jit(tx.update).lower(g, state).compile().as_text()
    found = _collectives(hlo)
    assert set(found) <= {"all-reduce"}, found
    assert found.get("all-reduce"), "the global statistic must be combined across devices"
    for shape in found["all-reduce"]:
        assert all(part.strip().endswith("[]") or "[]" in part for part in shape.split(",")), (
            shape)


def test_ranking_a_row_sharded_leaf_gathers_nothing(monkeypatch):
    """top_q on a leaf whose rows jit splits over the 8 CPU devices: ranked as one search per
    leaf, so each device ranks its own rows and only scalars are exchanged. With the loop over
    blocks of rows that one CPU device uses (forced here) the leaf would be gathered."""
    monkeypatch.setattr(slices_lib, "RANK_BLOCK_ENTRIES", 64)   # blocks of 8 rows of 8
    mesh = _mesh((8,), ("d",), "auto")
    g = jnp.asarray(np.random.default_rng(0).normal(size=(128, 8)), jnp.float32)
    tx = optclip.top_q(0.5)
    expected = tx.update(g, tx.init(g))[0]
    with jax.set_mesh(mesh):
        placed = jax.device_put(g, NamedSharding(mesh, P("d")))
        state = jax.jit(tx.init)(placed)
        step = jax.jit(tx.update)
        found = _collectives(step.lower(placed, state).compile().as_text())
        out = step(placed, state)[0]
        monkeypatch.setattr(slices_lib, "single_cpu_device", lambda: True)
        fresh = jax.jit(lambda g, s: tx.update(g, s))   # traced anew
        blocked = _collectives(fresh.lower(placed, state).compile().as_text())
    assert "all-gather" not in found and set(found) <= {"all-reduce"}, found
    assert "all-gather" in blocked, blocked
    np.testing.assert_array_equal(out, expected)


# ---------------------------------------------------------------------------------------------
# Two processes x 4 CPU devices (jax.distributed on localhost, gloo collectives).

def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_the_single_process_run(tmp_path):
    import os
    import pathlib
    import subprocess
    import sys

    from tests import distributed_worker as worker

    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        pytest.skip("this jax has no CPU cross-process collectives (gloo)")
    out = tmp_path / "results.npz"
    port = str(_free_port())
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(root / "tests" / "distributed_worker.py"),
                               port, str(i), str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any("gloo" in log.lower() and "not" in log.lower() and proc.returncode
           for log, proc in zip(logs, procs)):
        pytest.skip(f"no gloo cross-process collectives on this platform: {logs[0][-500:]}")
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    mesh = _mesh((8,), ("x",), "auto")
    expected = worker.run(mesh, lambda tree: jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, worker.SPECS))
    got = dict(np.load(out))
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], np.asarray(value), rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_axis_name_outside_shard_map_changes_nothing():
    """Unbound axis names (global arrays, e.g. init before shard_map): nothing to combine."""
    g = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}
    for make in (lambda a: optclip.clip_by_global_norm(1.0, axis_name=a),
                 lambda a: optclip.clip_norm_by_ema(beta=0.5, axis_name=a)):
        with_axis, without = make("x"), make(None)
        got = jax.jit(with_axis.update)(g, with_axis.init(g))
        expected = without.update(g, without.init(g))
        chex.assert_trees_all_close(got, expected, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Ranking inside shard_map: the whole slice's top k, without gathering the slice.

RANKERS = {
    "top_q": lambda a, q, dq: optclip.top_q(q, dq=dq, param_ndim=None, axis_name=a),
    "l1q_normalize": lambda a, q, dq: optclip.l1q_normalize(q, dq=dq, param_ndim=None,
                                                            axis_name=a),
    "l1q_frank_wolfe": lambda a, q, dq: optclip.l1q_frank_wolfe(q, 1.5, dq=dq, param_ndim=None,
                                                                axis_name=a),
    "l1_frank_wolfe": lambda a, q, dq: optclip.l1_frank_wolfe(1.5, param_ndim=None,
                                                              axis_name=a),
}


def _ties(seed):
    """(16, 4) magnitudes from {0, 1, 2, 3} with random signs: ties everywhere, NaN-free."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 4, size=(16, 4)) * rng.choice([-1, 1], size=(16, 4)),
                       jnp.float32)


def _ranked_in_shard_map(tx, mesh, spec, params, grads):
    def body(params, *steps):
        state, outs = tx.init(params), []
        for g in steps:
            out, state = tx.update(g, state, params)
            outs.append(out)
        return outs, optclip.stats(state)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (1 + len(grads)),
                           out_specs=([spec] * len(grads), P()))
    return jax.jit(mapped)(params, *grads)


@pytest.mark.parametrize("name", sorted(RANKERS))
@pytest.mark.parametrize("q, dq, grads", [
    (0.5, 0.0, "ones"), (0.3, 0.0, "ties"), (0.6, 0.3, "ties")],
    ids=["ones-half", "ties-static-k", "ties-random-k"])
def test_shard_map_keeps_the_same_entries_as_the_unsharded_run(name, q, dq, grads):
    """A (16, 4) leaf whose one slice is split 8 ways along its leading axis (over a tuple of
    mesh axes): the same kept entries (ties included), outputs and logged ``q``/``k`` as
    without sharding, for a static ``k`` and a drawn one."""
    steps = ([jnp.ones((16, 4))] * 2 if grads == "ones" else [_ties(s) for s in range(2)])
    params = jnp.full((16, 4), 0.5)
    mesh = _mesh((2, 4), ("d", "m"), "auto")
    outs, logged = _ranked_in_shard_map(RANKERS[name](("d", "m"), q, dq), mesh, P(("d", "m")),
                                        params, steps)
    plain = RANKERS[name](None, q, dq)
    state = plain.init(params)
    for g, out in zip(steps, outs):
        expected, state = plain.update(g, state, params)
        np.testing.assert_array_equal(np.asarray(out) != 0, np.asarray(expected) != 0)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6)
    chex.assert_trees_all_close(logged, optclip.stats(state), rtol=1e-6)


def test_shard_map_ranking_exchanges_counts_not_the_slice():
    """top_q inside shard_map: the collectives carry per-slice counts (at most one number per
    device), never the gradient."""
    tx = optclip.top_q(0.5, param_ndim=None, axis_name="x")
    mapped = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=_mesh((8,), ("x",), "auto"),
                           in_specs=(P("x"),), out_specs=P("x"))
    hlo = jax.jit(mapped).lower(jnp.ones((64, 32))).compile().as_text()
    found = _collectives(hlo)
    assert found.get("all-reduce"), found
    for op, shapes in found.items():
        for shape in shapes:
            elements = [int(n) for n in shape.split("[")[-1].split("]")[0].split(",") if n]
            assert np.prod(elements) <= 8, (op, shape)


@pytest.mark.parametrize("make", [
    lambda: optclip.top_q(0.5, param_ndim=None),
    lambda: optclip.l1q_normalize(0.5, param_ndim=None),
    lambda: optclip.l1q_frank_wolfe(0.5, 1.0, param_ndim=None),
], ids=["top_q", "l1q_normalize", "l1q_frank_wolfe"])
def test_explicit_mesh_ranks_a_sharded_vector_as_one_slice(make):
    """``param_ndim=None`` on a 1-D leaf sharded over an explicit mesh: its one slice is split
    across devices (JAX refuses to sort a sharded axis); same numbers as unsharded."""
    tx = make()
    g = {"v": jnp.asarray(np.random.default_rng(0).normal(size=16), jnp.float32)}
    params = {"v": jnp.ones(16)}
    expected = tx.update(g, tx.init(params), params)
    mesh = _mesh((8,), ("x",), "explicit")
    with jax.set_mesh(mesh):
        spec = {"v": P("x")}
        sharded_g, sharded_params = _place(g, mesh, spec), _place(params, mesh, spec)
        out, state = jax.jit(tx.update)(sharded_g, jax.jit(tx.init)(sharded_params),
                                        sharded_params)
    chex.assert_trees_all_close((out, state), expected, rtol=1e-6)
    assert out["v"].sharding.is_equivalent_to(sharded_g["v"].sharding, 1)


def test_pmap_ranks_the_slice_spread_over_the_devices():
    """Under pmap every leaf counts as split: the eight (2, 4) blocks form one slice, ranked as
    the (16, 4) matrix they stack into (ties in device order)."""
    tx = optclip.top_q(0.7, param_ndim=None, axis_name="i")
    g = _ties(3)
    out = jax.pmap(lambda b: tx.update(b, tx.init(b))[0], axis_name="i")(g.reshape(8, 2, 4))
    plain = optclip.top_q(0.7, param_ndim=None)
    np.testing.assert_array_equal(np.asarray(out).reshape(16, 4),
                                  np.asarray(plain.update(g, plain.init(g))[0]))


def test_pmap_l1q_counts_the_non_zero_entries_of_the_whole_slice():
    """l1q's divisor under pmap: the non-zero entries kept in the whole (16, 4) slice spread over
    the devices, counted across them; slices with fewer non-zero entries than k, a NaN, and
    infinities give the unsharded outputs."""
    g = np.random.default_rng(4).normal(size=(3, 16, 4)).astype(np.float32)
    g[0][np.random.default_rng(5).random((16, 4)) < 0.8] = 0.0
    g[1, 3, 1] = np.nan
    g[2, 5, 2], g[2, 9, 0] = np.inf, -np.inf
    for q, x in itertools.product((0.3, 0.95), g):
        tx = optclip.l1q_normalize(q, param_ndim=None, axis_name="i")
        out = jax.pmap(lambda b: tx.update(b, tx.init(b))[0], axis_name="i")(x.reshape(8, 2, 4))
        plain = optclip.l1q_normalize(q, param_ndim=None)
        np.testing.assert_array_equal(np.asarray(out).reshape(16, 4),
                                      np.asarray(plain.update(x, plain.init(x))[0]))


SLICE_TRANSFORMS = {
    "top_q": lambda a: optclip.top_q(0.5, param_ndim=None, axis_name=a),
    "l1q_normalize": lambda a: optclip.l1q_normalize(0.3, param_ndim=None, axis_name=a),
    "clamp": lambda a: optclip.clamp(-0.5, 0.5, axis_name=a),
    "project_l2_ball": lambda a: optclip.project_l2_ball(1.0, param_ndim=None, axis_name=a),
    "project_linf_ball": lambda a: optclip.project_linf_ball(1.5, axis_name=a),
    "clamp_params": lambda a: optclip.clamp_params(clamp_max=1.5, axis_name=a),
    "frank_wolfe": lambda a: optclip.frank_wolfe(0.5, axis_name=a),
    "l1_frank_wolfe": lambda a: optclip.l1_frank_wolfe(2.0, param_ndim=None, axis_name=a),
    "l2_frank_wolfe": lambda a: optclip.l2_frank_wolfe(2.0, param_ndim=None, axis_name=a),
    "linf_frank_wolfe": lambda a: optclip.linf_frank_wolfe(1.0, axis_name=a),
    "l1q_frank_wolfe": lambda a: optclip.l1q_frank_wolfe(0.5, 1.5, param_ndim=None,
                                                         axis_name=a),
}


@pytest.mark.parametrize("name", sorted(SLICE_TRANSFORMS))
def test_shard_map_ones_give_the_unsharded_output_and_state(name):
    """ones(8, 4) split 8 ways (and a replicated ones(4)): the same outputs and logged state as
    the unsharded run; the state is declared replicated, so JAX checks that it is the same on
    every device."""
    specs = {"w": P("x"), "b": P()}
    ones = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    outs, logged = _ranked_in_shard_map(SLICE_TRANSFORMS[name]("x"), _mesh((8,), ("x",), "auto"),
                                        specs, ones, [ones, ones])
    plain = SLICE_TRANSFORMS[name](None)
    state = plain.init(ones)
    for out in outs:
        expected, state = plain.update(ones, state, ones)
        chex.assert_trees_all_close(out, expected, rtol=1e-6)
    assert logged.keys() == optclip.stats(state).keys()
    chex.assert_trees_all_close(logged, optclip.stats(state), rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda a: optclip.l2_normalize(axis_name=a),
    lambda a: optclip.top_q(0.3, axis_name=a),
    lambda a: optclip.project_l2_ball(0.5, axis_name=a),
    lambda a: optclip.l1q_frank_wolfe(0.3, 1.0, axis_name=a),
], ids=["l2_normalize", "top_q", "project_l2_ball", "l1q_frank_wolfe"])
def test_one_element_slices_of_a_split_vector_are_not_combined(make):
    """``param_ndim=-1`` on a vector split over the named axis: every element is its own slice,
    so nothing is combined across devices (its slices have no reduced axes to split). Per-slice
    diagnostics then differ between devices, like the slices: only the outputs come back."""
    v = {"v": jnp.asarray(np.random.default_rng(1).normal(size=16), jnp.float32)}
    params = {"v": jnp.full(16, 0.25)}
    tx = make("x")
    mapped = jax.shard_map(lambda g, p: tx.update(g, tx.init(p), p)[0],
                           mesh=_mesh((8,), ("x",), "auto"), in_specs=({"v": P("x")},) * 2,
                           out_specs={"v": P("x")})
    plain = make(None)
    chex.assert_trees_all_close(jax.jit(mapped)(v, params),
                                plain.update(v, plain.init(params), params)[0], rtol=1e-6)
