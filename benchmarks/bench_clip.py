"""Compile time, step time and state memory of every optclip transform, against optax.adam.

Run with ``make bench`` (``python benchmarks/bench_clip.py``); ``--quick`` uses small trees,
``--only NAME ...`` a subset, ``--leaves 32,256`` other leaf counts. Measured in one process, on
whatever device JAX uses:

1. ``optclip.clip_by_global_norm`` vs ``optax.clip_by_global_norm`` vs a streaming baseline (one
   read pass for the norm, one in-place scale pass) on a GPT-2-small-shaped gradient tree (124M
   float32 parameters in 148 leaves, buffers donated), and the same inside ``chain(clip, adam)``;
   and the compile ratio of each inside ``chain(clip, adam)`` at every leaf count: the
   streaming baseline's is that of the simplest reduction a transform can add.
2. For every public transform, in a default construction as a new user would write it, in the
   step where its docs place it (``chain(T, adam)`` below; a projection runs after adam,
   Frank-Wolfe alone, since it replaces the optimizer, a wrapper of adam as itself):

   * compile ratio: ``jit(chain(T, adam).update)`` lowered and compiled (up to 256 leaves the
     fastest of two compiles from empty caches), over ``adam`` alone compiled right before it,
     on trees of 32, 256 and 2000 small float32 leaves (shapes (64, 32), (32,), (32, 64), (64,)
     repeated), for every transform at every count unless ``--big-only`` names the ones
     measured above ``--all-up-to`` leaves (one 2000-leaf compile takes 0.2-2 min on 2 cores,
     and a full run about 45 min);
   * step ratio: ``chain(T, adam)`` over ``adam`` per step on the GPT-2-small tree, the same
     gradients every step, buffers donated, adam and the chain taking turns step by step: the
     median over turns of the ratio of the two steps of a turn;
   * floor: the memory-traffic floor of that ratio. ``adam`` moves 6 buffers the size of the
     parameters per step (reads g, m, v; writes m, v, u); a transform adds the extra passes it
     cannot fuse away (a norm needs one more read of g, a projection after adam reads the
     parameters and the update for its statistic and the parameters for its output) plus
     one read and one write of each per-element state buffer: ``1 + (passes + 2 * state) / 6``;
   * state: bytes of the transform's state per parameter byte.

Prints one table, writes it as JSON (``--json``), and renders ``docs/benchmarks.md`` from it
(``--docs``; by default only for a full run). ``--render`` rebuilds the page from a JSON file
without measuring anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

import optclip
from optclip._core import slices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests import hlo  # noqa: E402 (the test suite's measure, shared)
from tests.registry import PLACEMENT, placed  # noqa: E402 (the steps the suite measures)

ADAM_PASSES = 6
COMPILE_SHAPES = hlo.SMALL_SHAPES


@dataclass(frozen=True)
class Case:
    """One public transform: how a new user builds it and what its step cannot avoid."""

    construction: str          # the expression, evaluated with ``optclip`` in scope
    passes: int                # extra passes over a parameter-sized buffer (besides state)
    note: str
    placement: str = "before"  # where the step runs it (tests/registry.py: PLACEMENT)


CASES: dict[str, Case] = {
    "clip_value": Case("optclip.clip_value(1.0)", 0, "elementwise"),
    "clip_norm": Case("optclip.clip_norm(1.0)", 1, "per-leaf norm"),
    "clip_by_global_norm": Case("optclip.clip_by_global_norm(1.0)", 1, "global norm"),
    "normalize": Case("optclip.normalize()", 1, "per-leaf norm"),
    "centralize": Case("optclip.centralize()", 1, "per-leaf mean"),
    "zscore_normalize": Case("optclip.zscore_normalize()", 2, "per-leaf mean, then std"),
    "clip_norm_by_ema": Case("optclip.clip_norm_by_ema()", 1, "per-leaf norms; EMA of g"),
    "normalize_by_ema": Case("optclip.normalize_by_ema()", 1, "per-leaf norms; EMA of g"),
    "clip_value_by_ema": Case("optclip.clip_value_by_ema()", 0, "elementwise; EMA of |g|"),
    "clip_value_growth": Case("optclip.clip_value_growth()", 0, "elementwise; previous update"),
    "clip_norm_growth": Case("optclip.clip_norm_growth()", 1, "per-leaf norm"),
    "hist_clip": Case("optclip.hist_clip()", 1, "global norm"),
    "param_hist_clip": Case("optclip.param_hist_clip()", 1, "per-leaf norms"),
    "zclip": Case("optclip.zclip()", 1, "global norm"),
    "quantile_clip": Case("optclip.quantile_clip()", 1, "per-leaf norms"),
    "standard_clip": Case("optclip.standard_clip()", 1, "per-leaf norms"),
    "sign": Case("optclip.sign()", 0, "elementwise"),
    "l1_normalize": Case("optclip.l1_normalize()", 1, "per-row norm"),
    "l2_normalize": Case("optclip.l2_normalize()", 1, "per-row norm"),
    "top_q": Case("optclip.top_q(q=0.3)", 1,
                  "per-row bisection on the bits of |g| (31 rounds), by blocks of rows"),
    "l1q_normalize": Case("optclip.l1q_normalize(q=0.3)", 1,
                          "per-row bisection on the bits of |g| (31 rounds), by blocks of rows"),
    "clamp": Case("optclip.clamp(-1.0, 1.0)", 0, "elementwise"),
    # Projections run after adam (chain(adam, T)): a statistic of x = params + u reads the
    # params and adam's update (from both moments), and the output reads the params again.
    "project_l2_ball": Case("optclip.project_l2_ball(epsilon=1.0)", 4,
                            "after adam; per-row norm of params + u, then params again"),
    "project_linf_ball": Case("optclip.project_linf_ball(epsilon=1.0)", 4,
                              "after adam; projected flag of params + u, then params again"),
    "clamp_params": Case("optclip.clamp_params(-1.0, 1.0)", 4,
                         "after adam; projected flag of params + u, then params again"),
    # Frank-Wolfe replaces adam (T alone): it reads g for its statistic (the finiteness at
    # least), then g and the params, and writes the update: 4 buffers against adam's 6.
    "frank_wolfe": Case("optclip.frank_wolfe()", -2, "replaces adam; reads params"),
    "l1_frank_wolfe": Case("optclip.l1_frank_wolfe(epsilon=1.0)", -2,
                           "replaces adam; per-row argmax; reads params"),
    "l2_frank_wolfe": Case("optclip.l2_frank_wolfe(epsilon=1.0)", -2,
                           "replaces adam; per-row norm; reads params"),
    "linf_frank_wolfe": Case("optclip.linf_frank_wolfe(epsilon=1.0)", -2,
                             "replaces adam; reads params"),
    "l1q_frank_wolfe": Case("optclip.l1q_frank_wolfe(q=0.3, epsilon=1.0)", -2,
                            "replaces adam; per-row bisection; reads params"),
    "adaptive_grad_clip": Case("optclip.adaptive_grad_clip(0.01)", 2,
                               "per-unit norms of g and params"),
    "adagc": Case("optclip.adagc()", 1, "per-leaf norms"),
    # Wrappers of adam: the construction names ``adam`` and is the whole optimizer.
    "skip_spikes": Case("optclip.skip_spikes(adam)", 1, "global norm; wraps adam"),
    # The clipped fraction and the finiteness check: one read of g and nu before adam's pass.
    "spam_clip": Case("optclip.spam_clip(adam)", 2,
                      "elementwise against adam's nu; fraction reads g and nu; wraps adam"),
    "adamw_clip": Case("optclip.adamw_clip(adam)", 2,
                       "elementwise from adam's nu; fraction reads g and nu; wraps adam"),
    "stable_adamw_clip": Case("optclip.stable_adamw_clip(adam)", 2,
                              "per-leaf RMS(g^2/nu): reads g and nu; wraps adam"),
}
CASES = {name: dataclasses.replace(case, placement=PLACEMENT.get(name, "before"))
         for name, case in CASES.items()}
# A quicker subset for the largest leaf count (--big-only with no names): one per family of
# per-leaf machinery (grouped reductions, per-leaf decisions on vectors).
BIG_ONLY = ("clip_value", "clip_norm", "clip_by_global_norm", "clip_norm_by_ema",
            "clip_norm_growth", "param_hist_clip", "zclip", "adagc", "skip_spikes")


def make(case: Case) -> optax.GradientTransformation:
    return eval(case.construction, {"optclip": optclip})  # noqa: S307 (our own table)


def optimizer(case: Case) -> optax.GradientTransformation:
    """The step a user runs: ``chain(T, adam)``, a projection after adam (``chain(adam, T)``),
    Frank-Wolfe alone (it replaces the optimizer), as the test suite measures them
    (``tests/registry.py``: ``PLACEMENT``); for a transform that wraps adam (its construction
    names ``adam``), the wrapped adam itself."""
    adam = optax.adam(1e-3)
    if re.search(r"\badam\b", case.construction):
        return eval(case.construction, {"optclip": optclip, "adam": adam})  # noqa: S307
    return placed(case.placement, make(case), adam)


# ---------------------------------------------------------------------------------------------
# Trees.

def gpt2_small_shapes(width: int = 768, layers: int = 12, vocab: int = 50257, context: int = 1024):
    shapes = {"wte": (vocab, width), "wpe": (context, width)}
    for i in range(layers):
        block = {"ln_1.g": (width,), "ln_1.b": (width,),
                 "attn.c_attn.w": (width, 3 * width), "attn.c_attn.b": (3 * width,),
                 "attn.c_proj.w": (width, width), "attn.c_proj.b": (width,),
                 "ln_2.g": (width,), "ln_2.b": (width,),
                 "mlp.c_fc.w": (width, 4 * width), "mlp.c_fc.b": (4 * width,),
                 "mlp.c_proj.w": (4 * width, width), "mlp.c_proj.b": (width,)}
        shapes.update({f"h{i}.{k}": v for k, v in block.items()})
    shapes.update({"ln_f.g": (width,), "ln_f.b": (width,)})
    return shapes


def make_tree(shapes, seed=0, scale=1e-3):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {name: jax.random.normal(k, shape, jnp.float32) * scale
            for k, (name, shape) in zip(keys, shapes.items())}


def compile_tree(leaves: int):
    """``leaves`` small float32 leaves (shapes and dtypes only: nothing is allocated)."""
    return {f"p{i:04d}": jax.ShapeDtypeStruct(COMPILE_SHAPES[i % len(COMPILE_SHAPES)],
                                              jnp.float32) for i in range(leaves)}


# ---------------------------------------------------------------------------------------------
# Measurements.

# Compiles per measurement up to --all-up-to leaves, the fastest kept: a single compile of a
# small tree on a 2-core machine moved by up to 40% between runs; the fastest of two is
# steadier. Larger trees (compiles of 10-100 s, relatively less noisy) are compiled once.
COMPILE_REPEATS = 2


def compile_repeats(leaves: int, all_up_to: int) -> int:
    return COMPILE_REPEATS if leaves <= all_up_to else 1


def compile_seconds(tx: optax.GradientTransformation, tree, repeats: int = 1) -> float:
    """Seconds to lower and compile ``jit(tx.update)`` (params passed: projections need them),
    the fastest of ``repeats`` compiles from empty caches."""
    state = jax.eval_shape(tx.init, tree)
    times = []
    for _ in range(repeats):
        jax.clear_caches()
        start = time.perf_counter()
        jax.jit(tx.update).lower(tree, state, tree).compile()
        times.append(time.perf_counter() - start)
    return min(times)


# How step ratios are taken (stored with each row), and how rows measured otherwise are named.
ESTIMATOR = "per-turn-warm"
OLD_ESTIMATORS = {
    None: "timed before 2026-11-28 14:00 UTC, from rounds of several steps",
    "per-turn": "timed before 2026-11-28 16:30 UTC, without the untimed turn",
}


class Stepper:
    """A jitted ``update`` with donated gradients and state, compiled once, stepped on demand.

    Every step sees the same gradients: a fresh copy of ``grads``, made before the clock
    starts, is donated to it. (Feeding a step's updates back as the next step's gradients
    would rank adam's outputs, whose entries are all about ``lr`` in size and often equal,
    instead of gradients: the top-q ranking then takes its tie-break every step.)
    """

    def __init__(self, tx: optax.GradientTransformation, params, grads):
        self.params = params
        self.grads = grads
        # Copies: an init may hand out one zeros buffer twice, which cannot be donated twice.
        self.state = jax.tree.map(jnp.copy, tx.init(params))
        self._update = jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=(0, 1))
        start = time.perf_counter()
        self.step()                                       # compile
        self.compile_s = time.perf_counter() - start
        self.first_s = self.step()                        # warm up

    def step(self) -> float:
        """Seconds of one step (the gradients' copy made before the clock starts)."""
        grads = jax.block_until_ready(jax.tree.map(jnp.copy, self.grads))
        start = time.perf_counter()
        updates, self.state = self._update(grads, self.state, self.params)
        jax.block_until_ready((updates, self.state))
        return time.perf_counter() - start


def interleaved(steppers: dict[str, Stepper], rounds: int, steps: int
                ) -> dict[str, list[float]]:
    """Seconds of each step of each stepper, the steppers taking turns step by step
    (``rounds * steps`` turns), after one untimed turn: a stepper's first step after another
    stepper's compile took about ten times its usual time (adam's: 0.9-1.1 s instead of
    0.1 s, measured on the 2-core CPU), which would have skewed the first turn's ratio."""
    for stepper in steppers.values():
        stepper.step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds * steps):
        for name, stepper in steppers.items():
            times[name].append(stepper.step())
    return times


def ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over turns of ``numerator``'s step over ``denominator``'s step of the same turn.

    The machine drifts between faster and slower phases that move every step alike (2-core
    CPU: adam's step 61 ms in one round of three steps, 95-108 ms in the rounds around it,
    with the same page faults per step), so each ratio pairs two steps taken one after the
    other. Eight repeats of 9 turns of ``chain(clip_by_global_norm, adam)`` against adam on a
    quiet machine spread by 2.0% this way, 6.4% pairing rounds of 3 steps, 13.3% as the ratio
    of the medians over all steps."""
    return statistics.median(n / d for n, d in zip(times[numerator], times[denominator],
                                                  strict=True))


def state_per_param_byte(tx: optax.GradientTransformation, params) -> float:
    state = jax.eval_shape(tx.init, params)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return state_bytes / param_bytes


def extra_passes(case: Case) -> float:
    """Parameter-sized buffers read and written per step by ``chain(T, adam)`` beyond adam's
    (exact: counted in the optimized HLO by the test suite's measure), per layer-sized leaf."""
    return hlo.extra_passes(optimizer(case), optax.adam(1e-3))


def extra_kernels(case: Case) -> float:
    """Kernels each added small leaf brings to ``chain(T, adam)``'s step beyond adam's own
    (exact, from the optimized HLO; XLA:CPU's compile time grows with their square), with
    the top-q ranking's groups as on a tree of many leaves (``slices._count_group_size``)."""
    saved = slices.COUNT_GROUP_PER
    slices.COUNT_GROUP_PER = 1
    try:
        return hlo.extra_kernels_per_leaf(optimizer(case), optax.adam(1e-3))
    finally:
        slices.COUNT_GROUP_PER = saved


def with_kernels(results: dict) -> dict:
    """``results`` with the kernels per leaf of every row that lacks them (a row of a run
    from before the column): exact and quick to take, so a partial run fills them all."""
    for row in results["transforms"]:
        if "kernels" not in row and row["name"] in CASES:
            row["kernels"] = extra_kernels(CASES[row["name"]])
    return results


def own_state_per_param_byte(case: Case, params, adam_state: float | None = None) -> float:
    """The transform's own state per parameter byte: that of its step less adam's (Frank-Wolfe,
    which replaces adam, holds the whole state of its step). ``adam_state``: adam's, if known."""
    whole = state_per_param_byte(optimizer(case), params)
    if case.placement == "alone":
        return whole
    return whole - (state_per_param_byte(optax.adam(1e-3), params) if adam_state is None
                    else adam_state)


def floor_passes(case: Case, state_ratio: float) -> int:
    """The passes beyond adam's that the transform cannot avoid."""
    return case.passes + 2 * round(state_ratio)


def floor(case: Case, state_ratio: float) -> float:
    """Memory-traffic floor of ``chain(T, adam) / adam``; per-element state only (not scalars)."""
    per_element = round(state_ratio, 1)
    return 1 + (case.passes + 2 * per_element) / ADAM_PASSES


def streaming_clip(max_norm: float):
    """The floor of global-norm clipping: one read pass for the sum of squares, one scale pass."""
    def update(grads, state, params=None):
        total = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
        factor = jnp.minimum(1.0, max_norm / jnp.sqrt(total))
        return jax.tree.map(lambda g: g * factor, grads), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# The global-norm clippers both comparisons measure (step time alone and in a chain; compile).
GLOBAL_CLIPS = {
    "streaming baseline": lambda: streaming_clip(1.0),
    "optax.clip_by_global_norm": lambda: optax.clip_by_global_norm(1.0),
    "optclip.clip_by_global_norm": lambda: optclip.clip_by_global_norm(1.0),
}


def global_norm_comparison(params, grads, rounds: int, steps: int) -> dict:
    contenders = {
        **{name: make() for name, make in GLOBAL_CLIPS.items()},
        "adam alone": optax.adam(1e-3),
        "optax chain(clip, adam)": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        "optclip chain(clip, adam)": optax.chain(optclip.clip_by_global_norm(1.0),
                                                 optax.adam(1e-3)),
    }
    steppers = {name: Stepper(tx, params, grads) for name, tx in contenders.items()}
    times = interleaved(steppers, rounds, steps)
    return {
        "estimator": ESTIMATOR,
        "ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "optclip_vs_optax": ratio(times, "optclip.clip_by_global_norm",
                                  "optax.clip_by_global_norm"),
        "optclip_vs_streaming": ratio(times, "optclip.clip_by_global_norm",
                                      "streaming baseline"),
        "optax_chain_vs_adam": ratio(times, "optax chain(clip, adam)", "adam alone"),
        "optclip_chain_vs_adam": ratio(times, "optclip chain(clip, adam)", "adam alone"),
    }


