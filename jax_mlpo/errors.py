"""Every error jax_mlpo raises, under one base, and how to get one back from inside an update.

An offloaded update runs inside an XLA call, so what it raises (a tier's :class:`TierIOError`,
a :class:`CorruptBlobError`) reaches the caller as the text of a ``JaxRuntimeError``. The
update keeps the exception it raised, and the text carries its number: :func:`cause` gives the
exception back, and :func:`typed` re-raises it, so a loop can catch it by type::

    try:
        with jax_mlpo.errors.typed():
            params, opt_state = jax.block_until_ready(train_step(params, opt_state, batch))
    except jax_mlpo.TierIOError as e:
        ...  # e is the tier's own exception, with its errno and message
"""

from __future__ import annotations

import collections
import contextlib
import re
import threading
from collections.abc import Iterator


class JaxMlpoError(Exception):
    """The base of every exception jax_mlpo raises."""


class ConfigError(JaxMlpoError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class StaleStateError(JaxMlpoError, RuntimeError):
    """The optimizer state handed to update is not the one the host state was last advanced to."""


class EngineFailedError(JaxMlpoError, RuntimeError):
    """A previous update failed midway; the host state is not consistent any more."""


class NoEngineError(JaxMlpoError, RuntimeError):
    """An optimizer state names no engine of this process: a template (``tx.init`` under a
    trace), one replaced by a later ``tx.init`` at its place, one closed, or another process's;
    the message says which, and the fix."""


class UnusedTiersWarning(UserWarning):
    """Tiers are configured, but the optimizer state fits in ``host_cache``, so it stays in host
    memory and the tiers are left unused. ``warnings.filterwarnings("ignore",
    category=jax_mlpo.UnusedTiersWarning)`` says that host memory alone is fine."""


class PendingUpdateError(JaxMlpoError, RuntimeError):
    """An overlapped loop's pending update is lost or about to be: the loop was dropped or
    given another model or optimizer before a flush, or a step failed inside its program after
    taking the params and the state (:class:`jax_mlpo.OverlappedLoop`)."""


class UnsupportedRuleError(JaxMlpoError, ValueError):
    """A ``jax.numpy`` update rule uses an operation, dtype or shape that a tile program does
    not run (the message names it); :class:`jax_mlpo.extend.JaxElementwiseOptimizer` then runs
    the rule through XLA, with a warning."""


class CheckpointInProgressError(JaxMlpoError, RuntimeError):
    """An optimizer's state is being read out for a checkpoint, and what was asked (another
    save, a load, an update during a synchronous snapshot) must wait for it to finish."""


class TierIOError(JaxMlpoError, OSError):
    """A read or write on a tier failed; the message names the tier, the file and what to do."""


class CorruptBlobError(TierIOError):
    """A blob failed its checksum: what is on disk is not what was written."""


class TierFullError(TierIOError):
    """A write found its tier's file system full (``errno.ENOSPC``); the blob it replaces is
    intact, so another tier can take the subgroup (``OffloadConfig.fallback_on_full``)."""


class TierInUseError(JaxMlpoError, RuntimeError):
    """The tier directory is locked by another run (or another optimizer in this process)."""


class AioUnavailableError(JaxMlpoError, OSError):
    """The kernel refused an AIO context (no AIO syscalls, or ``fs.aio-max-nr`` used up)."""


class CorruptCheckpointError(JaxMlpoError, RuntimeError):
    """A checkpoint's contents differ from what was saved (or it is incomplete)."""


class CheckpointSpaceError(JaxMlpoError, OSError):
    """A file system has less free space than a checkpoint needs."""


class CheckpointWriteError(JaxMlpoError, OSError):
    """A checkpoint could not be written; it was not published and the earlier ones are intact.

    The message names the step, the file or tier that failed, the cause and the fix.
    """


# The exceptions updates raised inside XLA calls, by number: the last ones only (a loop that
# fails reads its error at once; a bounded record keeps no failure alive for long).
_RAISED: collections.OrderedDict[int, BaseException] = collections.OrderedDict()
_KEPT = 64
_LOCK = threading.Lock()
_TAG = re.compile(r"\[jax_mlpo error #(\d+)\]")


def tag(error: BaseException) -> str:
    """Keeps ``error`` (raised inside an XLA call) and returns the mark its message carries."""
    with _LOCK:
        for number, kept in _RAISED.items():
            if kept is error:  # one error reported by several calls (a mesh's devices)
                return f"[jax_mlpo error #{number}]"
        number = next(reversed(_RAISED), 0) + 1
        _RAISED[number] = error
        while len(_RAISED) > _KEPT:
            _RAISED.popitem(last=False)
    return f"[jax_mlpo error #{number}]"


def forget_raised() -> None:
    """Drops the record of raised exceptions (at exit: their tracebacks' frames hold the
    failed calls' views of XLA's buffers, which must not outlive the interpreter)."""
    with _LOCK:
        _RAISED.clear()


def cause(error: BaseException) -> BaseException | None:
    """The exception a jax_mlpo update raised inside XLA, from the error that reports it.

    Args:
      error: what the step raised (a ``JaxRuntimeError``), or anything chained to it.

    Returns:
      The update's own exception (e.g. a :class:`TierIOError`), or None when ``error`` does not
      report one (or it is no longer kept: the last 64 are).
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = _TAG.search(str(error))
        if found is not None:
            with _LOCK:
                return _RAISED.get(int(found.group(1)))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def typed() -> Iterator[None]:
    """Re-raises an update's own exception in place of the ``JaxRuntimeError`` that reports
    it, so ``except jax_mlpo.TierIOError`` catches a tier's failure in a step. The exception
    keeps its own cause (the ``OSError`` with its errno); XLA's error is its context. Other
    errors pass through unchanged."""
    try:
        yield
    except Exception as e:
        found = cause(e)
        if found is None or found is e:
            raise
        raise found  # noqa: B904 - its __cause__ is its own; XLA's error becomes its context


def wait_for_updates() -> None:
    """Waits for the offloaded updates in flight (``jax.effects_barrier``).

    JAX keeps the error of the last side-effecting call that failed and re-raises it at every
    barrier until another such call runs; a failed update would so fail every later wait, even
    for a new, healthy optimizer. An error that reports an update's own exception is therefore
    passed here: that update's engine is failed, and refuses every use with the cause and the
    fix. Other errors are raised.
    """
    import jax

    try:
        jax.effects_barrier()
    except Exception as e:
        if cause(e) is None:
            raise
