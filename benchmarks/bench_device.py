"""Bandwidth reached on an accelerator: the fraction of memory bandwidth optclip's steps reach.

Run with ``make bench-device`` (``python benchmarks/bench_device.py``) on a machine whose JAX
default device is a GPU or TPU; it writes ``benchmarks/results_device.json``, which
``make bench-docs`` (and every ``make bench``) renders into ``docs/benchmarks.md``. On a CPU it
runs too (``--quick`` for a smoke run) but says so: a CPU of a few cores is not bound by memory.

Measured in one process, on the GPT-2-small-shaped tree of ``bench_clip.py`` (124M float32
parameters in 148 leaves; the same gradients every step, the state donated):

1. Two ceilings: an in-place elementwise pass ``x * a + b`` over a 1 GiB float32 buffer (reads
   and writes it: 2 GiB moved) and a sum of squares over it (reads it: 1 GiB).
2. ``clip_by_global_norm`` (optclip, optax, and the streaming baseline: one read pass for the
   norm, one scale pass) and ``zclip``, alone and in ``chain(T, adam)``: time per step, the
   fewest bytes the step must move (alone: read the gradients twice, write the updates once;
   with adam: adam's 6 parameter-sized buffers plus the norm's read), and that over the time as
   a fraction of the measured elementwise ceiling and of the device's datasheet bandwidth.
3. With ``--all``: ``chain(T, adam) / adam`` per step for every transform of ``bench_clip.py``,
   next to its memory-traffic floor.

Each timing is one jitted call that runs ``--steps`` steps in a ``fori_loop`` (see
:class:`Looped`): medians over ``--rounds`` interleaved rounds. ``--conditionals JSON`` adds to
a results file the number of conditionals each step holds when lowered for CUDA (exact, from
the exported StableHLO, on any machine): XLA's GPU runtime copies a conditional's predicate to
the host and waits for the device before it launches the branch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import optax

import optclip

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_clip as bc  # noqa: E402

ROOT = bc.ROOT

# Datasheet memory bandwidth in bytes per second, by the start of JAX's device_kind.
DATASHEET = {
    "NVIDIA H100 80GB HBM3": 3.35e12,      # H100 SXM5
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100 NVL": 3.9e12,
    "NVIDIA H200": 4.8e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
}


def datasheet_bandwidth(kind: str) -> float | None:
    return next((bw for name, bw in DATASHEET.items() if kind.startswith(name)), None)


class Looped:
    """``steps`` steps of a jitted step function run as one ``fori_loop`` in one jitted call,
    the carry (state and output) donated, timed per step.

    The loop is how an optimizer runs inside a real training step: on the device, between the
    model's own kernels, with no dispatch of its own (a step dispatched from Python on 148
    leaves takes the host about as long as the device needs for it, so timing separate
    calls would measure the host). Every iteration scales the gradients by a number that
    changes with the iteration, so XLA cannot hoist their reductions out of the loop; the
    multiply fuses into the kernels that read them and moves no bytes.

    ``compiled`` is the loop's executable and compile time from :func:`compile_loops`;
    without it the loop is compiled here.
    """

    def __init__(self, body, carry, args, steps: int, compiled=None):
        if compiled is None:
            compiled = compile_loops({None: (body, lambda: carry, args)}, steps, workers=1)[None]
        self.call, self.compile_s = compiled
        self.carry, self.args, self.steps = carry, args, steps
        self.run()                                          # warm up

    def run(self) -> float:
        jax.block_until_ready(self.carry)
        start = time.perf_counter()
        self.carry = jax.block_until_ready(self.call(self.carry, *self.args))
        return (time.perf_counter() - start) / self.steps


def compile_loops(specs: dict, steps: int, workers: int) -> dict:
    """``{name: (executable, compile seconds)}`` of the :class:`Looped` loop of each
    ``name: (body, carry factory, args)``.

    Lowered one after another (tracing holds the GIL), compiled by ``workers`` threads at once
    (XLA's compiler releases it): most of a full ``--all`` run on a GPU host of many cores was
    the rows' compiles, one at a time. The seconds are each compile's own wall time, so with
    several workers they overlap.
    """
    def lowered(body, carry, args):
        def run(carry, *args):
            return jax.lax.fori_loop(0, steps, lambda i, c: body(i, c, *args), carry)
        return jax.jit(run, donate_argnums=0).lower(jax.eval_shape(carry), *args)

    def compiled(low):
        start = time.perf_counter()
        return low.compile(), time.perf_counter() - start

    lows = {name: lowered(*spec) for name, spec in specs.items()}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = {name: pool.submit(compiled, low) for name, low in lows.items()}
        return {name: future.result() for name, future in futures.items()}


def iteration_scale(i) -> jax.Array:
    return 1.0 + i.astype(jnp.float32) * 1e-7


def transform_loop(tx: optax.GradientTransformation, params, grads) -> tuple:
    """``(body, carry factory, args)`` of the loop that steps ``tx`` (see :class:`Looped`)."""
    def body(i, carry, grads, params):
        state, _ = carry
        scaled = jax.tree.map(lambda g: g * iteration_scale(i).astype(g.dtype), grads)
        updates, state = tx.update(scaled, state, params)
        return state, updates

    def carry():
        return (jax.tree.map(jnp.copy, tx.init(params)), jax.tree.map(jnp.zeros_like, grads))
    return body, carry, (grads, params)


def transform_steppers(txs: dict, params, grads, args) -> dict[str, Looped]:
    """A :class:`Looped` per ``name: transformation``, all compiled first, in parallel."""
    specs = {name: transform_loop(tx, params, grads) for name, tx in txs.items()}
    compiled = compile_loops(specs, args.steps, args.workers)
    return {name: Looped(body, carry(), loop_args, args.steps, compiled[name])
            for name, (body, carry, loop_args) in specs.items()}


def ceiling_steppers(n: int, steps: int) -> dict[str, Looped]:
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    reduce = lambda i, acc, x: acc + jnp.sum(jnp.square(x * iteration_scale(i)))
    elementwise = lambda i, x: x * 0.999 + 1e-3
    return {"sum of squares": Looped(reduce, jnp.zeros((), jnp.float32), (jnp.copy(x),), steps),
            "elementwise": Looped(elementwise, x, (), steps)}


def interleaved(steppers: dict[str, Looped], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, stepper in steppers.items():
            times[name].append(stepper.run())
    return {name: statistics.median(t) for name, t in times.items()}


def bandwidth_report(params, grads, args) -> dict:
    kind = jax.devices()[0].device_kind
    gbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(grads))
    n = (2**28 if not args.quick else 2**24)
    ceilings = ceiling_steppers(n, args.steps)
    ceiling_s = interleaved(ceilings, args.rounds)
    ceiling = {"elementwise": 2 * 4 * n / ceiling_s["elementwise"],
               "sum of squares": 4 * n / ceiling_s["sum of squares"]}
    del ceilings

    # (contender, transformation, parameter-sized buffers its step must move at least)
    contenders = {
        "streaming baseline": (bc.streaming_clip(1.0), 3),
        "optax.clip_by_global_norm": (optax.clip_by_global_norm(1.0), 3),
        "optclip.clip_by_global_norm": (optclip.clip_by_global_norm(1.0), 3),
        "optclip.zclip": (optclip.zclip(), 3),
        "adam": (optax.adam(1e-3), bc.ADAM_PASSES),
        "chain(optax.clip_by_global_norm, adam)": (
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), bc.ADAM_PASSES + 1),
        "chain(optclip.clip_by_global_norm, adam)": (
            optax.chain(optclip.clip_by_global_norm(1.0), optax.adam(1e-3)), bc.ADAM_PASSES + 1),
        "chain(optclip.zclip, adam)": (
            optax.chain(optclip.zclip(), optax.adam(1e-3)), bc.ADAM_PASSES + 1),
    }
    steppers = transform_steppers({name: tx for name, (tx, _) in contenders.items()},
                                  params, grads, args)
    seconds = interleaved(steppers, args.rounds)
    peak = datasheet_bandwidth(kind)
    rows = {}
    for name, (_, buffers) in contenders.items():
        moved = buffers * gbytes / seconds[name]
        rows[name] = {"ms": seconds[name] * 1e3,
                      "compile_s": steppers[name].compile_s,
                      "buffers": buffers, "bytes_per_s": moved,
                      "of_elementwise": moved / ceiling["elementwise"],
                      "of_datasheet": None if peak is None else moved / peak}
    return {"ceiling_bytes_per_s": ceiling, "ceiling_ms": {k: v * 1e3 for k, v in
                                                           ceiling_s.items()},
            "ceiling_bytes": {"elementwise": 8 * n, "sum of squares": 4 * n},
            "datasheet_bytes_per_s": peak, "gradient_bytes": gbytes, "contenders": rows}


def step_rows(params, grads, args, names, out_path, results) -> None:
    start = time.perf_counter()
    deadline = start + args.deadline
    adam_tx = optax.adam(1e-3)
    adam_state = bc.state_per_param_byte(adam_tx, params)
    txs = {name: bc.optimizer(bc.CASES[name]) for name in names}
    specs = {name: transform_loop(tx, params, grads) for name, tx in txs.items()}
    # adam under a key no row has (None), compiled with the rows.
    specs[None] = transform_loop(adam_tx, params, grads)
    compiled = compile_loops(specs, args.steps, args.workers)
    print(f"compiled {len(names) + 1} steps in {time.perf_counter() - start:.0f} s "
          f"({args.workers} at once)", flush=True)
    body, carry, loop_args = specs.pop(None)
    adam = Looped(body, carry(), loop_args, args.steps, compiled.pop(None))
    for name in names:
        if time.perf_counter() > deadline:
            results["config"]["stopped"] = f"deadline reached before {name}"
            break
        start = time.perf_counter()
        case = bc.CASES[name]
        state_ratio = bc.own_state_per_param_byte(case, params, adam_state)
        body, carry, loop_args = specs[name]
        chain = Looped(body, carry(), loop_args, args.steps, compiled.pop(name))
        seconds = interleaved({"adam": adam, "chain": chain}, args.rounds)
        row = {"name": name, "step_ratio": seconds["chain"] / seconds["adam"],
               "floor": bc.floor(case, state_ratio), "step_ms": seconds["chain"] * 1e3,
               "adam_step_ms": seconds["adam"] * 1e3,
               "compile_s": chain.compile_s}
        del chain
        results["transforms"].append(row)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"{name:20s} step {row['step_ratio']:.2f} (floor {row['floor']:.2f})  "
              f"{row['step_ms']:.3f} ms  compile "
              f"{row['compile_s']:.1f} s  [{time.perf_counter() - start:.0f} s]", flush=True)


def print_bandwidth(report: dict) -> None:
    c = report["ceiling_bytes_per_s"]
    sheet = report["datasheet_bytes_per_s"]
    print(f"ceilings: elementwise {c['elementwise'] / 1e9:.0f} GB/s, sum of squares "
          f"{c['sum of squares'] / 1e9:.0f} GB/s; datasheet "
          f"{bc._fmt(sheet and sheet / 1e9, '.0f')} GB/s")
    print(f"{'contender':42s} {'ms':>8s} {'GB/s':>7s} {'of elem':>8s} "
          f"{'of sheet':>8s}")
    for name, r in report["contenders"].items():
        print(f"{name:42s} {r['ms']:8.3f} {r['bytes_per_s'] / 1e9:7.0f} "
              f"{r['of_elementwise']:8.2f} {bc._fmt(r['of_datasheet']):>8s}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tree and buffers (smoke run)")
    parser.add_argument("--all", action="store_true",
                        help="also chain(T, adam) / adam for every transform")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="with --all: these only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per round (one loop)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="bandwidth measurements (before and after the rows of --all)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="steps compiled at once (threads)")
    parser.add_argument("--deadline", type=float, default=1e9,
                        help="seconds after which --all measures no further transform")
    parser.add_argument("--conditionals", metavar="JSON",
                        help="only add each row's conditionals on CUDA to this results file")
    parser.add_argument("--json", default=bc.DEVICE_JSON)
    args = parser.parse_args(argv)
    bc.check_names(parser, args.only)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.conditionals:
        with open(args.conditionals) as f:
            results = json.load(f)
        for row in results["transforms"]:
            # The test suite's count (tests/hlo.py), on its tree of two large leaves and a small.
            row["conditionals"] = bc.hlo.gpu_conditionals(bc.optimizer(bc.CASES[row["name"]]),
                                                          bc.hlo.TREE)
        head = os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()
        results["conditionals_code"] = head
        with open(args.conditionals, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.conditionals}")
        return
    shapes = bc.gpt2_small_shapes(width=192 if args.quick else 768,
                                  vocab=50257 // (4 if args.quick else 1))
    params = bc.make_tree(shapes, seed=1)
    grads = bc.make_tree(shapes, seed=2, scale=1.0)
    count = sum(x.size for x in jax.tree.leaves(params))
    info = bc.machine()
    print(f"device: {info['device']}; {count / 1e6:.1f}M parameters in {len(shapes)} leaves\n")
    results = {"machine": info,
               "config": {"quick": args.quick, "rounds": args.rounds, "steps": args.steps,
                          "step_tree": f"{count / 1e6:.1f}M float32 parameters, "
                                       f"{len(shapes)} leaves",
                          "command": "python benchmarks/bench_device.py " + " ".join(
                              sys.argv[1:] if argv is None else argv)},
               "bandwidth": [], "transforms": []}
    for i in range(args.repeat):
        if i and args.all:
            step_rows(params, grads, args, args.only or list(bc.CASES), args.json, results)
        results["bandwidth"].append(bandwidth_report(params, grads, args))
        print_bandwidth(results["bandwidth"][-1])
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.all and args.repeat < 2:
        step_rows(params, grads, args, args.only or list(bc.CASES), args.json, results)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
