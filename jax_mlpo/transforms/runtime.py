"""This process's offloaded optimizers: their engines, where their calls meet, and the FFI.

One :class:`Runtime` per process (:data:`RUNTIME`) owns everything an update shares across
calls: the engines by the handle their optimizer state carries, a mesh engine's device slots,
the place each engine holds, the mesh plans a traced update looks up, where an update's group
calls meet, the configs already checked against their tiers, and the first failure. One lock
guards them. It wires the XLA FFI handlers to itself when it is made: an FFI call names an
engine by a handle only the runtime hands out, so no call can reach the handlers before they
are wired, whatever was imported first.

An offloaded state names its engine by a handle: a random int32 drawn when the engine is made,
never reused in the process. A state that did not come from this process's ``tx.init`` or
``update`` (restored by a plain orbax save, copied from another process, or closed) names no
engine here and is refused with the cause and the fix (a counter starting at 1 in every process
would name another run's engine).

Engines need no explicit ``close``: at exit, their tier locks are released and the scratch
state on the tiers is left for the next run to reclaim (it is never read back: a run resumes
from a checkpoint). :func:`close`, or :func:`closing` as a context manager, releases the tiers
early.

Each engine has a *place*: the tier directories and object prefixes its state lives in, or,
for a state all in host memory, its ``OffloadConfig`` object. An init in this process whose
engine takes the place of an open one replaces it (:meth:`Runtime.take_place`): the older engine
is closed (its writes and checkpoint reads waited for, its tier locks released, its host cache
freed) and its state then refuses every use with an error that names the later init. So a run
that re-creates its optimizer, or inits a restore target in the process that trains, neither
locks itself out of its own tiers nor holds two host caches.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import secrets
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jax_mlpo.config import FileTier, OffloadConfig
from jax_mlpo.engine.engine import Engine
from jax_mlpo.engine.grouped import GroupCalls, GroupedLeaves, Shards
from jax_mlpo.engine.layout import Layout
from jax_mlpo.engine.leaves import HostLeaves, StagedLeaves
from jax_mlpo.engine.row_stream import RowBoards
from jax_mlpo.engine.staged_groups import GroupCall, StagedGroupCalls, StagedGroupLeaves
from jax_mlpo.engine.step_metrics import StepMetrics, combine
from jax_mlpo.errors import NoEngineError, forget_raised, wait_for_updates
from jax_mlpo.native import host_update
from jax_mlpo.native.copies import (
    CudaCopier,
    cuda_host_register,
    cuda_host_unregister,
    cuda_module,
)
from jax_mlpo.native.host_update import DEFERRED, CallGroup, Completion
from jax_mlpo.sharding.mesh import DeviceCalls, MeshPlan
from jax_mlpo.sharding.plan import NO_GPU_MESH
from jax_mlpo.transforms.opt_state import find_offloaded, handle_of

__all__ = ["RUNTIME", "Runtime", "close", "closing", "engine_of", "key_of", "mesh_plan_of",
           "metrics", "place_of"]  # fmt: skip

logger = logging.getLogger(__name__)

# Where an engine keeps its state (:func:`place_of`): ("host", id(config)), or one
# ("tier", location) per tier.
Place = tuple[Any, ...]

# The handle of a state made by tx.init under a trace that makes no engine (jax.eval_shape):
# a template with the state's shapes and no engine. Real handles are drawn from [1, 2**31 - 1].
TEMPLATE = 0

_TEMPLATE = (
    "this jax_mlpo optimizer state was made by tx.init under a JAX trace that makes no engine "
    "(jax.eval_shape or nnx.eval_shape; or jax.jit across processes, or of jax_mlpo.muon with "
    "params on a mesh): it is a template with the state's shapes and dtypes and no host state "
    "behind it. Use it as an abstract restore target's shapes only; make the state to train "
    "and to restore into with tx.init(params), eagerly or under jax.jit / nnx.jit in one "
    "process (across processes, and jax_mlpo.muon on a mesh: eagerly, on the placed params)"
)

_NOT_FOUND = (
    "no jax_mlpo engine with handle {key} in this process: this optimizer state was not "
    "returned by this process's tx.init or update. Most likely it was restored from a "
    "checkpoint that does not hold the offloaded optimizer state (orbax's StandardSave/"
    "StandardRestore or PyTreeSave write only the step count and the handle). Save and restore "
    "the same item with jax_mlpo.checkpoint.OffloadSave / OffloadRestore in your "
    "CheckpointManager (docs/flax.md), restoring into a target made by a fresh tx.init; a state "
    "copied from another process cannot be used either."
)


def place_of(config: Any) -> Place:
    """Where an engine made with ``config`` keeps its state: its tiers' directories and object
    prefixes; for a config without tiers, the config object itself (by identity)."""
    if not config.tiers:
        return ("host", id(config))
    return tuple(("tier", os.path.realpath(t.path) if isinstance(t, FileTier) else t.path)
                 for t in config.tiers)  # fmt: skip


def _overlap(a: Place, b: Place) -> bool:
    """Whether two places share a tier (or are the same host-only config)."""
    if a[0] == "host" or b[0] == "host":
        return a == b
    return bool(set(a) & set(b))


def _failed_message(error: BaseException) -> str:
    return (f"the jitted tx.init that made this optimizer state failed when its program ran: "
            f"{type(error).__name__}: {error}")  # fmt: skip


def _describe(place: Place) -> str:
    if place[0] == "host":
        return "the same OffloadConfig, with no tiers"
    return "tiers " + ", ".join(repr(location) for _, location in place)


@dataclasses.dataclass
class ProcessCheckpoints:
    """What this process's checkpoint saves and restores share (:mod:`jax_mlpo.checkpoint`).

    Attributes:
      lock: guards ``prefetched``.
      prefetched: each data file's array being read ahead of its restore (``host_reads``).
      deletions: the threads listing and deleting recycled checkpoints (``recycle``).
      manager_options: the options of the managers ``jax_mlpo.checkpoint.manager`` made
        (orbax keeps a manager's options private).
      streams_may_start: set unless a save that returns before its streams end is being
        started (``handler.streams_held``).
      faults: the fault plan every checkpoint request consults (``file_io.attach_faults``).
    """

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    prefetched: dict[str, concurrent.futures.Future] = dataclasses.field(default_factory=dict)
    deletions: list[threading.Thread] = dataclasses.field(default_factory=list)
    manager_options: weakref.WeakKeyDictionary = dataclasses.field(
        default_factory=weakref.WeakKeyDictionary
    )
    streams_may_start: threading.Event = dataclasses.field(default_factory=threading.Event)
    faults: Any = None

    def __post_init__(self) -> None:
        self.streams_may_start.set()


class Runtime:
    """The process's engines and the calls that reach them (module doc); all state here.

    Attributes:
      checkpoints: what the process's checkpoints share.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[int, Engine] = {}
        # a mesh engine's handles, one per device of this process: where its calls meet, its slot
        self._slots: dict[int, tuple[DeviceCalls, int]] = {}
        self._closed: set[int] = set()
        self._places: dict[int, Place] = {}  # each open engine's place, by handle
        self._replaced: dict[int, Place] = {}  # the places of replaced handles
        self._first_failure: BaseException | None = None  # the first update that raised
        # The inits that failed inside a compiled program on several devices (an error raised
        # there would leave the other devices waiting in a collective): by the handle their
        # state got, and by the key an update of it is traced with (:meth:`init_failed`).
        self._failed: dict[int, BaseException] = {}
        self._failed_keys: dict[tuple[Any, ...], BaseException] = {}
        # whether an init was traced in this process: its engine's plan (on a mesh) or its
        # failure is registered when the program runs, which JAX dispatches asynchronously
        self.inits_traced = False
        # The mesh plans of the states initialised on a mesh, by what an update sees of them
        # when traced (the handle's and the leaves' shapes: shardings are not visible under
        # jit), so that a transformation re-created inside update (optax.inject_hyperparams)
        # finds its state's plan.
        self._mesh_plans: dict[tuple[Any, ...], MeshPlan] = {}
        # where each engine's grouped CPU calls meet (made at its first grouped update)
        self._group_calls: weakref.WeakKeyDictionary[Engine, GroupCalls] = (
            weakref.WeakKeyDictionary()
        )
        # where a GPU's group sends meet, by XLA's stream (one per device): the engine is
        # known only once the first group's scalars have reached the host
        self._gpu_group_calls: dict[int, StagedGroupCalls] = {}
        # where the rows of stacked layers sent by an overlapped step meet the receives in
        # its scan, by the stream number the step was traced with
        self._row_boards = RowBoards()
        # the configs already checked against their tiers, by id (with a weak reference, so
        # that a new config at a recycled id is checked again)
        self._validated: dict[int, weakref.ref] = {}
        self._cuda_wired = False
        self._measured: dict[str, float] = {}  # process constants, each measured once
        self.checkpoints = ProcessCheckpoints()
        host_update.connect_cpu(self._run_update, self._receive_row)

    # -- engines and handles ------------------------------------------------------------------

    def _new_handle(self) -> int:
        while True:  # the lock is held: unique among this process's handles, past and present
            handle = secrets.randbelow(2**31 - 1) + 1
            if handle not in self._engines and handle not in self._closed:
                return handle

    def register(self, engine: Engine, place: Place) -> int:
        """A new handle naming ``engine``, which holds ``place`` (:func:`place_of`)."""
        with self._lock:
            handle = self._new_handle()
            self._engines[handle] = engine
            self._places[handle] = place
        return handle

    def register_mesh(self, engine: Engine, plan: MeshPlan, key: tuple[Any, ...],
                      place: Place) -> list[int]:  # fmt: skip
        """One handle per device of ``plan`` (its slot), all naming ``engine``.

        Args:
          engine: the process's engine over the distinct shards of its devices.
          plan: the params' shards.
          key: what a traced update sees of the state (:meth:`mesh_plan_for`).
          place: where ``engine`` keeps its state (:func:`place_of`).
        """

        def run(count: int, scalars: np.ndarray, grads: list, params: list, updates: list
                ) -> None:  # fmt: skip
            _step(engine, count, scalars, grads, params, updates, None)

        calls = DeviceCalls(plan, run)
        with self._lock:
            handles = [self._new_handle() for _ in plan.devices]
            for slot, handle in enumerate(handles):
                self._engines[handle] = engine
                self._slots[handle] = (calls, slot)
                self._places[handle] = place
            self._mesh_plans[key] = plan
        return handles

    def init_failed(self, error: BaseException, key: tuple[Any, ...]) -> int:
        """A handle naming ``error``, raised by an init in a compiled program on several
        devices, whose state an update traced with ``key`` (:meth:`check_init`) or any use
        refuses."""
        logger.error("jax_mlpo: a jitted tx.init failed when its program ran: %r", error)
        with self._lock:
            handle = self._new_handle()
            self._failed[handle] = error
            self._closed.add(handle)  # never drawn again
            self._failed_keys[key] = error
        return handle

    def init_succeeded(self, key: tuple[Any, ...]) -> None:
        """Forgets the failure of an earlier init of the same key."""
        with self._lock:
            self._failed_keys.pop(key, None)

    def check_init(self, key: tuple[Any, ...]) -> None:
        """Raises the error of the last init of ``key`` if it failed inside its program."""
        with self._lock:
            error = self._failed_keys.get(key)
        if error is not None:
            raise NoEngineError(_failed_message(error)) from error

    def engine(self, key: int) -> Engine:
        """The engine of handle ``key``.

        Raises:
          NoEngineError: no engine has it in this process (the message names cause and fix).
        """
        with self._lock:
            found = self._engines.get(key)
            replaced, closed = self._replaced.get(key), key in self._closed
            failed = self._failed.get(key)
        if found is not None:
            return found
        if failed is not None:
            raise NoEngineError(_failed_message(failed)) from failed
        if key == TEMPLATE:
            raise NoEngineError(_TEMPLATE)
        if replaced is not None:
            raise NoEngineError(
                f"the jax_mlpo optimizer with handle {key} was replaced: a later tx.init in "
                f"this process took its place ({_describe(replaced)}) and closed it. Use the "
                "state that init returned (after a restore, the restored state); to hold two "
                "optimizers at once, give each its own tier directories (without tiers, its "
                "own OffloadConfig)"
            )
        if closed:
            raise NoEngineError(
                f"the jax_mlpo optimizer with handle {key} was closed (jax_mlpo.close): "
                "init a new one (and restore its state from a checkpoint)"
            )
        raise NoEngineError(_NOT_FOUND.format(key=key))

    def slot(self, key: int) -> tuple[DeviceCalls, int] | None:
        """Where a mesh engine's device calls meet, and the device's slot; None off a mesh."""
        with self._lock:
            return self._slots.get(key)

    def mesh_plan_for(self, key: tuple[Any, ...]) -> MeshPlan | None:
        """The plan of the mesh state an update traced with ``key`` updates, or None."""
        with self._lock:
            return self._mesh_plans.get(key)

    def open_handles(self) -> list[int]:
        """The handles of this process's open optimizers (a mesh optimizer has one per
        device)."""
        with self._lock:
            return list(self._engines)

    def open_engines(self) -> list[Engine]:
        """This process's open engines, each once."""
        with self._lock:
            return list({id(e): e for e in self._engines.values()}.values())

    def take_place(self, place: Place) -> None:
        """Closes the open engines of this process that hold any of ``place``'s tiers (or its
        host-only config), before a new engine takes it.

        Their states then refuse every use, naming the later init; their writes (and a
        checkpoint reading from them) are waited for first, so nothing they wrote is lost or
        torn.
        """
        with self._lock:
            keys = [k for k, p in self._places.items() if _overlap(p, place)]
        if keys:
            logger.info("jax_mlpo: a new init takes %s; closing the optimizer that held it", place)
            with contextlib.suppress(Exception):  # its updates in flight finish first
                jax.effects_barrier()
            self.close_keys(keys, replaced_by=place)

    def close_keys(self, keys: list[int], replaced_by: Place | None = None) -> None:
        """Forgets the engines of ``keys`` (a mesh engine's every slot) and closes them."""
        for key in keys:
            with self._lock:
                found = self._engines.pop(key, None)
                slots = [key] + [h for h, e in self._engines.items() if e is found]
                for handle in slots:
                    self._engines.pop(handle, None)
                    self._slots.pop(handle, None)
                    self._places.pop(handle, None)
                    self._closed.add(handle)
                    if replaced_by is not None:
                        self._replaced[handle] = replaced_by
            if found is not None:
                found.close()

    def validate_once(self, offload: OffloadConfig) -> None:
        """Checks ``offload``'s tiers once per config object: optax.inject_hyperparams
        re-creates the transformation inside every update, and a check writes to every tier."""
        with self._lock:
            ref = self._validated.get(id(offload))
        if ref is not None and ref() is offload:
            return
        offload.validate()
        with self._lock:
            self._validated[id(offload)] = weakref.ref(offload)

    def measured_once(self, name: str, measure: Callable[[], float]) -> float:
        """``measure()``'s value, measured at the first call for ``name`` in this process (a
        property of the machine, such as a host call's fixed cost)."""
        with self._lock:
            found = self._measured.get(name)
        if found is None:
            found = measure()
            with self._lock:
                found = self._measured.setdefault(name, found)
        return found

    def update_failed(self, error: BaseException) -> None:
        """Records that an update raised ``error`` (reported to the caller through XLA)."""
        with self._lock:
            if self._first_failure is None:
                self._first_failure = error

    # -- the calls ----------------------------------------------------------------------------

    def ensure_platform(self, platform: str) -> None:
        """Makes the host update callable on ``platform`` (``"cpu"``, or ``"gpu"``/``"cuda"``):
        on a GPU, wires the CUDA module's handlers to this runtime once.

        Raises:
          ImportError: on a GPU, if the CUDA module was not built, with how to build it.
          NotImplementedError: for any other platform.
        """
        host_update.check_platform(platform)
        if platform == "cpu":
            return
        with self._lock:
            if not self._cuda_wired:
                host_update.connect_cuda(self._run_update, self._send_group)
                self._cuda_wired = True

    def _run_update(self, handle, count, scalars, group, grads, params, updates, stream,
                    completion) -> str | None:  # fmt: skip
        """The host side of every ``jax_mlpo_host_update`` call (on an XLA thread, with the
        GIL): XLA's buffers in place on CPU, staged a subgroup at a time through XLA's stream
        on a GPU; with params on a mesh, each device's call meets the others' and all but the
        last are deferred (:mod:`jax_mlpo.sharding.mesh`); an update in one call per group of
        layers defers every call and completes each as its subgroups are done
        (:mod:`jax_mlpo.engine.grouped`)."""
        try:
            engine = self.engine(handle)
            slot = self.slot(handle)
            if not group.whole:
                if completion is None:  # a GPU's groups have handlers of their own
                    raise RuntimeError("a jax_mlpo update in groups reached the GPU's one-call "
                                       "handler")  # fmt: skip
                mesh, k = (None, 0) if slot is None else (slot[0].plan, slot[1])
                self._calls_of(engine, mesh).arrive(count, scalars, group, grads, params,
                                                    updates, completion, slot=k)  # fmt: skip
                return DEFERRED
            if slot is not None:
                if stream is not None:
                    raise NotImplementedError(NO_GPU_MESH)
                calls, k = slot
                deferred = calls.arrive(k, (count, scalars, grads, params, updates), completion)
                return DEFERRED if deferred else None
            _step(engine, count, scalars, grads, params, updates, stream)
            return None
        except BaseException as e:
            self.update_failed(e)
            raise

    def _receive_row(self, stream: int, row: int, outs: list, completion: Completion
                     ) -> str | None:  # fmt: skip
        """The host side of every ``jax_mlpo_host_receive``: a row of a group of stacked layers
        (:mod:`jax_mlpo.engine.row_stream`), handed over once the engine has updated it."""
        try:
            deferred = self._row_boards.receive(stream, row, outs, completion)
            return DEFERRED if deferred else None
        except BaseException as e:
            self.update_failed(e)
            raise

    def _calls_of(self, engine: Engine, mesh: MeshPlan | None) -> GroupCalls:
        """Where the CPU calls of ``engine``'s grouped updates meet (made at its first);
        ``mesh``: the shards of an engine over params on a mesh, whose every device makes each
        group's call."""
        with self._lock:
            found = self._group_calls.get(engine)
            if found is None:
                shards = None
                if mesh is not None:
                    shards = Shards(len(mesh.devices), tuple(s.owner for s in mesh.shards),
                                    tuple(s.leaf for s in mesh.shards),
                                    tuple(s.replicas for s in mesh.shards))  # fmt: skip

                def run(count: int, scalars: np.ndarray, leaves: GroupedLeaves,
                        order: list[int]) -> None:  # fmt: skip
                    try:
                        _step_in_groups(engine, count, scalars, leaves, order)
                    except BaseException as e:
                        self.update_failed(e)
                        raise

                found = self._group_calls[engine] = GroupCalls(engine.layout, run, shards=shards,
                                                               boards=self._row_boards)  # fmt: skip
        return found

    def _send_group(self, stream: int, group: CallGroup, grads: list, params: list,
                    updates: list, ticket: object) -> None:  # fmt: skip
        """The host side of every ``jax_mlpo_group_send`` (a GPU update in groups)."""
        try:
            with self._lock:
                calls = self._gpu_group_calls.get(stream)
                if calls is None:
                    calls = self._gpu_group_calls[stream] = StagedGroupCalls(
                        self._layout_of, self._run_staged, self.update_failed
                    )
            calls.arrive(GroupCall(group, grads, params, updates, ticket))
        except BaseException as e:
            self.update_failed(e)
            raise

    def _layout_of(self, handle: int) -> Layout:
        return self.engine(handle).layout

    def _run_staged(self, handle: int, count: int, scalars: np.ndarray,
                    leaves: StagedGroupLeaves, order: list[int]) -> None:  # fmt: skip
        engine = self.engine(handle)
        # the groups' pinned staging is the model's size: unpinned when the engine closes
        engine.on_close(cuda_module().release_group_staging)
        _step_in_groups(engine, count, scalars, leaves, order)

    # -- exit ---------------------------------------------------------------------------------

    def release_at_exit(self) -> None:
        """Releases every engine's tiers when the interpreter exits, without flushing: the
        state on the tiers is never read back, so nothing is lost."""
        with self._lock:
            engines = list({id(e): e for e in self._engines.values()}.values())
            self._engines.clear()
            self._slots.clear()
            self._places.clear()
            self._group_calls.clear()
            self._gpu_group_calls.clear()
            # the C++ handlers keep this runtime to the very end: nothing it holds may keep a
            # failed call's buffer views (its traceback's frames) alive past the interpreter
            failure, self._first_failure = self._first_failure, None
        if failure is not None:
            # one line, in case the loop never read an output of the failed step
            with contextlib.suppress(Exception):  # stderr may be closed by now
                print(
                    "jax_mlpo: an optimizer update failed in this process "
                    f"({type(failure).__name__}, raised by the step)",
                    file=sys.stderr,
                )
            _forget_failed_updates()
        forget_raised()
        for found in engines:
            try:
                found.close(flush=False)
            except Exception as e:  # noqa: BLE001 - nothing is left to save at exit
                logger.debug("jax_mlpo: releasing an engine at exit: %r", e)


def _step(engine: Engine, count: int, scalars: np.ndarray, grads: list, params: list,
          updates: list, stream: int | None) -> None:  # fmt: skip
    """One update of ``engine`` on XLA's buffers: in place on CPU (``stream`` None), staged a
    subgroup at a time through XLA's stream on a GPU."""
    if stream is None:
        leaves = HostLeaves(grads, params, updates)
    else:
        staging = engine.subgroup_staging(cuda_host_register, cuda_host_unregister)
        leaves = StagedLeaves(grads, params, updates, CudaCopier(stream), staging)
    engine.step_leaves(count, engine.optimizer.hyper(engine.scalars.read(scalars)), leaves)


def _step_in_groups(engine: Engine, count: int, scalars: np.ndarray, leaves: Any,
                    order: list[int]) -> None:  # fmt: skip
    """One update of ``engine`` from its group calls, in the forward pass's order."""
    # the engine times the update and its part after the first group was handed back
    # (StepMetrics.beside_s) on one clock, from ``leaves.first_done``
    engine.step_leaves(count, engine.optimizer.hyper(engine.scalars.read(scalars)), leaves,
                       forward=order)  # fmt: skip


def _forget_failed_updates() -> None:
    """Keeps JAX's exit hooks from re-raising a failed update that was already reported.

    A failed host update fails its XLA computation; JAX keeps that computation's runtime token
    and blocks on it again in each of its own exit hooks, printing the same traceback twice
    more. The failure is recorded on the engine and was raised to the caller, so the tokens are
    dropped here (JAX exposes no public way to do this; guarded so that a JAX without it only
    prints the duplicates).
    """
    with contextlib.suppress(Exception):
        from jax._src import dispatch  # noqa: PLC0415

        dispatch.runtime_tokens.clear()


# The process's runtime: every engine and call of this process goes through it.
RUNTIME = Runtime()
atexit.register(RUNTIME.release_at_exit)


def key_of(handle: Any) -> int:
    """The int a handle array holds for this process."""
    # A multi-process state's handle is int32[processes], sharded: this process's is its shard.
    if isinstance(handle, jax.Array) and not handle.is_fully_addressable:
        handle = handle.addressable_shards[0].data
    return int(np.asarray(handle).reshape(-1)[0])


def _states(opt_state: Any) -> list[Any]:
    states = find_offloaded(opt_state)
    if not states:
        raise ValueError(
            "opt_state contains no jax_mlpo optimizer state (pass the optimizer state: "
            "optimizer.opt_state with flax.nnx, state.opt_state with a TrainState)"
        )
    return states


def engine_of(opt_state: Any) -> Engine:
    """The host engine behind the (first) offloaded state inside ``opt_state``.

    Args:
      opt_state: an optimizer state in any form (an ``optax.chain`` state, ``nnx.Optimizer``'s
        ``opt_state``, ``nnx.state(optimizer)``).
    """
    return RUNTIME.engine(key_of(handle_of(_states(opt_state)[0])))


def mesh_plan_of(state: Any) -> MeshPlan | None:
    """The shards of an offloaded state over params on a mesh (:mod:`jax_mlpo.sharding.mesh`),
    or None (one device per process)."""
    found = RUNTIME.slot(key_of(handle_of(state)))
    return None if found is None else found[0].plan


def metrics(opt_state: Any) -> list[StepMetrics]:
    """The figures of every update the offloaded states in ``opt_state`` have run.

    An optimizer of several engines (``jax_mlpo.muon``'s momentum, master and AdamW states, or
    several offloaded optimizers in one ``optax.multi_transform``) runs them one after another
    in each update: its figures are theirs added up (:func:`jax_mlpo.engine.step_metrics.combine`).

    Args:
      opt_state: an optimizer state in any form (see :func:`engine_of`).

    Returns:
      One :class:`~jax_mlpo.StepMetrics` per update, oldest first (times, cache hits, bytes
      each tier moved); the updates in flight are waited for first.
    """
    wait_for_updates()
    engines: list[Engine] = []
    for state in _states(opt_state):
        found = RUNTIME.engine(key_of(handle_of(state)))
        if not any(found is e for e in engines):  # a mesh's slots share their engine
            engines.append(found)
    if len(engines) == 1:
        return list(engines[0].metrics)
    by_step: dict[int, list[StepMetrics]] = {}
    for e in engines:
        for m in e.metrics:
            by_step.setdefault(m.step, []).append(m)
    return [combine(parts) for _, parts in sorted(by_step.items())]


def close(opt_state: Any) -> None:
    """Waits for the updates in flight and the writes, releases the tier locks and forgets the
    host state.

    Not needed for correctness (a process may just end); it releases the tiers early. After
    it, ``opt_state`` cannot be updated any more.

    Args:
      opt_state: an optimizer state in any form holding offloaded states (see
        :func:`engine_of`).

    Raises:
      ValueError: if ``opt_state`` holds no offloaded state.
    """
    states = _states(opt_state)
    with contextlib.suppress(Exception):  # a failed update: close what it left all the same
        jax.effects_barrier()
    RUNTIME.close_keys([key_of(handle_of(state)) for state in states])


@contextlib.contextmanager
def closing(opt_state: Any) -> Iterator[Any]:
    """Closes the offloaded states in ``opt_state`` when the block ends (see :func:`close`).

    Example::

      with jax_mlpo.closing(tx.init(params)) as opt_state:
          ...  # train
    """
    try:
        yield opt_state
    finally:
        close(opt_state)
