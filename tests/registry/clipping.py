import numpy as np

import optclip
from tests.registry.base import (
    BOUND_RTOL,
    Entry,
    global_norm_at_most,
    max_abs_at_most,
    row_norms_at_most,
)


def _unit_std(out) -> bool:
    return all(np.isclose(np.std(np.asarray(x, np.float64), ddof=1), 1.0, rtol=BOUND_RTOL)
               for x in out.values())


ENTRIES = [
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
