import optclip
from tests.registry.base import Entry

ENTRIES = [
    Entry("adaptive_grad_clip", lambda: optclip.adaptive_grad_clip(0.05), needs_params=True,
          axis_make=lambda a: optclip.adaptive_grad_clip(0.05, dim=0, axis_name=a),
          bad_args=(({"clipping": 0.0}, "clipping"), ({"clipping": 0.1, "eps": -1.0}, "eps"),
                    ({"clipping": 0.1, "dim": "global"}, "dim"),
                    ({"clipping": 0.1, "axis_name": 1}, "axis_name"))),
]
