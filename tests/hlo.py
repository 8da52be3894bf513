"""Exact structural cost measures read from the optimized HLO of a jitted step (no timing).

``traffic`` counts the parameter-sized buffers a step reads and writes: on a tree of large
leaves of one size, every operand or result of an executed kernel (a fusion, a copy, a sort,
...) with at least as many elements as such a leaf is one pass over memory. On a large model a
step is bound by memory bandwidth, so its time is close to (passes) x (bytes of one buffer) /
bandwidth, and a kernel that re-reads the gradients or materialises a temporary shows up as
one more pass.

A ``conditional`` that returns parameter-sized arrays is a gate on the step itself (a wrapper
that runs or holds the optimizer): its dearest branch counts. One that returns only small
values computes a statistic on a rare path (a scale-safe norm recomputed with a rescaling
where the plain sum of squares overflowed or underflowed, a tie-break that only some rows
need): its cheapest branch counts, the one a typical step takes. The body of a ``while`` loop
counts once per iteration (XLA's known trip count; once when it is unknown).

Used by ``tests/test_step_traffic.py`` (the per-transform budget) and by ``make bench`` (the
passes column of the benchmark table).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import optax

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*?)\)(?:, (.*))?$")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLS = re.compile(r"(?:calls|to_apply|body)=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Opcodes that move no data: they name buffers (or parts of tuples) that already exist.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "copy-start",
         "copy-done", "after-all", "partition-id", "replica-id"}


# The counts are a property of one XLA: they were recorded with this jaxlib. Older XLA:CPU
# versions (the floor pins of `make test`) fuse reductions differently and write other
# temporaries out, so exact budgets hold only here.
RECORDED_JAXLIB = "0.10.2"


def recorded_xla() -> bool:
    """Whether this jaxlib is the one the exact pass counts were recorded with."""
    import jaxlib
    return jaxlib.__version__ == RECORDED_JAXLIB


# The tree the counts are made on: two leaves of one layer's size and shape (XLA shares a
# broadcast constant between the reductions of same-shape leaves only, and then writes it out:
# a real model has many such leaves) and a small one. Passes are counted per large leaf.
TREE = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32),
        "v": jax.ShapeDtypeStruct((256, 512), jnp.float32),
        "b": jax.ShapeDtypeStruct((512,), jnp.float32)}
LARGE = 2


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Parameter-sized buffers read and written by one step (``passes = reads + writes``)."""

    reads: int
    writes: int

    @property
    def passes(self) -> int:
        return self.reads + self.writes

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.reads + other.reads, self.writes + other.writes)

    def __mul__(self, times: int) -> Traffic:
        return Traffic(self.reads * times, self.writes * times)


