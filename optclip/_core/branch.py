"""Rare-case branches that never stop a GPU's host.

XLA's GPU runtime (CUDA and ROCm) runs a conditional by copying its predicate to the host and
waiting there until the device has finished everything before it; only then does it launch the
branch. Inside a training step that is a host sync: the host can no longer run ahead of the
device, and on a tree of many small leaves the rest of the step becomes bound by kernel
launches. XLA also passes the buffers a branch returns into and out of it through copies.
(On an H100 and a 148-leaf tree: taking the scale-safe norms' conditional out of the step
moved the transforms that read the gradients once from 1.46-1.54x adam's step to
1.41-1.48x; the gate over a wrapped adam's state, whose conditional copied every moment,
``skip_spikes(adam)`` from 1.93x to 1.45x.) On CPUs and TPUs a conditional runs where its
data is, and taking only the branch a step needs saves work.

So a rare-case branch that costs no extra read on a GPU goes through :func:`rare`: one
``lax.cond`` on CPUs and TPUs; on GPUs both branches, computed as data and picked by a select.
The scale-safe norms' rescaled sums are such a branch (their reduces read the arrays the plain
sums read, and XLA's GPU compiler fuses sibling reductions of one array into one read). A
branch that re-reads data scaled by what the first read found stays a ``lax.cond``: computed
every step, it would cost a read of the gradients. The gate that holds a wrapped optimizer's
state on a rejected step (:func:`optclip._core.stats.run_or_hold`) goes through :func:`rare`
too: on a GPU the select fuses into the kernels that write the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

# The platforms whose conditionals wait on the host (monkeypatched by the tests, which run
# the GPU form on the CPU).
SELECT_PLATFORMS: tuple[str, ...] = ("cuda", "rocm")


def rare(pred: jax.Array, taken: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
    """``taken()`` where the scalar ``pred`` holds, else ``otherwise()``.

    On CPUs and TPUs one ``lax.cond`` (the branch not taken does not run); on GPUs both run
    and an elementwise ``lax.select`` per leaf picks. The two must return the same structure.
    """
    def both(p):
        return _select(p, taken(), otherwise())

    def cond(p):
        return jax.lax.cond(p, taken, otherwise)

    return jax.lax.platform_dependent(pred, default=cond,
                                      **dict.fromkeys(SELECT_PLATFORMS, both))


def _select(pred: jax.Array, a: Any, b: Any) -> Any:
    # A scalar predicate: it carries no sharding of its own (a broadcast one would be
    # replicated, and a select of sharded operands on an Explicit mesh refuses it).
    return jax.tree.map(lambda x, y: jax.lax.select(pred, x, y), a, b)
