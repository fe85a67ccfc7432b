"""The object-store I/O engine: a value per blob on a tensorstore kvstore, with its crc32c.

A blob's value is its float32 bytes, then a 16-byte trailer: the magic ``JMPO``, the crc32c of
the data (the same CRC-32C the posix engine uses) and the data's length. A read checks all
three, so a flipped byte, a truncated value or a value of another blob is a
:class:`CorruptBlobError` naming the key. A PUT replaces a value whole (S3 has no partial
writes), so a write cut short leaves the old value, never half of each.

One run per prefix: :class:`ObjectLock` writes a lock object and refuses a prefix whose lock
another run holds. S3-compatible servers do not all honour conditional PUTs, so two runs
starting in the same second could both pass the check: a guard against mistakes, not a mutex.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import time
import uuid
from typing import Any

import numpy as np
import tensorstore as ts

from jax_mlpo.errors import ConfigError
from jax_mlpo.native.kernels import crc32c
from jax_mlpo.tiers.errors import CorruptBlobError
from jax_mlpo.tiers.lock import TierInUseError

_TRAILER = struct.Struct("<4sIQ")  # magic, crc32c, data bytes
_MAGIC = b"JMPO"
LOCK_KEY = ".jax_mlpo-lock"


def open_kvstore(tier: Any) -> ts.KvStore:
    """The tier's kvstore (an :class:`~jax_mlpo.tiers.object_tier.ObjectTier`), opened."""
    return ts.KvStore.open(tier.spec(), context=ts.Context(tier.context())).result()


class KvstoreBlobs:
    """Blobs of several kinds as values ``<kind>-<slot>.blob`` under the tier's prefix.

    Args:
      tier: the :class:`~jax_mlpo.tiers.object_tier.ObjectTier`.
      kinds: for each kind, the float32 length of each slot's blob.
      kvstore: the opened kvstore.
    """

    def __init__(self, tier: Any, kinds: dict[str, list[int]], kvstore: ts.KvStore) -> None:
        self._tier = tier
        self._kinds = kinds
        self._kv = kvstore

    def path(self, slot: int, kind: str) -> str:
        return f"{self._tier.path}{kind}-{slot}.blob"

    def files(self, slot: int, kind: str) -> list[str]:
        return [self.path(slot, kind)]

    def key(self, slot: int, kind: str) -> str:
        """The value's key, relative to the tier's prefix."""
        return f"{kind}-{slot}.blob"

    def write(self, slot: int, kind: str, data: np.ndarray) -> None:
        raw = memoryview(np.ascontiguousarray(data)).cast("B")
        trailer = _TRAILER.pack(_MAGIC, crc32c(raw), raw.nbytes)
        # tensorstore takes bytes: one copy of the blob, with the trailer joined on. Memory:
        # up to max_concurrency blobs of it beyond host_cache while writes are in flight.
        self._kv.write(self.key(slot, kind), b"".join((raw, trailer))).result()

    def discard(self, slot: int, kind: str) -> None:
        """Deletes the blob's value (a later read fails as never written)."""
        key = self.key(slot, kind)
        self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result()

    def damage(self, slot: int, kind: str) -> None:
        """Flips a bit of the value's first byte in the store (fault injection).

        Raises:
          FileNotFoundError: the blob was never written.
        """
        key = self.key(slot, kind)
        got = self._kv.read(key).result()
        if got.state != "value":
            raise FileNotFoundError(f"{self.path(slot, kind)}: no such value to damage")
        value = bytearray(got.value)
        value[0] ^= 0x01
        self._kv.write(key, bytes(value)).result()

    def read(self, slot: int, kind: str, out: np.ndarray) -> None:
        got = self._kv.read(self.key(slot, kind)).result()
        where = self.path(slot, kind)
        if got.state != "value":
            raise FileNotFoundError(f"{where}: no such value (never written, or deleted)")
        value = got.value
        nbytes = out.nbytes
        if len(value) != nbytes + _TRAILER.size:
            raise CorruptBlobError(
                f"{where}: {len(value)} bytes, expected {nbytes + _TRAILER.size} (truncated, or "
                "another blob's value)"
            )
        magic, crc, length = _TRAILER.unpack_from(value, nbytes)
        data = memoryview(value)[:nbytes]
        if magic != _MAGIC or length != nbytes or crc32c(data) != crc:
            raise CorruptBlobError(f"{where}: the value fails its crc32c (corrupted in storage)")
        out.view(np.uint8).reshape(-1)[:] = np.frombuffer(data, np.uint8)

    def close(self) -> None:
        pass


