"""The diagnostics convention and :func:`optclip.stats`.

Every optclip state class that carries something worth logging is registered with
:func:`diagnostic`, naming the transform and the fields to report. :func:`stats` walks any optax
state (``optax.chain`` tuples, ``inject_hyperparams``, ``masked``, ``MultiSteps``,
``apply_if_finite``, flax ``nnx.Optimizer`` state) and returns flat scalar entries computed from
what the states already hold, so logging costs no extra pass over the gradients.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optclip._core import branch, checks, norms

_REGISTRY: dict[type, tuple[str, tuple[str, ...], frozenset[str]]] = {}


def diagnostic(name: str, fields: tuple[str, ...], per_leaf: tuple[str, ...] = ()):
    """Class decorator: register a state ``NamedTuple`` whose ``fields`` ``stats`` reports.

    A field whose value is a tree of per-leaf (or per-slice) values, or a vector of per-leaf
    values, is summarised, so the logged keys do not depend on the number of leaves; a field
    holding one 0-d array (a scalar, or the value of a parameter that is a single array) is
    reported as it is. One class thus serves a transform's per-leaf and global layouts alike.
    Fields named in ``per_leaf`` are always summarised, even for a single-array parameter.
    """
    def register(cls):
        missing = (set(fields) | set(per_leaf)) - set(cls._fields)
        if missing:
            raise TypeError(f"{cls.__name__} has no fields {sorted(missing)}")
        _REGISTRY[cls] = (name, tuple(fields), frozenset(per_leaf))
        return cls
    return register


def _is_scalar(value: Any) -> bool:
    """One 0-d array, not inside a container (a per-leaf tree, even of one leaf) nor a vector
    of per-leaf values (:mod:`optclip._core.leafvec`, even of one entry).

    A flax ``Variable`` (how ``nnx.Optimizer`` holds each array of its optax state) counts as
    the array it wraps, so the nnx optimizer's state reads exactly as the raw optax state.
    """
    structure = jax.tree.structure(value, is_leaf=lambda x: checks.is_flax(x, "Variable"))
    leaves = jax.tree.leaves(value)
    one_leaf = jax.tree_util.treedef_is_leaf(structure) and len(leaves) == 1
    return one_leaf and jnp.ndim(leaves[0]) == 0


def _summarise(key: str, value: Any, per_leaf: bool) -> dict[str, jax.Array]:
    """``{key: value}`` for a scalar; ``key_max``/``key_mean`` (numbers) or ``key_frac``
    (flags) for a tree of per-leaf values, or for any field when ``per_leaf``."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(value)]
    leaves = [x for x in leaves if x.size > 0]
    if not leaves:
        return {}
    if not per_leaf and _is_scalar(value):
        return {key: leaves[0].reshape(())}
    count = sum(x.size for x in leaves)
    if all(x.dtype == jnp.bool_ for x in leaves):
        hits = sum(jnp.sum(x, dtype=jnp.int32) for x in leaves)
        return {f"{key}_frac": hits.astype(jnp.float32) / count}
    # The mean sums each value already divided by the count: a sum of finite values near
    # float32's largest would overflow to inf before the division.
    return {f"{key}_max": jnp.max(jnp.stack([jnp.max(x).astype(jnp.float32) for x in leaves])),
            f"{key}_mean": sum(jnp.sum(x.astype(jnp.float32) / count) for x in leaves)}


