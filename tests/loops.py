"""Runs the training loops of tests/integration_worker.py (a Flax loop with its own orbax
``CheckpointManager`` on four CPU devices) in interpreters of their own.

Loops that share no checkpoint run one after another in one interpreter, which starts JAX,
Flax and orbax once for all of them; a loop that resumes another's checkpoint runs in a new
one, as a restarted job would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from processes import ROOT, json_lines

WORKER = Path(__file__).with_name("integration_worker.py")
TIMEOUT_S = 300

Loop = tuple[str, str, str, Path]  # KIND OPTIMIZER PHASE WORKDIR (integration_worker.py)


def start_loops(*loops: Loop) -> subprocess.CompletedProcess:
    """The interpreter that ran ``loops`` one after another, finished (failed or not)."""
    return subprocess.run([sys.executable, str(WORKER), *_args(loops)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=ROOT)  # fmt: skip


def _args(loops: tuple[Loop, ...]) -> list[str]:
    return [str(part) for loop in loops for part in loop]


def run_loops(*loops: Loop) -> list[dict]:
    """Runs ``loops`` one after another in one new interpreter.

    Returns:
      What each loop printed (integration_worker.py's JSON line), in order.
    """
    return json_lines([str(WORKER), *_args(loops)], TIMEOUT_S)[-len(loops) :]
