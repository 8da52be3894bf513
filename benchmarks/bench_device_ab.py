"""A/B of two forms of optclip's step on an accelerator, in one process (``bench_device.py``'s
loops and tree).

``gates``: the gate that holds a wrapped adam's moments, an EMA or the previous update on a
rejected step (``optclip._core.stats.run_or_hold``), as a ``lax.cond`` against the select a GPU
step takes (``optclip._core.branch.rare``), for five transforms; ``chain(T, adam)`` over
``adam`` per step, and the kernels (fusions), copies and conditionals of each compiled step.
On a CPU or TPU both forms are the same conditional.

``grouping``: the variadic reduce that shares one kernel among same-shape small leaves
(``optclip._core.norms._may_group``) on and off, for ``clip_by_global_norm`` alone and in a
chain with adam, and ``zclip`` and ``clip_norm`` in the chain, next to optax's
``clip_by_global_norm``.

``stages`` (not yet run on a GPU): the same steps with the library's scale-safe sums of squares
against a candidate that finishes both sums of a leaf in one kernel
(:func:`_two_stage_partials`).

``ranking`` (not yet run on a GPU): ``top_q`` and ``l1q_normalize`` with the library's
bisection on the bits of ``|g|`` against three candidates: the same bisection with all leaves
in one loop, one that sorts each row (:func:`_sorted_mask`), and one that finds the cut
four bits a round in unrolled rounds and keeps the ties by a running count
(:func:`_radix_mask`).

    python benchmarks/bench_device_ab.py gates grouping stages ranking

writes ``benchmarks/results_device_ab.json``. The page quotes its figures in the GPU section
of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import optax

import optclip
from optclip._core import norms, slices, stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_clip as bc  # noqa: E402
import bench_device as bd  # noqa: E402

AB_JSON = os.path.join(bc.ROOT, "benchmarks", "results_device_ab.json")
RANKED = ["top_q", "l1q_normalize"]
GATED = ["skip_spikes", "clip_norm_by_ema", "clip_value_growth", "stable_adamw_clip",
         "spam_clip"]


def _counts(executable) -> dict:
    text = executable.as_text()
    return {"kernels": len(re.findall(r"^\s*\S+ = .*? fusion\(", text, re.M)),
            "copies": len(re.findall(r"^\s*\S+ = \S+ copy\(", text, re.M)),
            "conditionals": text.count(" conditional(")}


def _compiled(setup, base: dict, build: dict, forms: dict) -> tuple[dict, dict]:
    """Loop specs and executables of ``base`` (``{name: transformation factory}``) and of
    ``build`` in each of ``forms`` (``{form: (module, attribute, value) or None}``, named
    ``name/form``), each form traced with its attribute replaced."""
    def loops(build, patch):
        with mock.patch.object(*patch) if patch else contextlib.nullcontext():
            specs = {name: bd.transform_loop(make(), setup.params, setup.grads)
                     for name, make in build.items()}
            return specs, bd.compile_loops(specs, setup.args.steps, setup.args.workers)

    specs, compiled = loops(base, None)
    for form, patch in forms.items():
        more = loops({f"{n}/{form}": f for n, f in build.items()}, patch)
        specs.update(more[0])
        compiled.update(more[1])
    return specs, compiled


def _time(setup, groups: list[list[str]], specs: dict, compiled: dict) -> dict:
    """Each group timed in interleaved rounds, against its first entry."""
    out = {}
    for group in groups:
        loops = {name: bd.Looped(specs[name][0], specs[name][1](), specs[name][2],
                                 setup.args.steps, compiled[name]) for name in group}
        seconds = bd.interleaved(loops, setup.args.rounds)
        for name in group:
            counts = _counts(compiled[name][0])
            out[name] = {"ms": seconds[name] * 1e3, "over_first": seconds[name] / seconds[group[0]],
                         **counts}
            print(f"{name:36s} {seconds[name] * 1e3:8.3f} ms  x {group[0]} "
                  f"{out[name]['over_first']:.3f}  {counts}", flush=True)
        del loops
    return out


def _case_forms(setup, names: list[str], forms: dict) -> dict:
    """``chain(T, adam)`` of the registry's transforms ``names`` in each of ``forms``
    (``{form: patch or None}``), each transform's forms timed in one round with adam."""
    build = {name: (lambda name=name: bc.optimizer(bc.CASES[name])) for name in names}
    specs, compiled = _compiled(setup, {"adam": lambda: optax.adam(1e-3)}, build, forms)
    return _time(setup, [["adam", *[f"{n}/{form}" for form in forms]] for n in names],
                 specs, compiled)