def compile_reference(leaf_counts: list[int], all_up_to: int) -> dict:
    """Compile ratio over adam of three global-norm clippers chained with adam, per leaf count.

    The streaming baseline is the simplest reduction a transform can add to adam: one plain
    sum of squares per leaf, summed, and one scale (not scale-safe, no statistics). Its ratio
    is the reference for the compile targets of the transforms that reduce the leaves.
    """
    ratios: dict[str, dict[str, float]] = {name: {} for name in GLOBAL_CLIPS}
    for leaves in leaf_counts:
        tree, repeats = compile_tree(leaves), compile_repeats(leaves, all_up_to)
        for name, make in GLOBAL_CLIPS.items():
            base = compile_seconds(optax.adam(1e-3), tree, repeats)
            ratios[name][str(leaves)] = compile_seconds(
                optax.chain(make(), optax.adam(1e-3)), tree, repeats) / base
    return ratios


def measure_transform(name: str, case: Case, args, params, grads, adam: Stepper) -> dict:
    row: dict = {"name": name, "construction": case.construction, "note": case.note,
                 "compile": {}, "compile_s": {}, "adam_compile_s": {}}
    for leaves in args.leaves:
        if leaves > args.all_up_to and args.big_only is not None and name not in args.big_only:
            continue
        tree, repeats = compile_tree(leaves), compile_repeats(leaves, args.all_up_to)
        base = compile_seconds(optax.adam(1e-3), tree, repeats)
        chained = compile_seconds(optimizer(case), tree, repeats)
        row["compile"][str(leaves)] = chained / base
        row["compile_s"][str(leaves)] = chained
        row["adam_compile_s"][str(leaves)] = base
    state_ratio = own_state_per_param_byte(case, params)
    row["state_bytes_per_param_byte"] = state_ratio
    row["floor"] = floor(case, state_ratio)
    row["passes"] = extra_passes(case)
    row["floor_passes"] = floor_passes(case, state_ratio)
    row["kernels"] = extra_kernels(case)
    if not args.skip_step:
        chain = Stepper(optimizer(case), params, grads)
        if chain.first_s > args.slow_step:
            # Far from the targets (top-q ranking on a CPU): one timed turn.
            times = interleaved({"adam": adam, "chain": chain}, 1, 1)
            row["step_note"] = "one turn (slow)"
        else:
            # A slowish step gets fewer steps per round, never fewer rounds.
            steps = max(1, min(args.steps, int(args.step_budget / max(chain.first_s, 1e-6))))
            times = interleaved({"adam": adam, "chain": chain}, args.rounds, steps)
        row["step_ratio"] = ratio(times, "chain", "adam")
        row["step_ms"] = statistics.median(times["chain"]) * 1e3
        row["adam_step_ms"] = statistics.median(times["adam"]) * 1e3
        row["step_estimator"] = ESTIMATOR
        row["step_compile_s"] = chain.compile_s
        del chain
    return row


