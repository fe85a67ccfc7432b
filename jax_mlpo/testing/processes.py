"""Runs a program on several local processes (a ``jax.distributed`` job on one machine, as
:mod:`jax_mlpo.sharding.processes` runs on several hosts) and collects their exit codes and
logs::

    port = jax_mlpo.testing.processes.free_port()
    argvs = [[sys.executable, "worker.py", str(k), str(port)] for k in range(2)]
    run = jax_mlpo.testing.processes.run_local(argvs, os.environ, logs_dir, timeout_s=120)
    assert run.ok, run.logs
"""

from __future__ import annotations

import dataclasses
import pathlib
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence


def free_port() -> int:
    """A TCP port free on this machine now (for the jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """The processes' exit codes (in argv order), their logs and the seconds the run took."""

    codes: list[int] | None  # None: the run timed out (every process was killed)
    logs: list[str]  # each process's stdout and stderr
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.codes is not None and all(c == 0 for c in self.codes)


def run_local(
    argvs: Sequence[Sequence[str]],
    env: Mapping[str, str],
    logs_dir: pathlib.Path,
    timeout_s: float,
) -> LocalRun:
    """Starts one process per argv at once and waits for all of them.

    Args:
      argvs: each process's command line.
      env: their environment.
      logs_dir: where ``log<k>.txt`` (process k's output) is written.
      timeout_s: for the whole run; processes still running then are killed.

    Returns:
      The exit codes (None on a timeout), the logs and the seconds taken.
    """
    t0 = time.monotonic()
    logs = [open(pathlib.Path(logs_dir, f"log{k}.txt"), "w+") for k in range(len(argvs))]  # noqa: SIM115
    procs = [
        subprocess.Popen(list(argv), env=dict(env), stdout=log, stderr=subprocess.STDOUT)
        for argv, log in zip(argvs, logs, strict=True)
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
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return LocalRun(codes, texts, elapsed)
