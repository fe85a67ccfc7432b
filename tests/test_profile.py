"""The engine's phases in a standard ``jax.profiler`` trace, beside XLA's own events.

A user profiling a training step (TensorBoard, Perfetto) sees each update, each subgroup's
read wait, AdamW kernel and release, every tier request and the read-ahead between updates.
"""

from __future__ import annotations

import concurrent.futures
import threading

import jax
import jax.numpy as jnp

import jax_mlpo

SUB, N = 4096, 8


def events(logdir) -> list[tuple[int, str]]:
    """The trace's jax_mlpo events as ``(start_ns, name)``, in time order."""
    (path,) = list(logdir.glob("**/*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(path))
    found = [
        (ev.start_ns, ev.name.split("#")[0])
        for plane in data.planes
        for line in plane.lines
        for ev in line.events
        if ev.name.startswith("jax_mlpo.")
    ]
    return sorted(found)


def settle(engine) -> None:
    """Waits until the read-ahead has issued what it can and those reads have landed."""
    while engine.idle.read_ahead.running:
        threading.Event().wait(0.001)
    for resident in list(engine.pipeline.issued.values()):
        concurrent.futures.wait(resident.reads)


def test_a_profile_shows_each_phase_of_each_update(tmp_path):
    config = jax_mlpo.OffloadConfig(
        host_cache=4 * 8 * SUB,  # 4 buffers for 8 subgroups: reads, write-backs, read-ahead
        tiers=[jax_mlpo.FileTier(str(tmp_path / "tier"), sync=False)],
        subgroup_size=SUB,
        prefetch_depth=1,
        placement="even",
        order="ascending",
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    params = {"w": jnp.linspace(-1.0, 1.0, N * SUB, dtype=jnp.float32)}
    update = jax.jit(tx.update)
    with jax_mlpo.closing(tx.init(params)) as state:
        updates, state = update(params, state, params)  # compiled outside the trace
        jax.block_until_ready(updates)
        engine = jax_mlpo.engine_of(state)
        with jax.profiler.trace(str(tmp_path / "profile")):
            for step in range(2):
                updates, state = update(params, state, params)
                jax.block_until_ready(updates)
                if step == 0:  # the forward and backward pass: the reads ahead land
                    settle(engine)
            engine.drain()
    found = events(tmp_path / "profile")
    names = [name for _, name in found]
    assert names.count("jax_mlpo.update") == 2
    for phase in ("read_wait", "adamw", "release"):
        assert names.count(f"jax_mlpo.{phase}") == 2 * N, phase
    metrics = list(engine.metrics)[-2:]
    assert names.count("jax_mlpo.tier_read") >= metrics[1].reads_ahead > 0
    assert names.count("jax_mlpo.tier_write") > 0
    # the read-ahead between the two updates, and its reads before the second one started
    second = [t for t, name in found if name == "jax_mlpo.update"][1]
    ahead = [t for t, name in found if name == "jax_mlpo.engine.read_ahead"]
    assert any(t < second for t in ahead), ahead
    assert metrics[1].reads_ahead > 0
    first_reads = [t for t, name in found if name == "jax_mlpo.tier_read" and t < second]
    assert len(first_reads) >= metrics[1].reads_ahead
