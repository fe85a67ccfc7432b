"""jax_mlpo: MLP-Offload for JAX.

optax's AdamW, Lion and Muon with their optimizer state (fp32 master params and moments) off the
accelerator, in a host cache and file tiers, streamed subgroup by subgroup.
"""

import importlib
from typing import TYPE_CHECKING, Any

from jax_mlpo import errors, extend
from jax_mlpo.config import (
    Bandwidth,
    ConfigError,
    FileTier,
    ObjectTier,
    OffloadConfig,
    TierLimits,
    parse_size,
)
from jax_mlpo.engine.host_heap import return_freed_buffers
from jax_mlpo.engine.step_metrics import StepMetrics
from jax_mlpo.errors import (
    CheckpointInProgressError,
    CorruptCheckpointError,
    EngineFailedError,
    JaxMlpoError,
    NoEngineError,
    PendingUpdateError,
    StaleStateError,
    TierFullError,
    UnsupportedRuleError,
    UnusedTiersWarning,
)
from jax_mlpo.tiers.file import CorruptBlobError, TierIOError
from jax_mlpo.tiers.lock import TierInUseError
from jax_mlpo.transforms.accumulation import MultiSteps
from jax_mlpo.transforms.elementwise import adamw, lion
from jax_mlpo.transforms.muon import OffloadedMuonState, muon
from jax_mlpo.transforms.offload_plan import EnginePlan, OffloadPlan, TierPlan, plan_offload
from jax_mlpo.transforms.opt_state import OffloadedAdamWState, OffloadedState
from jax_mlpo.transforms.overlap import overlapped_step
from jax_mlpo.transforms.overlapped_loop import OverlappedLoop
from jax_mlpo.transforms.runtime import close, closing, engine_of, metrics

__version__ = "0.1.0"

if TYPE_CHECKING:  # for type checkers and editors; at run time, __getattr__ below
    from jax_mlpo import checkpoint


def __getattr__(name: str) -> Any:
    """``jax_mlpo.checkpoint``, imported on first use: it imports orbax, half a second of a
    new interpreter's start-up (2.7 s against 2.2 s on 2 cores) that a process which only
    trains (a data-parallel worker, an evaluation) does not need."""
    if name == "checkpoint":
        return importlib.import_module("jax_mlpo.checkpoint")
    raise AttributeError(f"module 'jax_mlpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "checkpoint"})


__all__ = [
    "Bandwidth",
    "CheckpointInProgressError",
    "ConfigError",
    "CorruptBlobError",
    "CorruptCheckpointError",
    "EngineFailedError",
    "EnginePlan",
    "FileTier",
    "JaxMlpoError",
    "MultiSteps",
    "NoEngineError",
    "ObjectTier",
    "OffloadConfig",
    "OffloadPlan",
    "OffloadedAdamWState",
    "OffloadedMuonState",
    "OffloadedState",
    "OverlappedLoop",
    "PendingUpdateError",
    "StaleStateError",
    "StepMetrics",
    "TierLimits",
    "TierFullError",
    "TierPlan",
    "TierIOError",
    "TierInUseError",
    "UnsupportedRuleError",
    "UnusedTiersWarning",
    "adamw",
    "lion",
    "muon",
    "checkpoint",
    "errors",
    "extend",
    "close",
    "closing",
    "engine_of",
    "metrics",
    "overlapped_step",
    "parse_size",
    "plan_offload",
    "return_freed_buffers",
]
