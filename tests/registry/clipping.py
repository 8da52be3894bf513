import optclip
from tests.registry.base import Entry

ENTRIES = [
    Entry("clip_value", lambda: optclip.clip_value(1.0),
          axis_make=lambda a: optclip.clip_value(1.0, axis_name=a),
          bad_args=(({"value": -1.0}, "value"), ({"value": "a"}, "value"))),
    Entry("clip_norm", lambda: optclip.clip_norm(1.0, dim=1),
          axis_make=lambda a: optclip.clip_norm(1.0, dim="global", axis_name=a), ones_norm=1.0,
          bad_args=(({"max_norm": 0.0}, "max_norm"), ({"max_norm": 1.0, "ord": "l7"}, "ord"),
                    ({"max_norm": 1.0, "min_size": -1}, "min_size"),
                    ({"max_norm": 1.0, "dim": "rows"}, "dim"))),
    Entry("clip_by_global_norm", lambda: optclip.clip_by_global_norm(1.0),
          axis_make=lambda a: optclip.clip_by_global_norm(1.0, axis_name=a), ones_norm=1.0,
          bad_args=(({"max_norm": -1.0}, "max_norm"), ({"ord": "foo"}, "ord"))),
    Entry("normalize", lambda: optclip.normalize(1.0, ord="std"),
          axis_make=lambda a: optclip.normalize(1.0, dim="global", axis_name=a), ones_norm=1.0,
          bad_args=(({"norm_value": 0.0}, "norm_value"), ({"eps": -1.0}, "eps"))),
    Entry("centralize", lambda: optclip.centralize(dim=0, inverse_dims=True), has_stats=False,
          axis_make=lambda a: optclip.centralize(dim=0, axis_name=a),
          bad_args=(({"min_size": 1.5}, "min_size"), ({"inverse_dims": "yes"}, "inverse_dims"))),
    Entry("zscore_normalize", lambda: optclip.zscore_normalize(), has_stats=False,
          axis_make=lambda a: optclip.zscore_normalize(axis_name=a),
          bad_args=(({"eps": 0.0}, "eps"),)),
]
