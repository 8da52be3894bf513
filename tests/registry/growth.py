import optclip
from tests.registry.base import Entry

_BAD_ARGS = (({"add": -1.0}, "add"), ({"mul": 0.0}, "mul"), ({"min_value": -1e-4}, "min_value"),
             ({"max_decay": 0.0}, "max_decay"))

ENTRIES = [
    Entry("clip_value_growth", lambda: optclip.clip_value_growth(add=0.5), bad_args=_BAD_ARGS,
          axis_make=lambda a: optclip.clip_value_growth(add=0.5, axis_name=a)),
    Entry("clip_norm_growth", lambda: optclip.clip_norm_growth(parameterwise=False, ord="l1"),
          axis_make=lambda a: optclip.clip_norm_growth(ord="l1", axis_name=a),
          bad_args=_BAD_ARGS + (({"ord": "foo"}, "ord"),
                                ({"parameterwise": 1}, "parameterwise"))),
]
