"""Hyperparameter validation and "float or schedule" resolution.

Every public factory validates its hyperparameters here, at construction time, so a bad value
fails with a message naming the parameter and the allowed range instead of a trace-time error.

A concrete 0-d array (``jnp.array(-1.0)``, a numpy scalar array) is read on the host at
construction and validated like the float it holds. Traced values (the hyperparameters that
``optax.inject_hyperparams`` passes in under ``jax.jit``) and schedules (callables) cannot be
checked without a host sync; they are accepted as they are.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Schedule = Callable[[jax.Array], Any]
ScalarOrSchedule = float | jax.Array | Schedule


def _is_checkable_number(value: Any) -> bool:
    return isinstance(value, (numbers.Real, np.generic)) and not isinstance(value, bool)


def _check_number(name: str, value: Any, allow_schedule: bool) -> bool:
    """Raises TypeError for non-numbers; returns whether ``value`` is a concrete number."""
    if allow_schedule and callable(value):
        return False
    if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, np.generic):
        if np.ndim(value) != 0:
            raise TypeError(f"{name} must be a scalar, got an array of shape {np.shape(value)}")
        if isinstance(value, jax.core.Tracer):
            return False
        if not jnp.issubdtype(value.dtype, jnp.number) or jnp.issubdtype(
                value.dtype, jnp.complexfloating):
            raise TypeError(f"{name} must be a real number, got an array of dtype {value.dtype}")
        return True
    if not _is_checkable_number(value):
        kind = "a number or a schedule (count -> value)" if allow_schedule else "a number"
        raise TypeError(f"{name} must be {kind}, got {value!r} of type {type(value).__name__}")
    return True


def _at_start(name: str, schedule: Schedule) -> Any:
    """``schedule``'s value at step 0, which a transform built with it is checked against, or
    ``None`` where that is not a number known now.

    Evaluated once, eagerly, with the step count the state keeps (an int32 scalar). Only the
    first step is checked: a schedule may leave the range after the steps a run takes. A
    schedule that cannot run here (one that reads a mesh axis, say, and only works inside
    ``shard_map``) is left to its run, where ``resolve`` meets it.
    """
    try:
        value = schedule(jnp.zeros([], jnp.int32))
    except Exception:  # checked where it runs instead
        return None
    if isinstance(value, jax.core.Tracer):
        return None
    _require_scalar(name, value, True, " at step 0")
    return value


def _require_scalar(name: str, value: Any, scheduled: bool, when: str = "") -> None:
    """A hyperparameter's value must be a scalar: an array would broadcast against the
    leaves or change the shapes of the state."""
    if np.ndim(value) != 0:
        source = "its schedule returned" if scheduled else "got"
        raise TypeError(f"{name} must be a scalar, but {source} an array of shape "
                        f"{np.shape(value)}{when}")


def in_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_schedule: bool = False,
    allow_none: bool = False,
    finite: bool = False,
) -> Any:
    """Check that ``value`` lies in the interval given by ``low``/``high`` (and, with
    ``finite``, is not infinite: a value that would turn finite gradients into non-finite
    outputs, or a stabilizer such as ``eps``). With ``allow_schedule``, a schedule's value at
    step 0 is checked (:func:`_at_start`).

    Returns the number checked (a schedule's value at step 0), or ``None`` where there is none
    known now (``None`` itself, a traced value, a schedule not evaluable here)."""
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a number, got None")
    source = ""
    if allow_schedule and callable(value):
        value = _at_start(name, value)
        if value is None:
            return None
        source = " from its schedule at step 0"
    if not _check_number(name, value, allow_schedule and not source):
        return None
    v = float(np.asarray(value))
    if np.isnan(v) and low is None and high is None:
        raise ValueError(f"{name} must be a number, got nan{source}")
    lo_ok = low is None or (v >= low if low_inclusive else v > low)
    hi_ok = high is None or (v <= high if high_inclusive else v < high)
    if lo_ok and hi_ok and not np.isnan(v) and not (finite and np.isinf(v)):
        return value
    parts = []
    if low is not None:
        parts.append(f"{'>=' if low_inclusive else '>'} {low:g}")
    if high is not None:
        parts.append(f"{'<=' if high_inclusive else '<'} {high:g}")
    if finite:
        parts.append("finite")
    raise ValueError(f"{name} must be {' and '.join(parts) or 'a number'}, got {v!r}{source}")


def _hyper_dtype() -> np.dtype:
    """The dtype hyperparameters are resolved in: float32, float64 under x64."""
    return np.dtype(np.float64 if jax.config.jax_enable_x64 else np.float32)


def smallest_positive() -> float:
    """The smallest positive value a threshold may take: the smallest normal number of the
    statistics dtype (float32's; float64's under x64). Below it a value rounds to a subnormal,
    which XLA flushes to zero in many kernels, or to 0 itself: a positive ``eps``, bound or
    width of ``1e-40`` would divide by zero in float32."""
    return float(np.finfo(_hyper_dtype()).tiny)


def positive(name: str, value: Any, *, allow_schedule: bool = False, allow_none: bool = False,
             finite: bool = False):
    """``value > 0``, in fact at least :func:`smallest_positive` (or a schedule / traced value
    when allowed); ``finite``: as in :func:`in_range`."""
    start = in_range(name, value, 0.0, low_inclusive=False, allow_schedule=allow_schedule,
                     allow_none=allow_none, finite=finite)
    if start is not None and (v := float(np.asarray(start))) < smallest_positive():
        source = " from its schedule at step 0" if callable(value) else ""
        raise ValueError(f"{name} must be at least {smallest_positive():.3g} "
                         f"({_hyper_dtype().name}'s smallest normal number), got {v!r}{source}")


def non_negative(name: str, value: Any, *, allow_schedule: bool = False, allow_none: bool = False,
                 finite: bool = False):
    """``value >= 0`` (or a schedule / traced value when allowed); ``finite``: as in
    :func:`in_range`."""
    in_range(name, value, 0.0, allow_schedule=allow_schedule, allow_none=allow_none,
             finite=finite)


def static(name: str, value: Any) -> None:
    """Static configuration (axes, ord, sizes, flags) cannot be an array or a tracer.

    ``optax.inject_hyperparams`` turns every numeric argument, defaults included, into an array;
    the configuration must then be listed in its ``static_args``.
    """
    if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, np.generic):
        raise TypeError(
            f"{name} is static configuration and cannot be an array; with "
            f"optax.inject_hyperparams list it in static_args, e.g. static_args=({name!r},)")


def integer(name: str, value: Any, low: int | None = None, *, allow_none: bool = False) -> None:
    """``value`` is a Python int (not bool) and ``>= low``."""
    if value is None and allow_none:
        return
    static(name, value)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


def one_of(name: str, value: Any, options: Sequence[Any]) -> None:
    """``value`` is one of ``options``."""
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")


def boolean(name: str, value: Any) -> None:
    static(name, value)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def resolve(value: ScalarOrSchedule, count: jax.Array, dtype=None, *, name: str) -> jax.Array:
    """The value of the float-or-schedule hyperparameter ``name`` at step ``count``.

    ``dtype`` defaults to the statistics dtype (float32; float64 under x64), so a float64 leaf
    compares against a float64 threshold, not one rounded through float32. A schedule (or an
    array that ``optax.inject_hyperparams`` hands in) must give a scalar: anything else is a
    ``TypeError`` naming the parameter, raised while tracing (it would otherwise broadcast
    against the leaves, or change the shape of the state).
    """
    scheduled = callable(value)
    if scheduled:
        value = value(count)
    _require_scalar(name, value, scheduled)
    return jnp.asarray(value, dtype=_hyper_dtype() if dtype is None else dtype)


def is_concrete_number(value: Any) -> bool:
    """Whether ``value`` is a number known at construction (not a schedule or traced array)."""
    if isinstance(value, jax.core.Tracer) or callable(value) or value is None:
        return False
    return np.ndim(value) == 0 and isinstance(np.asarray(value).item(), (int, float))


def arrays(tree: Any) -> Any:
    """``tree`` with Python-float leaves as 0-d arrays (convention 11: clipped like them).

    Python ints and bools, like integer arrays, are left as they are (they pass through).
    """
    return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, float) else x, tree)


def on_device(tree: Any) -> Any:
    """``tree`` with NumPy leaves as JAX arrays (the others as they are).

    A state read back from a checkpoint without jax (flax msgpack, pickle after
    ``jax.device_get``) holds NumPy arrays; a step called outside ``jax.jit`` then gets them
    as they are, and the state updates that write into an array (``x.at[i].set(v)``) need a
    JAX array. Under ``jax.jit`` the leaves are tracers already: nothing changes.
    """
    return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic))
                        else x, tree)


def params_like(updates: Any, params: Any, name: str) -> None:
    """Trace-time check that ``params`` has the tree structure of ``updates`` and, where an
    update is an array, a leaf of its shape: an error naming the transform and the leaf,
    where a mismatched tree would otherwise fail deep inside the step or, broadcast, give a
    silent wrong answer."""
    mismatch = _params_mismatch(updates, params)
    if mismatch:
        raise ValueError(f"{name}: {mismatch}")


def _params_mismatch(updates: Any, params: Any) -> str:
    """What makes ``params`` not pair with ``updates`` (:func:`params_like`), or ``""``."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    try:
        paired = treedef.flatten_up_to(params)
    except (ValueError, TypeError) as error:
        return f"params must have the tree structure of the updates ({error})"
    for (path, u), p in zip(leaves, paired):
        if hasattr(u, "shape") and np.shape(p) != np.shape(u):
            return (f"params{jax.tree_util.keystr(path)} has shape {np.shape(p)}, its "
                    f"update {np.shape(u)}: pass the parameters the updates are for")
    return ""


def transformation(init_fn: Callable[[Any], Any], update_fn: Callable[..., Any], *,
                   extra_args: bool = False, pairs_leaves: bool = False,
                   state_follows_params: bool = False) -> optax.GradientTransformation:
    """The ``optax.GradientTransformation`` of ``init_fn``/``update_fn``, with the tree contract.

    Every transform is built here, so all of them: see Python-float leaves as 0-d arrays
    (:func:`arrays`), take a state of NumPy arrays outside ``jax.jit`` (:func:`on_device`),
    and refuse an ``update`` on a tree that does not match the one ``init``
    was given (:func:`matches_init`, a trace-time check naming the leaf).

    ``pairs_leaves=True`` for a transform whose state pairs values with leaves by position
    (per-leaf vectors, :mod:`optclip._core.leafvec`): its state's shapes do not show which leaf
    changed, or a leaf renamed, so ``update`` also compares the updates' leaf paths with those
    of the trees this transformation's ``init`` was given (when it was given any).

    ``state_follows_params=True`` for a transform that sizes its state by the parameters' dtypes
    (a projection keeps nothing for an integer parameter, whatever update the optimizer before
    it gives that leaf): ``update`` then compares ``params`` with the trees ``init`` was given
    when they pair with the updates leaf for leaf (else the updates, and the transform's own
    check names the mismatch).

    With ``extra_args=True`` the result is an ``optax.GradientTransformationExtraArgs`` whose
    ``update(updates, state, params=None, **extra_args)`` forwards the keyword arguments to
    ``update_fn`` unchanged (the wrappers pass them on to the optimizer they wrap).
    """
    # Tree signature -> the state signature init gave it: update then compares without
    # tracing init again (eval_shape is the fallback for a tree init has not seen).
    built: dict = {}

    def init(params):
        params = arrays(params)
        state = init_fn(params)
        try:
            built[_signature(params)] = _state_signature(state)
        except TypeError:   # an unhashable leaf: fall back to tracing init in update
            pass
        return state

    def update(updates, state, params=None, **extra):
        updates = arrays(updates)
        state = on_device(state)
        params = None if params is None else arrays(params)
        like = (params if state_follows_params and params is not None
                and not _params_mismatch(updates, params) else updates)
        matches_init(init_fn, like, state, built, pairs_leaves)
        return update_fn(updates, state, params, **extra)

    if extra_args:
        return optax.GradientTransformationExtraArgs(init, update)
    return optax.GradientTransformation(init, update)


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves)