def stats(opt_state: Any) -> dict[str, jax.Array]:
    """Flat, loggable scalars from every optclip transform found in ``opt_state``.

    Keys are ``"<transform>/<field>"``; a transform used twice gets ``"<transform>_1/..."``
    for its second occurrence (in pytree order, a wrapper before what it wraps: the optimizer
    inside ``skip_spikes`` or ``spam_clip``, ``hist_clip``'s warm-up transform). Per-leaf or
    per-slice values (a tree of them, even of one leaf, or a vector with one entry per
    floating leaf) are summarised as ``<field>_max`` and ``<field>_mean`` (numbers) or
    ``<field>_frac`` (flags: the fraction set); the full values stay in the state
    (:func:`optclip.per_leaf` gives a vector back as a tree). A scalar is reported as it is
    (so is the per-slice value of a parameter that is a single array with one slice, except
    for fields a transform always summarises). Pure and traceable: call it inside
    ``jax.jit``. A flax ``nnx.Optimizer`` is read through its
    ``opt_state``; ``nnx.state(optimizer)`` has lost the state types and raises ``TypeError``.

    Example:
        >>> import jax.numpy as jnp, optax, optclip
        >>> tx = optax.chain(optclip.clip_by_global_norm(1.0), optax.adam(1e-3))
        >>> params = {"w": jnp.ones(4)}
        >>> state = tx.init(params)
        >>> _, state = tx.update({"w": jnp.full(4, 2.0)}, state, params)
        >>> s = optclip.stats(state)
        >>> float(s["clip_by_global_norm/norm"]), bool(s["clip_by_global_norm/clipped"])
        (4.0, True)
    """
    if checks.is_flax(opt_state, "Optimizer"):  # a flax nnx.Optimizer: read its optax state
        opt_state = opt_state.opt_state
    found = list(_registered(opt_state))
    if checks.is_flax(opt_state, "State") and not found:
        raise TypeError(
            "optclip.stats got a flax nnx.State (such as nnx.state(optimizer)), which keeps the "
            "arrays but not the optax state types that identify each transform; pass the "
            "optimizer's optax state, optimizer.opt_state, or the nnx.Optimizer itself")
    out: dict[str, jax.Array] = {}
    seen: collections.Counter[str] = collections.Counter()
    for state in found:
        name, fields, per_leaf = _REGISTRY[type(state)]
        prefix = name if seen[name] == 0 else f"{name}_{seen[name]}"
        seen[name] += 1
        for field in fields:
            out.update(_summarise(f"{prefix}/{field}", getattr(state, field), field in per_leaf))
    return out


def _registered(tree: Any) -> Iterator[Any]:
    """The states of optclip transforms in ``tree``, in pytree order, each followed by those
    nested in it (the state of the optimizer ``skip_spikes`` or ``spam_clip`` wraps, of
    ``hist_clip``'s warm-up transform)."""
    for node in jax.tree.leaves(tree, is_leaf=lambda x: type(x) in _REGISTRY):
        if type(node) in _REGISTRY:
            yield node
            reported = _REGISTRY[type(node)][1]
            yield from _registered([getattr(node, f) for f in node._fields if f not in reported])


def keep_finite(new: Any, old: Any) -> Any:
    """Per element: ``new`` where it is finite, else ``old`` (non-finite never enters state)."""
    return jax.tree.map(lambda n, o: jnp.where(jnp.isfinite(n), n, o), new, old)


def nan_marks(x: jax.Array) -> jax.Array:
    """``x - x``: 0 at every finite element, NaN at NaN and ±Inf.

    Summed, it is 0 exactly when all elements are finite, and never overflows. XLA:CPU runs
    that sum in its fast reduction kernel, which reads ``x`` once (a ``jnp.isfinite`` mask is
    first written out as an array, about 3x slower; its fast maximum may skip NaN, so
    finiteness is never read off a maximum). No constant takes part: ``x * 0`` broadcasts a
    zero that XLA shares between the reductions of same-shape leaves, and a shared operand is
    written out as a leaf-sized array and read by each of them.
    """
    return x - x


def leaf_finite(x: jax.Array) -> jax.Array:
    """Scalar bool: every element of the floating array ``x`` is finite (``sum`` of
    :func:`nan_marks` is 0)."""
    return jnp.sum(nan_marks(x)) == 0


