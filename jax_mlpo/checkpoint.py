"""Checkpoints of a training state that holds offloaded AdamW state, through orbax.

A jax_mlpo optimizer state is two int32 scalars on the device; AdamW's p, m and v live in the
engine's host cache and file tiers. :class:`OffloadCheckpointHandler` saves any pytree (params,
an ``optax.chain`` state, a dict of scalars) and replaces every
:class:`~jax_mlpo.OffloadedAdamWState` in it by the engine's state in the *logical* layout:

- ``count``: the step count (the offloaded state is at exactly this step);
- ``mu`` and ``nu``: float32 arrays of each parameter leaf's (global) shape;
- ``master``: the fp32 master copy of each bfloat16 leaf (None for float32 leaves).

Subgroups, tiers, host cache and process count are not part of a checkpoint, so it restores
into an optimizer with another ``subgroup_size``, tier list or ``host_cache``, and onto any
number of processes. Everything else in the tree (clipping and schedule states, the ``count``
scalars of ``optax.chain`` members) is saved as it is.

Several processes (``jax.distributed``, see :mod:`jax_mlpo.distributed`): the checkpoint is
still the global logical state, written the way orbax writes sharded ``jax.Array``s. Each
process contributes the shards it owns: its rows of every params leaf and of ``mu``, ``nu`` and
``master`` (as global arrays with the params' ``data`` sharding, written by orbax into
``ocdbt.process_<k>`` and merged into one array store when the checkpoint is finalized); the
replicated leaves and the scalars are written once, by process 0. On restore each process reads
only the saved shards that overlap its own (whole, to verify them; with 2 processes saved and 4
restoring, each reads the saved half holding its quarter) and loads only its shards into its
engine, whatever the process count, subgroups and tiers of the restoring run.

Each item also holds ``jax_mlpo_checksums.json``: a sha256 of every leaf as saved (dtype, shape
and bytes) or, for a leaf saved sharded, of every shard (with its index), the manifest itself
sealed by a sha256. Orbax's array files carry no checksum of their own (a flipped byte in an
array's data reads back as a different value); restore recomputes the digest of every shard it
reads and raises :class:`CorruptCheckpointError` on any difference, so what restores is bit for
bit what was saved. With several processes, each writes the digests of what it wrote into
``jax_mlpo_checksums.process_<k>.json``; process 0 merges them into the manifest when orbax
finalizes the checkpoint (after every process's writes), and a failed verification on any
process fails the restore on every process.

Crash safety and durability: the state is snapshotted synchronously in ``save`` (the next
update may then run while the snapshot is written in the background), written into orbax's
temporary directory and published by orbax's atomic rename once every file is written
(tensorstore fsyncs array files; the manifest is fsynced). A process killed at any moment leaves
the previous checkpoints as they were and at most a temporary directory, which
``CheckpointManager`` never returns as a step (and removes at start with
``cleanup_tmp_directories``). A checkpoint is durable once
``manager.wait_until_finished()`` returns (or the next save has started: orbax waits for the
previous one first). Tiers are never read back after a crash: restoring into a freshly
``tx.init``-ed optimizer re-creates them and writes the checkpointed state into them.

The snapshot holds the (process's share of the) optimizer state in host memory for the duration
of the write (12 bytes per parameter with bfloat16 params, 8 with float32).

Example (``tx`` an ``optax.chain`` holding ``jax_mlpo.adamw``)::

  mngr = jax_mlpo.checkpoint.manager("/ckpt/run1", max_to_keep=2)
  ...  # after update k:
  jax_mlpo.checkpoint.save(mngr, k, params, opt_state, {"data_step": k})
  ...  # in a new process (or processes), with any OffloadConfig:
  opt_state = tx.init(params)
  step, params, opt_state, extra = jax_mlpo.checkpoint.restore(mngr, params, opt_state)

The pieces compose with any orbax ``CheckpointManager``: ``OffloadSave(tree, params=...)`` and
``OffloadRestore(target)`` are the args of :class:`OffloadCheckpointHandler`, e.g. as items of
``ocp.args.Composite`` next to the caller's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src import asyncio_utils

from jax_mlpo import distributed, transform
from jax_mlpo.engine import EngineFailedError, StaleStateError
from jax_mlpo.kernels import F32
from jax_mlpo.transform import OffloadedAdamWState

CHECKSUMS_FILE = "jax_mlpo_checksums.json"
PROCESS_CHECKSUMS_FILE = "jax_mlpo_checksums.process_{}.json"  # merged into CHECKSUMS_FILE
FORMAT = 2  # 2: a leaf saved sharded has a sha256 per shard ("shards"); 1: one per leaf
READABLE_FORMATS = (1, 2)

Index = tuple[tuple[int, int], ...]  # a block of an array: [start, stop) per dimension


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's contents differ from what was saved (or it is incomplete)."""


# -- the tree in host memory ---------------------------------------------------------------------


