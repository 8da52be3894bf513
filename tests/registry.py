"""The conformance table: every public transform, one ``Entry`` each, grouped by family.

``tests/test_conformance.py`` runs the contract over ``ALL_ENTRIES``; ``tests/test_compile_cost.py``
and ``tests/test_sharding.py`` use the same table. A new transform gets one ``Entry`` in its
family's group (a new family: a new group, added to ``ALL_ENTRIES``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optclip


def default_tree(dtype=jnp.float32, seed: int = 0) -> dict[str, Any]:
    """Small gradients: a (8, 4) matrix (sharded along axis 0 in the sharding check), a vector."""
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(8, 4)) * 3, dtype),
            "b": jnp.asarray(rng.normal(size=(4,)), dtype)}


def _f64(tree) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


# Bounds are checked in float64 with a tolerance that covers float16 outputs.
BOUND_RTOL = 1e-2


def max_abs_at_most(bound: float) -> Callable[[Any], bool]:
    return lambda out: all(np.all(np.abs(x) <= bound) for x in _f64(out))


def global_norm_at_most(bound: float) -> Callable[[Any], bool]:
    return lambda out: np.sqrt(sum(np.sum(x ** 2) for x in _f64(out))) <= bound * (1 + BOUND_RTOL)


def row_norms_at_most(bound: float, leaf: str) -> Callable[[Any], bool]:
    return lambda out: np.all(np.linalg.norm(np.asarray(out[leaf], np.float64), axis=-1)
                              <= bound * (1 + BOUND_RTOL))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public transform in the conformance suite.

    name: the public name (``optclip.<name>``); used as the test id and for ``bad_args``.
    make: builds the transform with representative arguments.
    bad_args: ``(kwargs, parameter name)`` pairs that must raise ``ValueError``/``TypeError``
      at construction, with the parameter name in the message.
    needs_params: ``update`` needs ``params`` (projections, Frank-Wolfe).
    has_stats: ``optclip.stats`` reports at least one entry for its state.
    tree: makes the gradient tree (``dtype, seed -> tree``).
    rtol: tolerance for jit == eager and sharded == unsharded.
    axis_make: builds the transform with ``axis_name`` (``axis_name -> transform``), configured
      so that its statistics reduce over axis 0 of every leaf (the axis ``shard_map`` splits);
      ``None`` for transforms without ``axis_name``.
    ones_norm: the global norm of the output for ``ones(8, 4)`` on the first step, for the
      transforms that act on the global norm then (``None``: not checked).
    thresholds: parameter name -> keyword arguments that build the transform with that
      parameter as a number; every threshold also takes an optax schedule (``count -> value``).
    ord_kwargs: keyword arguments that build the transform when it takes an ``ord`` (the suite
      adds each ``ord``); ``None`` when it has none.
    bound: a property every output must have (the clipping bound holding), ``out -> bool``.
    scale_make: builds the transform for the scale-safety check when ``make`` wraps an optax
      optimizer whose own arithmetic is not scale-safe (``optax.adam`` squares gradients in the
      parameters' dtype: its ``nu`` overflows at float32 elements of 1e20 or float16 ones of
      6e4, and its ``eps=1e-8`` is 0 in float16): the same wrapper around an adam that sees
      bounded gradients, so the wrapper's own statistics still meet the huge ones. ``None``:
      ``make``.
    draws_per_leaf: ``make`` draws a random value for each float leaf in the tree's order (a
      random ``q``), so reordering the leaves changes which draw a leaf gets.
    """

    name: str
    make: Callable[[], optax.GradientTransformation]
    bad_args: tuple[tuple[dict, str], ...] = ()
    needs_params: bool = False
    has_stats: bool = True
    tree: Callable[..., Any] = default_tree
    rtol: float = 1e-5
    axis_make: Callable[[Any], optax.GradientTransformation] | None = None
    ones_norm: float | None = None
    thresholds: dict[str, dict] = dataclasses.field(default_factory=dict)
    ord_kwargs: dict | None = None
    bound: Callable[[Any], bool] | None = None
    scale_make: Callable[[], optax.GradientTransformation] | None = None
    draws_per_leaf: bool = False

    def __str__(self) -> str:
        return self.name


