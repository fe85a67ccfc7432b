"""Offline token data for pre-training: byte-level text corpora and pre-tokenized files.

Three sources, all ending up as one read-only 1-D token array (memory-mapped, so a run only pages
in the windows it samples):

* the Python standard library's own ``.py`` sources (:func:`default_corpus_files`), always present
  and needing no download;
* user text files (bytes are tokens 0..255);
* a pre-tokenized file: raw little-endian ``uint16``/``uint32`` or a 1-D ``.npy``.

Text corpora are concatenated once, with a 0 byte between files, and cached as a ``uint8`` ``.npy``
keyed by the files' paths, sizes and modification times; later runs memory-map the cache.

The last ``val_fraction`` (1%) of the tokens is held out for validation. :func:`batches` draws
random windows with ``np.random.default_rng((seed, step))``: step ``k``'s batch depends only on
``(seed, k)``, so a run resumed at step ``k`` sees exactly the batches the original run would have.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

__all__ = ["TokenDataset", "batches", "default_corpus_files"]

PathLike = str | os.PathLike[str]

# Directory names whose files are not library code (test suites, third-party packages, caches).
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_SEPARATOR = 0  # byte between files: marks document boundaries, never occurs in normal text
_CHUNK = 1 << 24  # tokens scanned at a time when checking a token file's range


def default_corpus_files() -> list[Path]:
    """Lists the standard library's ``.py`` files: a text corpus present on every machine.

    Returns:
        Paths under ``sysconfig.get_paths()["stdlib"]``, sorted, excluding test directories
        (``test``, ``tests``, ``idle_test``, ``*_test``, ``*_tests``) and ``site-packages``.

    Raises:
        FileNotFoundError: if the standard library directory does not exist.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"standard library directory {root} not found; pass text files or a token file instead."
        )
    files = []
    # os.walk, pruned: the excluded trees (site-packages above all) are never listed. A
    # recursive glob lists them all and filters after: ~18,000 directory reads instead of ~50,
    # each releasing the GIL (minutes, not milliseconds, beside a busy Python thread).
    for folder, dirs, names in os.walk(root):
        dirs[:] = [
            d for d in dirs if d not in _EXCLUDED_DIRS and not d.endswith(("_test", "_tests"))
        ]
        paths = (Path(folder, name) for name in names if name.endswith(".py"))
        files.extend(path for path in paths if path.is_file())
    # Sort on the relative path so the corpus (and the cache key) is the same on every run.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


