"""jax_mlpo.adamw against optax.adamw: parity across layouts, tiers, caches, dtypes and modes."""

from __future__ import annotations

import dataclasses
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from parity import (
    CASES,
    NUM_PARAMS,
    SCHEDULE,
    SHAPES,
    Case,
    assert_matches_reference,
    make_params,
    no_decay_on_vectors,
    offload_config,
    offloaded_adamw,
    run_offloaded,
)

import jax_mlpo


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parity_jit(case, dtype, tmp_path):
    params = run_offloaded(offloaded_adamw(offload_config(case, dtype, tmp_path)), dtype, "jit")
    assert_matches_reference(params, dtype)


@pytest.mark.parametrize("case", CASES[:3], ids=[c.name for c in CASES[:3]])
def test_parity_bf16_with_float32_update(case, tmp_path):
    """update_dtype=float32: the update master_new - f32(p), so apply_updates gives
    bf16(master_new) exactly (the tight bound, as before updates came in the params' dtype)."""
    tx = offloaded_adamw(offload_config(case, jnp.bfloat16, tmp_path), update_dtype=jnp.float32)
    params = run_offloaded(tx, jnp.bfloat16, "jit")
    assert_matches_reference(params, jnp.bfloat16, update_bf16=False)


def test_update_dtype_is_the_params_unless_float32_is_asked(tmp_path):
    params = make_params(jnp.bfloat16)
    grads = jax.tree.map(jnp.ones_like, params)
    for kwargs, want in [({}, jnp.bfloat16), ({"update_dtype": jnp.float32}, jnp.float32)]:
        tx = offloaded_adamw(offload_config(CASES[5], jnp.bfloat16, tmp_path), **kwargs)
        state = tx.init(params)
        updates, state = jax.jit(tx.update)(grads, state, params)
        assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(want)}
        jax_mlpo.close(state)
    with pytest.raises(ValueError, match="update_dtype must be None"):
        jax_mlpo.adamw(1e-3, offload=offload_config(CASES[5], jnp.float32, tmp_path),
                       update_dtype=jnp.bfloat16)  # fmt: skip


SWITCHES = [
    dict(placement=placement, order=order, retain=retain, delayed_conversion=delayed)
    for placement in ("measured", "first")
    for order in ("alternate", "ascending")
    for retain in (True, False)
    for delayed in (True, False)
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "switches", SWITCHES, ids=["-".join(str(v) for v in sw.values()) for sw in SWITCHES]
)
def test_parity_every_policy_switch(switches, dtype, tmp_path):
    """MLP-Offload's principles change where state is and when it moves, never the math."""
    config = offload_config(CASES[2], dtype, tmp_path, **switches)
    if not switches["delayed_conversion"]:  # room for the fp32 gradient buffers too
        config = dataclasses.replace(config, host_cache=2 * config.host_cache)
    assert_matches_reference(run_offloaded(offloaded_adamw(config), dtype, "jit"), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["eager", "nnx"])
def test_parity_eager_and_nnx(mode, dtype, tmp_path):
    case = CASES[2]
    params = run_offloaded(offloaded_adamw(offload_config(case, dtype, tmp_path)), dtype, mode)
    assert_matches_reference(params, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=[CASES[0].name, CASES[2].name])
def test_parity_max_grad_norm(case, dtype, tmp_path):
    """Clipping inside the update is optax.chain(clip_by_global_norm, adamw): to float32
    rounding for fp32 gradients; for bf16 ones, the chain with the clipping in float32."""
    tx = jax_mlpo.adamw(
        SCHEDULE,
        weight_decay=0.1,
        mask=no_decay_on_vectors,
        offload=offload_config(case, dtype, tmp_path),
        max_grad_norm=1.0,
    )
    assert_matches_reference(run_offloaded(tx, dtype, "jit"), dtype, clip_in_float32=True)


def test_max_grad_norm_above_the_norm_changes_nothing(tmp_path):
    """loss_fn's gradients have norms of ~1e3-1e4: a larger limit never clips."""
    config = offload_config(CASES[0], jnp.float32, tmp_path)
    kwargs = dict(weight_decay=0.1, mask=no_decay_on_vectors, offload=config)
    got = run_offloaded(jax_mlpo.adamw(SCHEDULE, **kwargs, max_grad_norm=1e30), jnp.float32, "jit")
    want = run_offloaded(jax_mlpo.adamw(SCHEDULE, **kwargs), jnp.float32, "jit")
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_max_grad_norm_must_be_positive(bad, tmp_path):
    config = offload_config(CASES[0], jnp.float32, tmp_path)
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        jax_mlpo.adamw(1e-3, offload=config, max_grad_norm=bad)


