"""Read-ahead across steps: the next update's reads run between updates, within host_cache.

Between two updates (the forward and backward pass) the engine reads the next update's first
subgroups into the host buffers that hold nothing it needs sooner. These tests check, through
the tiers' request traces and the fault plans of :mod:`jax_mlpo.testing` (orders and counts,
never times), that the reads happen before the next update starts, that they never take more
than the cache's buffers, and that whatever arrives meanwhile (a checkpoint, a load, a re-plan, a
failing tier, the baseline's switches) leaves the results exactly optax's.
"""

from __future__ import annotations

import dataclasses
import errno
import threading

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fault_training import BLOB, LR, SUB, WD, N, Training, grads_for, make_params

import jax_mlpo
from jax_mlpo.config import Bandwidth, TierLimits
from jax_mlpo.engine import retention
from jax_mlpo.engine.layout import gather_state
from jax_mlpo.testing import tier_faults
from jax_mlpo.transforms.opt_state import with_count


def config(tmp_path, name: str = "tier", **switches) -> jax_mlpo.OffloadConfig:
    """4 buffers for 8 subgroups on one tier (6 x BLOB: the baseline's hold a gradient blob
    too); ascending order, so that a step ends with the pipeline's buffers holding what the
    next step needs last: room to read ahead."""
    switches.setdefault("order", "ascending")
    return jax_mlpo.OffloadConfig(
        host_cache=6 * BLOB if switches.get("delayed_conversion") is False else 4 * BLOB,
        tiers=[jax_mlpo.FileTier(str(tmp_path / name), sync=False)],
        subgroup_size=SUB,
        prefetch_depth=1,
        placement="even",
        **switches,
    )


def optax_run(steps: int) -> list[np.ndarray]:
    """The params after each of ``steps`` updates of ``optax.adamw`` (the reference)."""
    tx = optax.adamw(LR, weight_decay=WD)
    params = make_params()
    state = tx.init(params)
    out = []
    for step in range(steps):
        updates, state = tx.update(grads_for(params, step), state, params)
        params = optax.apply_updates(params, updates)
        out.append(np.asarray(params["w"]))
    return out


class Run(Training):
    """An offloaded AdamW trained step by step, as a loop would, watched between updates."""

    def train(self, steps: int = 1) -> None:
        """Runs ``steps`` updates; a failed one leaves the params and state as they were (its
        outputs carry its error, which XLA may report at dispatch or when they are read)."""
        self.run(steps)

    def settle(self) -> None:
        """Waits, as a forward and backward pass would, until the read-ahead has issued what
        it can and those reads have landed."""
        while self.engine.idle.read_ahead.running:
            threading.Event().wait(0.001)
        for i in self.engine.pipeline.reads_ahead:
            resident = self.engine.pipeline.issued[i]
            for future in resident.reads:
                future.exception()  # waits

    def read_ahead_again(self) -> None:
        """Drops the reads issued ahead and issues them again (under a fault plan just
        attached)."""
        self.engine.idle.pause(cancel=True)
        self.engine.idle.resume()

    def close(self) -> None:
        jax_mlpo.close(self.state)


@pytest.fixture
def runs():
    opened: list[Run] = []
    yield opened
    for run in opened:
        run.close()


def open_run(runs, offload) -> Run:
    run = Run(offload)
    runs.append(run)
    return run


def test_reads_happen_before_the_update_that_needs_them(tmp_path, runs):
    run = open_run(runs, config(tmp_path))
    store = run.engine.tiers[0]
    plan = run.engine.plan
    # the tier's requests finished when each update ends, as the next read-ahead starts
    ends: list[int] = []
    resume = run.engine.idle.resume
    run.engine.idle.resume = lambda: (ends.append(len(store.trace)), resume())
    want = optax_run(4)
    for step in range(4):
        run.settle()  # the forward and backward pass
        ahead = run.engine.pipeline.reads_ahead
        order = retention.step_order(N, step, "ascending")
        # the next update's first subgroups not in host memory, in its order
        assert ahead == [i for i in order if i not in run.engine.cache.dirty][: len(ahead)]
        # never more than the buffers the retained subgroups leave free
        assert 0 < len(ahead) <= plan.buffers - len(run.engine.cache.dirty)
        store.trace = []
        run.train()
        m = run.engine.metrics[-1]
        assert m.reads_ahead == len(ahead)
        # the update read the others, and none of those read ahead again
        read = [slot for kind, slot, *_ in store.trace[: ends[-1]] if kind == "read"]
        assert len(read) + len(ahead) + m.cache_hits == N, (read, ahead, m.cache_hits)
        assert not set(read) & set(ahead), (read, ahead)
        np.testing.assert_allclose(np.asarray(run.params["w"]), want[step], rtol=1e-6, atol=1e-7)
    # all within host_cache: the cache's buffers, allocated once
    assert sum(b.nbytes for b in run.engine.cache.buffers) <= run.engine.config.host_cache


