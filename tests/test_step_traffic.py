"""Step cost, structurally: the memory passes every public transform adds to adam's step.

On a model of realistic size a training step is bound by memory bandwidth, so its time is
about the number of passes over parameter-sized buffers times the time of one pass. That number
is exact in the optimized HLO (``tests/hlo.py``): this suite holds every transform of the
conformance table to its budget, the passes ``chain(T, adam)`` reads and writes beyond
``adam`` alone (for a wrapper of an optimizer, beyond the wrapped optimizer; a projection is
measured after adam and Frank-Wolfe, which replaces adam, alone, as their docs place them:
``tests/registry.py``'s ``PLACEMENT``). Adam itself makes 9 (reads g, mu, nu; writes mu, nu,
the update; reads mu and nu again for the update).

The budgets are exact, not upper bounds: a change that adds a pass (a re-read of the
gradients, a temporary the size of the parameters) fails here, and a change that saves one
updates the table, so the table stays the record of what each step costs. The floor of a
transform is what it cannot avoid: an elementwise one with no diagnostics 0; a reduction over
the gradients (a norm, a finiteness check) 1 read; a per-element state buffer 1 read + 1 write;
reading the parameters 1. The rescaled re-read of a scale-safe norm (a conditional branch taken
only when a plain sum of squares overflows or underflows) is not counted (``tests/hlo.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optclip
from optclip._core import norms, slices
from tests import hlo
from tests.hlo import LARGE, RECORDED_JAXLIB, TREE, Traffic, extra_passes, recorded_xla, traffic
from tests.registry import ALL_ENTRIES, Entry, with_adam

pytestmark = pytest.mark.skipif(
    not recorded_xla(), reason=f"exact pass counts of jaxlib {RECORDED_JAXLIB}'s XLA (older "
    "XLA:CPU versions fuse reductions differently); checked by the main pins of make test")

# Passes per large leaf beyond adam's, per transform as the registry builds it, where one
# CPU device is visible, as make bench measures (this suite sees 8 CPU devices for its sharding
# checks, and takes the one-device paths through the ``one_device`` fixture of conftest.py,
# which patches ``norms._may_group`` and ``slices.single_cpu_device``). MULTI_DEVICE_BUDGET
# below holds the counts that differ where several devices are visible.
BUDGET = {
    # Elementwise. clip_value logs each leaf's max |g| and checks finiteness: two reductions
    # (XLA:CPU's fast float maximum skips NaN, so one maximum cannot give both); clamp counts.
    "clip_value": 2,
    "clamp": 1,
    "sign": 0,
    # One reduction over g (a per-leaf, per-row or global statistic, finiteness from it).
    "clip_norm": 1,
    "clip_by_global_norm": 1,
    "normalize": 2,                 # the registry's ord="std": mean, then the deviation
    "centralize": 1,
    "zscore_normalize": 2,          # mean, then the deviation
    "clip_norm_growth": 1,
    "hist_clip": 1,
    "param_hist_clip": 1,
    "zclip": 1,
    "quantile_clip": 1,
    "standard_clip": 1,
    "adagc": 1,
    "l1_normalize": 1,
    "l2_normalize": 1,
    # Per-element state (an EMA, the previous update): floor 2 (one read, one write) + one read
    # per statistic. The EMA pair: the update's norm (1), the moved EMA's norm read from the
    # update and the old EMA (2), the commit (2 reads, 1 write); with ord="std" (the registry's
    # clip_norm_by_ema) the moved EMA, read by two reductions, is written out first.
    "clip_norm_by_ema": 10,
    "normalize_by_ema": 6,
    "clip_value_by_ema": 11,
    # clip_value_growth writes its output over the donated update (no temporary, which on a CPU
    # costs about twice a pass in place); adam's kernels then also read the new reference.
    "clip_value_growth": 12,
    # Per-row ranking: on one CPU device a block of rows at a time from the cache. Each
    # block's read of the gradients (counted as a whole pass: 2 blocks of 128 rows, 2 counted,
    # 1 made) and the finiteness check; the rounds read their block from the cache. The output
    # waits for the finiteness check (stats.after): else XLA copies the donated gradients to
    # keep them for it (a read and a write more, into a new buffer every step). l1q also
    # counts the non-zero entries of each row (1): the kept ones follow from the row's cut.
    "top_q": 3,
    "l1q_normalize": 4,
    "l1q_frank_wolfe": -2,          # alone (replaces adam: its own 7 passes against adam's 9)
    # Projections, after adam as users place them: the statistic is a reduction over
    # params + u, u being adam's update. Floor 4: the reduction could recompute u from the
    # moments (3 reads), the output reads the params (1). A large leaf is reduced by a
    # variadic reduce (XLA:CPU's own loop: the box projections' excess row by row,
    # slices.excesses(computed=True); the plain and scaled sums of squares of
    # project_l2_ball): adam's update before its learning rate is written out once (its
    # divide is not recomputed), and the reduction and the output each read it with the
    # params.
    "project_l2_ball": 5,
    "project_linf_ball": 5,
    "clamp_params": 5,
    # Frank-Wolfe replaces adam: its whole step against adam's 9 (it reads g for the
    # finiteness or the per-row statistic, then g and the params, and writes the update: 4).
    "frank_wolfe": -5,
    "l1_frank_wolfe": -5,
    "l2_frank_wolfe": -5,
    "linf_frank_wolfe": -5,
    "adaptive_grad_clip": 2,
    # Wrappers of adam (a global norm; the moment clippers read g and nu for their statistic;
    # the NaN updates of a held step: a select after the gate, or, for the elementwise clips,
    # written with the clipped gradients ahead of the adam).
    "skip_spikes": 3,
    "spam_clip": 5,
    "adamw_clip": 5,
    "stable_adamw_clip": 4,
}


def _extra(entry: Entry) -> float:
    """Passes per large leaf beyond the baseline's (halves where something is shared)."""
    return extra_passes(*with_adam(entry))


