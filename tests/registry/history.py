import optclip
from tests.registry.base import Entry

ENTRIES = [
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
                      "max_grad_norm": {"warmup_steps": 2, "max_grad_norm": 1.0}}),
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
