"""Summary table and plots of a pretrain.py run, from its metrics JSONL.

Usage:
  python experiments/job/report.py runs/tiny/metrics-offload.jsonl [runs/tiny/metrics-optax.jsonl] \
      [--skip 5] [--out docs/pretrain_tiny.png]

The first file is the run described; a second one (the same job with ``--optimizer optax``) is
drawn on the loss panel and compared step by step. The table gives medians over the steps after
the first ``--skip`` (compilation, first writes), like the paper's iteration breakdown:
iteration = forward + backward + update, the update split into the host pipeline's read wait,
compute and write wait.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.job import iteration

logger = logging.getLogger("report")

_PHASES = (
    "step_s",
    "fwd_bwd_s",
    "update_s",
    "host_update_s",
    "read_wait_s",
    "compute_s",
    "write_wait_s",
    "beside_s",
    "update_exposed_s",
    "data_s",
)


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Reads a metrics JSONL file (one record per step).

    Raises:
        ValueError: if the file holds no records.
    """
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no metrics records; did the run take any step?")
    return records


def _window(records: Sequence[dict], skip: int) -> Sequence[dict]:
    # Keep at least one step so that a very short run still has a summary.
    return records[min(skip, len(records) - 1) :]


def summarize(records: Sequence[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Medians of the per-step times and throughputs after ``skip`` warm-up steps.

    Args:
        records: the metrics records, in step order.
        skip: steps left out (they include compilation).

    Returns:
        ``median_s`` (per phase, seconds), ``tokens_per_s``, ``cache_hit_rate`` (mean),
        ``tiers`` (per path: median bytes per step and GB/s), the mean loss of the first and the
        last 10 steps, and the steps covered.
    """
    window = _window(records, skip)
    median_s = {
        k.removesuffix("_s"): statistics.median(r[k] for r in window)
        for k in _PHASES
        if all(k in r for r in window)
    }
    tiers: dict[str, dict[str, float]] = {}
    moving = [r for r in window if "tiers" in r]  # the steps that ran an update
    for path in moving[0]["tiers"] if moving else {}:
        keys = [k for k in moving[0]["tiers"][path] if k != "busy_s"]
        tiers[path] = {k: statistics.median(r["tiers"][path][k] for r in moving) for k in keys}
    losses = [r["loss"] for r in records]
    out = {
        "first_step": window[0]["step"],
        "last_step": window[-1]["step"],
        "median_s": median_s,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in window),
        "tiers": tiers,
        "loss_first10": float(np.mean(losses[:10])),
        "loss_last10": float(np.mean(losses[-10:])),
    }
    if "beside" in median_s and median_s.get("host_update"):
        # an overlapped run: the share of the host update after its first group of layers was
        # handed back, which the forward pass could run beside
        out["beside_share"] = median_s["beside"] / median_s["host_update"]
    rates = [r["cache_hit_rate"] for r in window if "cache_hit_rate" in r]
    if rates:  # (a step with nothing pending, after an overlapped run's flush, has no update)
        out["cache_hit_rate"] = float(np.mean(rates))
    limit = iteration.summarize_limit(records, window[0]["step"] - 1)
    if limit is not None:
        out["limit"] = limit
    peaks = [r["peak_rss_bytes"] for r in records if "peak_rss_bytes" in r]
    if peaks:
        out["peak_rss_bytes"] = max(peaks)
    return out


def format_table(summary: dict[str, Any], title: str = "") -> str:
    """The summary as markdown tables: time per phase, then per tier."""
    med = summary["median_s"]
    it = med["step"]
    rows = [("iteration", med["step"])]
    if "update" in med:  # a plain step: forward and backward, then the update
        rows += [("forward + backward", med["fwd_bwd"]), ("update", med["update"])]
    elif "update_exposed" in med:  # overlapped: the update beside the next forward pass
        rows += [
            ("forward + backward (alone, timed apart)", med["fwd_bwd"]),
            ("update not hidden by the forward pass", med["update_exposed"]),
        ]
    if "host_update" in med:
        rows += [
            ("  host update (engine)", med["host_update"]),
            ("    read wait", med["read_wait"]),
            ("    compute (optimizer kernel)", med["compute"]),
            ("    write wait", med["write_wait"]),
        ]
        if med.get("beside"):
            rows.append(("    after the first group was handed back", med["beside"]))
    lines = []
    if title:
        lines.append(f"{title}: medians of steps {summary['first_step']}..{summary['last_step']}")
        lines.append("")
    lines += ["| phase | time (ms) | share of iteration |", "|---|---:|---:|"]
    lines += [f"| {name} | {1e3 * s:.2f} | {100 * s / it:.0f}% |" for name, s in rows]
    lines.append("")
    extra = [f"tokens/s {summary['tokens_per_s']:,.0f}"]
    if "cache_hit_rate" in summary:
        extra.append(f"cache hit rate {100 * summary['cache_hit_rate']:.0f}%")
    if "peak_rss_bytes" in summary:
        extra.append(f"peak RSS {summary['peak_rss_bytes'] / 2**30:.2f} GiB")
    extra.append(
        f"loss {summary['loss_first10']:.4f} (mean of the first 10 steps) -> "
        f"{summary['loss_last10']:.4f} (last 10)"
    )
    lines.append("; ".join(extra))
    if summary.get("limit"):
        lines += ["", iteration.format_limit(summary["limit"])]
    if summary["tiers"]:
        lines += [
            "",
            "| tier | read MB/step | write MB/step | read GB/s | write GB/s | busy GB/s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for path, t in summary["tiers"].items():
            lines.append(
                f"| {path} | {t['read_bytes'] / 1e6:.3f} | {t['write_bytes'] / 1e6:.3f} | "
                f"{t['read_GBps']:.3f} | {t['write_GBps']:.3f} | {t.get('busy_GBps', 0):.3f} |"
            )
        lines += [
            "",
            "read/write GB/s: the tier's bytes / host update time; busy GB/s: read + write "
            "bytes / time the tier had a request in flight.",
        ]
    return "\n".join(lines)


def _rolling_median(x: np.ndarray, width: int) -> np.ndarray:
    half = width // 2
    return np.array([np.median(x[max(0, i - half) : i + half + 1]) for i in range(len(x))])


def plot_run(
    records: Sequence[dict[str, Any]],
    out: str | Path,
    *,
    skip: int = 5,
    compare: Sequence[dict[str, Any]] | None = None,
    labels: tuple[str, str] = ("offload", "optax"),
    title: str = "",
    smooth: int = 9,
) -> Path:
    """Draws loss, time per step (fwd+bwd vs update), the update's waits and tier throughput.

    Args:
        records: the run's metrics records.
        out: the PNG to write.
        skip: first steps left out of the time panels (compilation dominates them).
        compare: another run's records (e.g. optax), drawn on the loss panel.
        labels: legend names of ``records`` and ``compare``.
        title: figure title.
        smooth: width of the rolling median on the time and throughput panels, in steps.

    Returns:
        ``out``, as a Path.

    Raises:
        ImportError: without matplotlib (``pip install -e '.[experiments]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in records])
    window = list(_window(records, skip))
    ws = np.array([r["step"] for r in window])

    def series(key: str, rs: Sequence[dict] = window) -> np.ndarray:
        # a step without the figure (an overlapped step has no separate update; a step with
        # nothing pending, no update at all) counts 0
        return _rolling_median(np.array([1e3 * r.get(key, 0.0) for r in rs]), smooth)

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0, 0]
    loss = np.array([r["loss"] for r in records])
    ax.plot(steps, loss, lw=0.8, label=labels[0])
    if compare:
        diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(records, compare, strict=False))
        ax.plot(
            [r["step"] for r in compare],
            [r["loss"] for r in compare],
            "--",
            lw=0.8,
            label=f"{labels[1]} (max |diff| {diff:.1e})",
        )
    if len(loss) >= 20:
        mean = np.convolve(loss, np.ones(10) / 10, mode="valid")
        ax.plot(steps[9:], mean, color="k", lw=1.5, label=f"{labels[0]}, mean of 10 steps")
    ax.set(title="training loss (per batch)", xlabel="step", ylabel="cross entropy (nats)")
    ax.legend(loc="upper center")
    ax.grid(alpha=0.3)
    if all("rss_bytes" in r for r in records):
        mem = ax.twinx()
        mem.plot(steps, [r["rss_bytes"] / 2**30 for r in records], color="C3", lw=0.8,
                 label="RSS")  # fmt: skip
        mem.plot(steps, [r["peak_rss_bytes"] / 2**30 for r in records], ":", color="C3",
                 lw=0.8, label="peak RSS")  # fmt: skip
        mem.set_ylabel("process memory (GiB)", color="C3")
        mem.set_ylim(bottom=0)
        mem.legend(loc="upper right")

    ax = axes[0, 1]
    if all("update_s" in r for r in window):
        fb, up = series("fwd_bwd_s"), series("update_s")
        ax.stackplot(ws, fb, up, labels=["forward + backward", "update"], alpha=0.8)
    else:  # overlapped: one program
        fb, up = series("step_s"), np.zeros(len(window))
        ax.stackplot(ws, fb, labels=["forward + backward, update beside it"], alpha=0.8)
    ax.plot(
        ws,
        [1e3 * r["step_s"] for r in window],
        lw=0.5,
        color="k",
        alpha=0.4,
        label="iteration (raw)",
    )
    ax.set(
        title=f"time per step (rolling median of {smooth}; steps <= {ws[0] - 1} left out)",
        xlabel="step",
        ylabel="ms",
    )
    ax.set_ylim(0, 1.5 * float(np.percentile(fb + up, 95)))
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)

    ax = axes[1, 0]
    if "read_wait_s" in window[0]:
        parts = [series(k) for k in ("read_wait_s", "compute_s", "write_wait_s")]
        host = series("host_update_s")
        parts.append(np.maximum(host - sum(parts), 0.0))
        if all("update_s" in r for r in window):
            parts.append(np.maximum(series("update_s") - host, 0.0))
        names = [
            "read wait",
            "compute (optimizer kernel)",
            "write wait",
            "engine other (I/O issue, copies)",
            "outside the engine (XLA ops in the update)",
        ][: len(parts)]
        ax.stackplot(ws, *parts, alpha=0.8, labels=names)
        ax.set_ylim(0, 1.5 * float(np.percentile(sum(parts), 95)))
        ax.legend(loc="upper right")
    else:
        ax.text(0.5, 0.5, "no offload metrics (optax run)", ha="center", transform=ax.transAxes)
    ax.set(title="update phase breakdown (rolling median)", xlabel="step", ylabel="ms")
    ax.grid(alpha=0.3)

    ax = axes[1, 1]
    tiers = list(window[0].get("tiers", {}))
    for i, path in enumerate(tiers):
        name = f"tier {i} ({Path(path).name})"
        for key, style in (("read_GBps", "-"), ("write_GBps", "--")):
            vals = _rolling_median(
                np.array([r["tiers"][path][key] if "tiers" in r else 0.0 for r in window]), smooth
            )
            ax.plot(ws, vals, style, color=f"C{i}", label=f"{name} {key.split('_')[0]}")
    if tiers:
        hit = 100 * float(np.mean([r.get("cache_hit_rate", 0.0) for r in window]))
        ax.set_title(f"tier throughput during the update (cache hit rate {hit:.0f}%)")
        ax.legend(loc="lower right")
        ax.set_ylim(bottom=0)
    else:
        ax.set_title("tier throughput")
        ax.text(0.5, 0.5, "no file tiers used", ha="center", transform=ax.transAxes)
    ax.set(xlabel="step", ylabel="GB/s (bytes / host update time)")
    ax.grid(alpha=0.3)

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics JSONL; a second one is compared")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of medians")
    parser.add_argument("--out", help="PNG to write (default: next to the first file)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = [load_metrics(p) for p in args.metrics[:2]]
    summary = summarize(runs[0], args.skip)
    if len(runs) == 2:
        n = min(len(runs[0]), len(runs[1]))
        diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(runs[0][:n], runs[1][:n], strict=True)]
        summary["compare"] = {"file": args.metrics[1], "steps": n, "max_abs_loss_diff": max(diffs)}
    logger.info("%s", format_table(summary, title=args.title or args.metrics[0]))
    if "compare" in summary:
        c = summary["compare"]
        logger.info(
            "max |loss diff| vs %s over %d steps: %.3g",
            c["file"],
            c["steps"],
            c["max_abs_loss_diff"],
        )
    out = args.out or str(Path(args.metrics[0]).with_suffix(".png"))
    labels = tuple(Path(p).stem.removeprefix("metrics-") for p in args.metrics[:2]) + ("",)
    plot_run(
        runs[0],
        out,
        skip=args.skip,
        compare=runs[1] if len(runs) == 2 else None,
        labels=labels[:2],
        title=args.title,
    )
    logger.info("plot in %s", out)
    return summary


if __name__ == "__main__":
    main()
