"""Checkpoints of a training state that holds offloaded AdamW state, through orbax.

A jax_mlpo optimizer state is two int32 scalars on the device; AdamW's p, m and v live in the
engine's host cache and file tiers. :class:`OffloadCheckpointHandler` saves any pytree (params,
an ``optax.chain`` state, a dict of scalars) and replaces every
:class:`~jax_mlpo.OffloadedAdamWState` in it by the engine's state in the *logical* layout:

- ``count``: the step count (the offloaded state is at exactly this step);
- ``mu`` and ``nu``: float32 arrays of each parameter leaf's shape;
- ``master``: the fp32 master copy of each bfloat16 leaf (None for float32 leaves).

Subgroups, tiers and host cache are not part of a checkpoint, so it restores into an optimizer
with another ``subgroup_size``, tier list or ``host_cache`` (and, sharded per leaf, later into
another process count). Everything else in the tree (clipping and schedule states, the
``count`` scalars of ``optax.chain`` members) is saved as it is.

Each item also holds ``jax_mlpo_checksums.json``: a sha256 of every leaf as saved (dtype, shape
and bytes), the manifest itself sealed by a sha256. Orbax's array files carry no checksum of
their own (a flipped byte in an array's data reads back as a different value); restore
recomputes every digest and raises :class:`CorruptCheckpointError` on any difference, so what
restores is bit for bit what was saved.

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

The snapshot holds the whole optimizer state in host memory for the duration of the write (12
bytes per parameter with bfloat16 params, 8 with float32).

Example (``tx`` an ``optax.chain`` holding ``jax_mlpo.adamw``)::

  mngr = jax_mlpo.checkpoint.manager("/ckpt/run1", max_to_keep=2)
  ...  # after update k:
  jax_mlpo.checkpoint.save(mngr, k, params, opt_state, {"data_step": k})
  ...  # in a new process, with any OffloadConfig:
  opt_state = tx.init(params)
  step, params, opt_state, extra = jax_mlpo.checkpoint.restore(mngr, params, opt_state)

The pieces compose with any orbax ``CheckpointManager``: ``OffloadSave(tree)`` and
``OffloadRestore(target)`` are the args of :class:`OffloadCheckpointHandler`, e.g. as items of
``ocp.args.Composite`` next to the caller's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src import asyncio_utils

from jax_mlpo import transform
from jax_mlpo.engine import EngineFailedError, StaleStateError
from jax_mlpo.kernels import F32
from jax_mlpo.transform import OffloadedAdamWState

CHECKSUMS_FILE = "jax_mlpo_checksums.json"
FORMAT = 1


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's contents differ from what was saved (or it is incomplete)."""


# -- the tree in host memory ---------------------------------------------------------------------


def _is_offloaded(x: Any) -> bool:
    return isinstance(x, OffloadedAdamWState)


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # flax.nnx variables wrap the arrays


def _engine_of(state: OffloadedAdamWState):
    return transform._engine(_value(state.handle))


def _is_key(x: Any) -> bool:
    """A typed PRNG key array (optax.add_noise's state): saved as its uint32 key data."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def check_savable(tree: Any) -> None:
    """Raises unless every offloaded state in ``tree`` is the current one of a healthy engine.

    Waits for the updates in flight (their ordered host callbacks) first.

    Raises:
      EngineFailedError: an update failed midway; the offloaded state is partly updated.
      StaleStateError: a state is not the one its engine was last advanced to.
    """
    states = [s for s in jax.tree.leaves(tree, is_leaf=_is_offloaded) if _is_offloaded(s)]
    for _ in range(2):  # before the barrier (which re-raises the failure less clearly), after
        if any(_engine_of(s).failed for s in states):
            raise EngineFailedError(
                "an update of this optimizer failed midway, so its offloaded state is partly "
                "updated and cannot be checkpointed. Restore from your last checkpoint (into a "
                "new tx.init) and continue from there."
            )
        jax.effects_barrier()
    for state in states:
        count, step = int(np.asarray(_value(state.count))), _engine_of(state).step_count
        if count != step:
            raise StaleStateError(
                f"the optimizer state to save is at step {count}, but its offloaded state is "
                f"at step {step}: save the state returned by the last update"
            )


def _snapshot(tree: Any) -> Any:
    """``tree`` in host memory, offloaded states in the logical layout; a copy the caller's
    later updates cannot change."""

    def convert(x: Any) -> Any:
        if _is_offloaded(x):
            state = _engine_of(x).state_dict()  # fresh arrays, from the cache and the tiers
            return {"count": np.asarray(_value(x.count), np.int32), **state}
        if _is_key(x):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            return np.array(x)  # a copy: device buffers may be donated, numpy ones reused
        return x

    check_savable(tree)
    return jax.tree.map(convert, tree, is_leaf=_is_offloaded)


def _abstract(target: Any) -> Any:
    """The host tree a checkpoint of ``target`` holds, with placeholders for the arrays."""

    def convert(x: Any) -> Any:
        if _is_offloaded(x):
            layout = _engine_of(x).layout
            return {
                "count": np.zeros((), np.int32),
                "mu": [np.empty(shape, F32) for shape in layout.shapes],
                "nu": [np.empty(shape, F32) for shape in layout.shapes],
                "master": [
                    np.empty(shape, F32) if dt != F32 else None
                    for shape, dt in zip(layout.shapes, layout.dtypes, strict=True)
                ],
            }
        if _is_key(x):
            x = jax.eval_shape(jax.random.key_data, x)
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
            return np.empty(x.shape, x.dtype)
        return x

    return jax.tree.map(convert, target, is_leaf=_is_offloaded)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaves(tree: Any) -> dict[str, Any]:
    """Leaves by path (``"1/0/mu/3"``), the same for a tree and orbax's dict form of it."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in flat}


