"""Loss curves of pre-training runs side by side: the runs, and their plot.

Each run is ``experiments/pretrain.py`` on one config with its own ``--set`` overrides, in a
subprocess and a run directory of its own; the benchmarks that compare variants of the same
run (``state_dtypes_loss``, ``optimizers_loss``) read its per-step records back.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger("bench.loss_curves")
ROOT = Path(__file__).resolve().parents[2]


def pretrain_records(
    config: str, sets: list[str], run_dir: Path, *, tier: bool, name: str
) -> list[dict]:
    """One ``pretrain.py`` run of the offloaded optimizer; its per-step metrics records.

    Args:
      config: the YAML config.
      sets: ``--set`` overrides (``run_dir``, checkpoints off and no plot are added).
      run_dir: the run's directory, removed before and after (tiers and checkpoints).
      tier: give the run its own tier under ``run_dir`` (a config's explicit tier path).
      name: the run's name in the log.
    """
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"run_dir={run_dir}", "report.plot=false", "checkpoint.every=0", *sets]
    if tier:
        sets.append(f"offload.tiers=[{{path: {run_dir / 'tier'}}}]")
    cmd = [sys.executable, "experiments/pretrain.py", "--config", config]
    for item in sets:
        cmd += ["--set", item]
    logger.info("%s: %s", name, " ".join(cmd))
    subprocess.run(cmd, cwd=ROOT, check=True)
    with open(run_dir / "metrics-offload.jsonl") as f:
        records = [json.loads(line) for line in f]
    shutil.rmtree(run_dir, ignore_errors=True)
    return [r for r in records if "loss" in r]


def plot(
    curves: dict[str, list[float]], path: str, title: str, base: str, window: int = 20
) -> None:
    """The loss curves, and below them each variant's loss minus ``base``'s (a running mean
    over ``window`` steps: the curves themselves overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})  # fmt: skip
    base_losses = np.asarray(curves.get(base, []))
    for name, losses in curves.items():
        steps = np.arange(1, len(losses) + 1)
        (line,) = top.plot(steps, losses, label=name, linewidth=1)
        if base_losses.size == len(losses) and name != base:
            diff = np.convolve(np.asarray(losses) - base_losses, np.ones(window) / window, "valid")
            bottom.plot(steps[window - 1 :], diff, label=f"{name} - {base}", linewidth=1,
                        color=line.get_color())  # fmt: skip
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    bottom.axhline(0.0, color="gray", linewidth=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"difference ({window}-step mean)")
    bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
