"""``jax_mlpo.adamw``: an optax AdamW whose state lives off the accelerator.

The transformation's state is two int32 scalars (the step count and a handle to the host engine
that owns p, m and v). ``update`` evaluates the learning rate and the bias corrections on the
device, exactly as optax does, and one side-effecting XLA FFI call runs the engine on XLA's own
buffers (:mod:`jax_mlpo.native.host_update`): it reads the gradients and params in place and
writes the update over the gradients, once per executed update, eagerly and under ``jax.jit``
alike. The call returns the next step count, so each update's data depends on the previous one.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlpo import distributed, registry
from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine import Engine
from jax_mlpo.kernels import AdamWHyper
from jax_mlpo.layout import build_layout, check_moment_dtypes, resolve_mask
from jax_mlpo.leaves import HostLeaves, StagedLeaves
from jax_mlpo.mesh_update import MeshPlan, mesh_plan
from jax_mlpo.native.copies import CudaCopier, cuda_host_register, cuda_host_unregister
from jax_mlpo.native.host_update import (
    DEFERRED,
    ensure_platform,
    host_update_call,
    set_host_update,
)
from jax_mlpo.opt_state import OffloadedAdamWState


def _refuse_discarding_wrappers() -> None:
    """Fails init inside optax.MultiSteps, which runs update on every micro-step and discards it."""
    multi_steps_init = optax.MultiSteps.init.__code__
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is multi_steps_init:
            raise ValueError(
                "jax_mlpo.adamw cannot be wrapped in optax.MultiSteps: MultiSteps runs the inner "
                "update on every micro-step and discards all but the last, but jax_mlpo advances "
                "its offloaded moments on every update it runs. Use jax_mlpo.MultiSteps(tx, "
                "every_k_schedule=k) instead: optax.MultiSteps's signature and results, with the "
                "inner update run only on the micro-step that applies it."
            )
        frame = frame.f_back


_NO_GPU_MESH = (
    "jax_mlpo takes params on a mesh of several devices per process on CPU only for now: on "
    "GPUs start one process per GPU (jax.distributed; experiments/launch/single_node.sh with "
    "NPROCS=<GPUs>), each with its shards"
)


def _hyper(engine: Engine, scalars: np.ndarray) -> AdamWHyper:
    """The step's scalars: lr, bc1, bc2, grad scale, then b1, b2, eps and weight decay where the
    update was given them as arrays (optax.inject_hyperparams), NaN where they are the Python
    floats the engine was made with (kept in double precision, as optax uses them)."""
    lr, bc1, bc2, scale, *given = (float(x) for x in scalars)
    b1, b2, eps, weight_decay = (
        own if math.isnan(x) else x
        for x, own in zip(given, (engine.b1, engine.b2, engine.eps, engine.weight_decay),
                          strict=True)
    )  # fmt: skip
    return AdamWHyper(
        bc1=bc1, bc2=bc2, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
        grad_scale=scale,
    )  # fmt: skip


def _run_update(handle, count, scalars, grads, params, updates, stream, completion):
    """The host side of every ``jax_mlpo_host_update`` call (on an XLA thread, with the GIL):
    XLA's buffers in place on CPU, staged a subgroup at a time through XLA's stream on a GPU;
    with params on a mesh, each device's call meets the others' and all but the last are
    deferred (:mod:`jax_mlpo.mesh_update`)."""
    try:
        slot = registry.slot(handle)
        if slot is not None:
            if stream is not None:
                raise NotImplementedError(_NO_GPU_MESH)
            calls, k = slot
            deferred = calls.arrive(k, (count, scalars, grads, params, updates), completion)
            return DEFERRED if deferred else None
        _step(registry.engine(handle), count, scalars, grads, params, updates, stream)
        return None
    except BaseException as e:
        registry.update_failed(e)
        raise


def run_on(engine: Engine):
    """The runner of a mesh engine's update, once every device's call has arrived."""

    def run(count: int, scalars: np.ndarray, grads: list, params: list, updates: list) -> None:
        _step(engine, count, scalars, grads, params, updates, None)

    return run


# The configs already checked against the file systems and object stores, by id (with a weak
# reference, so that a new config at a recycled id is checked again).
_VALIDATED: dict[int, weakref.ref] = {}


def _validate_once(offload: OffloadConfig) -> None:
    """Checks ``offload``'s tiers once per config object: optax.inject_hyperparams re-creates
    the transformation inside every update, and a check writes to every tier."""
    ref = _VALIDATED.get(id(offload))
    if ref is not None and ref() is offload:
        return
    offload.validate()
    _VALIDATED[id(offload)] = weakref.ref(offload)


def _concrete(value: Any) -> float:
    """``value`` as a Python float; NaN for a traced one (an update then always passes it)."""
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        return math.nan


def _step(engine, count, scalars, grads, params, updates, stream) -> None:
    """One update of ``engine`` on XLA's buffers: in place on CPU (``stream`` None), staged a
    subgroup at a time through XLA's stream on a GPU."""
    if stream is None:
        leaves = HostLeaves(grads, params, updates)
    else:
        staging = engine.subgroup_staging(cuda_host_register, cuda_host_unregister)
        leaves = StagedLeaves(grads, params, updates, CudaCopier(stream), staging)
    engine.step_leaves(count, _hyper(engine, scalars), leaves)


