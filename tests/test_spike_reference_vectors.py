"""optclip's spike protection against trajectories of the public PyTorch implementations.

``tests/data/spike_protection_reference.json`` holds parameter trajectories produced once, in
float64 on CPU, by pytorch-optimizer's ``AdaGC`` and ``SPAM``, ``AdamWClip`` and torch-optimi's
``StableAdamW`` (the exact versions and arguments are in the file), run outside the project on
the gradient sequence stored with them. Here the optclip equivalent (the rule wrapping or
preceding ``optax.adam``) replays the same gradients under float64.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optclip

DATA = json.loads((pathlib.Path(__file__).parent / "data" /
                   "spike_protection_reference.json").read_text())

EQUIVALENTS = {
    # The reference's warm-up is `step < warmup_steps` (1-based): warmup_steps=3 there is two
    # warm-up steps.
    "adagc": lambda: optax.chain(optclip.adagc(warmup_steps=2), optax.adam(1e-2, eps=1e-8)),
    "spam": lambda: optclip.spam_clip(optax.adam(1e-2, eps=1e-8), clip_after=3),
    "adamw_clip": lambda: optclip.adamw_clip(optax.adam(1e-2, eps=1e-8), warmup_steps=1),
    "stable_adamw": lambda: optclip.stable_adamw_clip(
        optax.adam(1e-2, b1=0.9, b2=0.99, eps=1e-6), b2=0.99, eps=1e-6),
}


@pytest.mark.parametrize("name", list(EQUIVALENTS))
def test_trajectory_matches_the_reference(name):
    assert name in DATA["references"], DATA["references"]
    with jax.enable_x64(True):
        params = {k: jnp.asarray(v, jnp.float64) for k, v in DATA["init"].items()}
        tx = EQUIVALENTS[name]()
        state = tx.init(params)
        for step, (grads, expected) in enumerate(zip(DATA["grads"],
                                                     DATA["trajectories"][name])):
            grads = {k: jnp.asarray(v, jnp.float64) for k, v in grads.items()}
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            for key in params:
                # SPAM adds eps to sqrt(nu) before bias correction (optax after): ~1e-7 apart.
                np.testing.assert_allclose(np.asarray(params[key]), np.asarray(expected[key]),
                                           rtol=1e-6, atol=1e-9,
                                           err_msg=f"{name}, step {step}, {key}")
