"""Spike protection: skip_spikes, adagc and the moment-aware clippers (wrappers of an adam)."""

import optax

import optclip
from tests.registry.base import Entry

_ADAM = optax.adam(1e-2)


def _bounded_adam(adam=optax.adam):
    """An adam whose own arithmetic stays in range for the scale-safety check (Entry.scale_make):
    its gradients are clipped to a global norm of 100 (squares below float16's largest value)
    and its eps is representable in float16."""
    return optax.chain(optclip.clip_by_global_norm(100.0), adam(1e-2, eps=1e-3))


ENTRIES = [
    Entry("skip_spikes",
          # A warm-up short enough that the 3 conformance steps reach the detector.
          lambda: optclip.skip_spikes(optax.adam(1e-2), warmup_steps=2),
          scale_make=lambda: optclip.skip_spikes(_bounded_adam(), warmup_steps=2),
          axis_make=lambda a: optclip.skip_spikes(optax.adam(1e-2), warmup_steps=2,
                                                  axis_name=a),
          # adam's first step is -lr * sign(g) (to 1e-8): lr * sqrt(32) for ones(8, 4).
          ones_norm=1e-2 * 32 ** 0.5,
          bad_args=(({"inner": abs}, "inner"),
                    ({"inner": _ADAM, "detector": "median"}, "detector"),
                    ({"inner": _ADAM, "threshold": -1.0}, "threshold"),
                    ({"inner": _ADAM, "warmup_steps": 1}, "warmup_steps"),
                    ({"inner": _ADAM, "window": 1}, "window"),
                    ({"inner": _ADAM, "max_consecutive": 0}, "max_consecutive"),
                    ({"inner": _ADAM, "alpha": 1.0}, "alpha"))),
    Entry("adagc", lambda: optclip.adagc(warmup_steps=1),
          axis_make=lambda a: optclip.adagc(warmup_steps=1, axis_name=a), ones_norm=1.0,
          bad_args=(({"lambda_abs": 0.0}, "lambda_abs"), ({"lambda_rel": -1.0}, "lambda_rel"),
                    ({"beta": 1.0}, "beta"), ({"warmup_steps": 0}, "warmup_steps"),
                    ({"eps": -1.0}, "eps"))),
    Entry("spam_clip", lambda: optclip.spam_clip(optax.adam(1e-2), clip_after=2,
                                                 reset_interval=3),
          scale_make=lambda: optclip.spam_clip(_bounded_adam(), clip_after=2, reset_interval=3),
          axis_make=lambda a: optclip.spam_clip(optax.adam(1e-2), clip_after=2, reset_interval=3,
                                                axis_name=a),
          bad_args=(({"inner": None}, "inner"), ({"inner": _ADAM, "threshold": 0.0}, "threshold"),
                    ({"inner": _ADAM, "clip_after": -1}, "clip_after"),
                    ({"inner": _ADAM, "reset_interval": 0}, "reset_interval"))),
    Entry("adamw_clip", lambda: optclip.adamw_clip(optax.adamw(1e-2), sigmas=1.0),
          scale_make=lambda: optclip.adamw_clip(_bounded_adam(optax.adamw), sigmas=1.0),
          axis_make=lambda a: optclip.adamw_clip(optax.adamw(1e-2), sigmas=1.0, axis_name=a),
          bad_args=(({"inner": None}, "inner"), ({"inner": _ADAM, "sigmas": 0.0}, "sigmas"),
                    ({"inner": _ADAM, "b2": 1.0}, "b2"),
                    ({"inner": _ADAM, "warmup_steps": -1}, "warmup_steps"))),
    Entry("stable_adamw_clip", lambda: optclip.stable_adamw_clip(optax.adam(1e-2)),
          scale_make=lambda: optclip.stable_adamw_clip(_bounded_adam()),
          axis_make=lambda a: optclip.stable_adamw_clip(optax.adam(1e-2), axis_name=a),
          bad_args=(({"inner": None}, "inner"), ({"inner": _ADAM, "b2": -0.1}, "b2"),
                    ({"inner": _ADAM, "eps": -1.0}, "eps"))),
]