def _is_offloaded(x: Any) -> bool:
    return isinstance(x, OffloadedAdamWState)


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # flax.nnx variables wrap the arrays


def _engine_of(state: OffloadedAdamWState):
    return transform._engine(_value(state.handle))


def _is_key(x: Any) -> bool:
    """A typed PRNG key array (optax.add_noise's state): saved as its uint32 key data."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _is_sharded(x: Any) -> bool:
    """A global array of which this process holds only some shards (a multi-process run)."""
    return isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)


def check_savable(tree: Any) -> None:
    """Raises unless every offloaded state in ``tree`` is the current one of a healthy engine.

    Waits for the updates in flight (their ordered host callbacks) first.

    Args:
      tree: a pytree that may hold offloaded AdamW states (e.g. an ``optax.chain`` state).

    Raises:
      EngineFailedError: an update failed midway; the offloaded state is partly updated.
      StaleStateError: a state is not the one its engine was last advanced to.
    """
    states = [s for s in jax.tree.leaves(tree, is_leaf=_is_offloaded) if _is_offloaded(s)]
    for _ in range(2):  # before the barrier (which re-raises the failure less clearly), after
        if any(_engine_of(s).failed for s in states):
            raise EngineFailedError(
                "an update of this optimizer failed midway, so its offloaded state is partly "
                "updated and cannot be checkpointed. Restore from your last checkpoint (into a "
                "new tx.init) and continue from there."
            )
        jax.effects_barrier()
    for state in states:
        count, step = int(np.asarray(_value(state.count))), _engine_of(state).step_count
        if count != step:
            raise StaleStateError(
                f"the optimizer state to save is at step {count}, but its offloaded state is "
                f"at step {step}: save the state returned by the last update"
            )


def _global_shapes(engine: Any, params: Any) -> list[tuple[int, ...]]:
    """The global shape of each leaf of a multi-process engine, which holds local shards only."""
    if params is None:
        raise ValueError(
            "in a multi-process run, an offloaded optimizer state is saved with its params "
            "(OffloadSave(opt_state, params=params); jax_mlpo.checkpoint.save does it): each "
            "process's engine holds only its shards, and the params give the global shapes"
        )
    shapes = [tuple(int(d) for d in np.shape(x)) for x in jax.tree.leaves(params)]
    local = tuple(distributed.local_shape(s, jax.process_count()) for s in shapes)
    if local != engine.layout.shapes:
        raise ValueError(
            f"the params saved with the optimizer state have leaves of shapes {shapes[:8]}, "
            f"whose shards {list(local[:8])} are not the optimizer's "
            f"{list(engine.layout.shapes[:8])}: pass the params it was initialised with"
        )
    return shapes


def _global_state(
    state: dict[str, list[np.ndarray | None]], shapes: list[tuple[int, ...]]
) -> dict[str, list[Any]]:
    """This process's ``state_dict`` (its shards) as global arrays sharded like the params.

    orbax then writes each process's shards, as it does for any sharded ``jax.Array``. A leaf
    that is replicated over the processes stays a host array: every process holds the same
    state for it, and orbax writes host arrays once, from process 0.
    """
    mesh = distributed.data_parallel_mesh()
    n = mesh.shape[distributed.AXIS]

    def put(local: np.ndarray | None, shape: tuple[int, ...]) -> Any:
        spec = distributed.leaf_spec(shape, n)
        if local is None or spec == P():
            return local
        sharding = _in_host_memory(NamedSharding(mesh, spec))
        return jax.make_array_from_process_local_data(sharding, local, shape)

    return {
        name: [put(a, s) for a, s in zip(leaves, shapes, strict=True)]
        for name, leaves in state.items()
    }


def _in_host_memory(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """``sharding`` in the devices' pinned host memory, where they have one.

    A snapshot must not take accelerator memory (the offloaded state is there because it does
    not fit); orbax writes arrays in host memory as it writes any other.
    """
    device = next(iter(sharding.addressable_devices))
    if any(m.kind == "pinned_host" for m in device.addressable_memories()):
        return sharding.with_memory_kind("pinned_host")
    return sharding


def _host_copy(x: jax.Array) -> jax.Array:
    """A copy of this process's shards of ``x``, the caller's later updates cannot change."""
    # device buffers may be donated to the next update
    sharding = _in_host_memory(x.sharding)
    shards = []
    for shard in x.addressable_shards:
        where = jax.sharding.SingleDeviceSharding(shard.device, memory_kind=sharding.memory_kind)
        shards.append(jax.device_put(np.array(shard.data), where))
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def _snapshot(tree: Any, params: Any = None) -> Any:
    """``tree`` in host memory, offloaded states in the logical layout; a copy the caller's
    later updates cannot change. In a multi-process run, what this process holds of each
    sharded leaf stays a (sharded) global array; ``params`` give the offloaded leaves' global
    shapes."""
    multiprocess = distributed.is_multiprocess()

    def convert(x: Any) -> Any:
        if _is_offloaded(x):
            engine = _engine_of(x)
            state = engine.state_dict()  # fresh arrays, from the cache and the tiers
            if multiprocess:
                state = _global_state(state, _global_shapes(engine, params))
            return {"count": np.array(_value(x.count), np.int32), **state}
        if _is_key(x):
            x = jax.random.key_data(x)
        if _is_sharded(x):
            return _host_copy(x)
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            return np.array(x)  # a copy: device buffers may be donated, numpy ones reused
        return x

    check_savable(tree)
    return jax.tree.map(convert, tree, is_leaf=_is_offloaded)


# -- the checksum manifest -----------------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaves(tree: Any) -> dict[str, Any]:
    """Leaves by path (``"1/0/mu/3"``), the same for a tree and orbax's dict form of it."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in flat}