# ---------------------------------------------------------------------------------------------
# Output.

def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    memory = None
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        memory = f"{kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    device = jax.devices()[0]
    # glibc's allocator settings decide whether a step's temporaries fault their pages in
    # afresh every step, which moves the CPU step ratios: a run under non-default ones says so.
    allocator = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                         if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory": memory, "allocator": allocator,
            "device": f"{device.device_kind} ({jax.default_backend()})",
            "gpu": jax.default_backend() == "gpu",
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
            "optax": optax.__version__, "optclip": optclip.__version__,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def _fmt(value, spec=".2f") -> str:
    return "—" if value is None else format(value, spec)


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    leaves = results["config"]["leaves"]
    header = ["transform", *[f"compile ×adam @{n}" for n in leaves], "step ×adam", "floor",
              "passes (floor)", "kernels/leaf", "state B/B"]
    rows = []
    for row in results["transforms"]:
        rows.append([row["name"], *[_fmt(row["compile"].get(str(n))) for n in leaves],
                     _fmt(row.get("step_ratio")) + ("*" if row.get("step_note") else ""),
                     _fmt(row["floor"]),
                     (f"{row['passes']:g} ({row['floor_passes']})" if "passes" in row else "—"),
                     _fmt(row.get("kernels"), ".1f"),
                     _fmt(row["state_bytes_per_param_byte"])])
    return header, rows


def print_table(results: dict) -> None:
    header, rows = table_rows(results)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))


def print_global(g: dict) -> None:
    print(f"{'contender':30s} {'ms/step':>9s}")
    for name, ms in g["ms"].items():
        print(f"{name:30s} {ms:9.2f}")
    print(f"optclip/optax {g['optclip_vs_optax']:.3f}, optclip/streaming "
          f"{g['optclip_vs_streaming']:.3f}, chain/adam: optax {g['optax_chain_vs_adam']:.3f}, "
          f"optclip {g['optclip_chain_vs_adam']:.3f}\n")


def print_compile_reference(ratios: dict) -> None:
    for name, by_leaves in ratios.items():
        part = " ".join(f"@{n} {r:.2f}" for n, r in by_leaves.items())
        print(f"{name:30s} compile ×adam {part}")
    print()


