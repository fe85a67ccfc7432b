"""An optax ``GradientTransformation`` around a host engine, whatever its optimizer.

The transformation's state is two int32 scalars (the step count and a handle to the host engine
that owns the fp32 master and the moments). ``init`` lays the params out in subgroups and makes
the engine (for one device, a mesh of this process's devices, or this process's shards of
several); ``update`` evaluates the step's scalars on the device, exactly as optax does, and one
side-effecting XLA FFI call runs the engine on XLA's own buffers
(:mod:`jax_mlpo.native.host_update`): it reads the gradients and params in place and writes the
update over the gradients, once per executed update, eagerly and under ``jax.jit`` alike. The
call returns the next step count, so each update's data depends on the previous one.
:func:`offloaded` builds it; :mod:`jax_mlpo.transforms.elementwise` has the public optimizers.
"""

from __future__ import annotations

import functools
import secrets
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine.engine import Engine
from jax_mlpo.engine.layout import Layout, build_layout, resolve_mask
from jax_mlpo.engine.plan import StateShape, warn_unused_tiers
from jax_mlpo.engine.row_stream import DRAIN
from jax_mlpo.engine.scalars import ScalarNames
from jax_mlpo.native.host_update import (
    CallGroup,
    group_receive_call,
    group_send_call,
    host_receive_call,
    host_update_call,
)
from jax_mlpo.optimizers import HostOptimizer
from jax_mlpo.sharding import processes as distributed
from jax_mlpo.sharding.mesh import MeshPlan
from jax_mlpo.sharding.plan import ShardPlan, plan_of_update, shard_plan, update_key
from jax_mlpo.transforms import overlap
from jax_mlpo.transforms.opt_state import OffloadedState
from jax_mlpo.transforms.runtime import RUNTIME, TEMPLATE, Place, place_of
from jax_mlpo.transforms.traced_init import (
    handle_at_run_time,
    made_at_run_time,
    wait_for_traced_inits,
)


def refuse_discarding_wrappers(name: str) -> None:
    """Fails init inside optax.MultiSteps, which runs update on every micro-step and discards it."""
    multi_steps_init = optax.MultiSteps.init.__code__
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is multi_steps_init:
            raise ValueError(
                f"jax_mlpo.{name} cannot be wrapped in optax.MultiSteps: MultiSteps runs the inner "
                "update on every micro-step and discards all but the last, but jax_mlpo advances "
                "its offloaded moments on every update it runs. Use jax_mlpo.MultiSteps(tx, "
                "every_k_schedule=k) instead: optax.MultiSteps's signature and results, with the "
                "inner update run only on the micro-step that applies it."
            )
        frame = frame.f_back


class EmptyGroup(NamedTuple):
    """The params of a group of an optimizer's leaves that is empty (``jax_mlpo.muon``'s AdamW
    group of a model of matrices only): ``init`` on it makes an engine over no leaves, which
    holds nothing (and, at a place of its own, is replaced by the next init there), so the
    optimizer's state has the same structure for any params. Other params with no leaves
    (``optax.tree.map_params``'s placeholder) get a template, and no engine to leak."""


