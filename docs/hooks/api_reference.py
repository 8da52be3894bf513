"""mkdocs hook: expand ``<!-- optclip-api -->`` in api.md into one entry per public name.

Every name in ``optclip.__all__`` gets a ``::: optclip.NAME`` entry under the heading of the
module that defines it, so a transform added to ``__all__`` appears in the API reference without
editing the page, and a name that cannot be imported fails the (strict) build.
"""

from __future__ import annotations

import importlib
import pathlib
import sys

# Document the checkout being built, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

MARKER = "<!-- optclip-api -->"

SECTIONS = {  # module -> heading, in page order
    "optclip._core.stats": "Diagnostics",
    "optclip.clipping": "Stateless clippers and normalizers (`clipping.py`)",
    "optclip.ema": "EMA-referenced clippers (`ema.py`)",
    "optclip.growth": "Growth limiters (`growth.py`)",
    "optclip.history": "drytorch's history-based clipping (`history.py`)",
    "optclip.zclip": "ZClip (`zclip.py`)",
    "optclip.autoclip": "AutoClip (`autoclip.py`)",
    "optclip.lp_space": "Lp-space gradient transforms (`lp_space.py`)",
    "optclip.projections": "Parameter projections (`projections.py`)",
    "optclip.frank_wolfe": "Frank-Wolfe (`frank_wolfe.py`)",
    "optclip.skip_spikes": "Spike protection: skipping steps (`skip_spikes.py`)",
    "optclip.adagc": "Spike protection: AdaGC (`adagc.py`)",
    "optclip.moment_clip": "Spike protection: moment-aware clipping (`moment_clip.py`)",
    "optclip.unitwise": "Unit-wise clipping and Flax unit axes (`unitwise.py`)",
}


def api_markdown() -> str:
    optclip = importlib.import_module("optclip")
    by_module: dict[str, list[str]] = {}
    for name in optclip.__all__:
        obj = getattr(optclip, name)  # AttributeError: a name in __all__ that is not exported
        module = getattr(obj, "__module__", "optclip")
        by_module.setdefault(module, []).append(name)
    order = list(SECTIONS) + sorted(set(by_module) - set(SECTIONS))
    lines = []
    for module in order:
        if module not in by_module:
            continue
        lines += [f"## {SECTIONS.get(module, f'`{module}`')}", ""]
        for name in by_module[module]:
            lines += [f"::: optclip.{name}", ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, api_markdown())
    return markdown