def _describe(leaf: Any) -> dict[str, Any]:
    a = np.asarray(leaf)
    digest = hashlib.sha256(f"{a.dtype.name}{a.shape}".encode())
    if a.dtype.kind in "OUS" or not a.flags.c_contiguous:
        digest.update(a.tobytes())
    else:  # no copy (bfloat16 has no buffer protocol of its own)
        digest.update(a.reshape(-1).view(np.uint8))
    return {"dtype": a.dtype.name, "shape": list(a.shape), "sha256": digest.hexdigest()}


def _seal(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _manifest(host: Any) -> dict[str, Any]:
    body = {
        "format": FORMAT,
        "leaves": {name: _describe(leaf) for name, leaf in _leaves(host).items()},
    }
    return {**body, "sha256": _seal(body)}


def _read_manifest(directory: epath.Path) -> dict[str, Any]:
    path = directory / CHECKSUMS_FILE
    try:
        manifest = json.loads(path.read_text())
        body = {k: manifest[k] for k in ("format", "leaves")}
        sealed = manifest["sha256"]
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing: {directory} was not written by jax_mlpo.checkpoint, or is "
            "incomplete. Restore another step."
        ) from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not a valid checksum manifest ({e!r})") from None
    if _seal(body) != sealed:
        raise CorruptCheckpointError(f"{path} is corrupt: its own sha256 does not match")
    if body["format"] != FORMAT:
        raise CorruptCheckpointError(
            f"{path}: format {body['format']!r}; this jax_mlpo reads format {FORMAT}"
        )
    return body


def _check_structure(host_target: Any, manifest: dict[str, Any], directory: epath.Path) -> None:
    """Fails, naming the leaves, if the target's leaves are not the checkpoint's."""
    saved = manifest["leaves"]
    wanted = _leaves(host_target)
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    if missing or extra:
        raise ValueError(
            f"checkpoint {directory} does not fit the target tree: leaves only in the target "
            f"{missing[:8]}, only in the checkpoint {extra[:8]}. Restore into the same model "
            "and optimizer structure (and param dtypes: bfloat16 leaves carry a master copy)."
        )
    for name, leaf in wanted.items():
        if isinstance(leaf, np.ndarray):
            want = (leaf.dtype.name, list(leaf.shape))
            got = (saved[name]["dtype"], saved[name]["shape"])
            if want != got:
                raise ValueError(
                    f"checkpoint {directory}: leaf {name} is {got[0]}{got[1]}, the target's is "
                    f"{want[0]}{want[1]}"
                )


def _verify(restored: Any, manifest: dict[str, Any], directory: epath.Path) -> None:
    got = _leaves(restored)
    saved = manifest["leaves"]
    if set(got) != set(saved):
        raise CorruptCheckpointError(
            f"checkpoint {directory}: restored leaves {sorted(set(got) ^ set(saved))[:8]} "
            "differ from the checksum manifest's"
        )
    for name, leaf in got.items():
        if _describe(leaf) != saved[name]:
            raise CorruptCheckpointError(
                f"checkpoint {directory}: leaf {name} does not match its sha256 (the checkpoint "
                "is corrupt: a changed or half-written file). Restore another step."
            )


def _like(target: Any, value: Any) -> Any:
    """``value`` (host) as the kind of leaf ``target`` is (device array, numpy, scalar)."""
    if _is_key(target):
        value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(target))
    if isinstance(target, jax.Array):
        return jax.device_put(value, target.sharding)
    if isinstance(target, jax.ShapeDtypeStruct):
        sharding = getattr(target, "sharding", None)
        return jax.device_put(value, sharding) if sharding is not None else jax.device_put(value)
    if isinstance(target, np.generic):
        return target.dtype.type(value)
    return value


