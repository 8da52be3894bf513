import optax

import optclip
from tests.registry.base import Entry

_NORM_BAD_ARGS = (({"beta": 1.5}, "beta"), ({"ord": "l7"}, "ord"), ({"eps": -1.0}, "eps"),
                  ({"tensorwise": "yes"}, "tensorwise"),
                  ({"max_ema_growth": 0.0}, "max_ema_growth"),
                  ({"ema_init": "ones"}, "ema_init"))

ENTRIES = [
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