def _describe(leaf: Any) -> dict[str, Any]:
    a = np.asarray(leaf)
    digest = hashlib.sha256(f"{a.dtype.name}{a.shape}".encode())
    if a.dtype.kind in "OUS" or not a.flags.c_contiguous:
        digest.update(a.tobytes())
    else:  # no copy (bfloat16 has no buffer protocol of its own)
        digest.update(a.reshape(-1).view(np.uint8))
    return {"dtype": a.dtype.name, "shape": list(a.shape), "sha256": digest.hexdigest()}


def _full(shape: tuple[int, ...] | list[int]) -> Index:
    return tuple((0, int(n)) for n in shape)


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A shard's index as jax gives it (a tuple of slices) as an :data:`Index`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _contains(outer: Index, inner: Index) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner, strict=True))


def _relative(outer: Index, inner: Index) -> tuple[slice, ...]:
    """The slices of ``inner`` in an array holding the block ``outer``."""
    return tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, inner, strict=True))


def _volume(index: Index) -> int:
    return math.prod(b - a for a, b in index)


def _tiles(shape: list[int], indexes: list[Index]) -> bool:
    """Whether the blocks ``indexes`` cover an array of ``shape`` exactly once."""
    full = _full(shape)
    if any(len(i) != len(full) or not _contains(full, i) for i in indexes):
        return False
    if sum(map(_volume, indexes)) != _volume(full):
        return False
    if len(indexes) <= 1:
        return True
    if all(i[1:] == full[1:] for i in indexes):  # split along the first dimension: sorted runs
        rows = sorted(i[0] for i in indexes if _volume(i))
        return all(a[1] <= b[0] for a, b in zip(rows, rows[1:], strict=False))
    return not any(  # general blocks: pairwise disjoint (and the volumes add up)
        all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(x, y, strict=True))
        for k, x in enumerate(indexes)
        for y in indexes[k + 1 :]
    )


