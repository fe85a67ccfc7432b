"""The host engine: one object per offloaded state (``engine.Engine``) with its collaborators
(the I/O between updates, the state's snapshots and loads), the layout of the state in
subgroups, the host budget's plan, the update order and retention, the pipeline and cache
(``buffers``), placement on the tiers (``placement``), and each update's measurements."""
