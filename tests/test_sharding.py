"""Sharding: shard_map/pmap with ``axis_name``, explicit and automatic meshes, state shardings,
scan carries, collectives in the compiled HLO, and a two-process run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import optclip

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