def all_finite(tree: Any, axis_name: norms.AxisName = None) -> jax.Array:
    """Scalar bool: every element of every floating leaf of ``tree`` is finite.

    One-element leaves (per-leaf statistics) are tested together on one vector; larger leaves
    each give ``sum(x - x)`` (:func:`leaf_finite`), small leaves of one shape from one shared
    variadic reduce (:func:`optclip._core.norms.leaf_reductions`). With ``axis_name`` (inside
    ``shard_map``/``pmap``) on every device along those mesh axes, so a step is committed or
    skipped everywhere alike. The floating leaves are those of
    :func:`optclip._core.norms.float_leaves` (arrays; a transform's ``update`` has already made
    Python-float leaves 0-d arrays).
    """
    leaves = norms.float_leaves(tree)
    arrays = [x for x in leaves if x.size != 1]
    values = [x.reshape(()) for x in leaves if x.size == 1] + norms.leaf_reductions(
        arrays, nan_marks)
    if not values:
        return norms.all_true(jnp.asarray(True), axis_name)
    # One dtype for the vector, upcast explicitly (exact, so a value stays finite or not):
    # 8-bit floats have no implicit promotion, and a list may mix them with float32 values.
    wide = jnp.result_type(*{norms.acc_dtype(v.dtype) for v in values})
    local = jnp.all(jnp.isfinite(norms.gather_scalars([v.astype(wide) for v in values])))
    return norms.all_true(local, axis_name)


def all_of(flags: list[jax.Array], axis_name: norms.AxisName = None) -> jax.Array:
    """Scalar bool: every per-leaf flag holds (on every device along ``axis_name``)."""
    local = jnp.all(norms.gather_scalars(flags)) if flags else jnp.asarray(True)
    return norms.all_true(local, axis_name)


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """Whole-step gate: ``new`` where the scalar ``ok`` holds, else ``old``, leaf by leaf.

    For states whose statistics belong together (an EMA and its norm, a reference update): a
    non-finite step leaves all of them as they were, so the next step continues as if the bad
    one had not happened.
    """
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _zero_from(x: jax.Array) -> jax.Array:
    """``+0`` everywhere, computed from ``x`` so that it is sharded like ``x``.

    ``jnp.zeros_like`` under ``jax.jit`` on an automatic-axes mesh comes out replicated (the
    zeros depend on nothing, so the partitioner has nothing to follow); a value computed from
    ``x`` inherits ``x``'s sharding there, and its sharding type under an explicit mesh.
    ``|x| * 0`` on finite entries (NaN/Inf in ``x`` never reach the state).
    """
    # Cast back: |x| of a complex leaf is real, and the dtype must reach the transform's checks.
    return (jnp.where(jnp.isfinite(x), jnp.abs(x), 0) * 0).astype(x.dtype)


def zeros_like_params(measure: Any, params: Any) -> Any:
    """State built with the parameters' shardings: zeros (``False`` for bools) shaped like
    ``measure(params)`` and sharded as ``measure`` would shard its result on ``params``.

    ``measure`` maps a params-like tree to the tree the state holds (per element, per slice or
    per leaf; ``None`` leaves stay ``None``); it runs once, at ``init``, on zeros sharded like
    the parameters. So ``init`` returns the sharding (and sharding type) that ``update``
    returns: no second compilation, and ``lax.scan`` accepts the state as a carry.
    """
    zeros = jax.tree.map(lambda x: _zero_from(x) if norms.is_float(x) else x, params)
    measured = measure(zeros)
    return jax.tree.map(
        lambda v: _zero_from(v.astype(jnp.float32)) > 0 if v.dtype == jnp.bool_
        else _zero_from(v), measured)


def step_count(count: jax.Array, finite: jax.Array) -> jax.Array:
    """``count + 1`` after a finite step; a non-finite one leaves a schedule's clock alone."""
    return jnp.where(finite, optax.safe_increment(count), count)


def count_nonfinite(nonfinite: jax.Array, finite: jax.Array) -> jax.Array:
    """The ``nonfinite`` counter after a step whose updates were ``finite`` (a scalar bool)."""
    return tally(nonfinite, ~finite)


def tally(counter: jax.Array, added: jax.Array) -> jax.Array:
    """``counter + added`` for an int32 ``counter`` and a non-negative ``added`` (a bool counts
    1), saturating at the int32 maximum as ``optax.safe_increment`` does: a counter never
    wraps to a negative number."""
    added = jnp.asarray(added).astype(counter.dtype)
    return counter + jnp.minimum(added, jnp.iinfo(counter.dtype).max - counter)


