"""Which shards of the params an engine holds: a mesh of this process's devices (``mesh``),
and the shards of several processes (``processes``, data parallel over ``jax.distributed``)."""
