"""The run configuration of the pre-training job: typed sections read from YAML and ``--set``.

A YAML file (see experiments/configs/) plus ``key=value`` overrides become a frozen
:class:`RunConfig`. draccus reads the file, merges the overrides and types every value against
its dataclass field; the checks here add the ranges and the rules between fields. Every error
names the dotted key. The ``offload`` section is jax_mlpo's :class:`jax_mlpo.OffloadConfig`, its
tiers defaulting to ``<run_dir>/tiers/t0`` and ``t1``.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import draccus
import mergedeep
import yaml

import jax_mlpo
from jax_mlpo import ConfigError
from models import LlamaConfig, get_preset

MomentDtype = Literal["float32", "bfloat16", "q8"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: Literal["default", "text", "tokens"] = "default"
    """'default' (the Python standard library's sources, byte-level), 'text' (``paths`` are
    text files, byte-level) or 'tokens' (``paths`` is one pre-tokenized .npy or raw file)."""
    paths: tuple[str, ...] = ()
    """Text files (source 'text') or the one token file (source 'tokens')."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a raw token file: 'uint16' or 'uint32' (a .npy carries its own)."""
    check_vocab: bool = True
    """Scan a token file once for ids >= the model's vocab_size (bounded memory)."""
    cache_dir: str | None = None
    """Where text corpora are concatenated once; None means <run_dir>/../data-cache."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "lion", "muon"] = "adamw"
    """adamw (jax_mlpo.adamw, or optax.adamw), lion (jax_mlpo.lion, or optax.lion: one moment,
    b1 and b2 as Lion's; eps, nu_dtype and q8 do not apply) or muon (jax_mlpo.muon, or
    optax.contrib.muon: Muon with muon_beta on the blocks' matrices, AdamW with b1, b2 and
    adam_peak_lr on the rest; q8 does not apply)."""
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
    mu_dtype: MomentDtype = "float32"
    """The first moment's dtype: float32, bfloat16 (optax's mu_dtype): 2 bytes per param, or q8
    (8-bit blockwise, jax_mlpo only): 1 byte and a scale per 256."""
    nu_dtype: MomentDtype = "float32"
    """The second moment's dtype: float32, bfloat16 or q8 (jax_mlpo only, not in optax)."""
    q8_rounding: Literal["stochastic", "nearest"] = "stochastic"
    """How q8 moments are rounded: stochastic (the default: with nearest, e2e-125m's loss ended
    5% above the float32 state's) or nearest."""
    muon_beta: float = 0.95
    """muon: the matrices' momentum decay."""
    adam_peak_lr: float | None = None
    """muon: the peak learning rate of the leaves AdamW updates; None is peak_lr."""
    muon_embeddings: bool = False
    """muon: orthogonalize the token embedding and the output head too (optax.contrib.muon's
    default: every 2-D leaf). False gives them to AdamW, as Muon's authors advise: Muon is for
    the hidden layers' matrices."""


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
    final: bool = True
    """Also save at the last step. False where the disk holds one checkpoint only (a new one
    is written before the old one is deleted)."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    axes: tuple[str, ...] = ("fsdp", "tensor")
    """Mesh axis names: the batch and every leaf's first dimension are split over the first
    (FSDP), a 2-D or larger leaf's last dimension over the second (tensor parallel)."""
    shape: tuple[int, ...] = ()
    """Devices per axis, their product the job's devices; () puts every device on the first
    axis (FSDP over all of them). Unused with one device, and with one device per process
    (jax_mlpo.sharding.processes's data-parallel layout)."""


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
    overlap: bool | Literal["auto"] = "auto"
    """Each update beside the next forward pass (jax_mlpo.overlapped_step), the same params:
    true, false, or auto (where it wins: experiments/job/steps.py's AutoSteps)."""
    overlap_groups: int | Literal["auto"] = "auto"
    """Host calls an overlapped update is split into (groups of layers); auto: as many as each
    pay for their call (jax_mlpo.transforms.overlap_cost.auto_groups)."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    offload: jax_mlpo.OffloadConfig = dataclasses.field(default_factory=jax_mlpo.OffloadConfig)
    """jax_mlpo's offload config; :func:`load_config` defaults its tiers to <run_dir>/tiers/t0
    and t1."""
    report: ReportConfig = dataclasses.field(default_factory=ReportConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Params, optimizer state and data position, saved in the background (jax_mlpo.checkpoint)."""
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    """How params and batch are sharded over the job's devices where a process has several
    (e.g. JAX_NUM_CPU_DEVICES=4, a multi-GPU node)."""


