"""The host engine through the public API: tier locking, corruption, metrics, I/O-compute
overlap, and degenerate layouts."""

from __future__ import annotations

import concurrent.futures
import errno
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_mlpo
from jax_mlpo import FileTier, OffloadConfig
from jax_mlpo.config import TierLimits
from jax_mlpo.engine.leaves import HostLeaves
from jax_mlpo.testing import tier_faults
from jax_mlpo.types import AdamWHyper


def blob_files(tier_dir) -> list[Path]:
    return sorted(Path(tier_dir).glob("state-*.blob"))


def grads_for(params, step: int):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(step), len(leaves))
    return treedef.unflatten(
        [
            jax.random.normal(k, jnp.shape(x), jnp.float32).astype(x.dtype)
            for k, x in zip(keys, leaves, strict=True)
        ]
    )


@pytest.fixture
def states():
    """Collects optimizer states and closes them at the end of the test."""
    opened: list = []
    yield opened
    for state in opened:
        jax_mlpo.close(state)


# -- tier locking -------------------------------------------------------------------------------


def test_second_optimizer_on_same_tier(tmp_path, states):
    """A second optimizer's init on the tier of this process's first replaces it (another
    process's lock is tests/test_tiers.py's): the first is closed and refuses to go on."""
    params = {"w": jnp.ones((1000,))}
    config = OffloadConfig(
        host_cache=4 * 8 * 100, tiers=[str(tmp_path / "tier")], subgroup_size=100
    )
    first = jax_mlpo.adamw(1e-3, offload=config)
    state = first.init(params)
    assert len(jax_mlpo.engine_of(state).tiers) == 1
    _, state = jax.jit(first.update)(grads_for(params, 0), state, params)
    jax.block_until_ready(state)

    second = jax_mlpo.adamw(1e-3, offload=config)  # construction only validates the path
    state2 = second.init(params)
    states.append(state2)
    assert len(jax_mlpo.engine_of(state2).tiers) == 1
    updates, _ = jax.jit(second.update)(grads_for(params, 0), state2, params)
    assert np.all(np.isfinite(np.asarray(updates["w"])))
    grads = jax.block_until_ready(grads_for(params, 1))
    with (
        pytest.raises(jax_mlpo.NoEngineError, match="was replaced: a later tx.init"),
        jax_mlpo.errors.typed(),
    ):
        jax.block_until_ready(first.update(grads, state, params))
    jax_mlpo.close(state2)
    with (
        pytest.raises(jax_mlpo.NoEngineError, match=r"was closed \(jax_mlpo.close\)"),
        jax_mlpo.errors.typed(),
    ):
        jax.block_until_ready(second.update(grads, state2, params))
    states.append(first.init(params))  # the first's tx again, once the second is closed


# -- corruption end to end ----------------------------------------------------------------------


def corrupt_optimizer(tmp_path, states, victim=3):
    """An optimizer after one update, with one byte flipped in subgroup ``victim``'s blob."""
    params = {"w": jnp.ones((1000,))}
    tier_path = str(tmp_path / "tier")
    config = OffloadConfig(host_cache=4 * 8 * 100, tiers=[tier_path], subgroup_size=100)
    tx = jax_mlpo.adamw(1e-3, offload=config)
    state = tx.init(params)
    states.append(state)
    update = jax.jit(tx.update)
    _, state = update(grads_for(params, 0), state, params)
    jax.block_until_ready(state)
    engine = jax_mlpo.engine_of(state)
    path = Path(engine.tiers[engine.tier_of[victim]].blob_path(victim))
    assert path.stat().st_size == 4096 + 4096  # 800 bytes of state padded to a block, trailer
    data = bytearray(path.read_bytes())
    data[17] ^= 0x01
    path.write_bytes(bytes(data))
    return update, state, params, tier_path, path


