"""The orbax handler of a pytree that may hold offloaded AdamW states, and its args.

:class:`OffloadCheckpointHandler` is an ``ocp.AsyncCheckpointHandler``: it composes with any
orbax ``CheckpointManager``, e.g. ``OffloadSave(tree, params=...)`` and ``OffloadRestore(target)``
as items of ``ocp.args.Composite`` next to the caller's own. It snapshots the tree
(:mod:`~jax_mlpo.checkpoint.snapshot`), has orbax's ``PyTreeCheckpointHandler`` write it, streams
the offloaded states (:mod:`~jax_mlpo.checkpoint.stream`), writes the checksum manifest
(:mod:`~jax_mlpo.checkpoint.manifest`) and, on restore, reads what the restore plan says
(:mod:`~jax_mlpo.checkpoint.restore_plan`), verifies it and loads it
(:mod:`~jax_mlpo.checkpoint.load`).

Crash safety: everything is written into orbax's temporary directory and published by orbax's
atomic rename once every file is written (tensorstore fsyncs the array files, the streamed
arrays are fdatasync'd, the manifest is fsynced), so a process killed at any moment leaves the
previous checkpoints as they were and at most a temporary directory, which
``CheckpointManager`` never returns as a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jax_mlpo.checkpoint import failures, manifest
from jax_mlpo.checkpoint.blocks import as_read
from jax_mlpo.checkpoint.host_arrays import DirectNumpyHandler, tree_handler
from jax_mlpo.checkpoint.load import load
from jax_mlpo.checkpoint.manifest import FORMAT, CorruptCheckpointError
from jax_mlpo.checkpoint.recycle import SpareFiles
from jax_mlpo.checkpoint.restore_plan import plan_restore
from jax_mlpo.checkpoint.snapshot import OffloadedStream, snapshot
from jax_mlpo.checkpoint.space import check_space
from jax_mlpo.checkpoint.stream import write_streams
from jax_mlpo.checkpoint.tree import leaves
from jax_mlpo.transforms.runtime import RUNTIME


@contextlib.contextmanager
def streams_held() -> Iterator[None]:
    """Holds back the streams of the offloaded states of the saves started inside.

    An asynchronous save writes the large host arrays (the params) before it returns; the
    offloaded states' streams (several GB) would share the disk with them and lengthen the time
    the training loop waits. Only around a save that returns before its streams end: a
    synchronous manager runs them inside ``save``.
    """
    RUNTIME.checkpoints.streams_may_start.clear()
    try:
        yield
    finally:
        RUNTIME.checkpoints.streams_may_start.set()


class OffloadCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores a pytree that may hold offloaded AdamW states, checksummed.

    ``async_save`` snapshots the tree synchronously (small arrays copied, every
    :class:`~jax_mlpo.OffloadedState` reduced to its count and its engine snapshotted,
    copy-on-write where ``concurrent``), writes the large host arrays
    (:class:`~jax_mlpo.checkpoint.host_arrays.DirectNumpyHandler`) and hands the rest to orbax's
    ``PyTreeCheckpointHandler``; in the background it streams the offloaded states (once
    :func:`streams_held` lets them) and writes the checksum manifest.
    ``restore`` needs the target tree (for the engines to load into) except for trees without
    offloaded states; it verifies every shard and piece it reads.
    """

    def __init__(self) -> None:
        self._arrays = DirectNumpyHandler()
        self._tree = tree_handler(self._arrays)

    async def async_save(
        self, directory: epath.Path, args: OffloadSave | None = None, **kwargs: Any
    ) -> list[ocp.future.Future]:
        """Snapshots ``args.item`` now; returns the futures that write it.

        Args:
          directory: the item's directory (orbax's temporary one).
          args: ``OffloadSave(tree, params=...)``.
          **kwargs: refused (orbax's legacy ``item=`` form).

        Returns:
          The futures writing the arrays and the manifest.

        Raises:
          StaleStateError: if an offloaded state is not the one its engine was last advanced to.
          EngineFailedError: if an update failed midway (the state is inconsistent).
          ValueError: in a multi-process run, for an offloaded state without its params.
        """
        concurrent = getattr(args, "concurrent", True)
        # In a thread: orbax runs the items' async_save concurrently, so the snapshot (which
        # writes the retained subgroups to their tiers) overlaps the params item's writes
        # instead of holding the event loop before them.
        host, streams = await asyncio.to_thread(
            _host_tree, args, kwargs, directory, concurrent=concurrent
        )
        spares = args.spares
        try:
            with failures.explained(directory):
                self._arrays.digests.clear()
                self._arrays.spares = spares
                # writes the large host arrays before it returns (they are not copied)
                futures = await self._tree.async_save(directory, args=ocp.args.PyTreeSave(host))
                records = manifest.host_records(host, self._arrays.digests)
        except BaseException:
            for stream in streams:
                stream.snapshot.close()
            raise
        rest = ocp.future.CommitFutureAwaitingContractedSignals(
            self._write_streams_and_manifest(directory, records, streams, spares),
            name="jax_mlpo_state",
        )
        return [*(futures or []), rest]

    async def _write_streams_and_manifest(
        self, directory: Any, records: dict[str, Any], streams: list[OffloadedStream],
        spares: SpareFiles | None,
    ) -> None:  # fmt: skip
        try:
            if hasattr(directory, "await_creation"):  # orbax creates it asynchronously
                directory = await directory.await_creation()
            await asyncio.to_thread(RUNTIME.checkpoints.streams_may_start.wait)
            with failures.explained(directory):
                # in a thread: the stream blocks on tier reads and tensorstore writes
                streamed = await asyncio.to_thread(write_streams, directory, streams, spares)
                self._write_manifest(directory, records, streamed)
        finally:
            for stream in streams:
                stream.snapshot.close()

    def _write_manifest(
        self, directory: Any, records: dict[str, Any], streamed: dict[str, Any]
    ) -> None:
        # Every process digests what it writes; with several, process 0 merges them at
        # finalize, once orbax has seen every process's writes complete.
        name, text = manifest.manifest_file(records, streamed, directory)
        manifest.write_synced(directory / name, text)

    def save(self, directory: epath.Path, args: OffloadSave | None = None, **kwargs: Any) -> None:
        """Like :meth:`async_save`, returning once everything is written.

        Args:
          directory: the item's directory.
          args: ``OffloadSave(tree, params=...)``.
          **kwargs: refused (orbax's legacy ``item=`` form).
        """
        # Orbax's synchronous save of the tree, rather than running async_save in an event
        # loop: orbax exposes no public way to run a coroutine where a loop may be running.
        host, streams = _host_tree(args, kwargs, directory, concurrent=False)
        try:
            with failures.explained(directory):
                self._arrays.digests.clear()
                self._arrays.spares = args.spares
                self._tree.save(directory, args=ocp.args.PyTreeSave(host))
                records = manifest.host_records(host, self._arrays.digests)
                streamed = write_streams(directory, streams, args.spares)
                self._write_manifest(directory, records, streamed)
        finally:
            for stream in streams:
                stream.snapshot.close()

    def restore(self, directory: epath.Path, args: OffloadRestore | None = None) -> Any:
        """Restores the tree saved in ``directory``, verified against its checksums.

        Args:
          directory: the item's directory.
          args: ``OffloadRestore(target)``. Offloaded states in ``target`` (from ``tx.init``,
            with any offload config and process count) get the checkpoint's state loaded into
            their engines (each process its shards); device arrays come back on the target's
            shardings. Without a target, the saved tree comes back in orbax's dict form (only
            for trees without offloaded states or sharded arrays).

        Returns:
          The restored tree, of ``target``'s structure.

        Raises:
          CorruptCheckpointError: a leaf or shard, or the manifest, does not match its digest
            (on every process, whichever found it).
          ValueError: the checkpoint's leaves, dtypes or shapes differ from the target's.
        """
        target = args.item if args is not None else None
        error, restored = None, None
        try:
            saved = manifest.read_manifest(directory)
            if target is None:
                restored = self._tree.restore(directory)
                reads = {name: as_read(leaf) for name, leaf in leaves(restored).items()}
                manifest.verify(reads, saved, directory)
                restored = restored.get("tree", {})  # orbax leaves out an empty subtree
            else:
                restored = self._restore_into(directory, target, saved)
        except Exception as e:  # noqa: BLE001 - raised below, once every process knows
            error = e
        _agree(error, directory)
        return restored

    def _restore_into(self, directory: epath.Path, target: Any, saved: dict[str, Any]) -> Any:
        plan = plan_restore(target, saved, directory)
        restored = self._tree.restore(
            directory,
            args=ocp.args.PyTreeRestore(item=plan.item, restore_args=plan.restore_args),
        )
        reads = jax.tree.map(as_read, restored)
        manifest.verify(leaves(reads), saved, directory)
        return load(target, plan.leaves["tree"], reads["tree"], plan.streams, directory)

    def metadata(self, directory: epath.Path) -> dict[str, Any]:
        """The saved leaves' and streamed arrays' dtypes, shapes and digests by path, without
        reading arrays."""
        body = manifest.read_manifest(directory)
        return {**body["leaves"], **body["streamed"]}

    def finalize(self, directory: epath.Path) -> None:
        """orbax's finalize (process 0, after every process wrote): merges the manifests."""
        self._tree.finalize(directory)
        manifest.merge_process_manifests(directory)

    def close(self) -> None:
        """Closes orbax's tree handler and the params' writer."""
        self._tree.close()
        self._arrays.close()


