"""What each update order moves per step, counted from the tiers' bytes in the step metrics.

A state four times the host cache on one file tier: the alternating order (the plain step's),
the forward pass's order (an update beside the forward pass), and the forward order alternating
its direction every step. Counts, never times: each step's bytes (its own and the write-backs and
reads ahead until the next update starts) against the retention module's count, and the
forward order's reads inside the update against the alternating order's.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_mlpo
from jax_mlpo.engine import retention
from jax_mlpo.engine.step_metrics import StepMetrics

SUBGROUP = 4096
SUBGROUPS = 24
BUFFERS = 6
STEPS = 6
LR, WD = 1e-3, 0.1


def make_params() -> dict[str, jax.Array]:
    return {"w": jnp.linspace(-1.0, 1.0, SUBGROUPS * SUBGROUP, dtype=jnp.float32)}


def grads_for(params: dict[str, jax.Array], step: int) -> dict[str, jax.Array]:
    return {"w": jnp.cos(params["w"] * (step + 1))}


def run(tmp_path, policy: str):
    """``STEPS`` updates in ``policy``'s order: the engine, its params after each step."""
    blob = 8 * SUBGROUP  # fp32 params: the blob holds m | v
    config = jax_mlpo.OffloadConfig(
        host_cache=BUFFERS * blob,
        tiers=[jax_mlpo.FileTier(str(tmp_path / policy), sync=False)],
        subgroup_size=SUBGROUP,
        prefetch_depth=1,
        placement="even",
        order="alternate",
        # what updates beside the forward pass do: pinned, not measured
        overlap_order="alternate" if policy == "forward, alternating" else "forward",
    )
    tx = jax_mlpo.adamw(LR, weight_decay=WD, offload=config)
    params = make_params()
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    if policy != "alternate":
        # what an update beside the forward pass does (transforms/overlap.py), here in one call
        engine.order.follow(list(range(SUBGROUPS)))
    update = jax.jit(tx.update)
    out = []
    for step in range(STEPS):
        updates, state = update(grads_for(params, step), state, params)
        params = optax.apply_updates(params, updates)
        out.append(np.asarray(params["w"]))
        settle(engine)
    return engine, state, out


def settle(engine) -> None:
    """Waits, as a forward and backward pass would, until the write-backs the update left behind
    have landed and the reads issued ahead of the next one are done."""
    while engine.idle.read_ahead.running:
        threading.Event().wait(0.001)
    for resident in engine.pipeline.issued.values():
        for future in resident.reads:
            future.exception()  # waits


def optax_run() -> list[np.ndarray]:
    tx = optax.adamw(LR, weight_decay=WD)
    params = make_params()
    state = tx.init(params)
    out = []
    for step in range(STEPS):
        updates, state = tx.update(grads_for(params, step), state, params)
        params = optax.apply_updates(params, updates)
        out.append(np.asarray(params["w"]))
    return out


def steady_steps(engine) -> list:
    """The steps whose window the next update closed, after the first (which read everything)."""
    return list(engine.metrics)[1:-1]