def load_config(path: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads the YAML config, applies ``key=value`` overrides and validates the result.

    draccus reads the file, types every value and builds the nested sections; an override is
    merged into the file's values as draccus merges its own command line: the value is YAML,
    a dotted key reaches into sections (``optimizer.peak_lr=1e-3``) and a mapping value is
    merged into the section it names (``model_overrides={layers: 2}`` keeps the file's other
    overrides; ``model_overrides=null`` first drops them).

    Args:
        path: a YAML file (see experiments/configs/), or None for the defaults.
        overrides: ``key=value`` strings, applied in order.

    Returns:
        The validated config, its ``offload`` an OffloadConfig whose tiers default to
        ``<run_dir>/tiers/t0`` and ``t1``. Nothing is created on disk.

    Raises:
        ConfigError: for a missing file, an unknown key, a value of the wrong type, a missing
            data file, an unknown model preset or an invalid model or offload setting. The
            message names the key.
    """
    data = _read(path) if path else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set steps=100")
        try:
            value = draccus.cfgparsing.parse_string(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({e})") from None
        mergedeep.merge(data, draccus.utils.deflatten({key: value}))
    # Built last: its default tiers lie under run_dir, which the rest of the config gives.
    offload = data.pop("offload", None)
    _check_lists(data, RunConfig)
    try:
        cfg = draccus.decode(RunConfig, data)
    except draccus.ParsingError as e:
        raise ConfigError(_explain(e)) from None
    _check(cfg)
    resolve_model(cfg)
    return dataclasses.replace(cfg, offload=offload_config(offload, cfg.run_dir))


def offload_config(section: Mapping[str, Any] | None, run_dir: str) -> jax_mlpo.OffloadConfig:
    """The ``offload`` section as an OffloadConfig; tiers default to <run_dir>/tiers/t0 and t1.

    draccus types the section's fields against OffloadConfig's own, so a field OffloadConfig
    gains is read without a change here; jax_mlpo reads the tiers (paths, ``s3://`` URLs or
    mappings of FileTier or ObjectTier fields, a union draccus does not decode) and checks the
    values.

    Args:
        section: the section's keys, or None for the defaults.
        run_dir: the run directory, home of the default tiers (not created).

    Returns:
        The OffloadConfig.

    Raises:
        ConfigError: for an unknown key or an invalid value, naming the field.
    """
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"config key 'offload' must be a mapping of OffloadConfig fields, got {section!r}; "
            "e.g. --set offload.host_cache=4MiB"
        )
    section = dict(section)
    home = Path(run_dir) / "tiers"
    tiers = section.pop("tiers", [str(home / "t0"), str(home / "t1")])
    try:
        return dataclasses.replace(draccus.decode(jax_mlpo.OffloadConfig, section), tiers=tiers)
    except draccus.ParsingError as e:
        raise ConfigError(_explain(e, "offload")) from None
    except (jax_mlpo.ConfigError, TypeError) as e:
        raise ConfigError(f"config key 'offload': {e}") from None


def resolve_model(cfg: RunConfig) -> LlamaConfig:
    """The model shape: the preset with ``model_overrides`` and ``max_seq_len = seq_len``.

    Raises:
        ConfigError: for an unknown preset or override, or a vocabulary too small for the data.
    """
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


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML, every field given: what ``<run_dir>/config.yaml`` holds.

    :func:`load_config` reads it back to the same config.
    """
    return yaml.safe_dump(plain(dataclasses.asdict(cfg)), sort_keys=False)


def plain(x: Any) -> Any:
    """Tuples to lists, for yaml.safe_dump and json."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    return x


# -- reading values ----------------------------------------------------------------------------


def _read(path: str) -> dict[str, Any]:
    """The YAML file's mapping of keys, read by draccus."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found; see experiments/configs/*.yaml")
    try:
        with open(path) as f:
            data = draccus.cfgparsing.load_config(f, file=path)
    except draccus.ParsingError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e.__cause__}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys, got {data!r}")
    return data


