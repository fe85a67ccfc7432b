"""Restore planning: what each process reads of every saved leaf, and as what.

A restore starts from the target (params and a fresh ``tx.init``, with any offload config and
process count) and the checkpoint's manifest. For every orbax leaf the plan settles the part of
it this process needs and the sharding orbax reads it with: each process reads only the saved
shards that overlap its own, whole (so that their digests can be checked), and with 2 processes
saved and 4 restoring each reads the saved half holding its quarter. A leaf it needs all of, or
whose shards are not equal slices along the first dimension, is read whole. For every offloaded
state it checks the streamed arrays against the engine (global shapes whose shards on this
run's processes, or on its mesh, are the engine's leaves) and gives the reader the saved
shards' records and where each of the engine's leaves is in the parameter leaves.
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

from jax_mlpo.checkpoint.blocks import Index, Region, engine_regions, full, index_of
from jax_mlpo.checkpoint.manifest import FORMAT, saved_shards
from jax_mlpo.checkpoint.stream import quantities
from jax_mlpo.checkpoint.tree import is_key, is_offloaded, leaves, path_name
from jax_mlpo.sharding import processes as distributed
from jax_mlpo.transforms.opt_state import OffloadedState
from jax_mlpo.transforms.runtime import engine_of, mesh_plan_of


@dataclasses.dataclass(frozen=True)
class Need:
    """What this process needs of a leaf: asked by the target, then checked against the
    manifest.

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
class LeafPlan:
    """How one saved leaf is restored.

    Attributes:
      need: what this process needs of it.
      read: the sharding orbax reads it with (see :func:`read_sharding`); None: read whole.
    """

    need: Need
    read: jax.sharding.Sharding | None


class StreamPlan(NamedTuple):
    """How one offloaded state's arrays are read (``state_reader.StateReader``).

    Attributes:
      records: for each ``(quantity, leaf)``, the saved shards' records.
      shapes: the parameter leaves' global shapes.
      regions: where each of the restoring engine's leaves is in the parameter leaves.
    """

    records: dict[tuple[str, int], list[dict[str, Any]]]
    shapes: list[tuple[int, ...]]
    regions: list[Region]


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
    """
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
        if not isinstance(w, Need):
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


def _offloaded_arrays(target: Any) -> dict[str, tuple[OffloadedState, str, str, int]]:
    """The arrays the target's offloaded states want: name -> (state, its name, quantity,
    parameter leaf)."""
    arrays = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_offloaded)
    for path, x in flat:
        if not is_offloaded(x):
            continue
        state, layout, plan = path_name(("tree", *path)), engine_of(x).layout, mesh_plan_of(x)
        # a mesh engine's leaves are shards: whether a parameter leaf has a master is its first
        # shard's
        owners = [s.leaf for s in plan.shards] if plan is not None else range(len(layout.shapes))
        masters: dict[int, bool] = {}
        for j, leaf in enumerate(owners):
            masters.setdefault(leaf, layout.has_master(j))
        for leaf, master in sorted(masters.items()):
            for quantity in quantities(layout):
                if quantity != "master" or master:
                    arrays[f"{state}/{quantity}/{leaf}"] = (x, state, quantity, leaf)
    return arrays


def _plan_streams(
    arrays: dict[str, tuple[OffloadedState, str, str, int]], saved: dict[str, Any],
    directory: Any,
) -> dict[str, StreamPlan]:  # fmt: skip
    """Each offloaded state's :class:`StreamPlan`, the saved arrays checked against its engine.

    Raises:
      ValueError: a saved array's shard on this run's processes (or its mesh) is not the
        engine's.
    """
    n = jax.process_count()
    shapes: dict[str, dict[int, tuple[int, ...]]] = {}
    streams: dict[str, StreamPlan] = {}
    states: dict[str, OffloadedState] = {}
    for name, (x, state, quantity, leaf) in arrays.items():
        record = saved[name]
        shape = tuple(int(d) for d in record["shape"])
        plan = mesh_plan_of(x)
        if plan is not None:
            fits, want = plan.shapes[leaf] == shape, f"{list(plan.shapes[leaf])} (on its mesh)"
        else:
            local = engine_of(x).layout.shapes[leaf]
            fits, want = distributed.local_shape(shape, n) == local, f"{list(local)}"
            if not fits:
                want += f", the shard on each of {n} processes of {list(shape)} is "
                want += f"{list(distributed.local_shape(shape, n))}"
        if record["dtype"] != "float32" or not fits:
            raise ValueError(
                f"checkpoint {directory}: array {name} is {record['dtype']}{list(shape)}; the "
                f"target optimizer's is float32{want}"
            )
        shapes.setdefault(state, {})[leaf] = shape
        states[state] = x
        plan_of = streams.setdefault(state, StreamPlan({}, [], []))
        plan_of.records[(quantity, leaf)] = record["shards"]
    for state, plan in streams.items():
        by_leaf = shapes[state]
        plan.shapes.extend(by_leaf[k] for k in range(len(by_leaf)))
        plan.regions.extend(engine_regions(states[state], plan.shapes)[0])
    return streams


def read_sharding(need: Need, shards: list[tuple[Index, str]]) -> jax.sharding.Sharding | None:
    """How a leaf is read, so that each process reads whole saved shards, only those it needs.

    Where the leaf was saved in ``s`` equal shards along its first dimension and is needed in
    ``t`` such shards, each device reads the block of ``1/gcd(s, t)`` of the leaf holding the
    shard it needs: a union of whole saved shards (so their digests can be checked) and, with
    ``s`` a multiple of ``t``, exactly what it needs.

    Args:
      need: what this process needs of the leaf.
      shards: the leaf's saved shards, as (index, digest).

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
    """The host tree a checkpoint of ``target`` holds, with a :class:`Need` per array leaf."""

    def sharded(x: Any) -> jax.sharding.Sharding | None:
        sharding = getattr(x, "sharding", None)
        return sharding if sharding is not None and not sharding.is_fully_addressable else None

    def convert(x: Any) -> Any:
        if is_offloaded(x):  # its arrays are streamed (see _plan_streams)
            return {"count": Need(np.dtype(np.int32), ())}
        if is_key(x):
            x = jax.eval_shape(jax.random.key_data, x)
            return Need(np.dtype(x.dtype), tuple(x.shape))  # small: read whole everywhere
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
            return Need(np.dtype(x.dtype), tuple(x.shape), sharding=sharded(x))
        return x

    return jax.tree.map(convert, target, is_leaf=is_offloaded)


def _need(name: str, wanted: Need, record: dict[str, Any], directory: Any) -> Need:
    """What the target asks of the saved leaf ``name``, checked against its record.

    Raises:
      ValueError: the saved leaf's dtype or shape is not the target's.
    """
    got = (record["dtype"], list(record["shape"]))
    if (wanted.dtype.name, list(wanted.shape)) != got:
        raise ValueError(
            f"checkpoint {directory}: leaf {name} is {got[0]}{got[1]}, the target's is "
            f"{wanted.dtype.name}{list(wanted.shape)}"
        )
    return wanted
