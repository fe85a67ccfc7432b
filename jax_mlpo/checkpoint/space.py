"""Disk space for a checkpoint, checked before it starts.

A checkpoint holds this process's share of the offloaded state (12 B/param with bfloat16 params,
8 with float32) and the rest of the tree. A save that runs while training goes on also needs,
on each tier, room for the subgroups the next updates write while the checkpoint still has to
read their old blobs (copy-on-write, :mod:`jax_mlpo.engine.snapshot`): up to that tier's share of
the state again. Where the checkpoint and a tier share a file system, the two add up. Object tiers
are not checked (their stores report no free space).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax

from jax_mlpo.checkpoint.tree import is_offloaded
from jax_mlpo.errors import CheckpointSpaceError
from jax_mlpo.transforms.runtime import engine_of


def _existing(path: str) -> str:
    """``path`` or its nearest existing parent (orbax creates step directories late)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def space_needed(tree: Any, directory: Any, *, concurrent: bool) -> dict[str, int]:
    """Bytes a save of ``tree`` into ``directory`` needs, by file system (a path on it).

    Args:
      tree: the tree to save.
      directory: where the checkpoint (item) goes.
      concurrent: whether training goes on while it is written (copy-on-write on the tiers).

    Returns:
      ``{path: bytes}``, one path per file system that needs space.
    """
    ckpt = _existing(os.fspath(directory))
    need: dict[int, tuple[str, int]] = {}

    def add(path: str, nbytes: int) -> None:
        dev = os.stat(path).st_dev
        where, had = need.get(dev, (path, 0))
        need[dev] = (where, had + nbytes)

    total = 0
    for x in jax.tree.leaves(tree, is_leaf=is_offloaded):
        if is_offloaded(x):
            engine = engine_of(x)
            total += engine.layout.state_bytes
            if concurrent:
                for k, store in enumerate(engine.tiers):
                    if store.directory is not None:
                        sgs = engine.layout.subgroups
                        on_tier = sum(sg.state_bytes for sg in sgs if engine.tier_of[sg.index] == k)
                        add(store.directory, on_tier)
        else:
            total += int(getattr(x, "nbytes", 0) or 0)
    add(ckpt, total)
    return dict(need.values())


def check_space(
    tree: Any, directory: Any, *, concurrent: bool, reusable: int = 0, margin: float = 1.05
) -> None:
    """Raises unless every file system has the space :func:`space_needed` says (plus 5%).

    Args:
      tree: the tree to save.
      directory: where the checkpoint (item) goes.
      concurrent: whether training goes on while it is written (copy-on-write on the tiers).
      reusable: bytes of a deleted checkpoint's files the save rewrites, on the checkpoint's
        file system (:mod:`~jax_mlpo.checkpoint.recycle`).
      margin: the space needed is multiplied by it.

    Raises:
      CheckpointSpaceError: naming the file system, the figures and the fix.
    """
    ckpt = os.stat(_existing(os.fspath(directory))).st_dev
    for path, nbytes in space_needed(tree, directory, concurrent=concurrent).items():
        free = shutil.disk_usage(path).free + (reusable if os.stat(path).st_dev == ckpt else 0)
        if free < nbytes * margin:
            fix = (
                "a synchronous save (jax_mlpo.checkpoint.save(..., blocking=True)) needs no "
                "room on the tiers; or free space there, or keep fewer checkpoints"
                if concurrent
                else "free space there, keep fewer checkpoints (max_to_keep), or checkpoint "
                "to another file system"
            )
            raise CheckpointSpaceError(
                f"a checkpoint {'written while training goes on ' if concurrent else ''}needs "
                f"{_size(nbytes)} on the file system of {path}, which has {_size(free)} free: "
                f"{fix}"
            )


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
