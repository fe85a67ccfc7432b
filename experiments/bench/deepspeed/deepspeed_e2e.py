"""End to end: one training iteration of a small GPT, jax_mlpo against DeepSpeed ZeRO-3 + NVMe.

Both systems train the same model (``experiments/configs/e2e-*.yaml``: a preset of
``models/presets.py``, bf16 params and compute) on the same batches (``experiments/job/data.py``),
with the same optimizer settings, subgroup size, pinned host memory budget and disk directory:

- ``deepspeed``: ``ds_gpt.py`` (beside this file) in the DeepSpeed venv (``.peer-venv``): the
  model in torch, ``deepspeed.initialize`` with ZeRO stage 3, bf16, ``offload_optimizer`` to
  ``nvme`` (``<dir>/ds``, pinned, ``buffer_count`` 12, pipelined reads and writes), libaio,
  sub_group_size = the config's ``offload.subgroup_size``, DeepSpeedCPUAdam (AdamW). Iteration =
  forward + backward (with the fp32 gradient swap-out) + ``engine.step`` (swap in, Adam, swap
  out).
- ``jax_mlpo``: ``experiments/pretrain.py`` as it is, with the config (its one file tier in the
  same directory as DeepSpeed's ``nvme_path``, ``host_cache`` = DeepSpeed's pinned buffers):
  each update beside the next forward pass (``overlap: true``, ``jax_mlpo.overlapped_step``).
  Iteration = pretrain.py's ``step_s``, the one jitted program; its forward + backward alone is
  timed apart once per run (``experiments/job/steps.py:OverlappedSteps``), and the rest of the
  iteration is the update the forward pass did not hide (``update_exposed_s``).
- ``jax_mlpo_plain``: the same with ``overlap=false``: the jitted forward + backward, then the
  jitted update (``tx.update`` with the offloaded AdamW, and ``apply_updates``).

Before every step, outside the timing, each side runs ``sync`` and drops the page cache (root), so
neither serves its optimizer state from RAM; ``/proc/self/io`` gives the bytes each step read and
wrote. For the jax side this driver runs pretrain.py in a worker process (``--worker jax``) whose
data iterator drops the cache before handing out each batch (pretrain.py counts that in
``data_s``, not in ``step_s``).

Rounds interleave the systems (DeepSpeed, jax_mlpo, DeepSpeed, jax_mlpo, ...), one process per
system and round; a run's figure is the median of its steps after the warm-up (the config's
``report.skip_steps``); the table gives the median over rounds and [min-max];
``e2e_speedup_vs_deepspeed`` = DeepSpeed's iteration / jax_mlpo's, per round. Each round starts
with fio on the directory (O_DIRECT, 1 MiB, queue depth 8).

Usage (after ``bash experiments/bench/deepspeed/install_deepspeed_peer.sh``; root, for the cache
drops):
  .venv/bin/python -m experiments.bench.deepspeed.deepspeed_e2e \
      --config experiments/configs/e2e-125m.yaml --rounds 5 \
      --json experiments/results/deepspeed_e2e.json
  # disk-bound: the tier capped (e2e-125m-capped.yaml), its limit at the cap; jax_mlpo only
  .venv/bin/python -m experiments.bench.deepspeed.deepspeed_e2e \
      --config experiments/configs/e2e-125m-capped.yaml --rounds 5 \
      --systems jax_mlpo,jax_mlpo_plain --json experiments/results/deepspeed_e2e_capped.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from experiments.bench.deepspeed.peer import (
    ROOT,
    module_command,
    require_peer,
    worker_command,
    worker_env,
)
from experiments.bench.harness import format_spread as fmt
from experiments.bench.harness import interleave, medians, ratio_spread, spread, write_json
from experiments.bench.sysio import (
    drop_page_cache,
    filesystem,
    fio_bandwidth,
    fio_mixed,
    proc_io,
)
from experiments.job import iteration

logger = logging.getLogger("bench.deepspeed_e2e")

MODULE = "experiments.bench.deepspeed.deepspeed_e2e"  # its jax_mlpo worker runs it again
SYSTEMS = ("deepspeed", "jax_mlpo", "jax_mlpo_plain")
# what each jax_mlpo system sets on top of the config
JAX_SETS = {"jax_mlpo": ["overlap=true"], "jax_mlpo_plain": ["overlap=false"]}


# ---- jax_mlpo worker: experiments/pretrain.py with a page-cache drop before every step --------


def jax_worker(args) -> dict:
    from experiments import pretrain
    from experiments.job import train
    from experiments.job.run_config import load_config, resolve_model

    per_step: dict[int, dict] = {}
    original = train.batches

    def batches_dropping_cache(*a, **kw):
        """The train loop's batches, but the page cache is dropped before each batch is handed
        out and /proc/self/io is read around each step (from one hand-out to the next)."""
        prev = None
        for step, batch in original(*a, **kw):
            if prev is not None:
                finish(prev)
            t0 = time.perf_counter()
            dropped = drop_page_cache(level=1)
            row = {"page_cache_dropped": dropped, "drop_s": time.perf_counter() - t0}
            row["_io0"] = proc_io()
            per_step[step + 1] = prev = row
            yield step, batch
        if prev is not None:
            finish(prev)

    def finish(row: dict) -> None:
        io0, io1 = row.pop("_io0"), proc_io()
        row["bytes_read"] = io1["read"] - io0["read"]
        row["bytes_written"] = io1["write"] - io0["write"]

    train.batches = batches_dropping_cache
    argv = ["--config", args.config] + [x for s in args.set for x in ("--set", s)]
    cfg = load_config(args.config, args.set)
    for tier in cfg.offload.tiers:
        shutil.rmtree(tier.path, ignore_errors=True)
    t0 = time.perf_counter()
    result = pretrain.main(argv)
    run_s = time.perf_counter() - t0
    for tier in cfg.offload.tiers:
        shutil.rmtree(tier.path, ignore_errors=True)
    records = [json.loads(line) for line in Path(result["metrics"]).read_text().splitlines()]
    skip = cfg.report.skip_steps
    # everything the tiers did from one update's end to the next's: the iteration
    whole = {i["step"]: i for i in iteration.iterations(records)}
    steps = []
    for r in records:
        row = {
            "step": r["step"],
            "loss": r["loss"],
            "iter_s": r["step_s"],
            # an overlapped run times its forward + backward apart from its third step on
            "fwd_bwd_s": r.get("fwd_bwd_s"),
            # an overlapped step's update is what its forward pass did not hide
            "update_s": r.get("update_s", r.get("update_exposed_s")),
            "beside_s": r.get("beside_s"),
            "host_update_s": r.get("host_update_s"),
            "read_wait_s": r.get("read_wait_s"),
            "compute_s": r.get("compute_s"),
            "write_wait_s": r.get("write_wait_s"),
            "cache_hits": r.get("cache_hits"),
            "subgroups": r.get("subgroups"),
            "tier_bytes_read": sum(t["read_bytes"] for t in r.get("tiers", {}).values()),
            "tier_bytes_written": sum(t["write_bytes"] for t in r.get("tiers", {}).values()),
            "tier_busy_s": sum(t["busy_s"] for t in r.get("tiers", {}).values()),
            "reads_ahead": r.get("reads_ahead", 0),
        }
        if r["step"] in whole:
            tiers = whole[r["step"]]["tiers"].values()
            row["iter_tier_bytes"] = sum(t["read_bytes"] + t["write_bytes"] for t in tiers)
            row["iter_busy_s"] = max(t["busy_s"] for t in tiers)
        row.update(per_step.get(r["step"], {}))
        if row["read_wait_s"] is not None and row["update_s"] is not None:
            # the read wait the forward pass could not have hidden: all of it in a plain step,
            # at most the update's unhidden time in an overlapped one
            row["read_wait_unhidden_s"] = min(row["read_wait_s"], row["update_s"])
        if r["step"] > skip:
            steps.append(row)
    model = resolve_model(cfg)
    from models import param_count

    out = {
        "system": "jax_mlpo",
        "jax_mlpo_sha256": library_fingerprint(),
        "params": param_count(model),
        "dtype": model.param_dtype,
        "host_cache": cfg.offload.host_cache,
        "subgroup_size": cfg.offload.subgroup_size,
        "tiers": [t.path for t in cfg.offload.tiers],
        "run_s": run_s,
        "losses": [r["loss"] for r in records],
        "steps": steps,
    }
    keys = (
        "iter_s", "fwd_bwd_s", "update_s", "host_update_s", "read_wait_s", "compute_s",
        "write_wait_s", "cache_hits", "bytes_read", "bytes_written", "tier_bytes_read",
        "tier_bytes_written", "tier_busy_s", "drop_s", "reads_ahead", "iter_tier_bytes",
        "iter_busy_s", "beside_s", "read_wait_unhidden_s",
    )  # fmt: skip
    out.update(medians(steps, [k for k in keys if all(s.get(k) is not None for s in steps)]))
    return out


def against_limit(out: dict, mixed_gbps: float, *, overlapped: bool = False) -> dict:
    """jax_mlpo's iteration against its limit, with the disk's mixed bandwidth of the round.

    ``limit_s`` = max(forward + backward + the update's compute, the iteration's tier bytes at
    the mixed bandwidth, or at the tier's ``bandwidth_cap`` where that is lower); ``floor_s`` =
    forward + backward + max(compute, the update's own tier bytes at that bandwidth): with a
    given host cache the update itself reads every subgroup not in the cache when it starts and
    writes as many back (docs/design.md, "Read-ahead"), so no
    overlap with the forward and backward pass brings the iteration below it. An ``overlapped``
    update runs beside the forward pass, so its floor is only max(forward + backward, the
    update): the update's own bytes cannot overlap the backward pass, but how forward and
    backward split is not measured.
    """
    rate = mixed_gbps * 1e9
    compute = out["fwd_bwd_s"] + out["compute_s"]
    limit = max(compute, out["iter_tier_bytes"] / rate)
    update_bytes = out["tier_bytes_read"] + out["tier_bytes_written"]
    update = max(out["compute_s"], update_bytes / rate)
    floor = max(out["fwd_bwd_s"], update) if overlapped else out["fwd_bwd_s"] + update
    return {
        "limit_s": limit,
        "vs_limit": out["iter_s"] / limit,
        "floor_s": floor,
        "vs_floor": out["iter_s"] / floor,
        "disk_busy": out["iter_busy_s"] / out["iter_s"],
    }


def library_fingerprint() -> str:
    """sha256 of jax_mlpo's sources: the library may change between rounds (shared checkout)."""
    digest = hashlib.sha256()
    for path in sorted(Path(ROOT, "jax_mlpo").rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and path.is_file():
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


# ---- the driver ------------------------------------------------------------------------------


def ds_command(args, cfg, model, n_params: int, nvme_path: str) -> list[str]:
    o = cfg.optimizer
    data_cache = cfg.data.cache_dir or str(Path(cfg.run_dir).parent / "data-cache")
    return worker_command(
        "ds_gpt.py",
        "--vocab", str(model.vocab_size),
        "--hidden", str(model.hidden),
        "--layers", str(model.layers),
        "--heads", str(model.heads),
        "--kv-heads", str(model.kv_heads),
        "--ffn", str(model.ffn),
        "--rope-theta", str(model.rope_theta),
        "--norm-eps", str(model.norm_eps),
        "--dtype", "bf16" if model.param_dtype == "bfloat16" else "fp32",
        "--expect-params", str(n_params),
        "--batch-size", str(cfg.batch_size),
        "--seq-len", str(cfg.seq_len),
        "--seed", str(cfg.seed),
        "--data-cache", os.path.join(ROOT, data_cache),
        "--peak-lr", str(o.peak_lr),
        "--warmup-steps", str(o.warmup_steps),
        "--total-steps", str(cfg.steps),
        "--min-lr-ratio", str(o.min_lr_ratio),
        "--b1", str(o.b1),
        "--b2", str(o.b2),
        "--eps", str(o.eps),
        "--weight-decay", str(o.weight_decay),
        "--clip-norm", str(o.clip_norm),
        "--nvme-path", nvme_path,
        "--sub-group-size", str(cfg.offload.subgroup_size),
        "--buffer-count", str(args.buffer_count),
        "--pipeline", args.pipeline,
        "--steps", str(cfg.steps),
        "--warmup", str(cfg.report.skip_steps),
    )  # fmt: skip


def run_system(system: str, args, cfg, model, n_params, log_dir: Path, rnd: int) -> dict:
    if system == "deepspeed":
        env = worker_env()
        cmd = ds_command(args, cfg, model, n_params, args.nvme_path)
    else:
        env = dict(os.environ)
        sets = [*args.set, *JAX_SETS[system]]
        cmd = module_command(MODULE, "--worker", "jax", "--config", args.config,
                             *[x for s in sets for x in ("--set", s)])  # fmt: skip
    log = log_dir / f"{system}-round{rnd}.log"
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with open(log, "w") as err:
        res = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT, timeout=1800
        )
    lines = res.stdout.strip().splitlines()
    with open(log, "a") as f:  # whatever the worker printed besides its JSON line
        f.write("\n".join(lines[:-1]) + "\n")
    if res.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{system} failed (rc {res.returncode}), log {log}:\n{tail}")
    out = json.loads(lines[-1])
    out["process_s"] = time.perf_counter() - t0
    out["loadavg_before"] = load0
    out["loadavg_after"] = os.getloadavg()
    out["log"] = str(log)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="experiments/configs/e2e-125m.yaml")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="pretrain.py override"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--buffer-count", type=int, default=12, help="DeepSpeed pinned buffers")
    parser.add_argument("--pipeline", choices=("on", "off"), default="on")
    parser.add_argument("--no-fio", action="store_true", help="skip the per-round fio")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=("jax",), help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    os.chdir(ROOT)

    if args.worker:
        sys.stdout.write(json.dumps(jax_worker(args)) + "\n")  # the driver reads this line
        return

    from experiments.job.run_config import load_config, plain, resolve_model
    from models import param_count

    cfg = load_config(args.config, args.set)
    model = resolve_model(cfg)
    n_params = param_count(model)
    tiers = cfg.offload.tiers
    if len(tiers) != 1:
        sys.exit(f"{args.config}: give exactly one offload tier (DeepSpeed has one nvme_path)")
    directory = os.path.dirname(os.path.abspath(tiers[0].path))
    # a capped tier (TierLimits.bandwidth_cap, reads and writes together): the limit's rate
    cap = tiers[0].limits.bandwidth_cap
    cap_gbps = cap / 1e9 if cap else None
    args.nvme_path = os.path.join(directory, "ds")
    os.makedirs(directory, exist_ok=True)
    systems = args.systems.split(",")
    if "deepspeed" in systems:
        require_peer()
    if not drop_page_cache(level=1):
        logger.warning("cannot drop the page cache (not root): state may be served from RAM")
    log_dir = Path(cfg.run_dir) / "e2e-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    state_bytes = n_params * (12 if model.param_dtype == "bfloat16" else 8)
    logger.info(
        "model %s (%s): %s parameters, %s; batch %d x %d; %d steps per run (%d warm-up); "
        "jax_mlpo state %.2f GB on %s, host_cache %.0f MiB, subgroup %d; DeepSpeed nvme_path %s, "
        "buffer_count %d, pipeline %s",
        cfg.model,
        json.dumps(cfg.model_overrides),
        f"{n_params:,}",
        model.param_dtype,
        cfg.batch_size,
        cfg.seq_len,
        cfg.steps,
        cfg.report.skip_steps,
        state_bytes / 1e9,
        tiers[0].path,
        cfg.offload.host_cache / 2**20,
        cfg.offload.subgroup_size,
        args.nvme_path,
        args.buffer_count,
        args.pipeline,
    )
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "disk_dir": directory,
        "filesystem": filesystem(directory),
        "loadavg_start": os.getloadavg(),
    }
    disk = []

    def measure_disk(rnd: int) -> None:
        if not args.no_fio:
            d = fio_bandwidth(os.path.join(directory, "fio"))
            # and the mixed limit (fio 50/50 randrw at the best point of a request-size sweep)
            d["mixed"] = fio_mixed(os.path.join(directory, "fio"), block="32M", depth=32)
            disk.append(d)
            logger.info("round %d disk: %s, load %s", rnd, d, os.getloadavg())

    def run(system: str, rnd: int) -> dict:
        out = run_system(system, args, cfg, model, n_params, log_dir, rnd)
        out["round"] = rnd
        mixed = disk[-1].get("mixed", {}).get("mixed_gbps") if disk else None
        if cap_gbps is not None:  # the tier moves at most this, whatever the disk could
            mixed = min(mixed, cap_gbps) if mixed else cap_gbps
        if system in JAX_SETS and mixed and "iter_tier_bytes" in out:
            out.update(against_limit(out, mixed, overlapped=system == "jax_mlpo"))
        logger.info(
            "round %d %s: iteration %.2f s (fwd+bwd %.2f s, %s %.2f s), read %.2f GB "
            "written %.2f GB per step, process %.0f s, load %.1f -> %.1f",
            rnd,
            system,
            out["iter_s"],
            out["fwd_bwd_s"],
            "step" if system == "deepspeed" else "update",
            out["step_s"] if system == "deepspeed" else out["update_s"],
            out.get("bytes_read", 0) / 1e9,
            out.get("bytes_written", 0) / 1e9,
            out["process_s"],
            out["loadavg_before"][0],
            out["loadavg_after"][0],
        )
        if system == "deepspeed" and rnd == 0:
            pinned = out["pinned_bytes"]
            if pinned != cfg.offload.host_cache:
                logger.warning(
                    "DeepSpeed's pinned swap buffers are %d bytes, jax_mlpo's host_cache %d: "
                    "set offload.host_cache to %d for the same budget",
                    pinned,
                    cfg.offload.host_cache,
                    pinned,
                )
        return out

    t_all = time.perf_counter()
    runs = interleave(systems, args.rounds, run, before_round=measure_disk)
    machine["loadavg_end"] = os.getloadavg()
    versions = sorted({o["jax_mlpo_sha256"] for o in runs.get("jax_mlpo", [])})
    if len(versions) > 1:
        logger.warning("jax_mlpo's sources changed between rounds: %s", versions)
    total_s = time.perf_counter() - t_all

    rows = {}
    keys = (
        "iter_s", "fwd_s", "bwd_s", "fwd_bwd_s", "step_s", "update_s", "host_update_s",
        "read_wait_s", "compute_s", "write_wait_s", "swap_in_s", "adam_s", "swap_out_s",
        "grad_swap_out_s", "bytes_read", "bytes_written", "drop_s", "cache_hits", "reads_ahead",
        "limit_s", "vs_limit", "floor_s", "vs_floor", "disk_busy", "beside_s",
        "read_wait_unhidden_s",
    )  # fmt: skip
    for system, outs in runs.items():
        row = {"system": system}
        for key in keys:
            if all(key in o for o in outs):
                row[key] = spread(o[key] for o in outs)
        for key in ("params", "dtype", "subgroups", "pinned_bytes", "host_cache", "disk_bytes",
                    "deepspeed", "torch", "torch_threads", "subgroup_size"):  # fmt: skip
            if key in outs[0]:
                row[key] = outs[0][key]
        row["losses_round0"] = outs[0]["losses"]
        rows[system] = row

    ratios = {}
    if "deepspeed" in runs and "jax_mlpo" in runs:
        ds, jx = runs["deepspeed"], runs["jax_mlpo"]

        def per_round(ds_key: str, jax_key: str) -> list[list[float]]:
            return [[d[ds_key] for d in ds], [j[jax_key] for j in jx]]

        ratios["e2e_speedup_vs_deepspeed"] = ratio_spread(*per_round("iter_s", "iter_s"))
        ratios["fwd_bwd_ratio"] = ratio_spread(*per_round("fwd_bwd_s", "fwd_bwd_s"))
        ratios["update_ratio"] = ratio_spread(*per_round("step_s", "update_s"))
        ratios["update_ratio_host"] = ratio_spread(*per_round("step_s", "host_update_s"))
        ratios["update_ratio_with_grad_swap"] = ratio_spread(
            [d["step_s"] + d["grad_swap_out_s"] for d in ds], [j["update_s"] for j in jx]
        )
    if "jax_mlpo_plain" in runs:
        if "deepspeed" in runs:
            ratios["e2e_speedup_vs_deepspeed_plain_step"] = ratio_spread(
                [d["iter_s"] for d in runs["deepspeed"]],
                [j["iter_s"] for j in runs["jax_mlpo_plain"]],
            )
        if "jax_mlpo" in runs:
            ratios["overlap_speedup"] = ratio_spread(
                [j["iter_s"] for j in runs["jax_mlpo_plain"]],
                [j["iter_s"] for j in runs["jax_mlpo"]],
            )

    lines: list[str] = []
    lines.append(
        f"{cfg.model} {json.dumps(cfg.model_overrides)}: {n_params:,} params "
        f"({model.param_dtype}), batch {cfg.batch_size} x {cfg.seq_len}, {args.rounds} "
        f"interleaved rounds x {cfg.steps - cfg.report.skip_steps} measured steps; medians "
        "over rounds [min-max]"
    )
    lines.append(
        f"{'system':<15}{'iteration s':>20}{'fwd+bwd s':>20}{'update/step s':>20}"
        f"{'read GB':>9}{'write GB':>9}"
    )
    for system, row in rows.items():
        upd = row.get("step_s") or row.get("update_s")
        lines.append(
            f"{system:<15}{fmt(row['iter_s']):>20}{fmt(row['fwd_bwd_s']):>20}{fmt(upd):>20}"
            f"{row['bytes_read']['median'] / 1e9:>9.2f}{row['bytes_written']['median'] / 1e9:>9.2f}"
        )
    if "deepspeed" in rows:
        r = rows["deepspeed"]
        lines.append(
            f"deepspeed: fwd {fmt(r['fwd_s'])}, bwd {fmt(r['bwd_s'])} (grad swap-out "
            f"{fmt(r['grad_swap_out_s'])}), step: swap in {fmt(r['swap_in_s'])}, adam "
            f"{fmt(r['adam_s'])}, swap out {fmt(r['swap_out_s'])}; pinned "
            f"{r['pinned_bytes'] / 2**20:.0f} MiB, subgroups {r['subgroups']}"
        )
    for name in (n for n in JAX_SETS if n in rows):
        r = rows[name]
        lines.append(
            f"{name}: host update {fmt(r.get('host_update_s'))}: read wait "
            f"{fmt(r.get('read_wait_s'))}, compute {fmt(r.get('compute_s'))}, write wait "
            f"{fmt(r.get('write_wait_s'))}; cache hits {fmt(r.get('cache_hits'), digits=0)}; "
            f"reads ahead {fmt(r.get('reads_ahead'), digits=0)}; "
            f"host_cache {r['host_cache'] / 2**20:.0f} MiB; read wait not hidden "
            f"{fmt(r.get('read_wait_unhidden_s'))}, update after its first group "
            f"{fmt(r.get('beside_s'))}"
        )
        if "vs_limit" in r:
            lines.append(
                f"{name}: iteration = {fmt(r['vs_limit'])} x its limit {fmt(r['limit_s'])} s "
                "(max(fwd+bwd + update compute, the iteration's tier bytes at fio's mixed "
                f"bandwidth or the tier's cap)), {fmt(r['vs_floor'])} x the floor with this host "
                f"cache {fmt(r['floor_s'])} s; tiers busy {fmt(r['disk_busy'])} of the iteration"
            )
    if disk:
        lines.append("disk (fio O_DIRECT 1 MiB QD8, and mixed 32 MiB x 32): " + json.dumps(disk))
    for k, v in ratios.items():
        lines.append(f"{k} = {fmt(v)}")
    if len(versions) > 1:
        lines.append(f"WARNING: jax_mlpo's sources changed between rounds ({', '.join(versions)})")
    lines.append(f"load average start {machine['loadavg_start']}, end {machine['loadavg_end']}")
    logger.info("summary\n%s", "\n".join(lines))
    result = {
        "args": vars(args),
        "config": plain(dataclasses.asdict(cfg)),
        "machine": machine,
        "total_s": total_s,
        "disk": disk,
        "rows": rows,
        "ratios": ratios,
        "runs": runs,
        "jax_mlpo_versions": versions,
    }
    write_json(args.json, result)
    if args.json:
        logger.info("results in %s", args.json)


if __name__ == "__main__":
    main()