def gates(setup) -> dict:
    # The conditional form: run_or_hold before the GPU form, one lax.cond (inside the jitted
    # loop its predicate is always traced).
    return _case_forms(setup, GATED, {"conditional": (stats, "run_or_hold", jax.lax.cond),
                                      "select": None})


def _norm_forms(setup, forms: dict) -> dict:
    """``clip_by_global_norm`` alone and in a chain with adam, and ``zclip`` and ``clip_norm``
    in the chain, in each of ``forms`` (``{form: patch or None}``), next to optax's
    ``clip_by_global_norm``."""
    def chain(tx):
        return lambda: optax.chain(tx(), optax.adam(1e-3))
    build = {"clip_by_global_norm": lambda: optclip.clip_by_global_norm(1.0),
             "chain(clip_by_global_norm, adam)": chain(lambda: optclip.clip_by_global_norm(1.0)),
             "chain(zclip, adam)": chain(optclip.zclip),
             "chain(clip_norm, adam)": chain(lambda: optclip.clip_norm(1.0))}
    specs, compiled = _compiled(setup, {
        "adam": lambda: optax.adam(1e-3),
        "optax.clip_by_global_norm": lambda: optax.clip_by_global_norm(1.0),
        "chain(optax.clip_by_global_norm, adam)": chain(lambda: optax.clip_by_global_norm(1.0))},
        build, forms)
    return _time(setup, [["optax.clip_by_global_norm",
                          *[f"clip_by_global_norm/{form}" for form in forms]],
                         ["adam", "chain(optax.clip_by_global_norm, adam)",
                          *[f"{n}/{form}" for n in list(build)[1:] for form in forms]]],
                 specs, compiled)


def grouping(setup) -> dict:
    return _norm_forms(setup, {"grouped": None,
                               "per leaf": (norms, "_may_group", lambda: False)})


def _two_stage_partials(leaves, build=None):
    """A candidate form of ``norms._square_partials`` for a GPU: each leaf's plain and scaled
    sums of squares from one variadic reduce over its last axis, then one variadic reduce of
    the two row vectors, so that one kernel finishes both sums. (XLA:GPU split the variadic
    reduce of a large leaf over all axes into one first stage with both partial sums and two
    single-result second stages: one more kernel per large leaf than optax's one sum.)"""
    del build

    def sums(x):
        wide = norms._wide(x)
        zero = jnp.zeros((), wide.dtype)
        squares = norms._squares(wide)
        if wide.ndim >= 2:
            rows = jax.lax.reduce(squares, (zero, zero), norms._add_pairs, (wide.ndim - 1,))
            squares = tuple(r.reshape(-1) for r in rows)
        return jax.lax.reduce(squares, (zero, zero), norms._add_pairs,
                              tuple(range(squares[0].ndim)))

    pairs = [sums(x) for x in leaves]
    return [p for p, _ in pairs], (lambda: [q for _, q in pairs]), False


def stages(setup) -> dict:
    return _norm_forms(setup, {"library": None,
                               "two-stage": (norms, "_square_partials", _two_stage_partials)})


def _row_masks(rows: list, ks: list, mask) -> list:
    """A candidate form of ``slices.top_k_masks``: ``mask(bits, k)`` of every array of rows
    (its magnitude bits, ``k`` an int32 scalar), no entry marked in a row of no entries."""
    return [jnp.zeros(r.shape, bool) if r.shape[-1] == 0
            else mask(slices.magnitude_bits(r), jnp.asarray(k, jnp.int32))
            for r, k in zip(rows, ks)]