@ocp.args.register_with_handler(OffloadCheckpointHandler, for_save=True)
@dataclasses.dataclass
class OffloadSave(ocp.args.CheckpointArgs):
    """Save args of :class:`OffloadCheckpointHandler`.

    Attributes:
      item: the tree to save (params, opt_state, scalars).
      params: the params the offloaded states in ``item`` were initialised with (arrays or
        ``jax.ShapeDtypeStruct``); needed in a multi-process run, where they give the global
        shapes of the leaves whose shards each process's engine holds.
      concurrent: for an asynchronous save, whether updates may run while it is written
        (copy-on-write on the tiers); False: the caller waits for it before the next update.
      spares: files of a deleted checkpoint for the save to rewrite
        (:func:`~jax_mlpo.checkpoint.recycle.spare_files`), or None: new files.
    """

    item: Any
    params: Any = None
    concurrent: bool = True
    spares: SpareFiles | None = None


@ocp.args.register_with_handler(OffloadCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class OffloadRestore(ocp.args.CheckpointArgs):
    """Restore args of :class:`OffloadCheckpointHandler`: the target tree, or None."""

    item: Any = None


def _host_tree(
    args: OffloadSave | None, kwargs: dict[str, Any], directory: Any, *, concurrent: bool
) -> tuple[dict[str, Any], list[OffloadedStream]]:
    """The host tree orbax writes (the snapshot of ``args.item`` and the format) and the
    offloaded states' streams, after checking there is disk space for them."""
    if not isinstance(args, OffloadSave):
        raise ValueError(
            "pass the item as args=jax_mlpo.checkpoint.OffloadSave(tree), got "
            f"{type(args).__name__} (and {sorted(kwargs)})"
        )
    check_space(args.item, directory, concurrent=concurrent)
    tree, streams = snapshot(args.item, args.params, concurrent=concurrent)
    # The format leaf also keeps orbax from refusing a tree without leaves (optax.sgd's state).
    return {"format": FORMAT, "tree": tree}, streams


def _agree(error: BaseException | None, directory: Any) -> None:
    """Raises on every process if restoring failed on any, so that none goes on alone.

    Args:
      error: what restoring raised on this process, or None.
      directory: the item's directory, for the message.

    Raises:
      CorruptCheckpointError: this or another process found the checkpoint corrupt.
      RuntimeError: restoring failed on another process (for another reason).
    """
    if jax.process_count() > 1:
        code = 0 if error is None else 1 if isinstance(error, CorruptCheckpointError) else 2
        codes = np.asarray(multihost_utils.process_allgather(np.int32(code))).reshape(-1)
        failed = [k for k, c in enumerate(codes.tolist()) if c]
        if error is None and failed:
            message = f"checkpoint {directory}: restoring failed on process(es) {failed}"
            if 1 in codes.tolist():
                raise CorruptCheckpointError(f"{message}: the checkpoint is corrupt")
            raise RuntimeError(f"{message} (see their errors)")
    if error is not None:
        raise error
