"""The dry run: a config's memory plan per process and tier, without allocating anything.

The figures come from jax_mlpo's own plan (:func:`jax_mlpo.plan_offload`: the layout, host
buffers and tier split an optimizer's ``init`` builds, made by the functions the engine builds
itself from), so what ``pretrain.py --dry-run`` prints is what a run allocates. The state is
assumed sharded evenly over the processes (each owns a contiguous 1/N of the flat parameters,
as ZeRO-3 does), each process running its own engine with the config's ``offload`` section.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

import jax_mlpo
from experiments.job.host_memory import meminfo, training_memory
from experiments.job.optimizer import muon_matrix_params
from experiments.job.run_config import ConfigError, RunConfig, resolve_model
from models import param_count


@dataclasses.dataclass(frozen=True)
class StatePart:
    """The state one engine of the job's optimizer holds.

    Attributes:
      name: ``adamw`` or ``lion`` (the whole state); for ``muon`` its engines' ``momentum``
        (the matrices' momentum), ``master`` (their fp32 master, bfloat16 params only) and
        ``adam`` (AdamW's state of the other leaves), each in a subdirectory of every tier.
      params: parameters of the model whose state it holds (all processes).
      master: it holds their fp32 master (bfloat16 params, not Muon's momentum engine).
      moments: its moments' dtype names, in order.
    """

    name: str
    params: int
    master: bool
    moments: tuple[str, ...]

    @property
    def description(self) -> str:
        """What it holds: ``fp32 master, m bfloat16, v float32``."""
        moments = [f"{n} {d}" for n, d in zip(("m", "v"), self.moments, strict=False)]
        return ", ".join((["fp32 master"] if self.master else []) + moments)


def state_parts(cfg: RunConfig) -> list[StatePart]:
    """The engines of ``cfg``'s optimizer and the state each holds: one for AdamW and Lion, up
    to three for Muon (:func:`jax_mlpo.muon`)."""
    model = resolve_model(cfg)
    o, n = cfg.optimizer, param_count(model)
    bf16 = model.param_dtype == "bfloat16"
    if o.name == "adamw":
        return [StatePart("adamw", n, bf16, (o.mu_dtype, o.nu_dtype))]
    if o.name == "lion":
        return [StatePart("lion", n, bf16, (o.mu_dtype,))]
    matrices = muon_matrix_params(cfg)
    parts = [StatePart("momentum", matrices, False, (o.mu_dtype,)),
             StatePart("master", matrices, True, ()),
             StatePart("adam", n - matrices, bf16, (o.mu_dtype, "float32"))]  # fmt: skip
    return [p for p in parts if p.params and (p.name != "master" or bf16)]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One process's share of one engine's state and the engine's plan over it.

    Attributes:
      part: the state the engine holds.
      params: parameters of the model.
      param_dtype: the model's parameter dtype.
      processes: processes sharing the state.
      params_per_process: parameters whose state (of this part) one process holds.
      engine: jax_mlpo's plan of the engine (:func:`jax_mlpo.plan_offload`): its subgroups,
        host buffers, retained subgroups and tier split.
      bandwidths_given: placement used the tiers' ``read_bandwidth``/``write_bandwidth``
        (otherwise equal bandwidths: a run probes them at start).
    """

    part: StatePart
    params: int
    param_dtype: str
    processes: int
    params_per_process: int
    engine: jax_mlpo.EnginePlan
    bandwidths_given: bool

    @property
    def state_bytes_per_process(self) -> int:
        return self.engine.state_bytes

    @property
    def state_bytes_per_param(self) -> float:
        """The fp32 master (4, bf16 params only: fp32 params are their own master copy) and the
        moments at their dtypes (4, 2, or about 1 + 4/256 for q8 with its scales each): AdamW's
        12, or 8 with float32 moments."""
        return self.engine.state_bytes / max(self.engine.params, 1)

    @property
    def subgroup_elems(self) -> int:
        """Parameters per subgroup (the last one may be smaller)."""
        return self.engine.subgroup_params

    @property
    def num_subgroups(self) -> int:
        """Subgroups per process."""
        return self.engine.subgroups


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """The plans of every engine of the job's optimizer in one process.

    Attributes:
      engines: one plan per engine, in the order the update runs them.
      problem: why the config cannot run (the engines' host cache split, or an engine's own
        plan), or None.
    """

    engines: tuple[MemoryPlan, ...]
    problem: str | None

    @property
    def state_bytes_per_process(self) -> int:
        return sum(e.state_bytes_per_process for e in self.engines)

    @property
    def host_bytes(self) -> int:
        """Host memory of the engines' buffers (their shares of ``host_cache``)."""
        return sum(e.engine.host_bytes for e in self.engines)

    @property
    def subgroup_elems(self) -> int:
        """Parameters of the largest subgroup of any engine."""
        return max(e.subgroup_elems for e in self.engines)


def process_params(cfg: RunConfig, processes: int) -> dict[str, jax.ShapeDtypeStruct]:
    """One process's share of the model's params, as its engines lay them out: each process
    holds a contiguous 1/``processes`` of the flat params of each of the optimizer's groups
    (ZeRO-3's sharding), so one leaf per group stands for them (the layout lays leaves end to
    end): Muon's matrices as one 2-D leaf, the other leaves as one vector."""
    model = resolve_model(cfg)
    n, dtype = param_count(model), jnp.dtype(model.param_dtype)
    matrices = muon_matrix_params(cfg) if cfg.optimizer.name == "muon" else 0
    shares = {
        "matrices": (math.ceil(matrices / processes), 1),
        "vectors": (math.ceil((n - matrices) / processes),),
    }
    return {k: jax.ShapeDtypeStruct(shape, dtype) for k, shape in shares.items() if shape[0]}


def optimizer_plan(cfg: RunConfig, processes: int) -> OptimizerPlan:
    """The engine plans of one of ``processes`` processes running ``cfg``.

    Engines of one optimizer (Muon's) share ``offload.host_cache`` as the run does
    (:func:`jax_mlpo.plan_offload` plans them as its ``init`` builds them).

    Args:
      cfg: the run config.
      processes: processes sharing the optimizer state evenly.

    Returns:
      The plans; nothing is allocated or created.

    Raises:
      ConfigError: for ``processes < 1`` or an invalid model.
    """
    if processes < 1:
        raise ConfigError(f"--processes must be >= 1, got {processes}")
    model = resolve_model(cfg)
    o, off = cfg.optimizer, cfg.offload
    plan = jax_mlpo.plan_offload(
        process_params(cfg, processes), off, optimizer=o.name, mu_dtype=o.mu_dtype,
        nu_dtype=o.nu_dtype if o.name == "adamw" else None,
    )  # fmt: skip
    parts = state_parts(cfg)
    assert [p.name for p in parts] == [e.name for e in plan.engines], (parts, plan.engines)
    known = bool(off.tiers) and all(t.bandwidth.read and t.bandwidth.write for t in off.tiers)
    engines = tuple(
        MemoryPlan(
            part=part,
            params=param_count(model),
            param_dtype=model.param_dtype,
            processes=processes,
            params_per_process=engine.params,
            engine=engine,
            bandwidths_given=known,
        )
        for part, engine in zip(parts, plan.engines, strict=True)
    )
    return OptimizerPlan(engines, plan.problem)


def memory_plan(cfg: RunConfig, processes: int) -> MemoryPlan:
    """The engine plan of one of ``processes`` processes running ``cfg``, whose optimizer has
    one engine (AdamW, Lion).

    Raises:
      ConfigError: for ``processes < 1``, an invalid model, or an optimizer of several engines
        (Muon: :func:`optimizer_plan`).
    """
    plan = optimizer_plan(cfg, processes)
    if len(plan.engines) != 1:
        raise ConfigError(
            f"optimizer.name={cfg.optimizer.name} runs {len(plan.engines)} engines "
            f"({', '.join(e.part.name for e in plan.engines)}); this plan models one: use "
            "optimizer.name=adamw or lion"
        )
    return plan.engines[0]


def dry_run(cfg: RunConfig, processes: int) -> dict[str, Any]:
    """Memory plan of a config without allocating: state per process and tier, host memory.

    Args:
      cfg: the run config.
      processes: processes sharing the optimizer state evenly.

    Returns:
      The figures :func:`format_dry_run` prints: parameters and state (all processes, per
      process, per subgroup), the engines' ``pipeline_buffers``, ``retained_subgroups`` and
      ``engine_host_bytes``, per tier path its ``subgroups``, ``retained`` and ``bytes``, the
      host buffers a process needs (``host_buffers``, ``host_bytes``), and the ``problem`` that
      keeps the config from running (None if it runs). An optimizer of several engines (Muon)
      has them added up, and each engine's figures under ``engines``.

    Raises:
      ConfigError: for ``processes < 1`` or an invalid model.
    """
    plan = optimizer_plan(cfg, processes)
    engines = plan.engines
    first = engines[0]
    state_all = sum(math.ceil(e.part.params * e.state_bytes_per_param) for e in engines)
    out: dict[str, Any] = {
        "model": cfg.model,
        "param_dtype": first.param_dtype,
        "processes": processes,
        "params": first.params,
        "params_per_process": math.ceil(first.params / processes),
        "state_bytes_per_param": (
            first.state_bytes_per_param if len(engines) == 1 else state_all / first.params
        ),
        "state_parts": "; ".join(
            e.part.description
            if len(engines) == 1
            else f"{e.part.name} ({e.part.params:,} params): {e.part.description}"
            for e in engines
        ),
        "state_bytes": state_all,
        "state_bytes_per_process": plan.state_bytes_per_process,
        "subgroups_per_process": sum(e.num_subgroups for e in engines),
        "subgroup_bytes": max(e.engine.subgroup_bytes for e in engines),
        "host_cache": cfg.offload.host_cache,
        "pipeline_buffers": sum(e.engine.pipeline_buffers for e in engines),
        "retained_subgroups": sum(e.engine.retained for e in engines),
        "engine_host_bytes": plan.host_bytes,
        "tiers": {},
        "problem": plan.problem,
    }
    for e in engines:
        for t in e.engine.tiers:  # Muon's engines: subdirectories of one tier, added up
            total = out["tiers"].setdefault(t.path, {"subgroups": 0, "retained": 0, "bytes": 0})
            total["subgroups"] += t.subgroups
            total["retained"] += t.retained
            total["bytes"] += t.bytes
    if out["tiers"]:
        out["tier_bandwidths"] = (
            "given" if first.bandwidths_given else "assumed equal (probed at start)"
        )
    if len(engines) > 1:
        out["engines"] = {
            e.part.name: {
                "params_per_process": e.params_per_process,
                "state_bytes_per_process": e.state_bytes_per_process,
                "subgroups": e.num_subgroups,
                "host_bytes": e.engine.host_bytes,
                "pipeline_buffers": e.engine.pipeline_buffers,
                "retained": e.engine.retained,
            }
            for e in engines
        }
    # The update reads gradients and params in XLA's buffers and writes the update over the
    # gradients: nothing of the model's size on the host beyond the cache. On a GPU
    # a subgroup's gradients, params and update are staged through pinned buffers.
    out["host_buffers"] = {
        "optimizer engine (host cache)": plan.host_bytes,
        "subgroup staging on a GPU (3 x 4 B x subgroup)": 12 * plan.subgroup_elems,
    }
    out["host_bytes"] = sum(out["host_buffers"].values())
    if processes == 1:  # the whole training process on this machine, as pretrain.py checks it
        training = {}
        for name, engine in (("offload", plan), ("optax", None)):
            t = training_memory(cfg, engine)
            training[name] = {"parts": t.parts, "host_bytes": t.host_total}
        out["training_memory"] = training
        out["mem_available"] = meminfo("MemAvailable")
    return out


def _gb(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_dry_run(d: dict[str, Any]) -> str:
    """The dry run (:func:`dry_run`'s figures) as a two-column markdown table."""
    rows = [
        ("model", f"{d['model']} ({d['param_dtype']} params)"),
        ("parameters", f"{d['params']:,}"),
        ("processes", f"{d['processes']}"),
        ("parameters per process", f"{d['params_per_process']:,}"),
        (
            "optimizer state per parameter",
            f"{d['state_bytes_per_param']:.4g} B ({d['state_parts']})",
        ),
        ("optimizer state, all processes", _gb(d["state_bytes"])),
        ("optimizer state per process", _gb(d["state_bytes_per_process"])),
    ]
    if "engines" in d:  # subgroups of each engine's own size
        rows.append(("subgroups per process", f"{d['subgroups_per_process']:,} (by engine below)"))
    else:
        last = d["subgroups_per_process"] * d["subgroup_bytes"] > d["state_bytes_per_process"]
        rows.append((
            "subgroups per process",
            f"{d['subgroups_per_process']:,} of {_gb(d['subgroup_bytes'])}"
            + (" (the last smaller)" if last else ""),
        ))  # fmt: skip
    for name, e in d.get("engines", {}).items():
        rows.append((f"  engine {name}", f"{e['params_per_process']:,} params, "
                     f"{_gb(e['state_bytes_per_process'])} in {e['subgroups']:,} subgroups, "
                     f"host {_gb(e['host_bytes'])}"))  # fmt: skip
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
    rows.append(("host memory per process on a GPU node", _gb(d["host_bytes"])))
    for name, t in d.get("training_memory", {}).items():
        for part, nbytes in t["parts"].items():
            if nbytes:
                rows.append((f"train on CPU, {name}: {part}", _gb(nbytes)))
        avail = d.get("mem_available")
        fits = "" if avail is None else (" (fits)" if t["host_bytes"] <= avail else
                                         f" > {_gb(avail)} available: refused")  # fmt: skip
        rows.append((f"train on CPU, {name}: host memory", _gb(t["host_bytes"]) + fits))
    if d["problem"]:
        rows.append(("PROBLEM", d["problem"]))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'quantity':<{width}} | value |", f"|{'-' * (width + 2)}|---:|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    return "\n".join(lines)
