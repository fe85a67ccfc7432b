"""Where an update's group calls meet and run the engine (:mod:`jax_mlpo.transforms.overlap`).

On CPU each engine's calls meet in a :class:`~jax_mlpo.engine.grouped.GroupCalls`; on a GPU each
stream's sends meet in a :class:`~jax_mlpo.engine.staged_groups.StagedGroupCalls`, which learns
the engine only once the first group's scalars reach the host. Either runs the engine in the
forward pass's order and records its failures (:func:`jax_mlpo.transforms.registry.update_failed`).
"""

from __future__ import annotations

import weakref

import numpy as np

from jax_mlpo.engine.engine import Engine
from jax_mlpo.engine.grouped import GroupCalls, GroupedLeaves, Shards
from jax_mlpo.engine.layout import Layout
from jax_mlpo.engine.staged_groups import GroupCall, StagedGroupCalls, StagedGroupLeaves
from jax_mlpo.native.copies import cuda_module
from jax_mlpo.native.host_update import CallGroup
from jax_mlpo.sharding.mesh import MeshPlan
from jax_mlpo.transforms import registry

__all__ = ["calls_of", "send_group"]

# Where each engine's grouped calls meet (made at its first grouped update).
GROUP_CALLS: weakref.WeakKeyDictionary[Engine, GroupCalls] = weakref.WeakKeyDictionary()


def calls_of(engine: Engine, mesh: MeshPlan | None = None) -> GroupCalls:
    """Where the CPU calls of `engine`'s grouped updates meet (made at its first); ``mesh``:
    the shards of an engine over params on a mesh, whose every device makes each group's call."""
    found = GROUP_CALLS.get(engine)
    if found is None:
        shards = None
        if mesh is not None:
            shards = Shards(len(mesh.devices), tuple(s.owner for s in mesh.shards),
                            tuple(s.leaf for s in mesh.shards),
                            tuple(s.replicas for s in mesh.shards))  # fmt: skip

        def run(count: int, scalars: np.ndarray, leaves: GroupedLeaves, order: list[int]) -> None:
            try:
                _step_in_groups(engine, count, scalars, leaves, order)
            except BaseException as e:
                registry.update_failed(e)
                raise

        found = GROUP_CALLS.setdefault(engine, GroupCalls(engine.layout, run, shards=shards))
    return found


def _step_in_groups(engine: Engine, count: int, scalars: np.ndarray, leaves: GroupedLeaves,
                    order: list[int]) -> None:  # fmt: skip
    """One update of ``engine`` from its group calls, in the forward pass's order."""
    # the engine times the update and its part after the first group was handed back
    # (StepMetrics.beside_s) on one clock, from ``leaves.first_done``
    engine.step_leaves(count, engine.optimizer.hyper(engine.scalars.read(scalars)), leaves,
                       forward=order)  # fmt: skip


# Where a GPU's group sends meet, by XLA's stream (one per device): the engine is known only
# once the first group's scalars have reached the host.
_GPU_GROUP_CALLS: dict[int, StagedGroupCalls] = {}


def send_group(stream: int, group: CallGroup, grads: list, params: list, updates: list,
               ticket: object) -> None:  # fmt: skip
    """The host side of every ``jax_mlpo_group_send`` (a GPU update in groups)."""
    try:
        calls = _GPU_GROUP_CALLS.get(stream)
        if calls is None:
            calls = _GPU_GROUP_CALLS.setdefault(
                stream, StagedGroupCalls(_layout_of, _run_staged, registry.update_failed)
            )
        calls.arrive(GroupCall(group, grads, params, updates, ticket))
    except BaseException as e:
        registry.update_failed(e)
        raise


def _layout_of(handle: int) -> Layout:
    return registry.engine(handle).layout


def _run_staged(handle: int, count: int, scalars: np.ndarray, leaves: StagedGroupLeaves,
                order: list[int]) -> None:  # fmt: skip
    engine = registry.engine(handle)
    # the groups' pinned staging is the model's size: unpinned when the engine closes
    engine.on_close(cuda_module().release_group_staging)
    _step_in_groups(engine, count, scalars, leaves, order)