class ObjectLock:
    """One run per prefix: a lock object holding its owner, deleted on release.

    Raises:
      TierInUseError: if another run's lock object is there (with its owner and the fix).
    """

    def __init__(self, tier: Any, kvstore: ts.KvStore) -> None:
        self._kv = kvstore
        held = kvstore.read(LOCK_KEY).result()
        if held.state == "value":
            try:
                owner = json.loads(held.value)
                who = f"pid {owner['pid']} on {owner['host']} (since {time.ctime(owner['since'])})"
            except (ValueError, KeyError, TypeError):
                who = "an unknown owner"
            raise TierInUseError(
                f"tier {tier.path!r} is in use by {who}: its lock object {LOCK_KEY} is there. "
                "Give this run another prefix, or, if that run is dead, delete "
                f"{tier.path}{LOCK_KEY}."
            )
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        kvstore.write(LOCK_KEY, json.dumps(record).encode()).result()

    def release(self) -> None:
        # the server may be gone: then the next run reports the stale lock
        with contextlib.suppress(ValueError):
            self._kv.delete_range(ts.KvStore.KeyRange(LOCK_KEY, LOCK_KEY + "\0")).result()


def explain(tier: Any, error: BaseException) -> str | None:
    """What a tensorstore error of an object tier means and how to fix it (None: unknown)."""
    text = str(error)
    endpoint = tier.spec().get("endpoint", "AWS S3")
    if "Could not connect" in text or "curl_code='7'" in text or "Couldn't resolve" in text:
        return (
            f"the endpoint {endpoint} is unreachable (server down, or a wrong endpoint). Start "
            "the server or fix ObjectTier.endpoint; after a failed update restore the optimizer "
            "state from your last checkpoint."
        )
    status = re.search(r"http_response_code='(5\d\d)'", text)
    if status is not None:
        return (
            f"the server at {endpoint} kept answering HTTP {status.group(1)} (unavailable or "
            f"overloaded) through all ObjectTier.request_retries={tier.request_retries} retries. "
            "Check the server; if it is only overloaded, raise request_retries. After a failed "
            "update restore the optimizer state from your last checkpoint."
        )
    if "Invalid S3 bucket name" in text:
        return (
            f"bucket {tier.bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, "
            "digits, dots and hyphens): fix the URL."
        )
    if "NoSuchBucket" in text:
        return f"bucket {tier.bucket!r} does not exist at {endpoint}: create it or fix the URL."
    if "credentials" in text.lower() or "PERMISSION_DENIED" in text or "code='403'" in text:
        used = tier.spec().get("aws_credentials", "the default chain")
        return (
            f"access to bucket {tier.bucket!r} at {endpoint} was refused or no credentials were "
            f"found (credentials {used}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "give valid credentials."
        )
    return None


def check_reachable(tier: Any) -> None:
    """A small write, read and delete under the tier's prefix, before anything is trained.

    Raises:
      ConfigError: naming the endpoint, the bucket and the fix (unreachable endpoint, missing
        bucket, refused or missing credentials).
    """
    # unique: every process of a run checks the same prefix at once
    key = f".jax_mlpo-probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        kv = open_kvstore(tier)
        kv.write(key, b"jax_mlpo").result()
        if kv.read(key).result().value != b"jax_mlpo":
            raise ValueError("the probe value read back differs from the one written")
        kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
    except ValueError as e:
        hint = explain(tier, e) or "check the endpoint, the bucket and the credentials."
        raise ConfigError(f"ObjectTier {tier.path!r}: {hint} ({e})") from e
