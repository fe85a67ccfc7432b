"""Launches a test worker on several local processes (jax.distributed on CPU) and checks they
all exit cleanly, with the tail of each process's log in the failure message."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = str(pathlib.Path(__file__).resolve().parents[1])


def free_port() -> int:
    """A TCP port free on this machine now (for the jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port, t0 = free_port(), time.monotonic()
    logs = [open(logs_dir / f"log{k}.txt", "w+") for k in range(nproc)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), *args_of(k, port)],
            env=env,
            stdout=logs[k],
            stderr=subprocess.STDOUT,
        )
        for k in range(nproc)
    ]
    try:
        deadline = t0 + timeout_s
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - t0
    text = []
    for k, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- process {k} ---\n{log.read()[-3000:]}")
        log.close()
    assert codes is not None, f"timed out after {timeout_s} s\n" + "\n".join(text)
    assert codes == [0] * nproc, f"exit codes {codes}\n" + "\n".join(text)
    return elapsed
