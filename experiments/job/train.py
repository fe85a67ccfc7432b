"""The training loop of the pre-training job, on one process or as one of several.

:func:`train` runs a :class:`~experiments.job.run_config.RunConfig`'s steps: the model from its
preset, the batches of :mod:`experiments.job.data`, the optimizer of
:mod:`experiments.job.optimizer` (jax_mlpo's offloaded AdamW, Lion or Muon, or optax's in
memory for comparison) and, with
``checkpoint.every``, checkpoints that a later run resumes exactly. A step is two jitted halves
timed apart (forward + backward, then the update); :mod:`experiments.job.records` turns each into a
metrics record. In a multi-process run (:func:`init_distributed`) every process runs the same
loop on its rows of the global batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import jax_mlpo
from experiments.job import metrics
from experiments.job.data import TokenDataset, batches
from experiments.job.dry_run import optimizer_plan
from experiments.job.host_memory import check_fits, meminfo, training_memory
from experiments.job.iteration import tier_totals
from experiments.job.mesh import batch_sharding, build_mesh, shard
from experiments.job.optimizer import build_optimizer
from experiments.job.records import earlier_records, finish, progress, step_record
from experiments.job.run_config import ConfigError, RunConfig, resolve_model
from experiments.job.steps import AutoSteps, make_step_runner
from jax_mlpo import checkpoint
from jax_mlpo.sharding import processes as distributed
from models import Llama, param_count

logger = logging.getLogger("pretrain")


def init_distributed(
    coordinator: str | None, num_processes: int | None, process_id: int | None
) -> int:
    """Starts ``jax.distributed`` for a multi-process run; nothing for a single process.

    The processes are given explicitly (``--coordinator``, ``--num-processes``,
    ``--process-id``, or ``$JAX_COORDINATOR_ADDRESS``, ``$JAX_NUM_PROCESSES``,
    ``$JAX_PROCESS_ID`` as ``experiments/launch/rank.sh`` exports them), or, when none is
    given, detected by JAX inside a Slurm step (``srun``) or an Open MPI job of more than one
    task.

    Args:
      coordinator: ``host:port`` of process 0, or None.
      num_processes: processes of the job, or None.
      process_id: this process's index, or None.

    Returns:
      This process's index (0 for a single process).

    Raises:
      ConfigError: for an incomplete or inconsistent set of the three.
    """
    if jax.distributed.is_initialized():
        return jax.process_index()
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given):
        tasks = os.environ.get("SLURM_NTASKS") if "SLURM_STEP_NODELIST" in os.environ else None
        tasks = tasks or os.environ.get("OMPI_COMM_WORLD_SIZE")
        if tasks and int(tasks) > 1:
            jax.distributed.initialize()  # JAX reads the launcher's environment
            logger.info("jax.distributed: process %d of %d (detected)", jax.process_index(),
                        jax.process_count())  # fmt: skip
            return jax.process_index()
        return 0
    if num_processes is None or num_processes < 1:
        raise ConfigError(
            f"--num-processes is {num_processes}: give the job's process count (>= 1) with "
            "--process-id and --coordinator (or $JAX_NUM_PROCESSES)"
        )
    if num_processes == 1:
        return 0
    if process_id is None or not 0 <= process_id < num_processes or not coordinator:
        raise ConfigError(
            f"a run of {num_processes} processes needs --process-id in 0..{num_processes - 1} "
            f"(got {process_id}) and --coordinator HOST:PORT (got {coordinator!r})"
        )
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )
    logger.info("jax.distributed: process %d of %d, coordinator %s", process_id,
                num_processes, coordinator)  # fmt: skip
    return process_id


def build_dataset(cfg: RunConfig, vocab_size: int) -> TokenDataset:
    """The config's token data (``data`` section).

    Args:
      cfg: the run config.
      vocab_size: the model's vocabulary, checked against a token file's ids.

    Returns:
      The dataset (text corpora cached under ``data.cache_dir``).
    """
    d = cfg.data
    cache = Path(d.cache_dir) if d.cache_dir else Path(cfg.run_dir).parent / "data-cache"
    if d.source == "default":
        return TokenDataset.from_default_corpus(cache)
    if d.source == "text":
        return TokenDataset.from_text_files(d.paths, cache)
    return TokenDataset.from_token_file(
        d.paths[0], dtype=d.token_dtype, vocab_size=vocab_size if d.check_vocab else None
    )


def open_checkpoints(cfg: RunConfig, name: str, resume: bool) -> Any:
    """The run's checkpoint manager, or None without ``checkpoint.every`` and ``--resume``.

    In a multi-process run every process opens it on the same directory (which must be on a
    file system all of them see, as ``run_dir``): orbax saves and restores collectively.

    Raises:
        ConfigError: for a new run (no ``--resume``) into a directory that holds checkpoints,
            which it would otherwise mix with its own.
    """
    c = cfg.checkpoint
    if not c.every and not resume:
        return None
    directory = Path(c.dir) if c.dir else Path(cfg.run_dir) / f"checkpoints-{name}"
    mngr = checkpoint.manager(directory, max_to_keep=c.keep)
    latest = mngr.latest_step()
    if not resume and latest is not None:
        mngr.close()
        raise ConfigError(
            f"checkpoint directory {str(directory)!r} holds checkpoints (latest: step "
            f"{latest}) of an earlier run: pass --resume to continue it, or set "
            "checkpoint.dir (or run_dir) elsewhere to start a new run"
        )
    return mngr


def restore(cfg: RunConfig, mngr: Any, params: Any, opt_state: Any) -> tuple[int, Any, Any]:
    """(data step, params, opt_state) of the latest checkpoint; step 0 and the inputs if none.

    Every process of a multi-process run calls it (the restore is collective); each gets its
    shards, whatever the process count that saved the checkpoint.

    Raises:
        ConfigError: for a checkpoint written with another seed (other batches).
    """
    if mngr.latest_step() is None:
        logger.warning("--resume: no checkpoint in %s, starting at step 0", mngr.directory)
        return 0, params, opt_state
    step, params, opt_state, extra = checkpoint.restore(mngr, params, opt_state)
    if extra.get("seed") != cfg.seed:
        raise ConfigError(
            f"checkpoint {step} in {mngr.directory} was written with seed {extra.get('seed')}, "
            f"this config has seed {cfg.seed} (other batches): resume with the run's config, "
            "or start a new run elsewhere"
        )
    nproc = jax.process_count()
    saved_by, saved_batch = int(extra.get("processes", 1)), extra.get("global_batch")
    if saved_batch is not None and int(saved_batch) != cfg.batch_size * nproc:
        saved_batch = int(saved_batch)
        # Allowed (a deliberate change of batch size), but usually an oversight when the
        # process count changed: batch_size is per process.
        fix = (f"; set batch_size={saved_batch // nproc} to continue it unchanged"
               if saved_batch % nproc == 0 else "")  # fmt: skip
        logger.warning(
            "checkpoint %d was written with a global batch of %d rows (%d processes), this run "
            "has %d (%d x batch_size %d): it goes on with other batches%s",
            step, saved_batch, saved_by, cfg.batch_size * nproc, nproc, cfg.batch_size, fix,
        )  # fmt: skip
    logger.info("resumed from step %d (%s), saved by %d process(es)", step, mngr.directory,
                saved_by)  # fmt: skip
    return int(extra["data_step"]), params, opt_state


def train(cfg: RunConfig, use_optax: bool, resume: bool = False) -> dict[str, Any]:
    """Runs the config's steps; writes metrics, summary and plot under ``cfg.run_dir``.

    With ``checkpoint.every`` it saves params, optimizer state and the data position every
    that many steps and at the end; ``resume`` continues from the latest checkpoint (the
    batches of step ``k`` depend only on ``(seed, k)``, so the run goes on exactly).

    In a multi-process run (``jax.distributed`` initialised, see :func:`init_distributed`)
    every process calls it with the same config: params and optimizer state are sharded over
    the processes (:mod:`jax_mlpo.sharding.processes`), each process feeds its ``batch_size`` rows
    of the global batch of ``batch_size x processes`` rows, and process 0 writes the metrics,
    summary and plot, with the slowest process's step time (``experiments.job.metrics.aggregate``).
    Checkpoints are saved and restored by every process (each writes and reads its shards;
    :mod:`jax_mlpo.checkpoint`), so a run resumes on any process count; process 0 continues
    the metrics file.

    Args:
      cfg: the run config.
      use_optax: train with optax's in-memory optimizer instead of jax_mlpo's.
      resume: continue from the latest checkpoint.

    Returns:
      :func:`experiments.job.records.finish`'s ``losses``, ``summary``, ``metrics`` and ``plot``;
      the processes other than 0 return the losses of the steps they ran only.
    """
    name = "optax" if use_optax else "offload"
    nproc, pid = jax.process_count(), jax.process_index()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # What XLA frees goes back to the system, so the peak stays the first step's (else it rose
    # 14% over 12 steps: jax_mlpo/engine/host_heap.py).
    jax_mlpo.return_freed_buffers()
    if nproc == 1:  # before anything large is allocated (multi-process: --dry-run's figures)
        engine = None if use_optax else optimizer_plan(cfg, 1)
        plan = training_memory(cfg, engine, on_cpu=jax.default_backend() == "cpu")
        check_fits(plan, use_optax, meminfo("MemAvailable"))
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.parts.items() if v)
        logger.info("memory plan: %.2f GiB of host memory (%s)", plan.host_total / 2**30, parts)
        total = meminfo("MemTotal")
        if total and not use_optax:
            logger.info(
                "optimizer state %.2f GB (%s) = %.2fx this machine's MemTotal (%.2f GB)%s",
                plan.state_bytes / 1e9, cfg.optimizer.name, plan.state_bytes / total, total / 1e9,
                ": it could not be held in memory even with nothing else there"
                if plan.state_bytes >= total else "",
            )  # fmt: skip
    # One device per process: jax_mlpo.sharding.processes's data-parallel layout; otherwise the
    # config's mesh over every device of the job.
    data_parallel = nproc > 1 and jax.local_device_count() == 1
    device_mesh = None if data_parallel else build_mesh(cfg.mesh, jax.devices())
    if device_mesh is not None and jax.default_backend() != "cpu":
        raise ConfigError(
            f"this process has {jax.local_device_count()} {jax.default_backend()} devices; "
            "jax_mlpo meshes several of them per process on CPU only for now: run one process "
            "per device (NPROCS=<devices> experiments/launch/single_node.sh), or make one "
            "visible (CUDA_VISIBLE_DEVICES)"
        )
    mngr = open_checkpoints(cfg, name, resume)  # first: a refused run stops before any work
    model_cfg = resolve_model(cfg)
    graphdef, params, rest = nnx.split(Llama(model_cfg, rngs=nnx.Rngs(cfg.seed)), nnx.Param, ...)
    logger.info("model %s: %s parameters", cfg.model, f"{param_count(model_cfg):,}")
    dataset = build_dataset(cfg, model_cfg.vocab_size)
    logger.info("data: %r", dataset)
    if device_mesh is not None:  # the params sharded over the mesh
        params, rest = shard(params, device_mesh), shard(rest, device_mesh)
        rows = batch_sharding(device_mesh, cfg.batch_size * nproc)
        logger.info("mesh %s over %d devices of %d process(es)", dict(device_mesh.shape),
                    device_mesh.size, nproc)  # fmt: skip
    elif nproc > 1:
        # Every process built the same params from the seed; each keeps its shards only.
        mesh = distributed.data_parallel_mesh()
        params, rest = distributed.shard_params(params, mesh), distributed.shard_params(rest, mesh)
        rows = distributed.batch_sharding(mesh)
        logger.info("%d processes, global batch %d x %d tokens", nproc, cfg.batch_size * nproc,
                    cfg.seq_len)  # fmt: skip
    tx = build_optimizer(cfg, use_optax)
    opt_state = tx.init(params)
    start = 0
    try:
        if resume and mngr.latest_step() is not None:
            # Into the params' shapes, with the initial params freed first: the two sets are
            # never alive together (the resumed beyond-RAM run peaked 4.13 GiB higher).
            params = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
            )
        if resume:
            start, params, opt_state = restore(cfg, mngr, params, opt_state)
    except BaseException:
        mngr.close()
        if not use_optax:
            jax_mlpo.close(opt_state)
        raise
    # the engines of the offloaded states (muon has up to three), which update one after
    # another; an engine over no leaves (an empty group of muon's) runs no update
    found = [] if use_optax else jax_mlpo.transforms.opt_state.find_offloaded(opt_state)
    engines = [e for e in map(jax_mlpo.engine_of, found) if e.layout.num_params]
    steps = make_step_runner(cfg, graphdef, tx, params, steps_left=cfg.steps - start)
    tokens_per_step = cfg.batch_size * nproc * cfg.seq_len
    metrics_path = run_dir / f"metrics-{name}.jsonl"
    lead = pid == 0  # writes the metrics, summary and plot
    records = earlier_records(metrics_path, start) if lead else []
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        desc=f"pretrain[{name}]",
        unit="step",
        mininterval=0.5,
        disable=not lead,
    )
    log = metrics_path.open("a" if start else "w") if lead else contextlib.nullcontext()
    try:
        with log, logging_redirect_tqdm(), bar:
            t_data = time.perf_counter()
            # The global batch of a step is the same for any process count: each process takes
            # its rows of it (generating all rows is cheap: random windows of a memory map).
            for step, batch in batches(
                dataset, cfg.batch_size * nproc, cfg.seq_len, cfg.seed, start, end_step=cfg.steps
            ):
                if nproc > 1:
                    mine = batch[pid * cfg.batch_size : (pid + 1) * cfg.batch_size]
                    tokens = jax.make_array_from_process_local_data(rows, mine)
                elif device_mesh is not None:
                    tokens = jax.device_put(batch, rows)
                else:
                    tokens = jnp.asarray(batch)
                t0 = time.perf_counter()
                params, opt_state, loss, timings, updated = steps.run(params, rest, opt_state,
                                                                      tokens)  # fmt: skip
                timings["data_s"] = t0 - t_data
                every = cfg.checkpoint.every
                last = cfg.checkpoint.final and step + 1 == cfg.steps
                saving = every and ((step + 1) % every == 0 or last)
                if saving or step + 1 == cfg.steps:
                    # an overlapped step leaves its gradients pending: applied here, so that
                    # the checkpoint and the final params are the plain loop's
                    params, opt_state, flush_s = steps.flush(params, opt_state)
                    if flush_s:
                        timings["step_s"] += flush_s
                        timings["flush_s"] = flush_s
                        updated += 1
                if saving:
                    t2 = time.perf_counter()
                    extra = {"data_step": step + 1, "seed": cfg.seed, "processes": nproc,
                             "global_batch": cfg.batch_size * nproc}  # fmt: skip
                    checkpoint.save(mngr, step + 1, params, opt_state, extra)
                    timings["checkpoint_s"] = time.perf_counter() - t2  # the snapshot only
                # the step's updates (an overlapped step's and a flush's) are each engine's last
                step_metrics = jax_mlpo.engine.step_metrics.combine(
                    [m for e in engines for m in list(e.metrics)[-updated:]]
                ) if engines and updated else None  # fmt: skip
                # A collective: every process's figures reach every process; the job moves at
                # the pace of its slowest process, whose figures the record holds.
                job = metrics.aggregate(step_metrics, timings, time_key="step_s")
                loss_value = float(np.asarray(loss.addressable_data(0)))  # replicated
                totals = {k: v for e in engines for k, v in tier_totals(e).items()} or None
                r = step_record(step + 1, loss_value, job, tokens_per_step, nproc, totals)
                if lead:
                    log.write(json.dumps(r) + "\n")
                    log.flush()  # a long run's metrics can be followed, and survive a crash
                records.append(r)
                shown = progress(r)
                bar.set_postfix(shown, refresh=False)
                bar.update()
                if lead and ((step + 1) % cfg.log_every == 0 or step == 0):
                    logger.info(
                        "step %d %s", step + 1, " ".join(f"{k}={v}" for k, v in shown.items())
                    )
                if not math.isfinite(r["loss"]):  # the same loss in every process
                    raise SystemExit(f"loss became {r['loss']} at step {step + 1}")
                t_data = time.perf_counter()
    finally:
        try:
            if mngr is not None:
                mngr.wait_until_finished()  # the last checkpoint is durable
                mngr.close()
        finally:
            if not use_optax:
                jax_mlpo.close(opt_state)
    if not lead:
        return {"losses": [r["loss"] for r in records], "summary": None, "metrics": None,
                "plot": None}  # fmt: skip
    digest = params_sha256(params) if nproc == 1 else None
    if isinstance(steps, AutoSteps):
        kept = {True: "overlapped", False: "plain", None: "(undecided)"}[steps.overlapped]
        logger.info("overlap: auto kept the %s step%s", kept,
                    f": {steps.reason}" if steps.reason else "")  # fmt: skip
    return finish(cfg, name, records, metrics_path, params_sha256=digest,
                  overlapped=steps.overlapped)  # fmt: skip


def params_sha256(params: Any) -> str:
    """A sha256 of the params' bytes (every leaf, in tree order): a resumed run's final params
    are bit for bit an uninterrupted run's iff the digests agree."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        a = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{a.dtype.name}{a.shape}".encode())
        digest.update(a.reshape(-1).view(np.uint8))
    return digest.hexdigest()
