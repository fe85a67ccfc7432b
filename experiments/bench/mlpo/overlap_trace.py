"""A jax.profiler trace of one overlapped step: the update's calls beside the forward pass.

A six-layer MLP's AdamW state on a file tier (the host cache smaller than the state), trained
with ``jax_mlpo.overlapped_step``: after warm-up steps, one step runs under ``jax.profiler.trace``
(a Perfetto trace). From the trace's events the script takes XLA's ops (the thunk executor's:
matmuls, fusions, each group's ``jax_mlpo_host_update`` call and its completion) and the engine's
annotations (``jax_mlpo.adamw`` per subgroup, ``jax_mlpo.read_wait``), and prints and draws
which of XLA's ops ran while the engine was still updating: the forward pass's matmuls between
the engine's subgroups, each group's call completing as its subgroups are done.

    python -m experiments.bench.mlpo.overlap_trace --plot docs/overlap_trace.png \
        --json experiments/results/overlap_trace.json
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

from experiments.bench.harness import write_json

LAYERS = 6


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def traced_step(width: int, batch: int, tier: str, warm: int) -> list[dict[str, Any]]:
    """The trace events of one overlapped step after ``warm`` others."""
    import jax
    import jax.numpy as jnp

    import jax_mlpo

    keys = jax.random.split(jax.random.key(0), LAYERS)
    params = {f"l{i}": jax.random.normal(k, (width, width)) * 0.03 for i, k in enumerate(keys)}

    def loss_fn(p, x):
        for i in range(LAYERS):
            x = jnp.tanh(x @ p[f"l{i}"])
        return jnp.mean(x**2)

    state_bytes = 12 * LAYERS * width * width
    config = jax_mlpo.OffloadConfig(
        host_cache=state_bytes // 3, subgroup_size=width * width // 2, prefetch_depth=1,
        tiers=[jax_mlpo.FileTier(tier, sync=False)],
    )  # fmt: skip
    tx = jax_mlpo.adamw(1e-3, offload=config)
    state = tx.init(params)
    step = jax.jit(
        lambda p, s, g, b: jax_mlpo.overlapped_step(loss_fn, tx, p, s, g, b, groups=LAYERS),
        donate_argnums=(0, 1, 2),
    )
    x = jax.random.normal(jax.random.key(1), (batch, width))
    pending = jax.jit(jax.grad(loss_fn))(params, x)
    for _ in range(warm):
        params, state, pending, _ = jax.block_until_ready(step(params, state, pending, x))
    out = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(out, create_perfetto_trace=True):
            params, state, pending, _ = jax.block_until_ready(step(params, state, pending, x))
        (path,) = glob.glob(f"{out}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        jax_mlpo.close(state)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def timeline(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The step's XLA ops and engine annotations, in ms from the first group's call."""
    spans = [e for e in events if e.get("ph") == "X"]
    calls = [e for e in spans if e["name"].startswith("ffi_call")]
    t0 = min(e["ts"] for e in calls)

    def ms(e: dict[str, Any]) -> tuple[float, float]:
        return (e["ts"] - t0) / 1e3, (e["ts"] + e.get("dur", 0) - t0) / 1e3

    engine = [{"subgroup": int(e["args"]["subgroup"]), "span": ms(e)}
              for e in spans if e["name"] == "jax_mlpo.adamw"]  # fmt: skip
    waits = [ms(e) for e in spans if e["name"] == "jax_mlpo.read_wait"]
    completions = [ms(e)[0] for e in spans if e["name"].startswith("end: ffi_call")]
    xla = [{"op": e["name"], "span": ms(e)} for e in spans
           if e.get("args", {}).get("hlo_op") == e["name"]
           and not e["name"].startswith("ffi_call") and ms(e)[0] >= 0]  # fmt: skip
    update_end = max(s["span"][1] for s in engine)
    matmuls = [o for o in xla if o["op"].startswith(("ynn_fusion", "dot"))]
    beside = [o for o in matmuls if o["span"][0] < update_end]
    return {
        "calls_issued_ms": [ms(e)[0] for e in calls],
        "calls_completed_ms": sorted(completions),
        "engine": engine,
        "read_waits": waits,
        "xla_ops": xla,
        "update_end_ms": update_end,
        "step_end_ms": max(o["span"][1] for o in xla),
        "matmuls": len(matmuls),
        "matmuls_beside_update": len(beside),
        "matmul_ms_beside_update": sum(
            min(o["span"][1], update_end) - o["span"][0] for o in beside
        ),  # fmt: skip
    }


def plot(t: dict[str, Any], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.2))
    for s in t["engine"]:
        a, b = s["span"]
        ax.barh(1, b - a, left=a, height=0.6, color="C1", edgecolor="k", lw=0.3)
        ax.text((a + b) / 2, 1, str(s["subgroup"]), ha="center", va="center", fontsize=7)
    for a, b in t["read_waits"]:
        ax.barh(1, b - a, left=a, height=0.6, color="C3", alpha=0.6)
    for o in t["xla_ops"]:
        a, b = o["span"]
        color = "C0" if o["op"].startswith(("ynn_fusion", "dot")) else "C7"
        ax.barh(0, max(b - a, 0.2), left=a, height=0.6, color=color)
    ax.axvline(t["update_end_ms"], color="k", lw=1.2)
    ax.set_yticks([0, 1], ["XLA ops\n(blue: matmuls)", "host update\n(subgroups; red: read wait)"])
    ax.set_xlabel("ms from the first group's call (black: the update's end)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tier = tempfile.mkdtemp(prefix="jax_mlpo-trace-")
    try:
        t = timeline(traced_step(args.width, args.batch, tier, args.warm))
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"machine: {machine}")
    # (XLA's completion marks come when a thread of its own takes the completion up, which can
    # lag the engine's completion by a busy core's time slice)
    print(f"group calls issued at {[round(x, 1) for x in t['calls_issued_ms']]} ms, marked "
          f"complete by XLA at {[round(x, 1) for x in t['calls_completed_ms']]} ms")  # fmt: skip
    print(f"the host update ends at {t['update_end_ms']:.1f} ms, the step at "
          f"{t['step_end_ms']:.1f} ms; {t['matmuls_beside_update']} of the step's {t['matmuls']} "
          f"matmuls started before the update's end ({t['matmul_ms_beside_update']:.1f} ms of "
          "matmul beside it)")  # fmt: skip
    if args.plot:
        plot(t, args.plot, f"one overlapped step, {LAYERS} layers of {args.width}x{args.width}, "
             f"batch {args.batch}: {machine}")  # fmt: skip
    write_json(args.json, {"machine": machine, "args": vars(args), **t})


if __name__ == "__main__":
    main()