@pytest.mark.parametrize("policy", ["alternate", "forward", "forward, alternating"])
def test_bytes_per_step_are_the_counted_ones(tmp_path, policy):
    engine, state, params = run(tmp_path, policy)
    plan = engine.plan
    blob = engine.layout.state_bytes // SUBGROUPS
    assert plan.buffers == BUFFERS and 4 * plan.buffers <= SUBGROUPS  # four times the cache
    # the forward order keeps what the pipeline leaves; the alternating order every buffer
    retained = plan.buffers - plan.minimum if policy == "forward" else plan.buffers
    moved = retention.moved_per_step(SUBGROUPS, plan.buffers, retained)
    for m in steady_steps(engine):
        assert sum(m.bytes_read.values()) == moved * blob, (m.step, m.bytes_read)
        assert sum(m.bytes_written.values()) == moved * blob, (m.step, m.bytes_written)
    # and the results are optax's, whatever the order
    for got, want in zip(params, optax_run(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    jax_mlpo.close(state)


def test_the_forward_order_reads_inside_the_update_what_the_alternating_order_reads(tmp_path):
    """The forward order's extra reads are the ones issued ahead, between updates: inside the
    update it reads ``subgroups - buffers``, as the alternating order does."""
    forward, f_state, _ = run(tmp_path, "forward")
    alternate, a_state, _ = run(tmp_path, "alternate")
    plan = forward.plan
    for f, a in zip(steady_steps(forward), steady_steps(alternate), strict=True):
        assert f.reads_ahead == plan.minimum  # the pipeline's buffers, free between updates
        assert f.cache_hits == plan.buffers - plan.minimum
        assert a.cache_hits == plan.buffers and a.reads_ahead == 0
        inside = f.subgroups - f.cache_hits - f.reads_ahead
        assert inside == a.subgroups - a.cache_hits - a.reads_ahead == SUBGROUPS - plan.buffers
    # the forward order moves the pipeline's buffers more each way: no fixed order can retain
    # a subgroup for less than a whole cycle
    f_moved = sum(steady_steps(forward)[0].bytes_read.values())
    a_moved = sum(steady_steps(alternate)[0].bytes_read.values())
    blob = forward.layout.state_bytes // SUBGROUPS
    assert f_moved - a_moved == plan.minimum * blob
    jax_mlpo.close(f_state)
    jax_mlpo.close(a_state)


def test_alternating_beside_the_forward_pass_reverses_every_other_update():
    order = retention.UpdateOrder(5, "alternate")
    order.follow([2, 0, 1, 4, 3])
    assert order.of_step(0) == order.of_step(1) == [2, 0, 1, 4, 3]
    order.pin(alternating=True)
    assert order.of_step(0) == [2, 0, 1, 4, 3] and order.of_step(1) == [3, 4, 1, 0, 2]
    assert order.runs_forward(2) and not order.runs_forward(3)
    # it keeps what the next update, the other way, starts with
    assert order.keep(order.of_step(0), [0] * 5, [2], spare_buffers=1) == {4, 3}
    # under a fixed policy it never alternates
    assert not retention.UpdateOrder(5, "ascending").may_alternate


@pytest.mark.parametrize(
    ("subgroups", "buffers", "retained", "moved"),
    [(24, 6, 6, 18), (24, 6, 3, 21), (4, 6, 6, 0), (12, 4, 1, 11)],
)
def test_moved_per_step(subgroups, buffers, retained, moved):
    assert retention.moved_per_step(subgroups, buffers, retained) == moved


def test_the_forward_order_alternates_only_where_its_extra_io_costs_more_than_half_the_overlap():
    # fits in the window: the forward order costs nothing
    assert not retention.alternate_beside_forward(window_s=0.5, extra_io_s=0.3, beside_s=0.0)
    # 0.2 s past the window against 0.3 s of the 0.6 s overlap lost by alternating
    assert not retention.alternate_beside_forward(window_s=0.5, extra_io_s=0.7, beside_s=0.6)
    assert retention.alternate_beside_forward(window_s=0.5, extra_io_s=0.9, beside_s=0.6)


def test_the_engine_alternates_from_what_it_measures_between_updates():
    """Windows and tier rates fed as the engine measures them: 24 subgroups of 1 MB, the
    alternating policy keeping 6, the forward order 3 (3 more each way: 6 MB of tier I/O)."""
    order = retention.UpdateOrder(24, "alternate")
    order.follow(list(range(24)))

    def after(window_s: float, rate: float, beside_s: float) -> bool:
        """One update in the forward order, then ``window_s`` until the next one starts."""
        moved = 30e6  # the last step's bytes, moved in moved / rate seconds of tier time
        last = StepMetrics(step=1, bytes_read={"t": moved / 2}, bytes_written={"t": moved / 2},
                           tier_busy_s={"t": moved / rate}, beside_s=beside_s)  # fmt: skip
        order.ended(0, now=100.0)
        order.measure(100.0 + window_s, last, [6], spare_buffers=3, blob_bytes=1e6)
        return order.alternating

    for _ in range(3):
        assert not after(window_s=1.0, rate=10e6, beside_s=1.0)  # 0.6 s fits in the window
    # 6 s of I/O in a 1 s window: 5 s past it against 0.5 s of the overlap alternating loses;
    # the median of the last five decides, so two such steps change nothing, a third does
    assert not after(window_s=1.0, rate=1e6, beside_s=1.0)
    assert not after(window_s=1.0, rate=1e6, beside_s=1.0)
    assert after(window_s=1.0, rate=1e6, beside_s=1.0)
    # after an update in the reverse order nothing is measured
    order.ended(1, now=200.0)
    order.measure(200.0, StepMetrics(step=2), [6], spare_buffers=3, blob_bytes=1e6)
    assert order.alternating
    # pinned: the measurements change nothing
    order.pin(alternating=False)
    assert not after(window_s=1.0, rate=1e6, beside_s=1.0)