def _sorted_mask(bits: jax.Array, k: jax.Array) -> jax.Array:
    """For a GPU: one stable sort of every row by descending magnitude (``lax.sort`` on the
    negated magnitude bits, carrying the index) instead of the bisection's 31 rounds of
    counts. The library's masks: the ``k`` largest ``|g|`` of each row, ties to the lowest
    index, NaN as the largest, and every zero where the ``k``-th largest is 0."""
    index = slices._row_index(bits)
    keys, order = jax.lax.sort((-bits, index), dimension=bits.ndim - 1, is_stable=True,
                               num_keys=1)
    at = jnp.broadcast_to(jnp.maximum(k - 1, 0), bits.shape[:-1] + (1,))
    kth = -jnp.take_along_axis(keys, at, axis=-1)
    last = jnp.where(kth == 0, bits.shape[-1] - 1, jnp.take_along_axis(order, at, axis=-1))
    return ((bits > kth) | ((bits == kth) & (index <= last))) & (k > 0)


def _radix_mask(bits: jax.Array, k: jax.Array) -> jax.Array:
    """For a GPU: the ``k``-th largest magnitude of every row digit by digit, four bits of
    ``|g|`` a round (8 rounds for float32, 16 for float64, unrolled: no loop, no
    conditional), each round one count per row of the entries at or above 15 candidates;
    then the ties at the cut kept by their running count along the row (a cumulative sum)
    instead of a second search in a ``lax.cond``. The bisection takes 31 rounds of one count
    each; a step bound by kernel launches takes about a quarter of them here. The library's
    masks."""
    kth = jnp.zeros(bits.shape[:-1] + (1,), bits.dtype)
    # The sign bit is clear: the digits cover the other bits, from the top.
    shift = 8 * bits.dtype.itemsize - 1
    while shift > 0:
        width = min(4, shift)
        shift -= width
        digits = jnp.arange(1, 1 << width, dtype=bits.dtype) << shift
        at_or_above = jnp.sum(bits[..., None, :] >= (kth + digits)[..., :, None], axis=-1,
                              dtype=jnp.int32)
        # Counts fall as the digit grows: the digit is how many candidates keep k entries.
        kth = kth + (jnp.sum(at_or_above >= k, axis=-1, keepdims=True,
                             dtype=bits.dtype) << shift)
    above, ties = bits > kth, bits == kth
    wanted = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    rank = jnp.cumsum(ties, axis=-1, dtype=jnp.int32)
    return (above | (ties & ((rank <= wanted) | (kth == 0)))) & (k > 0)


# The candidate forms of the top-q ranking (``slices.top_k_masks``); tests/test_bench_forms.py
# checks that each gives the library's masks.
RANKING_FORMS = {form: functools.partial(_row_masks, mask=mask)
                 for form, mask in (("sort", _sorted_mask), ("radix", _radix_mask))}


def ranking(setup) -> dict:
    # "one loop": the library's bisection with every leaf in one loop. The library ranks
    # leaves in groups of about a million entries, a loop each, for a CPU's caches; on a GPU
    # that is 74 loops (and tie-break conditionals) one after the other on GPT-2.
    return _case_forms(setup, RANKED, {
        "bisection": None, "one loop": (slices, "RANK_GROUP_ENTRIES", 1 << 62),
        **{form: (slices, "top_k_masks", masks) for form, masks in RANKING_FORMS.items()}})


EXPERIMENTS = {"gates": gates, "grouping": grouping, "stages": stages, "ranking": ranking}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="+", choices=sorted(EXPERIMENTS))
    parser.add_argument("--quick", action="store_true", help="small tree (smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--json", default=AB_JSON)
    args = parser.parse_args(argv)
    shapes = bc.gpt2_small_shapes(width=64 if args.quick else 768,
                                  vocab=1000 if args.quick else 50257)
    setup = argparse.Namespace(args=args, params=bc.make_tree(shapes, seed=1),
                               grads=bc.make_tree(shapes, seed=2, scale=1.0))
    results = {"machine": bc.machine(), "config": {
        "quick": args.quick, "rounds": args.rounds, "steps": args.steps,
        "command": "python benchmarks/bench_device_ab.py " + " ".join(
            sys.argv[1:] if argv is None else argv)}}
    for name in args.experiments:
        start = time.perf_counter()
        results[name] = EXPERIMENTS[name](setup)
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"wrote {args.json}")

if __name__ == "__main__":
    main()
