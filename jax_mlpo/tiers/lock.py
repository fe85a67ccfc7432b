"""An exclusive lock on a tier directory, so two runs never share (and overwrite) one."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from jax_mlpo.errors import TierInUseError

__all__ = ["TierInUseError", "TierLock"]


class TierLock:
    """``flock`` on ``<dir>/.jax_mlpo.lock``, with the owner written inside for the error message.

    The kernel drops the lock when its holder dies, so a crashed run never blocks the next one;
    the stale owner record left behind is reported, not trusted.
    """

    FILENAME = ".jax_mlpo.lock"

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, self.FILENAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise TierInUseError(
                f"tier directory {directory!r} is in use by {owner} (lock file {self.path}). "
                "Give this run its own directory, or stop the other run (or close its optimizer "
                "with jax_mlpo.close(opt_state)) first."
            ) from None
        stale = _read_owner(fd)
        os.ftruncate(fd, 0)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd: int | None = fd
        self.previous_owner = stale if stale != "an unknown owner" else None

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_owner(fd: int) -> str:
    try:
        rec = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["since"]))
        return f"pid {rec['pid']} on {rec['host']} (since {since})"
    except (ValueError, KeyError, TypeError):
        return "an unknown owner"
