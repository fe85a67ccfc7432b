"""Params sharded over a mesh of several devices: one engine per process over its distinct shards.

A user's params may carry any ``NamedSharding``: any mesh shape and axis names, leaves split on
any dimensions, replicated or partly replicated. XLA runs the update's FFI call once per device
(inside ``jax.shard_map`` over the params' own mesh), each call with that device's shards.
The process runs one engine, whose layout holds every distinct shard of its devices once: a
shard held by several of them (a leaf replicated over a mesh axis) has one owner, the first of
those devices in mesh order. The state of each distinct shard is stored once per process, and
the other devices holding the shard receive a copy of the owner's update.

With several processes each does the same over its own devices (a shard held by two
processes is stored by both, as replicated leaves are in :mod:`jax_mlpo.sharding.processes`).

One engine per process rather than one per device, so that the host cache, the tiers'
directories and permits, the metrics and the checkpoints stay per process (as with one device
per process), and a replicated shard's update costs a copy, not a collective. The devices'
calls meet in :class:`DeviceCalls`: the last to arrive runs the engine over all of them, and
the others are left pending in XLA meanwhile (asynchronous FFI calls), not waiting on a
thread.

Example (one process, four CPU devices: ``JAX_NUM_CPU_DEVICES=4``)::

    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"))
    params = jax.device_put(params, NamedSharding(mesh, P("fsdp", "tensor")))
    tx = jax_mlpo.adamw(1e-3, offload=config)
    state = tx.init(params)               # one engine over the 4 distinct shards of each leaf
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlpo.sharding.processes import AXIS, leaf_spec

# How long a device's call waits for the others of its step. XLA starts them together, so a
# wait this long means one will never come (a program that runs the update on some devices
# only): fail with the reason instead of hanging the job.
WAIT_S = 600.0

Index = tuple[tuple[int, int], ...]  # a shard's [start, stop) per dimension of its leaf


@dataclasses.dataclass(frozen=True)
class LocalShard:
    """One distinct shard of a param leaf held by this process's devices.

    Attributes:
      leaf: the param leaf's index (in the params' flattened order).
      index: its ``[start, stop)`` per dimension in the global leaf.
      owner: the slot (:attr:`MeshPlan.devices`) whose buffers the engine reads and writes.
      replicas: the other slots holding the same shard: they get a copy of the update.
    """

    leaf: int
    index: Index
    owner: int
    replicas: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.index)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Where the shards of params sharded over a mesh are, for this process's engine.

    Attributes:
      mesh: the params' mesh.
      specs: each leaf's ``PartitionSpec``.
      shapes: each leaf's global shape.
      devices: this process's devices of the mesh, in mesh order: the calls' slots.
      shards: the distinct shards, leaf by leaf: the engine's layout leaves.
    """

    mesh: Mesh
    specs: tuple[P, ...]
    shapes: tuple[tuple[int, ...], ...]
    devices: tuple[jax.Device, ...]
    shards: tuple[LocalShard, ...]

    def shard_structs(self, params: Any) -> list[jax.ShapeDtypeStruct]:
        """The engine's leaves: one ``ShapeDtypeStruct`` per distinct shard."""
        leaves = jax.tree.leaves(params)
        return [jax.ShapeDtypeStruct(s.shape, leaves[s.leaf].dtype) for s in self.shards]

    def shard_flags(self, flags: Sequence[bool]) -> list[bool]:
        """Per-leaf flags (weight decay) as per-shard ones."""
        return [flags[s.leaf] for s in self.shards]

    def handle_array(self, handles: Sequence[int]) -> jax.Array:
        """An int32 array with one element per mesh device, each device's holding the handle
        of its slot (``handles[slot]``); other processes' elements are theirs."""
        sharding = NamedSharding(self.mesh, P(*self.mesh.axis_names))
        arrays = [
            jax.device_put(np.full((1,) * self.mesh.devices.ndim, h, np.int32), d)
            for d, h in zip(self.devices, handles, strict=True)
        ]
        return jax.make_array_from_single_device_arrays(self.mesh.devices.shape, sharding, arrays)

    def replicated(self, value: Any) -> jax.Array:
        """``value`` on every device of the mesh (the same in every process)."""
        sharding = NamedSharding(self.mesh, P())
        return jax.make_array_from_process_local_data(sharding, np.asarray(value))

    def is_data_parallel(self) -> bool:
        """Whether this is :mod:`jax_mlpo.sharding.processes`'s layout: a 1-D ``data`` mesh of one
        device per process in device order, each leaf split along its first dimension where it
        divides and replicated otherwise."""
        mesh = self.mesh
        if mesh.axis_names != (AXIS,) or list(mesh.devices.flat) != jax.devices():
            return False
        if len(self.devices) != 1:
            return False
        n = mesh.size
        return all(
            NamedSharding(mesh, spec).is_equivalent_to(
                NamedSharding(mesh, leaf_spec(shape, n)), len(shape)
            )
            for spec, shape in zip(self.specs, self.shapes, strict=True)
        )


