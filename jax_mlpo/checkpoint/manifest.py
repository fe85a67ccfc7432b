"""The checksum manifest: a digest of every leaf or shard as saved, written and verified.

Orbax's array files carry no checksum of their own: a flipped byte in an array's data reads
back as a different value. Each item of a checkpoint therefore holds ``jax_mlpo_checksums.json``,
a digest (:mod:`~jax_mlpo.checkpoint.digest`: CRC-32C) of every leaf as saved (dtype, shape and
bytes) or, for a leaf saved sharded, of every shard (with its index), the manifest itself sealed
by a sha256. Restore recomputes the digest of every shard it reads, so what restores is bit for
bit what was saved.

With several processes, each writes the digests of what it wrote into
``jax_mlpo_checksums.process_<k>.json``; process 0 merges them into the manifest when orbax
finalizes the checkpoint, that is after every process's writes, and checks that the shards of
every leaf cover it exactly once.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
from etils import epath

from jax_mlpo.checkpoint import digest, file_io
from jax_mlpo.checkpoint.blocks import (
    Index,
    Read,
    as_index,
    contains,
    covers,
    full,
    index_of,
    relative,
    tiles,
    volume,
)
from jax_mlpo.checkpoint.tree import leaves
from jax_mlpo.errors import CorruptCheckpointError

CHECKSUMS_FILE = "jax_mlpo_checksums.json"
PROCESS_CHECKSUMS_FILE = "jax_mlpo_checksums.process_{}.json"  # merged into CHECKSUMS_FILE
# 5: CRC-32C digests ("digest") in place of sha256s; 4: each streamed array records its block of
# the leaf ("box": params on a mesh); 3: offloaded states streamed as arrays of their own
# ("streamed", a sha256 per chunk); 2: a leaf saved sharded has a sha256 per shard ("shards");
# 1: one per leaf
FORMAT = 5
READABLE_FORMATS = (3, 4, 5)


def host_records(host: Any, digests: dict[int, str] | None = None) -> dict[str, Any]:
    """The manifest's records of the host tree this process saves: dtype, shape and the digest
    of each leaf or shard it writes.

    Computed when the save starts, before the caller's next update may change the arrays.

    Args:
      host: the snapshot being saved (see :func:`jax_mlpo.checkpoint.snapshot.snapshot`).
      digests: digests already computed while writing, by ``id`` of the array written
        (:class:`~jax_mlpo.checkpoint.host_arrays.DirectNumpyHandler`).
    """
    records = {}
    for name, leaf in leaves(host).items():
        a = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
        records[name] = {
            "dtype": np.dtype(a.dtype).name,
            "shape": [int(d) for d in a.shape],
            "shards": _written_shards(leaf, digests or {}),
        }
    return records


def manifest_file(records: dict[str, Any], streamed: dict[str, Any], where: Any) -> tuple[str, str]:
    """The manifest file this process writes for what it saved.

    Args:
      records: its host tree's records (:func:`host_records`).
      streamed: the records of the offloaded states' arrays this process wrote
        (:func:`jax_mlpo.checkpoint.stream.write_streams`).
      where: the item's directory, for error messages.

    Returns:
      The file's name in the item's directory and its JSON text: the sealed manifest in a
      single-process run; with several processes, this process's digests, for
      :func:`merge_process_manifests` to merge once every process has written its own.
    """
    digests = _process_manifest(records, streamed)
    if jax.process_count() == 1:
        name, content = CHECKSUMS_FILE, _merge([digests], where)
    else:
        name, content = PROCESS_CHECKSUMS_FILE.format(jax.process_index()), digests
    return name, json.dumps(content, sort_keys=True)


def write_synced(path: epath.Path, text: str) -> None:
    """Writes ``text`` to ``path`` and fsyncs it.

    The manifest must be durable before orbax's rename publishes the checkpoint; tensorstore
    fsyncs the array files itself.
    """
    file_io.request("write", file_io.MANIFEST, os.fspath(path), 0, 0, len(text))
    with open(os.fspath(path), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def merge_process_manifests(directory: epath.Path) -> None:
    """Merges the processes' digests into the item's manifest (process 0, at finalize).

    Args:
      directory: the item's directory; a no-op where a single process saved it.

    Raises:
      CorruptCheckpointError: a process's digests are missing or corrupt, the processes
        disagree on the leaves, or the shards of a leaf do not cover it exactly once.
    """
    first = directory / PROCESS_CHECKSUMS_FILE.format(0)
    if not first.exists():
        return  # saved by a single process: the manifest is written already
    keys = ("format", "process", "processes", "leaves", "streamed")
    partials = [_read_sealed(first, keys)]
    paths = [directory / PROCESS_CHECKSUMS_FILE.format(k) for k in range(partials[0]["processes"])]
    partials += [_read_sealed(path, keys) for path in paths[1:]]
    write_synced(directory / CHECKSUMS_FILE, json.dumps(_merge(partials, directory)))
    for path in paths:
        path.unlink()


def read_manifest(directory: epath.Path) -> dict[str, Any]:
    """The item's manifest, checked against its seal.

    Args:
      directory: the item's directory.

    Returns:
      The manifest's body: ``format``, ``leaves`` (by name: ``dtype``, ``shape`` and either
      ``digest`` (``sha256`` before format 5) or ``shards``) and ``streamed`` (the offloaded
      states' arrays by name: ``dtype``, ``shape`` and ``shards``, each with its range and a
      digest per chunk).

    Raises:
      CorruptCheckpointError: the manifest is missing, not valid, of an unknown format, does
        not match its seal, or has a leaf whose shards do not cover it exactly once.
    """
    path = directory / CHECKSUMS_FILE
    file_io.request("read", file_io.MANIFEST, os.fspath(path), 0, 0, 0)
    try:  # the format first (unsealed): an older manifest has other keys
        fmt = json.loads(path.read_text()).get("format")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        fmt = FORMAT  # let the sealed read below say what is wrong
    if fmt in (1, 2):
        raise CorruptCheckpointError(
            f"{path}: format {fmt!r}; this jax_mlpo reads formats {READABLE_FORMATS} "
            "(formats 1 and 2, which held the offloaded state as orbax arrays, were written "
            "before jax_mlpo streamed it: restore them with the jax_mlpo that wrote them)"
        )
    if isinstance(fmt, int) and fmt not in READABLE_FORMATS:  # before the seal: it may differ
        raise CorruptCheckpointError(
            f"{path}: format {fmt!r}; this jax_mlpo reads formats {READABLE_FORMATS}. The "
            "checkpoint was written by another version of jax_mlpo: restore it with that one"
        )
    body = _read_sealed(path, ("format", "leaves", "streamed"))
    if body["format"] not in READABLE_FORMATS:
        raise CorruptCheckpointError(
            f"{path}: format {body['format']!r}; this jax_mlpo reads formats {READABLE_FORMATS}"
        )
    try:
        for name, record in body["leaves"].items():
            if not tiles(record["shape"], [index for index, _ in saved_shards(record)]):
                raise CorruptCheckpointError(
                    f"{path}: the shards of leaf {name} do not cover it exactly once"
                )
        for name, record in body["streamed"].items():
            if not covers(record["shape"], record["shards"]):
                raise CorruptCheckpointError(
                    f"{path}: the shards of array {name} do not cover it exactly once"
                )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is not a valid checksum manifest ({e!r})") from None
    return body


def saved_shards(record: dict[str, Any]) -> list[tuple[Index, str]]:
    """A manifest record's shards as (index, digest); one covering the leaf if saved whole."""
    if "shards" in record:
        return [(as_index(s["index"]), digest.recorded(s)) for s in record["shards"]]
    return [(full(record["shape"]), digest.recorded(record))]