# ---------------------------------------------------------------------------------------------
# clipping (stateless clippers and normalizers)

def _unit_std(out) -> bool:
    return all(np.isclose(np.std(np.asarray(x, np.float64), ddof=1), 1.0, rtol=BOUND_RTOL)
               for x in out.values())


CLIPPING = [
    Entry("clip_value", lambda: optclip.clip_value(1.0),
          axis_make=lambda a: optclip.clip_value(1.0, axis_name=a),
          bad_args=(({"value": -1.0}, "value"), ({"value": "a"}, "value")),
          thresholds={"value": {"value": 1.0}}, bound=max_abs_at_most(1.0)),
    Entry("clip_norm", lambda: optclip.clip_norm(1.0, dim=1),
          axis_make=lambda a: optclip.clip_norm(1.0, dim="global", axis_name=a), ones_norm=1.0,
          bad_args=(({"max_norm": 0.0}, "max_norm"), ({"max_norm": 1.0, "ord": "l7"}, "ord"),
                    ({"max_norm": 1.0, "min_size": -1}, "min_size"),
                    ({"max_norm": 1.0, "dim": "rows"}, "dim"),
                    ({"max_norm": 1.0, "dim": 1.5}, "dim")),
          thresholds={"max_norm": {"max_norm": 1.0, "dim": 1}},
          ord_kwargs={"max_norm": 1.0, "dim": 1}, bound=row_norms_at_most(1.0, "w")),
    Entry("clip_by_global_norm", lambda: optclip.clip_by_global_norm(1.0),
          axis_make=lambda a: optclip.clip_by_global_norm(1.0, axis_name=a), ones_norm=1.0,
          bad_args=(({"max_norm": -1.0}, "max_norm"), ({"ord": "foo"}, "ord")),
          thresholds={"max_norm": {"max_norm": 1.0}}, ord_kwargs={"max_norm": 1.0},
          bound=global_norm_at_most(1.0)),
    Entry("normalize", lambda: optclip.normalize(1.0, ord="std"),
          axis_make=lambda a: optclip.normalize(1.0, dim="global", axis_name=a), ones_norm=1.0,
          bad_args=(({"norm_value": 0.0}, "norm_value"), ({"eps": -1.0}, "eps")),
          thresholds={"norm_value": {"norm_value": 2.0}}, ord_kwargs={"norm_value": 1.0},
          bound=_unit_std),
    Entry("centralize", lambda: optclip.centralize(dim=0, inverse_dims=True), has_stats=False,
          axis_make=lambda a: optclip.centralize(dim=0, axis_name=a),
          bad_args=(({"min_size": 1.5}, "min_size"), ({"inverse_dims": "yes"}, "inverse_dims"))),
    Entry("zscore_normalize", lambda: optclip.zscore_normalize(), has_stats=False,
          axis_make=lambda a: optclip.zscore_normalize(axis_name=a),
          bad_args=(({"eps": 0.0}, "eps"),), bound=_unit_std),
]


# ---------------------------------------------------------------------------------------------
# ema (torchzero: norms and values referenced to an EMA)

_NORM_BAD_ARGS = (({"beta": 1.5}, "beta"), ({"ord": "l7"}, "ord"), ({"eps": -1.0}, "eps"),
                  ({"tensorwise": "yes"}, "tensorwise"),
                  ({"max_ema_growth": 0.0}, "max_ema_growth"),
                  ({"ema_init": "ones"}, "ema_init"))

EMA = [
    Entry("clip_norm_by_ema", lambda: optclip.clip_norm_by_ema(beta=0.5, ord="std"),
          axis_make=lambda a: optclip.clip_norm_by_ema(beta=0.5, ord="std", axis_name=a),
          bad_args=_NORM_BAD_ARGS,
          thresholds={"max_ema_growth": {"beta": 0.5, "max_ema_growth": 1.2}},
          ord_kwargs={"beta": 0.5}),
    Entry("normalize_by_ema", lambda: optclip.normalize_by_ema(beta=0.9, tensorwise=False),
          axis_make=lambda a: optclip.normalize_by_ema(beta=0.9, tensorwise=False, axis_name=a),
          bad_args=_NORM_BAD_ARGS,
          thresholds={"max_ema_growth": {"beta": 0.9, "tensorwise": False,
                                         "max_ema_growth": 1.2}},
          ord_kwargs={"beta": 0.9, "tensorwise": False}),
    Entry("clip_value_by_ema",
          lambda: optclip.clip_value_by_ema(beta=0.5, ema_transform=optax.scale(2.0)),
          axis_make=lambda a: optclip.clip_value_by_ema(beta=0.5, axis_name=a),
          bad_args=(({"beta": -0.1}, "beta"), ({"ema_init": 1.0}, "ema_init"),
                    ({"ema_transform": lambda x: x}, "ema_transform"))),
]