def _normalised(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def mesh_plan(params: Any) -> MeshPlan | None:
    """The plan of params sharded over a mesh of several devices; None when every leaf lives
    on one device (the single-device update needs no plan).

    Args:
      params: a pytree of ``jax.Array`` (or ``jax.ShapeDtypeStruct`` with a ``sharding``).

    Raises:
      ValueError: for leaves on different meshes, or sharded other than by a
        ``NamedSharding``, naming the leaf and the fix.
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    shardings = [getattr(x, "sharding", None) for _, x in flat]
    if all(s is None or len(s.device_set) == 1 for s in shardings):
        return None
    mesh: Mesh | None = None
    specs = []
    for (path, _), s in zip(flat, shardings, strict=True):
        if not isinstance(s, NamedSharding):
            raise ValueError(
                f"param {jax.tree_util.keystr(path)} has sharding {s!r}: with params on several "
                "devices, jax_mlpo.adamw needs every leaf placed with a NamedSharding on one "
                "mesh (jax.device_put(x, NamedSharding(mesh, spec)))"
            )
        if mesh is None:
            mesh = s.mesh
        elif s.mesh != mesh:
            raise ValueError(
                f"param {jax.tree_util.keystr(path)} is on mesh {s.mesh.shape_tuple}, an earlier "
                f"leaf on {mesh.shape_tuple}: place every param on the same mesh"
            )
        specs.append(s.spec)
    assert mesh is not None
    me = jax.process_index()
    devices = tuple(d for d in mesh.devices.flat if d.process_index == me)
    slot = {d: k for k, d in enumerate(devices)}
    shards = []
    shapes = tuple(tuple(int(d) for d in np.shape(x)) for _, x in flat)
    for leaf, (shape, s) in enumerate(zip(shapes, shardings, strict=True)):
        holders: dict[Index, list[int]] = {}
        for device, index in s.devices_indices_map(shape).items():
            if device in slot:
                holders.setdefault(_normalised(index, shape), []).append(slot[device])
        for index, slots in sorted(holders.items(), key=lambda kv: min(kv[1])):
            slots.sort()
            shards.append(LocalShard(leaf, index, slots[0], tuple(slots[1:])))
    return MeshPlan(mesh, tuple(specs), shapes, devices, tuple(shards))


Call = tuple[int, np.ndarray, list[Any], list[Any], list[Any]]  # count, scalars, g, p, u
Run = Callable[[int, np.ndarray, list[Any], list[Any], list[Any]], None]
Complete = Callable[[BaseException | None], None]  # native.host_update.Completion


class DeviceCalls:
    """Where the update calls of a process's devices meet.

    Every call but the last of a step hands its buffers in and returns at once, its XLA call
    left pending; the last runs the engine over every distinct shard (the owners' buffers),
    copies each update to the shard's replicas, returns, and completes the pending calls with
    the same outcome. No XLA thread waits for another device: XLA sizes its thread pools to
    the devices one collective needs, and a thread held in a wait of ours could starve a
    collective another device is in (a job with a step's loss reduced beside the update does
    that). Each pending call completes on a thread of its own, since XLA goes on with that
    device's program on the completing thread.

    Args:
      plan: the shards.
      run: ``run(count, scalars, grads, params, updates)`` over the distinct shards (the
        engine's leaves).
      wait_s: how long the first call of a step waits for the last before the step fails.
    """

    def __init__(self, plan: MeshPlan, run: Run, wait_s: float = WAIT_S) -> None:
        self._plan, self._run, self._wait_s = plan, run, wait_s
        self._lock = threading.Lock()
        self._calls: dict[int, Call] = {}
        self._pending: dict[int, Complete] = {}
        self._timer: threading.Timer | None = None
        self._round = 0

    @property
    def plan(self) -> MeshPlan:
        return self._plan

    def arrive(self, slot: int, call: Call, complete: Complete) -> bool:
        """Hands in device ``slot``'s call of one update.

        Returns:
          True when the call is left pending (``complete`` will be called with the step's
          outcome); False when this was the step's last call and the update has run.

        Raises:
          Exception: in the last call, the update's own error (every pending call of the step
            fails with it too).
          RuntimeError: the slot called twice in one step.
        """
        with self._lock:
            if slot in self._calls:
                raise RuntimeError(f"device slot {slot} called the update twice in one step")
            self._calls[slot] = call
            if len(self._calls) < len(self._plan.devices):
                self._pending[slot] = complete
                if self._timer is None:
                    self._timer = threading.Timer(self._wait_s, self._expire, (self._round,))
                    self._timer.daemon = True
                    self._timer.start()
                return True
            calls, pending = self._take_round()
        try:
            self._run_round(calls)
            error = None
        except BaseException as e:  # noqa: BLE001 - handed to every call of the round
            error = e
        self._complete(pending, error)
        if error is not None:
            raise error  # in every device's call: XLA fails the update with its message
        return False

    def _take_round(self) -> tuple[dict[int, Call], dict[int, Complete]]:
        calls, pending = self._calls, self._pending
        self._calls, self._pending = {}, {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._round += 1
        return calls, pending

    def _expire(self, round_: int) -> None:
        with self._lock:
            if round_ != self._round or not self._calls:
                return
            arrived = len(self._calls)
            _, pending = self._take_round()
        self._complete(pending, RuntimeError(
            f"jax_mlpo: {arrived} of this process's {len(self._plan.devices)} devices ran the "
            f"update within {self._wait_s:.0f} s: every device of the params' mesh must run it "
            "(one jitted update over the whole mesh)"
        ))  # fmt: skip

    @staticmethod
    def _complete(pending: dict[int, Complete], error: BaseException | None) -> None:
        for complete in pending.values():
            threading.Thread(target=complete, args=(error,), daemon=True,
                             name="jax_mlpo-update-complete").start()  # fmt: skip

    def _run_round(self, calls: dict[int, Call]) -> None:
        counts = {c[0] for c in calls.values()}
        if len(counts) != 1:
            raise RuntimeError(f"the devices' update calls have different step counts {counts}")
        count, scalars = calls[0][0], calls[0][1]
        shards = self._plan.shards
        grads = [calls[s.owner][2][s.leaf] for s in shards]
        params = [calls[s.owner][3][s.leaf] for s in shards]
        updates = [calls[s.owner][4][s.leaf] for s in shards]
        self._run(count, scalars, grads, params, updates)
        for s, update in zip(shards, updates, strict=True):
            for r in s.replicas:
                np.copyto(calls[r][4][s.leaf], update)