def commit(finite: jax.Array, new: Any, old: Any) -> Any:
    """The one state commit after a step: ``new`` if the step was ``finite`` (a scalar bool),
    else ``old`` as it was, with its ``nonfinite`` counter (when the state has one) counting the
    skipped step.

    Every stateful transform ends its ``update`` here, so a NaN/Inf step never enters running
    statistics, and a ``count`` advanced in ``new`` (a schedule's clock) stays where it was.
    """
    kept = keep_if(finite, new, old)
    if hasattr(old, "nonfinite"):
        kept = kept._replace(nonfinite=count_nonfinite(old.nonfinite, finite))
    return kept


def own_buffers(state: Any) -> Any:
    """``state`` with every array leaf its own object (repeated objects copied).

    ``jax.jit(step, donate_argnums=...)`` with the optimizer state donated refuses a state in
    which one array object fills several fields ("Attempt to donate the same buffer twice"),
    which an ``init`` building two fields from one zero array would produce.
    """
    seen: set[int] = set()

    def own(x):
        if id(x) in seen:
            return jnp.array(x, copy=True)
        seen.add(id(x))
        return x

    return jax.tree.map(own, state)


def run_or_hold(ok: jax.Array, run: Callable[[], Any], hold: Callable[[], Any]) -> Any:
    """``run()`` where the scalar ``ok`` holds, else ``hold()``: a step-wide gate on a wrapped
    optimizer's whole state.

    On CPUs and TPUs one ``lax.cond`` on the scalar: the taken branch alone runs, so ``run``
    updates the state in place and ``hold`` (the rare case) returns it untouched, with no pass
    over the state (as an elementwise select, XLA:CPU copied the donated state every step). On
    GPUs a select per leaf (:func:`optclip._core.branch.rare`): a conditional there stops the
    host every step, and XLA:GPU passed every state buffer into and out of the conditional
    through copies (on an H100, ``skip_spikes(adam)`` on a 148-leaf tree: 1.93x adam's step
    with the conditional, 1.45x with the select, which XLA fuses into the update's kernels).
    Under ``jax.vmap`` the cond becomes a select too. Called eagerly, the chosen branch runs op
    by op, bit for bit as it would alone.
    """
    if isinstance(ok, jax.core.Tracer):
        return branch.rare(ok, run, hold)
    return run() if bool(ok) else hold()


def filled_like(shapes: Any, like: Any, value: float) -> Any:
    """``value`` in every entry of trees shaped as ``shapes`` (``jax.eval_shape`` output), built
    from the matching leaves of ``like`` where their shapes agree, so that the result carries
    their shardings (and, inside ``shard_map``, their varying-axes type): the stand-in output of
    a branch that did not run an update must have the type of the one that did."""
    def fill(s, x):
        if jnp.shape(x) == s.shape:
            return jnp.full_like(x, value, dtype=s.dtype)
        return jnp.full(s.shape, value, s.dtype)

    return jax.tree.map(fill, shapes, like)


def cast_like(shapes: Any, tree: Any) -> Any:
    """``tree`` with each leaf in the dtype of the matching entry of ``shapes`` (a state held
    as it was must have the types of the state an update returns: optax's adam keeps integer
    moments for integer parameters at ``init`` and floating ones after a step)."""
    return jax.tree.map(lambda s, x: x if jnp.result_type(x) == s.dtype else
                        jnp.asarray(x).astype(s.dtype), shapes, tree)


def after(flag: jax.Array, tree: Any) -> Any:
    """``tree`` (floating arrays) unchanged, but computed after the scalar ``flag``.

    A check whose result only feeds the state (the finiteness of the updates) is otherwise
    unordered with the computation of the updates; with donated buffers XLA then copies each
    updates leaf the check reads before writing the output into it (a full extra read and write
    per leaf). Subtracting ``0 * flag`` makes every value that depends on ``tree`` wait for
    ``flag``; it is exact for every value (``x - 0`` keeps ``x``, signed zeros, NaN and Inf).
    """
    zero = jnp.asarray(flag).astype(jnp.float32) * 0
    return jax.tree.map(lambda x: x - zero.astype(jnp.result_type(x)), tree)
