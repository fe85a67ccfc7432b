"""The dry run: a config's memory plan per process and tier, without allocating anything.

The figures come from jax_mlpo's own plan (:func:`jax_mlpo.plan.host_plan` for the host
buffers, :func:`jax_mlpo.placement.split.tier_split` for the tiers), the functions the engine
builds itself from, so what ``pretrain.py --dry-run`` prints is what a run allocates. The state
is assumed sharded evenly over the processes (each owns a contiguous 1/N of the flat parameters,
as ZeRO-3 does), each process running its own engine with the config's ``offload`` section.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from experiments.host_memory import meminfo, training_memory
from experiments.run_config import ConfigError, RunConfig, resolve_model
from jax_mlpo import placement
from jax_mlpo.layout import state_bytes_per_param
from jax_mlpo.placement.split import TierSplit, tier_split
from jax_mlpo.plan import HostPlan, host_plan
from models import param_count


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One process's share of the state and the engine plan over it.

    Attributes:
      params: parameters of the model.
      param_dtype: the model's parameter dtype.
      processes: processes sharing the state.
      params_per_process: parameters whose state one process holds.
      state_bytes_per_param: the fp32 master (4, bf16 params only: fp32 params are their own
        master copy) and m and v at their dtypes (4, 2, or 1 + 4/256 for q8 with its scales
        each): 12 or 8 with float32 moments.
      subgroup_elems: parameters per subgroup (the last one may be smaller).
      num_subgroups: subgroups per process.
      host: the engine's host buffer plan.
      split: subgroups and retained subgroups per tier; None when the state fits the host cache.
      bandwidths_given: placement used the tiers' ``read_bandwidth``/``write_bandwidth``
        (otherwise equal bandwidths: a run probes them at start).
    """

    params: int
    param_dtype: str
    processes: int
    params_per_process: int
    state_bytes_per_param: float
    subgroup_elems: int
    num_subgroups: int
    host: HostPlan
    split: TierSplit | None
    bandwidths_given: bool

    @property
    def state_bytes_per_process(self) -> int:
        return math.ceil(self.params_per_process * self.state_bytes_per_param)


def memory_plan(cfg: RunConfig, processes: int) -> MemoryPlan:
    """The engine plan of one of ``processes`` processes running ``cfg``.

    Args:
      cfg: the run config.
      processes: processes sharing the optimizer state evenly.

    Returns:
      The plan; nothing is allocated or created.

    Raises:
      ConfigError: for ``processes < 1`` or an invalid model.
    """
    if processes < 1:
        raise ConfigError(f"--processes must be >= 1, got {processes}")
    model = resolve_model(cfg)
    off = cfg.offload
    n = param_count(model)
    moments = (cfg.optimizer.mu_dtype, cfg.optimizer.nu_dtype)  # dtype names numpy knows
    if cfg.optimizer.name in ("lion", "muon"):  # one moment (muon: its matrices')
        moments = moments[:1]
    per_param = state_bytes_per_param(model.param_dtype == "bfloat16", moments)
    per_proc = math.ceil(n / processes)
    size = min(off.subgroup_size, per_proc)
    n_sg = math.ceil(per_proc / size)
    host = host_plan(
        off,
        num_subgroups=n_sg,
        state_bytes=math.ceil(per_proc * per_param),
        max_state_elems=math.ceil(size * per_param / 4),
        max_subgroup_elems=size,
    )
    given = [(t.read_bandwidth, t.write_bandwidth) for t in host.tiers]
    known = bool(given) and all(r and w for r, w in given)
    split = None
    if host.tiers:
        # The engine's rule: measured placement uses the tiers' bandwidths (given, or probed at
        # start, which a dry run cannot do); the other placements split evenly.
        if known and off.placement == "measured":
            bw = [placement.effective_bandwidth(r, w) for r, w in given]
        else:
            bw = [1.0] * len(host.tiers)
        split = tier_split(n_sg, bw, host.retained, off.retain_policy)
    return MemoryPlan(
        params=n,
        param_dtype=model.param_dtype,
        processes=processes,
        params_per_process=per_proc,
        state_bytes_per_param=per_param,
        subgroup_elems=size,
        num_subgroups=n_sg,
        host=host,
        split=split,
        bandwidths_given=known,
    )


def dry_run(cfg: RunConfig, processes: int) -> dict[str, Any]:
    """Memory plan of a config without allocating: state per process and tier, host memory.

    Args:
      cfg: the run config.
      processes: processes sharing the optimizer state evenly.

    Returns:
      The figures :func:`format_dry_run` prints: parameters and state (all processes, per
      process, per subgroup), the engine's ``pipeline_buffers``, ``retained_subgroups`` and
      ``engine_host_bytes``, per tier path its ``subgroups``, ``retained`` and ``bytes``, the
      host buffers a process needs (``host_buffers``, ``host_bytes``), and the ``problem`` that
      keeps the config from running (None if it runs).

    Raises:
      ConfigError: for ``processes < 1`` or an invalid model.
    """
    plan = memory_plan(cfg, processes)
    host, per_param = plan.host, plan.state_bytes_per_param
    per_proc, state = plan.params_per_process, plan.state_bytes_per_process
    out: dict[str, Any] = {
        "model": cfg.model,
        "param_dtype": plan.param_dtype,
        "processes": processes,
        "params": plan.params,
        "params_per_process": per_proc,
        "state_bytes_per_param": per_param,
        "state_parts": ", ".join(
            (["fp32 master"] if plan.param_dtype == "bfloat16" else [])
            + [f"m {cfg.optimizer.mu_dtype}"]
            + ([f"v {cfg.optimizer.nu_dtype}"] if cfg.optimizer.name == "adamw" else [])
        ),
        "state_bytes": math.ceil(plan.params * per_param),
        "state_bytes_per_process": state,
        "subgroups_per_process": plan.num_subgroups,
        "subgroup_bytes": math.ceil(plan.subgroup_elems * per_param),
        "host_cache": cfg.offload.host_cache,
        "pipeline_buffers": host.minimum,
        "retained_subgroups": host.retained,
        "engine_host_bytes": host.host_bytes,
        "tiers": {},
        "problem": host.problem,
    }
    if plan.split is not None:
        for tier, count, kept in zip(
            host.tiers, plan.split.counts, plan.split.retained, strict=True
        ):
            out["tiers"][tier.path] = {
                "subgroups": count,
                "retained": kept,
                "bytes": math.ceil(count * plan.subgroup_elems * per_param),
            }
        # The last subgroup is smaller: take the difference off the tier holding the most.
        short = math.floor((plan.num_subgroups * plan.subgroup_elems - per_proc) * per_param)
        max(out["tiers"].values(), key=lambda t: t["subgroups"])["bytes"] -= short
        out["tier_bandwidths"] = (
            "given" if plan.bandwidths_given else "assumed equal (probed at start)"
        )
    # The update reads gradients and params in XLA's buffers and writes the update over the
    # gradients: nothing of the model's size on the host beyond the cache. On a GPU
    # a subgroup's gradients, params and update are staged through pinned buffers.
    out["host_buffers"] = {
        "optimizer engine (host cache)": host.host_bytes,
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
        (
            "subgroups per process",
            f"{d['subgroups_per_process']:,} of {_gb(d['subgroup_bytes'])}"
            + (
                " (the last smaller)"
                if d["subgroups_per_process"] * d["subgroup_bytes"] > d["state_bytes_per_process"]
                else ""
            ),
        ),
    ]
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