# ---------------------------------------------------------------------------------------------
# growth (torchzero: growth limited against the previous step)

_BAD_ARGS = (({"add": -1.0}, "add"), ({"mul": 0.0}, "mul"), ({"min_value": -1e-4}, "min_value"),
             ({"max_decay": 0.0}, "max_decay"))


def _thresholds(**base):
    return {"add": {**base, "add": 0.5}, "mul": {**base, "mul": 1.2},
            "min_value": {**base, "min_value": 0.5}, "max_decay": {**base, "max_decay": 1.5}}


GROWTH = [
    Entry("clip_value_growth", lambda: optclip.clip_value_growth(add=0.5), bad_args=_BAD_ARGS,
          axis_make=lambda a: optclip.clip_value_growth(add=0.5, axis_name=a),
          thresholds=_thresholds()),
    Entry("clip_norm_growth", lambda: optclip.clip_norm_growth(parameterwise=False, ord="l1"),
          axis_make=lambda a: optclip.clip_norm_growth(ord="l1", axis_name=a),
          bad_args=_BAD_ARGS + (({"ord": "foo"}, "ord"),
                                ({"parameterwise": 1}, "parameterwise")),
          # The l1 norms of the three conformance steps are 72.0, 70.7, 73.7: the cap binds at
          # the last step against the reference, the second norm, or 72.0 / max_decay where
          # 70.7 / 72.0 < 1 / max_decay; min_value lifts the reference above the norms, under
          # a cap below them.
          thresholds={"add": {"parameterwise": False, "ord": "l1", "add": 0.5},
                      "mul": {"parameterwise": False, "mul": 1.2},
                      "min_value": {"parameterwise": False, "ord": "l1", "min_value": 100.0,
                                    "mul": 0.5},
                      "max_decay": {"parameterwise": False, "ord": "l1", "mul": 1.0,
                                    "max_decay": 1.44}},
          ord_kwargs={"parameterwise": False}),
]


# ---------------------------------------------------------------------------------------------
# history (drytorch criteria, hist_clip, ZClip, AutoClip)