class TokenDataset:
    """A read-only 1-D token array with a held-out validation tail.

    Build it with :meth:`from_default_corpus`, :meth:`from_text_files` or
    :meth:`from_token_file`.

    Args:
        tokens: 1-D unsigned integer array (typically a ``np.memmap``), not copied.
        vocab_size: tokens lie in ``[0, vocab_size)``; ``None`` if unknown.
        val_fraction: share of tokens, taken from the end, held out for validation.
        source: human-readable description, for logs.

    Raises:
        ValueError: if ``tokens`` is empty or not 1-D, or ``val_fraction`` is not in ``[0, 1)``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        vocab_size: int | None,
        val_fraction: float = 0.01,
        source: str = "array",
    ):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape} from {source}.")
        if tokens.size == 0:
            raise ValueError(f"corpus is empty: 0 tokens from {source}.")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.source = source
        n_val = math.ceil(tokens.size * val_fraction)
        # Views, not copies: slicing a memmap keeps it memory-mapped.
        self.train = tokens[: tokens.size - n_val]
        self.val = tokens[tokens.size - n_val :]

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.source}: {self.tokens.size} tokens, train {self.train.size}, "
            f"val {self.val.size}, vocab_size={self.vocab_size})"
        )

    def split(self, name: str) -> np.ndarray:
        """Returns the ``"train"`` or ``"val"`` tokens.

        Raises:
            ValueError: for any other name.
        """
        if name == "train":
            return self.train
        if name == "val":
            return self.val
        raise ValueError(f"split must be 'train' or 'val', got {name!r}.")

    @classmethod
    def from_default_corpus(
        cls, cache_dir: PathLike, *, val_fraction: float = 0.01
    ) -> TokenDataset:
        """Byte-level dataset of the standard library's sources (:func:`default_corpus_files`).

        Args:
            cache_dir: directory for the concatenated ``uint8`` cache (created if missing).
            val_fraction: share held out for validation.

        Returns:
            The dataset, memory-mapped from the cache; ``vocab_size`` is 256.
        """
        return cls.from_text_files(
            default_corpus_files(), cache_dir, val_fraction=val_fraction, source="python-stdlib"
        )

    @classmethod
    def from_text_files(
        cls,
        paths: Sequence[PathLike],
        cache_dir: PathLike,
        *,
        val_fraction: float = 0.01,
        source: str | None = None,
    ) -> TokenDataset:
        """Byte-level dataset of text files, in the order given, separated by a 0 byte.

        The concatenation is written once to ``cache_dir/bytes-<key>.npy``, where the key hashes
        each file's resolved path, size and mtime: editing a file makes a new cache entry.

        Args:
            paths: the files; each byte becomes one token in ``[0, 256)``.
            cache_dir: directory for the cache (created if missing).
            val_fraction: share held out for validation.
            source: description for logs; defaults to the number of files.

        Returns:
            The dataset, memory-mapped from the cache; ``vocab_size`` is 256.

        Raises:
            FileNotFoundError: if a path does not exist or is not a file.
            ValueError: if ``paths`` is empty or all files are empty.
        """
        files = [Path(p) for p in paths]
        if not files:
            raise ValueError("corpus is empty: 0 text files given; pass at least one path.")
        key = hashlib.sha256()
        total_bytes = 0
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(
                    f"text file {path} does not exist; fix the path or drop it from the list."
                )
            stat = path.stat()
            key.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
            total_bytes += stat.st_size
        if total_bytes == 0:
            raise ValueError(f"corpus is empty: {len(files)} files with 0 bytes in total.")
        cache = Path(cache_dir) / f"bytes-{key.hexdigest()[:24]}.npy"
        if not cache.exists():
            _write_concatenation(files, cache)
        tokens = np.load(cache, mmap_mode="r")
        return cls(
            tokens,
            vocab_size=256,
            val_fraction=val_fraction,
            source=source or f"{len(files)} text files",
        )

    @classmethod
    def from_token_file(
        cls,
        path: PathLike,
        *,
        dtype: str = "uint16",
        vocab_size: int | None = None,
        val_fraction: float = 0.01,
    ) -> TokenDataset:
        """Memory-maps a pre-tokenized file.

        Args:
            path: a ``.npy`` file holding a 1-D unsigned integer array, or a raw little-endian
                array of ``dtype`` (any other suffix).
            dtype: ``"uint16"`` or ``"uint32"``; raw files only (a ``.npy`` carries its dtype).
            vocab_size: if given, the file is scanned once (in chunks, bounded memory) and a
                token ``>= vocab_size`` raises; out-of-range ids would otherwise be clamped
                silently by the embedding lookup.
            val_fraction: share held out for validation.

        Returns:
            The dataset, backed by the file itself (nothing copied).

        Raises:
            FileNotFoundError: if ``path`` does not exist.
            ValueError: for an unsupported dtype, a raw file whose size is not a multiple of the
                token size, an empty file, or a token outside ``[0, vocab_size)``.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"token file {path} does not exist; pass the path of a .npy or raw uint16/uint32 "
                "token file, or use TokenDataset.from_text_files for text."
            )
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
            if tokens.dtype.kind != "u" or tokens.dtype.itemsize > 4:
                raise ValueError(
                    f"{path} holds {tokens.dtype} tokens; save them as uint8, uint16 or uint32."
                )
        else:
            if dtype not in ("uint16", "uint32"):
                raise ValueError(f"dtype must be 'uint16' or 'uint32', got {dtype!r}.")
            item = np.dtype(dtype).newbyteorder("<")
            size = path.stat().st_size
            if size % item.itemsize:
                raise ValueError(
                    f"{path} has {size} bytes, not a multiple of {item.itemsize} ({dtype}); "
                    "is dtype right?"
                )
            if size == 0:
                raise ValueError(f"corpus is empty: token file {path} has 0 bytes.")
            tokens = np.memmap(path, dtype=item, mode="r")
        if tokens.size and vocab_size is not None:
            top = max(int(tokens[i : i + _CHUNK].max()) for i in range(0, tokens.size, _CHUNK))
            if top >= vocab_size:
                raise ValueError(
                    f"{path} contains token id {top} >= vocab_size={vocab_size}; pass the "
                    "tokenizer's vocabulary size."
                )
        return cls(tokens, vocab_size=vocab_size, val_fraction=val_fraction, source=str(path))


