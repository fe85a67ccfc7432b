"""An update that came in groups on a GPU (``ffi/cuda_grouped.h``), beside the forward pass.

Each group's send hands the engine, at once, views of the group's pinned host staging and a
ticket; the stream copies the group's inputs there later. :class:`StagedGroupCalls` gathers
one stream's groups like :class:`~jax_mlpo.engine.grouped.GroupCalls` does on CPU, then runs
the engine on a thread of its own, one update at a time in the order they were sent (XLA may
send the next step's groups before this one is done). :class:`StagedGroupLeaves` waits for a
subgroup's groups to arrive before the engine reads them, and releases each group's ticket as
soon as its subgroups are updated: the stream then copies the group's update to the device
while the engine goes on with the next groups.

Failures never leave the stream waiting: whatever happens, every ticket of an update is
released when the engine is done with it, and a group that never comes fails the update after
:data:`~jax_mlpo.engine.grouped.WAIT_S`. A failed update's results are unspecified (the stream
goes on with whatever the staging holds); its error is kept and raised by the next group send
on the stream, which fails that step, and recorded by ``on_error``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jax_mlpo.engine.grouped import WAIT_S, CallRound, GroupedLeaves, forward_order, gather
from jax_mlpo.engine.layout import Layout, Subgroup
from jax_mlpo.native.host_update import CallGroup

__all__ = ["GroupCall", "StagedGroupCalls", "StagedGroupLeaves"]

INT32_MAX = 2**31 - 1


class GroupCall(NamedTuple):
    """One group's send: its leaves' views of the staging, and its ticket (``GroupTicket``:
    ``wait(timeout_s)``, ``record()``, ``release(next_count)``)."""

    group: CallGroup
    grads: list[np.ndarray]
    params: list[np.ndarray]
    updates: list[np.ndarray]
    ticket: Any


class StagedGroupLeaves(GroupedLeaves):
    """:class:`GroupedLeaves` over the groups' staging: a subgroup is read once its groups'
    inputs have arrived, and a group whose subgroups are done is released to the stream."""

    def __init__(
        self, layout: Layout, calls: dict[int, GroupCall], grads: list, params: list,
        updates: list, group_of_leaf: Sequence[int], next_count: int, wait_s: float,
    ) -> None:  # fmt: skip
        self._calls, self._wait_s = calls, wait_s
        self._arrived: set[int] = set()

        def release(g: int) -> None:
            calls[g].ticket.release(next_count)

        super().__init__(layout, grads, params, updates, group_of_leaf, release)

    def fetch(self, sg: Subgroup) -> None:
        for g in sorted(self._groups_of[sg.index] - self._arrived):
            self.wait(g)

    def wait(self, g: int) -> None:
        """Waits until group ``g``'s inputs are in its staging.

        Raises:
          TimeoutError: they did not come within the wait.
        """
        if g in self._arrived:
            return
        if not self._calls[g].ticket.wait(self._wait_s):
            raise TimeoutError(
                f"jax_mlpo: group {g}'s inputs did not reach the host within {self._wait_s:.0f} s"
            )
        self._arrived.add(g)


# layout_of(handle) -> the engine's layout; run(handle, count, scalars, leaves, order)
LayoutOf = Callable[[int], Layout]
Run = Callable[[int, int, np.ndarray, StagedGroupLeaves, list[int]], None]


class StagedGroupCalls:
    """Where the group sends of one stream meet (module doc).

    Args:
      layout_of: the layout of the engine a handle names.
      run: runs the engine's update (on this object's thread).
      on_error: called with an update's error (besides keeping it for the next send).
      wait_s: how long an update waits for a group (to be sent, or its inputs to arrive).
    """

    def __init__(
        self, layout_of: LayoutOf, run: Run, on_error: Callable[[BaseException], None],
        wait_s: float = WAIT_S,
    ) -> None:  # fmt: skip
        self._layout_of, self._run, self._on_error = layout_of, run, on_error
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._round = CallRound(wait_s, self._expire)
        self._error: BaseException | None = None
        self._updates: queue.SimpleQueue[dict[int, GroupCall]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def arrive(self, call: GroupCall) -> None:
        """Hands in one group's send (it must not block: the stream has not copied yet).

        Raises:
          BaseException: the error of an earlier update on this stream, once.
        """
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                self._abandon(self._round.take())
                call.ticket.release(0)  # its receive never runs: the program stops here
                raise error
            if call.group.group in self._round.calls:  # an update whose program stopped midway
                self._abandon(self._round.take())
            calls = self._round.add(call.group, call)
            if calls is None:
                return
            self._updates.put(calls)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, daemon=True,
                                                name="jax_mlpo-gpu-grouped-update")  # fmt: skip
                self._worker.start()

    @staticmethod
    def _abandon(calls: dict[int, GroupCall]) -> None:
        for call in calls.values():
            call.ticket.release(0)

    def _expire(self, number: int) -> None:
        with self._lock:
            if number != self._round.number or not self._round.calls:
                return
            arrived = len(self._round.calls)
            calls = self._round.take()
        groups = next(iter(calls.values())).group.groups
        self._fail(RuntimeError(
            f"jax_mlpo: {arrived} of the update's {groups} group calls arrived within "
            f"{self._wait_s:.0f} s: every group of an overlapped update must run"
        ))  # fmt: skip
        self._abandon(calls)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._on_error(error)

    def _work(self) -> None:
        while True:
            self._update(self._updates.get())

    def _update(self, calls: dict[int, GroupCall]) -> None:
        next_count = 0
        try:
            # group 0's copy of the step's scalars (every group's is the same)
            if not calls[0].ticket.wait(self._wait_s):
                raise TimeoutError(
                    f"jax_mlpo: group 0's inputs did not reach the host within {self._wait_s:.0f} s"
                )
            handle, count, scalars = calls[0].ticket.record()
            next_count = count if count == INT32_MAX else count + 1
            layout = self._layout_of(handle)
            grads, params, updates, group_of_leaf = gather(
                len(layout.shapes),
                [(g, c.group, c.grads, c.params, c.updates) for g, c in calls.items()],
            )
            leaves = StagedGroupLeaves(layout, calls, grads, params, updates, group_of_leaf,
                                       next_count, self._wait_s)  # fmt: skip
            leaves.wait(0)
            self._run(handle, count, scalars, leaves, forward_order(layout, group_of_leaf))
        except BaseException as e:  # noqa: BLE001 - kept for the next send, never lost
            self._fail(e)
        finally:  # the stream waits for every group: done or failed, each is released
            for call in calls.values():
                call.ticket.release(next_count)
