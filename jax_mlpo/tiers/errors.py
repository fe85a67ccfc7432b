"""Errors of the file tiers."""

from __future__ import annotations


class TierIOError(OSError):
    """A read or write on a tier failed; the message names the tier, the file and what to do."""


class CorruptBlobError(TierIOError):
    """A blob failed its checksum: what is on disk is not what was written."""


class TierFullError(TierIOError):
    """A write found its tier's file system full (``errno.ENOSPC``); the blob it replaces is
    intact, so another tier can take the subgroup (``OffloadConfig.fallback_on_full``)."""
