"""Named model shapes, from CPU test sizes to the paper's 40B-120B and a 280B shape.

The 40B, 52B, 70B, 100B and 120B shapes are copied from MLP-Offload (Maurya et al., SC'25): layers,
hidden, FFN and heads as the paper lists them, GQA with 4 KV heads, sequence 2048, vocabulary
32000. The names are the paper's; with this architecture (SwiGLU, GQA-4, untied embeddings) the
exact counts differ from them, e.g. "40B" has ~48.0e9 parameters and "52B" ~44.0e9.
:func:`param_count` gives the exact number; use it, not the name, for bytes and throughput.
"""

from __future__ import annotations

from models.llama import LlamaConfig

__all__ = ["PRESETS", "get_preset", "param_count"]


def _lm(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int = 4) -> LlamaConfig:
    """A large shape: vocab 32000, seq 2048, bf16 parameters and compute (the paper's setting:
    bf16 parameters on the accelerator, fp32 master copy in the optimizer state)."""
    return LlamaConfig(
        vocab_size=32000,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        max_seq_len=2048,
        param_dtype="bfloat16",
        dtype="bfloat16",
    )


PRESETS: dict[str, LlamaConfig] = {
    # CPU unit tests: byte-level vocabulary, compiles and steps in well under a second.
    "tiny": LlamaConfig(
        vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=256, max_seq_len=128
    ),
    # Default CPU pre-training run (~3.2M parameters).
    "small": LlamaConfig(
        vocab_size=256, hidden=256, layers=4, heads=8, kv_heads=4, ffn=768, max_seq_len=256
    ),
    # GPT-3-125M-like width and depth with a LLaMA block (MHA, SwiGLU FFN = 8/3 * hidden).
    "125M": _lm(layers=12, hidden=768, ffn=2048, heads=12, kv_heads=12),
    # TinyLlama-1.1B.
    "1B": _lm(layers=22, hidden=2048, ffn=5632, heads=32, kv_heads=4),
    # LLaMA-1 7B and 13B (multi-head attention).
    "7B": _lm(layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32),
    "13B": _lm(layers=40, hidden=5120, ffn=13824, heads=40, kv_heads=40),
    # 20B in the paper's family (GQA-4, head size 128).
    "20B": _lm(layers=52, hidden=6144, ffn=16384, heads=48),
    # The paper's shapes (mlp-offload.md, "Model shapes"): layers x hidden x FFN x heads.
    "40B": _lm(layers=128, hidden=5120, ffn=20480, heads=40),
    "52B": _lm(layers=64, hidden=8192, ffn=21824, heads=64),
    "70B": _lm(layers=80, hidden=8192, ffn=28672, heads=64),
    "100B": _lm(layers=124, hidden=8192, ffn=28672, heads=64),
    "120B": _lm(layers=96, hidden=10240, ffn=28672, heads=80),
    # The paper trains "up to 280B" without giving the shape; ours (head size 128, FFN 3.25x
    # hidden, GQA-4) lands at ~280e9 parameters.
    "280B": _lm(layers=88, hidden=16384, ffn=53248, heads=128),
}


def param_count(config: LlamaConfig) -> int:
    """Number of parameters of ``Llama(config)``, computed from the shape without allocating.

    Args:
        config: the model shape.

    Returns:
        Embedding + per-block (q, k, v, o, gate, up, down, 2 RMSNorm scales) + final RMSNorm
        + output projection.
    """
    h, kv_dim = config.hidden, config.kv_heads * config.head_dim
    attention = 2 * h * h + 2 * h * kv_dim  # q and o are h x h; k and v are h x kv_dim
    mlp = 3 * h * config.ffn
    block = attention + mlp + 2 * h
    return config.vocab_size * h + config.layers * block + h + h * config.vocab_size


def get_preset(name: str) -> LlamaConfig:
    """Returns the preset ``name``.

    Args:
        name: a key of :data:`PRESETS`, e.g. ``"tiny"`` or ``"40B"``.

    Returns:
        The (frozen) config; use ``config.replace(...)`` for variants.

    Raises:
        ValueError: if ``name`` is not a preset; the message lists the valid names.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}."
        ) from None
