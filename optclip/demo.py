"""Taming loss spikes: train a tiny character-level transformer once per clipping strategy.

``python -m optclip.demo`` (or ``make demo``) trains a small Flax NNX transformer on the source
code of the Python standard library that ships with the running interpreter (nothing is
downloaded), at a learning rate high enough to provoke loss spikes, once per strategy. A few
batches are corrupted on purpose (each window one repeated character, as from a broken data
shard; ``--bad-batches``). Every run sees the same initial weights and the same batches. It shows
a progress bar, prints a results table and writes, in the output folder:

* ``curves.png``: loss, raw gradient norm and the scale the strategy applied, per strategy;
* ``results.md`` / ``results.json``: the table;
* ``stats.jsonl``: one line per strategy and step with ``optclip.stats(opt_state)``.

Strategies whose transform is not available in this version of optclip are skipped with a note.

    python -m optclip.demo --steps 300 --strategies none,clip_by_global_norm,zclip --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optclip

VOCAB = 128  # ASCII; other bytes are mapped to 0
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


# ---------------------------------------------------------------------------------------------
# Strategies: name -> (description, factory). A factory that needs a transform optclip does not
# have raises AttributeError and the strategy is skipped.

def _require(name: str) -> Callable[..., optax.GradientTransformation]:
    if not hasattr(optclip, name):
        raise AttributeError(f"optclip.{name} is not available in this version")
    return getattr(optclip, name)


STRATEGIES: dict[str, tuple[str, Callable[[], optax.GradientTransformation]]] = {
    "none": ("no clipping", optax.identity),
    "clip_by_global_norm": ("global norm <= 1",
                            lambda: _require("clip_by_global_norm")(1.0)),
    "zclip": ("ZClip z > 2.5, no fixed cap",
              lambda: _require("zclip")(max_grad_norm=None)),
    "hist_clip": ("drytorch HistClipper (z-score)", lambda: _require("hist_clip")()),
    "clip_norm_by_ema": ("per-leaf norm <= 1.5x its EMA",
                         lambda: _require("clip_norm_by_ema")()),
    "quantile_clip": ("AutoClip, 0.9 quantile of past norms",
                      lambda: _require("quantile_clip")(0.9, history_length=200,
                                                        global_threshold=True)),
    # Not run by default (pass them with --strategies, or --strategies all):
    "standard_clip": ("AutoClip, 2 std of past norms",
                      lambda: _require("standard_clip")(2.0, history_length=200,
                                                        global_threshold=True)),
    "param_hist_clip": ("drytorch ParamHistClipper", lambda: _require("param_hist_clip")()),
    "normalize_by_ema": ("per-leaf norm = its EMA", lambda: _require("normalize_by_ema")()),
    "clip_norm_growth": ("per-leaf norm growth <= 1.5x/step",
                         lambda: _require("clip_norm_growth")()),
    "clip_norm": ("per-leaf norm <= 0.5", lambda: _require("clip_norm")(0.5)),
    "clip_value": ("|g| <= 0.01 elementwise", lambda: _require("clip_value")(0.01)),
}

DEFAULT_STRATEGIES = ("none", "clip_by_global_norm", "zclip", "hist_clip", "clip_norm_by_ema",
                      "quantile_clip")


@dataclasses.dataclass(frozen=True)
class Config:
    """What a run trains; every strategy uses the same configuration."""

    steps: int = 300
    seed: int = 0
    learning_rate: float = 0.03
    batch_size: int = 16
    seq_len: int = 64
    width: int = 64
    depth: int = 2
    heads: int = 4
    text_bytes: int = 1_000_000
    # Steps (0-based) whose batch is corrupted: every window one character repeated, as from a
    # broken data shard. The same for every strategy; steps beyond ``steps`` are ignored.
    bad_batches: tuple[int, ...] = (100, 170, 240)


# ---------------------------------------------------------------------------------------------
# Data: the standard library's own source.

def load_text(max_bytes: int = 1_000_000) -> np.ndarray:
    """The installed standard library's ``*.py`` files (sorted by name), as ASCII codes.

    Args:
      max_bytes: stop once this many bytes have been read.

    Returns:
      A ``uint8`` array of codes below :data:`VOCAB`.

    Example:
      >>> codes = load_text(10_000)
      >>> codes.dtype, len(codes) >= 5_000, int(codes.max()) < VOCAB
      (dtype('uint8'), True, True)
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under {stdlib}")
    codes = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8).copy()
    codes[codes >= VOCAB] = 0
    return codes


