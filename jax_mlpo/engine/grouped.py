"""An update that came in one call per group of layers (:mod:`jax_mlpo.transforms.overlap`).

XLA starts the calls together (each depends only on its own gradients and params); each hands
its buffers in and stays pending, holding no XLA thread (an asynchronous FFI call). When every
group has arrived, :class:`GroupCalls` runs the engine over all subgroups on a thread of its
own, in the order the forward pass needs them, and completes each group's call as soon as the
subgroups holding its leaves are updated: XLA then runs that group's part of the forward pass
while the engine goes on with the next groups. A subgroup holding two groups' leaves completes
them only once it is done.

On a mesh every device of the process makes each group's call with its own shards
(:class:`Shards` says where each of the engine's leaves comes from): a group's update is
released on every device at once, the replicas' copies made first.

A group of stacked layers that a scan consumes row by row is a send whose rows its receives
take (:mod:`jax_mlpo.engine.row_stream`): its subgroups are updated in row order, and each row
is handed over as soon as it is done.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_mlpo.engine.layout import Layout, Subgroup
from jax_mlpo.engine.leaves import HostLeaves
from jax_mlpo.engine.row_stream import RowBoards, complete_later, row_rank, rows_of_subgroups
from jax_mlpo.native.host_update import CallGroup, Completion

__all__ = ["CallRound", "GroupCalls", "GroupedLeaves", "Shards", "forward_order", "gather"]

# How long the first group's call waits for the others of its update: XLA starts them
# together, so a wait this long means one will never come.
WAIT_S = 600.0

# run(count, scalars, leaves, order): the engine's update over ``leaves``, in ``order``
Run = Callable[[int, np.ndarray, "GroupedLeaves", list[int]], None]


def forward_order(layout: Layout, group_of_leaf: Sequence[int],
                  rows: dict[int, set[int]] | None = None) -> list[int]:  # fmt: skip
    """The subgroups in the order the forward pass needs them: by the first group of the leaves
    each holds, then by the first row of stacked leaves they hold (``rows``:
    :func:`~jax_mlpo.engine.row_stream.rows_of_subgroups`), then by index."""
    rows = rows or {}

    def rank(sg: Subgroup) -> tuple[int, int, int]:
        return min(group_of_leaf[seg.leaf] for seg in sg.segments), row_rank(sg, rows), sg.index

    return [sg.index for sg in sorted(layout.subgroups, key=rank)]


class GroupedLeaves(HostLeaves):
    """The :class:`~jax_mlpo.engine.leaves.Leaves` of an update whose leaves came in several
    calls (host memory, CPU): each subgroup stored completes the calls it was the last of.

    Args:
      grads, params, updates: the engine's flat leaves, gathered from the calls.
      group_of_leaf: each leaf's group.
      complete: ``complete(group)`` hands a group's call back to XLA.
      rows_of_leaf: each leaf's rows where its group is streamed by row (0 elsewhere).
      rows: the rows of streamed leaves each subgroup holds
        (:func:`~jax_mlpo.engine.row_stream.rows_of_subgroups` of ``rows_of_leaf``).
      row_done: ``row_done(group, row)``, once every subgroup holding a part of ``row`` of the
        group's stacked leaves is updated.
    """

    def __init__(
        self, layout: Layout, grads: list, params: list, updates: list,
        group_of_leaf: Sequence[int], complete: Callable[[int], None],
        rows_of_leaf: Sequence[int] | None = None, rows: dict[int, set[int]] | None = None,
        row_done: Callable[[int, int], None] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(grads, params, updates)
        self._complete = complete
        self._row_done = row_done
        self._rows_left: dict[tuple[int, int], set[int]] = {}  # (group, row): its subgroups
        self._rows_of: dict[int, list[tuple[int, int]]] = {}  # subgroup: its (group, row)s
        if rows_of_leaf and rows:
            for index, held in rows.items():
                sg = layout.subgroups[index]
                g = min(group_of_leaf[seg.leaf] for seg in sg.segments
                        if rows_of_leaf[seg.leaf])  # fmt: skip
                for r in held:
                    self._rows_left.setdefault((g, r), set()).add(index)
                    self._rows_of.setdefault(index, []).append((g, r))
        self.first_done: float | None = None  # when the first group was handed back
        self._left: dict[int, set[int]] = {}  # each group's subgroups still to update
        for sg in layout.subgroups:
            for seg in sg.segments:
                self._left.setdefault(group_of_leaf[seg.leaf], set()).add(sg.index)
        self._groups_of = {
            sg.index: {group_of_leaf[seg.leaf] for seg in sg.segments} for sg in layout.subgroups
        }
        for g in set(group_of_leaf) - set(self._left):  # groups of empty leaves only
            complete(g)

    def store(self, sg: Subgroup) -> None:
        for key in self._rows_of.get(sg.index, ()):
            left = self._rows_left[key]
            left.discard(sg.index)
            if not left and self._row_done is not None:
                self._row_done(*key)
        for g in self._groups_of[sg.index]:
            left = self._left[g]
            left.discard(sg.index)
            if not left:
                if self.first_done is None:
                    self.first_done = time.monotonic()
                self._complete(g)


def gather(n: int, calls: Sequence[tuple[int, CallGroup, list, list, list]]
           ) -> tuple[list, list, list, list[int]]:  # fmt: skip
    """The engine's ``n`` flat leaves from its group calls ``(group, call group, grads, params,
    updates)``: ``(grads, params, updates, group_of_leaf)``.

    Raises:
      RuntimeError: a call names a leaf the engine does not have, or no call carries one.
    """
    grads, params, updates = [None] * n, [None] * n, [None] * n
    group_of_leaf = [-1] * n
    for g, group, gs, ps, us in calls:
        for k, leaf in enumerate(group.leaf_ids):
            if not 0 <= leaf < n:
                raise RuntimeError(f"group {g} names leaf {leaf} of an engine of {n}")
            grads[leaf], params[leaf], updates[leaf], group_of_leaf[leaf] = gs[k], ps[k], us[k], g
    missing = [k for k in range(n) if group_of_leaf[k] < 0]
    if missing:
        raise RuntimeError(f"no group call carried the engine's leaves {missing[:8]}")
    return grads, params, updates, group_of_leaf


class CallRound:
    """The calls of one update, arriving one by one (the caller holds its own lock around
    every use): :meth:`add` gives the whole round once its last call is in; until then a timer
    calls ``expire(number)`` after ``wait_s``, which the caller compares with :attr:`number`.
    """

    def __init__(self, wait_s: float, expire: Callable[[int], None]) -> None:
        self._wait_s, self._expire = wait_s, expire
        self.calls: dict[int, Any] = {}
        self.number = 0  # of the round being gathered
        self._timer: threading.Timer | None = None

    def add(self, group: CallGroup, call: Any, slot: int = 0, slots: int = 1
            ) -> dict[Any, Any] | None:  # fmt: skip
        """Adds a group's call (of device ``slot`` of ``slots``: keyed ``(slot, group)`` where
        ``slots`` > 1); the round's calls once every one has come, else None."""
        self.calls[group.group if slots == 1 else (slot, group.group)] = call
        if len(self.calls) < group.groups * slots:
            if self._timer is None:
                self._timer = threading.Timer(self._wait_s, self._expire, (self.number,))
                self._timer.daemon = True
                self._timer.start()
            return None
        return self.take()

    def take(self) -> dict[int, Any]:
        """The calls so far, ending the round (and its timer)."""
        calls, self.calls = self.calls, {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.number += 1
        return calls


@dataclasses.dataclass(frozen=True)
class Shards:
    """Where an engine's leaves come from when its params are on a mesh of ``slots`` devices
    of this process: engine leaf ``i`` is param leaf ``leaf[i]``'s shard in device ``owner[i]``'s
    calls, and its update is copied to the same leaf in the calls of ``replicas[i]``."""

    slots: int
    owner: tuple[int, ...]
    leaf: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]

    @staticmethod
    def one_device(n: int) -> Shards:
        """The engine's ``n`` leaves, the params' own, from one device."""
        return Shards(1, (0,) * n, tuple(range(n)), ((),) * n)


