"""The engine's I/O between updates: write-backs landing, retained subgroups flushed, reads ahead.

Between two updates the pipeline goes on working: the last update's write-backs land
(write-behind) and the next update's reads are issued into the buffers they free
(:mod:`jax_mlpo.engine.read_ahead`). Anything else that needs the cache pauses that work first and
resumes it after: an update keeps the reads issued ahead, a snapshot between steps or a ``load``
cancels them. An error that leaves a subgroup's state lost fails the engine
(:class:`EngineHealth`, which the engine and its collaborators share).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from jax_mlpo.engine.buffers import IOPipeline
from jax_mlpo.engine.read_ahead import ReadAhead
from jax_mlpo.engine.step_metrics import StepMetrics, TierIOWindow
from jax_mlpo.errors import EngineFailedError
from jax_mlpo.tiers.errors import TierIOError


class EngineHealth:
    """Whether an engine can still run: failed (its state partly updated or lost) or closed."""

    def __init__(self) -> None:
        self.failed: BaseException | None = None
        self.closed = False

    def check_usable(self) -> None:
        """Raises EngineFailedError, naming the fix, when the engine failed or was closed."""
        if self.closed:
            raise EngineFailedError("this optimizer was closed (jax_mlpo.close); init a new one")
        if self.failed is not None:
            raise EngineFailedError(
                f"an earlier update failed midway ({self.failed!r}), so the offloaded state is "
                "partly updated. Restore from your last checkpoint and init a new optimizer."
            ) from self.failed


class IdleIO:
    """The between-updates I/O of one engine.

    Args:
      pipeline: the engine's I/O pipeline.
      read_ahead: its read-ahead thread, or None (no tiers, or the baseline's gradients).
      window: the tier I/O since the last update started, which the next closes.
      metrics: the engine's per-update figures (the last one takes its late write-backs).
      health: the engine's.
      next_order: the subgroups of the next update, in its order.
      host_only: the whole state lives in host memory: nothing to drain or flush.
    """

    def __init__(
        self, pipeline: IOPipeline, read_ahead: ReadAhead | None, window: TierIOWindow,
        metrics: Sequence[StepMetrics], health: EngineHealth,
        next_order: Callable[[], list[int]], host_only: bool,
    ) -> None:  # fmt: skip
        self.pipeline, self.read_ahead, self.window = pipeline, read_ahead, window
        self._metrics, self._health = metrics, health
        self._next_order, self._host_only = next_order, host_only

    def resume(self) -> None:
        """Starts reading the next update's subgroups into the buffers free between steps."""
        if self.read_ahead is None or self._health.closed or self._health.failed is not None:
            return
        self.read_ahead.start(self._next_order())

    def pause(self, *, cancel: bool = False) -> None:
        """Gives the cache back to the caller: the reads issued ahead stay for the next update,
        or are dropped with ``cancel`` (the state is about to be read out or replaced).

        Raises:
          TierIOError: a write-back the pass reclaimed had failed (the engine is failed then).
        """
        if self.read_ahead is None:
            return
        try:
            self.read_ahead.stop()
            if cancel:
                self.pipeline.cancel_reads()
        except BaseException as e:
            self._health.failed = e
            self.pipeline.abort()
            raise

    def take(self, metrics: StepMetrics) -> None:
        """Stops the read-ahead before an update, which uses the reads it issued.

        Raises:
          TierIOError: a read issued ahead has failed: the update does not start, the
            optimizer state is as the last update left it (the engine stays usable).
        """
        self.pause()
        metrics.reads_ahead = len(self.pipeline.reads_ahead)
        failed = self.pipeline.failed_read_ahead()
        if failed is None:
            return
        index, error = failed
        self.pause(cancel=True)
        message = (
            f"subgroup {index}: a read issued ahead of this update failed ({error}). The "
            "update did not start and the optimizer state is as the last update left it: "
            "retry the step once the tier is readable, or restore from a checkpoint."
        )
        raise (type(error) if isinstance(error, TierIOError) else TierIOError)(message) from error

    def drain(self) -> None:
        """Waits for the write-backs the last update left in flight (``write_behind``); the
        read-ahead goes on into the buffers they free.

        Raises:
          TierIOError: if one failed (and no other tier took it); the engine is failed then.
        """
        self.pause()
        self.drain_writes()
        self.resume()

    def drain_writes(self) -> None:
        """:meth:`drain` with the read-ahead already paused."""
        if not self.pipeline.writes:
            return
        t0 = time.monotonic()
        try:
            self.pipeline.drain()
        except BaseException as e:
            self._health.failed = e
            self.pipeline.abort(cancel=False)  # let the other write-backs land: less state lost
            raise
        last = self._metrics[-1] if self._metrics else None
        if last is not None:  # the last step's figures include its late write-backs
            last.write_wait_s += time.monotonic() - t0
            last.total_s += time.monotonic() - t0
        self.window.close_into(last)

    def flush(self) -> None:
        """Writes the subgroups retained in host memory to their tiers (they stay cached)."""
        if self._host_only or self._health.failed is not None:
            return
        self.pause()
        self.flush_retained()
        self.resume()

    def flush_retained(self) -> None:
        """:meth:`flush` with the read-ahead already paused."""
        if self._host_only:
            return
        self.drain_writes()
        self.pipeline.flush()
        self.window.reset()  # these writes belong to no update