def _state_signature(state: Any) -> dict[str, tuple[int, ...]]:
    """State leaf path -> shape."""
    return {jax.tree_util.keystr(path): tuple(np.shape(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def matches_init(init_fn: Callable[[Any], Any], updates: Any, state: Any,
                 built: dict | None = None, pairs_leaves: bool = False) -> None:
    """Trace-time check that ``state`` is what ``init`` builds for a tree like ``updates``.

    Convention 10: ``update`` on a tree whose structure or leaf shapes differ from the one
    ``init`` was given is an error naming the leaf, never a broadcast or a silent re-pairing
    of per-leaf state. Shapes are static, so this costs nothing at run time; it is exact under
    ``jax.vmap`` (both sides see per-example shapes) and with ``optax.masked``'s
    ``MaskedNode`` leaves (they have no arrays on either side). ``built`` maps the signatures
    of the trees ``init`` was given to their states'; with ``pairs_leaves`` the updates' leaf
    paths must also be those of one of these trees.
    """
    want = None
    if built is not None:
        try:
            want = built.get(_signature(updates))
        except TypeError:
            want = None
    if want is None:
        want = _state_signature(jax.eval_shape(init_fn, updates))
    have = _state_signature(state)
    if want.keys() != have.keys():
        new = sorted(want.keys() - have.keys())
        missing = sorted(have.keys() - want.keys())
        raise ValueError(
            "update got a tree that does not match the one init was given (state leaves "
            f"the updates would need but the state lacks: {new or 'none'}; state leaves with "
            f"no matching update: {missing or 'none'}){_changed_leaves(updates, built, have)}")
    for key, shape in want.items():
        if have[key] != shape:
            raise ValueError(
                f"update got a leaf whose shape differs from the one init was given: state "
                f"{key} has shape {have[key]}, the updates need {shape}"
                f"{_changed_leaves(updates, built, have)}")
    if pairs_leaves and built:
        paths = _leaf_paths(updates)
        if all(_leaf_paths_of(signature) != paths for signature in built):
            raise ValueError(
                "update got a tree whose leaves are not those init was given (this state "
                "pairs per-leaf values with leaves by position)"
                f"{_changed_leaves(updates, built, have)}")


def _leaf_paths(tree: Any) -> tuple[str, ...]:
    """The leaf paths of ``tree``, a flax ``Variable`` read as the array it wraps (flax's
    ``nnx.Optimizer`` calls ``init`` on the parameters' variables and ``update`` on arrays)."""
    return tuple(jax.tree_util.keystr(path) for path, _ in
                 jax.tree_util.tree_flatten_with_path(
                     tree, is_leaf=lambda x: is_flax(x, "Variable"))[0])


def is_flax(obj: Any, name: str) -> bool:
    """Whether ``obj`` is an instance of a flax class called ``name`` (flax is not imported)."""
    return any(c.__name__ == name and c.__module__.startswith("flax.")
               for c in type(obj).__mro__)


def _leaf_paths_of(signature: tuple) -> tuple[str, ...]:
    treedef, _ = signature
    return _leaf_paths(jax.tree.unflatten(treedef, range(treedef.num_leaves)))


def _changed_leaves(updates: Any, built: dict | None, have: dict) -> str:
    """`` (leaves ...)`` naming the leaves of ``updates`` that differ from those of a tree
    ``init`` was given (the one whose state is ``have``, else the closest), and what to do.

    The advice is to call ``init`` on the new tree, unless the only change is a leaf of the
    same shape that is floating-point on one side and not on the other: an optimizer before
    this transform (``optax.adam``) gives an integer parameter a floating-point update, and the
    state ``init`` built from the integer parameter has nothing for it.
    """
    renew = "; call init on the new tree"
    if not built:
        return renew
    now = {jax.tree_util.keystr(path): (np.shape(x), jnp.result_type(x))
           for path, x in jax.tree_util.tree_flatten_with_path(updates)[0]}

    def differing(signature):
        before = dict(zip(_leaf_paths_of(signature), signature[1]))
        names = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        kind = [k for k in names if k in before and k in now and before[k][0] == now[k][0]
                and jnp.issubdtype(before[k][1], jnp.floating)
                != jnp.issubdtype(now[k][1], jnp.floating)]
        return names, kind

    same_state = [s for s, state in built.items() if state == have] or list(built)
    names, kind = min((differing(s) for s in same_state), key=lambda d: len(d[0]))
    if not names:
        return renew
    listed = f" (leaves that differ from the tree init was given: {', '.join(names)})"
    if kind != names:
        return listed + renew
    return (f"{listed}: floating-point in the updates but not in the tree init was given, or "
            "the other way round, so the state has nothing for them (an optimizer before "
            "this transform, such as optax.adam, gives an integer parameter a floating-point "
            "update); leave integer leaves out of the optimizer (optax.masked) or call init on "
            "a tree whose leaves have the updates' dtypes")