HISTORY = [
    Entry("hist_clip",
          # A stateful warm-up transform (its state lives inside hist_clip's), and a warm-up
          # short enough that the 3 conformance steps reach the criterion.
          lambda: optclip.hist_clip(warmup_transform=optclip.clip_by_global_norm(1.0),
                                    warmup_steps=2),
          axis_make=lambda a: optclip.hist_clip(
              warmup_transform=optclip.clip_by_global_norm(1.0, axis_name=a), warmup_steps=2,
              axis_name=a), ones_norm=1.0,
          bad_args=(({"warmup_steps": 0}, "warmup_steps"), ({"criterion": "zscore"}, "criterion"),
                    ({"feedback": "clipped"}, "feedback"), ({"parity": "torch"}, "parity"))),
    Entry("param_hist_clip",
          lambda: optclip.param_hist_clip(optclip.ema_criterion(), warmup_steps=1),
          axis_make=lambda a: optclip.param_hist_clip(optclip.ema_criterion(), warmup_steps=1,
                                                      axis_name=a), ones_norm=1.0,
          bad_args=(({"warmup_steps": 1.5}, "warmup_steps"),
                    ({"warmup_transform": abs}, "warmup_transform"))),
    Entry("zclip", lambda: optclip.zclip(warmup_steps=2, max_grad_norm=None),
          axis_make=lambda a: optclip.zclip(warmup_steps=2, axis_name=a), ones_norm=1.0,
          bad_args=(({"mode": "quantile"}, "mode"), ({"clip_option": "median"}, "clip_option"),
                    ({"warmup_steps": 1}, "warmup_steps"), ({"alpha": 1.5}, "alpha"),
                    ({"max_grad_norm": -1.0}, "max_grad_norm")),
          thresholds={"z_thresh": {"warmup_steps": 2, "max_grad_norm": None, "z_thresh": 0.5},
                      "max_grad_norm": {"warmup_steps": 2, "max_grad_norm": 1.0},
                      "clip_factor": {"warmup_steps": 2, "max_grad_norm": None, "z_thresh": 0.5,
                                      "clip_factor": 0.5}}),
    Entry("quantile_clip", lambda: optclip.quantile_clip(0.5, history_length=2),
          axis_make=lambda a: optclip.quantile_clip(0.5, history_length=2, axis_name=a),
          bad_args=(({"quantile": 1.5}, "quantile"), ({"history_length": 0}, "history_length"),
                    ({"global_threshold": "yes"}, "global_threshold")),
          thresholds={"quantile": {"quantile": 0.5, "history_length": 2}}),
    Entry("standard_clip",
          lambda: optclip.standard_clip(history_length=4, global_threshold=True, add_mean=True),
          axis_make=lambda a: optclip.standard_clip(history_length=4, global_threshold=True,
                                                    add_mean=True, axis_name=a),
          bad_args=(({"deviations": -1.0}, "deviations"), ({"parity": "ref"}, "parity"),
                    ({"history_length": 2.5}, "history_length")),
          thresholds={"deviations": {"deviations": 0.5, "history_length": 4,
                                     "global_threshold": True, "add_mean": True}}),
]


# ---------------------------------------------------------------------------------------------
# lp_space (rai_toolbox: pre-step transforms, projections, Frank-Wolfe)
# The default tree is {"w": (8, 4), "b": (4,)} with "w" sharded along axis 0. ``param_ndim=-1``
# keeps each slice (a row of "w", an element of "b") on one device, so top-q ranks locally and
# the sharded run gives the same numbers.