def render_markdown(results: dict, device: dict | None = None) -> str:
    m, c = results["machine"], results["config"]
    header, rows = table_rows(results)
    older = {how: [r["name"] for r in results["transforms"]
                   if "step_ratio" in r and r.get("step_estimator") == estimator]
             for estimator, how in OLD_ESTIMATORS.items()}
    old_estimator = "".join(f" (rows {how}: " + ", ".join(f"`{n}`" for n in names) + ")"
                            for how, names in older.items() if names)
    lines = [
        "# Benchmarks",
        "",
        "Compile time, step time and state memory of every transform, each measured against",
        "`optax.adam(1e-3)` alone in the same process. Produced by `make bench`",
        "(`benchmarks/bench_clip.py`); this page is rewritten by every full run.",
        "",
        f"**Machine:** {m['cpu']}, {m['cores']} cores, {m['memory']} memory; JAX device "
        f"{m['device']}; Python {m['python']}, jax {m['jax']}, optax {m['optax']}, "
        f"optclip {m['optclip']}; measured {m['date']}"
        + (f"; allocator settings `{m['allocator']}`." if m.get("allocator") else "."),
        "",
    ]
    if not m["gpu"]:
        lines += ["This run had no GPU: the fraction of HBM bandwidth that",
                  "`clip_by_global_norm` and `zclip` reach was measured on an H100 in a separate",
                  "run, [below](#on-a-gpu-memory-bandwidth-reached)."
                  if device else "No GPU was available for this run, so the fraction of HBM "
                  "bandwidth reached by `clip_by_global_norm` and `zclip` was not measured.",
                  ""]
    if c.get("partial"):
        lines += [f"!!! warning \"Partial run\"\n    {c['partial']}", ""]
    for update in c.get("updates", ()):
        u = update["machine"]
        settings = f"; allocator settings `{u['allocator']}`" if u.get("allocator") else ""
        lines += [f"Measured again on {u['date']} after a change ({u['cpu']}, {u['cores']} "
                  f"cores; jax {u['jax']}{settings}; `{update['command']}`): "
                  + ", ".join(f"`{n}`" for n in update["names"]) + ". The other rows come "
                  "from the full run above.", ""]
    if not c.get("fresh_gradients"):
        # A full run made before every step got the same gradients.
        lines += [
            "The full run above fed each step the previous step's updates as its gradients",
            "(so did the rows measured again before 2026-11-27); the rows measured again since",
            "step on the same gradients every time. The top-q rows then ranked adam's outputs",
            "(all about lr in size, often equal), whose tie-break slowed them; for the other",
            "transforms the two agree within the noise (fresh / fed back, one process, 2-core",
            "CPU: `clip_by_global_norm` 1.10 / 1.12, `clip_value` 1.38 / 1.40,",
            "`clip_norm_by_ema` 1.94 / 1.90, `zclip` 1.14 / 1.18 ×adam).", ""]
    gpt2 = c["step_tree"]
    lines += [
        "## Every transform",
        "",
        "* **the step**: where the transform's docs place it, written `chain(T, adam)` below:",
        "  `optax.chain(T, adam)` for the clippers and normalizers; `optax.chain(adam, T)` for",
        "  the projections (`project_l2_ball`, `project_linf_ball`, `clamp_params`), which",
        "  project the updated parameters and go last; `T` alone for Frank-Wolfe, which",
        "  replaces the optimizer (its ratios are against adam's step, and its floor is below",
        "  1); and for a wrapper of adam, the wrapper. The test suite measures the same steps",
        "  (`tests/registry.py`: `PLACEMENT`).",
        "* **compile ×adam @N**: lowering plus XLA compile time of "
        "`jax.jit(optax.chain(T, optax.adam(1e-3)).update)` over `optax.adam(1e-3)`'s (up to",
        f"  {c['all_up_to']} leaves each the fastest of two compiles from empty caches), on N",
        "  small float32 leaves (shapes (64, 32), (32,), (32, 64), (64,) repeated), adam compiled",
        f"  right before each transform. {c['big_note']}",
        "  What bounds it from below on XLA:CPU: LLVM compiles every distinct kernel of the",
        "  step on its own, about 9 ms each (16, 32 and 64 independent scalar kernels: 158,",
        "  341 and 553 ms; stacked into one vector they stay as many kernels), and adam's step",
        "  on 32 leaves compiles in about 0.3 s. A transform that keeps scalar statistics",
        "  adds such kernels whatever the leaf count (`zclip`'s state update: about 25), so",
        "  on 32 leaves its ratio stays above 1.5. The page's small leaves also pay for each",
        "  reduction over rows wider than 32 entries that XNNPACK does not take: on a (32, 64)",
        "  leaf XLA:CPU writes the squares out and reduces in two steps (3 kernels), where a",
        "  (64, 128) leaf goes to XNNPACK (2 kernels; 2-core CPU, jax 0.10.2). How to keep",
        "  the wait short on a real model: [Compile time on large trees](compile-time.md).",
        f"* **step ×adam**: time of one `chain(T, adam)` step over one `adam` step on {gpt2},",
        "  the same gradients every step (a fresh copy, made before the clock starts) and the",
        "  state donated; adam and the chain take turns step by step, one untimed turn, then "
        f"{c['rounds']} x {c['steps']}",
        "  turns at most, and the figure is the median over turns of the chain's step over",
        "  adam's step of the same turn" + old_estimator + ".",
        "* **floor**: the memory-traffic floor of that ratio. `adam` moves 6 parameter-sized",
        "  buffers per step (reads the gradient and both moments, writes both moments and the",
        "  update); the floor adds the passes a transform cannot fuse away (a norm reads the",
        "  gradient once more; a projection after adam reads the parameters and adam's update,",
        "  from both moments, for its statistic, and the parameters again for its output: 4)",
        "  and one read and one write of every per-element state buffer:",
        "  `1 + (passes + 2 × state) / 6`. An elementwise transform fuses into adam's pass",
        "  (floor 1.00); one float32 buffer of state adds 0.33. Frank-Wolfe alone reads the",
        "  gradient for its statistic, then the gradient and the parameters, and writes the",
        "  update: 4 buffers against adam's 6 (passes -2, floor 0.67); adam's own step makes",
        "  9 passes (it reads both moments twice), so a step that replaces it can run below",
        "  that floor.",
        "* **passes (floor)**: parameter-sized buffers the step of `chain(T, adam)` reads and",
        "  writes beyond adam's own 9 (adam writes both moments and reads them again for the",
        "  update; a Frank-Wolfe step moves fewer: -5 (-2) is its 4 passes against adam's 9,",
        "  and its floor of 4 against adam's 6), counted exactly in",
        "  the optimized HLO on two (256, 512) leaves (per leaf: a constant XLA shares between",
        "  same-shape leaves and writes out counts); in brackets the",
        "  passes the transform cannot avoid (as in the floor). A conditional that returns",
        "  parameter-sized arrays (a wrapper's run-or-hold gate) counts its dearer branch; one",
        "  that returns small values (the rescaled re-read of a scale-safe norm, taken only when",
        "  a plain sum of squares overflows or underflows) its cheaper one. A loop's body counts",
        "  once per iteration: the top-q rounds, which work on one block of rows at a time from",
        "  the cache, count no pass, and each block's read of its leaf counts one (2 blocks",
        "  of 128 rows on these leaves: 2 counted, 1 made). A buffer counts as one pass",
        "  whatever its element width. Exact and free of timing noise:",
        "  `tests/test_step_traffic.py` holds every transform to its count. On a CPU a pass",
        "  that writes a new temporary (a copy, an intermediate written out) costs about twice",
        "  one that writes over a donated buffer: XLA:CPU allocates the temporary afresh every",
        "  step, and the first write to each page faults (one kernel `a * 0.5 + b` on 38.6M",
        "  float32 entries, GPT-2's embedding: 65 ms into a new buffer, 29 ms in place).",
        "* **kernels/leaf**: kernels (fusions, copies, reductions, and those inside conditional",
        "  branches and loop bodies) that each added leaf brings to the compiled step of",
        "  `chain(T, adam)` beyond adam's own 3, counted exactly in the optimized HLO on 4 and",
        "  16 leaves of the shapes above (0: every leaf of one shape shares the transform's",
        "  kernels; below 0: the chain merges one of adam's per-leaf kernels away). XLA:CPU",
        "  orders the kernels of a step by testing each new one against",
        "  those before it for buffer conflicts, so this part of the compile time grows with",
        "  the square of the kernel count: on 1024 leaves (perf samples) it took about a third",
        "  of the compile time of `adaptive_grad_clip` (about 12 kernels per leaf with adam's)",
        "  and an eighth of adam's. The ratios that grow most from 256 to 2000 leaves are",
        "  mostly those of transforms with many kernels per leaf. `tests/test_compile_cost.py`",
        "  holds every transform to its count; a run with --update takes it for every row of",
        "  the page that lacks it. On a host with several devices (8 GPUs, or",
        "  `--xla_force_host_platform_device_count`) same-shape leaves are not reduced",
        "  together (a variadic reduce over sharded operands would gather them), and the",
        "  counts are higher. The outputs of the step grow the same way: XLA's buffer",
        "  assignment compares each output with the ones before it, so a state that kept one",
        "  0-d array per leaf and field cost compile time quadratic in the leaves too. Every",
        "  transform keeps such values as one vector per field over the leaves",
        "  (`optclip.per_leaf` gives a tree): at 2000 leaves `clip_norm_by_ema` (5 values per",
        "  leaf) compiled in 10.35x adam's time as trees, 4.53x as vectors (2-core CPU,",
        "  2026-11-25 and 2026-11-27 full runs). The count is a proxy, not the cost: a kernel's",
        "  own compile time grows with its size, and one variadic reduce shared by many",
        "  leaves can cost more than the kernels it replaces (slice sums of 32 same-shape",
        "  leaves shared by one compensated reduce: fewer kernels, 10.6 s instead of 7.4 s to",
        "  compile `centralize` on 1000 leaves; the top-q ranking shares its counts among at",
        "  most 8 leaves, 32 compiled slower, and only from 64 leaves ranked together on, in",
        "  groups that grow with their number: on 32 leaves groups of 8 compiled slower than",
        "  none; this column counts the groups of a large tree). Changes are judged by",
        "  compile time too.",
        "* **state B/B**: bytes of the transform's own state per byte of parameters.",
        "* `*`: a step slower than --slow-step seconds: one timed turn (a step of adam, then one",
        "  of the chain).",
        "* **noise**: on a 2-core machine, two runs of the same code have moved single figures",
        "  by up to ±40% (compile at 32 and 256 leaves, each compile timed once; the fastest",
        "  of two narrows that) and, for the steps of the slowest transforms (several times",
        "  adam's), by up to 70%. Much of that is the machine itself: it drifts between faster",
        "  and slower phases that last tens of seconds and move every step alike (in one",
        "  process, adam's step took 61 ms in one round and 95-108 ms in the rounds around it,",
        "  with the same 37.7k page faults per step, and `clip_norm`'s 71 ms against",
        "  107-116 ms), which is why each ratio pairs two steps taken one after the other. The",
        "  passes column is exact. Read a figure against its neighbours and the floor, and",
        "  compare code versions in one process (`--only`).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
        *["| " + " | ".join([f"`{r[0]}`", *r[1:]]) + " |" for r in rows],
        "",
        "Constructions (defaults, required arguments filled in):",
        "",
        *[f"* `{r['name']}`: `{r['construction']}` ({r['note']})" for r in results["transforms"]],
        "",
    ]
    g = results.get("global_norm")
    if g:
        lines += [
            "## Global-norm clipping against optax and the streaming floor",
            "",
            f"On {gpt2}: the streaming baseline reads the gradients once for the norm and scales",
            "them in place in a second pass.",
            "",
            "| contender | ms / step |",
            "|---|---:|",
            *[f"| {name} | {ms:.2f} |" for name, ms in g["ms"].items()],
            "",
            f"`optclip.clip_by_global_norm` takes {g['optclip_vs_optax']:.3f}× optax's time and "
            f"{g['optclip_vs_streaming']:.3f}× the streaming baseline's; in a chain with adam, "
            f"optclip costs {g['optclip_chain_vs_adam']:.3f}× adam and optax "
            f"{g['optax_chain_vs_adam']:.3f}×"
            + (" (each ratio the median over turns of the ratio of two steps taken one after the"
               " other; the milliseconds are medians over every step)."
               if g.get("estimator") in (ESTIMATOR, "per-turn") else "."),
            "",
        ]
    ref = results.get("compile_reference")
    if ref:
        counts = list(next(iter(ref.values())))
        lines += [
            "## What a reduction costs to compile",
            "",
            "Compile ×adam (as in the table above) of `chain(clip, adam)` for three global-norm",
            "clippers. The streaming baseline is the simplest reduction a transform can add:",
            "`jnp.sum(g * g)` per leaf, one total, one scale; no scale safety and no statistics.",
            "A transform that reduces its leaves (norms, statistics, projections) adds at least",
            "one reduction kernel per leaf (or per group of same-shape leaves) to adam's",
            "elementwise kernels, which is what this figure measures.",
            "",
            "| contender | " + " | ".join(f"compile ×adam @{n}" for n in counts) + " |",
            "|---|" + "---:|" * len(counts),
            *[f"| {name} | " + " | ".join(_fmt(r.get(n)) for n in counts) + " |"
              for name, r in ref.items()],
            "",
        ]
    lines += ["Command: `" + c["command"] + "`", ""]
    if device:
        lines += device_section(device)
    return "\n".join(lines)


