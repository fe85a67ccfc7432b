"""The optax-parity problem shared by the parity tests and their worker scripts.

The params (``SHAPES``, or the ``shapes`` a caller passes: a worker on a mesh needs leaves that
split over its devices), a loss whose gradients do not depend on the params, the layouts
(``CASES``) the offloaded optimizer is run in, optax's run on an fp32 master copy as the
reference, and the comparison with its tolerances.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_mlpo

STEPS = 50
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 10, STEPS, 3e-3)
# Leaf sizes 1_000_003, 1 and 22, in tree order: w spans subgroups, norm is split by 500_005.
SHAPES = {"a_w": (1, 1_000_003), "b_bias": (1,), "c_norm": (22,)}
NUM_PARAMS = sum(int(np.prod(s)) for s in SHAPES.values())


def no_decay_on_vectors(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def make_params(dtype, shapes: dict | None = None) -> dict:
    shapes = SHAPES if shapes is None else shapes
    keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
    return {
        k: (jax.random.normal(key, shape) * 0.5).astype(dtype)
        for key, (k, shape) in zip(keys, shapes.items(), strict=True)
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
        total += jnp.sum(x.astype(jnp.float32) * _step_gradient(i, x.shape, step))
    return total


def _step_gradient(leaf: int, shape, step) -> jax.Array:
    """``loss_fn``'s float32 gradient of leaf number ``leaf`` (in tree order) at ``step``."""
    key = jax.random.fold_in(jax.random.PRNGKey(leaf), step)
    target = jax.random.normal(key, shape)
    scale = jnp.exp(2.0 * jnp.roll(target, 1))  # gradient magnitudes over ~3 decades
    return scale * target


def linear_loss(params, gradients):
    """The loss whose gradient is ``gradients`` (float32, cast to each param's dtype)."""
    return sum(
        jnp.sum(x.astype(jnp.float32) * g)
        for x, g in zip(*map(jax.tree.leaves, (params, gradients)), strict=True)
    )


_GRADIENT_CACHE: dict = {}


def step_gradients(shapes: dict | None = None, steps: int = STEPS) -> list[dict]:
    """``loss_fn``'s float32 gradients for each of ``steps`` steps, computed once a process.

    Bit for bit what ``jax.grad(loss_fn)`` gives inside a step, eager or jitted (the product
    is the same one multiply); its threefry normals cost most of a parity step when the step
    computed them itself, for every run of every test. 200 MB for :data:`SHAPES`.
    """
    shapes = SHAPES if shapes is None else shapes
    key = (tuple(shapes.items()), steps)
    if key not in _GRADIENT_CACHE:
        at = jax.jit(
            lambda step: {
                k: _step_gradient(i, shapes[k], step) for i, k in enumerate(sorted(shapes))
            }
        )
        _GRADIENT_CACHE[key] = [at(step) for step in range(steps)]
    return _GRADIENT_CACHE[key]


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


def offload_config(
    case: Case, dtype, tmp_path, moments: int = 2, **switches
) -> jax_mlpo.OffloadConfig:
    """``case``'s config for an optimizer with ``moments`` float32 moments (AdamW 2, Lion 1)."""
    per_elem = 4 * moments + (4 if dtype == jnp.bfloat16 else 0)
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


def optax_optimizer(name: str, mu_dtype=None):
    """optax's optimizer ``name`` (adamw, lion, muon) with the parity problem's settings."""
    if name == "muon":
        return optax.contrib.muon(
            SCHEDULE, weight_decay=0.1, weight_decay_mask=no_decay_on_vectors, mu_dtype=mu_dtype
        )
    factory = {"adamw": optax.adamw, "lion": optax.lion}[name]
    return factory(SCHEDULE, weight_decay=0.1, mask=no_decay_on_vectors, mu_dtype=mu_dtype)


def offloaded_adamw(config, **kwargs):
    return chain(
        jax_mlpo.adamw(
            SCHEDULE, weight_decay=0.1, mask=no_decay_on_vectors, offload=config, **kwargs
        )
    )


