"""Checkpoints of a training state that holds offloaded AdamW state, through orbax.

A jax_mlpo optimizer state is two int32 scalars on the device; AdamW's p, m and v live in the
engine's host cache and file tiers. :class:`OffloadCheckpointHandler` saves any pytree (params,
an ``optax.chain`` state, a dict of scalars) and replaces every
:class:`~jax_mlpo.OffloadedAdamWState` in it by the engine's state in the *logical* layout:

- ``count``: the step count (the offloaded state is at exactly this step);
- ``mu`` and ``nu``: float32 arrays of each parameter leaf's (global) shape;
- ``master``: the fp32 master copy of each bfloat16 leaf (None for float32 leaves).

Subgroups, tiers, host cache and process count are not part of a checkpoint, so it restores
into an optimizer with another ``subgroup_size``, tier list or ``host_cache``, and onto any
number of processes. Everything else in the tree (clipping and schedule states, the ``count``
scalars of ``optax.chain`` members) is saved as it is.

Several processes (``jax.distributed``, see :mod:`jax_mlpo.distributed`): the checkpoint is
still the global logical state, written the way orbax writes sharded ``jax.Array``s. Each
process contributes the shards it owns: its rows of every params leaf and of ``mu``, ``nu`` and
``master`` (as global arrays with the params' ``data`` sharding, written by orbax into
``ocdbt.process_<k>`` and merged into one array store when the checkpoint is finalized); the
replicated leaves and the scalars are written once, by process 0. On restore each process reads
only the saved shards that overlap its own (whole, to verify them; with 2 processes saved and 4
restoring, each reads the saved half holding its quarter) and loads only its shards into its
engine, whatever the process count, subgroups and tiers of the restoring run.

Each item also holds ``jax_mlpo_checksums.json``: a sha256 of every leaf as saved (dtype, shape
and bytes) or, for a leaf saved sharded, of every shard (with its index), the manifest itself
sealed by a sha256. Orbax's array files carry no checksum of their own (a flipped byte in an
array's data reads back as a different value); restore recomputes the digest of every shard it
reads and raises :class:`CorruptCheckpointError` on any difference, so what restores is bit for
bit what was saved. With several processes, each writes the digests of what it wrote into
``jax_mlpo_checksums.process_<k>.json``; process 0 merges them into the manifest when orbax
finalizes the checkpoint (after every process's writes), and a failed verification on any
process fails the restore on every process.

Crash safety and durability: the state is snapshotted synchronously in ``save`` (the next
update may then run while the snapshot is written in the background), written into orbax's
temporary directory and published by orbax's atomic rename once every file is written
(tensorstore fsyncs array files; the manifest is fsynced). A process killed at any moment leaves
the previous checkpoints as they were and at most a temporary directory, which
``CheckpointManager`` never returns as a step (and removes at start with
``cleanup_tmp_directories``). A checkpoint is durable once
``manager.wait_until_finished()`` returns (or the next save has started: orbax waits for the
previous one first). Tiers are never read back after a crash: restoring into a freshly
``tx.init``-ed optimizer re-creates them and writes the checkpointed state into them.

The snapshot holds the (process's share of the) optimizer state in host memory for the duration
of the write (12 bytes per parameter with bfloat16 params, 8 with float32).

Example (``tx`` an ``optax.chain`` holding ``jax_mlpo.adamw``)::

  mngr = jax_mlpo.checkpoint.manager("/ckpt/run1", max_to_keep=2)
  ...  # after update k:
  jax_mlpo.checkpoint.save(mngr, k, params, opt_state, {"data_step": k})
  ...  # in a new process (or processes), with any OffloadConfig:
  opt_state = tx.init(params)
  step, params, opt_state, extra = jax_mlpo.checkpoint.restore(mngr, params, opt_state)

The pieces compose with any orbax ``CheckpointManager``: ``OffloadSave(tree, params=...)`` and
``OffloadRestore(target)`` are the args of :class:`OffloadCheckpointHandler`, e.g. as items of
``ocp.args.Composite`` next to the caller's own.

Modules, one concept each:

- :mod:`~jax_mlpo.checkpoint.training`: :func:`manager`, :func:`save`, :func:`restore`;
- :mod:`~jax_mlpo.checkpoint.handler`: the orbax handler and its args;
- :mod:`~jax_mlpo.checkpoint.snapshot`: what a save takes from the tree and the engines;
- :mod:`~jax_mlpo.checkpoint.manifest`: the sha256 manifest, written and verified;
- :mod:`~jax_mlpo.checkpoint.restore_plan`: what each process reads of every leaf;
- :mod:`~jax_mlpo.checkpoint.load`: what was read, into the target and its engines;
- :mod:`~jax_mlpo.checkpoint.blocks` and :mod:`~jax_mlpo.checkpoint.tree`: the shard index
  arithmetic and the leaf kinds and names they share.
"""

from jax_mlpo.checkpoint.blocks import Index
from jax_mlpo.checkpoint.handler import OffloadCheckpointHandler, OffloadRestore, OffloadSave
from jax_mlpo.checkpoint.manifest import (
    CHECKSUMS_FILE,
    FORMAT,
    PROCESS_CHECKSUMS_FILE,
    READABLE_FORMATS,
    CorruptCheckpointError,
)
from jax_mlpo.checkpoint.snapshot import check_savable
from jax_mlpo.checkpoint.space import CheckpointSpaceError, check_space, space_needed
from jax_mlpo.checkpoint.training import Restored, manager, restore, save

__all__ = [
    "CHECKSUMS_FILE",
    "FORMAT",
    "Index",
    "PROCESS_CHECKSUMS_FILE",
    "READABLE_FORMATS",
    "CheckpointSpaceError",
    "CorruptCheckpointError",
    "OffloadCheckpointHandler",
    "OffloadRestore",
    "OffloadSave",
    "Restored",
    "check_savable",
    "check_space",
    "manager",
    "restore",
    "save",
    "space_needed",
]