LP_SPACE = [
    Entry("sign", lambda: optclip.sign(grad_scale=0.5, grad_bias=0.01), has_stats=False,
          bad_args=(({"grad_scale": "x"}, "grad_scale"), ({"grad_bias": None}, "grad_bias"))),
    Entry("l1_normalize", lambda: optclip.l1_normalize(grad_scale=2.0),
          axis_make=lambda a: optclip.l1_normalize(param_ndim=None, axis_name=a),
          bad_args=(({"eps": -1.0}, "eps"), ({"param_ndim": 1.5}, "param_ndim"))),
    Entry("l2_normalize", lambda: optclip.l2_normalize(param_ndim=None),
          axis_make=lambda a: optclip.l2_normalize(param_ndim=None, axis_name=a), ones_norm=1.0,
          bad_args=(({"eps": -1.0}, "eps"), ({"param_ndim": "rows"}, "param_ndim"),
                    ({"grad_scale": float("nan")}, "grad_scale"))),
    Entry("top_q", lambda: optclip.top_q(0.5, dq=0.2, seed=3), draws_per_leaf=True,
          axis_make=lambda a: optclip.top_q(0.5, dq=0.2, param_ndim=None, seed=3, axis_name=a),
          bad_args=(({"q": 1.5}, "q"), ({"q": 0.5, "dq": -0.1}, "dq"),
                    ({"q": 0.5, "seed": -1}, "seed"), ({"q": 0.5, "param_ndim": 1.0},
                                                       "param_ndim"))),
    Entry("l1q_normalize", lambda: optclip.l1q_normalize(0.3, grad_scale=1.8),
          axis_make=lambda a: optclip.l1q_normalize(0.3, param_ndim=None, axis_name=a),
          bad_args=(({"q": -0.1}, "q"), ({"q": 0.3, "eps": -1.0}, "eps"),
                    ({"q": 0.3, "dq": 2.0}, "dq"))),
    Entry("clamp", lambda: optclip.clamp(-1.0, 2.0),
          axis_make=lambda a: optclip.clamp(-1.0, 2.0, axis_name=a),
          bad_args=(({}, "clamp_min"), ({"clamp_min": 1.0, "clamp_max": 0.0}, "clamp_min"),
                    ({"clamp_max": "a"}, "clamp_max")),
          thresholds={"clamp_min": {"clamp_min": -1.0, "clamp_max": 2.0},
                      "clamp_max": {"clamp_min": -1.0, "clamp_max": 2.0}}),
    Entry("project_l2_ball", lambda: optclip.project_l2_ball(1.0), needs_params=True,
          axis_make=lambda a: optclip.project_l2_ball(1.0, param_ndim=None, axis_name=a),
          thresholds={"epsilon": {"epsilon": 1.0}},
          bad_args=(({"epsilon": -1.0}, "epsilon"), ({"epsilon": 1.0, "exact": 1}, "exact"),
                    ({"epsilon": 1.0, "param_ndim": 0.5}, "param_ndim"))),
    Entry("project_linf_ball", lambda: optclip.project_linf_ball(0.5), needs_params=True,
          axis_make=lambda a: optclip.project_linf_ball(0.5, axis_name=a),
          thresholds={"epsilon": {"epsilon": 0.5}},
          bad_args=(({"epsilon": -0.5}, "epsilon"), ({"epsilon": "big"}, "epsilon"))),
    Entry("clamp_params", lambda: optclip.clamp_params(clamp_max=0.5), needs_params=True,
          axis_make=lambda a: optclip.clamp_params(clamp_max=0.5, axis_name=a),
          thresholds={"clamp_max": {"clamp_max": 0.5}, "clamp_min": {"clamp_min": -0.5}},
          bad_args=(({}, "clamp_min"), ({"clamp_min": 2.0, "clamp_max": 1.0}, "clamp_max"))),
    Entry("frank_wolfe", lambda: optclip.frank_wolfe(0.5), needs_params=True,
          axis_make=lambda a: optclip.frank_wolfe(0.5, axis_name=a),
          bad_args=(({"learning_rate": -1.0}, "learning_rate"),
                    ({"learning_rate": 1.5, "use_default_lr_schedule": False}, "learning_rate"),
                    ({"lmo_scaling_factor": "x"}, "lmo_scaling_factor"),
                    ({"use_default_lr_schedule": "yes"}, "use_default_lr_schedule"))),
    Entry("l1_frank_wolfe", lambda: optclip.l1_frank_wolfe(2.0), needs_params=True,
          axis_make=lambda a: optclip.l1_frank_wolfe(2.0, param_ndim=None, axis_name=a),
          thresholds={"epsilon": {"epsilon": 2.0}},
          bad_args=(({"epsilon": -1.0}, "epsilon"), ({"epsilon": 1.0, "eps": -1.0}, "eps"))),
    Entry("l2_frank_wolfe", lambda: optclip.l2_frank_wolfe(2.0, param_ndim=None),
          axis_make=lambda a: optclip.l2_frank_wolfe(2.0, param_ndim=None, axis_name=a),
          needs_params=True, thresholds={"epsilon": {"epsilon": 2.0, "param_ndim": None}},
          bad_args=(({"epsilon": -1.0}, "epsilon"),
                    ({"epsilon": 1.0, "param_ndim": 2.0}, "param_ndim"))),
    Entry("linf_frank_wolfe", lambda: optclip.linf_frank_wolfe(1.0, learning_rate=0.5,
                                                               use_default_lr_schedule=False),
          needs_params=True, axis_make=lambda a: optclip.linf_frank_wolfe(1.0, axis_name=a),
          thresholds={"epsilon": {"epsilon": 1.0, "learning_rate": 0.5,
                                  "use_default_lr_schedule": False}},
          bad_args=(({"epsilon": -1.0}, "epsilon"), ({"epsilon": float("nan")}, "epsilon"),
                    ({"epsilon": 1.0, "learning_rate": -0.1}, "learning_rate"))),
    Entry("l1q_frank_wolfe", lambda: optclip.l1q_frank_wolfe(0.5, 1.5, dq=0.25),
          needs_params=True, draws_per_leaf=True, axis_make=lambda a: optclip.l1q_frank_wolfe(
              0.5, 1.5, dq=0.25, param_ndim=None, axis_name=a),
          thresholds={"epsilon": {"q": 0.5, "epsilon": 1.5, "dq": 0.25}},
          bad_args=(({"q": 2.0, "epsilon": 1.0}, "q"), ({"q": 0.5, "epsilon": -1.0}, "epsilon"),
                    ({"q": 0.5, "epsilon": 1.0, "seed": 0.5}, "seed"))),
]


