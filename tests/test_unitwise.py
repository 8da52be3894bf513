"""Unit-wise AGC, Flax unit axes and per-leaf ``dim``."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import optclip


def _tree(seed=0):
    """Flax layouts: Dense (in, out), Conv (H, W, in, out), a bias; gradients large enough that
    some units clip and others do not."""
    rng = np.random.default_rng(seed)
    return {"dense": {"kernel": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                      "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32)},
            "conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 2, 4)), jnp.float32)}}


def _grads(seed=1):
    rng = np.random.default_rng(seed)
    scales = {"dense": 0.3, "conv": 0.05}
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape) * scales[path[0].key]
                                    * rng.uniform(0.1, 3.0, size=x.shape[-1:]), jnp.float32),
        _tree())


def _agc_by_hand(g, w, clipping, eps, axes):
    g_norm = np.sqrt(np.sum(np.square(np.asarray(g, np.float64)), axis=axes, keepdims=True))
    w_norm = np.sqrt(np.sum(np.square(np.asarray(w, np.float64)), axis=axes, keepdims=True))
    allowed = clipping * np.maximum(w_norm, eps)
    return np.where(g_norm > allowed, g * allowed / g_norm, g)


@pytest.mark.parametrize("clipping", [0.01, 0.05, 0.3])
def test_matches_optax_on_dense_conv_and_bias(clipping):
    params, grads = _tree(), _grads()
    tx = optclip.adaptive_grad_clip(clipping)
    ours, state = tx.update(grads, tx.init(params), params)
    ref = optax.adaptive_grad_clip(clipping)
    theirs, _ = ref.update(grads, ref.init(params), params)
    chex.assert_trees_all_close(ours, theirs, rtol=1e-5, atol=1e-7)
    logged = optclip.stats(state)
    assert 0 < float(logged["adaptive_grad_clip/clipped_mean"]) < 1, logged


def test_matches_the_formula_per_unit():
    params, grads = _tree(), _grads()
    tx = optclip.adaptive_grad_clip(0.05)
    out, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(out["dense"]["kernel"], _agc_by_hand(
        grads["dense"]["kernel"], params["dense"]["kernel"], 0.05, 1e-3, (0,)), rtol=1e-5)
    np.testing.assert_allclose(out["conv"]["kernel"], _agc_by_hand(
        grads["conv"]["kernel"], params["conv"]["kernel"], 0.05, 1e-3, (0, 1, 2)), rtol=1e-5)
    np.testing.assert_allclose(out["dense"]["bias"], _agc_by_hand(
        grads["dense"]["bias"], params["dense"]["bias"], 0.05, 1e-3, (0,)), rtol=1e-5)


def test_scanned_stack_is_clipped_per_layer_not_across_layers():
    """(L, in, out): each layer's units on their own (optax reduces over the layer axis)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 8, 4)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(3, 8, 4)), jnp.float32) * jnp.asarray([0.01, 1.0, 10.0])[
        :, None, None]
    tx = optclip.adaptive_grad_clip(0.1, dim=optclip.flax_unit_axes(stacked=1))
    out, _ = tx.update({"layers": g}, tx.init({"layers": w}), {"layers": w})
    for layer in range(3):
        np.testing.assert_allclose(out["layers"][layer], _agc_by_hand(
            g[layer], w[layer], 0.1, 1e-3, (0,)), rtol=1e-5)


