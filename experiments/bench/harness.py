"""How the benchmarks measure: interleaved rounds, medians with their min-max, JSON results.

The machines the benchmarks run on are shared and their disks and memory bus drift, so every
comparison interleaves its systems (A B A B ..., or rotated A B, B A, ...) instead of running
each in one block, and reports the median over rounds with its [min-max]; a ratio between two
systems is taken per round, then summarised the same way.

Standard library only: the DeepSpeed peer's workers (``experiments/bench/deepspeed/ds_*.py``)
run in a venv without jax and import it too.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def spread(values: Iterable[float]) -> dict[str, float]:
    """The median of ``values`` with their min and max.

    Args:
      values: one figure per round (or per step).

    Returns:
      ``{"median": ..., "min": ..., "max": ...}``.
    """
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio_spread(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, float]:
    """:func:`spread` of the per-round ratios ``numerators[k] / denominators[k]``.

    Args:
      numerators, denominators: one figure per round of each system, in round order.

    Returns:
      The ratios' median, min and max.
    """
    return spread(a / b for a, b in zip(numerators, denominators, strict=True))


def format_spread(s: Mapping[str, float] | None, scale: float = 1.0, digits: int = 2) -> str:
    """A :func:`spread` as ``"median [min-max]"`` (``"-"`` for None)."""
    if not s:
        return "-"
    return (
        f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}-"
        f"{s['max'] * scale:.{digits}f}]"
    )


def medians(
    rows: Sequence[Mapping[str, Any]], keys: Iterable[str], missing: float | None = None
) -> dict[str, float]:
    """The median of each key over ``rows`` (e.g. a run's measured steps).

    Args:
      rows: dicts of figures.
      keys: the figures to summarise.
      missing: the figure of a row without the key (or with None); None leaves such rows out
        of the key's median, and a key no row has out of the result.

    Returns:
      ``{key: median}``.
    """
    out = {}
    for key in keys:
        values = [r.get(key) for r in rows]
        values = [missing if v is None else v for v in values]
        values = [v for v in values if v is not None]
        if values:
            out[key] = statistics.median(values)
    return out


def interleave(
    systems: Sequence[str],
    rounds: int,
    run: Callable[[str, int], T],
    *,
    rotate: bool = False,
    before_round: Callable[[int], None] | None = None,
) -> dict[str, list[T]]:
    """Runs every system once per round, the systems interleaved.

    Args:
      systems: the systems, in the order of the first round.
      rounds: how many rounds.
      run: ``run(system, round)`` measures one system once and returns its result.
      rotate: start round k with system ``k % len(systems)``, so each system runs first,
        second, ... equally often (a position effect, e.g. a disk that is faster after a pause,
        then hits every system alike); otherwise every round runs ``systems`` in order.
      before_round: called with the round's index before its first system (e.g. to measure
        the disk on which the round runs).

    Returns:
      Each system's results, in round order.
    """
    results: dict[str, list[T]] = {s: [] for s in systems}
    for rnd in range(rounds):
        if before_round is not None:
            before_round(rnd)
        k = rnd % len(systems) if rotate else 0
        for system in [*systems[k:], *systems[:k]]:
            results[system].append(run(system, rnd))
    return results


def round_robin(cases: Mapping[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds of each case per round: one warm-up call each, then ``rounds`` rounds of
    one call of every case in turn.

    Args:
      cases: name -> a call to time (it must wait for its own result, e.g.
        ``jax.block_until_ready``).
      rounds: timed rounds.

    Returns:
      Each case's times, in round order.
    """
    for fn in cases.values():  # compilation, first touch of the memory
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for key, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return times


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    return statistics.median(round_robin({"fn": fn}, repeats)["fn"])


def provenance() -> dict[str, Any]:
    """What makes a result reproducible: the commit (``+dirty`` with uncommitted changes), the
    date (UTC) and the machine (cores, CPU model, memory, kernel)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
        except OSError:  # no git on this machine
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": model,
            "memory_bytes": mem,
            "platform": platform.platform(),
        },  # fmt: skip
    }


def write_json(path: str | os.PathLike | None, result: Any, indent: int | None = 2) -> None:
    """Writes a benchmark's result (nothing when ``path`` is None: no ``--json`` given).

    A dict result gets a ``provenance`` entry (:func:`provenance`) unless it has one.

    Args:
      path: the ``--json`` file, or None.
      result: the result (JSON-serialisable).
      indent: as :func:`json.dump` (None: one line, for results with long traces).
    """
    if path is None:
        return
    if isinstance(result, dict) and "provenance" not in result:
        result = {"provenance": provenance(), **result}
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