def _large_arrays(shape: str, size: int) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) >= size
               for dims in _ARRAY.findall(shape))


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            bodies[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            bodies[current].append(line)
    return bodies, entry


def _traffic_of(name: str, bodies: dict[str, list[str]], size: int) -> Traffic:
    shapes: dict[str, str] = {}
    total = Traffic(0, 0)
    for line in bodies[name]:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        result, shape, opcode, operands, attributes = match.groups()
        shapes[result] = shape
        attributes = attributes or ""
        if opcode in _FREE:
            continue
        if opcode == "conditional":
            branches = _OPERAND.findall(_BRANCHES.search(attributes).group(1))
            pick = max if _large_arrays(shape, size) else min
            total += pick((_traffic_of(b, bodies, size) for b in branches),
                          key=lambda t: t.passes)
        elif opcode in ("call", "while"):
            body = _traffic_of(_CALLS.search(attributes).group(1), bodies, size)
            trips = _TRIPS.search(attributes) if opcode == "while" else None
            total += body * (int(trips.group(1)) if trips else 1)
        else:
            reads = sum(_large_arrays(shapes.get(o, ""), size)
                        for o in dict.fromkeys(_OPERAND.findall(operands)))
            total += Traffic(reads, _large_arrays(shape, size))
    return total


def compiled_step(tx: optax.GradientTransformation, tree):
    """``jit(tx.update)`` compiled for ``tree`` (gradients and state donated, the tree also
    passed as the parameters), as a training step runs it."""
    state = jax.eval_shape(tx.init, tree)
    return jax.jit(tx.update, donate_argnums=(0, 1)).lower(tree, state, tree).compile()


def traffic(tx: optax.GradientTransformation, tree) -> Traffic:
    """Parameter-sized reads and writes of ``jit(tx.update)`` (gradients and state donated, the
    tree also passed as the parameters) on ``tree``: buffers at least as large as its largest
    leaf count. Give the tree two or more leaves of that size and shape: XLA shares a broadcast
    constant between the reductions of same-shape leaves only, and then writes it out."""
    size = max(x.size for x in jax.tree.leaves(tree))
    text = compiled_step(tx, tree).as_text()
    bodies, entry = _computations(text)
    return _traffic_of(entry, bodies, size)


def kernels(text: str) -> int:
    """Kernels of the optimized HLO module ``text`` that XLA:CPU runs as thunks: the
    instructions of the entry computation that move data (not :data:`_FREE`), and those of
    every conditional branch and loop body, each counted once.

    XLA:CPU orders the thunks of each sequence (the entry, a branch, a loop body) by testing
    every new one against those before it for buffer conflicts, so the time it takes grows
    with the square of this count (on 1024 small leaves, a third of the compile time of a
    transform with 12 kernels per leaf against adam's 3). Exact and free of timing noise.
    """
    bodies, entry = _computations(text)

    def count(name: str) -> int:
        total = 0
        for line in bodies[name]:
            match = _INSTRUCTION.match(line)
            if not match or match.group(3) in _FREE:
                continue
            total += 1
            attributes = match.group(5) or ""
            if match.group(3) == "conditional":
                total += sum(count(b) for b in
                             _OPERAND.findall(_BRANCHES.search(attributes).group(1)))
            elif match.group(3) in ("call", "while"):
                total += count(_CALLS.search(attributes).group(1))
        return total

    return count(entry)


# Leaf shapes of the compile-cost measures; ``make bench`` compiles trees that repeat them.
SMALL_SHAPES = ((64, 32), (32,), (32, 64), (64,))


def small_tree(leaves: int) -> dict:
    """``leaves`` small float32 leaves of :data:`SMALL_SHAPES` in turn (shapes only)."""
    return {f"p{i:04d}": jax.ShapeDtypeStruct(SMALL_SHAPES[i % len(SMALL_SHAPES)], jnp.float32)
            for i in range(leaves)}


def _kernels_on(tx: optax.GradientTransformation, leaves: int) -> int:
    tree = small_tree(leaves)
    state = jax.eval_shape(tx.init, tree)
    return kernels(jax.jit(tx.update).lower(tree, state, tree).compile().as_text())


def extra_kernels_per_leaf(tx: optax.GradientTransformation, base: optax.GradientTransformation,
                           leaves: tuple[int, int] = (4, 16)) -> float:
    """Kernels (:func:`kernels`) each added leaf of :func:`small_tree` brings to ``tx``'s step
    beyond what it brings to ``base``'s, from trees of ``leaves`` leaves (the slope: what
    the tree's size does not change cancels)."""
    def slope(t: optax.GradientTransformation) -> float:
        return (_kernels_on(t, leaves[1]) - _kernels_on(t, leaves[0])) / (leaves[1] - leaves[0])

    return slope(tx) - slope(base)


def loop_writes(text: str, size: int, innermost: bool = False) -> list[str]:
    """The element types of the arrays of at least ``size`` elements that the kernels inside
    the ``while`` loops of the optimized HLO ``text`` write (once per loop body, not per
    iteration), e.g. ``['bf16', 'bf16']``; with ``innermost``, only in the loops whose body
    holds no loop."""
    bodies, _ = _computations(text)
    loops = [_CALLS.search(m.group(5) or "").group(1) for line in text.splitlines()
             if (m := _INSTRUCTION.match(line)) and m.group(3) == "while"]
    if innermost:
        loops = [body for body in loops if not any(
            (m := _INSTRUCTION.match(line)) and m.group(3) == "while" for line in bodies[body])]
    written = []
    for body in loops:
        for line in bodies[body]:
            match = _INSTRUCTION.match(line)
            if match and match.group(3) not in _FREE and _large_arrays(match.group(2), size):
                written += re.findall(r"\b([a-z]+\d*)\[", match.group(2))
    return written


def extra_passes(tx: optax.GradientTransformation, base: optax.GradientTransformation) -> float:
    """Passes per large leaf of :data:`TREE` that ``tx``'s step makes beyond ``base``'s."""
    return (traffic(tx, TREE).passes - traffic(base, TREE).passes) / LARGE


# ---------------------------------------------------------------------------------------------
# Conditionals on a GPU.

_CONDITIONAL = re.compile(r"\bstablehlo\.(?:if|case)\b")


def gpu_conditionals(tx: optax.GradientTransformation, tree) -> int:
    """Conditionals in ``jit(tx.update)`` (params passed) lowered for CUDA on ``tree``.

    Lowered on any machine (``jax.export``'s cross-platform lowering: no GPU needed); the
    platform choices of ``jax.lax.platform_dependent`` (a conditional on a constant index)
    are folded away by MLIR's canonicalizer, as XLA folds them, so what is counted is what the
    GPU runtime executes as a conditional: a copy of the predicate to the host and a wait for
    the device, every step.
    """
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir, passmanager

    state = jax.eval_shape(tx.init, tree)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    text = jax.export.export(step, platforms=["cuda"])(tree, state, tree).mlir_module()
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        passmanager.PassManager.parse("builtin.module(canonicalize)").run(module.operation)
        return len(_CONDITIONAL.findall(str(module)))