# ---------------------------------------------------------------------------------------------
# spike protection: skip_spikes, adagc and the moment-aware clippers (wrappers of an adam)

_ADAM = optax.adam(1e-2)


def _bounded_adam(adam=optax.adam):
    """An adam whose own arithmetic stays in range for the scale-safety check (Entry.scale_make):
    its gradients are clipped to a global norm of 100 (squares below float16's largest value)
    and its eps is representable in float16."""
    return optax.chain(optclip.clip_by_global_norm(100.0), adam(1e-2, eps=1e-3))


SPIKES = [
    Entry("skip_spikes",
          # A warm-up short enough that the 3 conformance steps reach the detector.
          lambda: optclip.skip_spikes(optax.adam(1e-2), warmup_steps=2),
          scale_make=lambda: optclip.skip_spikes(_bounded_adam(), warmup_steps=2),
          axis_make=lambda a: optclip.skip_spikes(optax.adam(1e-2), warmup_steps=2,
                                                  axis_name=a),
          # adam's first step is -lr * sign(g) (to 1e-8): lr * sqrt(32) for ones(8, 4).
          ones_norm=1e-2 * 32 ** 0.5,
          # (loss_threshold, read only with the loss extra argument: tests/test_skip_spikes.py)
          # The last step's score is 1.55: that step is flagged at half the threshold (1.0) and
          # at the rising schedule's 1.5, not at 2.0 or at 1.6 (that schedule one step on).
          thresholds={"threshold": {"inner": _ADAM, "warmup_steps": 2, "threshold": 2.0}},
          bad_args=(({"inner": abs}, "inner"),
                    ({"inner": _ADAM, "detector": "median"}, "detector"),
                    ({"inner": _ADAM, "threshold": -1.0}, "threshold"),
                    ({"inner": _ADAM, "warmup_steps": 1}, "warmup_steps"),
                    ({"inner": _ADAM, "window": 1}, "window"),
                    ({"inner": _ADAM, "max_consecutive": 0}, "max_consecutive"),
                    ({"inner": _ADAM, "alpha": 1.0}, "alpha"))),
    Entry("adagc", lambda: optclip.adagc(warmup_steps=1),
          axis_make=lambda a: optclip.adagc(warmup_steps=1, axis_name=a), ones_norm=1.0,
          # lambda_rel first: the inject_hyperparams rule builds with the first threshold's
          # arguments, and a warm-up of 1 step reaches the per-tensor phase (beta, lambda_rel).
          thresholds={"lambda_rel": {"warmup_steps": 1, "lambda_rel": 0.5},
                      "lambda_abs": {"warmup_steps": 3, "lambda_abs": 0.5}},
          bad_args=(({"lambda_abs": 0.0}, "lambda_abs"), ({"lambda_rel": -1.0}, "lambda_rel"),
                    ({"beta": 1.0}, "beta"), ({"warmup_steps": 0}, "warmup_steps"),
                    ({"eps": -1.0}, "eps"))),
    Entry("spam_clip", lambda: optclip.spam_clip(optax.adam(1e-2), clip_after=2,
                                                 reset_interval=3),
          scale_make=lambda: optclip.spam_clip(_bounded_adam(), clip_after=2, reset_interval=3),
          axis_make=lambda a: optclip.spam_clip(optax.adam(1e-2), clip_after=2, reset_interval=3,
                                                axis_name=a),
          thresholds={"threshold": {"inner": _ADAM, "clip_after": 0, "threshold": 0.5}},
          bad_args=(({"inner": None}, "inner"), ({"inner": _ADAM, "threshold": 0.0}, "threshold"),
                    ({"inner": _ADAM, "clip_after": -1}, "clip_after"),
                    ({"inner": _ADAM, "reset_interval": 0}, "reset_interval"))),
    Entry("adamw_clip", lambda: optclip.adamw_clip(optax.adamw(1e-2), sigmas=1.0),
          scale_make=lambda: optclip.adamw_clip(_bounded_adam(optax.adamw), sigmas=1.0),
          axis_make=lambda a: optclip.adamw_clip(optax.adamw(1e-2), sigmas=1.0, axis_name=a),
          thresholds={"sigmas": {"inner": _ADAM, "sigmas": 0.5, "warmup_steps": 0}},
          bad_args=(({"inner": None}, "inner"), ({"inner": _ADAM, "sigmas": 0.0}, "sigmas"),
                    ({"inner": _ADAM, "b2": 1.0}, "b2"),
                    ({"inner": _ADAM, "warmup_steps": -1}, "warmup_steps"))),
    Entry("stable_adamw_clip", lambda: optclip.stable_adamw_clip(optax.adam(1e-2)),
          scale_make=lambda: optclip.stable_adamw_clip(_bounded_adam()),
          axis_make=lambda a: optclip.stable_adamw_clip(optax.adam(1e-2), axis_name=a),
          bad_args=(({"inner": None}, "inner"), ({"inner": _ADAM, "b2": -0.1}, "b2"),
                    ({"inner": _ADAM, "eps": -1.0}, "eps"))),
]


