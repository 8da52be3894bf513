"""Taming loss spikes: train a tiny character-level transformer once per clipping strategy.

``make demo`` (``python examples/char_transformer_demo.py``) trains a small Flax NNX transformer
on the source code of the Python standard library that ships with the running interpreter
(nothing is downloaded), with Adam, once per strategy and seed. A few batches are corrupted on
purpose (the whole batch one repeated character, as from a broken data shard;
``--bad-batches``).
For a given seed every strategy starts from the same weights and sees the same batches; the
seeds run side by side (``jax.vmap``). Each step is the model's forward/backward pass (compiled
once for all strategies) and the strategy's ``nnx.Optimizer.update`` (compiled per strategy),
both compiled and run once before the timed loop. It prints the data's own character-bigram
loss as a baseline, a table of mean +/- spread over the seeds with the differences that hold on
every seed, and writes, in ``--out``:

* ``curves.png``: loss, damage around the corrupted batches, Adam's second moment and the scale
  each strategy applied;
* ``results.md`` / ``results.json``: the table and the per-seed numbers;
* ``stats.jsonl``: one line per strategy, seed and step with ``optclip.stats(opt_state)``.

To compare another strategy, add one line to :data:`STRATEGIES`.

    python examples/char_transformer_demo.py --steps 200 --seeds 0 --strategies none,zclip
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optclip

VOCAB = 128  # ASCII; other bytes are mapped to 0


# ---------------------------------------------------------------------------------------------
# Strategies: the one place to add a transform to the comparison. Each entry is a label (what it
# does, with the settings used) and a factory; ``default`` strategies run without --strategies.
# A factory returns either a transform that runs before Adam, or an ``AroundAdam`` for the
# spike-protection transforms that wrap Adam itself (skipping its update, reading its moments).

class AroundAdam(NamedTuple):
    """A strategy that wraps the Adam optimizer instead of running before it."""
    wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Strategy:
    label: str
    make: Callable[[], optax.GradientTransformation | AroundAdam]
    default: bool = True


STRATEGIES: dict[str, Strategy] = {
    "none": Strategy("no clipping", optax.identity),
    "clip_by_global_norm": Strategy("global norm <= 1",
                                    lambda: optclip.clip_by_global_norm(1.0)),
    "zclip": Strategy("ZClip: z-score > 2.5 of the norm's EMA, no fixed cap",
                      lambda: optclip.zclip(max_grad_norm=None)),
    "hist_clip": Strategy("drytorch HistClipper: z-score of the norm history",
                          lambda: optclip.hist_clip(), default=False),
    # Clips each leaf's norm to the norm of the EMA of that leaf's *gradient vectors*; gradient
    # noise averages out in that EMA, so it scales nearly every step (by about 0.1 here). Adam
    # after it undoes a constant scale: what matters is the relative scale at a spike.
    "clip_norm_by_ema": Strategy("per-leaf norm <= norm of the gradient's EMA (beta 0.99)",
                                 lambda: optclip.clip_norm_by_ema(), default=False),
    "quantile_clip": Strategy("AutoClip: global norm <= 0.9 quantile of the last 200",
                              lambda: optclip.quantile_clip(0.9, history_length=200,
                                                            global_threshold=True)),
    # Spike protection: skip the step, or clip against Adam's own second moment.
    "skip_spikes": Strategy("skip the step when the norm's z-score > 6 (Adam's state untouched)",
                            lambda: AroundAdam(optclip.skip_spikes)),
    "adagc": Strategy("AdaGC: per-tensor norm <= 1.05x its EMA (global <= 1 in warm-up)",
                      lambda: optclip.adagc(lambda_abs=1.0, warmup_steps=20)),
    "spam_clip": Strategy("SPAM: |g| <= sqrt(5000 nu) elementwise, before Adam's moments",
                          lambda: AroundAdam(optclip.spam_clip)),
    "stable_adamw_clip": Strategy("StableAdamW: per-tensor update / max(1, RMS(g^2/nu))",
                                  lambda: AroundAdam(optclip.stable_adamw_clip)),
    "adamw_clip": Strategy("AdamWClip: |g| <= mean + 3 std from Adam's moments",
                           lambda: AroundAdam(optclip.adamw_clip), default=False),
    # Not run by default (pass them with --strategies, or --strategies all):
    "standard_clip": Strategy("AutoClip: global norm <= mean + 2 std of the last 200",
                              lambda: optclip.standard_clip(2.0, history_length=200,
                                                            global_threshold=True),
                              default=False),
    "param_hist_clip": Strategy("drytorch ParamHistClipper (per leaf)",
                                lambda: optclip.param_hist_clip(), default=False),
    "normalize_by_ema": Strategy("per-leaf norm = norm of the gradient's EMA",
                                 lambda: optclip.normalize_by_ema(), default=False),
    "clip_norm_growth": Strategy("per-leaf norm growth <= 1.5x per step",
                                 lambda: optclip.clip_norm_growth(), default=False),
    "clip_norm": Strategy("per-leaf norm <= 0.5", lambda: optclip.clip_norm(0.5),
                          default=False),
    "clip_value": Strategy("|g| <= 0.01 elementwise", lambda: optclip.clip_value(0.01),
                           default=False),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """What a run trains; every strategy uses the same configuration."""

    steps: int = 400
    seeds: tuple[int, ...] = (0, 1, 2)
    learning_rate: float = 0.01     # peak; linear warm-up, then cosine decay to a tenth
    warmup_steps: int = 30
    batch_size: int = 16
    seq_len: int = 64
    width: int = 48
    depth: int = 2
    heads: int = 4
    text_bytes: int = 1_000_000
    # Steps (0-based) whose batch is corrupted: one character repeated over the whole batch, as
    # from a broken data shard. The same for every strategy and seed; steps past the run are
    # ignored.
    bad_batches: tuple[int, ...] = (200, 260, 320)


# ---------------------------------------------------------------------------------------------
# Data: the standard library's own source.

def load_text(max_bytes: int = 1_000_000) -> np.ndarray:
    """The installed standard library's ``*.py`` files (sorted by name), as ASCII codes."""
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


