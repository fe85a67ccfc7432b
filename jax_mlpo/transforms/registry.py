"""The host engines of this process, by the handle their optimizer state carries.

An offloaded state names its engine by a handle: a random int32 drawn when the engine is made,
never reused in the process. A state that did not come from this process's ``tx.init`` or
``update`` (restored by a plain orbax save, copied from another process, or closed) names no
engine here and is refused with the cause and the fix (a counter starting at 1 in every process
would name another run's engine).

Engines need no explicit ``close``: at exit, their tier locks are released and the
scratch state on the tiers is left for the next run to reclaim (it is never read back: a run
resumes from a checkpoint). :func:`close`, or :func:`closing` as a context manager, releases
the tiers early.

Each engine has a *place*: the tier directories and object prefixes its state lives in, or,
for a state all in host memory, its ``OffloadConfig`` object. An init in this process whose
engine takes the place of an open one replaces it (:func:`take_place`): the older engine is
closed (its writes and checkpoint reads waited for, its tier locks released, its host cache
freed) and its state then refuses every use with an error that names the later init. So a run
that re-creates its optimizer, or inits a restore target in the process that trains, neither
locks itself out of its own tiers nor holds two host caches.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jax_mlpo.config import FileTier
from jax_mlpo.engine.engine import Engine
from jax_mlpo.engine.step_metrics import StepMetrics, combine
from jax_mlpo.errors import NoEngineError, wait_for_updates
from jax_mlpo.sharding.mesh import DeviceCalls, MeshPlan
from jax_mlpo.transforms.opt_state import find_offloaded, handle_of

logger = logging.getLogger(__name__)

_ENGINES: dict[int, Engine] = {}
# A mesh engine's handles, one per device of this process: where its calls meet, and its slot.
_SLOTS: dict[int, tuple[DeviceCalls, int]] = {}
_CLOSED: set[int] = set()
# Where an engine keeps its state (:func:`place_of`): ("host", id(config)), or one
# ("tier", location) per tier.
Place = tuple[Any, ...]
# Each open engine's place, by handle; the places of replaced handles.
_PLACES: dict[int, Place] = {}
_REPLACED: dict[int, Place] = {}
_first_failure: BaseException | None = None  # the first update that raised in this process
# The inits that failed inside a compiled program on several devices (an error raised there
# would leave the other devices waiting in a collective): by the handle their state got, and
# by the key an update of it is traced with (:func:`init_failed`).
_FAILED: dict[int, BaseException] = {}
_FAILED_KEYS: dict[tuple[Any, ...], BaseException] = {}
# The mesh plans of the states initialised on a mesh, by what an update sees of them when
# traced (the handle's and the leaves' shapes: shardings are not visible under jit), so that a
# transformation re-created inside update (optax.inject_hyperparams) finds its state's plan.
_MESH_PLANS: dict[tuple[Any, ...], MeshPlan] = {}
_LOCK = threading.Lock()

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


def _new_handle() -> int:
    while True:  # the lock is held: unique among this process's handles, past and present
        handle = secrets.randbelow(2**31 - 1) + 1
        if handle not in _ENGINES and handle not in _CLOSED:
            return handle


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


def take_place(place: Place) -> None:
    """Closes the open engines of this process that hold any of ``place``'s tiers (or its
    host-only config), before a new engine takes it.

    Their states then refuse every use, naming the later init; their writes (and a checkpoint
    reading from them) are waited for first, so nothing they wrote is lost or torn.
    """
    with _LOCK:
        keys = [k for k, p in _PLACES.items() if _overlap(p, place)]
    if keys:
        logger.info("jax_mlpo: a new init takes %s; closing the optimizer that held it", place)
        with contextlib.suppress(Exception):  # its updates in flight finish first
            jax.effects_barrier()
        _close_keys(keys, replaced_by=place)


def register(engine: Engine, place: Place) -> int:
    """A new handle naming ``engine``, which holds ``place`` (:func:`place_of`)."""
    with _LOCK:
        handle = _new_handle()
        _ENGINES[handle] = engine
        _PLACES[handle] = place
    return handle


def register_mesh(
    engine: Engine,
    plan: MeshPlan,
    run: Callable[..., None],
    key: tuple[Any, ...],
    place: Place,
) -> list[int]:
    """One handle per device of ``plan`` (its slot), all naming ``engine``.

    Args:
      engine: the process's engine over the distinct shards of its devices.
      plan: the params' shards.
      run: ``run(count, scalars, grads, params, updates)``, once all devices' calls arrived.
      key: what a traced update sees of the state (:func:`mesh_plan_for`).
      place: where ``engine`` keeps its state (:func:`place_of`).
    """
    calls = DeviceCalls(plan, run)
    with _LOCK:
        handles = [_new_handle() for _ in plan.devices]
        for slot, handle in enumerate(handles):
            _ENGINES[handle] = engine
            _SLOTS[handle] = (calls, slot)
            _PLACES[handle] = place
        _MESH_PLANS[key] = plan
    return handles


def init_failed(error: BaseException, key: tuple[Any, ...]) -> int:
    """A handle naming ``error``, raised by an init in a compiled program on several devices,
    whose state an update traced with ``key`` (:func:`check_init`) or any use refuses."""
    logger.error("jax_mlpo: a jitted tx.init failed when its program ran: %r", error)
    with _LOCK:
        handle = _new_handle()
        _FAILED[handle] = error
        _CLOSED.add(handle)  # never drawn again
        _FAILED_KEYS[key] = error
    return handle


def init_succeeded(key: tuple[Any, ...]) -> None:
    """Forgets the failure of an earlier init of the same key."""
    with _LOCK:
        _FAILED_KEYS.pop(key, None)


def check_init(key: tuple[Any, ...]) -> None:
    """Raises the error of the last init of ``key`` if it failed inside its program."""
    error = _FAILED_KEYS.get(key)
    if error is not None:
        raise NoEngineError(_failed_message(error)) from error


def _failed_message(error: BaseException) -> str:
    return (f"the jitted tx.init that made this optimizer state failed when its program ran: "
            f"{type(error).__name__}: {error}")  # fmt: skip


def mesh_plan_for(key: tuple[Any, ...]) -> MeshPlan | None:
    """The plan of the mesh state an update traced with ``key`` updates, or None."""
    return _MESH_PLANS.get(key)


def key_of(handle: Any) -> int:
    """The int a handle array holds for this process."""
    # A multi-process state's handle is int32[processes], sharded: this process's is its shard.
    if isinstance(handle, jax.Array) and not handle.is_fully_addressable:
        handle = handle.addressable_shards[0].data
    return int(np.asarray(handle).reshape(-1)[0])


def engine(key: int) -> Engine:
    """The engine of handle ``key``.

    Raises:
      NoEngineError: no engine has it in this process (the message names the cause and fix).
    """
    try:
        return _ENGINES[key]
    except KeyError:
        if key in _FAILED:
            raise NoEngineError(_failed_message(_FAILED[key])) from _FAILED[key]
        if key == TEMPLATE:
            raise NoEngineError(_TEMPLATE) from None
        if key in _REPLACED:
            raise NoEngineError(
                f"the jax_mlpo optimizer with handle {key} was replaced: a later tx.init in "
                f"this process took its place ({_describe(_REPLACED[key])}) and closed it. "
                "Use the state that init returned (after a restore, the restored state); to "
                "hold two optimizers at once, give each its own tier directories (without "
                "tiers, its own OffloadConfig)"
            ) from None
        if key in _CLOSED:
            raise NoEngineError(
                f"the jax_mlpo optimizer with handle {key} was closed (jax_mlpo.close): "
                "init a new one (and restore its state from a checkpoint)"
            ) from None
        raise NoEngineError(_NOT_FOUND.format(key=key)) from None


def _describe(place: Place) -> str:
    if place[0] == "host":
        return "the same OffloadConfig, with no tiers"
    return "tiers " + ", ".join(repr(location) for _, location in place)


def update_failed(error: BaseException) -> None:
    """Records that an update raised ``error`` (reported to the caller through XLA)."""
    global _first_failure
    with _LOCK:
        if _first_failure is None:
            _first_failure = error


def open_handles() -> list[int]:
    """The handles of this process's open optimizers (a mesh optimizer has one per device)."""
    with _LOCK:
        return list(_ENGINES)