def run_reference(
    dtype, clip_in_float32: bool = False, mu_dtype=None, shapes=None, optimizer: str = "adamw",
    steps: int = STEPS,
):  # fmt: skip
    """optax's ``optimizer`` (adamw, lion) on an fp32 master copy; bf16 params are the master
    rounded to bf16.

    ``clip_in_float32``: the gradients are cast to float32 before clipping (the same for fp32).

    Returns:
      The params, the magnitude of the last step's fp32 update per element, and optax's first
      moment (in ``mu_dtype``).
    """
    master = jax.tree.map(lambda x: x.astype(jnp.float32), make_params(dtype, shapes))
    clipping, adam = optax.clip_by_global_norm(1.0), optax_optimizer(optimizer, mu_dtype)
    clip_state, adam_state = clipping.init(master), adam.init(master)

    @jax.jit
    def step(master, clip_state, adam_state, gradients):
        params = jax.tree.map(lambda x: x.astype(dtype), master)
        grads = jax.grad(linear_loss)(params, gradients)  # in the params' dtype, as a model's
        if clip_in_float32:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        grads, clip_state = clipping.update(grads, clip_state)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, adam_state = adam.update(grads, adam_state, master)
        return updates, clip_state, adam_state

    # apply_updates in its own jit, as it is for the offloaded optimizer (whose update comes
    # from the host): fused into the step, XLA would contract p + lr * u into an fma.
    apply = jax.jit(optax.apply_updates)

    for gradients in step_gradients(shapes, steps):
        updates, clip_state, adam_state = step(master, clip_state, adam_state, gradients)
        master = apply(master, updates)
    params = jax.tree.map(lambda x: x.astype(dtype), master)
    mu = None if optimizer == "muon" else adam_state[0].mu
    return params, jax.tree.map(jnp.abs, updates), mu


_REFERENCE_CACHE: dict = {}


def reference(
    dtype, clip_in_float32: bool = False, mu_dtype=None, shapes=None, optimizer: str = "adamw",
    steps: int = STEPS,
):  # fmt: skip
    key = (jnp.dtype(dtype).name, clip_in_float32, None if mu_dtype is None else str(mu_dtype),
           None if shapes is None else tuple(shapes.items()), optimizer, steps)  # fmt: skip
    if key not in _REFERENCE_CACHE:
        ran = run_reference(dtype, clip_in_float32, mu_dtype, shapes, optimizer, steps)
        _REFERENCE_CACHE[key] = jax.device_get(ran)
    return _REFERENCE_CACHE[key]


def run_offloaded(
    tx, dtype, mode, before_close=None, offloaded: bool = True, shapes=None, steps: int = STEPS
):
    """Trains ``steps`` steps on :data:`SHAPES` (or ``shapes``); ``before_close(opt_state)`` sees
    the state before it is closed (``offloaded``: ``tx`` is jax_mlpo's; False runs an optax one
    the same way)."""
    shapes = SHAPES if shapes is None else shapes
    params = make_params(dtype, shapes)
    if mode == "nnx":
        model = nnx.Dict({k: nnx.Param(v) for k, v in params.items()})
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def nnx_step(model, optimizer, gradients):
            def loss(m):
                return linear_loss({k: m[k][...] for k in shapes}, gradients)

            grads = nnx.grad(loss)(model)
            optimizer.update(model, grads)

        for gradients in step_gradients(shapes, steps):
            nnx_step(model, optimizer, gradients)
        if before_close is not None:
            before_close(optimizer.opt_state)
        if offloaded:
            jax_mlpo.close(optimizer.opt_state)
        return {k: model[k][...] for k in shapes}

    state = tx.init(params)

    def step(params, state, gradients):
        grads = jax.grad(linear_loss)(params, gradients)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if mode == "jit":
        step = jax.jit(step)
    for gradients in step_gradients(shapes, steps):
        params, state = step(params, state, gradients)
    if before_close is not None:
        before_close(state)
    if offloaded:
        jax_mlpo.close(state)
    return params


def bf16_ulp(x):
    """One bfloat16 ulp at |x|: 2**(exponent - 7)."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(x), 1e-30))) - 7)


def assert_matches_reference(
    params, dtype, clip_in_float32: bool = False, update_bf16=None, mu_dtype=None, shapes=None,
    optimizer: str = "adamw", max_differ: float = 1e-3, steps: int = STEPS,
):  # fmt: skip
    """Parity with optax; ``update_bf16``: the update was returned in bfloat16 (the default for
    bfloat16 params), which is rounded once, so ``apply_updates`` may land up to one bfloat16
    ulp of the last step's size away from bf16(master) where Sterbenz does not make it exact
    (a value crossing zero, or changing by more than 2x); ``max_differ``: the fraction of bf16
    elements that may differ so."""
    update_bf16 = dtype == jnp.bfloat16 if update_bf16 is None else update_bf16
    ref, last_step, _ = reference(dtype, clip_in_float32, mu_dtype, shapes, optimizer, steps)
    for k in SHAPES if shapes is None else shapes:
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
            assert differ.mean() <= max_differ, f"{k}: {differ.mean():.3%} of elements differ"