def verify(reads: dict[str, Read], manifest: dict[str, Any], directory: Any) -> None:
    """Checks every saved shard this process read against its digest.

    Args:
      reads: what this process read of each leaf, by name.
      manifest: the item's manifest (:func:`read_manifest`).
      directory: the item's directory, for error messages.

    Raises:
      CorruptCheckpointError: a leaf or shard differs from its digest, the leaves read are not
        the manifest's, or a block read is not covered by the manifest's shards.
    """
    saved = manifest["leaves"]
    if set(reads) != set(saved):
        raise CorruptCheckpointError(
            f"checkpoint {directory}: restored leaves {sorted(set(reads) ^ set(saved))[:8]} "
            "differ from the checksum manifest's"
        )
    for name, leaf in reads.items():
        shards = saved_shards(saved[name])
        for where, data in leaf.blocks:
            checked = 0
            for index, expected in shards:
                if not contains(where, index):
                    continue
                header, raw = _contents(data[relative(where, index)])
                if not digest.matches(raw, expected, header):  # covers dtype and shape
                    shard = "" if index == full(saved[name]["shape"]) else f" (shard {index})"
                    raise CorruptCheckpointError(
                        f"checkpoint {directory}: leaf {name}{shard} does not match its digest "
                        "(the checkpoint is corrupt: a changed or half-written file). Restore "
                        "another step."
                    )
                checked += volume(index)
            if checked != volume(where):
                raise CorruptCheckpointError(
                    f"checkpoint {directory}: leaf {name}: block {where} read is not covered by "
                    "the manifest's shards"
                )


