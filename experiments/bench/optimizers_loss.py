"""The offloaded optimizers side by side: the same pre-training run with AdamW, Lion and Muon.

Each is ``pretrain.py`` on the same config, seed and batches, with ``optimizer.name`` set.
Lion's learning rate and weight decay are rescaled as the Lion paper advises
(``--lion-lr-ratio`` times AdamW's peak learning rate, weight decay divided by it, so that
lr x wd stays); Muon's matrices take ``--muon-lr`` (0.02, Muon's usual rate with optax's
width scaling), its other leaves AdamW's peak learning rate. Printed and saved: the loss curves
(and their plot), the final losses, and per step the bytes the tiers moved and the update's
time, medians over the steps after the first (which writes the state for the first time); and
each against AdamW's. ``--optimizers muon --reuse FILE`` runs only Muon and takes the others
from an earlier result of the same config and steps (their losses are the same run for run:
same seed and batches; their times are that run's, and the result says when it was).

    python -m experiments.bench.optimizers_loss --config experiments/configs/e2e-125m.yaml \\
        --steps 200 --tier --json experiments/results/optimizers_loss_e2e.json \\
        --plot docs/optimizers_loss_e2e.png
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from experiments.bench.harness import write_json
from experiments.bench.loss_curves import plot, pretrain_records
from experiments.run_config import load_config

logger = logging.getLogger("bench.optimizers_loss")
OPTIMIZERS = ("adamw", "lion", "muon")


def _moved(record: dict) -> int:
    """Bytes the tiers read and wrote during the step (write-behind and read-ahead included)."""
    return sum(t["read_bytes"] + t["write_bytes"] for t in record.get("tiers", {}).values())


def run(args, name: str, run_dir: Path) -> dict:
    """One optimizer's run: its losses and its per-step I/O and update time."""
    cfg = load_config(args.config)
    sets = [f"steps={args.steps}", f"log_every={args.log_every}", f"optimizer.name={name}"]
    if name == "lion":
        o, ratio = cfg.optimizer, args.lion_lr_ratio
        sets += [f"optimizer.peak_lr={o.peak_lr * ratio:.6g}",
                 f"optimizer.weight_decay={o.weight_decay / ratio:.6g}"]  # fmt: skip
    if name == "muon":
        o = cfg.optimizer
        sets += [f"optimizer.peak_lr={args.muon_lr:.6g}", f"optimizer.adam_peak_lr={o.peak_lr:.6g}"]
    records = pretrain_records(args.config, sets, run_dir, tier=args.tier, name=name)
    later = records[1:]
    return {
        "losses": [r["loss"] for r in records],
        "sets": sets,
        "bytes_per_step": statistics.median(_moved(r) for r in later),
        "update_s": statistics.median(r["update_s"] for r in later),
        "step_s": statistics.median(r["step_s"] for r in later),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="experiments/configs/e2e-125m.yaml")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--tail", type=int, default=20, help="steps the final loss averages")
    parser.add_argument("--lion-lr-ratio", type=float, default=1 / 3)
    parser.add_argument("--muon-lr", type=float, default=0.02)
    parser.add_argument("--dir", default="runs/optimizers")
    parser.add_argument("--tier", action="store_true", help="give each run its own tier path")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated")
    parser.add_argument("--reuse", default=None, help="a result to take the others from")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    chosen = args.optimizers.split(",")
    runs, reused = _reused(args, [n for n in OPTIMIZERS if n not in chosen])
    runs.update({name: run(args, name, Path(args.dir).resolve() / name) for name in chosen})
    base = runs["adamw"]
    result = {"config": args.config, "steps": args.steps, "tail": args.tail, "optimizers": {}}
    for name in OPTIMIZERS:
        r = runs[name]
        final = statistics.fmean(r["losses"][-args.tail :])
        summary = {
            "final_loss": final,
            "bytes_per_step": r["bytes_per_step"],
            "bytes_vs_adamw": r["bytes_per_step"] / base["bytes_per_step"],
            "update_s": r["update_s"],
            "update_vs_adamw": r["update_s"] / base["update_s"],
            "step_s": r["step_s"],
        }
        result["optimizers"][name] = {**summary, "sets": r["sets"], "losses": r["losses"]}
        if name in reused:
            result["optimizers"][name]["measured"] = reused[name]
        logger.info(
            "%s: final loss %.4f, %.1f MB moved per step (%.2fx adamw), update %.3f s "
            "(%.2fx adamw), step %.3f s", name, final, r["bytes_per_step"] / 1e6,
            summary["bytes_vs_adamw"], r["update_s"], summary["update_vs_adamw"], r["step_s"],
        )  # fmt: skip
    if args.plot:
        title = f"{Path(args.config).name}, {args.steps} steps, same seed and batches"
        plot({k: r["losses"] for k, r in runs.items()}, args.plot, title, base="adamw")
    if args.json:
        write_json(args.json, result)


def _reused(args, names: list[str]) -> tuple[dict, dict]:
    """The runs of ``names`` from ``--reuse`` (checked to be this config's and steps'), and
    when and where each was measured."""
    if not names:
        return {}, {}
    if args.reuse is None:
        raise SystemExit(f"--optimizers leaves out {names}: give --reuse with their results")
    with open(args.reuse) as f:
        old = json.load(f)
    if (old["config"], old["steps"]) != (args.config, args.steps):
        raise SystemExit(f"{args.reuse} is {old['config']} for {old['steps']} steps, not "
                         f"{args.config} for {args.steps}")  # fmt: skip
    prov = old["provenance"]
    when = f"{prov['date']} at {prov['commit']} ({args.reuse})"
    return {n: old["optimizers"][n] for n in names}, {n: when for n in names}


if __name__ == "__main__":
    main()
