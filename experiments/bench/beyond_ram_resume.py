"""The proof's resume half: experiments/configs/beyond-ram.yaml killed after a checkpoint and
resumed, against an uninterrupted run of the same steps.

1. **Uninterrupted**: ``pretrain.py`` on the config for ``--steps`` steps, no checkpoints; its
   summary keeps the sha256 of the final params.
2. **Interrupted**: the same with a checkpoint every ``--every`` steps. Once the checkpoint is
   published (its step directory renamed into place: durable; with the state on one disk there
   is no room for a copy-on-write save, so pretrain saves it synchronously), a random delay of
   up to ``--max-delay`` seconds, then ``kill -9`` of the process group; then
   ``pretrain.py --resume`` to the end. ``--reuse-uninterrupted`` keeps step 1's results.
3. The final step's loss and the params' sha256 of the two runs must be equal (bit for bit).

Each run's tier and checkpoint files are deleted when it is done (tier ~ state, checkpoint ~
state: 58 GB for the interrupted run at its peak, with the params); metrics, summaries and logs
stay under ``--run-dir``. One checkpoint is all the disk holds beside the tier, so there is none
at the last step (``checkpoint.final=false``): a second would be written before the first is
deleted, and ``save`` refuses it for want of space.

    python -m experiments.bench.beyond_ram_resume --steps 6 --every 4 \
        --json experiments/results/beyond_ram_resume.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from experiments.bench.harness import write_json

logger = logging.getLogger("bench.beyond_ram_resume")
CONFIG = "experiments/configs/beyond-ram.yaml"


def command(run_dir: Path, steps: int, every: int, extra: list[str]) -> list[str]:
    tier = run_dir / "tiers" / "t0"
    cmd = [sys.executable, "experiments/pretrain.py", "--config", CONFIG,
           "--set", f"run_dir={run_dir}", "--set", f"steps={steps}",
           "--set", f"checkpoint.every={every}", "--set", "checkpoint.final=false",
           "--set", "report.plot=false",
           "--set", f"offload.tiers=[{{path: {tier}}}]"]  # fmt: skip
    for override in extra:
        cmd += ["--set", override]
    return cmd


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics-offload.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a last line may be partial


def run(cmd: list[str], log: Path) -> None:
    logger.info("running %s", " ".join(cmd))
    with open(log, "a") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed ({proc.returncode}): see {log}")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary-offload.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--max-delay", type=float, default=100.0, help="seconds after the save")
    parser.add_argument("--seed", type=int, default=None, help="of the kill's delay")
    parser.add_argument("--run-dir", default="runs/beyond-ram-resume")
    parser.add_argument("--json", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--reuse-uninterrupted", action="store_true",
                        help="keep an earlier uninterrupted run of the same steps")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    root = Path(args.run_dir)
    full, interrupted = root / "uninterrupted", root / "interrupted"
    shutil.rmtree(interrupted, ignore_errors=True)
    interrupted.mkdir(parents=True)

    t0 = time.time()
    if not (args.reuse_uninterrupted and (full / "summary-offload.json").exists()):
        shutil.rmtree(full, ignore_errors=True)
        full.mkdir(parents=True)
        try:
            run(command(full, args.steps, 0, args.set), full / "pretrain.log")
        finally:
            shutil.rmtree(full / "tiers", ignore_errors=True)
    full_s = time.time() - t0

    cmd = command(interrupted, args.steps, args.every, args.set)
    delay = random.Random(args.seed).uniform(0.0, args.max_delay)
    log = interrupted / "pretrain.log"
    kill: dict = {"delay_s": delay}
    with open(log, "w") as out:
        logger.info("running %s (killed %.1f s after checkpoint %d)", " ".join(cmd), delay,
                    args.every)  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        published = interrupted / "checkpoints-offload" / str(args.every)
        while proc.poll() is None and not published.is_dir():  # orbax's rename: durable
            time.sleep(1.0)
        if proc.poll() is not None:
            raise SystemExit(f"the interrupted run ended before its checkpoint: see {log}")
        saved = [r for r in records(interrupted) if r["step"] == args.every][0]
        kill["checkpoint_s"] = saved["checkpoint_s"]
        kill["published_after_step_records"] = len(records(interrupted))
        time.sleep(delay)
        kill["steps_done_at_kill"] = len(records(interrupted))
        os.killpg(proc.pid, signal.SIGKILL)
        kill["returncode"] = proc.wait()
    logger.info("killed after %d step records (returncode %s)", kill["steps_done_at_kill"],
                kill["returncode"])  # fmt: skip
    t1 = time.time()
    try:
        run([*cmd, "--resume"], log)
    finally:
        shutil.rmtree(interrupted / "tiers", ignore_errors=True)
        shutil.rmtree(interrupted / "checkpoints-offload", ignore_errors=True)
    resumed_s = time.time() - t1

    a, b = summary(full), summary(interrupted)
    la, lb = records(full)[-1], records(interrupted)[-1]
    out = {
        "steps": args.steps,
        "checkpoint_every": args.every,
        "kill": kill,
        "uninterrupted_s": full_s,
        "resume_s": resumed_s,
        "final_step": [la["step"], lb["step"]],
        "final_loss": [la["loss"], lb["loss"]],
        "params_sha256": [a.get("params_sha256"), b.get("params_sha256")],
        "losses_uninterrupted": [r["loss"] for r in records(full)],
        "losses_resumed": [r["loss"] for r in records(interrupted)],
    }
    digests = out["params_sha256"]
    out["bitwise_equal"] = (
        out["final_loss"][0] == out["final_loss"][1]
        and digests[0] is not None
        and digests[0] == digests[1]
    )
    print(json.dumps(out, indent=1))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
