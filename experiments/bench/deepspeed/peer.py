"""Where the DeepSpeed peer lives and how its workers are started.

The peer is a venv of its own (``.peer-venv``: torch CPU and DeepSpeed, no jax, installed by
``install_deepspeed_peer.sh``). Its workers (``ds_update.py``, ``ds_gpt.py``) are started by
path with that venv's python; ``PYTHONPATH`` holds the repository root so that they import
:mod:`experiments.bench.sysio`, :mod:`experiments.bench.harness` and :mod:`experiments.job.data`
(standard library and numpy only). jax_mlpo's side of a comparison runs as a module of this
package in the driver's own interpreter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[3])
PEER_PYTHON = os.path.join(ROOT, ".peer-venv", "bin", "python")
HERE = os.path.dirname(os.path.abspath(__file__))


def require_peer() -> None:
    """Exits with the fix when the peer's venv is not installed."""
    if not os.path.exists(PEER_PYTHON):
        sys.exit(
            f"{PEER_PYTHON} missing: run bash experiments/bench/deepspeed/install_deepspeed_peer.sh"
            " first"
        )


def worker_command(script: str, *args: str) -> list[str]:
    """The command line of a peer worker (``ds_update.py`` or ``ds_gpt.py``) in ``.peer-venv``.

    Args:
      script: the worker's file name in this directory.
      args: its arguments.

    Returns:
      The argv.
    """
    return [PEER_PYTHON, os.path.join(HERE, script), *args]


def worker_env() -> dict[str, str]:
    """A peer worker's environment: DeepSpeed's CPU accelerator, its JIT-built ops from
    ``.torch_ext`` (``install_deepspeed_peer.sh`` builds them) and the repository root on
    ``PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=os.path.join(ROOT, ".torch_ext"),
        PYTHONPATH=ROOT + (os.pathsep + path if path else ""),
    )


def module_command(module: str, *args: str) -> list[str]:
    """The command line of a jax_mlpo-side worker: ``module`` (dotted) run by this interpreter.

    Run it with ``cwd=ROOT``, which ``-m`` puts on the path.
    """
    return [sys.executable, "-m", module, *args]
