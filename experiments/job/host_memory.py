"""Will a run fit: its memory per process, by part, against what the machine has.

:func:`training_memory` adds up what a training process allocates for the chosen optimizer,
before anything is allocated: params, gradients, the update, the optimizer's state or host
cache, the forward and backward pass's temporaries as XLA's compiler counts them, and the
runtime's own. On a CPU backend all of it is host memory; with an accelerator the params,
gradients and temporaries are device memory and the optimizer's side is host memory.
:func:`check_fits` compares the host side with ``/proc/meminfo``'s ``MemAvailable`` and refuses
a run that cannot fit with the figures and the fix, instead of letting the kernel's OOM
killer end it midway. ``pretrain.py`` checks before it builds the model, and ``--dry-run``
prints the same figures.

The figures (bytes per parameter, bf16 params) are the measured ones of
``experiments/bench/memory.py`` (docs/benchmarks.md, "Memory"): jax_mlpo grows params (2) +
gradients (2) and writes the update over the gradients; ``optax.adamw`` as ``pretrain.py
--optimizer optax`` runs it (moments in the params' dtype, clipping chained before it) holds m
and v (2 + 2) and XLA's fresh update and clipped gradients (2 + 2) beside params and gradients.
"""

from __future__ import annotations

import dataclasses
import resource
from typing import TYPE_CHECKING

from experiments.job.optimizer import muon_matrix_params, muon_update_bytes
from experiments.job.run_config import ConfigError, RunConfig, resolve_model
from experiments.job.steps import grad_step_temp_bytes
from models import param_count

if TYPE_CHECKING:  # dry_run imports this module
    from experiments.job.dry_run import OptimizerPlan

GiB = 2**30
# What jax and XLA hold before the model (measured: 0.25 GiB RSS after import and a first
# computation) plus compiled programs and their scratch (the no-optimizer intercept of
# experiments/bench/memory.py, 0.51 GiB, rounded up).
RUNTIME_BYTES = GiB // 2 + GiB // 4


@dataclasses.dataclass(frozen=True)
class TrainingMemory:
    """One process's memory by part, in bytes.

    Attributes:
      device: parts in the accelerator's memory (the host's on a CPU backend).
      host: parts in host memory beside them.
      on_cpu: whether the device is the host (CPU backend): then everything is host memory.
      state_bytes: the optimizer's state (jax_mlpo: fp32 master, m, v on the tiers and in the
        cache; optax: m and v in memory).
    """

    device: dict[str, int]
    host: dict[str, int]
    on_cpu: bool
    state_bytes: int

    @property
    def parts(self) -> dict[str, int]:
        """The parts that are host memory (the device's too on a CPU backend)."""
        return {**(self.device if self.on_cpu else {}), **self.host}

    @property
    def host_total(self) -> int:
        """Host bytes: the host parts, plus the device parts on a CPU backend."""
        return sum(self.host.values()) + (sum(self.device.values()) if self.on_cpu else 0)


