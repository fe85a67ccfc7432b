"""MLP-Offload's principles, observed through the tiers' I/O traces rather than the code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_mlpo
from jax_mlpo.config import Bandwidth, TierLimits
from jax_mlpo.engine import placement
from jax_mlpo.tiers.file import TierPermits

N_PARAMS = 12 * 4096  # 12 subgroups of 4096 elements
SUBGROUP = 4096
BLOB = 8 * SUBGROUP  # fp32 params: m | v


def make_tx(tmp_path, buffers: int, tiers: int = 2, **switches):
    switches.setdefault("write_behind", False)  # each step's writes are traced in that step
    switches.setdefault("read_ahead", False)  # and its reads (tests/test_read_ahead.py)
    config = jax_mlpo.OffloadConfig(
        host_cache=buffers * BLOB * (1 if switches.get("delayed_conversion", True) else 1.5),
        tiers=[
            jax_mlpo.FileTier(
                str(tmp_path / f"t{k}"),
                bandwidth=Bandwidth(read=f"{(k + 1) * 100}MB", write=f"{(k + 1) * 100}MB"),
            )
            for k in range(tiers)
        ],
        subgroup_size=SUBGROUP,
        prefetch_depth=1,
        **switches,
    )
    return jax_mlpo.adamw(1e-3, offload=config)


def run_steps(tx, steps: int):
    params = {"w": jnp.linspace(-1, 1, N_PARAMS, dtype=jnp.float32)}
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    traces = []
    update = jax.jit(tx.update)
    for step in range(steps):
        for store in engine.tiers:
            store.trace = []
        grads = {"w": jnp.cos(params["w"] * (step + 1))}
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        jax.block_until_ready(params)
        traces.append([list(store.trace) for store in engine.tiers])
    return engine, state, traces


def slots(trace_of_step, name: str) -> list[int]:
    return sorted(slot for tier in trace_of_step for kind, slot, _, _ in tier if kind == name)


def test_retained_subgroups_skip_io_across_the_step_boundary(tmp_path):
    # 2 tiers x depth 1 + 2 = 4 pipeline buffers + 4 more: with the alternating order all 8
    # keep their subgroup across the step boundary, not written back
    engine, state, traces = run_steps(
        make_tx(tmp_path, buffers=8, replan=False, retain_policy="slow_tiers"), steps=4
    )
    n = N_PARAMS // SUBGROUP
    everything = set(range(n))
    for step in range(3):
        kept = everything - set(slots(traces[step], "write"))  # not written back at the end
        assert len(kept) == 8
        read_next = set(slots(traces[step + 1], "read"))
        # the next step (the other order) updates the kept ones without reading them
        assert read_next == everything - kept, "a retained subgroup was read again"
        assert engine.metrics[step + 1].cache_hits == 8
    # the slow tier's subgroups are the ones retained (retain_policy="slow_tiers")
    assert all(engine.tier_of[i] == 0 for i in kept)
    jax_mlpo.close(state)


def test_a_tier_that_retains_nothing_cannot_starve_the_pipeline(tmp_path):
    """With retain_policy="slow_tiers" every buffer ends a step holding a kept subgroup of the
    slow tier, while the fast tier keeps none. At 100 / 300 MB/s the fast tier's subgroups take
    the odd positions, so the last subgroup of the ascending step (and the first of the next)
    is the fast tier's: it needs a buffer when every buffer is kept and nothing is being
    written. The engine then writes back the kept subgroup needed last and goes on."""

    def tx(retain: bool):
        tiers = [
            jax_mlpo.FileTier(str(tmp_path / f"{retain}-t{k}"), bandwidth=Bandwidth(bw, bw))
            for k, bw in enumerate(("100MB", "300MB"))
        ]  # fmt: skip
        config = jax_mlpo.OffloadConfig(
            host_cache=4 * BLOB,  # the pipeline's 4 buffers, all kept at the step's end
            tiers=tiers,
            subgroup_size=SUBGROUP,
            prefetch_depth=1,
            replan=False,
            retain=retain,
            retain_policy="slow_tiers",
            write_behind=False,
        )
        return jax_mlpo.adamw(1e-3, offload=config)

    engine, state, traces = run_steps(tx(True), steps=3)
    n = N_PARAMS // SUBGROUP
    assert engine.tier_of[-1] == 1 and list(engine.split.retained) == [4, 0]
    # the ascending first step reaches the fast tier's last subgroup with all 4 buffers kept:
    # one of them was written back for it (a later step may start with that buffer free)
    assert len(set(range(n)) - set(slots(traces[0], "write"))) == 3
    got = {k: np.asarray(v) for k, v in engine.state_dict().items() if k != "master"}
    jax_mlpo.close(state)
    plain, plain_state, _ = run_steps(tx(False), steps=3)
    want = {k: np.asarray(v) for k, v in plain.state_dict().items() if k != "master"}
    jax_mlpo.close(plain_state)
    for name in ("mu", "nu"):
        for a, b in zip(got[name], want[name], strict=True):
            np.testing.assert_array_equal(a, b)


def test_without_retention_every_subgroup_moves_every_step(tmp_path):
    engine, state, traces = run_steps(make_tx(tmp_path, buffers=8, retain=False), steps=3)
    n = N_PARAMS // SUBGROUP
    for trace in traces:
        assert slots(trace, "read") == list(range(n))
        assert slots(trace, "write") == list(range(n))
    jax_mlpo.close(state)


def test_alternating_order_is_observed(tmp_path):
    engine, state, traces = run_steps(make_tx(tmp_path, buffers=4, retain=False), steps=3)

    def read_start(trace, slot):
        return min(t0 for tier in trace for kind, s, t0, _ in tier if kind == "read" and s == slot)

    for step, trace in enumerate(traces):
        ascending = step % 2 == 0
        assert (read_start(trace, 0) < read_start(trace, 6) < read_start(trace, 11)) == ascending
        assert (read_start(trace, 11) < read_start(trace, 6) < read_start(trace, 0)) != ascending
    jax_mlpo.close(state)


@pytest.mark.parametrize("bandwidths", [[1.0, 1.0], [3.0, 1.0], [600.0, 300.0, 100.0]])
@pytest.mark.parametrize("retained", [0, 3])
@pytest.mark.parametrize("policy", ["slow_tiers", "equal"])
def test_placement_proportions(bandwidths, retained, policy):
    n = 97
    kept = placement.retained_per_tier(bandwidths, retained, policy)
    tier_of = placement.interleave(placement.tier_counts(n, bandwidths, kept))
    counts = [tier_of.count(k) for k in range(len(bandwidths))]
    assert sum(counts) == n and sum(kept) == retained
    # the uncached share of every tier is proportional to its bandwidth, within one subgroup
    for k, bw in enumerate(bandwidths):
        ideal = (n - retained) * bw / sum(bandwidths)
        assert abs((counts[k] - kept[k]) - ideal) <= 1.0
    # interleaved: no tier gets more than its share of any window of consecutive subgroups
    for k, c in enumerate(counts):
        run = max(len(s) for s in "".join("x" if t == k else " " for t in tier_of).split(" "))
        assert run <= int(np.ceil(c / (n - c + 1))) + 1


def test_measured_placement_follows_the_probe(tmp_path):
    # no fsync: the page cache is far faster than the caps even when the disk is busy
    tiers = [
        jax_mlpo.FileTier(str(tmp_path / "fast"), TierLimits(bandwidth_cap="40MB"), sync=False),
        jax_mlpo.FileTier(str(tmp_path / "slow"), TierLimits(bandwidth_cap="10MB"), sync=False),
    ]
    config = jax_mlpo.OffloadConfig(
        host_cache=4 * BLOB * 4, tiers=tiers, subgroup_size=SUBGROUP * 4, prefetch_depth=1,
        retain=False,
    )  # fmt: skip
    tx = jax_mlpo.adamw(1e-3, offload=config)
    state = tx.init({"w": jnp.zeros(40 * SUBGROUP)})
    engine = jax_mlpo.engine_of(state)
    # the probe moved its bytes through each tier's cap: never above it, on any load (a token
    # bucket's transfer ends no sooner than its reservation; 1%: two clocks). How far below it
    # a loaded machine keeps the 40 MB/s tier is the load's, so no ratio is asserted.
    for (read, write), cap in zip(engine.bandwidth, (40e6, 10e6), strict=True):
        assert 0 < read <= 1.01 * cap and 0 < write <= 1.01 * cap, engine.bandwidth
    fast, slow = engine.tier_of.count(0), engine.tier_of.count(1)
    # the split finishes both tiers' I/O together for what the probe measured (10 subgroups,
    # ~4:1 on a quiet machine), nothing retained: a subgroup costs a read and a write on its
    # tier, and no other split of the 10 ends sooner
    cost = [1 / r + 1 / w for r, w in engine.bandwidth]  # seconds per byte, read then write

    def makespan(k: int) -> float:
        return max(k * cost[0], (10 - k) * cost[1])

    assert fast + slow == 10
    assert makespan(fast) == min(makespan(k) for k in range(11))
    jax_mlpo.close(state)


def test_baseline_writes_and_reads_gradients(tmp_path):
    tx = make_tx(tmp_path, buffers=4, placement="first", order="ascending", retain=False,
                 delayed_conversion=False)  # fmt: skip
    engine, state, traces = run_steps(tx, steps=2)
    n = N_PARAMS // SUBGROUP
    assert len(engine.tiers) == 1
    for trace in traces:
        assert slots(trace, "write-grad") == list(range(n))
        assert slots(trace, "read-grad") == list(range(n))
        # each gradient blob is durable before its read starts
        for kind, slot, t0, _ in trace[0]:
            if kind == "read-grad":
                done = [t1 for k, s, _, t1 in trace[0] if k == "write-grad" and s == slot]
                assert done and max(done) <= t0
    jax_mlpo.close(state)


def test_delayed_conversion_never_writes_gradients(tmp_path):
    engine, state, traces = run_steps(make_tx(tmp_path, buffers=4), steps=2)
    assert not [k for trace in traces for tier in trace for k, *_ in tier if "grad" in k]
    jax_mlpo.close(state)


def test_thread_permits_never_exceeded():
    permits = TierPermits("t", reads=2, writes=3)
    active = {"read": 0, "write": 0}
    peak = {"read": 0, "write": 0}
    lock = threading.Lock()

    def worker(direction: str) -> None:
        for _ in range(50):
            with permits.hold(direction):
                with lock:
                    active[direction] += 1
                    peak[direction] = max(peak[direction], active[direction])
                time.sleep(0.0005)
                with lock:
                    active[direction] -= 1

    threads = [threading.Thread(target=worker, args=(d,)) for d in ["read", "write"] * 8]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak == {"read": 2, "write": 3}


_PROCESS = textwrap.dedent(
    """
    import sys, time
    from jax_mlpo.tiers.file import TierPermits
    permits = TierPermits("shared-pfs", 4, 4, sys.argv[1], node_reads=1, node_writes=2)
    with open(sys.argv[2], "w") as log:
        for _ in range(40):
            for direction in ("read", "write"):
                with permits.hold(direction):
                    t0 = time.monotonic()
                    time.sleep(0.001)
                    log.write(f"{direction} {t0} {time.monotonic()}\\n")
    """
)


def test_node_permits_never_exceeded_across_processes(tmp_path):
    node_dir = str(tmp_path / "permits")
    logs = [str(tmp_path / f"p{i}.log") for i in range(3)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _PROCESS, node_dir, log], env=os.environ.copy())
        for log in logs
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    events = {"read": [], "write": []}
    for log in logs:
        with open(log) as f:
            for line in f:
                direction, t0, t1 = line.split()
                events[direction] += [(float(t0), 1), (float(t1), -1)]
    for direction, limit in (("read", 1), ("write", 2)):
        active = peak = 0
        for _, delta in sorted(events[direction], key=lambda e: (e[0], e[1])):
            active += delta
            peak = max(peak, active)
        assert peak <= limit, f"{direction}: {peak} processes at once, limit {limit}"
        assert len(events[direction]) == 2 * 3 * 40


def test_replan_migrates_away_from_a_tier_that_slows_down(tmp_path):
    given = dict(limits=TierLimits(bandwidth_cap="40MB"), bandwidth=Bandwidth("40MB", "40MB"))
    given["sync"] = False
    tiers = [
        jax_mlpo.FileTier(str(tmp_path / "a"), **given),
        jax_mlpo.FileTier(str(tmp_path / "b"), **given),
    ]
    config = jax_mlpo.OffloadConfig(
        host_cache=4 * BLOB,
        tiers=tiers,
        subgroup_size=SUBGROUP,
        prefetch_depth=1,
        retain=False,
        write_behind=False,  # each step's I/O falls in its own window: the model sees it whole
    )
    params = {"w": jnp.linspace(-1, 1, N_PARAMS, dtype=jnp.float32)}
    tx = jax_mlpo.adamw(1e-3, offload=config)
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    assert engine.tier_of.count(0) == engine.tier_of.count(1) == 6
    # tier b becomes 40x slower than it measured; not 10x: tier a's own first steps run up to
    # ~5x its model on a loaded machine, and at 10x the rescaled split left 4 of 6 subgroups
    # on b (seen in CI, and in test_object_tier's twin)
    engine.tiers[1].set_bandwidth_cap(1e6)
    update = jax.jit(tx.update)
    for _ in range(6):
        updates, state = update({"w": jnp.full(N_PARAMS, 0.1)}, state, params)
        jax.block_until_ready(updates)
    # after 3 steps off the model, subgroups moved to tier a on their write-backs
    # (40x slower: 0 or 1 of 12 in the model; CPU load also slows tier a's observed rate, so
    # allow 3)
    assert engine.tier_of.count(1) <= 3, engine.tier_of
    a_ratio = engine.bandwidth[0][0] / engine.bandwidth[1][0]
    assert a_ratio > 2  # the model now sees tier b as the slower one
    jax_mlpo.close(state)
