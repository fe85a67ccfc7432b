"""Storage tiers: host buffers, file tiers on tensorstore, and the locks that guard them."""