def test_corrupt_blob_fails_the_update_then_the_engine(tmp_path, states):
    victim = 3
    update, state, params, tier_path, path = corrupt_optimizer(tmp_path, states, victim)
    # Inputs ready before dispatch: the failure surfaces from this call (see the test below).
    grads = jax.block_until_ready(grads_for(params, 1))

    with pytest.raises(jax_mlpo.CorruptBlobError) as info, jax_mlpo.errors.typed():
        jax.block_until_ready(update(grads, state, params))
    message = str(info.value)
    assert re.search("checksum|corrupt", message)
    assert f"subgroup {victim}:" in message
    assert tier_path in message and str(path) in message

    with pytest.raises(jax_mlpo.EngineFailedError, match="failed midway"), jax_mlpo.errors.typed():
        jax.block_until_ready(update(grads, state, params))
    engine = jax_mlpo.engine_of(state)
    with pytest.raises(jax_mlpo.EngineFailedError, match="failed midway"):
        engine.step(1, None, [], [])  # the engine itself refuses before looking at arguments


@jax.jit
def late_grads(params):
    """Gradients still being computed (~0.1 s of matmuls) when the update is dispatched, as
    in a train step where the update follows the backward pass."""
    x = jnp.full((1000, 1000), 1e-3)
    y = x
    for _ in range(4):
        y = jnp.tanh(y @ x)
    return jax.tree.map(lambda p: jnp.ones_like(p) + 0 * y[0, 0], params)


def test_failed_update_does_not_poison_later_updates(tmp_path, states):
    update, state, params, _, _ = corrupt_optimizer(tmp_path, states)
    with pytest.raises(jax_mlpo.CorruptBlobError, match="checksum"), jax_mlpo.errors.typed():
        jax.block_until_ready(update(late_grads(params), state, params))
    # The message says: restore and init a new optimizer. That one must work.
    config = OffloadConfig(host_cache=4 * 8 * 100, tiers=[str(tmp_path / "new")], subgroup_size=100)
    tx = jax_mlpo.adamw(1e-3, offload=config)
    new_state = tx.init(params)
    states.append(new_state)
    grads = jax.block_until_ready(grads_for(params, 0))
    updates, new_state = jax.jit(tx.update)(grads, new_state, params)
    assert jax_mlpo.engine_of(new_state).step_count == 1
    with pytest.raises(jax_mlpo.EngineFailedError, match="failed midway"), jax_mlpo.errors.typed():
        jax.block_until_ready(update(grads, state, params))


# -- metrics ------------------------------------------------------------------------------------

# 1037 params in 10 subgroups of 100 elements and one of 37; "b" spans subgroups 9 and 10.
SHAPES = {"a": (10, 99), "b": (47,)}
NUM_PARAMS = 1037
SUBGROUP = 100
SUBGROUP_SIZES = [100] * 10 + [37]


def make_params(dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), len(SHAPES))
    return {
        k: jax.random.normal(key, shape).astype(dtype)
        for key, (k, shape) in zip(keys, SHAPES.items(), strict=True)
    }


def traced_steps(tx, params, steps: int):
    """Runs jitted updates; yields each step's metrics and the slots each tier read and wrote."""
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    update = jax.jit(tx.update)
    try:
        for step in range(steps):
            for store in engine.tiers:
                store.trace = []
            updates, state = update(grads_for(params, step), state, params)
            params = optax.apply_updates(params, updates)
            jax.block_until_ready(params)
            io = {
                store.tier.path: {
                    kind: sorted(slot for k, slot, _, _ in store.trace if k == kind)
                    for kind in ("read", "write")
                }
                for store in engine.tiers
            }
            yield engine, engine.metrics[-1], io
    finally:
        jax_mlpo.close(state)


def on_disk(tier_dir, engine_tier, num_subgroups) -> list[int]:
    """The subgroups whose state blob exists in a tier directory."""
    files = set(blob_files(tier_dir))
    return [i for i in range(num_subgroups) if Path(engine_tier.blob_path(i)) in files]


