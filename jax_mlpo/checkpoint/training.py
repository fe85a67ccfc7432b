"""A training checkpoint: params, optimizer state and extra scalars, as one orbax step.

:func:`save` and :func:`restore` are the usual way in: each step directory holds three items of
:class:`~jax_mlpo.checkpoint.handler.OffloadCheckpointHandler`, ``params``, ``opt_state`` and
``extra``, saved and restored together through an ``ocp.args.Composite``. A checkpoint is durable
once ``mngr.wait_until_finished()`` returns (or the next save has started: orbax waits for the
previous one first).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, NamedTuple

import orbax.checkpoint as ocp

from jax_mlpo.checkpoint import host_reads
from jax_mlpo.checkpoint.failures import CheckpointWriteError
from jax_mlpo.checkpoint.handler import OffloadRestore, OffloadSave, streams_held
from jax_mlpo.checkpoint.manifest import CorruptCheckpointError
from jax_mlpo.checkpoint.recycle import RECYCLED, SpareFiles, spare_files, wait_for_deletions
from jax_mlpo.checkpoint.snapshot import check_savable
from jax_mlpo.checkpoint.space import CheckpointSpaceError, check_space
from jax_mlpo.transforms.runtime import RUNTIME

logger = logging.getLogger(__name__)


class Restored(NamedTuple):
    """What :func:`restore` returns: the checkpoint's step and the restored trees."""

    step: int
    params: Any
    opt_state: Any
    extra: dict[str, Any]


def manager(
    directory: str | os.PathLike,
    *,
    max_to_keep: int | None = 2,
    async_save: bool = True,
    **options: Any,
) -> ocp.CheckpointManager:
    """An orbax ``CheckpointManager`` for :func:`save` and :func:`restore`.

    Args:
      directory: where the step directories go (created).
      max_to_keep: checkpoints kept (oldest deleted first); None keeps all.
      async_save: write in the background (``save`` returns after the snapshot).
      **options: more ``ocp.CheckpointManagerOptions`` fields (``todelete_subdir=None``:
        deleted checkpoints are deleted for good, and every save writes new files).

    Returns:
      The manager; it removes the temporary directories a killed save left behind, and moves
      a checkpoint it deletes into ``jax_mlpo_recycled/`` for the next save to rewrite
      (:mod:`~jax_mlpo.checkpoint.recycle`).
    """
    options.setdefault("cleanup_tmp_directories", True)  # leftovers of a killed save
    options.setdefault("todelete_subdir", RECYCLED)
    # the params are written while save runs (host_arrays): their directory must exist then
    options.setdefault("async_options", ocp.AsyncOptions(create_directories_asynchronously=False))
    made = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, **options
    )
    mngr = ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=made)
    RUNTIME.checkpoints.manager_options[mngr] = made
    return mngr


def _options_of(mngr: ocp.CheckpointManager) -> ocp.CheckpointManagerOptions:
    """The options :func:`manager` made ``mngr`` with; orbax's defaults for another manager."""
    return RUNTIME.checkpoints.manager_options.get(mngr) or ocp.CheckpointManagerOptions()


def save(
    mngr: ocp.CheckpointManager,
    step: int,
    params: Any,
    opt_state: Any,
    extra: dict[str, Any] | None = None,
    *,
    force: bool = False,
    blocking: bool | None = None,
) -> bool:
    """Saves params, the optimizer state and ``extra`` as checkpoint ``step``.

    Call it between updates with the params and state the last update returned. With an async
    manager it returns once the params are written (without a copy) and the retained subgroups
    are written to their tiers; the offloaded state is streamed into the checkpoint from the
    tiers while the next updates run (they write copy-on-write blobs until the checkpoint has
    read the old ones), and the checkpoint is durable once ``mngr.wait_until_finished()``
    returns. See the module docstring for the contents. With several processes, every process
    calls it (orbax saves collectively); each writes its shards, and the checkpoint holds the
    global state.

    Args:
      mngr: from :func:`manager`, or any ``ocp.CheckpointManager``: one made otherwise is
        taken to have orbax's default options (asynchronous saves, deleted checkpoints not
        rewritten); pass ``blocking=True`` with a synchronous one.
      step: the checkpoint's step, usually the number of updates applied.
      params: the params pytree.
      opt_state: the optimizer state (e.g. an ``optax.chain`` state with ``jax_mlpo.adamw``).
      extra: JSON-like scalars to keep with it (data position, RNG seeds...).
      force: save even if the manager's save policy would skip this step.
      blocking: True: return once the checkpoint is written (no room needed on the tiers for
        copy-on-write); False: write it while training goes on (async managers), or raise if
        the disks have no room for that; None: the latter where there is room, else the former
        (logged).

    Returns:
      Whether a checkpoint was started (orbax's save policy may skip a step).

    Raises:
      StaleStateError: ``opt_state`` is not the latest state of its optimizer.
      EngineFailedError: an update failed midway; restore from the previous checkpoint.
      CheckpointSpaceError: a file system has too little free space for the checkpoint.
      CheckpointWriteError: a write failed (the message says which, why and what to do); or
        the save before this one failed, so this one was not started.
    """
    check_savable(opt_state)  # before orbax starts a step directory
    if not force and not mngr.should_save(step):
        return False  # without waiting for a save in flight
    options = _options_of(mngr)
    concurrent = options.enable_async_checkpointing and blocking is not True
    try:  # the last save may still delete a step into the recycled files
        mngr.wait_until_finished()
    except Exception as e:
        raise CheckpointWriteError(
            f"checkpoint {step} was not started: the save before it failed, and orbax reports "
            f"that at the next save. Call save again for step {step} once its cause is fixed. "
            f"The failed save: {e}"
        ) from e
    spares = spare_files(mngr.directory) if options.todelete_subdir == RECYCLED else None
    target = os.path.join(os.fspath(mngr.directory), str(step))
    everything = (params, opt_state, extra)  # the items share the file system's free space
    if concurrent and blocking is None:
        try:
            _check_space(everything, target, concurrent=True, spares=spares)
        except CheckpointSpaceError as e:
            logger.warning("jax_mlpo: saving step %d synchronously: %s", step, e)
            concurrent = False
    _check_space(everything, target, concurrent=concurrent, spares=spares)
    args = ocp.args.Composite(
        params=OffloadSave(params, concurrent=concurrent, spares=spares),
        opt_state=OffloadSave(opt_state, params=params, concurrent=concurrent, spares=spares),
        extra=OffloadSave(dict(extra or {}), spares=spares),
    )
    with streams_held() if concurrent else contextlib.nullcontext():
        started = mngr.save(step, args=args, force=force)
    if not concurrent:
        mngr.wait_until_finished()
    return started


