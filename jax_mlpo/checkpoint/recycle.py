"""The data files of a deleted checkpoint, rewritten in place by the next save.

A checkpoint's array files are new files, their space reserved with ``fallocate`` (unwritten
extents), and on ext4 an O_DIRECT write into unwritten extents converts them in the journal as
it completes: fio wrote 8 MiB requests into a new, preallocated file at 1.6-2.2 GB/s here,
against 2.3-4.3 GB/s over the written blocks of an existing one (4 and 16 in flight).
A training run keeps its last ``max_to_keep`` checkpoints and deletes older ones, so the bytes
of a deleted checkpoint are free to be rewritten: :func:`~jax_mlpo.checkpoint.manager` has
orbax move a deleted step into :data:`RECYCLED` (its ``todelete_subdir``) instead of deleting
it, and the next save renames that step's large files into its own arrays
(:meth:`SpareFiles.take`, in :func:`~jax_mlpo.checkpoint.shard_file.create_data_file`) and
overwrites them. Every byte of an array is written before it is
published, and its file is cut to its size, so nothing of the old checkpoint remains in it.

Disk: between saves the checkpoint directory holds the last deleted checkpoint besides the kept
ones (it is what the next save rewrites). A save lists that checkpoint's files and deletes the
older leftovers in a background thread (:func:`spare_files`) while it starts: both were part of
the time an asynchronous save holds the training loop. Its space check counts the
files it will rewrite as free only where it fails without them, and then waits for the listing
and the deletions (:func:`wait_for_deletions`).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence

import jax

from jax_mlpo.tiers.posix import round_up_pages
from jax_mlpo.transforms.runtime import RUNTIME

logger = logging.getLogger(__name__)

RECYCLED = "jax_mlpo_recycled"  # orbax's todelete_subdir: <root>/jax_mlpo_recycled/<step>
MIN_BYTES = 1 << 20  # smaller files are not worth a rename (metadata, small arrays)


class SpareFiles:
    """Large files of one deleted checkpoint, for a save to rename into its arrays.

    Thread-safe: the params' writers and the state's streams take files at once. With several
    processes each has its own list of the same files; a file another process renamed first is
    skipped.

    Args:
      files: ``(bytes, path)`` of every file that may be taken (its size in whole pages).
      listing: instead of ``files``, a generator of them in batches, run in a background
        thread (:attr:`thread`): each batch may be taken as soon as it is listed, and
        :attr:`nbytes` waits for all.
      then: run in that thread once the files are listed.
    """

    def __init__(
        self,
        files: Sequence[tuple[int, str]] = (),
        *,
        listing: Callable[[], Iterator[list[tuple[int, str]]]] | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        self._files = sorted(files)
        self._changed = threading.Condition()
        self._listed = listing is None
        self.thread: threading.Thread | None = None
        if listing is not None:
            self.thread = threading.Thread(
                target=self._list, args=(listing, then), name="jax_mlpo-recycle", daemon=True
            )  # a daemon: an exit midway leaves a leftover, which the next save deletes
            self.thread.start()

    def _list(
        self,
        listing: Callable[[], Iterator[list[tuple[int, str]]]],
        then: Callable[[], None] | None,
    ) -> None:
        try:
            for batch in listing():
                with self._changed:
                    for file in batch:
                        bisect.insort(self._files, file)
                    self._changed.notify_all()
        except OSError as e:  # the rest is not rewritten: the save writes new files instead
            logger.warning("jax_mlpo: could not list a deleted checkpoint's files: %s", e)
        finally:
            with self._changed:
                self._listed = True
                self._changed.notify_all()
        if then is not None:
            then()

    @property
    def nbytes(self) -> int:
        """Bytes of the files not taken yet (once all are listed)."""
        with self._changed:
            self._changed.wait_for(lambda: self._listed)
            return sum(n for n, _ in self._files)

    def take(self, path: str, nbytes: int) -> bool:
        """Renames the smallest spare file of at least ``nbytes`` to ``path``.

        Files are for arrays of at least :data:`MIN_BYTES`, and at most twice as large as the
        array (the rest would be cut off, where a larger array could have rewritten it). While
        the files are being listed, it takes the first such file listed (waiting for one).

        Returns:
          Whether one was (``path`` then holds the old bytes: overwrite them all, and cut the
          file to its size).
        """
        if nbytes < MIN_BYTES:
            return False
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._listed or self._fitting(nbytes) is not None)
                k = self._fitting(nbytes)
                if k is None:
                    return False
                _, spare = self._files.pop(k)
            try:
                os.rename(spare, path)
                return True
            except FileNotFoundError:  # another process took it
                continue

    def _fitting(self, nbytes: int) -> int | None:
        """The index of the smallest file listed of ``nbytes`` to twice that, if any."""
        k = bisect.bisect_left(self._files, (nbytes, ""))
        return k if k < len(self._files) and self._files[k][0] <= 2 * nbytes else None


def wait_for_deletions() -> bool:
    """Waits until the leftovers :func:`spare_files` deletes in the background are gone.

    Returns:
      Whether there were any deletions to wait for.
    """
    deletions = RUNTIME.checkpoints.deletions  # listing and deleting (spare_files)
    waited = bool(deletions)
    while deletions:
        deletions.pop().join()
    return waited


def _step_number(name: str) -> int | None:
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else None


def spare_files(root: str | os.PathLike) -> SpareFiles:
    """The files of the last checkpoint deleted from ``root``, for the next save.

    Listed in a background thread, which then (process 0) deletes what is left of earlier
    deleted checkpoints (what the last save did not take; :func:`wait_for_deletions`), while
    the save starts: with the dentries cold, listing took up to 80 ms of the time an
    asynchronous save holds the training loop, in exploratory timings.

    Args:
      root: a checkpoint manager's directory.

    Returns:
      The large files of the deleted step with the highest number (none where nothing was
      deleted, or the manager deletes for good).
    """
    recycled = os.path.join(os.fspath(root), RECYCLED)
    try:
        steps = [(n, e) for e in os.listdir(recycled) if (n := _step_number(e)) is not None]
    except FileNotFoundError:
        return SpareFiles()
    if not steps:
        return SpareFiles()
    steps.sort()
    older = [os.path.join(recycled, name) for _, name in steps[:-1]]

    def delete_older() -> None:
        for path in older if jax.process_index() == 0 else ():
            shutil.rmtree(path, ignore_errors=True)

    newest = os.path.join(recycled, steps[-1][1])
    spares = SpareFiles(listing=lambda: _large_files(newest), then=delete_older)
    deletions = RUNTIME.checkpoints.deletions
    deletions[:] = [t for t in deletions if t.is_alive()]  # not one per save forever
    deletions.append(spares.thread)
    return spares


def _large_files(step: str) -> Iterator[list[tuple[int, str]]]:
    """``(bytes in whole pages, path)`` of the files of at least :data:`MIN_BYTES` in ``step``,
    a directory at a time, the params item's first (a save writes the params first)."""
    tops = sorted(os.listdir(step), key=lambda name: name != "params")
    for top, _, names in (w for name in tops for w in os.walk(os.path.join(step, name))):
        files = []
        for name in names:
            path = os.path.join(top, name)
            try:
                # its blocks: writers move whole pages, then cut the file to the array's size
                size = round_up_pages(os.stat(path).st_size)
            except FileNotFoundError:
                continue
            if size >= MIN_BYTES:
                files.append((size, path))
        if files:
            yield files
