"""Global-norm clipping at the memory-bandwidth limit, and compile time on many leaves.

Run with ``make bench`` (or ``python benchmarks/bench_clip.py --quick`` for a small tree). Prints
ratio tables measured in one run, on whatever device JAX uses:

1. ``optclip.clip_by_global_norm`` vs ``optax.clip_by_global_norm`` vs a streaming baseline (one
   read pass for the norm, one in-place scale pass) on a GPT-2-small-shaped gradient tree
   (124M float32 parameters in 148 leaves), buffers donated;
2. ``chain(clip, adam)`` vs ``adam`` alone, for optclip and optax;
3. compile time of ``chain(optclip.clip_by_global_norm, adam)`` vs ``adam`` alone (and optax's
   chain) on a tree of 2000 small leaves.

Targets (issue 2): optclip <= 1.05x optax and <= 1.10x the streaming baseline; chain/adam <= 1.07;
compile time of the optclip chain <= 1.5x adam alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import optclip


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


def streaming_clip(max_norm: float):
    """The floor: one read pass for the sum of squares, one scale pass."""
    def update(grads, state, params=None):
        total = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
        factor = jnp.minimum(1.0, max_norm / jnp.sqrt(total))
        return jax.tree.map(lambda g: g * factor, grads), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def timed_steps(tx, params, grads, repeats):
    """Median seconds per ``update`` with the gradients and state donated."""
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=(0, 1))
    grads = jax.tree.map(jnp.copy, grads)
    for _ in range(2):                                   # compile and warm up
        grads, state = step(grads, state, params)
    jax.block_until_ready(grads)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        grads, state = step(grads, state, params)
        jax.block_until_ready((grads, state))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compile_seconds(tx, params):
    state = tx.init(params)
    start = time.perf_counter()
    jax.jit(tx.update).lower(params, state, params).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a GPT-2 tree 1/4 the width and 200 leaves for compile time")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compile-leaves", type=int, default=2000)
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()

    width = 192 if args.quick else 768
    shapes = gpt2_small_shapes(width=width, vocab=50257 // (4 if args.quick else 1))
    params = make_tree(shapes, seed=1)
    grads = make_tree(shapes, seed=2, scale=1.0)          # global norm >> 1: clipping is active
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"{len(shapes)} leaves, {count / 1e6:.1f}M float32 parameters\n")

    clippers = {
        "streaming baseline": streaming_clip(1.0),
        "optax.clip_by_global_norm": optax.clip_by_global_norm(1.0),
        "optclip.clip_by_global_norm": optclip.clip_by_global_norm(1.0),
    }
    chains = {
        "adam alone": optax.adam(1e-3),
        "optax chain(clip, adam)": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        "optclip chain(clip, adam)": optax.chain(optclip.clip_by_global_norm(1.0),
                                                 optax.adam(1e-3)),
    }
    # Interleave the rounds so that drifting machine load hits every contender alike.
    results: dict[str, list[float]] = {name: [] for name in {**clippers, **chains}}
    for _ in range(3):
        for name, tx in {**clippers, **chains}.items():
            results[name].append(timed_steps(tx, params, grads, args.repeats))
    best = {name: min(times) for name, times in results.items()}

    gib = count * 4 / 2**30
    print(f"{'clip step':34s} {'ms':>9s} {'GiB/s*':>8s} {'vs optax':>9s} {'vs stream':>10s}")
    for name in clippers:
        t = best[name]
        vs_optax = t / best["optax.clip_by_global_norm"]
        vs_stream = t / best["streaming baseline"]
        print(f"{name:34s} {t * 1e3:9.2f} {3 * gib / t:8.1f} {vs_optax:9.3f} {vs_stream:10.3f}")
    print("* counted as 3 passes over the gradients (read, read, write)\n")
    print(f"{'optimizer step':34s} {'ms':>9s} {'vs adam':>9s}")
    for name in chains:
        print(f"{name:34s} {best[name] * 1e3:9.2f} {best[name] / best['adam alone']:9.3f}")

    if not args.skip_compile:
        leaves = 200 if args.quick else args.compile_leaves
        many = {f"p{i}": jnp.ones((8, 8 + i % 7), jnp.float32) for i in range(leaves)}
        contenders = {
            "adam alone": optax.adam(1e-3),
            "optax chain(clip, adam)": optax.chain(optax.clip_by_global_norm(1.0),
                                                   optax.adam(1e-3)),
            "optclip chain(clip, adam)": optax.chain(optclip.clip_by_global_norm(1.0),
                                                     optax.adam(1e-3)),
        }
        seconds = {name: compile_seconds(tx, many) for name, tx in contenders.items()}
        print(f"\ncompile time, {leaves} leaves{'':12s} {'s':>9s} {'vs adam':>9s}")
        for name, s in seconds.items():
            print(f"{name:34s} {s:9.2f} {s / seconds['adam alone']:9.3f}")


if __name__ == "__main__":
    main()