def batches(codes: np.ndarray, config: Config) -> np.ndarray:
    """All training windows, ``(steps, batch, seq_len + 1)``, drawn with ``config.seed``.

    The batches at ``config.bad_batches`` are corrupted: each window is one printable
    character repeated.

    Example:
      >>> data = batches(np.arange(1000, dtype=np.uint8) % 100, Config(steps=3, bad_batches=(1,)))
      >>> def repeated(batch): return bool((batch == batch[:, :1]).all())
      >>> data.shape, repeated(data[1]), repeated(data[0])
      ((3, 16, 65), True, False)
    """
    rng = np.random.default_rng(config.seed)
    starts = rng.integers(0, len(codes) - config.seq_len - 1,
                          size=(config.steps, config.batch_size))
    data = codes[starts[..., None] + np.arange(config.seq_len + 1)]
    for t in bad_steps(config):
        data[t] = rng.integers(32, 127, size=(config.batch_size, 1))
    return data


def bad_steps(config: Config) -> list[int]:
    """The corrupted steps that fall inside the run."""
    return sorted(t for t in set(config.bad_batches) if 0 <= t < config.steps)


# ---------------------------------------------------------------------------------------------
# Model.

class Block(nnx.Module):
    """Pre-LayerNorm attention + MLP block."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class CharTransformer(nnx.Module):
    """A causal transformer over bytes: ``(batch, time)`` codes -> ``(batch, time, VOCAB)``."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(VOCAB, config.width, rngs=rngs)
        self.positions = nnx.Embed(config.seq_len, config.width, rngs=rngs)
        self.blocks = nnx.List([Block(config.width, config.heads, rngs)
                                for _ in range(config.depth)])
        self.norm = nnx.LayerNorm(config.width, rngs=rngs)
        self.head = nnx.Linear(config.width, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


@functools.lru_cache(maxsize=4)
def _initial_state(config: Config) -> tuple[Any, Any]:
    def build():
        return CharTransformer(config, nnx.Rngs(config.seed))

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    # One compiled initialisation (eager init dispatches hundreds of small ops), shared by
    # every strategy of a run: they all start from the same weights.
    return graphdef, jax.jit(lambda: nnx.state(build()))()


def make_model(config: Config) -> CharTransformer:
    """The model for ``config``, its weights drawn from ``config.seed``."""
    graphdef, state = _initial_state(config)
    return nnx.merge(graphdef, state)  # arrays are immutable: sharing them is safe


# ---------------------------------------------------------------------------------------------
# Training.

@dataclasses.dataclass
class History:
    """Per-step records of one run."""

    name: str
    loss: np.ndarray
    grad_norm: np.ndarray       # global L2 norm of the raw gradient (before the strategy)
    update_norm: np.ndarray     # global L2 norm after the strategy (what Adam sees)
    clipped: np.ndarray         # bool: the strategy reported that it clipped this step
    step_time: np.ndarray       # seconds per step (the first, compiling, step excluded)
    stats: list[dict[str, float]]
    bad: tuple[int, ...] = ()   # steps whose batch was corrupted


def clipped_flag(step_stats: dict[str, Any]) -> Any:
    """Whether any transform in ``optclip.stats`` output reported clipping this step.

    Looks at the ``.../clipped`` (flag) and ``.../clipped_frac`` (fraction) entries.

    Example:
      >>> bool(clipped_flag({"zclip/clipped": True, "zclip/norm": 3.0}))
      True
      >>> bool(clipped_flag({}))
      False
    """
    flags = [jnp.asarray(v) > 0 for k, v in step_stats.items()
             if k.rsplit("/", 1)[-1] in ("clipped", "clipped_frac")]
    return jnp.any(jnp.stack(flags)) if flags else jnp.asarray(False)


@functools.lru_cache(maxsize=4)
def _gradient_step(config: Config) -> Callable:
    """``(params, window) -> (loss, grads)``, jitted once per model configuration.

    The model's forward and backward pass is the expensive part to compile; every strategy of a
    run shares this one compilation and compiles only its own (small) optimizer step.
    """
    graphdef, state = _initial_state(config)
    _, rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)[1:]

    def loss_fn(params, window):
        logits = nnx.merge(graphdef, params, rest)(window[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss_fn))


