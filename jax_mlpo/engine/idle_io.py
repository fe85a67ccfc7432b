"""The engine's I/O between updates: write-backs landing, retained subgroups flushed, reads ahead.

Between two updates the pipeline goes on working: the last update's write-backs land
(write-behind) and the next update's reads are issued into the buffers they free. Anything else
that needs the cache pauses that work first and resumes it after: an update keeps the reads
issued ahead, a snapshot between steps or a ``load`` cancels them. An error that leaves a
subgroup's state lost fails the engine (:class:`EngineHealth`, which the engine and its
collaborators share). :class:`IdleIO` does all of it for one engine; :class:`TierIOWindow` counts
the tiers' I/O between two updates into the figures of the first.

Read-ahead across steps (:class:`ReadAhead`): the next update's reads run during the forward
and backward pass. Between two updates the host buffers either hold subgroups the next update
starts with, or come free as the last update's write-backs land (write-behind). The next
update's order is known (:mod:`jax_mlpo.engine.retention`) and nothing changes the state before
it runs, so its reads can start in those free buffers right away instead of when the update
does. :class:`ReadAhead` runs :meth:`~jax_mlpo.engine.buffers.IOPipeline.read_ahead` on a thread
of its own after each update, once more each time a write-back frees a buffer, until no buffer
is left or the engine needs its cache again: then :meth:`ReadAhead.stop` returns with the reads
issued so far still in flight, and the update finds them resident or on their way. The engine
stops it before anything else touches the cache: an update (which keeps the reads), a checkpoint
snapshot, a ``load`` or ``close`` (which cancel them: the snapshot reads through the free
buffers, the load replaces the state they hold).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_mlpo.engine.buffers import IOPipeline
from jax_mlpo.engine.step_metrics import StepMetrics
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


class TierIOWindow:
    """Each tier's bytes and busy time since a mark, added to the figures of a step.

    A step's figures hold the tiers' I/O from its start to the next update's start: its own,
    the write-backs that finish after it returned (write-behind) and the next update's reads
    issued ahead (read-ahead), so that each step's bytes and busy time add up to the
    iteration's. The next update first closes the window into the last step's figures.

    Args:
      stores: the tiers (each with ``tier.path``, ``bytes_read``, ``bytes_written``, ``busy_s``).
    """

    def __init__(self, stores: Sequence[Any]) -> None:
        self._stores = stores
        self._mark: list[tuple[int, int, float]] | None = None

    def _now(self) -> list[tuple[int, int, float]]:
        return [(t.bytes_read, t.bytes_written, t.busy_s) for t in self._stores]

    def reset(self) -> None:
        """Starts a new window: the I/O so far belongs to no step (a flush, a load)."""
        self._mark = self._now()

    def close_into(self, metrics: StepMetrics | None) -> None:
        """Adds the window's I/O to ``metrics`` (if any) and starts a new window."""
        now = self._now()
        if metrics is not None and self._mark is not None:
            for store, (r0, w0, b0), (r1, w1, b1) in zip(self._stores, self._mark, now,
                                                          strict=True):  # fmt: skip
                path = store.tier.path
                metrics.bytes_read[path] = metrics.bytes_read.get(path, 0) + r1 - r0
                metrics.bytes_written[path] = metrics.bytes_written.get(path, 0) + w1 - w0
                metrics.tier_busy_s[path] = metrics.tier_busy_s.get(path, 0.0) + b1 - b0
        self._mark = now


class ReadAhead:
    """The read-ahead of one engine's I/O pipeline: at most one pass between two updates.

    Args:
      pipeline: the engine's I/O pipeline; only this object's thread touches it (and its
        cache) while it runs.
    """

    def __init__(self, pipeline: IOPipeline) -> None:
        self._pipeline = pipeline
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether a pass is issuing reads now (or waiting for a write-back to free a buffer)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, order: Sequence[int]) -> None:
        """Starts issuing the reads of the update that will run in ``order``."""
        self.stop()
        self._stopping.clear()
        self._wake.clear()
        thread = threading.Thread(
            target=self._run, args=(list(order),), name="jax_mlpo-read-ahead", daemon=True
        )
        # started before it is published: a stop() on another thread (the engine closing)
        # joins only a thread that has started
        thread.start()
        self._thread = thread

    def stop(self) -> None:
        """Stops issuing reads and returns once the pipeline is the caller's again; the reads
        issued stay in flight.

        Raises:
          TierIOError: a write-back of the last update failed while the pass reclaimed it
            (and no other tier took it): that subgroup's state is lost.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping.set()
        self._wake.set()
        thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self, order: list[int]) -> None:
        try:
            with jax.profiler.TraceAnnotation("jax_mlpo.engine.read_ahead"):
                while not self._stopping.is_set():
                    pending = self._pipeline.read_ahead(order)
                    if pending is None:
                        return
                    pending.add_done_callback(self._woken)
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as e:  # re-raised by stop(), in the engine's thread
            self._error = e

    def _woken(self, _: concurrent.futures.Future) -> None:
        self._wake.set()
