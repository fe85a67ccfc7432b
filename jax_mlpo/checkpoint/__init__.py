"""Checkpoints of a training state that holds offloaded AdamW state, through orbax.

A jax_mlpo optimizer state is two int32 scalars on the device; AdamW's p, m and v live in the
engine's host cache and file tiers, and may be larger than host memory. Each item of a
checkpoint is written by :class:`OffloadCheckpointHandler`: the tree (params, an
``optax.chain`` state, a dict of scalars) as a standard orbax PyTree item, every
:class:`~jax_mlpo.OffloadedState` in it reduced to its ``count``, and the offloaded state
*streamed* beside it (``jax_mlpo_state/``) in the *logical* layout:

- ``mu`` and ``nu`` of every parameter leaf, and ``master`` (the fp32 master copy) of every
  bfloat16 leaf, each shard a 1-D float32 zarr3 array of its elements (each process writes its
  shards: ``jax_mlpo_state/<state>/process_<k>/<quantity>.<engine leaf>``; readable with
  ``ts.open``), recorded as a block of the leaf (``box``) and a range of that block's
  flattening: a range of the whole leaf with one device per process, a whole block with params
  on a mesh;
- the save reads the state from the host cache and the tiers subgroup by subgroup
  (:mod:`jax_mlpo.engine.snapshot`) and writes each array in pieces of 8 MiB, O_DIRECT, a CRC-32C
  per piece; host memory beyond ``host_cache``: two read-ahead blobs and at most 8 pieces in flight,
  whatever the state's size.

Subgroups, tiers, host cache and process count are not part of a checkpoint, so it restores
into an optimizer with another ``subgroup_size``, tier list or ``host_cache``, and onto any
number of processes, and params on another mesh (or none): the restore streams the arrays
into the new engine subgroup by subgroup, each process reading only the pieces that overlap
its shards, whatever blocks they were saved in.

**Asynchronous saves without a copy of the state or the params.** With an async manager,
:func:`save` returns once the params are written (large host arrays by jax_mlpo itself, with
O_DIRECT, as uncompressed zarr3 arrays that plain orbax reads:
:mod:`~jax_mlpo.checkpoint.host_arrays`) and the retained subgroups are written to their
tiers; the next updates run while the state is streamed from the tiers. Until the
checkpoint has read a subgroup, its write-backs go to a second blob of that subgroup
(copy-on-write), and the old one is deleted once read: the tiers hold up to twice the state
during such a save. :func:`save` checks the free space first (:mod:`~jax_mlpo.checkpoint.space`)
and saves synchronously where copy-on-write would not fit (``blocking=None``), or raises
:class:`CheckpointSpaceError` naming the figures and the fix.

Several processes (``jax.distributed``, see :mod:`jax_mlpo.sharding.processes`): the params are
written the way orbax writes sharded ``jax.Array``s (each process the zarr3 chunks of its shards),
the offloaded state by each process into its own arrays (replicated leaves once, by process 0). On
restore each process reads only the saved shards that overlap its own.

Each item also holds ``jax_mlpo_checksums.json``: a digest (CRC-32C,
:mod:`~jax_mlpo.checkpoint.digest`; a sha256 before format 5) of every orbax leaf as saved (or of
every shard of a leaf saved sharded) and of every piece of every streamed array, the manifest
itself sealed by a sha256. Orbax's array files carry no checksum of their own; restore
recomputes the digest of every shard and piece it reads, before using it, and raises
:class:`CorruptCheckpointError` on any difference (a corrupt piece found midway leaves the
restoring engine failed: restore again into a new ``tx.init``). With several processes, each
writes the digests of what it wrote into ``jax_mlpo_checksums.process_<k>.json``; process 0
merges them when orbax finalizes the checkpoint, and a failed verification on any process fails
the restore on every process.

Crash safety and durability: everything is written into orbax's temporary directory (streamed
arrays fdatasync'd, the manifest fsynced) and published by orbax's atomic rename once every file
is written. A process killed at any moment, during an asynchronous save included, leaves the
previous checkpoints as they were and at most a temporary directory, which
``CheckpointManager`` never returns as a step (and removes at start with
``cleanup_tmp_directories``). A save that fails midway (a full disk, a lost object store)
leaves the same and raises :class:`CheckpointWriteError` naming the step, the file, the cause
and the fix. A checkpoint is durable once ``manager.wait_until_finished()``
returns (or the next save has started: orbax waits for the previous one first). Tiers are never
read back after a crash: restoring into a freshly ``tx.init``-ed optimizer re-creates them and
writes the checkpointed state into them.

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
- :mod:`~jax_mlpo.checkpoint.stream` and :mod:`~jax_mlpo.checkpoint.shard_file`: the offloaded
  state's arrays, written and read piece by piece;
- :mod:`~jax_mlpo.checkpoint.pieces`: which saved pieces fill a restoring subgroup, across
  shards cut into other blocks;
- :mod:`~jax_mlpo.checkpoint.space`: the free space a save needs;
- :mod:`~jax_mlpo.checkpoint.failures`: what a save that fails midway tells its caller;
- :mod:`~jax_mlpo.checkpoint.file_io`: the checkpoint's own file I/O, in one place (where a test's
  fault plan meets it);
- :mod:`~jax_mlpo.checkpoint.manifest`: the checksum manifest, written and verified;
- :mod:`~jax_mlpo.checkpoint.digest`: the digests it records (CRC-32C) and checks;
- :mod:`~jax_mlpo.checkpoint.restore_plan`: what each process reads of every leaf;
- :mod:`~jax_mlpo.checkpoint.load`: what was read, into the target and its engines;
- :mod:`~jax_mlpo.checkpoint.blocks` and :mod:`~jax_mlpo.checkpoint.tree`: the shard index
  arithmetic and the leaf kinds and names they share.
"""

from jax_mlpo.checkpoint.failures import CheckpointWriteError
from jax_mlpo.checkpoint.handler import OffloadCheckpointHandler, OffloadRestore, OffloadSave
from jax_mlpo.checkpoint.manifest import CorruptCheckpointError
from jax_mlpo.checkpoint.space import CheckpointSpaceError
from jax_mlpo.checkpoint.training import Restored, manager, restore, save

__all__ = [
    "CheckpointSpaceError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "OffloadCheckpointHandler",
    "OffloadRestore",
    "OffloadSave",
    "Restored",
    "manager",
    "restore",
    "save",
]