def _load(target: Any, restored: Any) -> Any:
    """Loads restored offloaded states into ``target``'s engines; leaves as ``target``'s."""

    def load(t: Any, r: Any) -> Any:
        if _is_offloaded(t):
            count = int(np.asarray(r["count"]))
            state = {name: list(r[name]) for name in ("mu", "nu", "master")}
            _engine_of(t).load_state_dict(count, state)
            return OffloadedAdamWState(count=_like(_value(t.count), r["count"]), handle=t.handle)
        return _like(t, r)

    return jax.tree.map(load, target, restored, is_leaf=_is_offloaded)


# -- the orbax handler ---------------------------------------------------------------------------


class OffloadCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores a pytree that may hold offloaded AdamW states, checksummed.

    ``async_save`` snapshots the tree synchronously (device arrays copied to the host, every
    :class:`~jax_mlpo.OffloadedAdamWState` replaced by its engine's ``state_dict`` at that
    step), then writes it with orbax's ``PyTreeCheckpointHandler`` and computes and writes the
    sha256 manifest in the background. ``restore`` needs the target tree (for the engines to
    load into) except for trees without offloaded states; it verifies every leaf.
    """

    def __init__(self) -> None:
        self._tree = ocp.PyTreeCheckpointHandler()

    async def async_save(
        self, directory: epath.Path, args: OffloadSave | None = None, **kwargs: Any
    ) -> list[ocp.future.Future]:
        """Snapshots ``args.item`` now; returns the futures that write it.

        Raises:
          StaleStateError: if an offloaded state is not the one its engine was last advanced to.
          EngineFailedError: if an update failed midway (the state is inconsistent).
        """
        if not isinstance(args, OffloadSave):
            raise ValueError(
                "pass the item as args=jax_mlpo.checkpoint.OffloadSave(tree), got "
                f"{type(args).__name__} (and {sorted(kwargs)})"
            )
        # the format leaf keeps orbax from refusing a tree without leaves (optax.sgd's state)
        host = {"format": FORMAT, "tree": _snapshot(args.item)}
        futures = await self._tree.async_save(directory, args=ocp.args.PyTreeSave(host))
        checksums = ocp.future.CommitFutureAwaitingContractedSignals(
            self._write_manifest(directory, host), name="jax_mlpo_checksums"
        )
        return [*(futures or []), checksums]

    async def _write_manifest(self, directory: Any, host: Any) -> None:
        text = json.dumps(_manifest(host), sort_keys=True)
        if hasattr(directory, "await_creation"):
            directory = await directory.await_creation()
        if jax.process_index() != 0:
            return
        with open(os.fspath(directory / CHECKSUMS_FILE), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def save(self, directory: epath.Path, args: OffloadSave | None = None, **kwargs: Any) -> None:
        """Like :meth:`async_save`, returning once everything is written."""
        for future in asyncio_utils.run_sync(self.async_save(directory, args, **kwargs)):
            future.result()

    def restore(self, directory: epath.Path, args: OffloadRestore | None = None) -> Any:
        """Restores the tree saved in ``directory``, verified against its checksums.

        Args:
          directory: the item's directory.
          args: ``OffloadRestore(target)``. Offloaded states in ``target`` (from ``tx.init``,
            with any offload config) get the checkpoint's state loaded into their engines;
            device arrays come back on the target's shardings. Without a target, the saved
            tree comes back in orbax's dict form (only for trees without offloaded states).

        Returns:
          The restored tree, of ``target``'s structure.

        Raises:
          CorruptCheckpointError: a leaf, or the manifest, does not match its sha256.
          ValueError: the checkpoint's leaves, dtypes or shapes differ from the target's.
        """
        manifest = _read_manifest(directory)
        target = args.item if args is not None else None
        if target is None:
            restored = self._tree.restore(directory)
            _verify(restored, manifest, directory)
            return restored.get("tree", {})  # orbax leaves out an empty subtree
        host_target = {"format": FORMAT, "tree": _abstract(target)}
        _check_structure(host_target, manifest, directory)
        restore_args = jax.tree.map(
            lambda x: (
                ocp.RestoreArgs(restore_type=np.ndarray)
                if isinstance(x, np.ndarray)
                else ocp.RestoreArgs()
            ),
            host_target,
        )
        restored = self._tree.restore(
            directory, args=ocp.args.PyTreeRestore(item=host_target, restore_args=restore_args)
        )
        _verify(restored, manifest, directory)
        return _load(target, restored["tree"])

    def metadata(self, directory: epath.Path) -> dict[str, Any]:
        """The saved leaves' dtypes, shapes and sha256s by path, without reading arrays."""
        return _read_manifest(directory)["leaves"]

    def finalize(self, directory: epath.Path) -> None:
        self._tree.finalize(directory)

    def close(self) -> None:
        self._tree.close()


