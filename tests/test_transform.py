"""jax_mlpo.adamw against optax.adamw: parity across layouts, tiers, caches, dtypes and modes."""

from __future__ import annotations

import dataclasses
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_mlpo

STEPS = 50
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 10, STEPS, 3e-3)
# Leaf sizes 1_000_003, 1 and 22, in tree order: w spans subgroups, norm is split by 500_005.
SHAPES = {"a_w": (1, 1_000_003), "b_bias": (1,), "c_norm": (22,)}
NUM_PARAMS = sum(int(np.prod(s)) for s in SHAPES.values())


def no_decay_on_vectors(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def make_params(dtype) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), len(SHAPES))
    return {
        k: (jax.random.normal(key, shape) * 0.5).astype(dtype)
        for key, (k, shape) in zip(keys, SHAPES.items(), strict=True)
    }


def loss_fn(params, step):
    """A linear loss whose gradient differs per element and per step.

    Its gradient does not depend on the params, so a one-ulp difference in a bf16 param cannot
    feed back into later gradients and grow: the comparison measures the optimizer alone. (Under
    a chaotic loss such as sum(sin(3x)) optax.adamw itself drifts by ~5e-6 relative in 50 steps
    between two ways XLA fuses the same jitted step.)
    """
    total = 0.0
    for i, x in enumerate(jax.tree.leaves(params)):
        key = jax.random.fold_in(jax.random.PRNGKey(i), step)
        target = jax.random.normal(key, x.shape)
        scale = jnp.exp(2.0 * jnp.roll(target, 1))  # gradient magnitudes over ~3 decades
        total += jnp.sum(x.astype(jnp.float32) * scale * target)
    return total


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    subgroup_size: int
    tiers: int
    cache: str  # "none": pipeline buffers only, "part": some subgroups resident, "all"
    prefetch_depth: int = 2


CASES = [
    Case("split-1tier-nocache", 500_005, 1, "none"),
    Case("split-3tiers-nocache", 131_072, 3, "none"),
    Case("split-3tiers-partcache", 131_072, 3, "part"),
    Case("split-1tier-sync", 300_007, 1, "none", prefetch_depth=0),
    Case("bigger-than-model-1tier", 2_000_000, 1, "none"),
    Case("split-allcache", 500_005, 0, "all"),
]


def offload_config(case: Case, dtype, tmp_path, **switches) -> jax_mlpo.OffloadConfig:
    per_elem = 12 if dtype == jnp.bfloat16 else 8
    blob = per_elem * min(case.subgroup_size, NUM_PARAMS)
    pipeline = (case.prefetch_depth * max(case.tiers, 1) + 2) * blob
    cache = {
        "none": pipeline,
        "part": pipeline + 2 * blob,
        "all": per_elem * NUM_PARAMS,
    }[case.cache]
    tiers = [jax_mlpo.FileTier(str(tmp_path / f"tier{i}")) for i in range(case.tiers)]
    return jax_mlpo.OffloadConfig(
        host_cache=cache,
        tiers=tiers,
        subgroup_size=case.subgroup_size,
        prefetch_depth=case.prefetch_depth,
        **switches,
    )


def chain(inner):
    return optax.chain(optax.clip_by_global_norm(1.0), inner)


def reference_adamw():
    return chain(optax.adamw(SCHEDULE, weight_decay=0.1, mask=no_decay_on_vectors))


def offloaded_adamw(config, **kwargs):
    return chain(
        jax_mlpo.adamw(
            SCHEDULE, weight_decay=0.1, mask=no_decay_on_vectors, offload=config, **kwargs
        )
    )


