"""The engine's I/O between updates: write-backs landing, retained subgroups flushed, reads ahead.

Mixed into :class:`jax_mlpo.engine.Engine`, whose update loop stays in its own module. Between
two updates the pipeline goes on working: the last update's write-backs land (write-behind) and
the next update's reads are issued into the buffers they free (:mod:`jax_mlpo.read_ahead`).
Anything else that needs the cache pauses that work first and resumes it after: an update
keeps the reads issued ahead, a snapshot between steps or a ``load`` cancels them. An error
that leaves a subgroup's state lost fails the engine.
"""

from __future__ import annotations

import time

from jax_mlpo import retention
from jax_mlpo.step_metrics import StepMetrics
from jax_mlpo.tiers.errors import TierIOError


class EngineIdleIO:
    """The between-updates I/O of an :class:`~jax_mlpo.engine.Engine` (a mixin: it uses the
    engine's ``pipeline``, ``_read_ahead``, ``metrics``, ``_window``, ``_failed``, ``_closed``,
    ``step_count``, ``layout`` and ``config``)."""

    def _resume_read_ahead(self) -> None:
        """Starts reading the next update's subgroups into the buffers free between steps."""
        if self._read_ahead is None or self._closed or self._failed is not None:
            return
        n = len(self.layout.subgroups)
        self._read_ahead.start(retention.step_order(n, self.step_count, self.config.order))

    def _pause_read_ahead(self, *, cancel: bool = False) -> None:
        """Gives the cache back to the caller: the reads issued ahead stay for the next update,
        or are dropped with ``cancel`` (the state is about to be read out or replaced).

        Raises:
          TierIOError: a write-back the pass reclaimed had failed (the engine is failed then).
        """
        if self._read_ahead is None:
            return
        try:
            self._read_ahead.stop()
            if cancel:
                self.pipeline.cancel_reads()
        except BaseException as e:
            self._failed = e
            self.pipeline.abort()
            raise

    def _take_read_ahead(self, metrics: StepMetrics) -> None:
        """Stops the read-ahead before an update, which uses the reads it issued.

        Raises:
          TierIOError: a read issued ahead has failed: the update does not start, the
            optimizer state is as the last update left it (the engine stays usable).
        """
        self._pause_read_ahead()
        metrics.reads_ahead = len(self.pipeline.reads_ahead)
        failed = self.pipeline.failed_read_ahead()
        if failed is None:
            return
        index, error = failed
        self._pause_read_ahead(cancel=True)
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
        self._pause_read_ahead()
        self._drain()
        self._resume_read_ahead()

    def _drain(self) -> None:
        if not self.pipeline.writes:
            return
        t0 = time.monotonic()
        try:
            self.pipeline.drain()
        except BaseException as e:
            self._failed = e
            self.pipeline.abort(cancel=False)  # let the other write-backs land: less state lost
            raise
        if self.metrics:  # the last step's figures include its late write-backs
            last = self.metrics[-1]
            last.write_wait_s += time.monotonic() - t0
            last.total_s += time.monotonic() - t0
        self._window.close_into(self.metrics[-1] if self.metrics else None)

    def flush(self) -> None:
        """Writes the subgroups retained in host memory to their tiers (they stay cached)."""
        if self.host_only or self._failed is not None:
            return
        self._pause_read_ahead()
        self._flush()
        self._resume_read_ahead()

    def _flush(self) -> None:
        if self.host_only:
            return
        self._drain()
        self.pipeline.flush()
        self._window.reset()  # these writes belong to no update
