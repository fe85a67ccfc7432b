"""A LLaMA-style decoder in Flax NNX: the model the offloaded optimizer trains.

Shape of the network (the one MLP-Offload's paper uses): token embedding, ``layers`` blocks of
``x + Attention(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``, a final RMSNorm and an untied output
projection. Attention is causal, grouped-query (``kv_heads`` key/value heads shared by
``heads // kv_heads`` query heads each) with rotary position embeddings. No layer has a bias.

Parameters are stored in ``LlamaConfig.param_dtype`` and matmuls run in ``LlamaConfig.dtype``;
normalisation statistics, softmax and the logits are always float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.typing import DTypeLike

from models import matmul

__all__ = ["LlamaConfig", "Llama", "loss_fn"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# GPT-2 / LLaMA initialisation scale. With it the logits of an untrained model are ~N(0, 0.2^2),
# so its loss starts at ~ln(vocab_size), a useful sanity check for the training loop.
_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a :class:`Llama` model.

    Raises:
        ValueError: at construction, if a size is not positive, ``hidden`` is not a multiple of
            ``heads``, ``heads`` is not a multiple of ``kv_heads``, the head size is odd (RoPE
            rotates pairs of features) or a dtype name is unknown. The message names the field.
    """

    vocab_size: int
    """Number of token ids; inputs must lie in ``[0, vocab_size)``."""
    hidden: int
    """Width of the residual stream (d_model)."""
    layers: int
    """Number of decoder blocks."""
    heads: int
    """Query heads; the head size is ``hidden // heads``."""
    kv_heads: int
    """Key/value heads (GQA); ``heads == kv_heads`` is plain multi-head attention."""
    ffn: int
    """Inner width of the SwiGLU MLP (each of gate, up and down has ``hidden * ffn`` weights)."""
    max_seq_len: int
    """Longest sequence the model accepts."""
    rope_theta: float = 10000.0
    """RoPE base wavelength."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    param_dtype: str = "float32"
    """Storage dtype of parameters: 'float32' or 'bfloat16'."""
    dtype: str = "float32"
    """Compute dtype of matmuls and activations: 'float32' or 'bfloat16'."""
    remat: bool = False
    """Recompute each block's activations in the backward pass instead of storing them."""
    scan_layers: bool = False
    """Store the blocks' params stacked along a leading ``[layers, ...]`` axis (one leaf per
    weight kind, as ``nnx.scan`` and MaxText lay them out) and run the blocks with
    ``jax.lax.scan``: one compiled block instead of ``layers``. The initial params are the
    unrolled model's, stacked."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}.")
        if self.hidden % self.heads:
            raise ValueError(
                f"LlamaConfig.hidden={self.hidden} is not divisible by heads={self.heads}; "
                "choose hidden as a multiple of heads (head size = hidden // heads)."
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig.heads={self.heads} is not divisible by kv_heads={self.kv_heads}; "
                "choose kv_heads as a divisor of heads (kv_heads == heads disables GQA)."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig head size hidden // heads = {self.head_dim} is odd; RoPE needs an "
                "even head size: change hidden or heads."
            )
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(
                f"LlamaConfig.rope_theta={self.rope_theta} and norm_eps={self.norm_eps} must both "
                "be positive."
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"LlamaConfig.{name}={getattr(self, name)!r} is not supported; use one of "
                    f"{sorted(_DTYPES)}."
                )

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden // self.heads

    def replace(self, **changes: object) -> LlamaConfig:
        """Returns a copy with ``changes`` applied (and validated again)."""
        return dataclasses.replace(self, **changes)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation with a learned scale; statistics in float32."""

    def __init__(self, features: int, *, eps: float, dtype: DTypeLike, param_dtype: DTypeLike):
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        # Squares of bf16 activations lose too much precision: normalise in float32.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def _rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotates feature pairs ``(i, i + d/2)`` of ``x[B, T, H, d]`` by position-dependent angles.

    This is the "rotate half" layout of the LLaMA reference code (GPT-NeoX style). The angles are
    computed in float32 from the sequence length, so no table is stored as state.
    """
    _, seq_len, _, dim = x.shape
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))  # [d/2]
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _linear(
    cfg: LlamaConfig, d_in: int, d_out: int, rngs: nnx.Rngs, std: float = _INIT_STD
) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=_DTYPES[cfg.dtype],
        param_dtype=_DTYPES[cfg.param_dtype],
        kernel_init=nnx.initializers.normal(std),
        dot_general=matmul.dot_general,  # bfloat16 on XLA's fast CPU kernels, backward too
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Causal grouped-query self-attention with RoPE."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        kv_dim = cfg.kv_heads * cfg.head_dim
        # Residual-branch outputs are scaled down by sqrt(2 * layers) (GPT-2) so the residual
        # stream's variance does not grow with depth at initialisation.
        out_std = _INIT_STD / (2 * cfg.layers) ** 0.5
        self.q = _linear(cfg, cfg.hidden, cfg.hidden, rngs)
        self.k = _linear(cfg, cfg.hidden, kv_dim, rngs)
        self.v = _linear(cfg, cfg.hidden, kv_dim, rngs)
        self.o = _linear(cfg, cfg.hidden, cfg.hidden, rngs, std=out_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q(x).reshape(b, t, cfg.heads, cfg.head_dim)
        k = self.k(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        v = self.v(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        q = _rope(q, cfg.rope_theta)
        k = _rope(k, cfg.rope_theta)
        # jax.nn.dot_product_attention handles GQA (query heads grouped over kv heads), takes the
        # softmax in float32 and can dispatch to cuDNN flash attention on GPU.
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.reshape(b, t, cfg.hidden))


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.gate = _linear(cfg, cfg.hidden, cfg.ffn, rngs)
        self.up = _linear(cfg, cfg.hidden, cfg.ffn, rngs)
        self.down = _linear(cfg, cfg.ffn, cfg.hidden, rngs, std=_INIT_STD / (2 * cfg.layers) ** 0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """One pre-norm decoder block: attention and MLP, each with a residual connection."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        norm_kw = dict(
            eps=cfg.norm_eps, dtype=_DTYPES[cfg.dtype], param_dtype=_DTYPES[cfg.param_dtype]
        )
        self.attn_norm = RMSNorm(cfg.hidden, **norm_kw)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, **norm_kw)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _run_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