@ocp.args.register_with_handler(OffloadCheckpointHandler, for_save=True)
@dataclasses.dataclass
class OffloadSave(ocp.args.CheckpointArgs):
    """Save args of :class:`OffloadCheckpointHandler`: the tree (params, opt_state, scalars)."""

    item: Any


@ocp.args.register_with_handler(OffloadCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class OffloadRestore(ocp.args.CheckpointArgs):
    """Restore args of :class:`OffloadCheckpointHandler`: the target tree, or None."""

    item: Any = None


# -- a training checkpoint: params, optimizer state, extra ---------------------------------------


class Restored(NamedTuple):
    """What :func:`restore` returns: the checkpoint's step and the restored trees."""

    step: int
    params: Any
    opt_state: Any
    extra: dict[str, Any]


def manager(
    directory: str | os.PathLike,
    *,
    max_to_keep: int | None = 2,
    async_save: bool = True,
    **options: Any,
) -> ocp.CheckpointManager:
    """An orbax ``CheckpointManager`` for :func:`save` and :func:`restore`.

    Args:
      directory: where the step directories go (created).
      max_to_keep: checkpoints kept (oldest deleted first); None keeps all.
      async_save: write in the background (``save`` returns after the snapshot).
      **options: more ``ocp.CheckpointManagerOptions`` fields.
    """
    options.setdefault("cleanup_tmp_directories", True)  # leftovers of a killed save
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, **options
        ),
    )


def save(
    mngr: ocp.CheckpointManager,
    step: int,
    params: Any,
    opt_state: Any,
    extra: dict[str, Any] | None = None,
    *,
    force: bool = False,
) -> bool:
    """Saves params, the optimizer state and ``extra`` as checkpoint ``step``.

    Call it between updates with the params and state the last update returned. It returns
    once the state is snapshotted in host memory (the next update may run); with an async
    manager the files are written in the background, and the checkpoint is durable once
    ``mngr.wait_until_finished()`` returns. See the module docstring for the contents.

    Args:
      mngr: from :func:`manager` (or any ``ocp.CheckpointManager``).
      step: the checkpoint's step, usually the number of updates applied.
      params: the params pytree.
      opt_state: the optimizer state (e.g. an ``optax.chain`` state with ``jax_mlpo.adamw``).
      extra: JSON-like scalars to keep with it (data position, RNG seeds...).
      force: save even if the manager's save policy would skip this step.

    Returns:
      Whether a checkpoint was started (orbax's save policy may skip a step).

    Raises:
      StaleStateError: ``opt_state`` is not the latest state of its optimizer.
      EngineFailedError: an update failed midway; restore from the previous checkpoint.
    """
    check_savable(opt_state)  # before orbax starts a step directory
    args = ocp.args.Composite(
        params=OffloadSave(params),
        opt_state=OffloadSave(opt_state),
        extra=OffloadSave(dict(extra or {})),
    )
    return mngr.save(step, args=args, force=force)


def restore(
    mngr: ocp.CheckpointManager, params: Any, opt_state: Any, *, step: int | None = None
) -> Restored:
    """Restores checkpoint ``step`` (default: the latest) into ``params`` and ``opt_state``.

    Args:
      mngr: the manager the checkpoint was saved with (or one on the same directory).
      params: a params tree of the saved structure (arrays or ``jax.ShapeDtypeStruct``), giving
        dtypes and shardings.
      opt_state: a fresh ``tx.init(params)`` (with any offload config: subgroups, tiers and
        host cache may differ from the saved run's). Its engines get the saved state.

    Returns:
      ``Restored(step, params, opt_state, extra)``.

    Raises:
      FileNotFoundError: no (such) checkpoint in the manager's directory.
      CorruptCheckpointError: a file of the checkpoint was changed or is incomplete.
      ValueError: the checkpoint does not fit ``params``/``opt_state``.
    """
    if step is None:
        step = mngr.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {mngr.directory}")
    elif step not in mngr.all_steps():
        raise FileNotFoundError(f"no checkpoint of step {step} in {mngr.directory}")
    args = ocp.args.Composite(
        params=OffloadRestore(params), opt_state=OffloadRestore(opt_state), extra=OffloadRestore()
    )
    out = mngr.restore(step, args=args)
    return Restored(int(step), out["params"], out["opt_state"], dict(out["extra"]))
