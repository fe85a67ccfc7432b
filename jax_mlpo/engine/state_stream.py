"""Every subgroup's state streamed out of, or into, the host cache and the tiers, in order.

A checkpoint of state larger than host memory, or a restore into it, moves the state subgroup
by subgroup through a few buffers: :func:`stream_blobs` overlaps one subgroup's tier I/O with
the caller's use of the next, and :func:`spare_buffers` finds those buffers among the host
cache's free ones (no host memory beyond ``host_cache`` where they suffice).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jax_mlpo.engine.buffers import IOPipeline
from jax_mlpo.engine.layout import Layout, Subgroup
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.tiers.posix import aligned_empty

Future = concurrent.futures.Future

READ_AHEAD = 2  # buffers of a stream: one blob read while the last is consumed


def spare_buffers(pipeline: IOPipeline, layout: Layout) -> list[np.ndarray]:
    """Buffers for work between steps: the cache's free ones, topped up to ``READ_AHEAD`` with
    blobs beyond the cache (where dirty subgroups hold the rest), so that one subgroup's tier
    I/O overlaps the next one's use.

    Call it with no write-back in flight and no read issued ahead: their buffers are busy.
    """
    free = pipeline.free_buffers()
    extra = max(0, READ_AHEAD - len(free))
    return free + [aligned_empty(layout.max_state_elems, np.float32) for _ in range(extra)]


def stream_blobs(
    pipeline: IOPipeline, subgroups: Sequence[Subgroup], buffers: Sequence[np.ndarray], *,
    load: bool, source: Callable[[int], tuple[FileTierStore, str]] | None = None,
) -> Iterator[tuple[Subgroup, np.ndarray]]:  # fmt: skip
    """Yields every subgroup's blob, in order, with the tiers' I/O overlapped.

    A dirty subgroup is yielded from its slot in the cache (unless ``source`` is given). The
    others go through ``buffers``: read from their tier ahead of the caller (as many reads in
    flight as there are buffers), or, with ``load``, written to their tier behind the caller
    once it has filled the blob.

    Args:
      pipeline: the engine's I/O pipeline (and through it, its cache).
      subgroups: the subgroups, in the order to yield them.
      buffers: float32 buffers, each at least the largest blob (at least one where a tier
        is read or written).
      load: whether the caller fills the blobs (written to the tiers) or reads them.
      source: where subgroup ``i``'s blob is read from, as (store, kind); default where its
        state is now (:meth:`~jax_mlpo.engine.buffers.IOPipeline.location`), or its slot
        when dirty.

    Yields:
      ``(subgroup, blob)``; a blob is valid until the next one is asked for.

    Raises:
      TierIOError: a read or write failed.
    """
    cache = pipeline.cache
    where = source or pipeline.location
    free = list(buffers)
    queue: deque[tuple[Subgroup, np.ndarray, np.ndarray | None, Future | None]] = deque()
    try:
        if load:
            for sg in subgroups:
                if sg.index in cache.dirty:  # host memory is where it lives
                    yield sg, cache.blob(sg.index, cache.dirty[sg.index])
                    continue
                if not free:  # the oldest write in flight gives its buffer
                    done, _, buffer, future = queue.popleft()
                    pipeline.wait(future, done.index)
                    free.append(buffer)
                buffer = free.pop()
                blob = buffer[: sg.state_elems]
                yield sg, blob
                queue.append((sg, blob, buffer, pipeline.write(sg.index, blob)))
            while queue:
                done, _, _, future = queue.popleft()
                pipeline.wait(future, done.index)
            return
        todo = deque(subgroups)
        while todo or queue:
            while todo:  # reads ahead, in order, as far as the buffers allow
                sg = todo[0]
                if source is None and sg.index in cache.dirty:
                    queue.append((sg, cache.blob(sg.index, cache.dirty[sg.index]), None, None))
                elif free:
                    buffer = free.pop()
                    blob = buffer[: sg.state_elems]
                    store, kind = where(sg.index)
                    queue.append((sg, blob, buffer, store.read(sg.index, blob, kind)))
                else:
                    break
                todo.popleft()
            sg, blob, buffer, future = queue.popleft()
            if future is not None:
                pipeline.wait(future, sg.index)
            yield sg, blob
            if buffer is not None:
                free.append(buffer)
    finally:  # no request may outlive the buffers it uses
        concurrent.futures.wait([e[3] for e in queue if e[3] is not None])