class GroupCalls:
    """Where the calls of one engine's grouped updates meet.

    Args:
      layout: the engine's leaves and subgroups.
      run: runs the engine's update (on this object's thread).
      wait_s: how long the first call of an update waits for the last before it fails.
      shards: where the engine's leaves come from (default: one device, leaf for leaf).
      boards: where the rows of groups streamed by row meet their receives (the process's).
    """

    def __init__(
        self, layout: Layout, run: Run, wait_s: float = WAIT_S, shards: Shards | None = None,
        boards: RowBoards | None = None,
    ) -> None:  # fmt: skip
        self._layout, self._run, self._wait_s = layout, run, wait_s
        self._shards = Shards.one_device(len(layout.shapes)) if shards is None else shards
        self._lock = threading.Lock()
        self._round = CallRound(wait_s, self._expire)
        self._boards = RowBoards() if boards is None else boards

    def arrive(self, count: int, scalars: np.ndarray, group: CallGroup, grads: list,
               params: list, updates: list, completion: Completion, slot: int = 0
               ) -> None:  # fmt: skip
        """Hands in one group's call (of device ``slot`` on a mesh); it completes when its
        subgroups are updated.

        Raises:
          RuntimeError: the group called twice in one update.
        """
        slots = self._shards.slots
        key = group.group if slots == 1 else (slot, group.group)
        with self._lock:
            if key in self._round.calls:
                raise RuntimeError(f"group {group.group} called the update twice in one step")
            call = (count, scalars, group, grads, params, updates, completion, slot)
            if group.rows:  # a send: pending until its receives took every row
                if slots != 1:
                    raise RuntimeError("stacked layers streamed by row on a mesh")
                self._boards.sent(group.stream, group.rows, params, updates, completion)
            calls = self._round.add(group, call, slot, slots)
            if calls is None:
                return
        threading.Thread(target=self._update, args=(list(calls.values()),), daemon=True,
                         name="jax_mlpo-grouped-update").start()  # fmt: skip

    def _expire(self, number: int) -> None:
        with self._lock:
            if number != self._round.number or not self._round.calls:
                return
            arrived = len(self._round.calls)
            calls = self._round.take()
        expected = next(iter(calls.values()))[2].groups * self._shards.slots
        error = RuntimeError(
            f"jax_mlpo: {arrived} of the update's {expected} group calls arrived within "
            f"{self._wait_s:.0f} s: every group of an overlapped update must run (on a mesh, "
            "on every device)"
        )
        for call in calls.values():
            self._hand_back(call, error)

    def _hand_back(self, call: tuple, error: BaseException | None) -> None:
        """Completes a group's call; a send (streamed by row) only fails here: its receives
        complete it."""
        if not call[2].rows:
            complete_later(call[6], error)
        elif error is not None:
            self._boards.fail(call[2].stream, error)

    def _update(self, calls: list[tuple]) -> None:
        by_group: dict[int, list[tuple]] = {}
        for c in calls:
            by_group.setdefault(c[2].group, []).append(c)
        done: set[int] = set()
        shards = self._shards

        def complete(g: int, error: BaseException | None = None) -> None:
            if g in done:
                return
            done.add(g)
            if error is None and any(shards.replicas):
                try:  # every device's copy of the group's replicated shards, before any returns
                    for i in range(len(shards.leaf)):
                        if group_of_leaf[i] == g:
                            for r in shards.replicas[i]:
                                np.copyto(by_slot[r, shards.leaf[i]][3], updates[i])
                except BaseException as e:  # noqa: BLE001 - the group's calls fail with it
                    error = e
            for c in by_group[g]:
                self._hand_back(c, error)

        group_of_leaf: list[int] = []
        try:
            counts = {c[0] for c in calls}
            if len(counts) != 1:
                raise RuntimeError(f"the update's group calls disagree: step counts {counts}")
            by_slot = _by_slot_and_leaf(calls)
            grads, params, updates, group_of_leaf = _engine_leaves(by_slot, shards)
            rows_of_group = {c[2].group: c[2].rows for c in calls}
            stream_of_group = {c[2].group: c[2].stream for c in calls}
            rows_of_leaf = [rows_of_group[g] for g in group_of_leaf]

            def row_done(g: int, row: int) -> None:
                self._boards.updated(stream_of_group[g], row)

            rows = rows_of_subgroups(self._layout, rows_of_leaf) if any(rows_of_leaf) else {}
            leaves = GroupedLeaves(self._layout, grads, params, updates, group_of_leaf, complete,
                                   rows_of_leaf, rows, row_done)  # fmt: skip
            order = forward_order(self._layout, group_of_leaf, rows)
            self._run(counts.pop(), calls[0][1], leaves, order)
        except BaseException as e:  # noqa: BLE001 - every call not yet completed fails with it
            for g in by_group:
                complete(g, e)
            return
        for g in by_group:  # groups whose subgroups were all done before
            complete(g)


