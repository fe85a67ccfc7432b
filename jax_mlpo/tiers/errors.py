"""Errors of the file tiers (defined with every error of the library in :mod:`jax_mlpo.errors`)."""

from __future__ import annotations

from jax_mlpo.errors import CorruptBlobError, TierFullError, TierIOError

__all__ = ["CorruptBlobError", "TierFullError", "TierIOError"]