@pytest.mark.parametrize(
    "dtype,moments,per_param",
    [
        (jnp.float32, (None, None), 8),
        (jnp.bfloat16, (None, None), 12),
        (jnp.float32, (jnp.bfloat16, None), 6),
        (jnp.float32, (jnp.bfloat16, jnp.bfloat16), 4),
        (jnp.bfloat16, (jnp.bfloat16, jnp.bfloat16), 8),
    ],
    ids=["fp32", "bf16", "fp32-mu_bf16", "fp32-moments_bf16", "bf16-moments_bf16"],
)
def test_state_is_off_the_accelerator(dtype, moments, per_param, tmp_path):
    """The tiers hold p (bf16 params' master), m and v at their widths: 4 + 4 + 4 bytes per
    param at most, 2 for a bfloat16 moment."""
    config = offload_config(Case("x", 131_072, 2, "none"), dtype, tmp_path)
    config = dataclasses.replace(config, host_cache=6 * per_param * 131_072)  # the pipeline's
    tx = offloaded_adamw(config, mu_dtype=moments[0], nu_dtype=moments[1])
    state = tx.init(make_params(dtype))
    assert sum(x.nbytes for x in jax.tree.leaves(state)) < 1024
    blobs = list(tmp_path.glob("tier*/state-*.blob"))
    # each blob file's trailer records the bytes of state it holds (then padding, checksums)
    held = [struct.unpack_from("<8sQ", p.read_bytes(), -4096)[1] for p in blobs]
    assert sum(held) == per_param * NUM_PARAMS
    assert sum(p.stat().st_size for p in blobs) <= per_param * NUM_PARAMS + 8192 * len(blobs)
    jax_mlpo.close(state)


def test_jitted_update_does_not_recompile(tmp_path):
    tx = offloaded_adamw(offload_config(CASES[0], jnp.float32, tmp_path))
    params = make_params(jnp.float32)
    state = tx.init(params)
    update = jax.jit(tx.update)
    grads = jax.tree.map(jnp.ones_like, params)
    _, state = update(grads, state, params)
    before = update._cache_size()
    for _ in range(3):
        _, state = update(grads, state, params)
    assert update._cache_size() == before
    jax_mlpo.close(state)


def test_multisteps_is_refused(tmp_path):
    tx = optax.MultiSteps(offloaded_adamw(offload_config(CASES[5], jnp.float32, tmp_path)), 4)
    with pytest.raises(ValueError, match="cannot be wrapped in optax.MultiSteps"):
        tx.init(make_params(jnp.float32))


def test_discarded_update_is_detected(tmp_path):
    tx = offloaded_adamw(offload_config(CASES[0], jnp.float32, tmp_path))
    params = make_params(jnp.float32)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    tx.update(grads, state, params)  # result discarded, as a misbehaving wrapper would
    with (
        pytest.raises(jax_mlpo.StaleStateError, match="offloaded state is at step 1"),
        jax_mlpo.errors.typed(),
    ):
        jax.block_until_ready(tx.update(grads, state, params))
    jax_mlpo.close(state)


def test_update_requires_params(tmp_path):
    tx = offloaded_adamw(offload_config(CASES[5], jnp.float32, tmp_path))
    params = make_params(jnp.float32)
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, state)
    jax_mlpo.close(state)


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "gradient-round-trip"])
def test_cache_hits_use_this_steps_gradients(delayed, tmp_path):
    """Subgroups updated from host buffers (retained or still cached) get this step's gradient,
    also on the baseline gradient path, whose fp32 gradient buffers hold an older one."""
    n, size = 32_000, 1000
    per_buffer = 4 * (2 * size + (0 if delayed else size))
    config = jax_mlpo.OffloadConfig(
        host_cache=10 * per_buffer,
        tiers=[jax_mlpo.FileTier(str(tmp_path / "t"), sync=False)],
        subgroup_size=size,
        retain=True,
        delayed_conversion=delayed,
        placement="first",
    )
    tx, ref = jax_mlpo.adamw(1e-2, offload=config), optax.adamw(1e-2)
    params = {"w": jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)}
    state, ref_state = tx.init(params), ref.init(params)
    update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
    got = want = params
    for step in range(6):
        grads = {"w": jax.random.normal(jax.random.PRNGKey(step), (n,))}
        updates, state = update(grads, state, got)
        got = optax.apply_updates(got, updates)
        ref_updates, ref_state = ref_update(grads, ref_state, want)
        want = optax.apply_updates(want, ref_updates)
    hits = [m.cache_hits for m in jax_mlpo.engine_of(state).metrics]
    jax_mlpo.close(state)
    assert min(hits[1:]) > 0, hits
    err = np.max(np.abs(np.asarray(got["w"]) - np.asarray(want["w"])))
    assert err <= 1e-6, err


def test_apply_if_finite_skips_the_host_update(tmp_path):
    """optax.apply_if_finite runs the update inside lax.cond: a non-finite gradient takes the
    other branch, so the host state does not advance, and the next finite update goes on."""
    params = make_params(jnp.float32)
    inner = jax_mlpo.adamw(1e-2, offload=offload_config(CASES[0], jnp.float32, tmp_path))
    tx = optax.apply_if_finite(inner, max_consecutive_errors=5)
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    update = jax.jit(tx.update)
    good = jax.tree.map(jnp.ones_like, params)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan) if g.ndim == 1 else g * jnp.nan, good)
    steps = []
    for grads in (good, bad, bad, good):
        updates, state = update(grads, state, params)
        jax.block_until_ready(updates)
        steps.append(engine.step_count)
    assert steps == [1, 1, 1, 2]
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 2
    jax_mlpo.close(state)