def is_traced(params: Any) -> bool:
    """Whether ``params`` are abstract: ``init`` called under ``jax.eval_shape`` or ``jit``."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))


def template_state(params: Any) -> OffloadedState:
    """The state's shapes and dtypes for abstract ``params``, with no engine behind it.

    ``jax.eval_shape(tx.init, params)`` (and ``nnx.eval_shape`` of an ``nnx.Optimizer``) is how
    Flax and orbax make restore targets' shapes: this writes nothing and allocates nothing. Its
    handle is :data:`jax_mlpo.transforms.TEMPLATE`, which every use of the state refuses,
    naming the fix: a state to train or restore into comes from ``tx.init`` on concrete params.
    """
    shape: tuple[int, ...] = ()
    if distributed.is_multiprocess():
        shape = (jax.process_count(),)
    for leaf in jax.tree.leaves(params):  # params on a mesh in their types (explicit sharding)
        mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
        if mesh is not None and not mesh.empty and mesh.size > 1:
            shape = tuple(mesh.axis_sizes)
            break
    template = jnp.full(shape, TEMPLATE, jnp.int32)
    return OffloadedState(count=jnp.zeros([], jnp.int32), handle=template)


# (count_inc, hyperparams, lr, grads) -> {name: scalar}: what the device computes for a step
DeviceScalars = Callable[[jax.Array, dict[str, Any], Any, Any], dict[str, Any]]


def offloaded(
    name: str,
    optimizer: HostOptimizer,
    *,
    learning_rate: optax.ScalarOrSchedule,
    hyperparams: dict[str, Any],
    device_scalars: DeviceScalars,
    moment_dtypes: tuple[Any, ...],
    mask: Any,
    offload: OffloadConfig,
    update_dtype: Any,
    keeps_master: bool = True,
    max_grad_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The transformation of an offloaded optimizer (its arguments already checked).

    Args:
      name: the public function's name (``"adamw"``), for messages.
      optimizer: the engine's per-subgroup math.
      learning_rate: a float or an optax schedule (evaluated on the device at the count).
      hyperparams: the other hyper-parameters by name, as given: Python floats (kept in double
        precision) or scalar arrays (inject_hyperparams: passed with every update).
      device_scalars: ``(count_inc, hyperparams, lr, grads) -> {name: scalar}``: the scalars
        ``optimizer.scalar_names`` names, computed on the device for the step (optax's own
        expressions, so they match it bit for bit).
      moment_dtypes: each moment's storage dtype, in ``optimizer.moment_names``' order.
      mask: where weight decay applies (resolved at init).
      offload: where the state lives.
      update_dtype: None (the params' dtype) or float32.
      keeps_master: whether the state holds the fp32 master of bfloat16 params (False: the
        update is computed from the gradients alone, as Muon's momentum pass is).
      max_grad_norm: if set, the scalar ``grad_scale`` clips the gradients to this global
        norm (``optax.clip_by_global_norm``'s rule), the norm summed in one order in every
        program (:meth:`jax_mlpo.sharding.plan.ShardPlan.global_norm`): the plain and the
        overlapped step scale by the same bits.

    Returns:
      The ``GradientTransformationExtraArgs`` of an :class:`Offloaded`; its ``update``
      requires ``params`` and ignores extra keyword arguments. ``init`` under a trace
      (``jax.eval_shape``) returns a template of the state (:func:`template_state`) and makes
      nothing; otherwise it replaces the engine of this process at the same place
      (:meth:`jax_mlpo.transforms.runtime.Runtime.take_place`).
    """
    spec = OffloadedSpec(name, optimizer, learning_rate, hyperparams, device_scalars,
                         tuple(moment_dtypes), mask, offload, update_dtype, keeps_master,
                         max_grad_norm)  # fmt: skip
    tx = Offloaded(spec)
    return optax.GradientTransformationExtraArgs(tx.init, tx.update)


class OffloadedSpec(NamedTuple):
    """What an offloaded optimizer is: :func:`offloaded`'s arguments."""

    name: str
    optimizer: HostOptimizer
    learning_rate: optax.ScalarOrSchedule
    hyperparams: dict[str, Any]
    device_scalars: DeviceScalars
    moment_dtypes: tuple[Any, ...]
    mask: Any
    offload: OffloadConfig
    update_dtype: Any
    keeps_master: bool
    max_grad_norm: float | None


def _shapes_of(params: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(np.shape(x)) for x in jax.tree.leaves(params))


