"""An update that came in one call per group of layers (:mod:`jax_mlpo.transforms.overlap`).

XLA starts the calls together (each depends only on its own gradients and params); each hands
its buffers in and stays pending, holding no XLA thread (an asynchronous FFI call). When every
group has arrived, :class:`GroupCalls` runs the engine over all subgroups on a thread of its
own, in the order the forward pass needs them, and completes each group's call as soon as the
subgroups holding its leaves are updated: XLA then runs that group's part of the forward pass
while the engine goes on with the next groups. A subgroup holding two groups' leaves completes
them only once it is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jax_mlpo.engine.layout import Layout, Segment, Subgroup
from jax_mlpo.native.host_update import CallGroup, Completion

__all__ = ["GroupCalls", "GroupedLeaves", "forward_order"]

# How long the first group's call waits for the others of its update: XLA starts them
# together, so a wait this long means one will never come.
WAIT_S = 600.0

# run(count, scalars, leaves, order): the engine's update over ``leaves``, in ``order``
Run = Callable[[int, np.ndarray, "GroupedLeaves", list[int]], None]


def forward_order(layout: Layout, group_of_leaf: Sequence[int]) -> list[int]:
    """The subgroups in the order the forward pass needs them: by the first group of the leaves
    each holds, then by index."""

    def rank(sg: Subgroup) -> tuple[int, int]:
        return min(group_of_leaf[seg.leaf] for seg in sg.segments), sg.index

    return [sg.index for sg in sorted(layout.subgroups, key=rank)]


class GroupedLeaves:
    """The :class:`~jax_mlpo.engine.leaves.Leaves` of an update whose leaves came in several
    calls (host memory, CPU): each subgroup stored completes the calls it was the last of.

    Args:
      grads, params, updates: the engine's flat leaves, gathered from the calls.
      group_of_leaf: each leaf's group.
      complete: ``complete(group)`` hands a group's call back to XLA.
    """

    def __init__(
        self, layout: Layout, grads: list, params: list, updates: list,
        group_of_leaf: Sequence[int], complete: Callable[[int], None],
    ) -> None:  # fmt: skip
        self.grads, self.params, self.updates = grads, params, updates
        self._complete = complete
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

    def check(self, layout: Layout) -> None:
        layout.check_leaves(self.grads, self.params, self.updates)

    def fetch(self, sg: Subgroup) -> None:
        pass

    def segment(self, seg: Segment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        span = seg.leaf_span
        return self.grads[seg.leaf][span], self.params[seg.leaf][span], self.updates[seg.leaf][span]

    def store(self, sg: Subgroup) -> None:
        for g in self._groups_of[sg.index]:
            left = self._left[g]
            left.discard(sg.index)
            if not left:
                if self.first_done is None:
                    self.first_done = time.monotonic()
                self._complete(g)

    def finish(self) -> None:
        pass


class GroupCalls:
    """Where the calls of one engine's grouped updates meet.

    Args:
      layout: the engine's leaves and subgroups.
      run: runs the engine's update (on this object's thread).
      wait_s: how long the first call of an update waits for the last before it fails.
    """

    def __init__(self, layout: Layout, run: Run, wait_s: float = WAIT_S) -> None:
        self._layout, self._run, self._wait_s = layout, run, wait_s
        self._lock = threading.Lock()
        self._calls: dict[int, tuple] = {}
        self._timer: threading.Timer | None = None
        self._round = 0

    def arrive(self, count: int, scalars: np.ndarray, group: CallGroup, grads: list,
               params: list, updates: list, completion: Completion) -> None:  # fmt: skip
        """Hands in one group's call; it completes when its subgroups are updated.

        Raises:
          RuntimeError: the group called twice in one update.
        """
        with self._lock:
            if group.group in self._calls:
                raise RuntimeError(f"group {group.group} called the update twice in one step")
            self._calls[group.group] = (count, scalars, group, grads, params, updates, completion)
            if len(self._calls) < group.groups:
                if self._timer is None:
                    self._timer = threading.Timer(self._wait_s, self._expire, (self._round,))
                    self._timer.daemon = True
                    self._timer.start()
                return
            calls = self._take_round()
        threading.Thread(target=self._update, args=(calls,), daemon=True,
                         name="jax_mlpo-grouped-update").start()  # fmt: skip

    def _take_round(self) -> dict[int, tuple]:
        calls, self._calls = self._calls, {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._round += 1
        return calls

    def _expire(self, round_: int) -> None:
        with self._lock:
            if round_ != self._round or not self._calls:
                return
            arrived = len(self._calls)
            calls = self._take_round()
        groups = next(iter(calls.values()))[2].groups
        error = RuntimeError(
            f"jax_mlpo: {arrived} of the update's {groups} group calls arrived within "
            f"{self._wait_s:.0f} s: every group of an overlapped update must run"
        )
        for call in calls.values():
            _complete(call[6], error)

    def _update(self, calls: dict[int, tuple]) -> None:
        done: set[int] = set()

        def complete(g: int, error: BaseException | None = None) -> None:
            if g not in done:
                done.add(g)
                _complete(calls[g][6], error)

        try:
            counts = {c[0] for c in calls.values()}
            if len(counts) != 1:
                raise RuntimeError(f"the update's group calls disagree: step counts {counts}")
            n = len(self._layout.shapes)
            grads, params, updates = [None] * n, [None] * n, [None] * n
            group_of_leaf = [-1] * n
            for g, (_, _, group, gs, ps, us, _) in calls.items():
                for k, leaf in enumerate(group.leaf_ids):
                    grads[leaf], params[leaf], updates[leaf] = gs[k], ps[k], us[k]
                    group_of_leaf[leaf] = g
            missing = [k for k in range(n) if group_of_leaf[k] < 0]
            if missing:
                raise RuntimeError(f"no group call carried the engine's leaves {missing[:8]}")
            leaves = GroupedLeaves(self._layout, grads, params, updates, group_of_leaf, complete)
            self._run(counts.pop(), calls[0][1], leaves, forward_order(self._layout, group_of_leaf))
        except BaseException as e:  # noqa: BLE001 - every call not yet completed fails with it
            for g in calls:
                complete(g, e)
            return
        for g in calls:  # groups whose subgroups were all done before
            complete(g)


def _complete(completion: Completion, error: BaseException | None) -> None:
    # XLA continues the program on the completing thread: a fresh one, so the engine's thread
    # goes on with the next group while the forward pass runs
    threading.Thread(target=completion, args=(error,), daemon=True,
                     name="jax_mlpo-update-complete").start()  # fmt: skip