def _explain(error: draccus.ParsingError, section: str = "") -> str:
    """draccus's error with the dotted key it names first (``section`` is where it decoded)."""
    cause = error.__cause__
    if isinstance(cause, jax_mlpo.ConfigError):  # a value jax_mlpo's dataclasses refused
        return f"config key '{section}': {cause}"
    if isinstance(error, draccus.utils.DecodingError):
        key = ".".join([section, *error.key_path] if section else error.key_path)
        return f"config key '{key}': {error.message}" if key else error.message
    return f"{error}: {cause}" if cause else str(error)


def _check_lists(data: Mapping[str, Any], cls: Any, section: str = "") -> None:
    """Refuses a value that is not a list where ``cls`` (a section's dataclass) has a tuple
    field: draccus would read a string as the tuple of its characters (``data.paths=a.txt`` as
    five paths). Checked on the values before draccus decodes them, section by section.

    Raises:
      ConfigError: naming the key, with an example of a list.
    """
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name not in data:
            continue
        raw, kind, key = data[field.name], hints[field.name], f"{section}{field.name}"
        if typing.get_origin(kind) is tuple and not isinstance(raw, list | tuple):
            example = "[2, 2]" if typing.get_args(kind)[:1] == (int,) else "[a, b]"
            raise ConfigError(
                f"config key '{key}': must be a list, got {raw!r}; e.g. --set '{key}={example}'"
            )
        if dataclasses.is_dataclass(kind) and isinstance(raw, Mapping):
            _check_lists(raw, kind, f"{key}.")


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
    groups = cfg.overlap_groups
    if groups != "auto" and groups < 1:
        raise ConfigError(
            f"config key 'overlap_groups' must be a positive integer or auto, got {groups!r}"
        )
    mesh = cfg.mesh
    if not 1 <= len(mesh.axes) <= 2 or len(set(mesh.axes)) != len(mesh.axes):
        raise ConfigError(
            f"config key 'mesh.axes' must name one or two distinct axes, got {list(mesh.axes)}"
        )
    if mesh.shape and (len(mesh.shape) != len(mesh.axes) or min(mesh.shape) < 1):
        raise ConfigError(
            f"config key 'mesh.shape' must give a positive size for each of mesh.axes "
            f"{list(mesh.axes)}, got {list(mesh.shape)} (or [] for every device on the first)"
        )
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
    one_moment = cfg.optimizer.name in ("lion", "muon")
    if one_moment and "q8" in (cfg.optimizer.mu_dtype, cfg.optimizer.nu_dtype):
        raise ConfigError(f"config key 'optimizer.mu_dtype': {cfg.optimizer.name} stores its "
                          "moments in float32 or bfloat16, not q8")  # fmt: skip
    if not 0 <= cfg.optimizer.muon_beta < 1:
        raise ConfigError("config key 'optimizer.muon_beta' must be in [0, 1)")
    for key in ("b1", "b2"):
        if not 0 <= getattr(cfg.optimizer, key) < 1:
            raise ConfigError(f"config key 'optimizer.{key}' must be in [0, 1)")
    d = cfg.data
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
