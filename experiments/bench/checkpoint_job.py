"""The checkpoint benchmark's fresh-process runs and its job's shape.

``run_child`` runs one measurement in a fresh process and deletes its files whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

LEAF = 16 * 2**20  # elements per param leaf
SUBGROUP = 4 * 2**20  # 48 MiB blobs with a bf16 master


def run_child(module: str, args: list[str], directory: str) -> dict:
    """Runs ``python -m module *args`` in a fresh process with ``directory`` new and empty
    (deleted afterwards); returns the dict it printed as ``RESULT <json>``.

    Raises:
      RuntimeError: the run failed (its stderr's end in the message).
    """
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                              text=True, check=False)  # fmt: skip
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])
