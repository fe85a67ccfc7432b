"""Training with narrower optimizer state: the same run with float32, bfloat16 m and v,
bfloat16 m only, and q8 m and v (nearest or stochastic rounding), side by side: the loss curves
in one plot and the final losses' ratios.

Each variant is ``pretrain.py`` on the same config, seed and batches (a subprocess each, its own
run directory), with ``optimizer.mu_dtype`` / ``optimizer.nu_dtype`` set by ``--set``. The final
loss is the mean of the last ``--tail`` steps; the ratio is against the float32 state's.

    python -m experiments.bench.state_dtypes_loss --config experiments/configs/e2e-125m.yaml \\
        --steps 300 --json experiments/results/state_dtypes_loss.json \\
        --plot docs/state_dtypes_loss.png
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from experiments.bench.harness import write_json
from experiments.bench.loss_curves import plot, pretrain_records

logger = logging.getLogger("bench.state_dtypes_loss")
ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {  # name: (mu_dtype, nu_dtype, q8_rounding)
    "fp32": ("float32", "float32", "nearest"),
    "bf16-m-v": ("bfloat16", "bfloat16", "nearest"),
    "bf16-m": ("bfloat16", "float32", "nearest"),
    "q8-m-v": ("q8", "q8", "nearest"),
    "q8-m-v-stochastic": ("q8", "q8", "stochastic"),
}


def run_variant(args, name: str, run_dir: Path) -> list[float]:
    """One pretrain.py run; its per-step losses."""
    mu, nu, rounding = VARIANTS[name]
    sets = [f"steps={args.steps}", f"log_every={args.log_every}", f"optimizer.mu_dtype={mu}",
            f"optimizer.nu_dtype={nu}", f"optimizer.q8_rounding={rounding}"]  # fmt: skip
    records = pretrain_records(args.config, sets, run_dir, tier=args.tier, name=name)
    return [r["loss"] for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="experiments/configs/e2e-125m.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--tail", type=int, default=20, help="steps the final loss averages")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dir", default="runs/state_dtypes")
    parser.add_argument("--tier", action="store_true", help="give each run its own tier path")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--replot", default=None, help="plot a --json result again; no runs")
    parser.add_argument("--reuse", default=None,
                        help="a --json result whose curves of the same config and steps stand in "
                        "for variants not in --variants (runs are deterministic: check a few "
                        "steps of one against it first)")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        title = f"{Path(saved['config']).name}, {saved['steps']} steps, same seed"
        plot(saved["losses"], args.plot, title, base="fp32")
        return

    curves, reused = {}, []
    if args.reuse:
        with open(args.reuse) as f:
            saved = json.load(f)
        if (saved["config"], saved["steps"]) != (args.config, args.steps):
            parser.error(f"--reuse {args.reuse} ran {saved['config']} for {saved['steps']} steps")
        curves |= saved["losses"]
        logger.info("reused from %s: %s", args.reuse, ", ".join(saved["losses"]))
    ran = args.variants.split(",")
    for k, name in enumerate(ran):
        fresh = run_variant(args, name, Path(args.dir).resolve() / f"v{k}")
        if name in curves:
            logger.info("%s: the same losses as in %s: %s", name, args.reuse,
                        fresh == curves[name])  # fmt: skip
        curves[name] = fresh
    if args.reuse:
        reused = [name for name in curves if name not in ran]
    final = {name: statistics.fmean(losses[-args.tail :]) for name, losses in curves.items()}
    base = final.get("fp32")
    result = {
        "config": args.config,
        "steps": args.steps,
        "tail": args.tail,
        "final_loss": final,
        "ratio_to_float32": {k: v / base for k, v in final.items()} if base else None,
        "losses": curves,
        "reused": {"from": args.reuse, "variants": reused} if reused else None,
    }
    for name, value in final.items():
        logger.info("%s: final loss %.4f%s", name, value,
                    f" ({value / base:.4f}x float32)" if base else "")  # fmt: skip
    if args.plot:
        title = f"{Path(args.config).name}, {args.steps} steps, same seed"
        plot(curves, args.plot, title, base="fp32")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