def slot(key: int) -> tuple[DeviceCalls, int] | None:
    """Where a mesh engine's device calls meet, and the device's slot; None off a mesh."""
    return _SLOTS.get(key)


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
    return engine(key_of(handle_of(_states(opt_state)[0])))


def mesh_plan_of(state: Any) -> MeshPlan | None:
    """The shards of an offloaded state over params on a mesh (:mod:`jax_mlpo.sharding.mesh`),
    or None (one device per process)."""
    found = _SLOTS.get(key_of(handle_of(state)))
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
        found = engine(key_of(handle_of(state)))
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
    _close_keys([key_of(handle_of(state)) for state in states])


def _close_keys(keys: list[int], replaced_by: Place | None = None) -> None:
    """Forgets the engines of ``keys`` (a mesh engine's every slot) and closes them."""
    for key in keys:
        with _LOCK:
            found = _ENGINES.pop(key, None)
            slots = [key] + [h for h, e in _ENGINES.items() if e is found]  # a mesh's slots
            for handle in slots:
                _ENGINES.pop(handle, None)
                _SLOTS.pop(handle, None)
                _PLACES.pop(handle, None)
                _CLOSED.add(handle)
                if replaced_by is not None:
                    _REPLACED[handle] = replaced_by
        if found is not None:
            found.close()


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


@atexit.register
def _release_at_exit() -> None:
    """Releases every engine's tiers when the interpreter exits, without flushing: the state
    on the tiers is never read back, so nothing is lost."""
    with _LOCK:
        engines = list({id(e): e for e in _ENGINES.values()}.values())
        _ENGINES.clear()
        _SLOTS.clear()
        _PLACES.clear()
    if _first_failure is not None:
        # one line, in case the loop never read an output of the failed step
        with contextlib.suppress(Exception):  # stderr may be closed by now
            print(
                "jax_mlpo: an optimizer update failed in this process "
                f"({type(_first_failure).__name__}, raised by the step)",
                file=sys.stderr,
            )
        _forget_failed_updates()
    for found in engines:
        try:
            found.close(flush=False)
        except Exception as e:  # noqa: BLE001 - nothing is left to save at exit
            logger.debug("jax_mlpo: releasing an engine at exit: %r", e)


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