def training_memory(
    cfg: RunConfig, engine: OptimizerPlan | None, on_cpu: bool = True
) -> TrainingMemory:
    """What one process of ``cfg`` allocates, by part (a single-process run).

    Args:
      cfg: the run config.
      engine: jax_mlpo's plan for it (:func:`experiments.job.dry_run.optimizer_plan` with one
        process), or None for ``pretrain.py --optimizer optax``.
      on_cpu: a CPU backend (the device parts are host memory too).

    Returns:
      The parts; nothing is allocated.
    """
    m = resolve_model(cfg)
    n = param_count(m)
    pbytes = 2 if m.param_dtype == "bfloat16" else 4
    device = {
        "params": n * pbytes,
        "gradients": n * pbytes,
        # XLA's own figure for the compiled forward and backward pass (seconds to compile,
        # nothing allocated): an estimate from the shapes missed the backward pass's
        # temporaries by 0.8 GiB on beyond-ram.yaml (docs/beyond-ram.md)
        "forward and backward temporaries (XLA)": grad_step_temp_bytes(cfg),
    }
    if cfg.optimizer.name == "muon":
        # Newton-Schulz's temporaries (optax's: they hold its update too). The update runs
        # after the forward and backward pass has freed its temporaries: the peak is the larger
        # of the two (jax_mlpo on e2e-125m: 1.08x the peak RSS measured, where adding both made
        # it 1.21x).
        fwd_bwd = device["forward and backward temporaries (XLA)"]
        beyond = muon_update_bytes(cfg, use_optax=engine is None) - fwd_bwd
        device["Muon's update temporaries beyond those (XLA)"] = max(0, beyond)
    host: dict[str, int] = {"jax runtime and compiled programs": RUNTIME_BYTES}
    if engine is None:
        mu_bytes = 2 if cfg.optimizer.mu_dtype == "bfloat16" else pbytes
        if cfg.optimizer.name == "lion":
            moments = n * mu_bytes
            device["optax.lion m"] = moments
        elif cfg.optimizer.name == "muon":  # the matrices' momentum, AdamW's m and v elsewhere
            matrices = muon_matrix_params(cfg)
            moments = matrices * mu_bytes + (n - matrices) * (mu_bytes + pbytes)
            device["optax.contrib.muon m (matrices), m and v (the rest)"] = moments
        elif cfg.optimizer.mu_dtype == "bfloat16":
            moments = n * (2 + pbytes)
            device["optax.adamw m (bfloat16) and v (params' dtype)"] = moments
        else:
            moments = 2 * n * pbytes
            device["optax.adamw m and v (params' dtype)"] = moments
        if cfg.optimizer.name != "muon":  # (Muon's: its temporaries, above)
            device["update and clipped gradients (XLA's, fresh)"] = 2 * n * pbytes
        return TrainingMemory(device, host, on_cpu, moments)
    host["jax_mlpo host cache (engine)"] = engine.host_bytes
    if not on_cpu:
        host["subgroup staging (3 x 4 B x subgroup)"] = 12 * engine.subgroup_elems
    device["update"] = 0  # written over the gradients
    return TrainingMemory(device, host, on_cpu, engine.state_bytes_per_process)


def _kib_field(path: str, field: str) -> int | None:
    """A ``kB`` field of a procfs file (``/proc/meminfo``, ``/proc/self/status``) in bytes;
    None where there is no such file or field."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def meminfo(field: str) -> int | None:
    """A field of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``) in bytes, or None."""
    return _kib_field("/proc/meminfo", field)


def peak_rss_bytes() -> int:
    """The process's peak resident set from ``getrusage`` (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_memory() -> dict[str, int]:
    """This process's resident memory now and at its peak (``VmRSS``, ``VmHWM``) in bytes, as
    ``{"rss_bytes", "peak_rss_bytes"}``; without procfs the peak from ``getrusage``."""
    rss, peak = (_kib_field("/proc/self/status", f) for f in ("VmRSS", "VmHWM"))
    if peak is None:
        peak = peak_rss_bytes()
    return {"rss_bytes": rss, "peak_rss_bytes": peak} if rss is not None else {
        "peak_rss_bytes": peak}  # fmt: skip


def check_fits(plan: TrainingMemory, use_optax: bool, available: int | None) -> None:
    """Refuses a run whose host memory plan exceeds what the machine has available.

    Raises:
      ConfigError: naming the parts, the total, the available memory and the fixes.
    """
    need = plan.host_total
    if available is None or need <= available:
        return
    lines = ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.parts.items() if v)
    fix = (
        "offload the optimizer state (drop --optimizer optax: jax_mlpo keeps it on disk tiers)"
        if use_optax
        else "lower offload.host_cache, batch_size or seq_len, or set model_overrides.remat: true"
    )
    raise ConfigError(
        f"this run needs {need / GiB:.1f} GiB of host memory ({lines} GiB) but "
        f"{available / GiB:.1f} GiB is available (/proc/meminfo MemAvailable): {fix}"
    )
