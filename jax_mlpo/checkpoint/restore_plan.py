"""Restore planning: what each process reads of every saved leaf, and as what.

A restore starts from the target (params and a fresh ``tx.init``, with any offload config and
process count) and the checkpoint's manifest. For every orbax leaf the plan settles the part of
it this process needs and the sharding orbax reads it with: each process reads only the saved
shards that overlap its own, whole (so that their sha256s can be checked), and with 2 processes
saved and 4 restoring each reads the saved half holding its quarter. A leaf it needs all of, or
whose shards are not equal slices along the first dimension, is read whole. For every offloaded
state it checks the streamed arrays against the engine (global shapes whose shards on this
run's processes are the engine's leaves) and gives the reader the saved shards' records and
where this process's shard of each leaf starts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlpo import distributed
from jax_mlpo.checkpoint.blocks import Index, full, index_of, shard_starts
from jax_mlpo.checkpoint.manifest import FORMAT, saved_shards
from jax_mlpo.checkpoint.stream import QUANTITIES
from jax_mlpo.checkpoint.tree import is_key, is_offloaded, leaves, path_name, refuse_mesh_states
from jax_mlpo.transform import engine_of
from jax_mlpo.types import F32


@dataclasses.dataclass(frozen=True)
class Wanted:
    """What the target asks of a leaf, before the manifest is read.

    A dataclass rather than a NamedTuple: it is a leaf of the planned trees, and jax would
    flatten a NamedTuple.

    Attributes:
      dtype: the leaf's dtype.
      shape: its global shape.
      sharding: the leaf's sharding where this process needs only its shards; None where it
        needs all of it.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    sharding: jax.sharding.Sharding | None = None


@dataclasses.dataclass(frozen=True)
class Need:
    """What this process needs of a saved leaf, once checked against the manifest.

    Attributes:
      dtype: the leaf's dtype.
      shape: its global shape.
      sharding: the leaf's sharding where this process needs only its shards; None where it
        needs all of it.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    sharding: jax.sharding.Sharding | None = None


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one saved leaf is restored.

    Attributes:
      need: what this process needs of it.
      read: the sharding orbax reads it with (see :func:`read_sharding`); None: read whole.
    """

    need: Need
    read: jax.sharding.Sharding | None


class StreamPlan(NamedTuple):
    """How one offloaded state's arrays are read (:class:`~jax_mlpo.checkpoint.stream.StateReader`).

    Attributes:
      records: for each ``(quantity, leaf)``, the saved shards' records.
      starts: where this process's shard of each leaf starts (flattened).
    """

    records: dict[tuple[str, int], list[dict[str, Any]]]
    starts: list[int]


class RestorePlan(NamedTuple):
    """What :func:`plan_restore` returns.

    Attributes:
      leaves: the saved host tree (``{"format": ..., "tree": ...}``) with a :class:`LeafPlan`
        for every array leaf, other leaves as the target's.
      item: the abstract tree for ``ocp.args.PyTreeRestore``.
      restore_args: the ``ocp.RestoreArgs`` tree for it.
      streams: each offloaded state's :class:`StreamPlan`, by its leaf name (``"tree/2"``).
    """

    leaves: Any
    item: Any
    restore_args: Any
    streams: dict[str, StreamPlan]


def plan_restore(target: Any, manifest: dict[str, Any], directory: Any) -> RestorePlan:
    """Plans restoring the item with ``manifest`` into ``target``.

    Args:
      target: the tree to restore into (params, a fresh ``tx.init``, scalars).
      manifest: the item's manifest (:func:`jax_mlpo.checkpoint.manifest.read_manifest`).
      directory: the item's directory, for error messages.

    Returns:
      The plan of every leaf and the orbax restore args that carry it out.

    Raises:
      ValueError: the checkpoint's leaves, dtypes or shapes differ from the target's.
      NotImplementedError: a target state over params on a mesh (:mod:`jax_mlpo.mesh_update`).
    """
    refuse_mesh_states(target)
    wanted = {"format": FORMAT, "tree": _abstract(target)}
    saved = manifest["leaves"]
    arrays = _offloaded_arrays(target)
    names = set(leaves(wanted)) | set(arrays)
    have = set(saved) | set(manifest["streamed"])
    missing, extra = sorted(names - have), sorted(have - names)
    if missing or extra:
        raise ValueError(
            f"checkpoint {directory} does not fit the target tree: leaves only in the target "
            f"{missing[:8]}, only in the checkpoint {extra[:8]}. Restore into the same model "
            "and optimizer structure (and param dtypes: bfloat16 leaves carry a master copy)."
        )

    def plan(path: tuple[Any, ...], w: Any) -> Any:
        if not isinstance(w, Wanted):
            return w
        name = path_name(path)
        need = _need(name, w, saved[name], directory)
        return LeafPlan(need, read_sharding(need, saved_shards(saved[name])))

    planned = jax.tree_util.tree_map_with_path(plan, wanted)

    def item(p: Any) -> Any:
        if not isinstance(p, LeafPlan):
            return p
        if p.read is None:
            return np.empty(p.need.shape, p.need.dtype)  # not touched: no memory
        return jax.ShapeDtypeStruct(p.need.shape, p.need.dtype, sharding=p.read)

    def restore_args(p: Any) -> ocp.RestoreArgs:
        if not isinstance(p, LeafPlan):
            return ocp.RestoreArgs()
        if p.read is None:
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.ArrayRestoreArgs(sharding=p.read, global_shape=p.need.shape, dtype=p.need.dtype)

    streams = _plan_streams(arrays, manifest["streamed"], directory)
    return RestorePlan(
        planned, jax.tree.map(item, planned), jax.tree.map(restore_args, planned), streams
    )