def _write_concatenation(files: Sequence[Path], cache: Path) -> None:
    """Writes the 0-separated bytes of ``files`` to the ``.npy`` file ``cache``, atomically."""
    total = sum(f.stat().st_size for f in files) + len(files) - 1
    cache.parent.mkdir(parents=True, exist_ok=True)
    # Write under a temporary name and rename: a crash or a concurrent run never leaves a
    # truncated cache that a later run would memory-map.
    fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=cache.stem, suffix=".tmp.npy")
    os.close(fd)
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(total,))
        pos = 0
        for i, path in enumerate(files):
            if i:
                out[pos] = _SEPARATOR
                pos += 1
            data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
            if pos + data.size > total:
                raise RuntimeError(f"{path} grew while the corpus cache was being written.")
            out[pos : pos + data.size] = data
            pos += data.size
        out.flush()
        del out
        if pos != total:
            raise RuntimeError("a corpus file shrank while the corpus cache was being written.")
        os.replace(tmp, cache)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def batches(
    dataset: TokenDataset,
    batch_size: int,
    seq_len: int,
    seed: int,
    start_step: int = 0,
    *,
    split: str = "train",
    end_step: int | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yields ``(step, batch)`` with random windows of the chosen split, reproducibly per step.

    Each row of step ``k``'s batch starts at an offset drawn uniformly from
    ``[0, len(split) - seq_len]`` by ``np.random.default_rng((seed, k))``; no state carries over
    between steps, so ``batches(..., start_step=k)`` resumes exactly.

    Args:
        dataset: the tokens.
        batch_size: rows per batch.
        seq_len: tokens per row (the model sees ``seq_len`` tokens and predicts ``seq_len - 1``).
        seed: non-negative run seed.
        start_step: first step to yield.
        split: ``"train"`` or ``"val"``.
        end_step: stop before this step; ``None`` means never stop.

    Yields:
        ``(step, tokens)`` with ``tokens`` an int32 numpy array ``[batch_size, seq_len]``.

    Raises:
        ValueError: (at the call, not at the first ``next``) for non-positive sizes, a negative
            seed or step, an unknown split, or a split shorter than ``seq_len``.
    """
    data = dataset.split(split)
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must be positive.")
    if seed < 0 or start_step < 0:
        raise ValueError(f"seed={seed} and start_step={start_step} must be non-negative.")
    if seq_len > data.size:
        raise ValueError(
            f"seq_len={seq_len} is longer than the {split} split ({data.size} tokens of "
            f"{dataset.tokens.size}); use a shorter seq_len or more data."
        )
    return _windows(data, batch_size, seq_len, seed, start_step, end_step)


def _windows(
    data: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int, end_step: int | None
) -> Iterator[tuple[int, np.ndarray]]:
    # A separate generator so that batches() validates its arguments when called.
    offsets = np.arange(seq_len)[None, :]
    while end_step is None or step < end_step:
        rng = np.random.default_rng((seed, step))
        starts = rng.integers(0, data.size - seq_len + 1, size=batch_size)
        # Fancy indexing on a memmap reads only the touched pages.
        yield step, np.asarray(data[starts[:, None] + offsets], dtype=np.int32)
        step += 1