def bigram_loss(codes: np.ndarray) -> float:
    """Cross-entropy (nats/char) of the text's own bigram table on the text itself: the loss of
    a model that predicts each character from the previous one only, fitted to all the data."""
    pairs = np.zeros((VOCAB, VOCAB))
    np.add.at(pairs, (codes[:-1], codes[1:]), 1)
    rows = pairs.sum(axis=1, keepdims=True)
    seen = pairs > 0
    return float(-(pairs[seen] * np.log(pairs[seen] / np.broadcast_to(rows, pairs.shape)[seen]))
                 .sum() / pairs.sum())


def bad_steps(config: Config) -> list[int]:
    """The corrupted steps that fall inside the run."""
    return sorted(t for t in set(config.bad_batches) if 0 <= t < config.steps)


def batches(codes: np.ndarray, config: Config, seed: int) -> np.ndarray:
    """All training windows of one seed, ``(steps, batch, seq_len + 1)``; the batches at
    ``config.bad_batches`` are corrupted (the whole batch one printable character repeated)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(codes) - config.seq_len - 1,
                          size=(config.steps, config.batch_size))
    data = codes[starts[..., None] + np.arange(config.seq_len + 1)]
    for t in bad_steps(config):
        data[t] = rng.integers(32, 127)
    return data


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


# ---------------------------------------------------------------------------------------------
# Training: model and nnx.Optimizer, one compiled step for all seeds.

class AfterStrategy(NamedTuple):
    norm: jax.Array  # global norm of what the strategy handed on (for the "scale applied" plot)


def record_norm() -> optax.GradientTransformation:
    """Identity that keeps the global norm of its input in its state (read by the demo only)."""
    return optax.GradientTransformation(
        lambda params: AfterStrategy(jnp.zeros([], jnp.float32)),
        lambda updates, state, params=None: (updates, AfterStrategy(optax.tree.norm(updates))))


def make_optimizer(strategy: optax.GradientTransformation | AroundAdam,
                   config: Config) -> optax.GradientTransformation:
    """``strategy``, then Adam with a linear warm-up and cosine decay (or Adam wrapped by the
    strategy, for an ``AroundAdam``)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate / 10)
    adam = optax.adam(schedule)
    if isinstance(strategy, AroundAdam):
        return optax.chain(record_norm(), strategy.wrap(adam))
    return optax.chain(strategy, record_norm(), adam)