def run_reference(dtype, clip_in_float32: bool = False, mu_dtype=None):
    """optax.adamw on an fp32 master copy; bf16 params are the master rounded to bf16.

    ``clip_in_float32``: the gradients are cast to float32 before clipping (the same for fp32).

    Returns:
      The params, the magnitude of the last step's fp32 update per element, and optax's first
      moment (in ``mu_dtype``).
    """
    master = jax.tree.map(lambda x: x.astype(jnp.float32), make_params(dtype))
    clipping, adam = (
        optax.clip_by_global_norm(1.0),
        optax.adamw(SCHEDULE, weight_decay=0.1, mask=no_decay_on_vectors, mu_dtype=mu_dtype),
    )
    clip_state, adam_state = clipping.init(master), adam.init(master)

    @jax.jit
    def step(master, clip_state, adam_state, i):
        params = jax.tree.map(lambda x: x.astype(dtype), master)
        grads = jax.grad(loss_fn)(params, i)  # in the params' dtype, as the model gives them
        if clip_in_float32:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        grads, clip_state = clipping.update(grads, clip_state)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, adam_state = adam.update(grads, adam_state, master)
        return updates, clip_state, adam_state

    # apply_updates in its own jit, as it is for the offloaded optimizer (whose update comes
    # from the host): fused into the step, XLA would contract p + lr * u into an fma.
    apply = jax.jit(optax.apply_updates)

    for i in range(STEPS):
        updates, clip_state, adam_state = step(master, clip_state, adam_state, i)
        master = apply(master, updates)
    params = jax.tree.map(lambda x: x.astype(dtype), master)
    return params, jax.tree.map(jnp.abs, updates), adam_state[0].mu


_REFERENCE_CACHE: dict = {}


def reference(dtype, clip_in_float32: bool = False, mu_dtype=None):
    key = (jnp.dtype(dtype).name, clip_in_float32, None if mu_dtype is None else str(mu_dtype))
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = jax.device_get(run_reference(dtype, clip_in_float32, mu_dtype))
    return _REFERENCE_CACHE[key]


def run_offloaded(tx, dtype, mode, before_close=None):
    """Trains STEPS steps; ``before_close(opt_state)`` sees the state before it is closed."""
    params = make_params(dtype)
    if mode == "nnx":
        model = nnx.Dict({k: nnx.Param(v) for k, v in params.items()})
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def nnx_step(model, optimizer, i):
            def loss(m):
                return loss_fn({k: m[k][...] for k in SHAPES}, i)

            grads = nnx.grad(loss)(model)
            optimizer.update(model, grads)

        for i in range(STEPS):
            nnx_step(model, optimizer, i)
        if before_close is not None:
            before_close(optimizer.opt_state)
        jax_mlpo.close(optimizer.opt_state)
        return {k: model[k][...] for k in SHAPES}

    state = tx.init(params)

    def step(params, state, i):
        grads = jax.grad(loss_fn)(params, i)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if mode == "jit":
        step = jax.jit(step)
    for i in range(STEPS):
        params, state = step(params, state, i)
    if before_close is not None:
        before_close(state)
    jax_mlpo.close(state)
    return params


def bf16_ulp(x):
    """One bfloat16 ulp at |x|: 2**(exponent - 7)."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(x), 1e-30))) - 7)


def assert_matches_reference(
    params, dtype, clip_in_float32: bool = False, update_bf16=None, mu_dtype=None
):
    """Parity with optax; ``update_bf16``: the update was returned in bfloat16 (the default for
    bfloat16 params), which is rounded once, so ``apply_updates`` may land up to one bfloat16
    ulp of the last step's size away from bf16(master) where Sterbenz does not make it exact
    (a value crossing zero, or changing by more than 2x)."""
    update_bf16 = dtype == jnp.bfloat16 if update_bf16 is None else update_bf16
    ref, last_step, _ = reference(dtype, clip_in_float32, mu_dtype)
    for k in SHAPES:
        got, want = np.asarray(params[k]), np.asarray(ref[k])
        assert got.dtype == want.dtype, k
        if dtype == jnp.float32:
            err = np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want)))
            assert err <= 1e-6, f"{k}: max relative error {err:.3g} > 1e-6"
        else:
            g32, w32 = got.astype(np.float32), want.astype(np.float32)
            differ = g32 != w32
            # 1 ulp of bf16 at |x| is 2**(exponent - 7). Where a master value crosses zero, the
            # bf16 value shows the fp32 master's own rounding (float32 parity, 1e-6 absolute at
            # |p| <= 1), so the allowance is the larger of the two.
            allowed = np.maximum(bf16_ulp(w32), 1e-6 * np.maximum(1.0, np.abs(w32)))
            if update_bf16:
                allowed = np.maximum(allowed, bf16_ulp(np.asarray(last_step[k], np.float32)))
            worst = np.max((np.abs(g32 - w32) / allowed)[differ], initial=0.0)
            assert worst <= 1.0, f"{k}: an element differs by {worst:.3g} x the allowance"
            assert differ.mean() <= 1e-3, f"{k}: {differ.mean():.3%} of elements differ"


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
    with pytest.raises(Exception, match="offloaded state is at step 1"):
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
