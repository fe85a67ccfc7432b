"""The optax transformations: the public optimizers (``elementwise``: AdamW and Lion;
``muon``), the transformation around an engine (``offloaded``), their state in a loop's tree
(``opt_state``), this process's engines and their calls (``runtime``) and gradient accumulation
(``accumulation``)."""