def _check_space(tree: Any, target: str, *, concurrent: bool, spares: SpareFiles | None) -> None:
    """:func:`~jax_mlpo.checkpoint.space.check_space`, first without waiting for the files of a
    deleted checkpoint to be listed (:mod:`~jax_mlpo.checkpoint.recycle`); where that fails,
    once more with them counted as free and the older leftovers deleted."""
    try:
        check_space(tree, target, concurrent=concurrent)
    except CheckpointSpaceError:
        if spares is None:
            raise
        reusable = spares.nbytes
        wait_for_deletions()
        check_space(tree, target, concurrent=concurrent, reusable=reusable)


def restore(
    mngr: ocp.CheckpointManager, params: Any, opt_state: Any, *, step: int | None = None
) -> Restored:
    """Restores checkpoint ``step`` (default: the latest) into ``params`` and ``opt_state``.

    Args:
      mngr: the manager the checkpoint was saved with (or one on the same directory).
      params: a params tree of the saved structure (arrays or ``jax.ShapeDtypeStruct``), giving
        dtypes and shardings.
      opt_state: a fresh ``tx.init(params)`` (with any offload config: subgroups, tiers and
        host cache may differ from the saved run's, and so may the process count; every
        process calls ``restore``). Its engines get the saved state, each process its shards.

    Returns:
      ``Restored(step, params, opt_state, extra)``.

    Raises:
      FileNotFoundError: no (such) checkpoint in the manager's directory.
      CorruptCheckpointError: a file of the checkpoint was changed or is incomplete; the
        message names the file and the other steps to restore.
      ValueError: the checkpoint does not fit ``params``/``opt_state``.
    """
    try:  # orbax lists a save in flight as a step: wait, so that a failed one is not taken
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - the failed save is not listed; restore another
        logger.warning("jax_mlpo: restoring from the checkpoints before a failed save: %s", e)
    if step is None:
        step = mngr.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {mngr.directory}")
    elif step not in mngr.all_steps():
        raise FileNotFoundError(
            f"no checkpoint of step {step} in {mngr.directory} (a save that failed or was "
            f"killed is never listed); its checkpoints are steps {list(mngr.all_steps())}: "
            "restore one of those"
        )
    args = ocp.args.Composite(
        params=OffloadRestore(params), opt_state=OffloadRestore(opt_state), extra=OffloadRestore()
    )
    # the params are read while the offloaded state streams in (orbax restores opt_state first)
    drop = host_reads.prefetch(os.path.join(os.fspath(mngr.directory), str(step), "params"))
    try:
        out = mngr.restore(step, args=args)
    except CorruptCheckpointError as e:
        others = sorted(set(mngr.all_steps()) - {step})
        raise CorruptCheckpointError(
            f"checkpoint {step} in {mngr.directory} is corrupt: {e} The manager's other "
            + (
                f"checkpoints are steps {others}: pass step={others[-1]} to restore the latest."
                if others
                else "checkpoints: none; this one cannot be restored."
            )
        ) from e
    finally:
        drop()
    return Restored(int(step), out["params"], out["opt_state"], dict(out["extra"]))
