"""Launches test workers in interpreters of their own: one worker that prints JSON lines
(:func:`json_lines`), or one on several local processes (jax.distributed on CPU), checking that
they all exit cleanly, with the tail of each process's log in the failure message; the
data-parallel job of tests/dist_worker.py run that way."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

import numpy as np

from jax_mlpo.testing.processes import free_port, run_local

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
DIST_WORKER = pathlib.Path(__file__).with_name("dist_worker.py")
STEPS = 20  # of the data-parallel job
TIMEOUT_S = 80


def json_lines(argv: list[str], timeout_s: float, env: dict[str, str] | None = None
               ) -> list[dict]:  # fmt: skip
    """Runs ``python *argv`` in a new interpreter (its device count is fixed when JAX starts)
    from the repository's root, with ``env`` added to this one's environment.

    Returns:
      The JSON lines it printed, in order.

    Raises:
      AssertionError: it exited non-zero (the message has the tail of its stderr).
    """
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout_s, env={**os.environ, **(env or {})})  # fmt: skip
    assert done.returncode == 0, done.stderr[-8000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


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


def run_data_parallel(
    nproc: int, base: pathlib.Path, mode: str = "plain", steps: int = STEPS
) -> tuple[dict, list[dict], float]:
    """tests/dist_worker.py's job on ``nproc`` processes (its MODE ``mode``) under ``base``.

    Returns:
      Process 0's final params (gathered), every process's JSON, and the seconds taken.
    """
    tiers, out = base / "tiers", base / "out"
    tiers.mkdir(parents=True)
    out.mkdir()
    elapsed = run_workers(
        DIST_WORKER,
        nproc,
        lambda k, port: [str(k), str(nproc), str(port), str(tiers), str(out), str(steps), mode],
        base,
        TIMEOUT_S,
    )
    params = dict(np.load(out / "params.npz"))
    infos = [json.loads((out / f"proc{k}.json").read_text()) for k in range(nproc)]
    return params, infos, elapsed
