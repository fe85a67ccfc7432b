"""The pre-training job's optimizer: ``optimizer.name`` (AdamW, Lion or Muon) with its schedule,
weight decay mask and clipping, jax_mlpo's offloaded one or optax's in memory for comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import optax

import jax_mlpo
from experiments.run_config import ConfigError, RunConfig, resolve_model
from experiments.steps import abstract_model


def build_optimizer(cfg: RunConfig, use_optax: bool) -> optax.GradientTransformation:
    """The config's optimizer (``optimizer.name``) with its schedule, decay mask and clipping.

    Args:
      cfg: the run config.
      use_optax: optax's in-memory optimizer (clipping chained before it) instead of
        jax_mlpo's offloaded one (AdamW's clipping inside the host update).

    Returns:
      The transformation. The parents of default tiers (under ``<run_dir>/tiers``) are
      created; explicitly given tiers' parents must exist.
    """
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

    kwargs = dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask,
                  mu_dtype=None if o.mu_dtype == "float32" else o.mu_dtype)  # fmt: skip
    _make_default_tier_parents(cfg)
    clip = optax.clip_by_global_norm(o.clip_norm)
    if o.name == "muon":
        return optax.chain(clip, _muon(o, schedule, decay_mask, cfg, use_optax))
    if o.name == "lion":
        del kwargs["eps"]
        if use_optax:
            return optax.chain(clip, optax.lion(schedule, **kwargs))
        return optax.chain(clip, jax_mlpo.lion(schedule, **kwargs, offload=cfg.offload))
    if use_optax:
        if o.nu_dtype != "float32":
            raise ConfigError(
                f"optimizer.nu_dtype={o.nu_dtype} is jax_mlpo's; optax.adamw keeps nu in the "
                "params' dtype: drop --optimizer optax or set optimizer.nu_dtype=float32"
            )
        if o.mu_dtype == "q8":
            raise ConfigError(
                "optimizer.mu_dtype=q8 is jax_mlpo's; optax.adamw takes a float mu_dtype: drop "
                "--optimizer optax or set optimizer.mu_dtype=bfloat16 or float32"
            )
        return optax.chain(clip, optax.adamw(schedule, **kwargs))
    kwargs["nu_dtype"] = None if o.nu_dtype == "float32" else o.nu_dtype
    kwargs["q8_rounding"] = o.q8_rounding
    # The same clipping as the chain above, applied inside the host update (no pass of XLA's
    # over the gradients to scale them).
    return jax_mlpo.adamw(schedule, **kwargs, offload=cfg.offload, max_grad_norm=o.clip_norm)


def muon_matrices(cfg: RunConfig) -> Callable[[Any], Any]:
    """The job's ``muon_weight_dimension_numbers``: Muon for the blocks' 2-D weights, AdamW (None)
    for the vectors and, unless ``optimizer.muon_embeddings``, the token embedding and the
    output head (with it, every 2-D leaf: optax.contrib.muon's default)."""
    outer_too = cfg.optimizer.muon_embeddings

    def spec(path: Any, x: Any) -> Any:
        name = jax.tree_util.keystr(path)
        outer = "embed" in name or "lm_head" in name
        muon = x.ndim == 2 and (outer_too or not outer)
        return optax.contrib.MuonDimensionNumbers() if muon else None

    return lambda params: jax.tree_util.tree_map_with_path(spec, params)


def muon_matrix_params(cfg: RunConfig) -> int:
    """Parameters of the leaves Muon updates in the job (:func:`muon_matrices`), counted on the
    model's shapes without allocating it."""
    _, params, _ = abstract_model(resolve_model(cfg))
    specs = jax.tree.leaves(
        muon_matrices(cfg)(params),
        is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers),
    )
    leaves = jax.tree.leaves(params)
    return sum(math.prod(x.shape) for x, s in zip(leaves, specs, strict=True) if s is not None)


def _muon(o: Any, schedule: Any, decay_mask: Any, cfg: RunConfig, use_optax: bool) -> Any:
    """Muon on the blocks' matrices (every 2-D leaf with ``muon_embeddings``), AdamW on the
    rest."""
    adam_lr = schedule
    if o.adam_peak_lr is not None:
        adam_lr = optax.warmup_cosine_decay_schedule(
            0.0, o.adam_peak_lr, o.warmup_steps, max(cfg.steps, o.warmup_steps + 1),
            o.adam_peak_lr * o.min_lr_ratio,
        )  # fmt: skip
    kwargs = dict(beta=o.muon_beta, eps=o.eps, weight_decay=o.weight_decay,
                  weight_decay_mask=decay_mask, adam_b1=o.b1, adam_b2=o.b2,
                  adam_learning_rate=adam_lr,
                  muon_weight_dimension_numbers=muon_matrices(cfg),
                  mu_dtype=None if o.mu_dtype == "float32" else o.mu_dtype)  # fmt: skip
    if use_optax:
        return optax.contrib.muon(schedule, **kwargs)
    return jax_mlpo.muon(schedule, **kwargs, offload=cfg.offload)


def _make_default_tier_parents(cfg: RunConfig) -> None:
    """Creates the parents of default tiers (under ``<run_dir>/tiers``)."""
    for tier in cfg.offload.tiers:
        if Path(tier.path).parent == Path(cfg.run_dir) / "tiers":
            Path(tier.path).parent.mkdir(parents=True, exist_ok=True)
