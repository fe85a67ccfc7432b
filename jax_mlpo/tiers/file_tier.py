"""A file tier's settings: a directory on a file system that holds part of the optimizer state.

Plain data, checked when built; :meth:`FileTier.validate` checks it against the file system.
:mod:`jax_mlpo.tiers.file` is the store that serves it. :mod:`jax_mlpo.config` exports it with
the rest of the offload configuration.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Literal

from jax_mlpo.errors import ConfigError
from jax_mlpo.tiers.settings import (
    Bandwidth,
    TierLimits,
    check_choice,
    check_settings,
    parse_size,
    takes_flat_settings,
)

__all__ = ["FileTier", "IoEngine", "IoMode", "IoSubmit"]

IoEngine = Literal["posix", "tensorstore"]
IoMode = Literal["default", "direct", "memmap"]
IoSubmit = Literal["aio", "threads"]


@takes_flat_settings
@dataclasses.dataclass(frozen=True)
class FileTier:
    """A directory on a file system that holds part of the optimizer state.

    One blob per subgroup (``[p | m | v]`` float32, contiguous) is stored with a crc32c checksum
    per chunk, verified on every read. The directory is locked for the lifetime of the optimizer
    so that a second run cannot use it.

    Attributes:
      path: the tier's directory. Its parent must exist; the directory itself is created.
      limits: requests in flight and bandwidth caps, per process and per node
        (:class:`~jax_mlpo.tiers.settings.TierLimits`).
      bandwidth: the tier's read and write bandwidth for placement; where not given, measured
        by a probe at start (:class:`~jax_mlpo.tiers.settings.Bandwidth`).
      io_engine: how blobs reach the file system. ``"posix"``: one preallocated file per blob,
        written and read with ``pwrite``/``pread`` of ``chunk_bytes`` each, up to
        ``queue_depth`` requests in flight (reads ahead of writes), a checksum per chunk in the
        file's trailer; with O_DIRECT (where the file system supports it) it reaches the disk's
        sequential bandwidth. ``"tensorstore"``: a zarr3 array per kind of blob on
        tensorstore's ``file`` driver (one chunk file per ``chunk_bytes``, zarr3's crc32c
        codec); 65-75% of the disk's bandwidth on the development machines.
      io_mode: ``"direct"`` (O_DIRECT: no page cache), ``"default"`` (the page cache) or
        ``"memmap"`` (tensorstore only); None: the engine's own, :attr:`effective_io_mode`.
      queue_depth: chunk requests in flight on this tier (``"posix"``).
      io_submit: how ``"posix"`` hands requests to the kernel: ``"aio"`` (Linux kernel AIO
        from C++, DeepSpeed's libaio path; falls back to threads, with a warning, where the
        kernel refuses it) or ``"threads"`` (a thread per request in flight).
      sync: ``fdatasync`` every blob write before it counts as done. Off by default: a tier
        holds working state, never restored from (a restart deletes its blob files and restores
        a checkpoint, whose files are synced), so a flush buys no recoverability. A ``kill -9``
        loses no written blob either way (O_DIRECT writes are in the device, page-cache writes
        outlive the process); a power loss or kernel crash may lose tier writes, and the run
        then resumes from its last checkpoint, as it would anyway.
      chunk_bytes: the size of one request (and one checksum): blobs larger than this are
        read and written as several concurrent requests.

    Raises:
      ConfigError: naming the field, the value, the tier's path and the fix.
    """

    path: str
    limits: TierLimits = TierLimits()
    bandwidth: Bandwidth = Bandwidth()
    io_engine: IoEngine = "posix"
    io_mode: IoMode | None = None
    queue_depth: int = 8
    io_submit: IoSubmit = "aio"
    sync: bool = False
    chunk_bytes: int | str = "8MiB"

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike) or not str(self.path):
            raise ConfigError(f"FileTier.path={self.path!r} must be a non-empty directory path")
        object.__setattr__(self, "path", os.fspath(self.path))
        check_settings(self, "FileTier")
        chunk = parse_size(self.chunk_bytes, f"FileTier.chunk_bytes ({self.path})")
        if chunk < 4 or chunk % 4:
            raise ConfigError(
                f"FileTier.chunk_bytes={self.chunk_bytes!r} for {self.path}: must be a positive "
                "multiple of 4 bytes (float32 elements), e.g. '8MiB'"
            )
        object.__setattr__(self, "chunk_bytes", chunk)
        check_choice(
            self.io_engine,
            IoEngine,
            "FileTier.io_engine",
            "'posix': pread/pwrite, O_DIRECT; 'tensorstore': zarr3 on tensorstore's file driver",
            self.path,
        )
        if self.io_mode is not None:
            check_choice(
                self.io_mode,
                IoMode,
                "FileTier.io_mode",
                "'direct': O_DIRECT; 'default': the page cache; 'memmap': tensorstore only",
                self.path,
            )
        if self.io_mode == "memmap" and self.io_engine != "tensorstore":
            raise ConfigError(
                f"FileTier.io_mode='memmap' for {self.path}: needs io_engine='tensorstore' "
                f"(io_engine={self.io_engine!r} has 'direct' and 'default')"
            )
        if not isinstance(self.queue_depth, int) or self.queue_depth < 1:
            raise ConfigError(
                f"FileTier.queue_depth={self.queue_depth!r} for {self.path}: must be an int >= 1 "
                "(chunk requests in flight; 8 suits NVMe and virtual disks)"
            )
        check_choice(
            self.io_submit,
            IoSubmit,
            "FileTier.io_submit",
            "'aio': kernel AIO; 'threads': a thread per request",
            self.path,
        )

    @property
    def effective_io_mode(self) -> IoMode:
        """``io_mode``, or where None the engine's own: ``"direct"`` for ``"posix"``,
        ``"default"`` (the page cache) for ``"tensorstore"``."""
        if self.io_mode is not None:
            return self.io_mode
        return "direct" if self.io_engine == "posix" else "default"

    def for_process(self, index: int) -> FileTier:
        """This tier for process ``index`` of a multi-process run: ``<path>/proc<index>``,
        sharing node permits with the other processes through ``limits.permits_key``."""
        return self.for_part(f"proc{index}")

    def for_part(self, name: str) -> FileTier:
        """This tier for one of several engines of a run (a process's, or one of
        ``jax_mlpo.muon``'s): ``<path>/<name>``, sharing node permits through
        ``limits.permits_key``."""
        return dataclasses.replace(
            self, path=os.path.join(self.path, name), limits=self.limits.shared_by(self.path)
        )

    def validate(self) -> None:
        """Checks the path against the file system: creates the directory and writes a probe.

        Raises:
          ConfigError: if the parent directory is missing, the path is not a directory, or
            the directory cannot be created or written (read-only or full file system, no
            permission).
        """
        path = Path(self.path).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"FileTier.path={self.path!r} exists and is not a directory")
        if not path.exists() and not path.parent.is_dir():
            raise ConfigError(
                f"FileTier.path={self.path!r}: parent directory {str(path.parent)!r} does not "
                "exist. Create it (e.g. mount the disk) or fix the path."
            )
        try:
            path.mkdir(mode=0o700, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".jax_mlpo-probe-"):
                pass
        except OSError as e:
            raise ConfigError(
                f"FileTier.path={self.path!r} is not writable ({e.strerror}). Choose a directory "
                "you can write to, or fix its permissions or free space."
            ) from e