# ---------------------------------------------------------------------------------------------
# unitwise (adaptive gradient clipping)

UNITWISE = [
    Entry("adaptive_grad_clip", lambda: optclip.adaptive_grad_clip(0.05), needs_params=True,
          axis_make=lambda a: optclip.adaptive_grad_clip(0.05, dim=0, axis_name=a),
          thresholds={"clipping": {"clipping": 0.05}},
          bad_args=(({"clipping": 0.0}, "clipping"), ({"clipping": 0.1, "eps": -1.0}, "eps"),
                    ({"clipping": 0.1, "dim": "global"}, "dim"),
                    ({"clipping": 0.1, "axis_name": 1}, "axis_name"))),
]


ALL_ENTRIES = [*CLIPPING, *EMA, *GROWTH, *HISTORY, *LP_SPACE, *SPIKES, *UNITWISE]

# Wrappers of an optimizer, and the optimizer each wraps as the registry builds it: their step
# costs are measured against it, not against chain(T, adam).
WRAPPED = {"skip_spikes": lambda: optax.adam(1e-2), "spam_clip": lambda: optax.adam(1e-2),
           "adamw_clip": lambda: optax.adamw(1e-2),
           "stable_adamw_clip": lambda: optax.adam(1e-2)}


# Where a transform goes in a step, as its docs place it, when that is not before the inner
# optimizer: a projection of the updated parameters goes after adam, and Frank-Wolfe replaces
# the optimizer (its step is the whole update). Costs are measured where users put them.
PLACEMENT = {"project_l2_ball": "after", "project_linf_ball": "after", "clamp_params": "after",
             **{name: "alone" for name in ("frank_wolfe", "l1_frank_wolfe", "l2_frank_wolfe",
                                           "linf_frank_wolfe", "l1q_frank_wolfe")}}


def placed(where: str, tx: optax.GradientTransformation, adam: optax.GradientTransformation
           ) -> optax.GradientTransformation:
    """The step that runs ``tx`` with ``adam`` where its docs place it (``where``, a value of
    :data:`PLACEMENT`, or ``'before'``): ``chain(tx, adam)``, ``chain(adam, tx)``, or ``tx``
    alone."""
    if where == "after":
        return optax.chain(adam, tx)
    return tx if where == "alone" else optax.chain(tx, adam)


def with_adam(entry: Entry) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
    """The optimizer a step of ``entry`` runs, and the one its cost is measured against:
    ``chain(T, adam)`` and ``adam`` (a projection after adam, Frank-Wolfe alone:
    :data:`PLACEMENT`), or a wrapper of adam (``WRAPPED``) and the adam it wraps."""
    if entry.name in WRAPPED:
        return entry.make(), WRAPPED[entry.name]()
    return (placed(PLACEMENT.get(entry.name, "before"), entry.make(), optax.adam(1e-3)),
            optax.adam(1e-3))