def test_every_transform_has_a_budget():
    assert set(BUDGET) == {entry.name for entry in ALL_ENTRIES}


def _stateless(fn) -> optax.GradientTransformation:
    return optax.GradientTransformation(optax.identity().init,
                                        lambda updates, state, params=None: (fn(updates), state))


def test_measure_counts_passes():
    """Adam: read g, mu, nu; write mu, nu; read them again; write the update. A transform that
    fuses into adam's kernels costs nothing; one that writes a temporary (here a sort, which no
    elementwise kernel can absorb) costs that write and one read."""
    assert traffic(optax.adam(1e-3), TREE) == Traffic(reads=6 * LARGE, writes=3 * LARGE)
    identity = _stateless(lambda u: jax.tree.map(lambda g: -g, u))
    assert traffic(optax.chain(identity, optax.adam(1e-3)), TREE) == Traffic(12, 6)
    row_sort = _stateless(lambda u: jax.tree.map(lambda g: jnp.sort(g, axis=-1), u))
    assert traffic(optax.chain(row_sort, optax.adam(1e-3)), TREE) == Traffic(14, 8)


def _finiteness_scaled(marks):
    """Scales every leaf by 1 + its ``sum(marks(g))`` (a finiteness-style reduction)."""
    return _stateless(lambda u: jax.tree.map(lambda g: g * (1 + jnp.sum(marks(g))), u))


def test_measure_sees_shared_constants():
    """``sum(g * 0)`` on two same-shape leaves: XLA shares the broadcast zero between the two
    reductions and writes it out (one write, and a second read in each reduction); ``g - g``
    has no constant, and each reduction reads its leaf once."""
    times_zero = _finiteness_scaled(lambda g: g * jnp.zeros((), g.dtype))
    minus_self = _finiteness_scaled(lambda g: g - g)
    base = traffic(optax.adam(1e-3), TREE).passes
    assert traffic(optax.chain(minus_self, optax.adam(1e-3)), TREE).passes - base == LARGE
    assert traffic(optax.chain(times_zero, optax.adam(1e-3)), TREE).passes - base > LARGE


def test_apart_keeps_each_reduction_to_one_read():
    """The core's barrier helper: the same ``sum(g * 0)``, with the zero passed through
    ``norms.apart`` together with its leaf, shares no constant, and each reduction reads its
    leaf once (as ``g - g`` does)."""
    def apart_zero(g):
        g, zero = norms.apart(g, jnp.zeros((), g.dtype))
        return g * zero

    base = traffic(optax.adam(1e-3), TREE).passes
    chained = optax.chain(_finiteness_scaled(apart_zero), optax.adam(1e-3))
    assert traffic(chained, TREE).passes - base == LARGE


