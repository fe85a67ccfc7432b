"""What a pre-training run writes: one record per step, then the summary and the plot.

Each step becomes one JSON line of ``<run_dir>/metrics-<optimizer>.jsonl``: the step's times
(the slowest process's, in a multi-process run), the loss and, for the offloaded optimizer, the
engine's host metrics with per-tier throughput. At the end of the run the records become
``summary-<optimizer>.md`` and ``.json`` and ``pretrain-<optimizer>.png``
(:mod:`experiments.job.report` reads and draws metrics files; this module decides what goes in
them). A resumed run continues the metrics file of the run it resumes.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

import jax_mlpo
from experiments.job import iteration, report
from experiments.job.host_memory import process_memory
from experiments.job.run_config import RunConfig

logger = logging.getLogger("pretrain")

# Figures of every process kept in a multi-process run's records (aggregate's key: record's key).
PER_PROCESS = {
    "step_s": "step_s",
    "fwd_bwd_s": "fwd_bwd_s",
    "update_s": "update_s",
    "data_s": "data_s",
    "total_s": "host_update_s",
    "read_wait_s": "read_wait_s",
    "compute_s": "compute_s",
    "write_wait_s": "write_wait_s",
    "cache_hits": "cache_hits",
}


def step_record(
    step: int, loss: float, job: Any, tokens_per_step: int, processes: int,
    tier_totals: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The metrics record of one step.

    Args:
      step: the 1-based step.
      loss: the step's loss (the same in every process).
      job: the step's figures over all processes (``experiments.job.metrics.aggregate``'s result).
      tokens_per_step: tokens of the global batch.
      processes: processes of the run.
      tier_totals: this process's tier counters now (:func:`experiments.job.iteration.tier_totals`).

    Returns:
      The record: step, loss, the slowest process's times, tokens/s, the engine's metrics
      (with the offloaded optimizer) and, with several processes, every process's figures.
    """
    r: dict[str, Any] = {
        "step": step,
        "loss": loss,
        **job.timings,
        "tokens_per_s": tokens_per_step / job.step_time_s,
        **process_memory(),
    }
    if job.metrics is not None:
        r.update(update_record(job.metrics))
    if tier_totals:
        r["tier_totals"] = tier_totals
    if processes > 1:
        r["processes"] = processes
        r["slowest_process"] = job.slowest
        every_process = job.per_process
        r["per_process"] = {out: every_process[k] for k, out in PER_PROCESS.items()
                            if k in every_process}  # fmt: skip
    return r


def update_record(m: jax_mlpo.StepMetrics) -> dict[str, Any]:
    """The offloaded update's host metrics, with per-tier throughput and the cache hit rate.

    A tier's ``read_GBps``/``write_GBps`` are its bytes over the host update time (what the
    update phase got from it); ``busy_GBps`` is read + write bytes over the time the tier had a
    request in flight (what the tier delivered while working).

    Args:
      m: the engine's metrics of the step.

    Returns:
      The record's update fields.
    """
    total = max(m.total_s, 1e-12)
    busy = getattr(m, "tier_busy_s", {})
    tiers = {}
    for path in sorted(set(m.bytes_read) | set(m.bytes_written)):
        read, written = m.bytes_read.get(path, 0), m.bytes_written.get(path, 0)
        tiers[path] = {
            "read_bytes": read,
            "write_bytes": written,
            "read_GBps": read / total / 1e9,
            "write_GBps": written / total / 1e9,
            "busy_s": busy.get(path, 0.0),
            "busy_GBps": (read + written) / busy[path] / 1e9 if busy.get(path) else 0.0,
        }
    return {
        "host_update_s": m.total_s,
        "read_wait_s": m.read_wait_s,
        "compute_s": m.compute_s,
        "write_wait_s": m.write_wait_s,
        "beside_s": m.beside_s,
        "cache_hits": m.cache_hits,
        "reads_ahead": m.reads_ahead,
        "subgroups": m.subgroups,
        "cache_hit_rate": m.cache_hits / max(m.subgroups, 1),
        "tiers": tiers,
    }


def progress(r: dict[str, Any]) -> dict[str, str]:
    """A record's figures for the progress bar and the log line."""
    out = {
        "loss": f"{r['loss']:.4f}",
        "tok/s": f"{r['tokens_per_s']:,.0f}",
    }
    if "update_s" in r:  # a plain step's two halves; an overlapped step is one program
        out["fwd+bwd"] = f"{1e3 * r['fwd_bwd_s']:.0f}ms"
        out["update"] = f"{1e3 * r['update_s']:.0f}ms"
    else:
        out["step"] = f"{1e3 * r['step_s']:.0f}ms"
    if "peak_rss_bytes" in r:
        out["RSS"] = f"{r.get('rss_bytes', 0) / 2**30:.1f}/{r['peak_rss_bytes'] / 2**30:.1f}G"
    if "read_wait_s" in r:
        waits = (r["read_wait_s"], r["compute_s"], r["write_wait_s"])
        out["r/c/w"] = "/".join(f"{1e3 * w:.0f}" for w in waits) + "ms"
        out["hit"] = f"{100 * r['cache_hit_rate']:.0f}%"
        out["GB/s r/w"] = " ".join(
            f"{t['read_GBps']:.2f}/{t['write_GBps']:.2f}" for t in r["tiers"].values()
        )
    return out


