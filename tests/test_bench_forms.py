"""The candidate forms that ``benchmarks/bench_device_ab.py`` times against the library's must
compute what the library computes: an A/B of a wrong answer measures nothing."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optclip
from optclip._core import slices

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import bench_device_ab as ab  # noqa: E402


def _rows(dtype) -> jax.Array:
    """Rows of 12 entries that exercise every rule of the ranking: ties at the cut (kept from
    the lowest index), NaN (above inf), ±inf, zeros and -0.0 (every zero kept where the k-th
    largest is 0), a subnormal, and values apart by one unit in the last place."""
    tiny = np.finfo(dtype).smallest_subnormal
    one_up = np.nextafter(dtype(1.0), dtype(2.0))
    return jnp.asarray(np.array([
        [3.0, -1.0, 2.0, -2.0, 2.0, 0.5, -2.0, 1.0, 0.0, 2.0, -0.5, 0.25],
        [np.nan, 1.0, -np.inf, np.inf, 0.0, -1.0, 2.0, np.nan, 0.0, 5.0, -5.0, 1.0],
        [0.0, -0.0, 0.0, 1.0, 0.0, 0.0, -2.0, 0.0, 0.0, 0.0, tiny, 0.0],
        [1.0, one_up, 1.0, one_up, -1.0, -one_up, 1.0, 1.0, 0.5, -0.5, 0.5, 1.0],
        np.random.default_rng(0).normal(size=12),
    ], dtype))


@pytest.mark.parametrize("form", sorted(ab.RANKING_FORMS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_ranking_form_gives_the_library_masks(form, dtype):
    candidate = ab.RANKING_FORMS[form]
    with jax.enable_x64(dtype == np.float64):
        rows = _rows(dtype)
        batched = rows.reshape(5, 2, 6)               # two rows per leading entry
        for k in range(13):
            want = slices.top_k_masks([rows, batched], [k, min(k, 6)])
            got = candidate([rows, batched], [jnp.int32(k), min(k, 6)])
            for w, g, x in zip(want, got, (rows, batched), strict=True):
                # Where the k-th largest is 0, which zeros are marked is free (a marked zero
                # keeps its own value); every other entry must be marked alike.
                nonzero = np.asarray(x) != 0
                np.testing.assert_array_equal(np.asarray(g)[nonzero], np.asarray(w)[nonzero],
                                              err_msg=f"k={k}")


@pytest.mark.parametrize("form", sorted(ab.RANKING_FORMS))
def test_a_ranking_form_gives_the_library_step(form, monkeypatch):
    """Patched in as the benchmark patches it: ``top_q`` and ``l1q_normalize`` on a tree with
    a 1-D, a 2-D and a 3-D leaf return the library's updates."""
    rng = np.random.default_rng(1)
    tree = {"b": jnp.asarray(rng.normal(size=7), jnp.float32),
            "w": jnp.asarray(rng.normal(size=(5, 9)), jnp.float32),
            "c": jnp.asarray(np.round(rng.normal(size=(2, 3, 8)) * 2) / 2, jnp.float32)}
    outputs = []
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(slices, "top_k_masks", ab.RANKING_FORMS[form])
        for tx in (optclip.top_q(0.3), optclip.l1q_normalize(0.6)):
            outputs.append(jax.jit(tx.update)(tree, tx.init(tree))[0])
    for want, got in zip(outputs[:2], outputs[2:]):
        jax.tree.map(np.testing.assert_array_equal, got, want)
