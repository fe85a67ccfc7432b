"""Errors of the file tiers."""

from __future__ import annotations


class TierIOError(OSError):
    """A read or write on a tier failed; the message names the tier, the file and what to do."""


class CorruptBlobError(TierIOError):
    """A blob failed its checksum: what is on disk is not what was written."""