def earlier_records(metrics_path: Path, start: int) -> list[dict[str, Any]]:
    """A resumed run's metrics up to its checkpoint; the file is cut back to them.

    Args:
      metrics_path: the run's metrics file.
      start: the step the run resumes after (0: a new run).

    Returns:
      The records of steps ``1..start`` (none for a new run or a missing file).
    """
    if not start or not metrics_path.exists():
        return []
    records = [r for r in report.load_metrics(metrics_path) if r["step"] <= start]
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def common_tiers(records: list[dict], skip: int) -> list[dict]:
    """``records`` with only the tiers that every record after the first ``skip`` has.

    A run resumed with other tiers (another ``offload.tiers``, or another process count with
    other default tiers) holds records of both; ``report.summarize`` and ``report.plot_run``
    read each tier of their window's first record in every record of the window.
    """
    window = records[min(skip, len(records) - 1) :]
    common = set.intersection(*(set(r.get("tiers", {})) for r in window))
    if all(set(r.get("tiers", {})) == common for r in window):
        return records
    logger.warning("the run used other tiers before it was resumed: the summary and the plot "
                   "leave out the tiers that steps %d..%d do not all have", window[0]["step"],
                   window[-1]["step"])  # fmt: skip
    return [{**r, "tiers": {p: t for p, t in r["tiers"].items() if p in common}}
            if "tiers" in r else r for r in records]  # fmt: skip


def finish(
    cfg: RunConfig, name: str, records: list[dict], metrics_path: Path,
    params_sha256: str | None = None, overlapped: bool | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Writes the run's summary (markdown and JSON) and plot under ``cfg.run_dir``.

    Args:
      cfg: the run config.
      name: the optimizer's name in the file names ("offload" or "optax").
      records: every step's record, in step order.
      metrics_path: the metrics file (returned, and logged).
      params_sha256: a digest of the final params (single-process runs), kept in the summary.
      overlapped: whether the run kept the overlapped step (``overlap: auto`` chooses; None:
        it had not chosen by the end), kept in the summary.

    Returns:
      The run's ``losses``, ``summary`` (``report.summarize``'s, with every process's medians
      in a multi-process run), ``metrics`` path and ``plot`` path (None without a plot).
    """
    run_dir = Path(cfg.run_dir)
    shown = common_tiers(records, cfg.report.skip_steps)
    summary = report.summarize(shown, cfg.report.skip_steps)
    nproc = records[-1].get("processes", 1) if records else 1
    batch = f"batch {cfg.batch_size} x {cfg.seq_len} tokens"
    if nproc > 1:
        batch = f"{nproc} processes, global batch {cfg.batch_size * nproc} x {cfg.seq_len} tokens"
    table = report.format_table(summary, title=f"{cfg.model}, {name}, {batch}")
    if nproc > 1:
        # The table holds the slowest process's figures of each step; here every process's
        # (of the steps run on this process count: a resumed run may have changed it).
        window = records[min(cfg.report.skip_steps, len(records) - 1) :]
        window = [r for r in window if r.get("processes") == nproc]  # holds records[-1]
        # the figures every step of the window has (an overlapped step has no update apart)
        keys = set.intersection(*(set(r["per_process"]) for r in window))
        per = {
            key: [statistics.median(r["per_process"][key][k] for r in window)
                  for k in range(nproc)]
            for key in window[0]["per_process"] if key in keys
        }  # fmt: skip

        def ms(key: str, k: int) -> str:
            return f"{1e3 * per[key][k]:.2f}" if key in per else "-"

        slowest = [sum(r["slowest_process"] == k for r in window) for k in range(nproc)]
        summary["per_process_median_s"] = per
        summary["slowest_process_steps"] = slowest
        table += "\n\n| process | step (ms) | forward + backward (ms) | update (ms) | slowest |\n"
        table += "|---:|---:|---:|---:|---:|\n"
        table += "\n".join(
            f"| {k} | {ms('step_s', k)} | {ms('fwd_bwd_s', k)} | {ms('update_s', k)} | "
            f"in {slowest[k]} of {len(window)} steps |"
            for k in range(nproc)
        )
    logger.info(
        "summary (medians of steps %d..%d):\n%s", summary["first_step"], summary["last_step"], table
    )
    (run_dir / f"summary-{name}.md").write_text(table + "\n")
    if params_sha256 is not None:
        summary["final_step"], summary["params_sha256"] = records[-1]["step"], params_sha256
        logger.info("final params (step %d): sha256 %s", records[-1]["step"], params_sha256)
    summary["overlapped"] = overlapped
    (run_dir / f"summary-{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot = None
    if cfg.report.plot:
        try:
            plot = report.plot_run(
                shown,
                run_dir / f"pretrain-{name}.png",
                skip=cfg.report.skip_steps,
                title=f"{cfg.model} ({name})",
            )
            logger.info("plot in %s", plot)
            if summary.get("limit"):
                timeline = iteration.plot_timeline(shown, run_dir / f"timeline-{name}.png")
                logger.info("timeline in %s", timeline)
        except ImportError:
            logger.warning("matplotlib is not installed, no plot: pip install -e '.[experiments]'")
    logger.info("metrics in %s", metrics_path)
    losses = [r["loss"] for r in records]
    return {"losses": losses, "summary": summary, "metrics": metrics_path, "plot": plot}
