"""LLaMA-style models that jax_mlpo trains, and their named shapes."""

from models.llama import Llama, LlamaConfig, loss_fn
from models.presets import PRESETS, get_preset, param_count

__all__ = ["PRESETS", "Llama", "LlamaConfig", "get_preset", "loss_fn", "param_count"]