def _seal(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _written_shards(leaf: Any) -> list[dict[str, Any]]:
    """sha256s of the parts of ``leaf`` that this process writes.

    orbax's rule: a sharded array's shards are written by the processes holding their replica
    0, host arrays and scalars by process 0.
    """
    if isinstance(leaf, jax.Array):
        return [
            {
                "index": [list(r) for r in _index(s.index, leaf.shape)],
                "sha256": _describe(s.data)["sha256"],
            }
            for s in leaf.addressable_shards
            if s.replica_id == 0
        ]
    if jax.process_index() != 0:
        return []
    described = _describe(leaf)
    return [{"index": [list(r) for r in _full(described["shape"])], "sha256": described["sha256"]}]


def _process_manifest(host: Any) -> dict[str, Any]:
    """The digests of what this process writes of the host tree, sealed."""
    leaves = {}
    for name, leaf in _leaves(host).items():
        a = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
        leaves[name] = {
            "dtype": np.dtype(a.dtype).name,
            "shape": [int(d) for d in a.shape],
            "shards": _written_shards(leaf),
        }
    body = {
        "format": FORMAT,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "leaves": leaves,
    }
    return {**body, "sha256": _seal(body)}


def _merge(partials: list[dict[str, Any]], where: Any) -> dict[str, Any]:
    """The manifest of a checkpoint from every writing process's digests, sealed.

    A leaf written whole gets one sha256 (as in format 1); a leaf written in shards, a sha256
    per shard with its index.

    Raises:
      CorruptCheckpointError: the processes disagree on the leaves, or the shards of a leaf do
        not cover it exactly once.
    """
    leaves: dict[str, dict[str, Any]] = {}
    for partial in partials:
        if leaves and set(partial["leaves"]) != set(leaves):
            raise CorruptCheckpointError(
                f"{where}: process {partial['process']} saved other leaves than process "
                f"{partials[0]['process']} ({sorted(set(partial['leaves']) ^ set(leaves))[:8]})"
            )
        for name, record in partial["leaves"].items():
            merged = leaves.setdefault(
                name, {"dtype": record["dtype"], "shape": record["shape"], "shards": []}
            )
            if (merged["dtype"], merged["shape"]) != (record["dtype"], record["shape"]):
                raise CorruptCheckpointError(
                    f"{where}: leaf {name} is {record['dtype']}{record['shape']} on process "
                    f"{partial['process']}, {merged['dtype']}{merged['shape']} on another"
                )
            merged["shards"].extend(record["shards"])
    for name, record in leaves.items():
        shards = sorted(record.pop("shards"), key=lambda s: s["index"])
        if not _tiles(record["shape"], [_as_index(s["index"]) for s in shards]):
            raise CorruptCheckpointError(
                f"{where}: the saved shards of leaf {name} do not cover it exactly once "
                f"({[s['index'] for s in shards][:8]})"
            )
        if len(shards) == 1:  # written whole
            record["sha256"] = shards[0]["sha256"]
        else:
            record["shards"] = shards
    body = {"format": FORMAT, "leaves": leaves}
    return {**body, "sha256": _seal(body)}


def _as_index(rows: list[list[int]]) -> Index:
    return tuple((int(a), int(b)) for a, b in rows)


def _saved_shards(record: dict[str, Any]) -> list[tuple[Index, str]]:
    """A manifest record's shards: (index, sha256); one covering the leaf if saved whole."""
    if "shards" in record:
        return [(_as_index(s["index"]), s["sha256"]) for s in record["shards"]]
    return [(_full(record["shape"]), record["sha256"])]


def _write_synced(path: epath.Path, text: str) -> None:
    with open(os.fspath(path), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read_sealed(path: epath.Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The body of a sealed JSON file (the ``keys`` of it), checked against its sha256."""
    try:
        content = json.loads(path.read_text())
        body = {k: content[k] for k in keys}
        sealed = content["sha256"]
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing: {path.parent} was not written by jax_mlpo.checkpoint, or is "
            "incomplete. Restore another step."
        ) from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not a valid checksum manifest ({e!r})") from None
    if _seal(body) != sealed:
        raise CorruptCheckpointError(f"{path} is corrupt: its own sha256 does not match")
    return body


def _merge_process_manifests(directory: epath.Path) -> None:
    """Merges the processes' digests into the item's manifest (process 0, at finalize)."""
    first = directory / PROCESS_CHECKSUMS_FILE.format(0)
    if not first.exists():
        return  # saved by a single process: the manifest is written already
    keys = ("format", "process", "processes", "leaves")
    partials = [_read_sealed(first, keys)]
    paths = [directory / PROCESS_CHECKSUMS_FILE.format(k) for k in range(partials[0]["processes"])]
    partials += [_read_sealed(path, keys) for path in paths[1:]]
    _write_synced(directory / CHECKSUMS_FILE, json.dumps(_merge(partials, directory)))
    for path in paths:
        path.unlink()


def _read_manifest(directory: epath.Path) -> dict[str, Any]:
    path = directory / CHECKSUMS_FILE
    body = _read_sealed(path, ("format", "leaves"))
    if body["format"] not in READABLE_FORMATS:
        raise CorruptCheckpointError(
            f"{path}: format {body['format']!r}; this jax_mlpo reads formats {READABLE_FORMATS}"
        )
    try:
        for name, record in body["leaves"].items():
            if not _tiles(record["shape"], [index for index, _ in _saved_shards(record)]):
                raise CorruptCheckpointError(
                    f"{path}: the shards of leaf {name} do not cover it exactly once"
                )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is not a valid checksum manifest ({e!r})") from None
    return body


# -- restoring -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Want:
    """A leaf to restore: its dtype and global shape, what this process needs and reads of it."""

    dtype: np.dtype
    shape: tuple[int, ...] | None  # None: an offloaded state's leaf; the manifest has it
    local: tuple[int, ...] | None = None  # an offloaded state's leaf: its shape in the engine
    # the leaf's sharding where this process needs only its shards; None: it needs it all
    sharding: jax.sharding.Sharding | None = None
    read: jax.sharding.Sharding | None = None  # how it is read (see _read_sharding); None: whole


@dataclasses.dataclass
class _Read:
    """What this process read of one leaf: blocks of it, each made of whole saved shards."""

    shape: tuple[int, ...]
    blocks: list[tuple[Index, np.ndarray]]
    value: Any = None  # the value orbax returned, when read whole

    def part(self, index: Index) -> np.ndarray:
        """The block ``index`` of the leaf (a view of what was read)."""
        for where, data in self.blocks:
            if _contains(where, index):
                return data[_relative(where, index)]
        raise AssertionError(f"block {index} of a leaf of shape {self.shape} was not read")

    def whole(self) -> Any:
        return self.value if self.value is not None else self.part(_full(self.shape))


def _abstract(target: Any) -> Any:
    """The host tree a checkpoint of ``target`` holds, with a :class:`_Want` per array leaf."""

    def need(x: Any) -> jax.sharding.Sharding | None:
        sharding = getattr(x, "sharding", None)
        return sharding if sharding is not None and not sharding.is_fully_addressable else None

    def convert(x: Any) -> Any:
        if _is_offloaded(x):
            layout = _engine_of(x).layout
            return {
                "count": _Want(np.dtype(np.int32), ()),
                "mu": [_Want(F32, None, shape) for shape in layout.shapes],
                "nu": [_Want(F32, None, shape) for shape in layout.shapes],
                "master": [
                    _Want(F32, None, shape) if dt != F32 else None
                    for shape, dt in zip(layout.shapes, layout.dtypes, strict=True)
                ],
            }
        if _is_key(x):
            x = jax.eval_shape(jax.random.key_data, x)
            return _Want(np.dtype(x.dtype), tuple(x.shape))  # small: read whole everywhere
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
            return _Want(np.dtype(x.dtype), tuple(x.shape), sharding=need(x))
        return x

    return jax.tree.map(convert, target, is_leaf=_is_offloaded)


def _check_structure(wanted: dict[str, Any], manifest: dict[str, Any], directory: Any) -> None:
    """Fills in the offloaded states' global shapes; fails, naming the leaves, if the target's
    leaves are not the checkpoint's."""
    saved = manifest["leaves"]
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    if missing or extra:
        raise ValueError(
            f"checkpoint {directory} does not fit the target tree: leaves only in the target "
            f"{missing[:8]}, only in the checkpoint {extra[:8]}. Restore into the same model "
            "and optimizer structure (and param dtypes: bfloat16 leaves carry a master copy)."
        )
    n = jax.process_count()
    for name, want in wanted.items():
        if not isinstance(want, _Want):
            continue
        got = (saved[name]["dtype"], list(saved[name]["shape"]))
        if want.shape is None:  # an offloaded state's leaf: this process's shard of got's shape
            shape = tuple(got[1])
            if distributed.local_shape(shape, n) != want.local:
                raise ValueError(
                    f"checkpoint {directory}: leaf {name} is {got[0]}{got[1]}, whose shard on "
                    f"each of {n} processes is {list(distributed.local_shape(shape, n))}; the "
                    f"target optimizer's is {list(want.local)}"
                )
            want.shape = shape
            if n > 1:  # the optimizer's engine holds its shards of the leaf
                mesh = distributed.data_parallel_mesh()
                want.sharding = NamedSharding(mesh, distributed.leaf_spec(shape, n))
        if (want.dtype.name, list(want.shape)) != got:
            raise ValueError(
                f"checkpoint {directory}: leaf {name} is {got[0]}{got[1]}, the target's is "
                f"{want.dtype.name}{list(want.shape)}"
            )


def _read_sharding(want: _Want, shards: list[tuple[Index, str]]) -> jax.sharding.Sharding | None:
    """How a leaf is read, so that each process reads whole saved shards, only those it needs.

    Where the leaf was saved in ``s`` equal shards along its first dimension and is needed in
    ``t`` such shards, each device reads the block of ``1/gcd(s, t)`` of the leaf holding the
    shard it needs: a union of whole saved shards (so their sha256s can be checked) and, with
    ``s`` a multiple of ``t``, exactly what it needs. Returns that sharding, or None where
    every process reads the whole leaf (it needs it all, it was saved whole, or the shards are
    not such slices).
    """
    if want.sharding is None or len(shards) < 2 or not want.shape:
        return None
    shape, rows = want.shape, want.shape[0]
    rest = _full(shape)[1:]

    def slices(indexes: list[Index]) -> int | None:
        """k if ``indexes`` are the k equal slices along the first dimension, else None."""
        k = len(indexes)
        if rows % k:
            return None
        size = rows // k
        expect = [((j * size, (j + 1) * size), *rest) for j in range(k)]
        return k if sorted(indexes) == expect else None

    needs = {d: _index(i, shape) for d, i in want.sharding.devices_indices_map(shape).items()}
    s, t = slices([index for index, _ in shards]), slices(sorted(set(needs.values())))
    if s is None or t is None or math.gcd(s, t) == 1:
        return None
    g = math.gcd(s, t)
    groups: list[list[jax.Device]] = [[] for _ in range(g)]
    for device, index in sorted(needs.items(), key=lambda item: item[0].id):
        groups[index[0][0] // (rows // g)].append(device)
    if len({len(group) for group in groups}) != 1:
        return None
    return NamedSharding(Mesh(np.array(groups), ("block", "replica")), P("block"))


def _as_read(value: Any) -> _Read:
    """A leaf orbax restored: this process's blocks of a sharded array, or the whole value."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        blocks = {_index(s.index, value.shape): s.data for s in value.addressable_shards}
        return _Read(tuple(value.shape), [(i, np.asarray(d)) for i, d in blocks.items()])
    a = np.asarray(value)
    return _Read(a.shape, [(_full(a.shape), a)], value)


def _verify(read: dict[str, _Read], manifest: dict[str, Any], directory: Any) -> None:
    """Checks every saved shard this process read against its sha256.

    Raises:
      CorruptCheckpointError: a leaf or shard differs from its sha256, or a block read is not
        covered by the manifest's shards.
    """
    saved = manifest["leaves"]
    if set(read) != set(saved):
        raise CorruptCheckpointError(
            f"checkpoint {directory}: restored leaves {sorted(set(read) ^ set(saved))[:8]} "
            "differ from the checksum manifest's"
        )
    for name, leaf in read.items():
        shards = _saved_shards(saved[name])
        for where, data in leaf.blocks:
            checked = 0
            for index, sha256 in shards:
                if not _contains(where, index):
                    continue
                part = data[_relative(where, index)]
                if _describe(part)["sha256"] != sha256:  # the digest covers dtype and shape
                    shard = "" if index == _full(saved[name]["shape"]) else f" (shard {index})"
                    raise CorruptCheckpointError(
                        f"checkpoint {directory}: leaf {name}{shard} does not match its sha256 "
                        "(the checkpoint is corrupt: a changed or half-written file). Restore "
                        "another step."
                    )
                checked += _volume(index)
            if checked != _volume(where):
                raise CorruptCheckpointError(
                    f"checkpoint {directory}: leaf {name}: block {where} read is not covered by "
                    "the manifest's shards"
                )


def _like(target: Any, read: _Read) -> Any:
    """``read`` as the kind of leaf ``target`` is (device array, numpy, scalar)."""
    sharding = getattr(target, "sharding", None)
    if isinstance(target, jax.Array | jax.ShapeDtypeStruct) and sharding is not None:
        if sharding.is_fully_addressable:
            value = jax.device_put(read.whole(), sharding)
        else:  # each process places its shards, from the blocks it read
            value = jax.make_array_from_callback(
                read.shape, sharding, lambda idx: read.part(_index(idx, read.shape))
            )
    elif isinstance(target, jax.Array | jax.ShapeDtypeStruct):
        value = jax.device_put(read.whole())
    elif isinstance(target, np.generic):
        return target.dtype.type(read.whole())
    else:
        return read.whole()
    if _is_key(target):
        value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(target))
    return value


def _local(want: _Want, read: _Read) -> np.ndarray:
    """This process's shard of an offloaded state's leaf, as its engine holds it."""
    if want.sharding is None:
        return read.whole()
    indexes = want.sharding.addressable_devices_indices_map(want.shape).values()
    (index,) = {_index(i, want.shape) for i in indexes}  # one device per process
    return read.part(index)


def _load(target: Any, wants: Any, reads: Any) -> Any:
    """Loads restored offloaded states into ``target``'s engines; leaves as ``target``'s."""

    def load(t: Any, w: Any, r: Any) -> Any:
        if _is_offloaded(t):
            count = int(r["count"].whole())
            state = {
                name: [
                    _local(want, read) if want is not None else None  # fp32 leaves: no master
                    for want, read in zip(w[name], r[name], strict=True)
                ]
                for name in ("mu", "nu", "master")
            }
            _engine_of(t).load_state_dict(count, state)
            count = _like(_value(t.count), r["count"])
            return OffloadedAdamWState(count=count, handle=t.handle)
        return _like(t, r)

    return jax.tree.map(load, target, wants, reads, is_leaf=_is_offloaded)


def _agree(error: BaseException | None, directory: Any) -> None:
    """Raises on every process if restoring failed on any, so that none goes on alone.

    Raises:
      CorruptCheckpointError: this or another process found the checkpoint corrupt.
      RuntimeError: restoring failed on another process (for another reason).
    """
    if jax.process_count() > 1:
        code = 0 if error is None else 1 if isinstance(error, CorruptCheckpointError) else 2
        codes = np.asarray(multihost_utils.process_allgather(np.int32(code))).reshape(-1)
        failed = [k for k, c in enumerate(codes.tolist()) if c]
        if error is None and failed:
            message = f"checkpoint {directory}: restoring failed on process(es) {failed}"
            if 1 in codes.tolist():
                raise CorruptCheckpointError(f"{message}: the checkpoint is corrupt")
            raise RuntimeError(f"{message} (see their errors)")
    if error is not None:
        raise error


# -- the orbax handler ---------------------------------------------------------------------------


class OffloadCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores a pytree that may hold offloaded AdamW states, checksummed.

    ``async_save`` snapshots the tree synchronously (device arrays copied to the host, every
    :class:`~jax_mlpo.OffloadedAdamWState` replaced by its engine's ``state_dict`` at that
    step; with several processes, each process's shards as global sharded arrays), then writes
    it with orbax's ``PyTreeCheckpointHandler`` and computes and writes the sha256 manifest in
    the background. ``restore`` needs the target tree (for the engines to load into) except for
    trees without offloaded states; it verifies every shard it reads.
    """

    def __init__(self) -> None:
        self._tree = ocp.PyTreeCheckpointHandler()

    async def async_save(
        self, directory: epath.Path, args: OffloadSave | None = None, **kwargs: Any
    ) -> list[ocp.future.Future]:
        """Snapshots ``args.item`` now; returns the futures that write it.

        Args:
          directory: the item's directory (orbax's temporary one).
          args: ``OffloadSave(tree, params=...)``.

        Returns:
          The futures writing the arrays and the manifest.

        Raises:
          StaleStateError: if an offloaded state is not the one its engine was last advanced to.
          EngineFailedError: if an update failed midway (the state is inconsistent).
          ValueError: in a multi-process run, for an offloaded state without its params.
        """
        if not isinstance(args, OffloadSave):
            raise ValueError(
                "pass the item as args=jax_mlpo.checkpoint.OffloadSave(tree), got "
                f"{type(args).__name__} (and {sorted(kwargs)})"
            )
        # the format leaf keeps orbax from refusing a tree without leaves (optax.sgd's state)
        host = {"format": FORMAT, "tree": _snapshot(args.item, args.params)}
        futures = await self._tree.async_save(directory, args=ocp.args.PyTreeSave(host))
        checksums = ocp.future.CommitFutureAwaitingContractedSignals(
            self._write_manifest(directory, host), name="jax_mlpo_checksums"
        )
        return [*(futures or []), checksums]

    async def _write_manifest(self, directory: Any, host: Any) -> None:
        # Every process digests what it writes; with several, process 0 merges them at finalize,
        # once orbax has seen every process's writes complete.
        digests = _process_manifest(host)
        if jax.process_count() == 1:
            name, content = CHECKSUMS_FILE, _merge([digests], directory)
        else:
            name, content = PROCESS_CHECKSUMS_FILE.format(jax.process_index()), digests
        text = json.dumps(content, sort_keys=True)
        if hasattr(directory, "await_creation"):
            directory = await directory.await_creation()
        _write_synced(directory / name, text)

    def save(self, directory: epath.Path, args: OffloadSave | None = None, **kwargs: Any) -> None:
        """Like :meth:`async_save`, returning once everything is written."""
        for future in asyncio_utils.run_sync(self.async_save(directory, args, **kwargs)):
            future.result()

    def restore(self, directory: epath.Path, args: OffloadRestore | None = None) -> Any:
        """Restores the tree saved in ``directory``, verified against its checksums.

        Args:
          directory: the item's directory.
          args: ``OffloadRestore(target)``. Offloaded states in ``target`` (from ``tx.init``,
            with any offload config and process count) get the checkpoint's state loaded into
            their engines (each process its shards); device arrays come back on the target's
            shardings. Without a target, the saved tree comes back in orbax's dict form (only
            for trees without offloaded states or sharded arrays).

        Returns:
          The restored tree, of ``target``'s structure.

        Raises:
          CorruptCheckpointError: a leaf or shard, or the manifest, does not match its sha256
            (on every process, whichever found it).
          ValueError: the checkpoint's leaves, dtypes or shapes differ from the target's.
        """
        target = args.item if args is not None else None
        error, restored = None, None
        try:
            manifest = _read_manifest(directory)
            if target is None:
                restored = self._tree.restore(directory)
                reads = {name: _as_read(leaf) for name, leaf in _leaves(restored).items()}
                _verify(reads, manifest, directory)
                restored = restored.get("tree", {})  # orbax leaves out an empty subtree
            else:
                restored = self._restore_into(directory, target, manifest)
        except Exception as e:  # noqa: BLE001 - raised below, once every process knows
            error = e
        _agree(error, directory)
        return restored

    def _restore_into(self, directory: epath.Path, target: Any, manifest: dict[str, Any]) -> Any:
        host_target = {"format": FORMAT, "tree": _abstract(target)}
        wanted = _leaves(host_target)
        _check_structure(wanted, manifest, directory)
        for name, want in wanted.items():
            if isinstance(want, _Want):
                want.read = _read_sharding(want, _saved_shards(manifest["leaves"][name]))

        def item(w: Any) -> Any:
            if not isinstance(w, _Want):
                return w
            if w.read is None:
                return np.empty(w.shape, w.dtype)  # not touched: no memory
            return jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.read)

        def restore_args(w: Any) -> ocp.RestoreArgs:
            if not isinstance(w, _Want):
                return ocp.RestoreArgs()
            if w.read is None:
                return ocp.RestoreArgs(restore_type=np.ndarray)
            return ocp.ArrayRestoreArgs(sharding=w.read, global_shape=w.shape, dtype=w.dtype)

        restored = self._tree.restore(
            directory,
            args=ocp.args.PyTreeRestore(
                item=jax.tree.map(item, host_target),
                restore_args=jax.tree.map(restore_args, host_target),
            ),
        )
        reads = jax.tree.map(_as_read, restored)
        _verify(_leaves(reads), manifest, directory)
        return _load(target, host_target["tree"], reads["tree"])

    def metadata(self, directory: epath.Path) -> dict[str, Any]:
        """The saved leaves' dtypes, shapes and sha256s by path, without reading arrays."""
        return _read_manifest(directory)["leaves"]

    def finalize(self, directory: epath.Path) -> None:
        """orbax's finalize (process 0, after every process wrote): merges the manifests."""
        self._tree.finalize(directory)
        _merge_process_manifests(directory)

    def close(self) -> None:
        self._tree.close()


@ocp.args.register_with_handler(OffloadCheckpointHandler, for_save=True)
@dataclasses.dataclass
class OffloadSave(ocp.args.CheckpointArgs):
    """Save args of :class:`OffloadCheckpointHandler`.

    Attributes:
      item: the tree to save (params, opt_state, scalars).
      params: the params the offloaded states in ``item`` were initialised with (arrays or
        ``jax.ShapeDtypeStruct``); needed in a multi-process run, where they give the global
        shapes of the leaves whose shards each process's engine holds.
    """

    item: Any
    params: Any = None


@ocp.args.register_with_handler(OffloadCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class OffloadRestore(ocp.args.CheckpointArgs):
    """Restore args of :class:`OffloadCheckpointHandler`: the target tree, or None."""

    item: Any = None


# -- a training checkpoint: params, optimizer state, extra ---------------------------------------


class Restored(NamedTuple):
    """What :func:`restore` returns: the checkpoint's step and the restored trees."""

    step: int
    params: Any
    opt_state: Any
    extra: dict[str, Any]


def manager(
    directory: str | os.PathLike,
    *,
    max_to_keep: int | None = 2,
    async_save: bool = True,
    **options: Any,
) -> ocp.CheckpointManager:
    """An orbax ``CheckpointManager`` for :func:`save` and :func:`restore`.

    Args:
      directory: where the step directories go (created).
      max_to_keep: checkpoints kept (oldest deleted first); None keeps all.
      async_save: write in the background (``save`` returns after the snapshot).
      **options: more ``ocp.CheckpointManagerOptions`` fields.
    """
    options.setdefault("cleanup_tmp_directories", True)  # leftovers of a killed save
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, **options
        ),
    )


def save(
    mngr: ocp.CheckpointManager,
    step: int,
    params: Any,
    opt_state: Any,
    extra: dict[str, Any] | None = None,
    *,
    force: bool = False,
) -> bool:
    """Saves params, the optimizer state and ``extra`` as checkpoint ``step``.

    Call it between updates with the params and state the last update returned. It returns
    once the state is snapshotted in host memory (the next update may run); with an async
    manager the files are written in the background, and the checkpoint is durable once
    ``mngr.wait_until_finished()`` returns. See the module docstring for the contents. With
    several processes, every process calls it (orbax saves collectively); each writes its
    shards, and the checkpoint holds the global state.

    Args:
      mngr: from :func:`manager` (or any ``ocp.CheckpointManager``).
      step: the checkpoint's step, usually the number of updates applied.
      params: the params pytree.
      opt_state: the optimizer state (e.g. an ``optax.chain`` state with ``jax_mlpo.adamw``).
      extra: JSON-like scalars to keep with it (data position, RNG seeds...).
      force: save even if the manager's save policy would skip this step.

    Returns:
      Whether a checkpoint was started (orbax's save policy may skip a step).

    Raises:
      StaleStateError: ``opt_state`` is not the latest state of its optimizer.
      EngineFailedError: an update failed midway; restore from the previous checkpoint.
    """
    check_savable(opt_state)  # before orbax starts a step directory
    args = ocp.args.Composite(
        params=OffloadSave(params),
        opt_state=OffloadSave(opt_state, params=params),
        extra=OffloadSave(dict(extra or {})),
    )
    return mngr.save(step, args=args, force=force)


def restore(
    mngr: ocp.CheckpointManager, params: Any, opt_state: Any, *, step: int | None = None
) -> Restored:
    """Restores checkpoint ``step`` (default: the latest) into ``params`` and ``opt_state``.

    Args:
      mngr: the manager the checkpoint was saved with (or one on the same directory).
      params: a params tree of the saved structure (arrays or ``jax.ShapeDtypeStruct``), giving
        dtypes and shardings.
      opt_state: a fresh ``tx.init(params)`` (with any offload config: subgroups, tiers and
        host cache may differ from the saved run's, and so may the process count; every
        process calls ``restore``). Its engines get the saved state, each process its shards.

    Returns:
      ``Restored(step, params, opt_state, extra)``.

    Raises:
      FileNotFoundError: no (such) checkpoint in the manager's directory.
      CorruptCheckpointError: a file of the checkpoint was changed or is incomplete.
      ValueError: the checkpoint does not fit ``params``/``opt_state``.
    """
    if step is None:
        step = mngr.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {mngr.directory}")
    elif step not in mngr.all_steps():
        raise FileNotFoundError(f"no checkpoint of step {step} in {mngr.directory}")
    args = ocp.args.Composite(
        params=OffloadRestore(params), opt_state=OffloadRestore(opt_state), extra=OffloadRestore()
    )
    out = mngr.restore(step, args=args)
    return Restored(int(step), out["params"], out["opt_state"], dict(out["extra"]))
