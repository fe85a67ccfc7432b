"""Pre-trains a LLaMA-style Flax model with jax_mlpo's offloaded AdamW (the main job).

Usage:
  python experiments/pretrain.py --config experiments/configs/tiny.yaml \
      [--set steps=100 --set offload.host_cache=4MiB] [--optimizer optax]
  python experiments/pretrain.py --config experiments/configs/7b-node.yaml --set model=280B \
      --dry-run --processes 64
  python experiments/pretrain.py --config ... --set checkpoint.every=50 [--resume]
  python experiments/pretrain.py --config ... --num-processes 2 --process-id K \
      --coordinator HOST:PORT        # one of N processes (or experiments/launch/*.sh)

The run directory holds the resolved config (config.yaml), the per-step metrics
(metrics-<optimizer>.jsonl), the summary table (summary-<optimizer>.md and .json), the plot
(pretrain-<optimizer>.png), unless tiers are given the optimizer's file tiers (tiers/) and, with
``checkpoint.every``, the checkpoints (checkpoints-<optimizer>/: params, optimizer state, data
position; ``--resume`` continues from the latest). With several processes (data parallel,
``jax.distributed``) every process runs the same config with ``batch_size`` rows of the global
batch, and process 0 writes the outputs with the slowest process's step time; every process
writes its shards of each checkpoint, which restores onto any process count. See
docs/pretrain.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax_mlpo  # noqa: E402
from experiments import report  # noqa: E402
from experiments.data import TokenDataset, batches  # noqa: E402
from jax_mlpo import checkpoint, distributed  # noqa: E402
from models import Llama, LlamaConfig, get_preset, loss_fn, param_count  # noqa: E402

logger = logging.getLogger("pretrain")


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and the fix."""


# -- configuration ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "default"
    """'default' (the Python standard library's sources, byte-level), 'text' (``paths`` are
    text files, byte-level) or 'tokens' (``paths`` is one pre-tokenized .npy or raw file)."""
    paths: tuple[str, ...] = ()
    """Text files (source 'text') or the one token file (source 'tokens')."""
    token_dtype: str = "uint16"
    """Element type of a raw token file: 'uint16' or 'uint32' (a .npy carries its own)."""
    check_vocab: bool = True
    """Scan a token file once for ids >= the model's vocab_size (bounded memory)."""
    cache_dir: str | None = None
    """Where text corpora are concatenated once; None means <run_dir>/../data-cache."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    peak_lr: float = 3e-3
    """Peak learning rate of the warm-up + cosine schedule."""
    warmup_steps: int = 30
    """Linear warm-up from 0 to peak_lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of peak_lr."""
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay (times the learning rate, as optax); not on 1-D params."""
    clip_norm: float = 1.0
    """Global gradient norm clipping."""


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    skip_steps: int = 5
    """Steps left out of the summary's medians (compilation, first writes)."""
    plot: bool = True
    """Write <run_dir>/pretrain-<optimizer>.png at the end (needs matplotlib)."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps and at the last step; 0: no checkpoints."""
    dir: str | None = None
    """Where the checkpoints go; None means <run_dir>/checkpoints-<optimizer>."""
    keep: int = 2
    """Checkpoints kept (the oldest are deleted)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    run_dir: str = "runs/tiny"
    """Output directory: config, metrics, summary, plot and default tiers."""
    model: str = "tiny"
    """A preset of models/presets.py (tiny, small, 125M, 1B, 7B, ..., 280B)."""
    model_overrides: dict = dataclasses.field(default_factory=dict)
    """LlamaConfig fields replacing the preset's, e.g. {layers: 4, remat: true}."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    batch_size: int = 8
    """Sequences per step per process (the global batch is batch_size x processes)."""
    seq_len: int = 128
    """Tokens per sequence; also the model's max_seq_len."""
    steps: int = 300
    seed: int = 0
    log_every: int = 10
    """Log a line (loss, times, tiers) every this many steps."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    offload: dict = dataclasses.field(default_factory=dict)
    """jax_mlpo.OffloadConfig fields; tiers default to <run_dir>/tiers/t0 and t1."""
    report: ReportConfig = dataclasses.field(default_factory=ReportConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Params, optimizer state and data position, saved in the background (jax_mlpo.checkpoint)."""


def _describe(value: Any) -> str:
    kinds = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an int"}
    kind = kinds.get(type(value), f"a {type(value).__name__}")
    return f"{value!r} ({kind})"


