"""Host buffers between AdamW and the tiers: the slot cache and its I/O pipeline."""
