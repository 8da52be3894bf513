import optclip
from tests.registry.base import Entry

_BAD_ARGS = (({"add": -1.0}, "add"), ({"mul": 0.0}, "mul"), ({"min_value": -1e-4}, "min_value"),
             ({"max_decay": 0.0}, "max_decay"))


def _thresholds(**base):
    return {"add": {**base, "add": 0.5}, "mul": {**base, "mul": 1.2},
            "min_value": {**base, "min_value": 0.5}, "max_decay": {**base, "max_decay": 1.5}}


ENTRIES = [
    Entry("clip_value_growth", lambda: optclip.clip_value_growth(add=0.5), bad_args=_BAD_ARGS,
          axis_make=lambda a: optclip.clip_value_growth(add=0.5, axis_name=a),
          thresholds=_thresholds()),
    Entry("clip_norm_growth", lambda: optclip.clip_norm_growth(parameterwise=False, ord="l1"),
          axis_make=lambda a: optclip.clip_norm_growth(ord="l1", axis_name=a),
          bad_args=_BAD_ARGS + (({"ord": "foo"}, "ord"),
                                ({"parameterwise": 1}, "parameterwise")),
          thresholds=_thresholds(parameterwise=False), ord_kwargs={"parameterwise": False}),
]
