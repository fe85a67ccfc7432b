"""Host buffers between the optimizer and the tiers: the slot cache and its I/O pipeline."""
