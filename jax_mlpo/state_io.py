"""The engine's state in its logical layout: snapshots for checkpoints, ``state_dict``, ``load``.

Mixed into :class:`jax_mlpo.engine.Engine`, whose update loop stays in its own module: these
methods read the state out subgroup by subgroup (:mod:`jax_mlpo.snapshot`) or replace it
(:mod:`jax_mlpo.state_stream`), between updates or, for an asynchronous checkpoint, while they
run. They take the engine's step lock, stop its read-ahead first and fail the engine where its
state could be left partly replaced.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jax_mlpo.layout import Subgroup, gather_state, scatter_state
from jax_mlpo.snapshot import StateSnapshot
from jax_mlpo.state_stream import spare_buffers, stream_blobs
from jax_mlpo.types import F32


class EngineStateIO:
    """The state I/O of an :class:`~jax_mlpo.engine.Engine` (a mixin: it uses the engine's
    ``_step_lock``, ``pipeline``, ``layout``, ``tiers``, ``_window`` and read-ahead control)."""

    def snapshot(self, *, concurrent: bool = False) -> StateSnapshot:
        """The state at this step, to read subgroup by subgroup (:mod:`jax_mlpo.snapshot`).

        Args:
          concurrent: whether updates may run before it is closed (an asynchronous checkpoint):
            the dirty subgroups are written to their tiers now, and later write-backs leave the
            blobs it reads intact. Otherwise no update may run until it is closed.

        Returns:
          The snapshot; close it when done.

        Raises:
          EngineFailedError: the engine failed or was closed.
          RuntimeError: another snapshot of this engine is open (a checkpoint being written).
        """
        with self._step_lock:
            self._check_usable()
            if self._snapshot is not None:
                raise RuntimeError(
                    "a checkpoint of this optimizer is still being written: wait for it "
                    "(CheckpointManager.wait_until_finished()) before saving another"
                )
            # Between steps the snapshot reads through the free buffers: the reads issued
            # ahead give theirs back. A concurrent one has buffers of its own.
            self._pause_read_ahead(cancel=not concurrent)
            self._drain()
            if concurrent:
                self._flush()
            self._snapshot = StateSnapshot(
                self.pipeline, self._kinds, self.layout, self.tiers, self.tier_of,
                self.step_count,
                concurrent=concurrent, on_close=self._snapshot_closed,
            )  # fmt: skip
            if concurrent:
                self._resume_read_ahead()
            return self._snapshot

    def _snapshot_closed(self) -> None:
        # Between steps the snapshot's I/O belongs to no update. A concurrent one closes on the
        # checkpoint's thread, maybe inside an update: its reads count in the updates' tier
        # bytes then, rather than the window being reset under the update.
        concurrent = self._snapshot.concurrent
        if not concurrent:
            self._window.reset()
        self._snapshot = None
        if not concurrent:  # the free buffers are the cache's again
            self._resume_read_ahead()

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
        layout = self.layout
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
        for name in self.layout.moment_names:
            shapes = tuple(tuple(np.shape(x)) for x in state[name])
            if shapes != self.layout.shapes:
                raise ValueError(f"{name}: leaf shapes {shapes} differ from {self.layout.shapes}")
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
        with self._step_lock:
            self._check_usable()
            if self._snapshot is not None:
                raise RuntimeError("a checkpoint of this optimizer is being written")
            self._pause_read_ahead(cancel=True)  # they hold the state being replaced
            self._drain()
            try:
                buffers = spare_buffers(self.pipeline, self.layout) if self.tiers else []
                sgs = self.layout.subgroups
                for sg, blob in stream_blobs(self.pipeline, sgs, buffers, load=True):
                    fill(sg, blob)
            except BaseException as e:
                self._failed = e
                raise
            self._window.reset()  # this I/O belongs to no update
            self.step_count = int(step)
            self._resume_read_ahead()