def _coerce(value: Any, hint: Any, key: str, default: Any) -> Any:
    """Checks ``value`` against the field type ``hint``; returns it converted (tuple, float)."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(
                f"config key '{key}' is a section, got {_describe(value)}; set its keys "
                f"instead, e.g. --set {key}.<key>=<value>"
            )
        return _build(hint, value, key)
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    example = f"--set {key}={default!r}" if default not in (None, (), {}) else f"--set {key}=..."
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and not isinstance(value, bool):
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    if hint is str and isinstance(value, str):
        return value
    if hint is dict and isinstance(value, dict | None):
        return dict(value or {})
    if typing.get_origin(hint) is tuple:
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(
            f"config key '{key}' must be a list of strings, got {_describe(value)}; "
            f"e.g. {key}: [a.txt, b.txt] in YAML or --set '{key}=[a.txt, b.txt]'"
        )
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    want = names.get(hint, "a mapping" if hint is dict else str(hint))
    raise ConfigError(f"config key '{key}' must be {want}, got {_describe(value)}; e.g. {example}")


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in data:
        if name not in fields:
            key = f"{where}.{name}" if where else name
            close = difflib.get_close_matches(str(name), fields, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                f"unknown config key '{key}'; {hint}valid keys{' in ' + where if where else ''}: "
                f"{', '.join(fields)}"
            )
    values = {}
    for name, value in data.items():
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else None
        values[name] = _coerce(value, hints[name], f"{where}.{name}" if where else name, default)
    return cls(**values)


def _set(data: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set steps=100")
    node = data
    *parents, leaf = key.split(".")
    parts = key.split(".")
    for i, p in enumerate(parents):
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"--set {item!r}: config key '{'.'.join(parts[: i + 1])}' is "
                f"{_describe(child)}, not a section, so it has no key '{parts[i + 1]}'"
            )
        node = child
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({e})") from None


def load_config(path: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads the YAML config, applies ``key=value`` overrides and validates the result.

    Args:
        path: a YAML file (see experiments/configs/), or None for the defaults.
        overrides: ``key=value`` strings; dotted keys reach into sections
            (``optimizer.peak_lr=1e-3``); values are parsed as YAML (``data.paths=[a, b]``).

    Returns:
        The validated config, with ``offload`` completed to every OffloadConfig field (tiers
        default to ``<run_dir>/tiers/t0`` and ``t1``). Nothing is created on disk.

    Raises:
        ConfigError: for a missing file, an unknown key, a value of the wrong type, a missing
            data file, an unknown model preset or an invalid model or offload setting. The
            message names the key and the fix.
    """
    data: dict[str, Any] = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} not found; see experiments/configs/*.yaml")
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of keys, got {data!r}")
    for item in overrides:
        _set(data, item)
    cfg = _build(RunConfig, data, "")
    _check(cfg)
    resolve_model(cfg)
    offload = dataclasses.asdict(resolve_offload(cfg))
    offload["tiers"] = list(offload["tiers"])
    return dataclasses.replace(cfg, offload=offload)


def _check(cfg: RunConfig) -> None:
    """Rejects values of the right type but out of range, and contradictions."""
    positive = {
        "batch_size": cfg.batch_size,
        "steps": cfg.steps,
        "log_every": cfg.log_every,
        "optimizer.peak_lr": cfg.optimizer.peak_lr,
        "optimizer.eps": cfg.optimizer.eps,
        "optimizer.clip_norm": cfg.optimizer.clip_norm,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key '{key}' must be positive, got {value!r}")
    non_negative = {
        "seed": cfg.seed,
        "optimizer.warmup_steps": cfg.optimizer.warmup_steps,
        "optimizer.weight_decay": cfg.optimizer.weight_decay,
        "optimizer.min_lr_ratio": cfg.optimizer.min_lr_ratio,
        "report.skip_steps": cfg.report.skip_steps,
        "checkpoint.every": cfg.checkpoint.every,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value!r}")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"config key 'checkpoint.keep' must be >= 1, got {cfg.checkpoint.keep}")
    if cfg.seq_len < 2:
        raise ConfigError(f"config key 'seq_len' must be >= 2 (input + target), got {cfg.seq_len}")
    for key in ("b1", "b2"):
        if not 0 <= getattr(cfg.optimizer, key) < 1:
            raise ConfigError(f"config key 'optimizer.{key}' must be in [0, 1)")
    d = cfg.data
    if d.source not in ("default", "text", "tokens"):
        raise ConfigError(
            f"config key 'data.source' must be 'default', 'text' or 'tokens', got {d.source!r}"
        )
    if d.source == "default" and d.paths:
        raise ConfigError(
            "config key 'data.paths' is set but data.source is 'default' (the stdlib corpus); "
            "set data.source=text (text files) or data.source=tokens (a token file)"
        )
    if d.source != "default" and not d.paths:
        raise ConfigError(f"data.source is {d.source!r}: set config key 'data.paths' to the files")
    if d.source == "tokens" and len(d.paths) != 1:
        raise ConfigError(f"config key 'data.paths' must name one token file, got {len(d.paths)}")
    for i, p in enumerate(d.paths):
        if not os.path.isfile(p):
            raise ConfigError(
                f"config key 'data.paths[{i}]': data file {p!r} not found; fix the path "
                "(--set 'data.paths=[...]') or use data.source=default"
            )
    if d.token_dtype not in ("uint16", "uint32"):
        raise ConfigError(
            f"config key 'data.token_dtype' must be uint16 or uint32: {d.token_dtype}"
        )


def resolve_model(cfg: RunConfig) -> LlamaConfig:
    """The model shape: the preset with ``model_overrides`` and ``max_seq_len = seq_len``."""
    try:
        preset = get_preset(cfg.model)
    except ValueError as e:
        raise ConfigError(f"config key 'model': {e}") from None
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    for name in cfg.model_overrides:
        if name == "max_seq_len":
            raise ConfigError("config key 'model_overrides.max_seq_len': set seq_len instead")
        if name not in fields:
            raise ConfigError(
                f"unknown config key 'model_overrides.{name}'; valid keys: {', '.join(fields)}"
            )
    try:
        model = preset.replace(**cfg.model_overrides, max_seq_len=cfg.seq_len)
    except ValueError as e:
        raise ConfigError(f"config key 'model_overrides': {e}") from None
    if cfg.data.source != "tokens" and model.vocab_size < 256:
        raise ConfigError(
            f"data.source={cfg.data.source!r} is byte-level (256 ids) but the model's vocab_size "
            f"is {model.vocab_size}; raise config key 'model_overrides.vocab_size' to >= 256"
        )
    return model


def resolve_offload(cfg: RunConfig) -> jax_mlpo.OffloadConfig:
    """The offload config, with tiers defaulting to <run_dir>/tiers/t0 and t1 (not created)."""
    offload = dict(cfg.offload)
    tiers = Path(cfg.run_dir) / "tiers"
    offload.setdefault("tiers", [str(tiers / "t0"), str(tiers / "t1")])
    if not isinstance(offload["tiers"], list | tuple):  # a string would be split into characters
        raise ConfigError(
            f"config key 'offload.tiers' must be a list of paths or {{path: ...}} mappings, got "
            f"{_describe(offload['tiers'])}; e.g. --set 'offload.tiers=[/nvme/run, /pfs/run]'"
        )
    try:
        return jax_mlpo.OffloadConfig.from_dict(offload)
    except (jax_mlpo.ConfigError, TypeError) as e:
        message = str(e).removeprefix("offload: ")
        raise ConfigError(f"config section 'offload': {message}") from None


# -- dry run -----------------------------------------------------------------------------------


def dry_run(cfg: RunConfig, processes: int) -> dict[str, Any]:
    """Memory plan of a config without allocating: state per process and tier, host memory.

    Assumes the optimizer state is sharded evenly over ``processes`` (each owns a contiguous
    1/N of the flat parameters, as ZeRO-3 does) and that each process runs its own engine with
    the config's ``offload`` section. The plan follows jax_mlpo's engine: the whole host cache
    becomes subgroup buffers (``prefetch_depth`` x tiers + 2 for the pipeline, the rest retain
    subgroups across steps) and the subgroups are split over the tiers by bandwidth. Tier
    bandwidths are probed when the optimizer starts; here they are the tiers'
    ``read_bandwidth``/``write_bandwidth`` where given, else equal.
    """
    from jax_mlpo import placement  # the engine's pure planning functions

    if processes < 1:
        raise ConfigError(f"--processes must be >= 1, got {processes}")
    model = resolve_model(cfg)
    off = resolve_offload(cfg)
    n = param_count(model)
    bf16 = model.param_dtype == "bfloat16"
    per_param = 12 if bf16 else 8  # fp32 master + m + v, or m + v (fp32 params are the master)
    per_proc = math.ceil(n / processes)
    size = min(off.subgroup_size, per_proc)
    n_sg = math.ceil(per_proc / size)
    state = per_proc * per_param
    out: dict[str, Any] = {
        "model": cfg.model,
        "param_dtype": model.param_dtype,
        "processes": processes,
        "params": n,
        "params_per_process": per_proc,
        "state_bytes_per_param": per_param,
        "state_bytes": n * per_param,
        "state_bytes_per_process": state,
        "subgroups_per_process": n_sg,
        "subgroup_bytes": size * per_param,
        "host_cache": off.host_cache,
        "pipeline_buffers": 0,
        "retained_subgroups": n_sg,
        "engine_host_bytes": state,
        "tiers": {},
        "problem": None,
    }
    if state > off.host_cache:
        tiers = off.tiers[:1] if off.placement == "first" else off.tiers
        per_buffer = 4 * size * (per_param // 4 + (0 if off.delayed_conversion else 1))
        minimum = off.prefetch_depth * len(tiers) + 2
        buffers = off.host_cache // per_buffer
        retained = max(0, min(buffers - minimum, n_sg)) if off.retain else 0
        out.update(pipeline_buffers=minimum, retained_subgroups=retained)
        out["engine_host_bytes"] = max(buffers, minimum) * per_buffer
        if not tiers:
            out["problem"] = "the state exceeds offload.host_cache and offload.tiers is empty"
        elif buffers < minimum:
            out["problem"] = (
                f"offload.host_cache holds {buffers} subgroup buffers, the pipeline needs "
                f"{minimum} ({minimum * per_buffer:,} bytes): raise it, or lower "
                "offload.subgroup_size or offload.prefetch_depth"
            )
        if tiers:
            given = [(t.read_bandwidth, t.write_bandwidth) for t in tiers]
            known = all(r and w for r, w in given)
            bw = [placement.effective_bandwidth(r, w) for r, w in given] if known else None
            bw = bw if bw and off.placement == "measured" else [1.0] * len(tiers)
            kept = placement.retained_per_tier(bw, retained, off.retain_policy)
            counts = placement.tier_counts(n_sg, bw, kept)
            for tier, count, k in zip(tiers, counts, kept, strict=True):
                out["tiers"][tier.path] = {
                    "subgroups": count,
                    "retained": k,
                    "bytes": count * size * per_param,
                }
            out["tier_bandwidths"] = "given" if known else "assumed equal (probed at start)"
    # The last subgroup is smaller: take the difference off the tier holding the most.
    if out["tiers"]:
        short = (n_sg * size - per_proc) * per_param
        max(out["tiers"].values(), key=lambda t: t["subgroups"])["bytes"] -= short
    grad_b = param_b = 2 if bf16 else 4
    dt = "bf16" if bf16 else "fp32"
    out["host_buffers"] = {
        "optimizer engine (host cache)": out["engine_host_bytes"],
        f"gradients handed to the update ({dt})": per_proc * grad_b,
        f"params handed to the update ({dt})": per_proc * param_b,
        "updates returned (fp32)": per_proc * 4,
    }
    out["host_bytes"] = sum(out["host_buffers"].values())
    return out


def _gb(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_dry_run(d: dict[str, Any]) -> str:
    """The dry run as a two-column markdown table."""
    rows = [
        ("model", f"{d['model']} ({d['param_dtype']} params)"),
        ("parameters", f"{d['params']:,}"),
        ("processes", f"{d['processes']}"),
        ("parameters per process", f"{d['params_per_process']:,}"),
        ("optimizer state per parameter", f"{d['state_bytes_per_param']} B"),
        ("optimizer state, all processes", _gb(d["state_bytes"])),
        ("optimizer state per process", _gb(d["state_bytes_per_process"])),
        (
            "subgroups per process",
            f"{d['subgroups_per_process']:,} of {_gb(d['subgroup_bytes'])}"
            + (
                " (the last smaller)"
                if d["subgroups_per_process"] * d["subgroup_bytes"] > d["state_bytes_per_process"]
                else ""
            ),
        ),
    ]
    if not d["tiers"]:
        rows.append(("  all in the host cache", _gb(d["state_bytes_per_process"])))
    else:
        rows.append(("  pipeline buffers (subgroups)", f"{d['pipeline_buffers']}"))
        rows.append(("  retained in host memory across steps", f"{d['retained_subgroups']:,}"))
    for path, t in d["tiers"].items():
        rows.append(
            (
                f"  on tier {path}",
                f"{t['subgroups']:,} ({t['retained']} retained): {_gb(t['bytes'])}",
            )
        )
    if d["tiers"]:
        rows.append(("  tier bandwidths for placement", d["tier_bandwidths"]))
    rows.append(("offload.host_cache", _gb(d["host_cache"])))
    for name, nbytes in d["host_buffers"].items():
        rows.append((f"host: {name}", _gb(nbytes)))
    rows.append(("host memory needed per process", _gb(d["host_bytes"])))
    if d["problem"]:
        rows.append(("PROBLEM", d["problem"]))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'quantity':<{width}} | value |", f"|{'-' * (width + 2)}|---:|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    return "\n".join(lines)


# -- training ----------------------------------------------------------------------------------


def build_dataset(cfg: RunConfig, vocab_size: int) -> TokenDataset:
    d = cfg.data
    cache = Path(d.cache_dir) if d.cache_dir else Path(cfg.run_dir).parent / "data-cache"
    if d.source == "default":
        return TokenDataset.from_default_corpus(cache)
    if d.source == "text":
        return TokenDataset.from_text_files(d.paths, cache)
    return TokenDataset.from_token_file(
        d.paths[0], dtype=d.token_dtype, vocab_size=vocab_size if d.check_vocab else None
    )


def build_optimizer(cfg: RunConfig, use_optax: bool) -> optax.GradientTransformation:
    o = cfg.optimizer
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        o.peak_lr,
        o.warmup_steps,
        max(cfg.steps, o.warmup_steps + 1),
        o.peak_lr * o.min_lr_ratio,
    )

    def decay_mask(params):  # no weight decay on norms' scales (1-D leaves)
        return jax.tree.map(lambda x: x.ndim > 1, params)

    kwargs = dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    if use_optax:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), optax.adamw(schedule, **kwargs))
    offload = resolve_offload(cfg)
    for tier in offload.tiers:  # create parents of default tiers; explicit ones must exist
        if Path(tier.path).parent == Path(cfg.run_dir) / "tiers":
            Path(tier.path).parent.mkdir(parents=True, exist_ok=True)
    # The same clipping as the chain above, applied inside the host update (no pass of XLA's
    # over the gradients to scale them).
    return jax_mlpo.adamw(schedule, **kwargs, offload=offload, max_grad_norm=o.clip_norm)


def make_steps(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> tuple[Any, Any]:
    """The two jitted halves of a training step, timed apart.

    ``grad_step(params, rest, tokens) -> (loss, grads)`` is the forward and backward pass;
    ``update_step(grads, opt_state, params) -> (params, opt_state)`` is the optimizer update.
    With jax_mlpo the update's AdamW runs on the host inside an ordered ``io_callback``, so the
    wall time of ``update_step`` is the update phase. Off CPU, the update donates its inputs.
    """

    @jax.jit
    def grad_step(params: nnx.State, rest: nnx.State, tokens: jax.Array):
        def loss_of(p: nnx.State) -> jax.Array:
            return loss_fn(nnx.merge(graphdef, p, rest), tokens)

        return jax.value_and_grad(loss_of)(params)

    def update(grads: nnx.State, opt_state: Any, params: nnx.State):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    donate = (0, 1, 2) if jax.default_backend() != "cpu" else ()
    return grad_step, jax.jit(update, donate_argnums=donate)


# Figures of every process kept in a multi-process run's records (aggregate's key: record's key).
_PER_PROCESS = {
    "step_s": "step_s",
    "fwd_bwd_s": "fwd_bwd_s",
    "update_s": "update_s",
    "data_s": "data_s",
    "total_s": "host_update_s",
    "read_wait_s": "read_wait_s",
    "compute_s": "compute_s",
    "write_wait_s": "write_wait_s",
    "cache_hits": "cache_hits",
}


def _update_record(m: jax_mlpo.StepMetrics) -> dict[str, Any]:
    """The offloaded update's host metrics, with per-tier throughput and the cache hit rate.

    A tier's ``read_GBps``/``write_GBps`` are its bytes over the host update time (what the
    update phase got from it); ``busy_GBps`` is read + write bytes over the time the tier had a
    request in flight (what the tier delivered while working).
    """
    total = max(m.total_s, 1e-12)
    busy = getattr(m, "tier_busy_s", {})
    tiers = {}
    for path in sorted(set(m.bytes_read) | set(m.bytes_written)):
        read, written = m.bytes_read.get(path, 0), m.bytes_written.get(path, 0)
        tiers[path] = {
            "read_bytes": read,
            "write_bytes": written,
            "read_GBps": read / total / 1e9,
            "write_GBps": written / total / 1e9,
            "busy_s": busy.get(path, 0.0),
            "busy_GBps": (read + written) / busy[path] / 1e9 if busy.get(path) else 0.0,
        }
    return {
        "host_update_s": m.total_s,
        "read_wait_s": m.read_wait_s,
        "compute_s": m.compute_s,
        "write_wait_s": m.write_wait_s,
        "cache_hits": m.cache_hits,
        "subgroups": m.subgroups,
        "cache_hit_rate": m.cache_hits / max(m.subgroups, 1),
        "tiers": tiers,
    }


def _progress(r: dict[str, Any]) -> dict[str, str]:
    out = {
        "loss": f"{r['loss']:.4f}",
        "tok/s": f"{r['tokens_per_s']:,.0f}",
        "fwd+bwd": f"{1e3 * r['fwd_bwd_s']:.0f}ms",
        "update": f"{1e3 * r['update_s']:.0f}ms",
    }
    if "read_wait_s" in r:
        waits = (r["read_wait_s"], r["compute_s"], r["write_wait_s"])
        out["r/c/w"] = "/".join(f"{1e3 * w:.0f}" for w in waits) + "ms"
        out["hit"] = f"{100 * r['cache_hit_rate']:.0f}%"
        out["GB/s r/w"] = " ".join(
            f"{t['read_GBps']:.2f}/{t['write_GBps']:.2f}" for t in r["tiers"].values()
        )
    return out


def open_checkpoints(cfg: RunConfig, name: str, resume: bool) -> Any:
    """The run's checkpoint manager, or None without ``checkpoint.every`` and ``--resume``.

    In a multi-process run every process opens it on the same directory (which must be on a
    file system all of them see, as ``run_dir``): orbax saves and restores collectively.

    Raises:
        ConfigError: for a new run (no ``--resume``) into a directory that holds checkpoints,
            which it would otherwise mix with its own.
    """
    c = cfg.checkpoint
    if not c.every and not resume:
        return None
    directory = Path(c.dir) if c.dir else Path(cfg.run_dir) / f"checkpoints-{name}"
    mngr = checkpoint.manager(directory, max_to_keep=c.keep)
    latest = mngr.latest_step()
    if not resume and latest is not None:
        mngr.close()
        raise ConfigError(
            f"checkpoint directory {str(directory)!r} holds checkpoints (latest: step "
            f"{latest}) of an earlier run: pass --resume to continue it, or set "
            "checkpoint.dir (or run_dir) elsewhere to start a new run"
        )
    return mngr


def _restore(cfg: RunConfig, mngr: Any, params: Any, opt_state: Any) -> tuple[int, Any, Any]:
    """(data step, params, opt_state) of the latest checkpoint; step 0 and the inputs if none.

    Every process of a multi-process run calls it (the restore is collective); each gets its
    shards, whatever the process count that saved the checkpoint.
    """
    if mngr.latest_step() is None:
        logger.warning("--resume: no checkpoint in %s, starting at step 0", mngr.directory)
        return 0, params, opt_state
    step, params, opt_state, extra = checkpoint.restore(mngr, params, opt_state)
    if extra.get("seed") != cfg.seed:
        raise ConfigError(
            f"checkpoint {step} in {mngr.directory} was written with seed {extra.get('seed')}, "
            f"this config has seed {cfg.seed} (other batches): resume with the run's config, "
            "or start a new run elsewhere"
        )
    nproc = jax.process_count()
    saved_by, saved_batch = int(extra.get("processes", 1)), extra.get("global_batch")
    if saved_batch is not None and int(saved_batch) != cfg.batch_size * nproc:
        saved_batch = int(saved_batch)
        # Allowed (a deliberate change of batch size), but usually an oversight when the
        # process count changed: batch_size is per process.
        fix = (f"; set batch_size={saved_batch // nproc} to continue it unchanged"
               if saved_batch % nproc == 0 else "")  # fmt: skip
        logger.warning(
            "checkpoint %d was written with a global batch of %d rows (%d processes), this run "
            "has %d (%d x batch_size %d): it goes on with other batches%s",
            step, saved_batch, saved_by, cfg.batch_size * nproc, nproc, cfg.batch_size, fix,
        )  # fmt: skip
    logger.info("resumed from step %d (%s), saved by %d process(es)", step, mngr.directory,
                saved_by)  # fmt: skip
    return int(extra["data_step"]), params, opt_state


def train(cfg: RunConfig, use_optax: bool, resume: bool = False) -> dict[str, Any]:
    """Runs the config's steps; writes metrics, summary and plot under ``cfg.run_dir``.

    With ``checkpoint.every`` it saves params, optimizer state and the data position every
    that many steps and at the end; ``resume`` continues from the latest checkpoint (the
    batches of step ``k`` depend only on ``(seed, k)``, so the run goes on exactly).

    In a multi-process run (``jax.distributed`` initialised, see :func:`init_distributed`)
    every process calls it with the same config: params and optimizer state are sharded over
    the processes (:mod:`jax_mlpo.distributed`), each process feeds its ``batch_size`` rows of
    the global batch of ``batch_size x processes`` rows, and process 0 writes the metrics,
    summary and plot, with the slowest process's step time (``jax_mlpo.metrics.aggregate``).
    Checkpoints are saved and restored by every process (each writes and reads its shards;
    :mod:`jax_mlpo.checkpoint`), so a run resumes on any process count; process 0 continues
    the metrics file. The other processes return the losses of the steps they ran only.
    """
    name = "optax" if use_optax else "offload"
    nproc, pid = jax.process_count(), jax.process_index()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mngr = open_checkpoints(cfg, name, resume)  # first: a refused run stops before any work
    model_cfg = resolve_model(cfg)
    graphdef, params, rest = nnx.split(Llama(model_cfg, rngs=nnx.Rngs(cfg.seed)), nnx.Param, ...)
    logger.info("model %s: %s parameters", cfg.model, f"{param_count(model_cfg):,}")
    dataset = build_dataset(cfg, model_cfg.vocab_size)
    logger.info("data: %r", dataset)
    if nproc > 1:
        # Every process built the same params from the seed; each keeps its shards only.
        mesh = distributed.data_parallel_mesh()
        params, rest = distributed.shard_params(params, mesh), distributed.shard_params(rest, mesh)
        rows = distributed.batch_sharding(mesh)
        logger.info("%d processes, global batch %d x %d tokens", nproc, cfg.batch_size * nproc,
                    cfg.seq_len)  # fmt: skip
    tx = build_optimizer(cfg, use_optax)
    opt_state = tx.init(params)
    start = 0
    try:
        if resume:
            start, params, opt_state = _restore(cfg, mngr, params, opt_state)
    except BaseException:
        mngr.close()
        if not use_optax:
            jax_mlpo.close(opt_state)
        raise
    grad_step, update_step = make_steps(graphdef, tx)
    tokens_per_step = cfg.batch_size * nproc * cfg.seq_len
    metrics_path = run_dir / f"metrics-{name}.jsonl"
    lead = pid == 0  # writes the metrics, summary and plot
    records = _earlier_records(metrics_path, start) if lead else []
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        desc=f"pretrain[{name}]",
        unit="step",
        mininterval=0.5,
        disable=not lead,
    )
    log = metrics_path.open("a" if start else "w") if lead else contextlib.nullcontext()
    try:
        with log, logging_redirect_tqdm(), bar:
            t_data = time.perf_counter()
            # The global batch of a step is the same for any process count: each process takes
            # its rows of it (generating all rows is cheap: random windows of a memory map).
            for step, batch in batches(
                dataset, cfg.batch_size * nproc, cfg.seq_len, cfg.seed, start, end_step=cfg.steps
            ):
                if nproc > 1:
                    mine = batch[pid * cfg.batch_size : (pid + 1) * cfg.batch_size]
                    tokens = jax.make_array_from_process_local_data(rows, mine)
                else:
                    tokens = jnp.asarray(batch)
                t0 = time.perf_counter()
                loss, grads = jax.block_until_ready(grad_step(params, rest, tokens))
                t1 = time.perf_counter()
                params, opt_state = jax.block_until_ready(update_step(grads, opt_state, params))
                t2 = time.perf_counter()
                timings = {"step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "update_s": t2 - t1,
                           "data_s": t0 - t_data}  # fmt: skip
                every = cfg.checkpoint.every
                if every and ((step + 1) % every == 0 or step + 1 == cfg.steps):
                    extra = {"data_step": step + 1, "seed": cfg.seed, "processes": nproc,
                             "global_batch": cfg.batch_size * nproc}  # fmt: skip
                    checkpoint.save(mngr, step + 1, params, opt_state, extra)
                    timings["checkpoint_s"] = time.perf_counter() - t2  # the snapshot only
                engine = None if use_optax else jax_mlpo.engine_of(opt_state).metrics[-1]
                # A collective: every process's figures reach every process; the job moves at
                # the pace of its slowest process, whose figures the record holds.
                job = jax_mlpo.metrics.aggregate(engine, timings, time_key="step_s")
                r: dict[str, Any] = {
                    "step": step + 1,
                    "loss": float(np.asarray(loss.addressable_data(0))),  # replicated
                    **job.timings,
                    "tokens_per_s": tokens_per_step / job.step_time_s,
                }
                if job.metrics is not None:
                    r.update(_update_record(job.metrics))
                if nproc > 1:
                    r["processes"] = nproc
                    r["slowest_process"] = job.slowest
                    every_process = job.per_process
                    r["per_process"] = {out: every_process[k] for k, out in _PER_PROCESS.items()
                                        if k in every_process}  # fmt: skip
                if lead:
                    log.write(json.dumps(r) + "\n")
                records.append(r)
                bar.set_postfix(_progress(r), refresh=False)
                bar.update()
                if lead and ((step + 1) % cfg.log_every == 0 or step == 0):
                    logger.info(
                        "step %d %s",
                        step + 1,
                        " ".join(f"{k}={v}" for k, v in _progress(r).items()),
                    )
                if not math.isfinite(r["loss"]):  # the same loss in every process
                    raise SystemExit(f"loss became {r['loss']} at step {step + 1}")
                t_data = time.perf_counter()
    finally:
        try:
            if mngr is not None:
                mngr.wait_until_finished()  # the last checkpoint is durable
                mngr.close()
        finally:
            if not use_optax:
                jax_mlpo.close(opt_state)
    if not lead:
        return {"losses": [r["loss"] for r in records], "summary": None, "metrics": None,
                "plot": None}  # fmt: skip
    return _finish(cfg, name, records, metrics_path)


def _earlier_records(metrics_path: Path, start: int) -> list[dict[str, Any]]:
    """A resumed run's metrics up to its checkpoint; the file is cut back to them."""
    if not start or not metrics_path.exists():
        return []
    records = [r for r in report.load_metrics(metrics_path) if r["step"] <= start]
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _common_tiers(records: list[dict], skip: int) -> list[dict]:
    """``records`` with only the tiers that every record after the first ``skip`` has.

    A run resumed with other tiers (another ``offload.tiers``, or another process count with
    other default tiers) holds records of both; ``report.summarize`` and ``report.plot_run``
    read each tier of their window's first record in every record of the window.
    """
    window = records[min(skip, len(records) - 1) :]
    common = set.intersection(*(set(r.get("tiers", {})) for r in window))
    if all(set(r.get("tiers", {})) == common for r in window):
        return records
    logger.warning("the run used other tiers before it was resumed: the summary and the plot "
                   "leave out the tiers that steps %d..%d do not all have", window[0]["step"],
                   window[-1]["step"])  # fmt: skip
    return [{**r, "tiers": {p: t for p, t in r["tiers"].items() if p in common}}
            if "tiers" in r else r for r in records]  # fmt: skip


def _finish(cfg: RunConfig, name: str, records: list[dict], metrics_path: Path) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    shown = _common_tiers(records, cfg.report.skip_steps)
    summary = report.summarize(shown, cfg.report.skip_steps)
    nproc = records[-1].get("processes", 1) if records else 1
    batch = f"batch {cfg.batch_size} x {cfg.seq_len} tokens"
    if nproc > 1:
        batch = f"{nproc} processes, global batch {cfg.batch_size * nproc} x {cfg.seq_len} tokens"
    table = report.format_table(summary, title=f"{cfg.model}, {name}, {batch}")
    if nproc > 1:
        # The table holds the slowest process's figures of each step; here every process's
        # (of the steps run on this process count: a resumed run may have changed it).
        window = records[min(cfg.report.skip_steps, len(records) - 1) :]
        window = [r for r in window if r.get("processes") == nproc]  # holds records[-1]
        per = {
            key: [statistics.median(r["per_process"][key][k] for r in window)
                  for k in range(nproc)]
            for key in window[0]["per_process"]
        }  # fmt: skip
        slowest = [sum(r["slowest_process"] == k for r in window) for k in range(nproc)]
        summary["per_process_median_s"] = per
        summary["slowest_process_steps"] = slowest
        table += "\n\n| process | step (ms) | forward + backward (ms) | update (ms) | slowest |\n"
        table += "|---:|---:|---:|---:|---:|\n"
        table += "\n".join(
            f"| {k} | {1e3 * per['step_s'][k]:.2f} | {1e3 * per['fwd_bwd_s'][k]:.2f} | "
            f"{1e3 * per['update_s'][k]:.2f} | in {slowest[k]} of {len(window)} steps |"
            for k in range(nproc)
        )
    logger.info(
        "summary (medians of steps %d..%d):\n%s", summary["first_step"], summary["last_step"], table
    )
    (run_dir / f"summary-{name}.md").write_text(table + "\n")
    (run_dir / f"summary-{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot = None
    if cfg.report.plot:
        try:
            plot = report.plot_run(
                shown,
                run_dir / f"pretrain-{name}.png",
                skip=cfg.report.skip_steps,
                title=f"{cfg.model} ({name})",
            )
            logger.info("plot in %s", plot)
        except ImportError:
            logger.warning("matplotlib is not installed, no plot: pip install -e '.[experiments]'")
    logger.info("metrics in %s", metrics_path)
    losses = [r["loss"] for r in records]
    return {"losses": losses, "summary": summary, "metrics": metrics_path, "plot": plot}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the run's losses, summary and paths (or the dry run)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="experiments/configs/tiny.yaml")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted for sections), value as YAML",
    )
    parser.add_argument(
        "--optimizer",
        choices=["offload", "optax"],
        default="offload",
        help="offload: jax_mlpo.adamw (default); optax: in-memory optax.adamw, for comparison",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in checkpoint.dir (params, optimizer state, "
        "data position); starts at step 0 if there is none",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="report parameter, state and host memory sizes; allocate nothing",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes sharing the optimizer state (for --dry-run)",
    )
    group = parser.add_argument_group(
        "multi-process training (jax.distributed; one process per accelerator or host, each "
        "started with the same config)"
    )
    group.add_argument(
        "--coordinator",
        default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        metavar="HOST:PORT",
        help="process 0's address for jax.distributed (default: $JAX_COORDINATOR_ADDRESS)",
    )
    group.add_argument(
        "--num-processes",
        type=int,
        default=_env_int("JAX_NUM_PROCESSES"),
        help="processes of the job (default: $JAX_NUM_PROCESSES; under srun or mpirun, "
        "detected by jax)",
    )
    group.add_argument(
        "--process-id",
        type=int,
        default=_env_int("JAX_PROCESS_ID"),
        help="this process's index, 0 .. N-1 (default: $JAX_PROCESS_ID)",
    )
    args = parser.parse_args(argv)
    if args.processes != 1 and not args.dry_run:
        parser.error(
            "--processes applies to --dry-run only; to train on several processes pass "
            "--num-processes, --process-id and --coordinator (or use experiments/launch/)"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("pretrain").setLevel(logging.INFO)
    try:
        cfg = load_config(args.config, args.set)
        resolved = yaml.safe_dump(_plain(dataclasses.asdict(cfg)), sort_keys=False)
        if args.dry_run:
            logger.info("resolved config (%s):\n%s", args.config, resolved)
            plan = dry_run(cfg, args.processes)
            logger.info("dry run, nothing allocated:\n%s", format_dry_run(plan))
            return plan
        if init_distributed(args.coordinator, args.num_processes, args.process_id) > 0:
            logging.getLogger("pretrain").setLevel(logging.WARNING)  # process 0 reports
        logger.info("resolved config (%s):\n%s", args.config, resolved)
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            (Path(cfg.run_dir) / "config.yaml").write_text(resolved)
        return train(cfg, args.optimizer == "optax", resume=args.resume)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"${name}={value!r} is not an integer") from None


def init_distributed(
    coordinator: str | None, num_processes: int | None, process_id: int | None
) -> int:
    """Starts ``jax.distributed`` for a multi-process run; nothing for a single process.

    The processes are given explicitly (``--coordinator``, ``--num-processes``,
    ``--process-id``, or ``$JAX_COORDINATOR_ADDRESS``, ``$JAX_NUM_PROCESSES``,
    ``$JAX_PROCESS_ID`` as ``experiments/launch/rank.sh`` exports them), or, when none is
    given, detected by JAX inside a Slurm step (``srun``) or an Open MPI job of more than one
    task.

    Args:
      coordinator: ``host:port`` of process 0, or None.
      num_processes: processes of the job, or None.
      process_id: this process's index, or None.

    Returns:
      This process's index (0 for a single process).

    Raises:
      ConfigError: for an incomplete or inconsistent set of the three.
    """
    if jax.distributed.is_initialized():
        return jax.process_index()
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given):
        tasks = os.environ.get("SLURM_NTASKS") if "SLURM_STEP_NODELIST" in os.environ else None
        tasks = tasks or os.environ.get("OMPI_COMM_WORLD_SIZE")
        if tasks and int(tasks) > 1:
            jax.distributed.initialize()  # JAX reads the launcher's environment
            logger.info("jax.distributed: process %d of %d (detected)", jax.process_index(),
                        jax.process_count())  # fmt: skip
            return jax.process_index()
        return 0
    if num_processes is None or num_processes < 1:
        raise ConfigError(
            f"--num-processes is {num_processes}: give the job's process count (>= 1) with "
            "--process-id and --coordinator (or $JAX_NUM_PROCESSES)"
        )
    if num_processes == 1:
        return 0
    if process_id is None or not 0 <= process_id < num_processes or not coordinator:
        raise ConfigError(
            f"a run of {num_processes} processes needs --process-id in 0..{num_processes - 1} "
            f"(got {process_id}) and --coordinator HOST:PORT (got {coordinator!r})"
        )
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )
    logger.info("jax.distributed: process %d of %d, coordinator %s", process_id,
                num_processes, coordinator)  # fmt: skip
    return process_id


def _plain(x: Any) -> Any:
    """Tuples to lists, for yaml.safe_dump."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def cli(argv: list[str] | None = None) -> None:
    """:func:`main` as the command runs it: a failed process of a multi-process run exits at once.

    Otherwise a process whose step failed would wait in ``jax.distributed``'s shutdown barrier
    (up to 300 s) for the others, which wait for it in the step's collectives: it prints its
    error and leaves with exit status 1 instead (the launcher, e.g. ``single_node.sh`` or
    ``srun``, then stops the others; a peer's departure also fails their collectives). The
    metrics written so far are closed, and the checkpoints are crash-safe: a save in flight is
    left as a temporary directory that the next run removes.
    """
    try:
        main(argv)
    except BaseException as e:
        if not (jax.distributed.is_initialized() and jax.process_count() > 1):
            raise
        if isinstance(e, SystemExit) and (e.code is None or isinstance(e.code, int)):
            code = e.code or 0
        else:
            if isinstance(e, SystemExit):
                print(e.code, file=sys.stderr)
            else:
                traceback.print_exc()
            code = 130 if isinstance(e, KeyboardInterrupt) else 1
        print(f"pretrain.py: process {jax.process_index()} of {jax.process_count()} exits with "
              f"status {code}, not waiting for the others", file=sys.stderr)  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    cli()
