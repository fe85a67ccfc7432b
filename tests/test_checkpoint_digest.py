"""The checkpoint's digests: CRC-32C (format 5); formats 3 and 4's sha256s still checked."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from jax_mlpo.checkpoint import digest


def test_a_digest_is_the_standard_crc32c_of_header_then_data():
    assert digest.of(b"123456789") == "crc32c:e3069283"  # the CRC-32C check value
    data = np.arange(1 << 16, dtype=np.float32)
    fed = digest.Digest(b"float32(65536,)")
    for part in np.split(data, 8):
        fed.update(part)
    assert fed.hexdigest() == digest.of(data, b"float32(65536,)")
    assert digest.of(data, b"float32(65536,)") != digest.of(data)  # the header counts


@pytest.mark.parametrize("kind", ["crc32c", "sha256"])
def test_every_flipped_byte_fails_its_digest(kind):
    data = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    raw = data.view(np.uint8)
    if kind == "crc32c":
        expected = digest.of(data, b"h")
    else:  # as formats 3 and 4 recorded it: bare hex
        expected = hashlib.sha256(b"h" + raw.tobytes()).hexdigest()
    assert digest.matches(data, expected, b"h")
    assert not digest.matches(data, expected, b"i")
    for pos in range(0, raw.size, 7):
        flipped = raw.copy()
        flipped[pos] ^= 1 << (pos % 8)
        assert not digest.matches(flipped, expected, b"h"), pos


def test_a_record_gives_its_digests_under_either_key():
    assert digest.recorded({"digest": ["crc32c:00000000"]}) == ["crc32c:00000000"]
    assert digest.recorded({"sha256": "ab" * 32}) == "ab" * 32