def _plain(tree: Any) -> Any:
    """``tree`` with nnx Variables replaced by their arrays (optax's state types kept)."""
    return jax.tree.map(lambda x: x[...] if isinstance(x, nnx.Variable) else x, tree,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def adam_nu(opt_state: Any) -> dict[str, jax.Array]:
    """Mean and max over all elements of the last ``nu`` (Adam's second moment) in
    ``opt_state``, found by name, so any optimizer whose state has a ``nu`` field works; NaN
    when the chain has none."""
    found = optax.tree_utils.tree_get_all_with_path(_plain(opt_state), "nu")
    if not found:
        return {"nu_mean": jnp.asarray(jnp.nan), "nu_max": jnp.asarray(jnp.nan)}
    leaves = jax.tree.leaves(found[-1][1])
    return {"nu_mean": sum(jnp.sum(x) for x in leaves) / sum(x.size for x in leaves),
            "nu_max": jnp.max(jnp.stack([jnp.max(x) for x in leaves]))}


def _after_strategy_norm(opt_state: Any) -> jax.Array:
    states = jax.tree.leaves(_plain(opt_state), is_leaf=lambda x: isinstance(x, AfterStrategy))
    return next(x for x in states if isinstance(x, AfterStrategy)).norm


def _model(config: Config, key: jax.Array) -> CharTransformer:
    return CharTransformer(config, nnx.Rngs(key))


def _graphdef(make: Callable[[], Any]) -> Any:
    return nnx.graphdef(nnx.eval_shape(make))


def _aot(fn: Callable, *shapes: Any) -> tuple[Callable, float]:
    """``jax.jit(jax.vmap(fn))`` compiled for ``shapes`` before use; returns it and the seconds
    the compilation took."""
    start = time.perf_counter()
    compiled = jax.jit(jax.vmap(fn)).lower(*shapes).compile()
    return compiled, time.perf_counter() - start


@dataclasses.dataclass
class Models:
    """The models of every seed (stacked) and their gradient step, compiled once for all
    strategies: the expensive part to compile."""

    config: Config
    graphdef: Any
    init_state: Any                 # nnx.state of the models, leading axis = seed
    gradient: Callable              # (model state, windows) -> (loss, grads)
    compile_s: float


def build_models(config: Config) -> Models:
    """Initialise one model per seed and compile the forward/backward pass, ahead of time."""
    graphdef = _graphdef(lambda: _model(config, jax.random.key(0)))
    keys = jnp.asarray(config.seeds, jnp.uint32)
    init_state = jax.jit(jax.vmap(lambda s: nnx.state(_model(config, jax.random.key(s)))))(keys)

    def gradient(model_state, window):
        model = nnx.merge(graphdef, model_state)

        def loss_fn(model):
            logits = model(window[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:]).mean()

        return nnx.value_and_grad(loss_fn)(model)

    windows = jax.ShapeDtypeStruct((len(config.seeds), config.batch_size, config.seq_len + 1),
                                   jnp.int32)
    compiled, seconds = _aot(gradient, jax.eval_shape(lambda: init_state), windows)
    return Models(config, graphdef, init_state, compiled, seconds)


def compile_update(models: Models, tx: optax.GradientTransformation):
    """``(opt_state, update, seconds)`` for ``tx``: the stacked ``nnx.Optimizer`` state of every
    seed and ``update(model_state, opt_state, grads) -> (model_state, opt_state, logs)``, which
    runs ``optimizer.update(model, grads)``, compiled ahead of time."""
    make_optimizer_for = lambda model: nnx.Optimizer(model, tx, wrt=nnx.Param)
    opt_graphdef = _graphdef(lambda: make_optimizer_for(_model(models.config,
                                                                jax.random.key(0))))
    opt_state = jax.jit(jax.vmap(lambda m: nnx.state(make_optimizer_for(
        nnx.merge(models.graphdef, m)))))(models.init_state)

    def update(model_state, opt_state, grads):
        model = nnx.merge(models.graphdef, model_state)
        optimizer = nnx.merge(opt_graphdef, opt_state)
        optimizer.update(model, grads)  # the nnx.Optimizer idiom: strategy and Adam in one call
        logs = {"grad_norm": optax.tree.norm(grads),
                "update_norm": _after_strategy_norm(optimizer.opt_state),
                "stats": optclip.stats(optimizer.opt_state), **adam_nu(optimizer.opt_state)}
        return nnx.state(model), nnx.state(optimizer), logs

    shapes = jax.eval_shape(lambda: (models.init_state, opt_state))
    grads = jax.eval_shape(lambda: nnx.state(models.init_state, nnx.Param))
    compiled, seconds = _aot(update, *shapes, grads)
    return opt_state, compiled, seconds


@dataclasses.dataclass
class History:
    """Per-step records of one strategy, one row per seed."""

    name: str
    seeds: tuple[int, ...]
    loss: np.ndarray         # (seeds, steps)
    grad_norm: np.ndarray    # global L2 norm of the raw gradient
    update_norm: np.ndarray  # global L2 norm after the strategy (what Adam sees)
    nu_mean: np.ndarray      # mean of Adam's second moment over all elements, after the step
    nu_max: np.ndarray       # its largest element
    clipped: np.ndarray      # bool: the strategy reported clipping
    stats: list[list[dict[str, float]]]  # [seed][step]
    step_ms: float           # median wall time of one step of all seeds
    first_step_ms: float     # the first step's (nothing left to compile: as fast as the rest)
    compile_s: float         # compiling this strategy's update (the model's pass is shared)
    bad: tuple[int, ...] = ()


def clipped_flag(step_stats: dict[str, np.ndarray]) -> np.ndarray:
    """Per seed: whether any transform in ``optclip.stats`` reported clipping (or skipping)
    this step."""
    flags = [np.asarray(v) > 0 for k, v in step_stats.items()
             if k.rsplit("/", 1)[-1] in ("clipped", "clipped_frac", "clipped_fraction", "skipped")]
    return np.any(flags, axis=0) if flags else np.zeros((), bool)


def train(name: str, strategy: optax.GradientTransformation | AroundAdam, data: np.ndarray,
          models: Models, progress: Any = None) -> History:
    """Train the models of every seed with ``make_optimizer(strategy)``; ``data`` is
    ``(seeds, steps, batch, seq_len + 1)``. Every step runs two compiled functions, both
    compiled before the first step: the shared forward/backward pass and this strategy's
    ``optimizer.update``."""
    config = models.config
    n = len(config.seeds)
    opt_state, update, compile_s = compile_update(models, make_optimizer(strategy, config))
    model_state = models.init_state
    # One untimed run of both compiled functions (result discarded): the first timed step then
    # costs what every other step costs (no compilation, buffers already allocated).
    jax.block_until_ready(update(model_state, opt_state,
                                 models.gradient(model_state, data[:, 0])[1]))
    records, times = [], []
    for t in range(config.steps):
        start = time.perf_counter()
        loss, grads = models.gradient(model_state, data[:, t])
        model_state, opt_state, logs = update(model_state, opt_state, grads)
        out = jax.device_get({"loss": loss, **logs})
        times.append(time.perf_counter() - start)
        records.append(out)
        if progress is not None:
            progress.update(1)
            if t % 20 == 0 or t == config.steps - 1:
                progress.set_postfix(loss=f"{float(np.mean(out['loss'])):.3f}")
    column = lambda key: np.stack([np.asarray(r[key], np.float64) for r in records], axis=1)
    per_step = [{k: np.asarray(v) for k, v in r["stats"].items()} for r in records]
    return History(
        name=name, seeds=tuple(config.seeds), loss=column("loss"),
        grad_norm=column("grad_norm"), update_norm=column("update_norm"),
        nu_mean=column("nu_mean"), nu_max=column("nu_max"),
        clipped=np.stack([np.broadcast_to(clipped_flag(s), (n,)) for s in per_step], axis=1),
        stats=[[{k: float(v[i]) for k, v in s.items()} for s in per_step] for i in range(n)],
        step_ms=float(np.median(times) * 1e3), first_step_ms=times[0] * 1e3,
        compile_s=compile_s,
        bad=tuple(bad_steps(config)))


# ---------------------------------------------------------------------------------------------
# Results: per-seed numbers, their mean and spread, and which differences hold on every seed.

BEFORE = 20  # steps before a corrupted batch whose median loss is the reference level
AFTER = 10   # steps after it over which the damage is averaged
ZOOM = (-5, 30)  # steps shown around a corrupted batch in the zoom panel


def _nanmean(x: np.ndarray, axis: Any = None) -> np.ndarray:
    """``np.nanmean`` that returns NaN for all-NaN slices without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis)


def _clean(loss: np.ndarray, bad: Sequence[int]) -> np.ndarray:
    """``loss`` with the corrupted batches' own losses (and non-finite values) as NaN."""
    clean = np.where(np.isfinite(loss), loss, np.nan)
    clean[..., list(bad)] = np.nan
    return clean


def around_bad(loss: np.ndarray, bad: Sequence[int], lo: int = ZOOM[0],
               hi: int = ZOOM[1]) -> np.ndarray:
    """Loss relative to its level before each corrupted batch: ``(..., len(bad), hi - lo)``,
    ``loss[t + k] - median(loss[t - BEFORE:t])`` for ``k`` in ``[lo, hi)`` (NaN outside the run
    and on corrupted batches).

    Example:
      >>> loss = np.r_[np.full(30, 2.0), 9.0, 2.5, 2.2, np.full(7, 2.0)]
      >>> around_bad(loss, [30], -1, 3).round(2).tolist()
      [[0.0, nan, 0.5, 0.2]]
    """
    clean = _clean(np.asarray(loss, np.float64), bad)
    out = np.full(clean.shape[:-1] + (len(bad), hi - lo), np.nan)
    for i, t in enumerate(bad):
        level = np.nanmedian(clean[..., max(t - BEFORE, 0):t], axis=-1)
        for j, k in enumerate(range(lo, hi)):
            if 0 <= t + k < clean.shape[-1]:
                out[..., i, j] = clean[..., t + k] - level
    return out


def summarize(history: History) -> dict[str, np.ndarray]:
    """Per seed: the table's numbers (one array entry per seed).

    * ``final_loss``: mean loss of the last 10% of the steps (nats/char);
    * ``damage``: mean rise of the loss over the ``AFTER`` steps after a corrupted batch above
      the median of the ``BEFORE`` steps before it, averaged over the corrupted batches;
    * ``peak_damage``: the largest such rise on one step;
    * ``clipped``: fraction of steps on which the strategy reported clipping.
    """
    clean = _clean(history.loss, history.bad)
    tail = max(len(history.loss[0]) // 10, 1)
    rows = {"final_loss": _nanmean(clean[:, -tail:], axis=1),
            "clipped": history.clipped.mean(axis=1)}
    if history.bad:
        rise = around_bad(history.loss, history.bad, 1, AFTER + 1)
        rows["damage"] = _nanmean(rise, axis=(1, 2))
        rows["peak_damage"] = np.nanmax(rise, axis=(1, 2))
    return rows


COLUMNS = {"final_loss": ("final loss", "{:.3f}"), "damage": ("damage after bad batch", "{:+.3f}"),
           "peak_damage": ("peak damage", "{:+.3f}"), "clipped": ("steps clipped", "{:.0%}")}


def mean_spread(x: np.ndarray, fmt: str) -> str:
    """``mean ± half the range`` over the seeds (the mean alone for one seed).

    Example:
      >>> mean_spread(np.array([1.0, 1.2, 1.1]), "{:.2f}")
      '1.10 ± 0.10'
    """
    x = np.asarray(x, np.float64)
    if x.size < 2:
        return fmt.format(x.mean())
    spread = (np.nanmax(x) - np.nanmin(x)) / 2
    return f"{fmt.format(np.nanmean(x))} ± {fmt.format(spread).lstrip('+')}"


def results_table(rows: dict[str, dict[str, np.ndarray]], step_ms: dict[str, float]) -> str:
    """A Markdown table, one line per strategy: mean ± half the range over the seeds."""
    keys = [k for k in COLUMNS if all(k in r for r in rows.values())]
    head = ["strategy"] + [COLUMNS[k][0] for k in keys] + ["ms/step (all seeds)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        cells = [name] + [mean_spread(row[k], COLUMNS[k][1]) for k in keys]
        lines.append("| " + " | ".join(cells + [f"{step_ms[name]:.0f}"]) + " |")
    return "\n".join(lines)


def verdicts(rows: dict[str, dict[str, np.ndarray]], baseline: str = "none") -> list[str]:
    """Paired comparisons with ``baseline`` (the same seed: the same weights and batches).
    A difference counts only when it has the same sign on every seed and its mean exceeds half
    the range of the per-seed differences; otherwise it is reported as within noise.

    Example:
      >>> rows = {"none": {"damage": np.array([0.3, 0.5, 0.4])},
      ...         "a": {"damage": np.array([0.1, 0.2, 0.1])},
      ...         "b": {"damage": np.array([0.35, 0.6, 0.3])},
      ...         "c": {"damage": np.array([0.29, 0.2, 0.39])}}
      >>> for line in verdicts(rows):
      ...     print(line)
      damage after bad batch: a -0.267 (lower on 3/3 seeds)
      damage after bad batch: b within noise of none (-0.100 .. +0.100)
      damage after bad batch: c within noise of none (-0.300 .. -0.010)
    """
    if baseline not in rows:
        return []
    if min(r.size for r in rows[baseline].values()) < 2:
        return ["one seed: run several (--seeds) to tell differences from noise"]
    out = []
    for key in ("damage", "final_loss"):
        if key not in rows[baseline]:
            continue
        base = rows[baseline][key]
        for name, row in rows.items():
            if name == baseline:
                continue
            diff = row[key] - base
            n = diff.size
            if holds(diff):
                word = "lower" if np.mean(diff) < 0 else "higher"
                out.append(f"{COLUMNS[key][0]}: {name} {np.mean(diff):+.3f} ({word} on {n}/{n} "
                           "seeds)")
            else:
                out.append(f"{COLUMNS[key][0]}: {name} within noise of {baseline} "
                           f"({np.min(diff):+.3f} .. {np.max(diff):+.3f})")
    return out


MIN_EFFECT = 0.01  # nats/char: smaller differences are reported as negligible


def holds(diff: np.ndarray) -> bool:
    """A paired difference counts: the same sign on every seed, its mean beyond half the range
    of the per-seed differences (several seeds needed) and at least ``MIN_EFFECT``."""
    diff = np.asarray(diff, np.float64)
    same_sign = bool(np.all(diff < 0) or np.all(diff > 0))
    mean = abs(diff.mean())
    return (diff.size > 1 and same_sign and mean >= MIN_EFFECT
            and mean > (diff.max() - diff.min()) / 2)


def among(rows: dict[str, dict[str, np.ndarray]], baseline: str = "none") -> list[str]:
    """Per metric, the pairs of strategies other than ``baseline`` whose difference holds on
    every seed (:func:`holds`); every other pair is within noise.

    Example:
      >>> rows = {"a": {"damage": np.array([0.1, 0.2])}, "b": {"damage": np.array([0.3, 0.5])},
      ...         "c": {"damage": np.array([0.12, 0.15])}}
      >>> among(rows)
      ['damage after bad batch: a < b, c < b; other pairs within noise']
    """
    names = [n for n in rows if n != baseline]
    out = []
    for key in ("damage", "final_loss"):
        if len(names) < 2 or not all(key in rows[n] for n in names):
            continue
        found = [f"{a} < {b}" if np.mean(rows[a][key] - rows[b][key]) < 0 else f"{b} < {a}"
                 for i, a in enumerate(names) for b in names[i + 1:]
                 if holds(rows[a][key] - rows[b][key])]
        rest = "; other pairs within noise" if found else "every pair within noise"
        out.append(f"{COLUMNS[key][0]}: {', '.join(found)}{rest}")
    return out


def smooth(x: np.ndarray, width: int = 10) -> np.ndarray:
    """Trailing moving average along the last axis (same shape); NaN entries are skipped.

    Example:
      >>> smooth(np.array([1.0, 3.0, np.nan, 5.0]), width=2).tolist()
      [1.0, 2.0, 3.0, 5.0]
    """
    x = np.asarray(x, np.float64)
    valid = np.isfinite(x)
    pad = [(0, 0)] * (x.ndim - 1) + [(1, 0)]
    sums = np.cumsum(np.pad(np.where(valid, x, 0.0), pad), axis=-1)
    counts = np.cumsum(np.pad(valid, pad), axis=-1)
    hi = np.arange(1, x.shape[-1] + 1)
    lo = np.maximum(hi - width, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums[..., hi] - sums[..., lo]) / (counts[..., hi] - counts[..., lo])


def _band(ax, x, runs, color, label=None, lw=1.5, alpha=0.15):
    """Mean over the seeds (line) and their min..max (shaded)."""
    with warnings.catch_warnings():  # all-NaN columns (corrupted batches) stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, lo, hi = np.nanmean(runs, 0), np.nanmin(runs, 0), np.nanmax(runs, 0)
    ax.plot(x, mean, color=color, lw=lw, label=label)
    if len(runs) > 1:
        ax.fill_between(x, lo, hi, color=color, alpha=alpha, lw=0)


def plot(histories: Sequence[History], baseline: float | None = None, path: str | None = None):
    """Four panels: the loss (10-step mean); the loss around the corrupted batches relative to
    its level before them; Adam's second moment relative to before them; the scale each
    strategy applied (norm after / raw). Lines: mean over seeds; shading: their range.
    Returns the matplotlib figure; writes it to ``path`` when given."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    (ax_loss, ax_zoom), (ax_nu, ax_scale) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bad = sorted({t for h in histories for t in h.bad})
    lags = np.arange(*ZOOM)
    for i, h in enumerate(histories):
        c = colors[i % len(colors)]
        steps = np.arange(1, h.loss.shape[1] + 1)
        _band(ax_loss, steps, smooth(_clean(h.loss, h.bad)), c, h.name)
        with np.errstate(invalid="ignore", divide="ignore"):
            _band(ax_scale, steps, smooth(h.update_norm / h.grad_norm, 5), c, h.name, lw=1)
        if h.bad:
            zoom = around_bad(h.loss, h.bad)           # (seeds, bad, lags)
            _band(ax_zoom, lags, smooth(_nanmean(zoom, axis=1), 3), c, h.name, alpha=0.07)
            nu = np.log2(around_bad_ratio(h.nu_max, h.bad))
            if np.isfinite(nu).any():
                _band(ax_nu, lags, _nanmean(nu, axis=1), c, h.name)
    if baseline is not None:
        ax_loss.axhline(baseline, color="k", lw=1, ls="--", label="bigram table")
    settled = np.concatenate([smooth(_clean(h.loss, h.bad))[:, len(h.loss[0]) // 5:].ravel()
                              for h in histories])
    settled = settled[np.isfinite(settled)]
    if settled.size:
        ax_loss.set_ylim(np.min(settled) - 0.05, max(np.max(settled), baseline or 0) + 0.1)
    ax_loss.set(ylabel="training loss (nats/char), 10-step mean", xlabel="step")
    for t in bad:
        ax_loss.axvline(t + 1, color="0.6", lw=0.8, ls=":")
        ax_scale.axvline(t + 1, color="0.6", lw=0.8, ls=":")
    ax_zoom.axhline(0, color="0.5", lw=0.8)
    ax_zoom.axvline(0, color="0.6", lw=0.8, ls=":")
    ax_zoom.set(xlabel="steps after a corrupted batch (its own loss left out)",
                ylabel="loss - median of the 20 steps before\n(3-step mean, all bad batches)")
    ax_nu.axvline(0, color="0.6", lw=0.8, ls=":")
    ax_nu.set(xlabel="steps after a corrupted batch",
              ylabel="log2 (Adam's largest nu / its value before)")
    ax_scale.set_yscale("log")
    ax_scale.set(xlabel="step (dotted: corrupted batches)",
                 ylabel="scale applied (norm after / raw)")
    for ax in axes.ravel():
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=8, ncol=2)
    seeds = len(histories[0].seeds) if histories else 0
    fig.suptitle(f"Character-level transformer on the Python standard library, Adam; "
                 f"{seeds} seed(s): line = mean, band = range", fontsize=11)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=72)
    return fig


def around_bad_ratio(x: np.ndarray, bad: Sequence[int]) -> np.ndarray:
    """``x[t + k] / x[t - 1]`` around each corrupted batch ``t``: ``(seeds, bad, lags)``."""
    out = np.full(x.shape[:-1] + (len(bad), ZOOM[1] - ZOOM[0]), np.nan)
    for i, t in enumerate(bad):
        for j, k in enumerate(range(*ZOOM)):
            if 0 <= t + k < x.shape[-1] and t >= 1:
                with np.errstate(invalid="ignore", divide="ignore"):
                    out[..., i, j] = x[..., t + k] / x[..., t - 1]
    return out


# ---------------------------------------------------------------------------------------------
# Command line.

def build(names: Sequence[str]) -> dict[str, optax.GradientTransformation | AroundAdam]:
    """Build the named strategies (an unknown name stops the demo with the list of names)."""
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    return {name: STRATEGIES[name].make() for name in names}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def build_parser() -> argparse.ArgumentParser:
    """The command line; every flag has a help text (``--help``)."""
    defaults = Config()
    known = "; ".join(f"{k}: {s.label}" + ("" if s.default else " (not default)")
                      for k, s in STRATEGIES.items())
    parser = argparse.ArgumentParser(
        prog="python examples/char_transformer_demo.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    parser.add_argument("--seeds", default=",".join(map(str, defaults.seeds)),
                        help="comma-separated seeds (initial weights and batch order), run "
                             "side by side")
    parser.add_argument(
        "--strategies", default=",".join(k for k, s in STRATEGIES.items() if s.default),
        help=f"comma-separated, or 'all'. Known: {known}")
    parser.add_argument("--out", default="demo_out", help="output folder")
    parser.add_argument("--lr", type=float, default=defaults.learning_rate,
                        help="Adam's peak learning rate (linear warm-up, cosine decay to a tenth)")
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                        help="learning-rate warm-up steps")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="windows per batch")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len,
                        help="characters per window (the model's context)")
    parser.add_argument("--width", type=int, default=defaults.width, help="model width")
    parser.add_argument("--depth", type=int, default=defaults.depth, help="transformer blocks")
    parser.add_argument("--bad-batches", default=",".join(map(str, defaults.bad_batches)),
                        help="comma-separated 0-based steps whose batch is corrupted ('' for none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    args = parse_args(argv)
    config = Config(steps=args.steps, seeds=_ints(args.seeds), learning_rate=args.lr,
                    warmup_steps=args.warmup_steps, batch_size=args.batch_size,
                    seq_len=args.seq_len, width=args.width, depth=args.depth,
                    bad_batches=_ints(args.bad_batches))
    if not config.seeds:
        raise SystemExit("no seed to run")
    names = list(STRATEGIES) if args.strategies == "all" else [
        s.strip() for s in args.strategies.split(",") if s.strip()]
    strategies = build(names)
    if not strategies:
        raise SystemExit("no strategy to run")

    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    codes = load_text(Config.text_bytes)
    baseline = bigram_loss(codes)
    data = np.stack([batches(codes, config, s) for s in config.seeds]).astype(np.int32)
    print(f"optclip {optclip.__version__} demo: {len(strategies)} strategies x "
          f"{len(config.seeds)} seeds x {config.steps} steps, batch {config.batch_size}x"
          f"{config.seq_len} chars, width {config.width}, {config.depth} blocks, Adam peak lr "
          f"{config.learning_rate:g}, on "
          f"{jax.devices()[0].platform}")
    print(f"baseline: the text's own character-bigram table scores {baseline:.3f} nats/char")
    models = build_models(config)
    print(f"compiled ahead of time, before any timed step: the model's forward/backward pass "
          f"once for all strategies and seeds ({models.compile_s:.1f} s), then each strategy's "
          f"optimizer.update (and run once, untimed)")

    try:
        from tqdm.auto import tqdm
    except ImportError:  # the [demo] extra installs tqdm; run without a bar otherwise
        tqdm = None

    histories, rows = [], {}
    with open(os.path.join(args.out, "stats.jsonl"), "w") as log:
        for name, strategy in strategies.items():
            bar = None
            if tqdm is not None and not args.no_progress:
                bar = tqdm(total=config.steps, desc=f"{name:>20}", unit="step", leave=True)
            history = train(name, strategy, data, models, bar)
            if bar is not None:
                bar.close()
            print(f"{name:>20}: update compiled in {history.compile_s:.1f} s; first step "
                  f"{history.first_step_ms:.0f} ms, median {history.step_ms:.0f} ms "
                  f"(all seeds)")
            for i, seed in enumerate(history.seeds):
                for t, step_stats in enumerate(history.stats[i]):
                    log.write(json.dumps({"strategy": name, "seed": seed, "step": t + 1,
                                          "loss": float(history.loss[i, t]),
                                          "grad_norm": float(history.grad_norm[i, t]),
                                          **step_stats}) + "\n")
            histories.append(history)
            rows[name] = summarize(history)

    table = results_table(rows, {h.name: h.step_ms for h in histories})
    print()
    print(table)
    bad = ", ".join(str(t + 1) for t in bad_steps(config)) or "none"
    print(f"\nmean ± half the range over seeds {', '.join(map(str, config.seeds))}. "
          f"final loss: last 10% of the steps (bigram baseline {baseline:.3f}); damage: mean "
          f"rise of the loss over the {AFTER} steps after a corrupted batch (steps {bad}) above "
          f"its median over the {BEFORE} before; peak damage: the largest rise on one step; "
          f"steps clipped: steps on which optclip.stats reported clipping or, for "
          f"skip_spikes, a skipped step (clip_norm_by_ema clips nearly every step by design).")
    found = verdicts(rows)
    if found:
        print("\nPaired with 'none' (same weights and batches per seed); a difference counts "
              "only if it has the same sign on every seed, its mean exceeds half the range "
              f"of the per-seed differences and is at least {MIN_EFFECT} nats:")
        for line in found:
            print(f"  {line}")
    between = among(rows)
    if between and len(config.seeds) > 1:
        print("\nBetween the other strategies, by the same rule:")
        for line in between:
            print(f"  {line}")
        found += between
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n\n" + "\n".join(f"* {line}" for line in found) + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(config), "bigram_baseline": baseline,
                   "results": {k: {m: v.tolist() for m, v in r.items()}
                               for k, r in rows.items()},
                   "verdicts": found}, f, indent=2)
    png = os.path.join(args.out, "curves.png")
    plot(histories, baseline, png)
    print(f"wrote {png}, results.md, results.json and stats.jsonl to {args.out}/ "
          f"in {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