def device_section(dev: dict) -> list[str]:
    """The page's section on an accelerator, from ``bench_device.py``'s results."""
    m, c = dev["machine"], dev["config"]
    reports = dev["bandwidth"]

    def both(name, field, spec=".2f"):
        return " / ".join(format(r["contenders"][name][field], spec) for r in reports)

    sheet = reports[0]["datasheet_bytes_per_s"]
    lines = [
        "## On a GPU: memory bandwidth reached",
        "",
        f"**Machine:** {m['device']}, a host of {m['cores']} cores; Python {m['python']}, jax "
        f"{m['jax']}, optax {m['optax']}; measured {m['date']} "
        f"(`{c['command']}`, `benchmarks/bench_device.py`, code {c.get('code', '?')}) on "
        f"{c['step_tree']}. Each time is one jitted call running {c['steps']} steps in a",
        "`fori_loop`, as an optimizer runs inside a training step; median over "
        f"{c['rounds']} interleaved rounds. The bandwidth figures were taken twice, before and",
        "after the rows of the second table (first / second).",
        "",
        "Ceilings measured on the card: an in-place elementwise pass over 1 GiB moved "
        + " / ".join(f"{r['ceiling_bytes_per_s']['elementwise'] / 1e9:.0f}" for r in reports)
        + " GB/s, a sum of squares read "
        + " / ".join(f"{r['ceiling_bytes_per_s']['sum of squares'] / 1e9:.0f}" for r in reports)
        + " GB/s" + (f"; the datasheet says {sheet / 1e9:.0f} GB/s." if sheet else "."),
        "**fraction** is the fewest bytes the step must move (parameter-sized buffers: alone,",
        "two reads of the gradients and one write; with adam, adam's 6 and one more read)",
        "over the time, against the elementwise ceiling.",
        "",
        "| contender | buffers | ms / step | fraction of ceiling |",
        "|---|---:|---:|---:|",
        *[f"| {name} | {r['buffers']} | {both(name, 'ms', '.3f')} | "
          f"{both(name, 'of_elementwise')} |"
          for name, r in reports[0]["contenders"].items()],
        "",
    ]
    rows = dev.get("transforms", [])
    if rows:
        lines += [
            f"`chain(T, adam)` over `adam` per step for {len(rows)} transforms"
            + (f" (the run's time budget ended before the rest; {c['stopped']})"
               if c.get("stopped") else "") + ", next to the floor of the",
            "table above, and the conditionals (`lax.cond`) the step holds when lowered for",
            "CUDA (counted exactly in the exported StableHLO, code "
            f"{dev.get('conditionals_code', '?')}).",
            "",
            "| transform | step ×adam (GPU) | floor | conditionals |",
            "|---|---:|---:|---:|",
            *[f"| `{r['name']}` | {r['step_ratio']:.2f} | {r['floor']:.2f} | "
              f"{r.get('conditionals', '—')} |" for r in rows],
            "",
        ]
    if c.get("note"):
        lines += [f"!!! note \"Since this run\"\n    {c['note']}", ""]
    lines += [
        "What this run says:",
        "",
        "* adam alone on this tree reaches about 0.7 of the elementwise ceiling: 148 leaves,",
        "  many of them small (768-entry biases), make 148 small kernels whose launch and tail",
        "  cost is not hidden.",
        "* A transform whose only extra work is one read of the gradients (a norm, a statistic)",
        "  costs 1.41-1.48x adam on the card, `centralize` 1.26x and optax's",
        "  `chain(clip_by_global_norm, adam)` 1.28x; optclip's `clip_by_global_norm` alone",
        "  takes about 1.2x optax's time. The conditionals are out of those steps now (with",
        "  them, in an earlier run: 1.46-1.54x), and the variadic reduce that shares one kernel",
        "  among same-shape small leaves is not the cause either (with one reduce per leaf",
        "  instead: 1.273 against 1.276 ms alone, 2.139 against 2.149 ms in the chain, one A/B",
        "  in one process, `benchmarks/bench_device_ab.py`). What is left is kernels on a step",
        "  bound by their launches: the scale-safe norm of a large leaf is a two-stage",
        "  reduction with two results (the plain and the rescaled sum of squares); XLA reads",
        "  the leaf once for both, but finishes each in a kernel of its own, where optax's",
        "  single sum needs one: the step of `chain(optclip.clip_by_global_norm, adam)`",
        "  compiles to 381 kernels, optax's to 352.",
        "* The gates that hold a wrapped adam's moments, an EMA or the previous update on a",
        "  rejected step are selects on a GPU: as conditionals XLA passed every state buffer",
        "  into and out of the branch through a copy (about 150 copies per step of",
        "  `skip_spikes(adam)`) and read the predicate back to the host. Measured in one",
        "  process (`bench_device_ab.py gates`), conditional against select: `skip_spikes`",
        "  1.93x adam against 1.45x, `spam_clip` 2.30x against 1.82x, `stable_adamw_clip` 2.21x",
        "  against 1.83x, `clip_norm_by_ema` 2.47x against 2.16x (`clip_value_growth`'s",
        "  conditional XLA had already turned into a select: 2.23x and 2.21x); the rows above",
        "  are the select.",
        "* `top_q`, `l1q_normalize` and `l1q_frank_wolfe` (20-22x) find each row's k-th",
        "  magnitude by a bisection on its bits, 31 rounds of a count per row. The leaves",
        "  are ranked in groups of about a million entries (for a CPU's caches), each group",
        "  by its own loop and its own conditional for the ties at the cut: on this tree 74",
        "  loops one after the other, some 2,300 rounds of small kernels a step.",
        "  `bench_device_ab.py ranking` (not yet run on a GPU) times that form against all",
        "  leaves in one loop, a sort of each row, and a search of four bits a round in 8",
        "  unrolled rounds with the ties kept by a running count.",
        "* Timed as separate jitted calls instead of in a loop, every step on this tree was",
        "  bound by the host: dispatching one step of adam (592 buffers in and out) took the",
        "  host 4.4 ms, three times the device's 1.5 ms, and every ratio shrank toward 1. Jit",
        "  the whole training step (forward, backward and optimizer) on a GPU.",
        "",
    ]
    return lines


