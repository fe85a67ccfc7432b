"""The pre-training job's optimizer: ``optimizer.name`` (AdamW, Lion or Muon) with its schedule,
weight decay mask and clipping, jax_mlpo's offloaded one or optax's in memory for comparison.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jax_mlpo
from experiments.job.run_config import ConfigError, RunConfig, resolve_model
from experiments.job.steps import abstract_model
from models import LlamaConfig


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
    if not use_optax:  # optax's state stays in memory
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


def muon_matrices(embeddings: bool) -> Callable[[Any], Any]:
    """The job's ``muon_weight_dimension_numbers``: Muon for the blocks' 2-D weights, AdamW (None)
    for the vectors and, unless ``embeddings`` (``optimizer.muon_embeddings``), the token
    embedding and the output head (with it, every 2-D leaf: optax.contrib.muon's default)."""

    def spec(path: Any, x: Any) -> Any:
        name = jax.tree_util.keystr(path)
        outer = "embed" in name or "lm_head" in name
        muon = x.ndim == 2 and (embeddings or not outer)
        return optax.contrib.MuonDimensionNumbers() if muon else None

    return lambda params: jax.tree_util.tree_map_with_path(spec, params)


def _muon_shapes(cfg: RunConfig) -> tuple[tuple[int, ...], ...]:
    """The shapes of the leaves Muon updates in the job, from the model's abstract params."""
    return _muon_shapes_of(resolve_model(cfg), cfg.optimizer.muon_embeddings)


@functools.cache  # the dry run and the memory plan ask for the same model's
def _muon_shapes_of(model: LlamaConfig, embeddings: bool) -> tuple[tuple[int, ...], ...]:
    _, params, _ = abstract_model(model)
    specs = jax.tree.leaves(
        muon_matrices(embeddings)(params),
        is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers),
    )
    leaves = jax.tree.leaves(params)
    return tuple(x.shape for x, s in zip(leaves, specs, strict=True) if s is not None)


def muon_matrix_params(cfg: RunConfig) -> int:
    """Parameters of the leaves Muon updates in the job (:func:`muon_matrices`), counted on the
    model's shapes without allocating it."""
    return sum(math.prod(shape) for shape in _muon_shapes(cfg))


def muon_update_bytes(cfg: RunConfig, use_optax: bool) -> int:
    """XLA's figure for the device memory of the job's Muon update beyond its inputs and
    outputs; nothing of the model's size is allocated.

    ``optax.contrib.muon``: the temporaries of its whole update, compiled for abstract params
    and state. ``jax_mlpo.muon``: its update calls host engines, which exist only after init;
    what it runs on the device is optax's Newton-Schulz over the float32 momentum its momentum
    engine hands over, compiled alone: that momentum and the temporaries (on e2e-125m 1.04x the
    whole update program's temporaries, compiled after init). On XLA:CPU the temporaries grow
    with the number of matrices, about 6x each matrix's float32 size: the matrices'
    Newton-Schulz iterations do not share buffers.
    """
    if use_optax:
        return _optax_update_bytes(cfg)
    shapes = _muon_shapes(cfg)
    return _newton_schulz_bytes(shapes) if shapes else 0


def _optax_update_bytes(cfg: RunConfig) -> int:
    _, params, _ = abstract_model(resolve_model(cfg))
    tx = build_optimizer(cfg, use_optax=True)
    state = jax.eval_shape(tx.init, params)
    memory = jax.jit(tx.update).lower(params, state, params).compile().memory_analysis()
    return int(memory.temp_size_in_bytes)


@functools.cache  # the dry run and the checks of one process ask for the same shapes
def _newton_schulz_bytes(shapes: tuple[tuple[int, ...], ...]) -> int:
    momentum = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]

    def orthogonalize(mu: list[jax.Array]) -> Any:
        dims = [optax.contrib.MuonDimensionNumbers()] * len(mu)
        tx = optax.contrib.scale_by_muon(beta=0.0, nesterov=False, weight_dimension_numbers=dims)
        return tx.update(mu, tx.init(mu)._replace(mu=mu))[0]

    memory = jax.jit(orthogonalize).lower(momentum).compile().memory_analysis()
    return int(memory.argument_size_in_bytes + memory.temp_size_in_bytes)


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
                  muon_weight_dimension_numbers=muon_matrices(o.muon_embeddings),
                  mu_dtype=None if o.mu_dtype == "float32" else o.mu_dtype)  # fmt: skip
    if use_optax:
        return optax.contrib.muon(schedule, **kwargs)
    return jax_mlpo.muon(schedule, **kwargs, offload=cfg.offload)


def _make_default_tier_parents(cfg: RunConfig) -> None:
    """Creates the parents of default tiers (under ``<run_dir>/tiers``)."""
    for tier in cfg.offload.tiers:
        if Path(tier.path).parent == Path(cfg.run_dir) / "tiers":
            Path(tier.path).parent.mkdir(parents=True, exist_ok=True)