def test_explicit_fsdp_mesh():
    """optax's raises ShardingTypeError here; optclip's gives the unsharded numbers."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    params, grads = _tree(), _grads()
    specs = {"dense": {"kernel": PartitionSpec("x"), "bias": PartitionSpec()},
             "conv": {"kernel": PartitionSpec()}}
    tx = optclip.adaptive_grad_clip(0.05)
    expected, _ = tx.update(grads, tx.init(params), params)
    with jax.set_mesh(mesh):
        place = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                                       t, specs)
        sharded_params, sharded_grads = place(params), place(grads)
        state = jax.jit(tx.init)(sharded_params)
        out, _ = jax.jit(tx.update)(sharded_grads, state, sharded_params)
    chex.assert_trees_all_close(out, expected, rtol=1e-5, atol=1e-7)
    assert out["dense"]["kernel"].sharding.is_equivalent_to(
        sharded_grads["dense"]["kernel"].sharding, 2)


def test_final_layer_excluded_with_a_mask():
    params = {**_tree(), "head": {"kernel": jnp.ones((4, 2))}}
    grads = {**_grads(), "head": {"kernel": jnp.full((4, 2), 100.0)}}
    tx = optax.masked(optclip.adaptive_grad_clip(0.01), lambda p: jax.tree_util.tree_map_with_path(
        lambda path, _: "head" not in jax.tree_util.keystr(path), p))
    out, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_array_equal(out["head"]["kernel"], grads["head"]["kernel"])
    assert float(jnp.max(jnp.abs(out["dense"]["kernel"] - grads["dense"]["kernel"]))) > 0


# ---------------------------------------------------------------------------------------------
# Flax layouts and per-leaf dim.

def test_flax_unit_axes_on_linen_and_nnx_models():
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Embed(10, 4)(x)
            x = nn.Conv(3, (2, 2))(x[:, :, None, :])
            return nn.Dense(2)(x)

    linen_params = Linen().init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"]

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 4, rngs=rngs)
            self.conv = nnx.Conv(4, 3, (2, 2), rngs=rngs)
            self.dense = nnx.Linear(3, 2, rngs=rngs)

    nnx_params = nnx.state(Nnx(nnx.Rngs(0)), nnx.Param)
    unit_axes = optclip.flax_unit_axes()
    for params in (linen_params, nnx_params):
        axes = {jax.tree_util.keystr(p): unit_axes(p, x)
                for p, x in jax.tree_util.tree_leaves_with_path(params)}
        by_name = {}
        for key, value in axes.items():
            for name in ("embedding", "Conv_0']['kernel", "conv']['kernel", "Dense_0']['kernel",
                         "dense']['kernel", "bias"):
                if name in key:
                    by_name.setdefault(name.split("'")[0] or name, set()).add(value)
        assert by_name["embedding"] == {(1,)}, axes
        assert by_name.get("Conv_0", by_name.get("conv")) == {(0, 1, 2)}, axes
        assert by_name.get("Dense_0", by_name.get("dense")) == {(0,)}, axes
        assert by_name["bias"] == {(0,)}, axes


def test_centralize_with_flax_unit_axes_centres_each_output_unit():
    params = {"Dense_0": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": jnp.arange(4.0)}}
    tx = optclip.centralize(dim=optclip.flax_unit_axes())
    out, _ = tx.update(params, tx.init(params))
    np.testing.assert_allclose(out["Dense_0"]["kernel"].mean(axis=0), 0, atol=1e-6)
    assert float(jnp.abs(out["Dense_0"]["kernel"].mean(axis=1)).max()) > 1  # rows untouched
    np.testing.assert_allclose(out["Dense_0"]["bias"], params["Dense_0"]["bias"] - 1.5)
    tx = optclip.centralize(dim=optclip.flax_unit_axes(vectors=False))
    out, _ = tx.update(params, tx.init(params))
    np.testing.assert_allclose(out["Dense_0"]["kernel"].mean(axis=0), 0, atol=1e-6)
    np.testing.assert_array_equal(out["Dense_0"]["bias"], params["Dense_0"]["bias"])


@pytest.mark.parametrize("dim", [
    {"a": 0, "b": (0, 1)},
    {"a": 0, "b": {"k": None, "v": 1}},
    lambda path, x: 0 if jax.tree_util.keystr(path) == "['a']" else (
        None if "k" in jax.tree_util.keystr(path) else 1),
], ids=["tree", "nested", "callable"])
def test_clip_norm_with_per_leaf_dim(dim):
    rng = np.random.default_rng(0)
    g = {"a": jnp.asarray(rng.normal(size=(4, 3)) * 5, jnp.float32),
         "b": {"k": jnp.asarray(rng.normal(size=(2, 3)) * 5, jnp.float32),
               "v": jnp.asarray(rng.normal(size=(2, 3)) * 5, jnp.float32)}}
    tx = optclip.clip_norm(1.0, dim=dim)
    out, _ = tx.update(g, tx.init(g))
    resolved = {"a": 0, "k": (0, 1), "v": (0, 1)} if isinstance(dim, dict) and not isinstance(
        dim["b"], dict) else {"a": 0, "k": (0, 1), "v": 1}
    leaves = {"a": (out["a"], g["a"]), "k": (out["b"]["k"], g["b"]["k"]),
              "v": (out["b"]["v"], g["b"]["v"])}
    for name, (o, x) in leaves.items():
        norm = np.sqrt(np.sum(np.square(np.asarray(x)), axis=resolved[name], keepdims=True))
        np.testing.assert_allclose(o, x * np.minimum(1, 1 / norm), rtol=1e-5, err_msg=name)


def test_per_leaf_dim_that_does_not_match_the_tree_is_a_clear_error():
    tx = optclip.clip_norm(1.0, dim={"nope": 0})
    with pytest.raises(ValueError, match="per-leaf dim"):
        tx.init({"a": jnp.ones(3)})


@pytest.mark.parametrize("make", [
    lambda pn: optclip.l2_normalize(param_ndim=pn),
    lambda pn: optclip.top_q(0.5, param_ndim=pn),
], ids=["l2_normalize", "top_q"])
def test_lp_space_with_per_leaf_param_ndim(make):
    """Each leaf with its own ``param_ndim`` equals that leaf run on its own."""
    rng = np.random.default_rng(0)
    g = {"conv": jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32),
         "dense": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}
    per_leaf = {"conv": -1, "dense": None}
    for spec in (per_leaf, lambda path, x: per_leaf[path[0].key]):
        tx = make(spec)
        out, _ = tx.update(g, tx.init(g))
        for name, k in per_leaf.items():
            alone = make(k)
            np.testing.assert_allclose(out[name], alone.update(g[name], alone.init(g[name]))[0],
                                       rtol=1e-6, err_msg=name)
    # A per-leaf param_ndim beyond the leaf's rank makes the leaf one slice, as a single one.
    tx, whole = make({"conv": 5, "dense": None}), make(None)
    np.testing.assert_allclose(tx.update(g, tx.init(g))[0]["conv"],
                               whole.update(g["conv"], whole.init(g["conv"]))[0], rtol=1e-6)