def _offloaded_arrays(target: Any) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """The arrays the target's offloaded states want: name -> (state, (quantity, leaf), its
    shape in this process's engine)."""
    arrays = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_offloaded)
    for path, x in flat:
        if not is_offloaded(x):
            continue
        state, layout = path_name(("tree", *path)), engine_of(x).layout
        for leaf, (shape, dtype) in enumerate(zip(layout.shapes, layout.dtypes, strict=True)):
            for quantity in QUANTITIES:
                if quantity != "master" or dtype != F32:
                    arrays[f"{state}/{quantity}/{leaf}"] = (state, (quantity, leaf), shape)
    return arrays


def _plan_streams(
    arrays: dict[str, tuple[str, tuple[str, int], tuple[int, ...]]],
    saved: dict[str, Any], directory: Any,
) -> dict[str, StreamPlan]:  # fmt: skip
    """Each offloaded state's :class:`StreamPlan`, the saved arrays checked against its engine.

    Raises:
      ValueError: a saved array's shard on this run's processes is not the engine's leaf.
    """
    n = jax.process_count()
    shapes: dict[str, dict[int, tuple[int, ...]]] = {}
    streams: dict[str, StreamPlan] = {}
    for name, (state, key, local) in arrays.items():
        record = saved[name]
        shape = tuple(int(d) for d in record["shape"])
        if record["dtype"] != "float32" or distributed.local_shape(shape, n) != local:
            raise ValueError(
                f"checkpoint {directory}: array {name} is {record['dtype']}{list(shape)}, whose "
                f"shard on each of {n} processes is {list(distributed.local_shape(shape, n))}; "
                f"the target optimizer's is float32{list(local)}"
            )
        shapes.setdefault(state, {})[key[1]] = shape
        streams.setdefault(state, StreamPlan({}, [])).records[key] = record["shards"]
    for state, plan in streams.items():
        by_leaf = shapes[state]
        plan.starts.extend(shard_starts([by_leaf[k] for k in range(len(by_leaf))])[0])
    return streams


def read_sharding(need: Need, shards: list[tuple[Index, str]]) -> jax.sharding.Sharding | None:
    """How a leaf is read, so that each process reads whole saved shards, only those it needs.

    Where the leaf was saved in ``s`` equal shards along its first dimension and is needed in
    ``t`` such shards, each device reads the block of ``1/gcd(s, t)`` of the leaf holding the
    shard it needs: a union of whole saved shards (so their sha256s can be checked) and, with
    ``s`` a multiple of ``t``, exactly what it needs.

    Args:
      need: what this process needs of the leaf.
      shards: the leaf's saved shards, as (index, sha256).

    Returns:
      That sharding, or None where every process reads the whole leaf (it needs it all, it was
      saved whole, or the shards are not such slices).
    """
    if need.sharding is None or len(shards) < 2 or not need.shape:
        return None
    shape, rows = need.shape, need.shape[0]
    rest = full(shape)[1:]

    def slices(indexes: list[Index]) -> int | None:
        """k if ``indexes`` are the k equal slices along the first dimension, else None."""
        k = len(indexes)
        if rows % k:
            return None
        size = rows // k
        expect = [((j * size, (j + 1) * size), *rest) for j in range(k)]
        return k if sorted(indexes) == expect else None

    needs = {d: index_of(i, shape) for d, i in need.sharding.devices_indices_map(shape).items()}
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


def _abstract(target: Any) -> Any:
    """The host tree a checkpoint of ``target`` holds, with a :class:`Wanted` per array leaf."""

    def sharded(x: Any) -> jax.sharding.Sharding | None:
        sharding = getattr(x, "sharding", None)
        return sharding if sharding is not None and not sharding.is_fully_addressable else None

    def convert(x: Any) -> Any:
        if is_offloaded(x):  # its arrays are streamed (see _plan_streams)
            return {"count": Wanted(np.dtype(np.int32), ())}
        if is_key(x):
            x = jax.eval_shape(jax.random.key_data, x)
            return Wanted(np.dtype(x.dtype), tuple(x.shape))  # small: read whole everywhere
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
            return Wanted(np.dtype(x.dtype), tuple(x.shape), sharding=sharded(x))
        return x

    return jax.tree.map(convert, target, is_leaf=is_offloaded)


def _need(name: str, wanted: Wanted, record: dict[str, Any], directory: Any) -> Need:
    """What this process needs of the saved leaf ``name``, checked against its record.

    Raises:
      ValueError: the saved leaf's dtype or shape is not the target's.
    """
    got = (record["dtype"], list(record["shape"]))
    if (wanted.dtype.name, list(wanted.shape)) != got:
        raise ValueError(
            f"checkpoint {directory}: leaf {name} is {got[0]}{got[1]}, the target's is "
            f"{wanted.dtype.name}{list(wanted.shape)}"
        )
    return Need(wanted.dtype, tuple(wanted.shape), wanted.sharding)