set_host_update(_run_update)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
    *,
    offload: OffloadConfig,
    max_grad_norm: float | None = None,
    update_dtype: Any = None,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    q8_rounding: str = "stochastic",
) -> optax.GradientTransformation:
    r"""AdamW with its state (fp32 master params, m, v) offloaded to host memory and files.

    The update is ``optax.adamw``'s, operation for operation in float32:

    .. math::
      m_t = b_1 m_{t-1} + (1-b_1) g_t, \quad v_t = b_2 v_{t-1} + (1-b_2) g_t^2, \\
      u_t = -\eta_t \left(\frac{m_t / (1-b_1^t)}{\sqrt{v_t / (1-b_2^t)} + \epsilon}
            + \lambda\, p_{t-1}\right)

    where the weight decay :math:`\lambda` applies where ``mask`` is True. For float32 params
    ``optax.apply_updates(params, u)`` gives optax.adamw's params (to float32 rounding). For
    bfloat16 params the tiers also keep an fp32 master copy, and the update is in the params'
    dtype, as optax's convention is: ``bfloat16(master_new) - params``, computed from the
    params handed to this update. ``apply_updates`` then yields ``bfloat16(master_new)``
    exactly wherever the new and old values are within a factor 2 of each other (Sterbenz) and
    within a bfloat16 rounding of it elsewhere; the master copy itself stays exact, and the next
    update is computed from the params as they are, so no difference accumulates
    (docs/precision.md, "The bf16 update", has the measured fractions).
    ``update_dtype=jnp.float32`` returns ``master_new - float32(params)`` instead, with which
    ``apply_updates`` gives ``bfloat16(master_new)`` bit for bit, at 4 bytes of update per param.

    Memory: the update is written over the gradients where their dtypes agree (bfloat16
    gradients of bfloat16 params, or float32 of float32), so inside a jitted train step the
    device holds params and gradients and nothing else of the model's size; the host holds the
    host cache and nothing that grows with the model.

    p, m and v never live on the accelerator: the returned state is two int32 scalars, and the
    moments are advanced on the host by every update that runs. Each update must therefore be
    handed the state returned by the previous one; wrappers that compute and then discard an
    update (``optax.MultiSteps``) are refused: :class:`jax_mlpo.MultiSteps` accumulates
    gradients with its semantics. ``optax.inject_hyperparams(jax_mlpo.adamw)`` works as for
    ``optax.adamw``: the transformation it re-creates in every update finds the engine its
    state names.

    Args:
      learning_rate: a float or an optax schedule (evaluated on the device at the step count).
      b1: exponential decay of the first moment.
      b2: exponential decay of the second moment.
      eps: added to the denominator outside the square root.
      weight_decay: decoupled weight decay, multiplied by the learning rate as in optax.
        Each of these four may be a Python float (kept in double precision, as optax uses
        it) or a scalar array that may change from step to step (as
        ``optax.inject_hyperparams`` passes them: float32, as optax computes with them).
      mask: a pytree of bools (or a prefix of the params tree), or a callable returning one:
        where weight decay applies. Resolved once, at init.
      offload: where the state lives; see :class:`jax_mlpo.OffloadConfig`.
      max_grad_norm: if set, gradients are clipped to this global norm first, as
        ``optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw(...))`` does, but without
        writing the scaled gradients: the norm is taken on the device (in float32) and the scale
        is applied inside the host update, where the gradients are read anyway. That saves a
        pass over the gradients and a fresh buffer of their size every step (0.13 s of 0.15 s at
        97.5M bfloat16 params on 2 CPU cores). With bfloat16 gradients the norm and the scaling
        are float32 (optax's chain computes both in bfloat16); with float32 ones they agree with
        the chain to rounding.
      update_dtype: None (the params' dtype, the default) or ``jnp.float32``: the update's dtype
        for bfloat16 params (float32 params always get a float32 update).
      mu_dtype: None (float32) or ``jnp.bfloat16``: the dtype the first moment is stored in on
        the tiers, with optax's meaning: the moment is advanced and the update computed in
        float32 (the decay rounded to bfloat16, as optax's weak-typed ``b1 * mu`` does), then
        stored rounded to nearest even; so ``optax.adamw(mu_dtype=jnp.bfloat16)``'s m bit for
        bit.
      nu_dtype: None (float32) or ``jnp.bfloat16``: the same for the second moment (optax has
        no such option); its decay stays float32. Both bfloat16 cut the state from 12 (bfloat16
        params) or 8 (float32) bytes per param to 8 or 4.
        Either may also be ``"q8"``: 8-bit blockwise (:mod:`jax_mlpo.quantize`: a byte per
        element with 3 mantissa bits, a power-of-two scale per 256 elements), decoded to
        float32 inside the update and encoded again; both q8 make the state 6.03 bytes per
        param with bfloat16 params (2.03 with float32 ones). Not exact to optax: the moments
        carry a rounding error of at most 1/16 (nearest) each step.
      q8_rounding: how q8 moments are rounded: ``"stochastic"`` (unbiased; its random bits
        are a hash of the step, the subgroup and the element, so a resumed run draws the same
        ones) or ``"nearest"``, which leaves moments that change by under 3-6% a step where
        they are: a 125M model's loss ended 5% above the float32 state's with it, 0.5% below
        with stochastic rounding (docs/benchmarks.md).

    Returns:
      An optax ``GradientTransformation`` whose ``update`` requires ``params``.

    Raises:
      ConfigError: at construction, for a tier path that is missing or not writable; at init,
        for a host cache too small for the pipeline.
      ValueError: at construction, for a ``max_grad_norm`` that is not positive, an
        ``update_dtype`` other than None and float32, a ``mu_dtype``/``nu_dtype`` other than
        None, float32, bfloat16 and "q8", or a ``q8_rounding`` other than those two.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_mlpo
      >>> tx = jax_mlpo.adamw(1e-3, offload=jax_mlpo.OffloadConfig(host_cache="64MiB"))
      >>> params = {"w": jnp.ones((4, 4))}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> jax_mlpo.close(state)
    """
    if not isinstance(offload, OffloadConfig):
        raise TypeError(f"offload must be a jax_mlpo.OffloadConfig, got {type(offload).__name__}")
    _validate_once(offload)
    scalars_given = {"b1": b1, "b2": b2, "eps": eps, "weight_decay": weight_decay}
    for name, value in scalars_given.items():
        if not isinstance(value, int | float) and np.shape(value) != ():
            raise ValueError(f"{name} must be a float or a scalar array, got shape "
                             f"{np.shape(value)}")  # fmt: skip
    moments = check_moment_dtypes([jnp.float32 if d is None else d for d in (mu_dtype, nu_dtype)])
    if q8_rounding not in ("nearest", "stochastic"):
        raise ValueError(f'q8_rounding must be "nearest" or "stochastic", got {q8_rounding!r}')
    # the engine's own values: used where an update passes none (Python floats, kept double)
    hyper = {name: _concrete(value) for name, value in scalars_given.items()}
    hyper["stochastic_rounding"] = q8_rounding == "stochastic"
    if max_grad_norm is not None and not float(max_grad_norm) > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None: no clipping), got {max_grad_norm!r}")
    if update_dtype is not None and jnp.dtype(update_dtype) != jnp.float32:
        raise ValueError(
            f"update_dtype must be None (the params' dtype) or float32, got {update_dtype!r}"
        )

    # The plans of the states this transformation initialised on a mesh, by what an update
    # sees of them when traced (the handles' and the leaves' shapes): the leaves' shardings are
    # not visible under jit. A transformation re-created inside update (inject_hyperparams)
    # finds them in the registry.
    mesh_plans: dict[tuple[Any, ...], MeshPlan] = {}

    def plan_key(handle_shape: Any, param_leaves: list[Any]) -> tuple[Any, ...]:
        return (tuple(handle_shape), *(tuple(np.shape(p)) for p in param_leaves))

    # The params' leaf shapes at each init, checked by every update this transformation traces:
    # the host state is laid out by them, and the FFI call sees only flat buffers (it catches a
    # changed leaf count or size, not a reshape that keeps the size). Shapes, not the tree: the
    # same leaves come wrapped differently (nnx.Optimizer inits on variables, updates on arrays).
    init_shapes: set[tuple[tuple[int, ...], ...]] = set()

    def shapes_of(params: Any) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(np.shape(x)) for x in jax.tree.leaves(params))

    def init_fn(params):
        _refuse_discarding_wrappers()
        init_shapes.add(shapes_of(params))
        ensure_platform(jax.default_backend())
        plan = mesh_plan(params)
        if plan is not None and distributed.is_multiprocess() and plan.is_data_parallel():
            plan = None  # jax_mlpo.distributed's layout, which checkpoints can hold
        if plan is not None:  # params on a mesh: one engine over this process's shards
            if jax.default_backend() != "cpu":
                raise NotImplementedError(_NO_GPU_MESH)
            flags = plan.shard_flags(resolve_mask(mask, params))
            layout = build_layout(plan.shard_structs(params), offload.subgroup_size, flags, moments)
            config = offload
            if distributed.is_multiprocess():
                config = distributed.process_config(offload, jax.process_index())
            engine = Engine(layout, config, **hyper)
            key = plan_key(plan.mesh.devices.shape, jax.tree.leaves(params))
            handle = plan.handle_array(registry.register_mesh(engine, plan, run_on(engine), key))
            mesh_plans[key] = plan
            return OffloadedAdamWState(count=plan.replicated(np.int32(0)), handle=handle)
        if distributed.is_multiprocess():
            # Data parallel (see jax_mlpo/distributed.py): this process's engine holds the state
            # of its own shards, in per-process tier directories.
            mesh = distributed.data_parallel_mesh()
            local = distributed.local_params(params, jax.process_count())
            layout = build_layout(local, offload.subgroup_size, resolve_mask(mask, params), moments)
            config = distributed.process_config(offload, jax.process_index())
            engine = Engine(layout, config, **hyper)
            return OffloadedAdamWState(
                count=distributed.replicated(np.int32(0), mesh),
                handle=distributed.global_handle(registry.register(engine), mesh),
            )
        layout = build_layout(params, offload.subgroup_size, resolve_mask(mask, params), moments)
        engine = Engine(layout, offload, **hyper)
        return OffloadedAdamWState(
            count=jnp.zeros([], jnp.int32),
            handle=jnp.asarray(registry.register(engine), jnp.int32),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "jax_mlpo.adamw needs params in update (tx.update(grads, state, params)): they "
                "are read for weight decay and for the bfloat16 master copy"
            )
        if init_shapes and shapes_of(params) not in init_shapes:
            raise ValueError(
                "the params handed to update are not those the optimizer was initialised "
                f"with: leaf shapes {list(shapes_of(params))[:8]}, against "
                f"{[list(s)[:8] for s in init_shapes]} at init. The offloaded state is laid out "
                "by the params at init: init a new optimizer for other params (and restore its "
                "state from a checkpoint)"
            )
        # Arrays among the hyper-parameters (inject_hyperparams's, maybe traced) are arguments
        # of the jitted update; Python floats stay constants of it, in double precision.
        lr = None if callable(learning_rate) else learning_rate
        arrays = {k: v for k, v in scalars_given.items() if not isinstance(v, int | float)}
        return jitted_update(updates, state, params, lr, arrays)

    # Jitted even when called eagerly, so the scalars are rounded the same way in both modes.
    @jax.jit
    def jitted_update(updates, state, params, lr, arrays):
        count_inc = optax.safe_increment(state.count)
        if lr is None:
            lr = learning_rate(state.count)
        hp = {**scalars_given, **arrays}
        # The same expressions optax evaluates, on the device, so the scalars match it bit for bit.
        bc1 = 1 - hp["b1"] ** count_inc
        bc2 = 1 - hp["b2"] ** count_inc
        scale = 1.0
        if max_grad_norm is not None:  # optax.clip_by_global_norm's rule, applied on the host
            g_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), updates))
            scale = jnp.where(g_norm < max_grad_norm, 1.0, max_grad_norm / g_norm)
        given = [arrays.get(k, jnp.float32(jnp.nan)) for k in scalars_given]
        scalars = jnp.stack([jnp.asarray(x, jnp.float32) for x in (lr, bc1, bc2, scale, *given)])
        grads, treedef = jax.tree.flatten(updates)
        param_leaves = treedef.flatten_up_to(params)
        key = plan_key(np.shape(state.handle), param_leaves)
        plan = mesh_plans.get(key) or registry.mesh_plan_for(key)
        if plan is not None:  # each device's call with its shards, one engine per process
            count_out, outs = distributed.sharded_update(
                host_update, grads, param_leaves, state.handle, state.count, scalars,
                mesh=plan.mesh, specs=plan.specs,
            )  # fmt: skip
        elif state.handle.ndim:  # multi-process: each process updates its own shards
            count_out, outs = distributed.sharded_update(
                host_update, grads, param_leaves, state.handle, state.count, scalars
            )
        else:
            count_out, outs = host_update(grads, param_leaves, state.handle, state.count, scalars)
        return treedef.unflatten(outs), OffloadedAdamWState(count=count_out, handle=state.handle)

    def host_update(grads, param_leaves, handle, count, scalars):
        dtypes = [
            jnp.float32 if update_dtype is not None else jnp.dtype(p.dtype) for p in param_leaves
        ]
        return host_update_call(handle, count, scalars, grads, param_leaves, dtypes)

    return optax.GradientTransformation(init_fn, update_fn)