def train(name: str, strategy: optax.GradientTransformation, data: np.ndarray,
          config: Config, progress: Any = None) -> History:
    """Train a fresh model with ``optax.chain(strategy, optax.adam(lr))``.

    Each step runs the shared, jitted gradient computation and this strategy's optimizer step,
    jitted once; the latter returns the raw and post-strategy gradient norms and
    ``optclip.stats`` of the optimizer state.
    """
    model = make_model(config)
    params = nnx.state(model, nnx.Param)
    gradient_step = _gradient_step(config)
    adam = optax.adam(config.learning_rate)
    tx = optax.chain(strategy, adam)
    opt_state = jax.jit(tx.init)(params)  # one compilation instead of one per leaf shape

    @jax.jit
    def optimizer_step(params, opt_state, grads):
        # The two halves of ``tx`` run one after the other (the state is the chain's tuple) so
        # that the norm of what the strategy hands to Adam can be logged too.
        strategy_state, adam_state = opt_state
        clipped, strategy_state = strategy.update(grads, strategy_state, params)
        updates, adam_state = adam.update(clipped, adam_state, params)
        opt_state = (strategy_state, adam_state)
        params = optax.apply_updates(params, updates)
        step_stats = optclip.stats(opt_state)
        return params, opt_state, {
            "grad_norm": _tree_norm(grads), "update_norm": _tree_norm(clipped),
            "clipped": clipped_flag(step_stats), "stats": step_stats}

    def step(params, opt_state, window):
        loss, grads = gradient_step(params, window)
        params, opt_state, out = optimizer_step(params, opt_state, grads)
        return params, opt_state, {"loss": loss, **out}

    records, times = [], []
    for t in range(config.steps):
        start = time.perf_counter()
        params, opt_state, out = step(params, opt_state, data[t])
        out = jax.device_get(out)
        times.append(time.perf_counter() - start)
        records.append(out)
        if progress is not None:
            progress.update(1)
            if t % 10 == 0 or t == config.steps - 1:
                progress.set_postfix(loss=f"{float(out['loss']):.3f}",
                                     gnorm=f"{float(out['grad_norm']):.2g}")
    return History(
        name=name,
        loss=np.array([r["loss"] for r in records], np.float64),
        grad_norm=np.array([r["grad_norm"] for r in records], np.float64),
        update_norm=np.array([r["update_norm"] for r in records], np.float64),
        clipped=np.array([r["clipped"] for r in records], bool),
        step_time=np.array(times[1:] or times, np.float64),
        stats=[{k: float(v) for k, v in r["stats"].items()} for r in records],
        bad=tuple(bad_steps(config)),
    )


# ---------------------------------------------------------------------------------------------
# Results.

SPIKE_WINDOW = 20


AFTER_BAD = 5  # steps averaged after a corrupted batch