class Offloaded:
    """An offloaded optimizer's ``init`` and ``update``, and what they share.

    Attributes:
      spec: what the optimizer is.
      scalar_names: the step's scalars, laid out once (checked here).
      mesh_plans: the plans of the states this transformation initialised on a mesh, by what
        an update sees of them when traced (the handles' and the leaves' shapes): the leaves'
        shardings are not visible under jit. A transformation re-created inside update
        (inject_hyperparams) finds them in the runtime.
      init_shapes: the params' leaf shapes at each init, checked by every update traced: the
        host state is laid out by them, and the FFI call sees only flat buffers (it catches a
        changed leaf count or size, not a reshape that keeps the size). Shapes, not the tree:
        the same leaves come wrapped differently (nnx.Optimizer inits on variables, updates
        on arrays).
    """

    def __init__(self, spec: OffloadedSpec) -> None:
        self.spec = spec
        self.scalar_names = ScalarNames.of(spec.optimizer.scalar_names, spec.hyperparams)
        self.mesh_plans: dict[tuple[Any, ...], MeshPlan] = {}
        self.init_shapes: set[tuple[tuple[int, ...], ...]] = set()
        # jitted even when called eagerly, so the scalars are rounded the same way in both modes
        self._jitted_update = jax.jit(self._update_body, static_argnums=5)

    def init(
        self, params: Any, *, part_offload: OffloadConfig | None = None, part_mask: Any = None,
        host_arrays: bool = False,
    ) -> OffloadedState:  # fmt: skip
        """optax's ``init``.

        Args:
          params: the params (concrete; traced: a template, or engines made at run time).
          part_offload, part_mask: where an optimizer is made of several of these, each over a
            group of its leaves (jax_mlpo.muon), each part's own config and weight decay mask.
          host_arrays: the state as NumPy scalars (made inside a compiled init's host call).
        """
        spec = self.spec
        refuse_discarding_wrappers(spec.name)
        where = spec.offload if part_offload is None else part_offload
        decay = spec.mask if part_mask is None else part_mask
        self.init_shapes.add(_shapes_of(params))
        if not (jax.tree.leaves(params) or isinstance(params, EmptyGroup)):
            return template_state(params)
        if is_traced(params):
            if not made_at_run_time(params):
                return template_state(params)
            init = functools.partial(self.init, part_offload=part_offload, part_mask=part_mask,
                                     host_arrays=True)  # fmt: skip
            handle = handle_at_run_time(params, init)
            return OffloadedState(count=jnp.zeros([], jnp.int32), handle=handle)
        RUNTIME.ensure_platform(jax.default_backend())
        plan = shard_plan(params, backend=jax.default_backend())
        flags = plan.engine_flags(resolve_mask(decay, params))
        moments = (spec.moment_dtypes, spec.optimizer.moment_names, spec.keeps_master)
        # stacked layers row by row: an overlapped step updates them as its scan reaches them
        layout = build_layout(plan.engine_leaves(params), where.subgroup_size, flags, *moments,
                              by_row=plan.mesh is None and not plan.processes)  # fmt: skip
        engine, place = self._new_engine(layout, plan.engine_config(where))
        RUNTIME.init_succeeded(plan.key(params))
        if plan.mesh is not None:  # a handle per device, whose calls meet before the engine runs
            key = plan.key(params)
            handles = RUNTIME.register_mesh(engine, plan.mesh, key, place)
            self.mesh_plans[key] = plan.mesh
        else:
            handles = [RUNTIME.register(engine, place)]
        if part_offload is None:  # a part's tiers are its optimizer's (jax_mlpo.muon warns)
            warn_unused_tiers(spec.name, where, [StateShape.of(layout)], [engine.plan])
        if host_arrays:  # a scalar, or one handle per device in the mesh's shape
            shape = () if plan.mesh is None else plan.mesh.mesh.devices.shape
            return OffloadedState(count=np.int32(0), handle=np.reshape(handles, shape))
        count, handle = plan.arrays(handles)
        return OffloadedState(count=count, handle=handle)

    def _new_engine(self, layout: Layout, config: OffloadConfig) -> tuple[Engine, Place]:
        # it replaces the engine of this process at its place (a second init)
        place = place_of(config)
        RUNTIME.take_place(place)
        return Engine(layout, config, self.spec.optimizer, self.scalar_names), place

    def update(self, updates: Any, state: OffloadedState, params: Any = None,
               **extra_args: Any) -> tuple[Any, OffloadedState]:  # fmt: skip
        """optax's ``update``: other extra arguments are accepted and ignored, as optax's
        optimizers do (``value=``, ...); an overlapped step's grouping is read."""
        spec = self.spec
        grouping = overlap.Grouping.given(extra_args)
        if params is None:
            raise ValueError(
                f"jax_mlpo.{spec.name} needs params in update (tx.update(grads, state, params)): "
                "they are read for weight decay and for the bfloat16 master copy"
            )
        if self.init_shapes and _shapes_of(params) not in self.init_shapes:
            raise ValueError(
                "the params handed to update are not those the optimizer was initialised "
                f"with: leaf shapes {list(_shapes_of(params))[:8]}, against "
                f"{[list(s)[:8] for s in self.init_shapes]} at init. The offloaded state is "
                "laid out by the params at init: init a new optimizer for other params (and "
                "restore its state from a checkpoint)"
            )
        # Arrays among the hyper-parameters (inject_hyperparams's, maybe traced) are arguments
        # of the jitted update; Python floats stay constants of it, in double precision.
        lr = None if callable(spec.learning_rate) else spec.learning_rate
        arrays = {k: v for k, v in spec.hyperparams.items() if not isinstance(v, int | float)}
        if grouping is not None:  # the step computes the next gradients as this reads them
            param_leaves = jax.tree.structure(updates).flatten_up_to(params)
            grouping.reads(
                param_leaves, self._plan(state.handle, param_leaves).grad_shardings(param_leaves)
            )
        groups = _groups_of(params, state, grouping)
        if groups is not None:  # traced by overlapped_step, into its program (grouping.hold)
            return self._update_body(updates, state, params, lr, arrays, groups, grouping)
        return self._jitted_update(updates, state, params, lr, arrays, None)

    def _update_body(self, updates, state, params, lr, arrays, groups, grouping=None):
        spec = self.spec
        count_inc = optax.safe_increment(state.count)
        if lr is None:
            lr = spec.learning_rate(state.count)
        grads, treedef = jax.tree.flatten(updates)
        param_leaves = treedef.flatten_up_to(params)
        plan = self._plan(state.handle, param_leaves)
        computed = spec.device_scalars(count_inc, {**spec.hyperparams, **arrays}, lr, updates)
        if spec.max_grad_norm is not None:
            g_norm = plan.global_norm(grads)
            computed["grad_scale"] = jnp.where(g_norm < spec.max_grad_norm, 1.0,
                                               spec.max_grad_norm / g_norm)  # fmt: skip
        scalars = self.scalar_names.vector(computed, arrays)
        if groups is None:
            count_out, outs = plan.update(
                self._host_update, grads, param_leaves, state.handle, state.count, scalars
            )
            return treedef.unflatten(outs), OffloadedState(count=count_out, handle=state.handle)
        # the scalars and every call's next count, held to the step's end (_grouped_update
        # says why); the barrier keeps XLA from fusing the held scalars' producer into the
        # hold, which would recompute them there and free the calls' buffer early
        scalars = jax.lax.optimization_barrier(scalars)
        gpu = grouping.platform == "cuda"
        # stacked layers a scan consumes go row by row on one CPU device (engine/row_stream.py)
        one_device = not gpu and plan.mesh is None and not plan.processes
        grouped = functools.partial(self._grouped_update, groups=groups, gpu=gpu,
                                    grouping=grouping if one_device else None)  # fmt: skip
        counts, outs = plan.update(grouped, grads, param_leaves, state.handle, state.count,
                                   scalars)  # fmt: skip
        grouping.hold(scalars, *(counts[k] for k in range(len(set(groups)))))
        return treedef.unflatten(outs), OffloadedState(count=jnp.max(counts), handle=state.handle)

    def _plan(self, handle: Any, param_leaves: list[Any]) -> ShardPlan:
        """The shard plan of an update of the state with ``handle`` on ``param_leaves``."""
        key = update_key(np.shape(handle), param_leaves)
        wait_for_traced_inits(key)  # a jitted init registers its plan when it runs
        mesh = self.mesh_plans.get(key) or RUNTIME.mesh_plan_for(key)
        return plan_of_update(handle, mesh, param_leaves)

    def _update_dtypes(self, param_leaves: list[Any]) -> list[Any]:
        f32 = self.spec.update_dtype is not None
        return [jnp.float32 if f32 else jnp.dtype(p.dtype) for p in param_leaves]

    def _host_update(self, grads, param_leaves, handle, count, scalars):
        return host_update_call(
            handle, count, scalars, grads, param_leaves, self._update_dtypes(param_leaves)
        )

    def _grouped_update(self, grads, param_leaves, handle, count, scalars, *, groups, gpu,
                        grouping=None):  # fmt: skip
        # One call per group present, renumbered 0.. in forward order; each call's operands are
        # its own leaves. Every call's next count is a value the program uses (the caller holds
        # them to the step's end): an unused result's buffer is one slice that all the calls
        # would write, and XLA would run them one after another; a count's buffer freed before
        # the end would go to the forward pass's temporaries, which would then wait for every
        # call. On a GPU each group is a send and a receive (ffi/cuda_grouped.h says why).
        present = sorted(set(groups))
        dtypes = self._update_dtypes(param_leaves)
        ids_of = [[k for k, gk in enumerate(groups) if gk == g] for g in present]
        rows = grouping.rows if grouping is not None else {}
        calls = [CallGroup(rank, len(present), tuple(ids), rows.get(g, 0),
                           secrets.randbits(31) if rows.get(g) else 0)
                 for rank, (g, ids) in enumerate(zip(present, ids_of, strict=True))]  # fmt: skip
        tokens = [
            group_send_call(handle, count, scalars, [grads[k] for k in call.leaf_ids],
                            [param_leaves[k] for k in call.leaf_ids], call,
                            f32_updates=self.spec.update_dtype is not None)
            for call in calls
        ] if gpu else []  # fmt: skip
        outs: list[Any] = [None] * len(grads)
        counts = []
        for call in calls:
            ids = call.leaf_ids
            if gpu:
                shapes = [jax.ShapeDtypeStruct(jnp.shape(param_leaves[k]), dtypes[k]) for k in ids]
                count_out, group_outs = group_receive_call(tokens, shapes, call)
            else:
                count_out, group_outs = host_update_call(
                    handle, count, scalars, [grads[k] for k in ids],
                    [param_leaves[k] for k in ids], [dtypes[k] for k in ids], call,
                )  # fmt: skip
            counts.append(count_out)
            for k, out in zip(ids, group_outs, strict=True):
                outs[k] = out
            if call.rows:
                rows = [_row_of(param_leaves[k], jnp.result_type(param_leaves[k])) for k in ids]
                rows += [_row_of(param_leaves[k], dtypes[k]) for k in ids]
                grouping.streams[present[call.group]] = overlap.RowStream(
                    [param_leaves[k] for k in ids], group_outs,
                    functools.partial(_receive, call.stream, rows),
                )  # fmt: skip
        return jnp.stack(counts), outs


