"""Read-ahead across steps: the next update's reads run during the forward and backward pass.

Between two updates the host buffers either hold subgroups the next update starts with, or
come free as the last update's write-backs land (write-behind). The next update's order is
known (:mod:`jax_mlpo.engine.retention`) and nothing changes the state before it runs, so its reads
can start in those free buffers right away instead of when the update does.
:class:`ReadAhead` runs :meth:`~jax_mlpo.engine.buffers.IOPipeline.read_ahead` on a thread
of its own after each update, once more each time a write-back frees a buffer, until no buffer
is left or the engine needs its cache again: then :meth:`ReadAhead.stop` returns with the reads
issued so far still in flight, and the update finds them resident or on their way.

The engine stops it before anything else touches the cache: an update (which keeps the reads),
a checkpoint snapshot, a ``load`` or ``close`` (which cancel them: the snapshot reads through the
free buffers, the load replaces the state they hold).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence

import jax

from jax_mlpo.engine.buffers import IOPipeline


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
