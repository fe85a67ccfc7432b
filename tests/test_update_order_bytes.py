"""What each update order moves per step, counted from the tiers' bytes in the step metrics.

A state four times the host cache on one file tier: the alternating order (the plain step's),
the forward pass's order (an update beside the forward pass: what the last update kept first),
and the forward order alternating its direction every step. Counts, never times: each step's
bytes (its own and the write-backs and reads ahead until the next update starts) against the
retention module's count, and the forward order's hits and reads against the alternating
order's.
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
    # every order keeps every buffer: S - B each way
    moved = retention.moved_per_step(SUBGROUPS, plan.buffers, plan.buffers)
    for m in steady_steps(engine):
        assert sum(m.bytes_read.values()) == moved * blob, (m.step, m.bytes_read)
        assert sum(m.bytes_written.values()) == moved * blob, (m.step, m.bytes_written)
    # and the results are optax's, whatever the order
    for got, want in zip(params, optax_run(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    jax_mlpo.close(state)


def test_the_forward_order_hits_what_the_alternating_order_hits(tmp_path):
    """Both start an update with every buffer's subgroup and read nothing ahead: no buffer is
    free between updates, and each keeps one subgroup per buffer."""
    forward, f_state, f_params = run(tmp_path, "forward")
    alternate, a_state, a_params = run(tmp_path, "alternate")
    plan = forward.plan
    for f, a in zip(steady_steps(forward), steady_steps(alternate), strict=True):
        assert f.cache_hits == a.cache_hits == plan.buffers
        assert f.reads_ahead == a.reads_ahead == 0
        assert f.subgroups - f.cache_hits == a.subgroups - a.cache_hits == SUBGROUPS - BUFFERS
    for f, a in zip(f_params, a_params, strict=True):
        np.testing.assert_array_equal(f, a)  # the order changes no bit
    jax_mlpo.close(f_state)
    jax_mlpo.close(a_state)


def test_the_forward_order_updates_what_it_kept_first():
    """The first subgroups of the forward order stay for good, the pipeline's buffers keep the
    last ones each update ran, and the next update starts with all of them."""
    order = retention.UpdateOrder(8, "alternate")
    order.follow([2, 0, 1, 4, 3, 7, 5, 6])
    assert order.of_step(0) == [2, 0, 1, 4, 3, 7, 5, 6]  # nothing kept yet
    # 4 retained on one tier, 2 beyond the pipeline's buffers: 2 and 0 for good, the last two
    kept = order.keep(order.of_step(0), [0] * 8, [4], spare_buffers=2)
    assert kept == {2, 0, 5, 6}
    assert order.of_step(1) == [2, 0, 5, 6, 1, 4, 3, 7]
    assert order.keep(order.of_step(1), [0] * 8, [4], spare_buffers=2) == {2, 0, 3, 7}
    assert order.of_step(2) == [2, 0, 3, 7, 1, 4, 5, 6]
    # per tier: the last ones of each tier's own count
    order = retention.UpdateOrder(6, "alternate")
    order.follow(list(range(6)))
    assert order.keep(list(range(6)), [0, 1, 0, 1, 0, 1], [2, 1], spare_buffers=1) == {0, 4, 5}


def test_alternating_beside_the_forward_pass_reverses_every_other_update():
    order = retention.UpdateOrder(5, "alternate", alternating=True)
    order.follow([2, 0, 1, 4, 3])
    assert order.of_step(0) == [2, 0, 1, 4, 3] and order.of_step(1) == [3, 4, 1, 0, 2]
    # it keeps what the next update, the other way, starts with
    assert order.keep(order.of_step(0), [0] * 5, [2], spare_buffers=1) == {4, 3}


@pytest.mark.parametrize(
    ("subgroups", "buffers", "retained", "moved"),
    [(24, 6, 6, 18), (24, 6, 3, 21), (4, 6, 6, 0), (12, 4, 1, 11)],
)
def test_moved_per_step(subgroups, buffers, retained, moved):
    assert retention.moved_per_step(subgroups, buffers, retained) == moved