def _contents(leaf: Any) -> tuple[bytes, np.ndarray | bytes]:
    """What a leaf's digest covers: its dtype and shape (a header), then its bytes."""
    a = np.asarray(leaf)
    header = f"{a.dtype.name}{a.shape}".encode()
    if a.dtype.kind in "OUS" or not a.flags.c_contiguous:
        return header, a.tobytes()
    return header, a.reshape(-1).view(np.uint8)  # no copy (bfloat16 has no buffer protocol)


def _digest_of(leaf: Any) -> str:
    header, raw = _contents(leaf)
    return digest.of(raw, header)


def _seal(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _written_shards(leaf: Any, digests: dict[int, str]) -> list[dict[str, Any]]:
    """Digests of the parts of ``leaf`` that this process writes (``digests``: by ``id`` of
    host arrays, those computed while writing them).

    Follows orbax's rule of who writes what: a sharded array's shards are written by the
    processes holding their replica 0, host arrays and scalars by process 0.
    """
    if isinstance(leaf, jax.Array):
        return [
            {
                "index": [list(r) for r in index_of(s.index, leaf.shape)],
                "digest": _digest_of(s.data),
            }
            for s in leaf.addressable_shards
            if s.replica_id == 0
        ]
    if jax.process_index() != 0:
        return []
    index = [list(r) for r in full(np.shape(leaf))]
    if id(leaf) in digests:
        return [{"index": index, "digest": digests.pop(id(leaf))}]
    return [{"index": index, "digest": _digest_of(leaf)}]


def _process_manifest(records: dict[str, Any], streamed: dict[str, Any]) -> dict[str, Any]:
    """The digests of what this process writes of the host tree and streams, sealed."""
    body = {
        "format": FORMAT,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "leaves": records,
        "streamed": streamed,
    }
    return {**body, "sha256": _seal(body)}


def _merge(partials: list[dict[str, Any]], where: Any) -> dict[str, Any]:
    """The manifest of a checkpoint from every writing process's digests, sealed.

    A leaf written whole gets one digest (as in format 1); a leaf written in shards, a digest
    per shard with its index.

    Raises:
      CorruptCheckpointError: the processes disagree on the leaves, or the shards of a leaf do
        not cover it exactly once.
    """
    records: dict[str, dict[str, Any]] = {}
    for partial in partials:
        if records and set(partial["leaves"]) != set(records):
            raise CorruptCheckpointError(
                f"{where}: process {partial['process']} saved other leaves than process "
                f"{partials[0]['process']} ({sorted(set(partial['leaves']) ^ set(records))[:8]})"
            )
        for name, record in partial["leaves"].items():
            merged = records.setdefault(
                name, {"dtype": record["dtype"], "shape": record["shape"], "shards": []}
            )
            if (merged["dtype"], merged["shape"]) != (record["dtype"], record["shape"]):
                raise CorruptCheckpointError(
                    f"{where}: leaf {name} is {record['dtype']}{record['shape']} on process "
                    f"{partial['process']}, {merged['dtype']}{merged['shape']} on another"
                )
            merged["shards"].extend(record["shards"])
    for name, record in records.items():
        shards = sorted(record.pop("shards"), key=lambda s: s["index"])
        if not tiles(record["shape"], [as_index(s["index"]) for s in shards]):
            raise CorruptCheckpointError(
                f"{where}: the saved shards of leaf {name} do not cover it exactly once "
                f"({[s['index'] for s in shards][:8]})"
            )
        if len(shards) == 1:  # written whole
            record["digest"] = shards[0]["digest"]
        else:
            record["shards"] = shards
    streamed: dict[str, dict[str, Any]] = {}
    for partial in partials:
        for name, record in partial["streamed"].items():
            merged = streamed.setdefault(name, {**record, "shards": []})
            merged["shards"].extend(record["shards"])
    for name, record in streamed.items():
        record["shards"].sort(key=lambda r: (r.get("box", []), r["start"]))
        if not covers(record["shape"], record["shards"]):
            raise CorruptCheckpointError(
                f"{where}: the saved shards of array {name} do not cover it exactly once "
                f"({[(r['start'], r['size']) for r in record['shards']][:8]})"
            )
    body = {"format": FORMAT, "leaves": records, "streamed": streamed}
    return {**body, "sha256": _seal(body)}


def _read_sealed(path: epath.Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The body of a sealed JSON file (the ``keys`` of it), checked against its sha256."""
    try:
        content = json.loads(path.read_text())
        body = {k: content[k] for k in keys}
        sealed = content["sha256"]
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing: {path.parent} was not written by jax_mlpo.checkpoint, or is "
            "incomplete. Restore another step."
        ) from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not a valid checksum manifest ({e!r})") from None
    if _seal(body) != sealed:
        raise CorruptCheckpointError(f"{path} is corrupt: its own sha256 does not match")
    return body