def merged(path: str, update: dict) -> dict:
    """The results of the full run in ``path`` with the rows of ``update`` (an ``--only`` run)
    in place of its own, and a record of the update in its config."""
    with open(path) as f:
        full = json.load(f)
    if full["config"].get("partial") or full["config"].get("quick"):
        raise SystemExit(f"--update: {path} is not the result of a full run")
    names = [row["name"] for row in update["transforms"]]
    rows = {row["name"]: row for row in update["transforms"]}
    full["transforms"] = [rows.pop(row["name"], row) for row in full["transforms"]]
    full["transforms"] += list(rows.values())
    # Earlier updates keep only the rows this one does not measure again.
    earlier = [{**u, "names": [n for n in u["names"] if n not in names]}
               for u in full["config"].get("updates", ())]
    full["config"]["updates"] = [*(u for u in earlier if u["names"]),
                                 {"names": names, "machine": update["machine"],
                                  "command": update["config"]["command"]}]
    return full


DEVICE_JSON = os.path.join(ROOT, "benchmarks", "results_device.json")


def device_results() -> dict | None:
    """The last accelerator run of ``bench_device.py`` (rendered into the page), if any."""
    if not os.path.exists(DEVICE_JSON):
        return None
    with open(DEVICE_JSON) as f:
        return json.load(f)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="GPT-2 tree at 1/4 width and vocabulary; compile at 32 and 128 leaves")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these transforms only")
    parser.add_argument("--leaves", type=lambda s: [int(x) for x in s.split(",")],
                        help="leaf counts for compile time (default 32,256,2000)")
    parser.add_argument("--all-up-to", type=int, default=256,
                        help="leaf counts above this are compiled once (not the fastest of "
                             "two), and only for the transforms --big-only names if given")
    parser.add_argument("--big-only", nargs="*", metavar="NAME",
                        help="measure leaf counts above --all-up-to for these transforms only "
                             "(no names: a subset, one per family); default every transform")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3,
                        help="turns per round (at most; a slow step gets fewer)")
    parser.add_argument("--step-budget", type=float, default=4.0,
                        help="seconds per round and contender that set fewer steps for slow steps")
    parser.add_argument("--slow-step", type=float, default=5.0,
                        help="seconds: a slower warm step is timed once, without rounds")
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--skip-global", action="store_true",
                        help="skip the global-norm comparison and the compile reference")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results.json"))
    parser.add_argument("--docs", default=None,
                        help="write the page here (default docs/benchmarks.md on a full run)")
    parser.add_argument("--render", metavar="JSON",
                        help="only render --docs (default docs/benchmarks.md) from this JSON")
    parser.add_argument("--update", action="store_true",
                        help="with --only: replace those transforms' rows in the --json file of "
                             "the last full run (which keeps its other rows, its global-norm "
                             "comparison and compile reference) and re-render the page, which "
                             "says which rows were measured again, when and where")
    args = parser.parse_args(argv)
    if args.update and not args.only:
        parser.error("--update needs --only (a full run rewrites every row anyway)")
    if args.leaves is None:
        args.leaves = [32, 128] if args.quick else [32, 256, 2000]
    check_names(parser, args.only)
    return args


