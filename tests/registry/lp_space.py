"""Conformance entries for the rai_toolbox family (optclip/lp_space.py).

The default tree is {"w": (8, 4), "b": (4,)} with "w" sharded along axis 0. ``param_ndim=-1``
keeps each slice (a row of "w", an element of "b") on one device, so top-q ranks locally and the
sharded run gives the same numbers.
"""

import optclip
from tests.registry.base import Entry

ENTRIES = [
    Entry("sign", lambda: optclip.sign(grad_scale=0.5, grad_bias=0.01), has_stats=False,
          bad_args=(({"grad_scale": "x"}, "grad_scale"), ({"grad_bias": None}, "grad_bias"))),
    Entry("l1_normalize", lambda: optclip.l1_normalize(grad_scale=2.0),
          axis_make=lambda a: optclip.l1_normalize(param_ndim=None, axis_name=a),
          bad_args=(({"eps": -1.0}, "eps"), ({"param_ndim": 1.5}, "param_ndim"))),
    Entry("l2_normalize", lambda: optclip.l2_normalize(param_ndim=None),
          axis_make=lambda a: optclip.l2_normalize(param_ndim=None, axis_name=a), ones_norm=1.0,
          bad_args=(({"eps": -1.0}, "eps"), ({"param_ndim": "rows"}, "param_ndim"),
                    ({"grad_scale": float("nan")}, "grad_scale"))),
    Entry("top_q", lambda: optclip.top_q(0.5, dq=0.2, seed=3),
          bad_args=(({"q": 1.5}, "q"), ({"q": 0.5, "dq": -0.1}, "dq"),
                    ({"q": 0.5, "seed": -1}, "seed"), ({"q": 0.5, "param_ndim": 1.0},
                                                       "param_ndim"))),
    Entry("l1q_normalize", lambda: optclip.l1q_normalize(0.3, grad_scale=1.8),
          bad_args=(({"q": -0.1}, "q"), ({"q": 0.3, "eps": -1.0}, "eps"),
                    ({"q": 0.3, "dq": 2.0}, "dq"))),
    Entry("clamp", lambda: optclip.clamp(-1.0, 2.0),
          bad_args=(({}, "clamp_min"), ({"clamp_min": 1.0, "clamp_max": 0.0}, "clamp_min"),
                    ({"clamp_max": "a"}, "clamp_max")),
          thresholds={"clamp_min": {"clamp_min": -1.0, "clamp_max": 2.0},
                      "clamp_max": {"clamp_min": -1.0, "clamp_max": 2.0}}),
    Entry("project_l2_ball", lambda: optclip.project_l2_ball(1.0), needs_params=True,
          thresholds={"epsilon": {"epsilon": 1.0}},
          bad_args=(({"epsilon": -1.0}, "epsilon"), ({"epsilon": 1.0, "exact": 1}, "exact"),
                    ({"epsilon": 1.0, "param_ndim": 0.5}, "param_ndim"))),
    Entry("project_linf_ball", lambda: optclip.project_linf_ball(0.5), needs_params=True,
          thresholds={"epsilon": {"epsilon": 0.5}},
          bad_args=(({"epsilon": -0.5}, "epsilon"), ({"epsilon": "big"}, "epsilon"))),
    Entry("clamp_params", lambda: optclip.clamp_params(clamp_max=0.5), needs_params=True,
          thresholds={"clamp_max": {"clamp_max": 0.5}, "clamp_min": {"clamp_min": -0.5}},
          bad_args=(({}, "clamp_min"), ({"clamp_min": 2.0, "clamp_max": 1.0}, "clamp_max"))),
    Entry("frank_wolfe", lambda: optclip.frank_wolfe(0.5), needs_params=True,
          bad_args=(({"learning_rate": -1.0}, "learning_rate"),
                    ({"learning_rate": 1.5, "use_default_lr_schedule": False}, "learning_rate"),
                    ({"lmo_scaling_factor": "x"}, "lmo_scaling_factor"),
                    ({"use_default_lr_schedule": "yes"}, "use_default_lr_schedule"))),
    Entry("l1_frank_wolfe", lambda: optclip.l1_frank_wolfe(2.0), needs_params=True,
          thresholds={"epsilon": {"epsilon": 2.0}},
          bad_args=(({"epsilon": -1.0}, "epsilon"), ({"epsilon": 1.0, "eps": -1.0}, "eps"))),
    Entry("l2_frank_wolfe", lambda: optclip.l2_frank_wolfe(2.0, param_ndim=None),
          needs_params=True, thresholds={"epsilon": {"epsilon": 2.0, "param_ndim": None}},
          bad_args=(({"epsilon": -1.0}, "epsilon"),
                    ({"epsilon": 1.0, "param_ndim": 2.0}, "param_ndim"))),
    Entry("linf_frank_wolfe", lambda: optclip.linf_frank_wolfe(1.0, learning_rate=0.5,
                                                               use_default_lr_schedule=False),
          needs_params=True,
          bad_args=(({"epsilon": float("nan")}, "epsilon"),
                    ({"epsilon": 1.0, "learning_rate": -0.1}, "learning_rate"))),
    Entry("l1q_frank_wolfe", lambda: optclip.l1q_frank_wolfe(0.5, 1.5, dq=0.25),
          needs_params=True,
          bad_args=(({"q": 2.0, "epsilon": 1.0}, "q"), ({"q": 0.5, "epsilon": -1.0}, "epsilon"),
                    ({"q": 0.5, "epsilon": 1.0, "seed": 0.5}, "seed"))),
]
