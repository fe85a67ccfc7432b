"""The engine's state in its logical layout: snapshots for checkpoints, ``state_dict``, ``load``.

These read the state out subgroup by subgroup (:mod:`jax_mlpo.engine.snapshot`) or replace it
(:mod:`jax_mlpo.engine.state_stream`), between updates or, for an asynchronous checkpoint, while
they run. They take the engine's step lock, pause its read-ahead first and fail the engine where its
state could be left partly replaced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jax_mlpo.engine.idle_io import EngineHealth, IdleIO
from jax_mlpo.engine.layout import Subgroup, gather_state, scatter_state
from jax_mlpo.engine.snapshot import StateSnapshot
from jax_mlpo.engine.state_stream import spare_buffers, stream_blobs
from jax_mlpo.errors import CheckpointInProgressError
from jax_mlpo.types import F32

if TYPE_CHECKING:
    from jax_mlpo.engine.engine import Engine


class StateIO:
    """The state I/O of one :class:`~jax_mlpo.engine.engine.Engine`.

    Args:
      engine: the engine (its layout, pipeline, tiers and step count).
      idle: its between-updates I/O, paused around each read-out or load.
      health: its health, failed by a load that breaks off.
      step_lock: the lock its updates hold.
    """

    def __init__(
        self, engine: Engine, idle: IdleIO, health: EngineHealth, step_lock: threading.Lock
    ) -> None:
        self._engine, self._idle, self._health, self._step_lock = engine, idle, health, step_lock
        self.open_snapshot: StateSnapshot | None = None  # the one a checkpoint is reading

    def snapshot(self, *, concurrent: bool = False) -> StateSnapshot:
        """The state at this step, to read subgroup by subgroup (:mod:`jax_mlpo.engine.snapshot`).

        Args:
          concurrent: whether updates may run before it is closed (an asynchronous checkpoint):
            the dirty subgroups are written to their tiers now, and later write-backs leave the
            blobs it reads intact. Otherwise no update may run until it is closed.

        Returns:
          The snapshot; close it when done.

        Raises:
          EngineFailedError: the engine failed or was closed.
          CheckpointInProgressError: another snapshot of this engine is open (a checkpoint
            being written).
        """
        engine, idle = self._engine, self._idle
        with self._step_lock:
            self._health.check_usable()
            self._refuse_while_snapshot_open("saving another")
            # Between steps the snapshot reads through the free buffers: the reads issued
            # ahead give theirs back. A concurrent one has buffers of its own.
            idle.pause(cancel=not concurrent)
            idle.drain_writes()
            if concurrent:
                idle.flush_retained()
            self.open_snapshot = StateSnapshot(
                engine.pipeline, engine.kinds, engine.layout, engine.tiers, engine.tier_of,
                engine.step_count,
                concurrent=concurrent, on_close=self._snapshot_closed,
            )  # fmt: skip
            if concurrent:
                idle.resume()
            return self.open_snapshot

    def _refuse_while_snapshot_open(self, action: str) -> None:
        if self.open_snapshot is not None:
            raise CheckpointInProgressError(
                "a checkpoint of this optimizer is still being written: wait for it "
                f"(CheckpointManager.wait_until_finished()) before {action}"
            )

    def _snapshot_closed(self) -> None:
        # Between steps the snapshot's I/O belongs to no update. A concurrent one closes on the
        # checkpoint's thread, maybe inside an update: its reads count in the updates' tier
        # bytes then, rather than the window being reset under the update.
        concurrent = self.open_snapshot.concurrent
        if not concurrent:
            self._idle.window.reset()
        self.open_snapshot = None
        if not concurrent:  # the free buffers are the cache's again
            self._idle.resume()

    def state_dict(self) -> dict[str, list[np.ndarray | None]]:
        """The optimizer's state per parameter leaf, independent of subgroups and tiers.

        The whole state in new arrays: for tests and small states (checkpoints stream it
        through :meth:`snapshot` instead).

        Returns:
          ``{"mu": [...], "nu": [...], "master": [...]}`` (the optimizer's moments by name:
          Lion has no ``nu``), float32 arrays of each leaf's shape
          (``master`` holds the fp32 master copy of bfloat16 leaves and None for float32 ones,
          whose master copy is the params themselves).
        """
        layout = self._engine.layout
        out = {name: [np.zeros(s, F32) for s in layout.shapes] for name in layout.moment_names}
        out["master"] = [
            np.zeros(s, F32) if layout.has_master(j) else None for j, s in enumerate(layout.shapes)
        ]
        with self.snapshot() as snap:
            for sg, blob in snap.blobs():
                gather_state(sg, blob, out)
        return out

    def load_state_dict(self, step: int, state: dict[str, list[np.ndarray | None]]) -> None:
        """Replaces the optimizer's state with ``state`` (as :meth:`state_dict` gives it) at
        ``step``.

        Raises:
          ValueError: if the leaves' shapes differ from the layout's.
        """
        layout = self._engine.layout
        for name in layout.moment_names:
            shapes = tuple(tuple(np.shape(x)) for x in state[name])
            if shapes != layout.shapes:
                raise ValueError(f"{name}: leaf shapes {shapes} differ from {layout.shapes}")
        self.load(step, lambda sg, blob: scatter_state(sg, state, blob))

    def load(self, step: int, fill: Callable[[Subgroup, np.ndarray], None]) -> None:
        """Replaces the optimizer's state at ``step``, subgroup by subgroup in order.

        Args:
          step: the step the new state is at.
          fill: fills a subgroup's blob (``[p | m | v]`` float32) with its new state; the
            blobs are written to the tiers behind it, through the cache's free buffers.

        Raises:
          TierIOError: a tier write failed (the engine is failed then).
          Whatever ``fill`` raises (the engine is failed then: its state is partly replaced).
        """
        engine, idle = self._engine, self._idle
        with self._step_lock:
            self._health.check_usable()
            self._refuse_while_snapshot_open("loading a state")
            idle.pause(cancel=True)  # they hold the state being replaced
            idle.drain_writes()
            try:
                pipeline, layout = engine.pipeline, engine.layout
                buffers = spare_buffers(pipeline, layout) if engine.tiers else []
                for sg, blob in stream_blobs(pipeline, layout.subgroups, buffers, load=True):
                    fill(sg, blob)
            except BaseException as e:
                self._health.failed = e
                raise
            idle.window.reset()  # this I/O belongs to no update
            engine.step_count = int(step)
            idle.resume()
