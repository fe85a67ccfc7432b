"""The engine's host memory does not grow with the model: a regression guard, not a timing.

A jitted, donated bf16 train step of 64Mi params with all optimizer state on a disk tier runs in
a fresh process (experiments/bench/memory.py's child), beside the same step with no optimizer.
The staging transport this replaced held 8 B/param of host copies (0.5 GiB here) on top,
so the bound below would fail by 64 MiB at least.
"""

from __future__ import annotations

import json
import subprocess
import sys

PARAMS_MI = 64
CACHE = 256 * 2**20  # the pipeline: 4 buffers of 48 MiB (4Mi-element subgroups)


def run(system: str, tier) -> dict:
    cmd = [sys.executable, "-m", "experiments.bench.memory", "--child", system,
           "--params-mi", str(PARAMS_MI), "--cache", str(CACHE), "--tier", str(tier),
           "--steps", "2"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_host_memory_is_the_host_cache(tmp_path):
    floor = run("none", tmp_path / "none")
    mlpo = run("jax_mlpo", tmp_path / "tier")
    n = PARAMS_MI * 2**20
    # the engine's pool is within its budget, and nothing else of note is allocated in Python
    # (tracemalloc: numpy arrays, jax's tracing and lowering; the staging held 512 MiB here)
    assert mlpo["engine_host_bytes"] <= CACHE
    assert mlpo["traced_peak"] <= 32 * 2**20, mlpo["traced_peak"]
    # over the no-optimizer step: the gradients XLA keeps for the update (bf16, 2 B/param; the
    # update takes over their buffer) and the host cache, with 64 MiB for the rest
    growth = (mlpo["peak_rss"] - mlpo["rss_start"]) - (floor["peak_rss"] - floor["rss_start"])
    allowed = 2 * n + CACHE + 64 * 2**20
    assert growth <= allowed, f"{growth / 2**20:.0f} MiB > {allowed / 2**20:.0f} MiB"
