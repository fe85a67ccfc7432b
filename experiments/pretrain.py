"""Pre-trains a LLaMA-style Flax model with jax_mlpo's offloaded AdamW or Lion (the main job).

Usage:
  python experiments/pretrain.py --config experiments/configs/tiny.yaml \
      [--set steps=100 --set offload.host_cache=4MiB] [--optimizer optax]
  python experiments/pretrain.py --config experiments/configs/7b-node.yaml --set model=280B \
      --dry-run --processes 64
  python experiments/pretrain.py --config ... --set checkpoint.every=50 [--resume]
  python experiments/pretrain.py --config ... --num-processes 2 --process-id K \
      --coordinator HOST:PORT        # one of N processes (or experiments/launch/*.sh)

The run directory holds the resolved config (config.yaml), the per-step metrics
(metrics-<optimizer>.jsonl), the summary table (summary-<optimizer>.md and .json), the plot
(pretrain-<optimizer>.png), unless tiers are given the optimizer's file tiers (tiers/) and, with
``checkpoint.every``, the checkpoints (checkpoints-<optimizer>/: params, optimizer state, data
position; ``--resume`` continues from the latest). With several processes (data parallel,
``jax.distributed``) every process runs the same config with ``batch_size`` rows of the global
batch, and process 0 writes the outputs with the slowest process's step time; every process
writes its shards of each checkpoint, which restores onto any process count. See
docs/pretrain.md.

The job's parts, in ``experiments/job/``: :mod:`~experiments.job.run_config` (the config),
:mod:`~experiments.job.dry_run` (the memory plan), :mod:`~experiments.job.optimizer` (the
optimizer), :mod:`~experiments.job.train` (the loop), :mod:`~experiments.job.records` (its
outputs) and :mod:`~experiments.job.metrics` (a step's figures across processes).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

# XLA's CPU thread pools hold max(cores, devices) threads, what one collective over every
# device needs; a device may run two independent collectives at once, each holding a thread,
# and starve another device (seen with 4 devices on 2 cores: 3 of them in a collective-permute
# for XLA's 40 s). Several CPU devices per process get 4 threads each (read when jax first
# creates its CPU client, so set here, before any array).
_CPU_DEVICES = int(os.environ.get("JAX_NUM_CPU_DEVICES", "1") or 1)
if _CPU_DEVICES > 1:
    os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 4 * _CPU_DEVICES)))

import jax  # noqa: E402

from experiments.job.dry_run import dry_run, format_dry_run  # noqa: E402
from experiments.job.run_config import ConfigError, load_config, to_yaml  # noqa: E402
from experiments.job.train import init_distributed, train  # noqa: E402

logger = logging.getLogger("pretrain")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the run's losses, summary and paths (or the dry run).

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
      :func:`experiments.job.train.train`'s result, or with ``--dry-run``
      :func:`experiments.job.dry_run.dry_run`'s.

    Raises:
      SystemExit: for a config error (its message names the key and the fix).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="experiments/configs/tiny.yaml")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted for sections), value as YAML; a mapping merges into "
        "the section it names; applied in order",
    )
    parser.add_argument(
        "--optimizer",
        choices=["offload", "optax"],
        default="offload",
        help="offload: jax_mlpo.adamw (default); optax: in-memory optax.adamw, for comparison",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in checkpoint.dir (params, optimizer state, "
        "data position); starts at step 0 if there is none",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="report parameter, state and host memory sizes; allocate nothing",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes sharing the optimizer state (for --dry-run)",
    )
    group = parser.add_argument_group(
        "multi-process training (jax.distributed; one process per accelerator or host, each "
        "started with the same config)"
    )
    group.add_argument(
        "--coordinator",
        default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        metavar="HOST:PORT",
        help="process 0's address for jax.distributed (default: $JAX_COORDINATOR_ADDRESS)",
    )
    group.add_argument(
        "--num-processes",
        type=int,
        default=_env_int("JAX_NUM_PROCESSES"),
        help="processes of the job (default: $JAX_NUM_PROCESSES; under srun or mpirun, "
        "detected by jax)",
    )
    group.add_argument(
        "--process-id",
        type=int,
        default=_env_int("JAX_PROCESS_ID"),
        help="this process's index, 0 .. N-1 (default: $JAX_PROCESS_ID)",
    )
    args = parser.parse_args(argv)
    if args.processes != 1 and not args.dry_run:
        parser.error(
            "--processes applies to --dry-run only; to train on several processes pass "
            "--num-processes, --process-id and --coordinator (or use experiments/launch/)"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    try:
        cfg = load_config(args.config, args.set)
        resolved = to_yaml(cfg)
        if args.dry_run:
            logger.info("resolved config (%s):\n%s", args.config, resolved)
            plan = dry_run(cfg, args.processes)
            logger.info("dry run, nothing allocated:\n%s", format_dry_run(plan))
            return plan
        if init_distributed(args.coordinator, args.num_processes, args.process_id) > 0:
            logger.setLevel(logging.WARNING)  # process 0 reports
        logger.info("resolved config (%s):\n%s", args.config, resolved)
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            (Path(cfg.run_dir) / "config.yaml").write_text(resolved)
        return train(cfg, args.optimizer == "optax", resume=args.resume)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"${name}={value!r} is not an integer") from None


def cli(argv: list[str] | None = None) -> None:
    """:func:`main` as the command runs it: a failed process of a multi-process run exits at once.

    Otherwise a process whose step failed would wait in ``jax.distributed``'s shutdown barrier
    (up to 300 s) for the others, which wait for it in the step's collectives: it prints its
    error and leaves with exit status 1 instead (the launcher, e.g. ``single_node.sh`` or
    ``srun``, then stops the others; a peer's departure also fails their collectives). The
    metrics written so far are closed, and the checkpoints are crash-safe: a save in flight is
    left as a temporary directory that the next run removes.

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).
    """
    try:
        main(argv)
    except BaseException as e:
        if not (jax.distributed.is_initialized() and jax.process_count() > 1):
            raise
        if isinstance(e, SystemExit) and (e.code is None or isinstance(e.code, int)):
            code = e.code or 0
        else:
            if isinstance(e, SystemExit):
                print(e.code, file=sys.stderr)
            else:
                traceback.print_exc()
            code = 130 if isinstance(e, KeyboardInterrupt) else 1
        print(f"pretrain.py: process {jax.process_index()} of {jax.process_count()} exits with "
              f"status {code}, not waiting for the others", file=sys.stderr)  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    cli()