def summarize(history: History) -> dict[str, float]:
    """The table row of one run. Losses on corrupted batches are left out of the loss columns.

    * ``final_loss``: mean loss of the last ``SPIKE_WINDOW`` steps;
    * ``best_loss``: lowest ``SPIKE_WINDOW``-step running mean;
    * ``worst_spike``: largest ``loss[t] - median(loss[t-SPIKE_WINDOW:t])`` (nats), i.e. how far
      one step's loss jumped above where training just was (a non-finite loss counts as inf);
    * ``after_bad``: mean over the corrupted batches of how much the loss of the next
      ``AFTER_BAD`` steps rose above the median of the ``SPIKE_WINDOW`` steps before it
      (the damage one bad batch did; NaN without corrupted batches);
    * ``clipped_frac``: fraction of steps on which the strategy reported clipping;
    * ``median_step_ms``: median wall time of a step, compilation excluded.

    Example:
      >>> loss = np.r_[np.full(30, 2.0), 5.0, np.full(9, 2.0)]
      >>> h = History("x", loss, loss, loss, np.zeros(40, bool), np.full(39, 0.01), [])
      >>> row = summarize(h)
      >>> row["worst_spike"], row["final_loss"], row["clipped_frac"], row["median_step_ms"]
      (3.0, 2.15, 0.0, 10.0)
      >>> summarize(History("x", loss, loss, loss, np.zeros(40, bool), np.ones(39), [], bad=(29,)))[
      ...     "after_bad"]
      0.6
    """
    loss = np.where(np.isfinite(history.loss), history.loss, np.inf)
    clean = loss.copy()
    clean[list(history.bad)] = np.nan
    w = min(SPIKE_WINDOW, max(len(loss) // 2, 1))
    windows = np.lib.stride_tricks.sliding_window_view(clean, w)
    running = [np.nanmean(x) for x in windows if not np.isnan(x).all()]
    spikes = [clean[t] - np.nanmedian(clean[t - w:t]) for t in range(w, len(loss))
              if not np.isnan(clean[t]) and not np.isnan(clean[t - w:t]).all()]
    damage = [np.nanmean(clean[t + 1:t + 1 + AFTER_BAD]) - np.nanmedian(clean[max(t - w, 0):t])
              for t in history.bad if 0 < t < len(loss) - 1]
    return {
        "final_loss": float(np.nanmean(clean[-w:])),
        "best_loss": float(np.min(running)) if running else float("nan"),
        "worst_spike": float(np.max(spikes)) if spikes else 0.0,
        "after_bad": float(np.mean(damage)) if damage else float("nan"),
        "clipped_frac": float(np.mean(history.clipped)),
        "median_step_ms": float(np.median(history.step_time) * 1e3),
    }


COLUMNS = (("strategy", "{}"), ("final loss", "{:.3f}"), ("best loss", "{:.3f}"),
           ("worst spike", "{:.3f}"), ("after bad batch", "{:+.3f}"), ("clipped", "{:.0%}"),
           ("median step ms", "{:.1f}"))


def results_table(rows: dict[str, dict[str, float]]) -> str:
    """A Markdown table, one line per strategy."""
    keys = ("final_loss", "best_loss", "worst_spike", "after_bad", "clipped_frac",
            "median_step_ms")
    lines = ["| " + " | ".join(c for c, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for name, row in rows.items():
        cells = [name] + [fmt.format(row[k]) for (_, fmt), k in zip(COLUMNS[1:], keys, strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def smooth(x: np.ndarray, width: int = 10) -> np.ndarray:
    """Trailing moving average (same length as ``x``); NaN entries are skipped.

    Example:
      >>> smooth(np.array([1.0, 3.0, np.nan, 5.0]), width=2).tolist()
      [1.0, 2.0, 3.0, 5.0]
    """
    x = np.asarray(x, np.float64)
    valid = np.isfinite(x)
    sums = np.cumsum(np.r_[0.0, np.where(valid, x, 0.0)])
    counts = np.cumsum(np.r_[0, valid])
    hi = np.arange(1, len(x) + 1)
    lo = np.maximum(hi - width, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums[hi] - sums[lo]) / (counts[hi] - counts[lo])


def plot(histories: Sequence[History], path: str | None = None):
    """Loss, raw gradient norm and the scale each strategy applied (norm after / raw), per strategy.

    Returns the matplotlib figure; writes it to ``path`` when given.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_raw, ax_after) = plt.subplots(
        3, 1, figsize=(11, 10), sharex=True, gridspec_kw={"height_ratios": [1.4, 1, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, h in enumerate(histories):
        c = colors[i % len(colors)]
        steps = np.arange(1, len(h.loss) + 1)
        clean = h.loss.copy()
        clean[list(h.bad)] = np.nan  # the loss on a corrupted batch says nothing about the model
        ax_loss.plot(steps, clean, color=c, alpha=0.25, lw=0.8)
        ax_loss.plot(steps, smooth(clean), color=c, lw=1.6, label=h.name)
        ax_raw.plot(steps, h.grad_norm, color=c, lw=0.9, alpha=0.8, label=h.name)
        with np.errstate(invalid="ignore", divide="ignore"):
            ax_after.plot(steps, h.update_norm / h.grad_norm, color=c, lw=0.9, alpha=0.8,
                          label=h.name)
    settled = [np.delete(h.loss, list(h.bad))[len(h.loss) // 10:] for h in histories]
    finite = np.concatenate([x[np.isfinite(x)] for x in settled] or [[1.0]])
    if finite.size:
        ax_loss.set_ylim(np.percentile(finite, 0.5) - 0.1, np.percentile(finite, 99.5) + 0.15)
    ax_loss.set_ylabel("training loss (nats/char)\nfaint: per step, bold: 10-step mean")
    ax_loss.legend(ncol=3, fontsize=8)
    for ax, what in ((ax_raw, "gradient norm\n(raw)"),
                     (ax_after, "scale applied\n(norm after / raw)")):
        ax.set_yscale("log")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3, which="both")
    ax_loss.grid(alpha=0.3)
    for t in sorted({t for h in histories for t in h.bad}):
        for ax in (ax_loss, ax_raw, ax_after):
            ax.axvline(t + 1, color="0.5", lw=0.8, ls=":")
    ax_after.set_xlabel("step (dotted: corrupted batches)")
    fig.suptitle("Character-level transformer on the Python standard library, "
                 "Adam at a spiky learning rate")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


# ---------------------------------------------------------------------------------------------
# Command line.

def available(names: Sequence[str]) -> tuple[dict[str, optax.GradientTransformation],
                                             dict[str, str]]:
    """Build the named strategies; returns ``(built, skipped name -> reason)``."""
    built, skipped = {}, {}
    for name in names:
        if name not in STRATEGIES:
            raise SystemExit(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        try:
            built[name] = STRATEGIES[name][1]()
        except (AttributeError, TypeError, ValueError) as err:
            skipped[name] = str(err)
    return built, skipped


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m optclip.demo", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = Config()
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    parser.add_argument(
        "--strategies", default=",".join(DEFAULT_STRATEGIES),
        help=f"comma-separated, or 'all'; known: {', '.join(STRATEGIES)}")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="initial weights and batch order")
    parser.add_argument("--out", default="demo_out", help="output folder")
    parser.add_argument("--lr", type=float, default=defaults.learning_rate,
                        help="Adam learning rate (high on purpose)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--width", type=int, default=defaults.width, help="model width")
    parser.add_argument("--depth", type=int, default=defaults.depth, help="transformer blocks")
    parser.add_argument("--bad-batches", default=",".join(map(str, defaults.bad_batches)),
                        help="comma-separated 0-based steps whose batch is corrupted ('' for none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    config = Config(steps=args.steps, seed=args.seed, learning_rate=args.lr,
                    batch_size=args.batch_size, seq_len=args.seq_len, width=args.width,
                    depth=args.depth,
                    bad_batches=tuple(int(t) for t in args.bad_batches.split(",") if t.strip()))
    names = list(STRATEGIES) if args.strategies == "all" else [
        s.strip() for s in args.strategies.split(",") if s.strip()]
    strategies, skipped = available(names)
    for name, reason in skipped.items():
        print(f"note: skipping strategy {name!r}: {reason}")
    if not strategies:
        raise SystemExit("no strategy to run")

    os.makedirs(args.out, exist_ok=True)
    data = batches(load_text(Config.text_bytes), config)
    print(f"optclip {optclip.__version__} demo: {len(strategies)} strategies x {config.steps} "
          f"steps, batch {config.batch_size}x{config.seq_len} chars, "
          f"Adam lr {config.learning_rate:g}, on {jax.devices()[0].platform}")

    try:
        from tqdm.auto import tqdm
    except ImportError:  # the [demo] extra installs tqdm; run without a bar otherwise
        tqdm = None

    histories, rows = [], {}
    started = time.perf_counter()
    with open(os.path.join(args.out, "stats.jsonl"), "w") as log:
        for name, strategy in strategies.items():
            bar = None
            if tqdm is not None and not args.no_progress:
                bar = tqdm(total=config.steps, desc=f"{name:>20}", unit="step", leave=True)
            history = train(name, strategy, data, config, bar)
            if bar is not None:
                bar.close()
            for t, step_stats in enumerate(history.stats):
                log.write(json.dumps({"strategy": name, "step": t + 1,
                                      "loss": float(history.loss[t]),
                                      "grad_norm": float(history.grad_norm[t]),
                                      **step_stats}) + "\n")
            histories.append(history)
            rows[name] = summarize(history)

    table = results_table(rows)
    print()
    print(table)
    bad = ", ".join(str(t + 1) for t in bad_steps(config)) or "none"
    print(f"\nLosses on the corrupted batches (steps {bad}) are left out. worst spike: largest "
          f"jump of one step's loss above the median of the previous {SPIKE_WINDOW} steps; "
          f"after bad batch: mean rise of the loss over the "
          f"{AFTER_BAD} steps after a corrupted batch; clipped: steps on which optclip.stats "
          f"reported clipping.")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(config), "results": rows,
                   "skipped": skipped}, f, indent=2)
    png = os.path.join(args.out, "curves.png")
    plot(histories, png)
    print(f"wrote {png}, results.md, results.json and stats.jsonl to {args.out}/ "
          f"in {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