def _by_slot_and_leaf(calls: Sequence[tuple]) -> dict[tuple[int, int], tuple]:
    """Each call's buffers by ``(slot, param leaf)``: ``(group, grad, param, update)``."""
    out = {}
    for _, _, group, gs, ps, us, _, slot in calls:
        for k, leaf in enumerate(group.leaf_ids):
            out[slot, leaf] = (group.group, gs[k], ps[k], us[k])
    return out


def _engine_leaves(by_slot: dict[tuple[int, int], tuple], shards: Shards
                   ) -> tuple[list, list, list, list[int]]:  # fmt: skip
    """The engine's flat leaves from the calls' buffers: ``(grads, params, updates,
    group_of_leaf)``.

    Raises:
      RuntimeError: a call names a leaf the engine does not have, or no call carries one.
    """
    known = set(shards.leaf)
    for (_, leaf), (g, *_) in by_slot.items():
        if leaf not in known:
            raise RuntimeError(f"group {g} names leaf {leaf} of an engine of {len(known)}")
    missing = [i for i, key in enumerate(zip(shards.owner, shards.leaf, strict=True))
               if key not in by_slot]  # fmt: skip
    if missing:
        raise RuntimeError(f"no group call carried the engine's leaves {missing[:8]}")
    found = [by_slot[key] for key in zip(shards.owner, shards.leaf, strict=True)]
    return ([f[1] for f in found], [f[2] for f in found], [f[3] for f in found],
            [f[0] for f in found])  # fmt: skip
