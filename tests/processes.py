"""Launches a test worker on several local processes (jax.distributed on CPU) and checks they
all exit cleanly, with the tail of each process's log in the failure message."""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Callable

from experiments.processes import free_port, run_local

ROOT = str(pathlib.Path(__file__).resolve().parents[1])


def run_workers(
    worker: pathlib.Path,
    nproc: int,
    args_of: Callable[[int, int], list[str]],
    logs_dir: pathlib.Path,
    timeout_s: float,
) -> float:
    """Runs ``python worker *args_of(k, port)`` for k in 0..nproc-1; returns the seconds taken.

    Raises:
      AssertionError: a process timed out or exited non-zero (the message has their logs).
    """
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    port = free_port()
    argvs = [[sys.executable, str(worker), *args_of(k, port)] for k in range(nproc)]
    run = run_local(argvs, env, logs_dir, timeout_s)
    text = "\n".join(f"--- process {k} ---\n{log[-3000:]}" for k, log in enumerate(run.logs))
    assert run.codes is not None, f"timed out after {timeout_s} s\n" + text
    assert run.codes == [0] * nproc, f"exit codes {run.codes}\n" + text
    return run.elapsed_s