@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=str)
def test_step_passes_match_budget(entry, one_device):
    extra = _extra(entry)
    assert extra == BUDGET[entry.name], (
        f"{entry.name}: chain(T, adam) makes {extra} passes over parameter-sized buffers beyond "
        f"adam's, the budget is {BUDGET[entry.name]}: "
        + ("a pass was added (a re-read of the gradients? a temporary the size of the "
           "parameters?)" if extra > BUDGET[entry.name] else "a pass was saved: lower the "
           "budget"))


# Where several devices are visible (this suite's 8 CPU devices, unsharded arrays), the counts
# that differ from BUDGET's; every other transform takes the same paths. The ranking is one
# search per leaf over the whole array (31 rounds, each reads the bits and writes and reads
# the comparison: XLA:CPU does not fuse a comparison into a reduction; the comparison is
# bfloat16 flags, half a float32 pass each, counted here as whole ones), and the second
# bisection, on the index, that only rows with too many ties need: a loop over blocks of rows
# would gather a sharded leaf. The projections keep XNNPACK's plain reductions (a variadic
# reduce over a sharded axis would be gathered), which have adam's update written out a
# second time, with the learning rate applied.
MULTI_DEVICE_BUDGET = {"top_q": 96, "l1q_normalize": 97, "l1q_frank_wolfe": 91,
                       "project_l2_ball": 7, "project_linf_ball": 7, "clamp_params": 7}


@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=str)
def test_several_devices_change_only_the_listed_counts(entry):
    assert jax.device_count() > 1
    assert _extra(entry) == MULTI_DEVICE_BUDGET.get(entry.name, BUDGET[entry.name])


def test_ranking_rounds_write_two_byte_flags(monkeypatch):
    """XLA:CPU writes the comparison of every bisection round out before it counts it: the
    rounds write it as bfloat16 flags, half the bytes of float32, and nothing else; on one CPU
    device a block of rows at a time (the (256, 512) leaves in blocks of 128 rows: nothing the
    size of a leaf in any loop; each block's loop writes the block's bits once, outside the
    rounds). Also inside ``shard_map``, where each device counts its block of the slice."""
    monkeypatch.setattr(slices, "single_cpu_device", lambda: True)
    tx = optax.chain(optclip.top_q(0.9), optax.adam(1e-3))
    text = hlo.compiled_step(tx, TREE).as_text()
    rows = slices._block_rows(jnp.zeros(TREE["w"].shape))
    assert rows == 128
    assert not hlo.loop_writes(text, TREE["w"].size)
    written = hlo.loop_writes(text, rows * TREE["w"].shape[1], innermost=True)
    assert written and set(written) == {"bf16"}, written

    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    split = optclip.top_q(0.9, param_ndim=None, axis_name="x")
    mapped = jax.shard_map(lambda g: split.update(g, split.init(g))[0], mesh=mesh,
                           in_specs=(P("x"),), out_specs=P("x"))
    block = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    text = jax.jit(mapped).lower(block).compile().as_text()
    written = hlo.loop_writes(text, 256 * 512)
    assert written and set(written) == {"bf16"}, written


@pytest.mark.parametrize("make", [optclip.clip_norm_by_ema,
                                  lambda: optclip.normalize_by_ema(tensorwise=False)],
                         ids=["per-leaf", "global"])
def test_ema_pair_writes_only_the_committed_ema(make):
    """The EMA-referenced norm clippers (order 2) measure the moved EMA from the update and the
    old EMA without writing it out, and commit it in place: beyond adam's, each large leaf is
    read 5 times (the update's norm, the moved EMA's norm from both, the commit from both) and
    written once (the committed EMA). No temporary, and no copy of the donated updates."""
    base = traffic(optax.adam(1e-3), TREE)
    assert traffic(optax.chain(make(), optax.adam(1e-3)), TREE) == base + Traffic(
        reads=5 * LARGE, writes=LARGE)
