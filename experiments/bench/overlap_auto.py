"""Is ``overlap: auto`` ever slower than the plain step? The tiny job and a 26K-param NNX loop.

``overlap: auto`` (the pre-training job's default, and ``jax_mlpo.OverlappedLoop``'s) runs the
update beside the next forward pass only where it wins. Two small cases where it does not:

- **the tiny job** (``experiments/configs/tiny.yaml``, 156K params): ``experiments/pretrain.py``
  in a fresh process per run, with ``overlap=auto``, ``false`` and ``true`` (the old default),
  interleaved rounds; each run's wall time (compilation included), its summary's tokens/s and
  its final params' sha256;
- **a 26K-param NNX transformer** (``models.Llama``: one layer, hidden 32) on one device, its
  AdamW state on a file tier: the plain NNX step under ``nnx.jit``, under
  ``OverlappedLoop.nnx`` (``overlap="auto"``) and with ``overlap=True, groups=8``, interleaved
  rounds in this process; each run's wall time, its median step after warm-up, and the final
  params' sha256.

Every system must end on the same sha256 (the steps are the plain loop's, bit for bit).

    python -m experiments.bench.overlap_auto --rounds 3 --json experiments/results/overlap_auto.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.bench.harness import (
    format_spread,
    interleave,
    provenance,
    ratio_spread,
    spread,
    write_json,
)

ROOT = Path(__file__).resolve().parents[2]
JOB_SYSTEMS = ("auto", "false", "true")
LOOP_SYSTEMS = ("plain", "auto", "overlap-8")


def tiny_job(overlap: str, steps: int, work: Path) -> dict[str, Any]:
    """One run of the tiny config in a fresh process: wall seconds, tokens/s, sha256."""
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"tiny-{overlap}-"))
    cmd = [sys.executable, str(ROOT / "experiments" / "pretrain.py"), "--config",
           str(ROOT / "experiments" / "configs" / "tiny.yaml"), "--set", f"run_dir={run_dir}",
           "--set", f"data.cache_dir={work / 'data-cache'}", "--set", f"steps={steps}",
           "--set", f"overlap={overlap}", "--set", "report.plot=false"]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    wall = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary-offload.json").read_text())
    return {"wall_s": wall, "tokens_per_s": summary["tokens_per_s"],
            "step_s": summary["median_s"]["step"], "sha256": summary["params_sha256"],
            "overlapped": summary.get("overlapped")}  # fmt: skip


def small_model():
    from models import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden=32, layers=1, heads=2, kv_heads=1, ffn=72,
                       max_seq_len=64)  # fmt: skip


def nnx_loop(system: str, steps: int, work: Path) -> dict[str, Any]:
    """One run of the 26K-param model's loop: wall seconds, median step, sha256."""
    import jax
    import numpy as np
    from flax import nnx

    import jax_mlpo
    from models import Llama, loss_fn

    model = Llama(small_model(), rngs=nnx.Rngs(0))
    tier = tempfile.mkdtemp(dir=work, prefix=f"loop-{system}-")
    config = jax_mlpo.OffloadConfig(host_cache="96KiB", subgroup_size=2048, prefetch_depth=2,
                                    tiers=[jax_mlpo.FileTier(tier, sync=False)])  # fmt: skip
    optimizer = nnx.Optimizer(model, jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config),
                              wrt=nnx.Param)  # fmt: skip
    rng = np.random.default_rng(0)
    batches = [jax.numpy.asarray(rng.integers(0, 256, (8, 64), dtype=np.int32))
               for _ in range(steps)]  # fmt: skip

    def train_step(model, optimizer, tokens):  # the plain NNX step
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    if system == "plain":
        train_step = nnx.jit(train_step)
    elif system == "auto":
        train_step = jax_mlpo.OverlappedLoop.nnx(train_step)
    else:
        train_step = jax_mlpo.OverlappedLoop.nnx(train_step, overlap=True, groups=8)
    times = []
    t_run = time.perf_counter()
    for tokens in batches:
        t0 = time.perf_counter()
        jax.block_until_ready(train_step(model, optimizer, tokens))
        times.append(time.perf_counter() - t0)
    if system != "plain":
        train_step.flush()
    wall = time.perf_counter() - t_run
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        digest.update(np.ascontiguousarray(np.asarray(leaf)).view(np.uint8))
    jax_mlpo.close(optimizer.opt_state)
    kept = None if system == "plain" else train_step.overlapped
    return {"wall_s": wall, "step_s": statistics.median(times[10:]), "sha256": digest.hexdigest(),
            "overlapped": kept}  # fmt: skip


def report(name: str, systems: tuple[str, ...], runs: dict[str, list[dict[str, Any]]],
           base: str, figures: tuple[str, ...]) -> dict[str, Any]:  # fmt: skip
    print(f"\n{name}")
    print("| system | " + " | ".join(figures) + " | kept the overlapped step |")
    print("|---|" + "---:|" * len(figures) + "---|")
    out: dict[str, Any] = {"runs": runs, "spread": {}, "ratio_to_" + base: {}}
    for s in systems:
        cells = []
        for f in figures:
            sp = spread(r[f] for r in runs[s])
            out["spread"].setdefault(s, {})[f] = sp
            cells.append(format_spread(sp, 1e3 if f == "step_s" else 1.0,
                                       0 if f == "tokens_per_s" else 2))  # fmt: skip
        kept = sorted({str(r["overlapped"]) for r in runs[s]})
        print(f"| {s} | " + " | ".join(cells) + f" | {', '.join(kept)} |")
    for s in systems:
        if s != base:
            ratio = ratio_spread([r["wall_s"] for r in runs[s]], [r["wall_s"] for r in runs[base]])
            out["ratio_to_" + base][s] = ratio
            print(f"wall time {s} / {base}, per round: {format_spread(ratio, digits=3)}")
    shas = {r["sha256"] for s in systems for r in runs[s]}
    out["same_sha256"] = len(shas) == 1
    print(f"final params sha256: {'the same in every run' if len(shas) == 1 else shas}"
          f" ({next(iter(shas))[:16]}...)")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job-steps", type=int, default=300, help="the tiny job's steps")
    parser.add_argument("--loop-steps", type=int, default=200, help="the 26K loop's steps")
    parser.add_argument("--skip-job", action="store_true", help="only the 26K-param loop")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cpu = provenance()["machine"]["cpu"]
    print(f"CPU: {cpu}; {args.rounds} interleaved rounds (rotated)")
    result: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="overlap-auto-") as tmp:
        work = Path(tmp)
        if not args.skip_job:

            def job(system: str, _: int) -> dict[str, Any]:
                return tiny_job(system, args.job_steps, work)

            runs = interleave(JOB_SYSTEMS, args.rounds, job, rotate=True)
            result["tiny_job"] = report(
                f"tiny.yaml, {args.job_steps} steps, a fresh process per run (overlap=...)",
                JOB_SYSTEMS, runs, "false", ("wall_s", "tokens_per_s", "step_s"),
            )  # fmt: skip
        runs = interleave(LOOP_SYSTEMS, args.rounds,
                          lambda s, _: nnx_loop(s, args.loop_steps, work), rotate=True)  # fmt: skip
        result["nnx_26k"] = report(
            f"26K-param NNX transformer, {args.loop_steps} steps (median step after 10)",
            LOOP_SYSTEMS, runs, "plain", ("wall_s", "step_s"),
        )  # fmt: skip
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
