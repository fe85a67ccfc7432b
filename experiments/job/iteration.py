"""An iteration against its limit: where its time goes, and how busy the tiers were.

Each pre-training record holds the tiers' cumulative counters when its update returned
(:func:`tier_totals`): the difference between two records is everything the tiers did in one
iteration, the write-backs that landed during the forward and backward pass (write-behind) and
the reads issued there (read-ahead) included. From those:

- the **limit** of an iteration: max(forward + backward + the update's compute, the iteration's
  bytes at the tiers' bandwidth), with each tier serving its reads and writes one after the
  other at the bandwidths the engine probed at start
  (:attr:`jax_mlpo.engine.engine.Engine.bandwidth`);
- the **disk busy fraction**: the time some request of a tier was in flight, over the iteration.

:func:`plot_timeline` draws both per iteration: the compute and the waits of the iteration
beside each tier's busy time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def tier_totals(engine: Any) -> dict[str, dict[str, float]]:
    """Each tier's cumulative bytes and busy time, and its bandwidth in the placement model.

    Args:
      engine: the optimizer's :class:`~jax_mlpo.engine.engine.Engine`.

    Returns:
      Per tier path: ``read_bytes``, ``write_bytes``, ``busy_s`` and the bandwidths
      ``read_Bps``, ``write_Bps`` (None unless placement is ``"measured"``: the others know
      none).
    """
    known = engine.config.placement == "measured"
    return {
        store.tier.path: {
            "read_bytes": store.bytes_read,
            "write_bytes": store.bytes_written,
            "busy_s": store.busy_s,
            "read_Bps": read_bps if known else None,
            "write_Bps": write_bps if known else None,
        }
        for store, (read_bps, write_bps) in zip(engine.tiers, engine.bandwidth, strict=True)
    }


def iterations(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per iteration (from one record to the next): the tiers' bytes and busy time, its limit.

    Returns:
      One entry per record after the first that both carry ``tier_totals``: ``step``,
      ``step_s``, ``limit_s``, ``compute_limit_s`` (forward + backward + update compute),
      ``io_limit_s`` (the bytes at the tiers' bandwidth, the slowest tier), ``vs_limit``
      (iteration / limit), ``disk_busy`` (the busiest tier's busy time / iteration) and
      ``tiers`` (per path: ``read_bytes``, ``write_bytes``, ``busy_s``).
    """
    out = []
    for before, r in zip(records, records[1:], strict=False):
        if "tier_totals" not in before or "tier_totals" not in r or "fwd_bwd_s" not in r:
            continue  # (an overlapped run's first steps: forward + backward not timed apart)
        if any(t["read_Bps"] is None for t in r["tier_totals"].values()):
            continue  # no bandwidth model: no limit
        tiers, io_s = {}, 0.0
        for path, now in r["tier_totals"].items():
            then = before["tier_totals"].get(path)
            if then is None:
                continue
            moved = {k: now[k] - then[k] for k in ("read_bytes", "write_bytes", "busy_s")}
            tiers[path] = moved
            reads_s = moved["read_bytes"] / now["read_Bps"]
            io_s = max(io_s, reads_s + moved["write_bytes"] / now["write_Bps"])
        compute_s = r["fwd_bwd_s"] + r.get("compute_s", 0.0)
        limit = max(compute_s, io_s)
        busy = max((t["busy_s"] for t in tiers.values()), default=0.0)
        out.append({
            "step": r["step"],
            "step_s": r["step_s"],
            "limit_s": limit,
            "compute_limit_s": compute_s,
            "io_limit_s": io_s,
            "vs_limit": r["step_s"] / limit,
            "disk_busy": busy / r["step_s"],
            "tiers": tiers,
        })  # fmt: skip
    return out


def summarize_limit(records: Sequence[dict[str, Any]], skip: int) -> dict[str, float] | None:
    """Medians over the iterations after ``skip`` of :func:`iterations`' figures (None: the
    records carry no tier counters)."""
    window = [i for i in iterations(records) if i["step"] > skip]
    if not window:
        return None
    keys = ("step_s", "limit_s", "compute_limit_s", "io_limit_s", "vs_limit", "disk_busy")
    return {k: statistics.median(i[k] for i in window) for k in keys}


def format_limit(limit: dict[str, float]) -> str:
    """One line for the summary table."""
    return (
        f"iteration {1e3 * limit['step_s']:.0f} ms = {limit['vs_limit']:.2f}x its limit, max("
        f"forward + backward + update compute {1e3 * limit['compute_limit_s']:.0f} ms, the "
        f"iteration's bytes at the tiers' probed bandwidth {1e3 * limit['io_limit_s']:.0f} ms); "
        f"tiers busy {100 * limit['disk_busy']:.0f}% of the iteration"
    )


def plot_timeline(records: Sequence[dict[str, Any]], out: str | Path, *, last: int = 10) -> Path:
    """Draws the last ``last`` iterations: compute and waits beside each tier's busy time.

    Each iteration is two bars: the iteration (forward + backward, then the update as the
    optimizer's compute, read wait, write wait and the rest) and, for each tier, the time it had
    a request in flight during the iteration, with the iteration's limit marked.

    Returns:
      ``out``, as a Path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step = {i["step"]: i for i in iterations(records)}
    shown = [r for r in records if r["step"] in by_step][-last:]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    paths = sorted({p for r in shown for p in by_step[r["step"]]["tiers"]})
    width = 0.8 / (1 + len(paths))
    for n, r in enumerate(shown):
        parts = [
            ("forward + backward", r["fwd_bwd_s"], "C0"),
            ("update: optimizer compute", r.get("compute_s", 0.0), "C1"),
            ("update: read wait", r.get("read_wait_s", 0.0), "C3"),
            ("update: write wait", r.get("write_wait_s", 0.0), "C4"),
        ]
        parts.append(("update: rest", max(0.0, r["step_s"] - sum(p[1] for p in parts)), "C7"))
        bottom = 0.0
        for label, seconds, color in parts:
            ax.bar(n, seconds, width, bottom=bottom, color=color, label=label if n == 0 else None)
            bottom += seconds
        it = by_step[r["step"]]
        for k, path in enumerate(paths):
            busy = it["tiers"].get(path, {}).get("busy_s", 0.0)
            ax.bar(n + (k + 1) * width, busy, width, color=f"C{5 + k}", hatch="//", alpha=0.7,
                   label=f"tier busy: {Path(path).name}" if n == 0 else None)  # fmt: skip
        ax.hlines(it["limit_s"], n - width / 2, n + (len(paths) + 0.5) * width, colors="k",
                  linestyles="--", label="limit" if n == 0 else None)  # fmt: skip
    ax.set_xticks(range(len(shown)), [str(r["step"]) for r in shown])
    title = "each iteration: compute and waits (left), each tier's busy time (right)"
    ax.set(xlabel="step", ylabel="seconds", title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