def check_names(parser: argparse.ArgumentParser, names) -> None:
    unknown = set(names or ()) - set(CASES)
    if unknown:
        parser.error(f"unknown transforms {sorted(unknown)}; choose from {sorted(CASES)}")


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
        path = args.docs or os.path.join(ROOT, "docs", "benchmarks.md")
        with open(path, "w") as f:
            f.write(render_markdown(results, device_results()))
        print(f"wrote {path}")
        return

    names = args.only or list(CASES)
    missing = set(optclip.__all__) - set(CASES) - {
        "stats", "clip_grad_norm", "clip_grad_value", "normalize_grads", "max_clipping",
        "mean_clipping", "reciprocal_clipping", "ema_criterion", "zscore_criterion",
        "flax_unit_axes", "per_leaf"}
    if missing:
        print(f"warning: no benchmark case for {sorted(missing)}", file=sys.stderr)
    width = 192 if args.quick else 768
    shapes = gpt2_small_shapes(width=width, vocab=50257 // (4 if args.quick else 1))
    params = make_tree(shapes, seed=1)
    grads = make_tree(shapes, seed=2, scale=1.0)          # global norm >> 1: clipping is active
    count = sum(x.size for x in jax.tree.leaves(params))
    step_tree = (f"a GPT-2-small-shaped tree ({count / 1e6:.1f}M float32 parameters, "
                 f"{len(shapes)} leaves)")
    info = machine()
    print(f"device: {info['device']}, {info['cores']} cores; step tree: {step_tree}\n")

    big = [n for n in args.leaves if n > args.all_up_to]
    if args.big_only is not None and not args.big_only:
        args.big_only = list(BIG_ONLY)
    big_note = (f"At {', '.join(map(str, big))} leaves only " +
                ", ".join(f"`{n}`" for n in args.big_only) + " are measured (time)."
                if big and args.big_only is not None else "")
    partial = []
    if args.quick:
        partial.append("--quick: small trees, not the sizes the targets refer to.")
    if args.only:
        partial.append(f"--only: {len(names)} of {len(CASES)} transforms.")
    results: dict = {
        "machine": info,
        "config": {"leaves": args.leaves, "all_up_to": args.all_up_to, "big_only": args.big_only,
                   "big_note": big_note, "rounds": args.rounds, "steps": args.steps,
                   "step_tree": step_tree, "quick": args.quick,
                   "fresh_gradients": True,
                   "partial": " ".join(partial) or None,
                   "command": "python benchmarks/bench_clip.py " + " ".join(
                       sys.argv[1:] if argv is None else argv)},
        "transforms": [],
    }
    if not args.skip_global and not args.skip_step:
        results["global_norm"] = global_norm_comparison(params, grads, args.rounds, args.steps)
        print_global(results["global_norm"])
    if not args.skip_global:
        results["compile_reference"] = compile_reference(args.leaves, args.all_up_to)
        print_compile_reference(results["compile_reference"])
    adam = None if args.skip_step else Stepper(optax.adam(1e-3), params, grads)
    for done, name in enumerate(names):
        start = time.perf_counter()
        row = measure_transform(name, CASES[name], args, params, grads, adam)
        results["transforms"].append(row)
        # Written after every row: a run that is stopped (time, memory) keeps what it measured
        # (``--render`` turns it into the page, marked partial).
        # (--update leaves the full run's file alone until the end.)
        if done + 1 < len(names) and not args.update:
            unfinished = {**results, "config": {**results["config"], "partial": " ".join(
                partial + [f"Stopped after {done + 1} of {len(names)} transforms."])}}
            with open(args.json, "w") as f:
                json.dump(unfinished, f, indent=1)
        compile_part = " ".join(f"@{n} {r:.2f}" for n, r in row["compile"].items())
        print(f"{name:20s} compile {compile_part}  step {_fmt(row.get('step_ratio'))}"
              f" (floor {row['floor']:.2f})  passes {row['passes']:g} ({row['floor_passes']})"
              f"  state {row['state_bytes_per_param_byte']:.2f}"
              f"  [{time.perf_counter() - start:.0f} s]", flush=True)
    if args.update:
        results = with_kernels(merged(args.json, results))
    print()
    print_table(results)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.json}")
    docs = args.docs or (None if (args.quick or args.only) and not args.update else
                         os.path.join(ROOT, "docs", "benchmarks.md"))
    if docs:
        with open(docs, "w") as f:
            f.write(render_markdown(results, device_results()))
        print(f"wrote {docs}")


if __name__ == "__main__":
    main()