# Rematerialised variant: only the block input is saved for backward; everything inside the block
# is recomputed. Defined once at import so each call does not re-wrap the function.
_run_block_remat = nnx.remat(_run_block)


def _stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose every param is ``blocks``' params stacked along a new leading axis."""
    graphdef = nnx.graphdef(blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(b) for b in blocks))
    return nnx.merge(graphdef, stacked)


def _scan_blocks(blocks: Block, x: jax.Array, remat: bool) -> jax.Array:
    """``x`` through the stacked blocks, one ``lax.scan`` iteration per layer."""
    graphdef, stacked = nnx.split(blocks)

    def body(x: jax.Array, layer: nnx.State) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, layer)(x), None

    if remat:  # as _run_block_remat: only each block's input is saved for backward
        body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, x, stacked)
    return x


class Llama(nnx.Module):
    """LLaMA-style causal language model.

    Args:
        config: the model shape and numerics.
        rngs: random streams for initialisation; ``None`` means ``nnx.Rngs(0)``.

    Examples:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> cfg = LlamaConfig(vocab_size=256, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64,
        ...                   max_seq_len=16)
        >>> Llama(cfg, rngs=nnx.Rngs(0))(jnp.zeros((2, 8), jnp.int32)).shape
        (2, 8, 256)
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs | None = None):
        if rngs is None:
            rngs = nnx.Rngs(0)
        self.config = config
        dtype, param_dtype = _DTYPES[config.dtype], _DTYPES[config.param_dtype]
        self.embed = nnx.Embed(
            config.vocab_size,
            config.hidden,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(_INIT_STD),
            rngs=rngs,
        )
        # The scanned model draws its blocks as the unrolled one does, then stacks them: the
        # same initial params from the same rngs.
        blocks = [Block(config, rngs=rngs) for _ in range(config.layers)]
        self.blocks = _stack_blocks(blocks) if config.scan_layers else nnx.List(blocks)
        self.final_norm = RMSNorm(
            config.hidden, eps=config.norm_eps, dtype=dtype, param_dtype=param_dtype
        )
        self.lm_head = _linear(config, config.hidden, config.vocab_size, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Computes next-token logits.

        Args:
            tokens: int32 ``[B, T]`` token ids in ``[0, vocab_size)``, ``T <= max_seq_len``.

        Returns:
            float32 logits ``[B, T, vocab_size]``; position ``t`` depends only on
            ``tokens[:, : t + 1]``.

        Raises:
            ValueError: if ``tokens`` is not 2-D or longer than ``max_seq_len``.
        """
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, seq], got {tokens.shape}.")
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds LlamaConfig.max_seq_len="
                f"{self.config.max_seq_len}; shorten the batch or raise max_seq_len."
            )
        x = self.embed(tokens)
        if self.config.scan_layers:
            x = _scan_blocks(self.blocks, x, self.config.remat)
        else:
            run = _run_block_remat if self.config.remat else _run_block
            for block in self.blocks:
                x = run(block, x)
        # Logits in float32: the cross entropy over a large vocabulary is sensitive to rounding.
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)


def loss_fn(model: Llama, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross entropy.

    Position ``t`` predicts ``tokens[:, t + 1]``; the mean runs over the ``B * (T - 1)``
    predictions.

    Args:
        model: the language model.
        tokens: int32 ``[B, T]`` with ``T >= 2``.

    Returns:
        A float32 scalar, in nats.
    """
    logits = model(tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.mean(losses)