def test_the_same_results_and_bytes_with_and_without_read_ahead(tmp_path, runs):
    on = open_run(runs, config(tmp_path, "on"))
    off = open_run(runs, config(tmp_path, "off", read_ahead=False))
    for _ in range(5):
        for run in (on, off):
            run.settle() if run is on else None
            run.train()
    np.testing.assert_array_equal(np.asarray(on.params["w"]), np.asarray(off.params["w"]))
    assert [m.reads_ahead for m in off.engine.metrics] == [0] * 5
    assert all(m.reads_ahead > 0 for m in on.engine.metrics)

    def subgroups_read(run: Run) -> int:
        return sum(sum(m.bytes_read.values()) for m in run.engine.metrics) // BLOB

    # the reads moved between updates, none added: the one issued after the last update is
    # counted in no update (its window closes at the next one), so at most the buffers' worth
    assert 0 <= subgroups_read(off) - subgroups_read(on) <= on.engine.plan.buffers


@pytest.mark.parametrize(
    "switches",
    [
        dict(order="alternate"),
        dict(order="alternate", retain=False),
        dict(order="ascending", write_behind=False),
        dict(order="ascending", retain=False),
    ],
    ids=["all-principles", "alternate-no-retain", "ascending-wait-writes", "ascending-no-retain"],
)
def test_matches_optax_with_each_pipeline_setting(tmp_path, runs, switches):
    run = open_run(runs, config(tmp_path, **switches))
    want = optax_run(6)
    for step in range(6):
        run.settle()
        run.train()
        np.testing.assert_allclose(np.asarray(run.params["w"]), want[step], rtol=1e-6, atol=1e-7)
    if switches.get("retain", True) and switches["order"] == "alternate":
        # every buffer holds a subgroup the next update starts with: nothing to read ahead
        assert [m.reads_ahead for m in list(run.engine.metrics)[1:]] == [0] * 5
    else:
        assert all(m.reads_ahead > 0 for m in run.engine.metrics)