@pytest.mark.parametrize(
    "dtype,per_elem", [(jnp.float32, 8), (jnp.bfloat16, 12)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("retain", [False, True], ids=["no-reuse", "reuse"])
def test_metrics_pipeline_only(dtype, per_elem, retain, tmp_path):
    """No room beyond the pipeline: without reuse every step reads and writes every blob once;
    with it the subgroups a step ends with stay in the buffers, neither written back nor read
    by the next step (which starts with them)."""
    depth, n = 2, len(SUBGROUP_SIZES)
    buffers = depth * 2 + 2
    blob_bytes = [per_elem * size for size in SUBGROUP_SIZES]
    tiers = [str(tmp_path / "t0"), str(tmp_path / "t1")]
    config = OffloadConfig(
        host_cache=(depth * len(tiers) + 2) * per_elem * SUBGROUP,
        tiers=tiers,
        subgroup_size=SUBGROUP,
        prefetch_depth=depth,
        placement="even",
        retain=retain,
        write_behind=False,  # each step's bytes are counted in that step
        read_ahead=False,  # and its reads: none issued before it
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    placed = None
    previous_order = None
    for step, (engine, m, io) in enumerate(traced_steps(tx, make_params(dtype), 3), start=1):
        if placed is None:
            stores = {store.tier.path: store for store in engine.tiers}
            placed = {t: on_disk(t, stores[t], n) for t in tiers}
            assert sorted(placed[tiers[0]] + placed[tiers[1]]) == list(range(n))
            assert placed[tiers[0]] and placed[tiers[1]]  # both tiers hold subgroups
        assert m.step == step
        assert m.subgroups == n
        order = list(range(n)) if step % 2 else list(range(n))[::-1]  # alternating
        # reused: the subgroups the previous step updated last, still in the buffers
        reused = set(previous_order[-buffers:]) if retain and previous_order else set()
        previous_order = order
        assert m.cache_hits == len(reused)
        for t in tiers:
            unread = sorted(set(placed[t]) - reused)
            kept = set(order[-buffers:]) if retain else set()
            written = sorted(set(placed[t]) - kept)
            assert io[t]["read"] == unread, f"step {step}: reads of {t}"
            assert io[t]["write"] == written, f"step {step}: writes of {t}"
            assert m.bytes_read[t] == sum(blob_bytes[i] for i in unread)
            assert m.bytes_written[t] == sum(blob_bytes[i] for i in written)


@pytest.mark.parametrize(
    "dtype,per_elem", [(jnp.float32, 8), (jnp.bfloat16, 12)], ids=["fp32", "bf16"]
)
def test_metrics_with_retained_subgroups(dtype, per_elem, tmp_path):
    """Room for 2 subgroups beyond the pipeline: every buffer's subgroup is kept across the step
    boundary (dirty, not written back), and the next step starts with them."""
    depth, n, extra = 2, len(SUBGROUP_SIZES), 2
    blob_bytes = [per_elem * size for size in SUBGROUP_SIZES]
    tiers = [str(tmp_path / "t0"), str(tmp_path / "t1")]
    config = OffloadConfig(
        host_cache=(depth * len(tiers) + 2 + extra) * per_elem * SUBGROUP,
        tiers=tiers,
        subgroup_size=SUBGROUP,
        prefetch_depth=depth,
        placement="even",
        write_behind=False,  # each step's writes are traced in that step
        read_ahead=False,  # and its reads: none issued before it
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    kept: set[int] | None = None  # not written back by the previous step
    for step, (engine, m, io) in enumerate(traced_steps(tx, make_params(dtype), 4), start=1):
        stores = list(engine.tiers)
        reads = [i for t in tiers for i in io[t]["read"]]
        writes = [i for t in tiers for i in io[t]["write"]]
        assert len(reads) == len(set(reads)) and len(writes) == len(set(writes))  # once at most
        assert m.subgroups == n
        # every buffer's subgroup is reused
        buffers = depth * len(tiers) + 2 + extra
        assert m.cache_hits == (0 if kept is None else buffers), f"step {step}"
        assert len(reads) + m.cache_hits == n
        if kept is not None:  # the kept ones are among those not read
            assert kept <= set(range(n)) - set(reads), f"step {step}"
        assert len(writes) == n - buffers
        kept = set(range(n)) - set(writes)
        for t in tiers:
            assert m.bytes_read[t] == sum(blob_bytes[i] for i in io[t]["read"])
            assert m.bytes_written[t] == sum(blob_bytes[i] for i in io[t]["write"])
    # closing (at the end of traced_steps) flushes the retained subgroups to their tiers
    flushed = [slot for store in stores for kind, slot, _, _ in store.trace if kind == "write"]
    assert sorted(flushed) == sorted(set(writes) | kept)  # the last step's writes, then the flush
    assert len(flushed) == n


def test_metrics_with_everything_cached(tmp_path, states):
    tier = tmp_path / "tier"
    config = OffloadConfig(
        host_cache=8 * NUM_PARAMS, tiers=[str(tier)], subgroup_size=SUBGROUP, prefetch_depth=2
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    params = make_params(jnp.float32)
    state = tx.init(params)
    states.append(state)
    engine = jax_mlpo.engine_of(state)
    assert engine.tiers == []
    update = jax.jit(tx.update)
    for step in range(2):
        _, state = update(grads_for(params, step), state, params)
        jax.block_until_ready(state)
        m = engine.metrics[-1]
        assert m.cache_hits == m.subgroups == len(SUBGROUP_SIZES)
        assert m.bytes_read == {} and m.bytes_written == {}
    # the tier was validated (created) but never opened: no state, no lock
    assert tier.is_dir() and list(tier.iterdir()) == []


# -- overlap of I/O and compute -----------------------------------------------------------------

N_SUBGROUPS = 8
OVERLAP_SUBGROUP = 32_768  # 256 KiB blobs (fp32: m and v)
READ_S = 0.04  # per blob at the cap; a step moves 2 blobs (read + write) per subgroup
COMPUTE_S = 0.08  # per subgroup, slept between fetching its leaves and storing its update
HYPER = AdamWHyper(bc1=0.1, bc2=0.001, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)


def intersection(a, b) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


class SlowLeaves(HostLeaves):
    """Host leaves whose every subgroup takes ``COMPUTE_S`` longer between :meth:`fetch` and
    :meth:`store` (the kernel runs between them); records each subgroup's compute span."""

    def __init__(self, grads, params, updates) -> None:
        super().__init__(grads, params, updates)
        self.spans: list[tuple[float, float]] = []
        self._t0 = 0.0

    def fetch(self, sg) -> None:
        self._t0 = time.monotonic()
        time.sleep(COMPUTE_S)

    def store(self, sg) -> None:
        self.spans.append((self._t0, time.monotonic()))


def overlap_step(tmp_path, depth, states):
    """One update over a bandwidth-capped tier with slowed compute; returns its metrics and the
    read and compute spans."""
    blob = 8 * OVERLAP_SUBGROUP
    limits = TierLimits(bandwidth_cap=blob / READ_S)
    tier = FileTier(str(tmp_path / f"tier-depth{depth}"), limits, sync=False)
    config = OffloadConfig(
        host_cache=(depth + 2) * blob,
        tiers=[tier],
        subgroup_size=OVERLAP_SUBGROUP,
        prefetch_depth=depth,
        placement="even",  # no bandwidth probe at init
        read_ahead=False,  # the step's own reads: none issued before it (tests/test_read_ahead)
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    params = {"w": jnp.zeros((N_SUBGROUPS * OVERLAP_SUBGROUP,), jnp.float32)}
    state = tx.init(params)
    states.append(state)
    engine = jax_mlpo.engine_of(state)
    assert engine.tier_of == [0] * N_SUBGROUPS and not engine.host_only

    for store in engine.tiers:
        store.trace = []
    flat = np.asarray(params["w"])
    leaves = SlowLeaves([np.ones_like(flat)], [flat], [np.zeros_like(flat)])
    engine.step_leaves(0, HYPER, leaves)  # one leaf: one segment per subgroup
    engine.drain()  # the last write-backs (write_behind) are in the trace too
    trace = [span for store in engine.tiers for span in store.trace]
    reads = {slot: (t0, t1) for kind, slot, t0, t1 in trace if kind == "read"}
    writes = [(t0, t1) for kind, _, t0, t1 in trace if kind == "write"]
    assert len(leaves.spans) == N_SUBGROUPS
    # every subgroup read once; all but the (depth + 2) the step ends with written back (the
    # next step, in the other order, starts with them)
    assert len(reads) == N_SUBGROUPS and len(writes) == N_SUBGROUPS - (depth + 2)
    # the first step runs in ascending order: the n-th compute span is subgroup n's
    return engine.metrics[-1], [reads[i] for i in range(N_SUBGROUPS)], leaves.spans


def test_io_overlaps_compute_with_prefetch(tmp_path, states):
    metrics, reads, computes = overlap_step(tmp_path, 2, states)
    overlapped = sum(any(intersection(r, c) > 0 for c in computes) for r in reads)
    assert overlapped > N_SUBGROUPS // 2, f"only {overlapped} reads overlap the compute"
    # prefetched: every read began before the previous subgroup's compute ended, so reads hide
    # behind compute instead of following it (without prefetch each begins after it ended:
    # test_no_overlap_without_prefetch). Not "before that compute began": with 4 buffers a read
    # two ahead waits for a write-back's buffer and is issued just before that compute starts,
    # and on a loaded machine its I/O thread may start after it.
    for i in range(1, N_SUBGROUPS):
        assert reads[i][0] < computes[i - 1][1], (i, reads[i], computes[i - 1])


def test_no_overlap_without_prefetch(tmp_path, states):
    metrics, reads, computes = overlap_step(tmp_path, 0, states)
    for r in reads:
        for c in computes:
            assert intersection(r, c) == 0, (r, c)
    # serial: each read began only after the previous subgroup's compute had finished
    for i in range(1, N_SUBGROUPS):
        assert reads[i][0] >= computes[i - 1][1], (i, reads[i], computes[i - 1])


# -- write-behind -------------------------------------------------------------------------------


def write_behind_run(tmp_path, write_behind: bool, states, steps: int = 3, settle: bool = False):
    """Updates over a capped tier (10 ms per blob); returns the engine, state, params, the
    number of write-backs still in flight when each update returned and each update's trace
    of tier requests (those that finished after it returned included). ``settle`` lets them
    finish before the next update, as a forward and backward pass would.

    Nothing is retained: with retention (alternating order) a step ends with every buffer
    holding a kept subgroup, so its other write-backs finished before it did, and there is
    nothing left to write behind.
    """
    blob = 8 * OVERLAP_SUBGROUP
    tier = FileTier(str(tmp_path / f"tier-{write_behind}"), TierLimits(bandwidth_cap=blob / 0.01))
    config = OffloadConfig(
        host_cache=4 * blob,
        tiers=[tier],
        subgroup_size=OVERLAP_SUBGROUP,
        prefetch_depth=1,
        placement="even",
        retain=False,
        write_behind=write_behind,
        read_ahead=False,  # each step's reads are its own (tests/test_read_ahead.py)
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    params = {"w": jnp.linspace(-1.0, 1.0, N_SUBGROUPS * OVERLAP_SUBGROUP, dtype=jnp.float32)}
    state = tx.init(params)
    states.append(state)
    engine = jax_mlpo.engine_of(state)
    store = engine.tiers[0]
    update = jax.jit(tx.update)
    in_flight, traces = [], []
    # With write-behind, the write-back of each step's last subgroup is held until the update
    # has returned and been counted: nothing in the step waits for it, so an update that did
    # wait would hang (10 s, then fail the count), and one that did not returns with it in
    # flight whatever the machine's load.
    with tier_faults(engine) as plan:
        for step in range(steps):
            last = N_SUBGROUPS - 1 if step % 2 == 0 else 0  # the alternating order's last
            if write_behind:
                plan.hang("write", slot=last, limit_s=10)
            store.trace = []  # with settle, the last update's write-backs are in the last
            traces.append(store.trace)
            updates, state = update(grads_for(params, step), state, params)
            jax.block_until_ready(updates)
            in_flight.append(sum(not w.future.done() for w in engine.pipeline.writes))
            plan.release()
            if settle:
                concurrent.futures.wait([w.future for w in engine.pipeline.writes])
            params = optax.apply_updates(params, updates)
    return engine, state, params, in_flight, traces


def test_write_behind_returns_before_the_last_writes_and_changes_nothing(tmp_path, states):
    engine, state, params, in_flight, _ = write_behind_run(tmp_path, True, states)
    assert min(in_flight) >= 1, in_flight  # the update returned with write-backs in flight
    want_engine, want_state, want, waited, _ = write_behind_run(tmp_path, False, states)
    assert waited == [0, 0, 0]
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(want["w"]))
    # the state (state_dict waits for the writes) is the same bit for bit
    got_state, want_state_dict = engine.state_dict(), want_engine.state_dict()
    assert not engine.pipeline.writes
    for name in ("mu", "nu"):
        for a, b in zip(got_state[name], want_state_dict[name], strict=True):
            np.testing.assert_array_equal(a, b)


def test_write_behind_bytes_count_in_the_update_that_issued_them(tmp_path, states):
    """Write-backs that finish after their update returned (here: all of them, before the next
    update or the drain starts) are in that update's figures, as if it had waited for them."""
    engine, _, _, in_flight, traces = write_behind_run(tmp_path, True, states, 4, settle=True)
    assert min(in_flight) >= 1, in_flight
    engine.drain()
    want_engine, *_ = write_behind_run(tmp_path, False, states, steps=4)

    def moved(e, kind):
        return [sum(getattr(m, kind).values()) for m in e.metrics]

    for kind in ("bytes_read", "bytes_written"):
        assert moved(engine, kind) == moved(want_engine, kind), kind
    blob = 8 * OVERLAP_SUBGROUP  # every step writes every subgroup (nothing retained)
    assert moved(engine, "bytes_written") == [N_SUBGROUPS * blob] * 4
    # each update's busy time is the time its own requests were in flight, late ones included
    busy = [sum(m.tier_busy_s.values()) for m in engine.metrics]
    in_flight_s = [union_length([(t0, t1) for *_, t0, t1 in trace]) for trace in traces]
    assert [len(trace) for trace in traces] == [2 * N_SUBGROUPS] * 4  # every read and write
    assert busy == pytest.approx(in_flight_s, rel=1e-9, abs=1e-9)


def union_length(spans) -> float:
    """The length of the union of ``(start, end)`` spans."""
    total, reach = 0.0, -np.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def test_a_failed_write_behind_fails_the_next_update(tmp_path, states):
    blob = 8 * OVERLAP_SUBGROUP
    config = OffloadConfig(
        host_cache=4 * blob,
        tiers=[FileTier(str(tmp_path / "tier"), sync=False)],
        subgroup_size=OVERLAP_SUBGROUP,
        prefetch_depth=1,
        placement="even",
        retain=False,  # the step ends with write-backs in flight (see write_behind_run)
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    params = {"w": jnp.linspace(-1.0, 1.0, N_SUBGROUPS * OVERLAP_SUBGROUP, dtype=jnp.float32)}
    state = tx.init(params)
    states.append(state)
    engine = jax_mlpo.engine_of(state)
    store = engine.tiers[0]
    update = jax.jit(tx.update)
    with tier_faults(state) as plan:
        for slot in range(N_SUBGROUPS // 2, N_SUBGROUPS):  # the step's last write-backs
            plan.hang("write", slot=slot, limit_s=10).fail("write", slot=slot, errno=errno.EIO)
        updates, state = update(grads_for(params, 0), state, params)
        jax.block_until_ready(updates)  # returned while its last write-backs are in flight
        assert any(not w.future.done() for w in engine.pipeline.writes)
        plan.release()
        with (
            pytest.raises(
                jax_mlpo.TierIOError, match=f"tier {store.tier.path!r}.*Input/output error"
            ),
            jax_mlpo.errors.typed(),
        ):
            jax.block_until_ready(update(grads_for(params, 1), state, params))
    assert "hung+failed" in plan.outcomes("write")
    with pytest.raises(jax_mlpo.EngineFailedError, match="failed midway"):
        engine.state_dict()


# -- degenerate layouts -------------------------------------------------------------------------

DEGENERATE = [
    # name, params, subgroup_size, whether the state goes to the tier. With the cache at the
    # pipeline's minimum (4 buffers), a model of one subgroup always fits in host memory.
    ("subgroup-bigger-than-model", {"w": (3, 5), "b": (4,)}, 1000, False),
    ("single-scalar", {"s": ()}, 1, False),
    ("single-scalar-big-subgroup", {"s": ()}, 100, False),
    ("scalars-one-per-subgroup", {"a": (), "b": (3,), "c": ()}, 1, True),
]


@pytest.mark.parametrize(
    "shapes,subgroup_size,tiered", [c[1:] for c in DEGENERATE], ids=[c[0] for c in DEGENERATE]
)
def test_degenerate_layouts_match_optax(shapes, subgroup_size, tiered, tmp_path, states):
    keys = jax.random.split(jax.random.PRNGKey(3), len(shapes))
    params = {
        k: jax.random.normal(key, shape)
        for key, (k, shape) in zip(keys, shapes.items(), strict=True)
    }
    num = sum(int(np.prod(s)) for s in shapes.values())
    blob = 8 * min(subgroup_size, num)
    config = OffloadConfig(
        host_cache=4 * blob, tiers=[str(tmp_path / "tier")], subgroup_size=subgroup_size
    )
    tx = jax_mlpo.adamw(1e-2, weight_decay=0.1, offload=config)
    ref = optax.adamw(1e-2, weight_decay=0.1)
    state, ref_state = tx.init(params), ref.init(params)
    states.append(state)
    engine = jax_mlpo.engine_of(state)
    assert len(engine.layout.subgroups) == -(-num // subgroup_size)
    assert engine.host_only is not tiered
    update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
    ref_params = params
    for step in range(3):
        grads = grads_for(params, step)
        updates, state = update(grads, state, params)
        want, ref_state = ref_update(grads, ref_state, ref_params)
        for k in shapes:
            got_k, want_k = np.asarray(updates[k]), np.asarray(want[k])
            assert got_k.shape == want_k.shape == shapes[k]
            np.testing.assert_allclose(got_k, want_k, rtol=1e-6, atol=1e-9, err_msg=f"{k}@{step}")
        params = optax.apply_updates(params, updates)
        ref_params = optax.apply_updates(ref_params, want)
    assert engine.metrics[-1].subgroups == len(engine.layout.subgroups)
    if tiered:
        assert sum(engine.metrics[-1].bytes_read.values()) > 0


def test_a_tier_that_stops_answering_times_out(tmp_path, states):
    config = OffloadConfig(
        host_cache=4 * 8 * SUBGROUP, tiers=[str(tmp_path / "t")], subgroup_size=SUBGROUP,
        prefetch_depth=1, placement="even", io_timeout_s=0.5,
    )  # fmt: skip
    tx = jax_mlpo.adamw(1e-3, offload=config)
    params = make_params(jnp.float32)
    state = tx.init(params)
    states.append(state)
    grads = jax.tree.map(jnp.ones_like, params)
    with tier_faults(state) as plan:
        plan.hang("read", limit_s=10)  # a file system that stops answering
        with (
            pytest.raises(
                jax_mlpo.TierIOError, match="did not complete a request within io_timeout_s=0.5"
            ),
            jax_mlpo.errors.typed(),
        ):
            jax.block_until_ready(jax.jit(tx.update)(grads, state, params))
        # the update gave up while the read was still held, not when it came back
        assert plan.hanging == 1 and plan.outcomes("read").count("hung") == 1


def test_load_state_dict_leaves_no_stale_subgroup_in_host_memory(tmp_path, states):
    """Write-backs still queued when the state is replaced must not survive as clean hits:
    the next update starts from the loaded state, exactly as a fresh engine loaded with it."""
    blob = 8 * OVERLAP_SUBGROUP
    # 5 buffers, 3 for the pipeline: each step keeps 4 and 5 and writes 0-3 back, the last
    # write-back still queued when it returns
    n = 6
    hyper = AdamWHyper(bc1=0.3, bc2=0.01, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    params = [np.linspace(-1.0, 1.0, n * OVERLAP_SUBGROUP, dtype=np.float32)]

    def make(name):
        config = OffloadConfig(
            host_cache=5 * blob, tiers=[FileTier(str(tmp_path / name), sync=False)],
            subgroup_size=OVERLAP_SUBGROUP, prefetch_depth=1, placement="even",
            order="ascending",  # the pipeline's write-backs end the step still queued
            read_ahead=False,  # and stay queued: the read-ahead would reclaim them as they land
        )  # fmt: skip
        state = jax_mlpo.adamw(1e-3, offload=config).init({"w": jnp.asarray(params[0])})
        states.append(state)
        return jax_mlpo.engine_of(state)

    engine = make("used")
    for step in range(2):
        engine.step(step, hyper, [np.cos(params[0] * (step + 1))], params)
    assert engine.pipeline.writes  # queued write-backs whose buffers hold the old state
    loaded = {
        "mu": [np.full(params[0].shape, 0.5, np.float32)],
        "nu": [np.full(params[0].shape, 0.25, np.float32)],
        "master": [None],
    }
    engine.load_state_dict(2, loaded)
    # no buffer may offer a subgroup as it was before the load (a clean hit would bypass it)
    assert engine.cache.clean == {}
    fresh = make("fresh")
    fresh.load_state_dict(2, loaded)
    grads = [np.cos(params[0] * 3)]
    got = np.array(engine.step(2, hyper, grads, params)[0])
    want = np.array(fresh.step(2, hyper, grads, params)[0])
    np.testing.assert_array_equal(got, want)