def _row_of(param: Any, dtype: Any) -> jax.ShapeDtypeStruct:
    """One row of a stacked param leaf, in ``dtype``."""
    return jax.ShapeDtypeStruct(jnp.shape(param)[1:], dtype)


def _receive(stream: int, rows: list[jax.ShapeDtypeStruct], row: jax.Array | None
             ) -> list[jax.Array]:  # fmt: skip
    """A sent group's receive of ``row`` of its params and updates (None: the drain)."""
    if row is None:
        return host_receive_call(stream, jnp.int32(DRAIN), [])
    return host_receive_call(stream, row, rows)


def _groups_of(params: Any, state: OffloadedState, grouping: overlap.Grouping | None
               ) -> tuple[int, ...] | None:  # fmt: skip
    """Each param leaf's group inside jax_mlpo.overlapped_step (None: one call), on a platform
    the overlapped step splits for (``grouping.platform``: a CPU, or a GPU with the grouped
    handlers). A mesh's or several processes' calls are split on CPU, where every device makes
    each group's call (:class:`jax_mlpo.engine.grouped.Shards`)."""
    if grouping is None or grouping.platform is None:
        return None
    groups = tuple(grouping.group_of(p) for p in jax.tree.leaves(params))
    if (not groups or None in groups or len(set(groups)) == 1
            or (np.ndim(state.handle) and grouping.platform != "cpu")):  # fmt: skip
        return None
    return groups
