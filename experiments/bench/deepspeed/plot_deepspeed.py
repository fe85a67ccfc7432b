"""Plots the DeepSpeed comparisons from their JSON results (docs/deepspeed.md).

Left: the update phase (experiments/bench/deepspeed/deepspeed_peer.py), time per step split into
what each system does, with the bytes it moved. Right: the end-to-end iteration
(experiments/bench/deepspeed/deepspeed_e2e.py), forward+backward and update. Bars are medians
over the interleaved rounds; whiskers are [min, max] of the totals.

Usage:
  python -m experiments.bench.deepspeed.plot_deepspeed \
      --update experiments/results/deepspeed_update.json \
      --e2e experiments/results/deepspeed_e2e.json --out docs/deepspeed.png
"""

from __future__ import annotations

import argparse
import json
import logging

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

logger = logging.getLogger("bench.plot_deepspeed")


def _med(row: dict, key: str) -> float:
    value = row.get(key)
    return value["median"] if isinstance(value, dict) else float(value or 0.0)


def _span(row: dict, key: str) -> tuple[float, float]:
    value = row[key]
    return (value["min"], value["max"]) if isinstance(value, dict) else (value, value)


def plot_update(ax, result: dict) -> None:
    rows = result["rows"]
    labels, parts, totals, spans, moved = [], [], [], [], []
    for key, row in rows.items():
        read_gb = row["bytes_read_per_step"] / 1e9
        written_gb = row["bytes_written_per_step"] / 1e9
        if key.startswith("ds-"):
            step, grads = _med(row, "update_s"), _med(row, "grad_write_s")
            parts.append({"optimizer step": step, "gradient swap-out (backward)": grads})
            totals.append(step + grads)
            lo, hi = _span(row, "update_s")
            spans.append((lo + grads, hi + grads))
        else:
            host, full = _med(row, "engine_s"), _med(row, "update_s")
            parts.append({"optimizer step": host, "XLA <-> host copies": full - host})
            totals.append(full)
            spans.append(_span(row, "update_s"))
        labels.append(row["label"].replace("jax_mlpo ", "jax_mlpo\n"))
        moved.append(f"{read_gb:.2f} r / {written_gb:.2f} w GB")
    colors = {
        "optimizer step": "#4c72b0",
        "gradient swap-out (backward)": "#dd8452",
        "XLA <-> host copies": "#8c8c8c",
    }
    seen = set()
    for i, p in enumerate(parts):
        bottom = 0.0
        for name, value in p.items():
            ax.bar(i, value, bottom=bottom, color=colors[name],
                   label=None if name in seen else name)  # fmt: skip
            seen.add(name)
            bottom += value
        lo, hi = spans[i]
        ax.errorbar(i, totals[i], yerr=[[totals[i] - lo], [hi - totals[i]]], color="k", capsize=3)
        ax.text(i, hi * 1.02, moved[i], ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("seconds per step")
    rounds = result["args"]["rounds"]
    ax.set_title(f"update phase, 1.5 GiB of p, m, v on one disk ({rounds} rounds)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center")


def plot_e2e(ax, result: dict) -> None:
    rows = result["rows"]
    names = list(rows)
    for i, key in enumerate(names):
        row = rows[key]
        fb = _med(row, "fwd_bwd_s")
        upd = _med(row, "step_s") if "step_s" in row else _med(row, "update_s")
        ax.bar(i, fb, color="#55a868", label="forward + backward" if i == 0 else None)
        ax.bar(i, upd, bottom=fb, color="#4c72b0", label="update / engine.step" if i == 0 else None)
        lo, hi = _span(row, "iter_s")
        total = _med(row, "iter_s")
        ax.errorbar(i, total, yerr=[[total - lo], [hi - total]], color="k", capsize=3)
    ax.set_xticks(range(len(names)), [rows[k].get("system", k) for k in names], fontsize=8)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"end to end, 97.5M-param GPT ({result['args']['rounds']} rounds)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--update", default="experiments/results/deepspeed_update.json")
    parser.add_argument("--e2e", default="experiments/results/deepspeed_e2e.json")
    parser.add_argument("--out", default="docs/deepspeed.png")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[3, 2])
    with open(args.update) as f:
        plot_update(left, json.load(f))
    with open(args.e2e) as f:
        plot_e2e(right, json.load(f))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
