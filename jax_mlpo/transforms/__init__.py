"""The optax transformations: the public optimizers (``elementwise``: AdamW and Lion;
``muon``), the transformation around an engine (``offloaded``), their state in a loop's tree
(``opt_state``), this process's engines (``registry``) and gradient accumulation
(``accumulation``)."""