def test_the_baseline_reads_nothing_ahead(tmp_path, runs):
    base = config(tmp_path, "base", delayed_conversion=False).baseline()
    assert base.read_ahead is False
    # with the baseline's fp32 gradients a read includes the gradient blob, which the next
    # backward pass has not written yet: read-ahead stays off even when asked for
    asked = dataclasses.replace(
        config(tmp_path, "asked", delayed_conversion=False).baseline(), read_ahead=True
    )
    want = optax_run(4)
    for offload in (base, asked):
        run = open_run(runs, offload)
        run.train(4)
        assert [m.reads_ahead for m in run.engine.metrics] == [0] * 4
        np.testing.assert_allclose(np.asarray(run.params["w"]), want[-1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("concurrent", [False, True], ids=["between-steps", "concurrent"])
def test_a_snapshot_with_reads_in_flight(tmp_path, runs, concurrent):
    """A checkpoint's snapshot taken while reads issued ahead are still in flight reads the
    state at its step, and training goes on exactly."""
    run = open_run(runs, config(tmp_path))
    reference = open_run(runs, config(tmp_path, "reference", read_ahead=False))
    run.train(2)
    reference.train(2)
    want = reference.engine.state_dict()
    with tier_faults(run.state) as plan:
        plan.hang("read", limit_s=10)  # the first read ahead is held in flight
        run.read_ahead_again()
        plan.wait_for(1, op="read", outcome="hung")
        threading.Timer(0.05, plan.release).start()
        snapshot = run.engine.snapshot(concurrent=concurrent)
        if concurrent:  # updates go on while the checkpoint reads the state of step 2
            run.train()
        with snapshot:
            got = {"mu": [np.zeros(N * SUB, np.float32)], "nu": [np.zeros(N * SUB, np.float32)]}
            for sg, blob in snapshot.blobs():
                gather_state(sg, blob, got)
    for name in ("mu", "nu"):
        np.testing.assert_array_equal(got[name][0], want[name][0])
    run.train(4 - run.step)
    np.testing.assert_allclose(np.asarray(run.params["w"]), optax_run(4)[-1], rtol=1e-6, atol=1e-7)


def test_a_load_drops_the_reads_of_the_state_it_replaces(tmp_path, runs):
    run = open_run(runs, config(tmp_path))
    run.train(2)
    at_two = run.engine.state_dict()
    params_two = run.params
    run.train()  # step 3; then reads of step 4's subgroups are issued ahead
    third = np.asarray(run.params["w"])
    run.settle()
    assert run.engine.pipeline.reads_ahead
    # back to step 2: the reads ahead hold step 3's state and must not be used
    run.engine.load_state_dict(2, at_two)
    run.state = with_count(run.state, jnp.asarray(2, run.state.count.dtype))
    run.params, run.step = params_two, 2
    run.train()
    np.testing.assert_array_equal(np.asarray(run.params["w"]), third)


def test_a_replan_moves_subgroups_under_read_ahead(tmp_path, runs):
    given = dict(
        limits=TierLimits(bandwidth_cap="40MB"), bandwidth=Bandwidth("40MB", "40MB"), sync=False
    )
    offload = jax_mlpo.OffloadConfig(
        host_cache=4 * BLOB,
        tiers=[jax_mlpo.FileTier(str(tmp_path / k), **given) for k in ("a", "b")],
        subgroup_size=SUB,
        prefetch_depth=1,
        order="ascending",
        write_behind=False,  # each step's I/O falls in its own window: the model sees it whole
    )
    run = open_run(runs, offload)
    assert run.engine.tier_of.count(0) == run.engine.tier_of.count(1) == N // 2
    run.engine.tiers[1].set_bandwidth_cap(1e6)  # tier b becomes 40x slower than it measured
    run.train(8)
    assert run.engine.tier_of.count(1) < N // 2, run.engine.tier_of  # subgroups moved to a
    assert sum(m.reads_ahead for m in run.engine.metrics) > 0
    np.testing.assert_allclose(np.asarray(run.params["w"]), optax_run(8)[-1], rtol=1e-6, atol=1e-7)


def test_a_failed_read_ahead_stops_the_next_update_before_it_changes_anything(tmp_path, runs):
    run = open_run(runs, config(tmp_path))
    run.train(2)
    before = run.engine.state_dict()
    params, state = run.params, run.state
    with tier_faults(run.state) as plan:
        plan.fail("read", nth=1, errno=errno.EIO)
        run.read_ahead_again()
        plan.wait_for(1, op="read", outcome="failed")
        run.settle()
        with (
            pytest.raises(
                jax_mlpo.TierIOError, match="read issued ahead of this update failed"
            ) as info,
            jax_mlpo.errors.typed(),
        ):
            run.train()
    assert "Input/output error" in str(info.value)
    assert not run.engine.failed  # nothing was updated
    after = run.engine.state_dict()
    for name in ("mu", "nu"):
        np.testing.assert_array_equal(after[name][0], before[name][0])
    # the same step again, once the tier reads: exactly optax's
    run.params, run.state = params, state
    run.train(2)
    np.testing.assert_allclose(np.asarray(run.params["w"]), optax_run(4)[-1], rtol=1e-6, atol=1e-7)


def test_a_write_behind_that_fails_during_read_ahead_fails_the_next_update(tmp_path, runs):
    run = open_run(runs, config(tmp_path, order="alternate", retain=False))
    run.train()
    with tier_faults(run.state) as plan:
        # the second update (descending) writes subgroup 0 back last
        plan.hang("write", slot=0, limit_s=10).fail("write", slot=0, errno=errno.EIO)
        run.train()  # returns with that write-back held (write-behind)
        assert run.engine.pipeline.writes
        plan.release()
        plan.wait_for(1, op="write", outcome="hung+failed")
        with (
            pytest.raises(jax_mlpo.TierIOError, match="Input/output error"),
            jax_mlpo.errors.typed(),
        ):
            run.train()
    assert run.engine.failed
    with pytest.raises(jax_mlpo.EngineFailedError):
        run.engine.snapshot()
