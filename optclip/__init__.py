"""optclip: gradient clippers and normalizers as ``optax.GradientTransformation``s.

Every transform composes with ``optax.chain``::

    tx = optax.chain(optclip.clip_by_global_norm(1.0), optax.adam(3e-4))

and ``optclip.stats(opt_state)`` returns what a training loop wants to log.
"""

from optclip._core.leafvec import per_leaf
from optclip._core.stats import stats
from optclip.adagc import adagc
from optclip.autoclip import quantile_clip, standard_clip
from optclip.clipping import (
    centralize,
    clip_by_global_norm,
    clip_grad_norm,
    clip_grad_value,
    clip_norm,
    clip_value,
    normalize,
    normalize_grads,
    zscore_normalize,
)
from optclip.ema import clip_norm_by_ema, clip_value_by_ema, normalize_by_ema
from optclip.frank_wolfe import (
    frank_wolfe,
    l1_frank_wolfe,
    l1q_frank_wolfe,
    l2_frank_wolfe,
    linf_frank_wolfe,
)
from optclip.growth import clip_norm_growth, clip_value_growth
from optclip.history import (
    ema_criterion,
    hist_clip,
    max_clipping,
    mean_clipping,
    param_hist_clip,
    reciprocal_clipping,
    zscore_criterion,
)
from optclip.lp_space import clamp, l1_normalize, l1q_normalize, l2_normalize, sign, top_q
from optclip.moment_clip import adamw_clip, spam_clip, stable_adamw_clip
from optclip.projections import clamp_params, project_l2_ball, project_linf_ball
from optclip.skip_spikes import skip_spikes
from optclip.unitwise import adaptive_grad_clip, flax_unit_axes
from optclip.zclip import zclip

__version__ = "0.1.0"

__all__ = [
    "stats",
    "per_leaf",
    # stateless (clipping.py)
    "centralize",
    "clip_by_global_norm",
    "clip_grad_norm",
    "clip_grad_value",
    "clip_norm",
    "clip_value",
    "normalize",
    "normalize_grads",
    "zscore_normalize",
    # ema.py
    "clip_norm_by_ema",
    "clip_value_by_ema",
    "normalize_by_ema",
    # growth.py
    "clip_norm_growth",
    "clip_value_growth",
    # history.py (drytorch)
    "ema_criterion",
    "hist_clip",
    "max_clipping",
    "mean_clipping",
    "param_hist_clip",
    "reciprocal_clipping",
    "zscore_criterion",
    # zclip.py
    "zclip",
    # autoclip.py
    "quantile_clip",
    "standard_clip",
    # lp_space.py (pre-step)
    "clamp",
    "l1_normalize",
    "l1q_normalize",
    "l2_normalize",
    "sign",
    "top_q",
    # projections.py
    "clamp_params",
    "project_l2_ball",
    "project_linf_ball",
    # frank_wolfe.py
    "frank_wolfe",
    "l1_frank_wolfe",
    "l1q_frank_wolfe",
    "l2_frank_wolfe",
    "linf_frank_wolfe",
    # spike protection: skip_spikes.py, adagc.py, moment_clip.py
    "adagc",
    "adamw_clip",
    "skip_spikes",
    "spam_clip",
    "stable_adamw_clip",
    # unitwise.py
    "adaptive_grad_clip",
    "flax_unit_axes",
]
