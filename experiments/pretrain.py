"""Pre-trains a LLaMA-style Flax model with jax_mlpo's offloaded AdamW (the main job).

Usage:
  python experiments/pretrain.py --config experiments/configs/tiny.yaml \
      [--set steps=100 --set offload.host_cache=4MiB] [--optimizer optax]

The run directory holds the resolved config (config.yaml), the per-step metrics (metrics.jsonl)
and, unless tiers are given, the optimizer's file tiers (tiers/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import yaml
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax_mlpo  # noqa: E402
from experiments.data import TokenDataset, batches  # noqa: E402
from models import Llama, get_preset, loss_fn, param_count  # noqa: E402

logger = logging.getLogger("pretrain")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    peak_lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    run_dir: str = "runs/tiny"
    model: str = "tiny"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    data: str = "default"  # "default" (Python stdlib sources), a text file list, or a token file
    token_dtype: str = "uint16"
    batch_size: int = 8
    seq_len: int = 128
    steps: int = 300
    seed: int = 0
    log_every: int = 10
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    offload: dict = dataclasses.field(default_factory=dict)


def _typed(cls: type, data: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SystemExit(f"config: unknown key(s) {unknown} in {where}; valid: {sorted(names)}")
    values = dict(data)
    if cls is RunConfig and isinstance(values.get("optimizer"), dict):
        values["optimizer"] = _typed(OptimizerConfig, values["optimizer"], "optimizer")
    return cls(**values)


def load_config(path: str | None, overrides: list[str]) -> RunConfig:
    """Reads the YAML config and applies ``key=value`` overrides (dotted keys, YAML values)."""
    data: dict[str, Any] = {}
    if path:
        if not os.path.exists(path):
            raise SystemExit(f"config file {path!r} not found; see experiments/configs/")
        data = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key=value, e.g. --set steps=100")
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return _typed(RunConfig, data, "config")


def build_dataset(cfg: RunConfig, cache_dir: Path) -> TokenDataset:
    if cfg.data == "default":
        return TokenDataset.from_default_corpus(cache_dir)
    paths = cfg.data.split(",")
    if len(paths) == 1 and paths[0].endswith((".bin", ".npy", ".tokens")):
        return TokenDataset.from_token_file(paths[0], dtype=cfg.token_dtype)
    return TokenDataset.from_text_files(paths, cache_dir)


def build_optimizer(cfg: RunConfig, run_dir: Path, use_optax: bool) -> optax.GradientTransformation:
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

    if use_optax:
        adamw = optax.adamw(
            schedule, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask
        )
    else:
        offload = dict(cfg.offload)
        offload.setdefault("tiers", [str(run_dir / "tiers" / "t0"), str(run_dir / "tiers" / "t1")])
        (run_dir / "tiers").mkdir(parents=True, exist_ok=True)
        adamw = jax_mlpo.adamw(
            schedule, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask,
            offload=jax_mlpo.OffloadConfig.from_dict(offload),
        )  # fmt: skip
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="experiments/configs/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--optimizer", choices=["offload", "optax"], default="offload",
        help="offload: jax_mlpo.adamw (default); optax: in-memory optax.adamw, for comparison",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.set)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    (run_dir / "config.yaml").write_text(resolved)
    logger.info("resolved config:\n%s", resolved)

    model_cfg = get_preset(cfg.model).replace(**cfg.model_overrides, max_seq_len=cfg.seq_len)
    model = Llama(model_cfg, rngs=nnx.Rngs(cfg.seed))
    logger.info("model %s: %s parameters", cfg.model, f"{param_count(model_cfg):,}")
    dataset = build_dataset(cfg, run_dir.parent / "data-cache")
    tx = build_optimizer(cfg, run_dir, args.optimizer == "optax")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    losses: list[float] = []
    metrics_path = run_dir / f"metrics-{args.optimizer}.jsonl"
    with metrics_path.open("w") as log, tqdm(total=cfg.steps, desc="pretrain", unit="step") as bar:
        for step, batch in batches(
            dataset, cfg.batch_size, cfg.seq_len, cfg.seed, end_step=cfg.steps
        ):
            t0 = time.perf_counter()
            loss = float(train_step(model, optimizer, jnp.asarray(batch)))
            record = {"step": step + 1, "loss": loss, "step_s": time.perf_counter() - t0}
            record["tokens_per_s"] = cfg.batch_size * cfg.seq_len / record["step_s"]
            if args.optimizer == "offload":
                update = jax_mlpo.engine_of(optimizer.opt_state).metrics[-1]
                record["update"] = update.as_dict()
            log.write(json.dumps(record) + "\n")
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.4f}", step_ms=f"{1e3 * record['step_s']:.0f}")
            bar.update()
            if (step + 1) % cfg.log_every == 0 or step == 0:
                logger.info(
                    "step %d loss %.4f step %.1f ms", step + 1, loss, 1e3 * record["step_s"]
                )
            if not math.isfinite(loss):
                raise SystemExit(f"loss became {loss} at step {step + 1}")
    if args.optimizer == "offload":
        jax_mlpo.close(optimizer.opt_state)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    logger.info("mean loss of the first 10 steps %.4f, of the last 10 %.4f", first, last)
    logger.info("metrics in %s", metrics_path)
    return losses


if __name__ == "__main__":
    main()
