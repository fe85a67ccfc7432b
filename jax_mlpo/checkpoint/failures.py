"""What a save that fails midway tells its caller: the step, the file, the cause and the fix.

A save writes everything into orbax's temporary directory (``<step>.orbax-checkpoint-tmp``),
published by a rename once every file is written. A write that fails there (a full disk, a
device error) or a read of the offloaded state from its tier that fails (a lost object store)
leaves that directory unpublished: ``CheckpointManager`` never lists it (the next
:func:`~jax_mlpo.checkpoint.manager` on the directory deletes it, in the background and before
its first save), and the earlier checkpoints are as they were. :func:`explain` turns the error
into a :class:`CheckpointWriteError` that says so, with the fix for its cause.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any

from jax_mlpo.errors import CheckpointSpaceError, CheckpointWriteError, TierIOError


def _step_of(step_dir: str) -> str:
    """The step of orbax's directory ``<step>[.orbax-checkpoint-tmp...]``, as text."""
    name = os.path.basename(step_dir.rstrip(os.sep))
    head = name.split(".", 1)[0]
    return head if head.isdigit() else name


@contextlib.contextmanager
def explained(item_directory: Any) -> Iterator[None]:
    """Raises what the block's writes raise as a :class:`CheckpointWriteError` (chained to it)
    when :func:`needs_explaining` says so; other errors pass through unchanged."""
    try:
        yield
    except Exception as e:
        if needs_explaining(e):
            raise explain(e, item_directory) from e
        raise


def needs_explaining(error: BaseException) -> bool:
    """Whether ``error`` is a failed write or tier read that :func:`explain` explains (not an
    error that says what to do already, nor a programming error)."""
    return isinstance(error, OSError) and not isinstance(
        error, CheckpointWriteError | CheckpointSpaceError
    )


def explain(error: OSError, item_directory: Any) -> CheckpointWriteError:
    """The error a save raises for ``error``, met while writing the item ``item_directory``.

    Args:
      error: what the write (or the read of the state from a tier) raised.
      item_directory: the item's directory in orbax's temporary step directory.

    Returns:
      A :class:`CheckpointWriteError` chained to ``error`` by the caller (``raise ... from``).
    """
    step_dir = os.path.dirname(os.fspath(item_directory).rstrip(os.sep))
    step, root = _step_of(step_dir), os.path.dirname(step_dir)
    if isinstance(error, TierIOError):
        what = f"reading the optimizer state from its tier failed: {error}"
        fix = (
            "Fix the tier as its error says. Its state may be lost with it: restore the last "
            "checkpoint into a new tx.init, then train and save again"
        )
    else:
        path = error.filename or "a file of the checkpoint"
        cause = f"[Errno {error.errno}] {error.strerror}" if error.strerror else str(error)
        what = f"error writing {path}: {cause}"
        if error.errno == errno.ENOSPC:
            fix = (
                "Cause: the file system is full. Free space there (or give the manager another "
                "directory), then save again: training can go on meanwhile"
            )
        else:
            fix = (
                "Cause: the file system failed the write: check that it is mounted, writable "
                "and healthy, then save again: training can go on meanwhile"
            )
    return CheckpointWriteError(
        f"checkpoint {step} in {root} was not saved: {what}. It was not published: the manager "
        f"does not list step {step} and the earlier checkpoints are intact (the partial "
        f"directory {step_dir} is deleted by the next jax_mlpo.checkpoint.manager on {root}, "
        f"before its first save). {fix}."
    )
