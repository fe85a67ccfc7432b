"""Testing hooks: inject I/O faults into an optimizer's tiers or its checkpoints, and change the
tiers' bandwidth.

For tests of what training and checkpointing do when storage misbehaves, through public API
only. :func:`tier_faults` attaches a :class:`FaultPlan` to one tier (or all) of an offloaded
optimizer state, an :class:`~jax_mlpo.engine.engine.Engine` or a single
:class:`~jax_mlpo.tiers.file.FileTierStore`; every blob read and write of that tier then asks the
plan whether to fail it (an ``OSError`` with the errno of the test's choice: ``EIO``, or
``ENOSPC`` for a full disk), corrupt the stored blob first (the read's checksum must catch it),
delay it, hang it until released, or run an action inside it (stop a server), optionally only
for one blob kind or slot, counted from the ``nth`` matching request. The plan records each
request it saw as ``(op, kind, slot, outcome, where)`` in ``plan.trace``::

    import errno, jax_mlpo.testing

    with jax_mlpo.testing.tier_faults(opt_state, tier=0) as plan:
        plan.fail("write", nth=3, errno=errno.EIO)
        with pytest.raises(jax_mlpo.TierIOError, match="Input/output error"):
            ...  # updates
    assert plan.outcomes("write")[2] == "failed"

:func:`checkpoint_faults` attaches a plan to the checkpoint's own file I/O in this process
(every save and restore of :mod:`jax_mlpo.checkpoint`, whichever of its threads moves the
bytes): the pieces of the offloaded state's arrays (kind ``"state"``), of the large host
arrays it writes itself, the params (``"array"``), and the checksum manifests
(``"manifest"``); a slot is a piece's index in its file, ``where`` the file. An injected
failure fails the save (or restore) as the disk's own would; :meth:`FaultPlan.corrupt` flips a
bit of a piece on disk before the restore reads it, as a torn write or bit rot leaves it::

    with jax_mlpo.testing.checkpoint_faults() as plan:
        plan.fail("write", kind="state", nth=3, errno=errno.ENOSPC)  # the disk fills midway
        jax_mlpo.checkpoint.save(mngr, step, params, opt_state)
        with pytest.raises(jax_mlpo.checkpoint.CheckpointWriteError, match="No space left"):
            mngr.wait_until_finished()

A save also reads the offloaded state from the tiers: those reads are the tiers' requests
(:func:`tier_faults`). Held requests are released when the block exits. With no plan attached a
request pays one ``None`` check. To change a tier's bandwidth cap while it runs (a device that
slows down), use :func:`set_bandwidth_cap` or ``FileTierStore.set_bandwidth_cap``;
``FileTierStore.trace`` and ``FileTierStore.pacing`` record each request's start and end and
its reservation on the cap's clock, for order and overlap checks.

Two submodules run what such tests run against: :mod:`jax_mlpo.testing.s3_server` a local S3
server for object tiers (``moto[server]``), :mod:`jax_mlpo.testing.processes` a program on
several local processes (a ``jax.distributed`` job on one machine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jax_mlpo.checkpoint import file_io
from jax_mlpo.engine.engine import Engine
from jax_mlpo.tiers.faults import FaultEvent, FaultPlan
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.transforms.runtime import engine_of

__all__ = [
    "FaultEvent",
    "FaultPlan",
    "checkpoint_faults",
    "set_bandwidth_cap",
    "tier_faults",
    "tier_stores",
]


def tier_stores(target: Any, tier: int | None = 0) -> list[FileTierStore]:
    """The tier stores of ``target``.

    Args:
      target: an offloaded optimizer state (any form :func:`jax_mlpo.engine_of` takes), its
        :class:`~jax_mlpo.engine.engine.Engine`, or a :class:`~jax_mlpo.tiers.file.FileTierStore`.
      tier: the index of the tier in ``OffloadConfig.tiers`` as the engine opened them; None:
        every tier.

    Returns:
      The stores (one, or all the engine's).

    Raises:
      ValueError: if there is no tier ``tier`` (the state may be all in host memory).
    """
    if isinstance(target, FileTierStore):
        stores = [target]
    else:
        engine = target if isinstance(target, Engine) else engine_of(target)
        stores = list(engine.tiers)
    if tier is None:
        return stores
    if not 0 <= tier < len(stores):
        raise ValueError(
            f"tier={tier}: the optimizer has {len(stores)} open tier(s) (none when its whole "
            "state fits in host_cache): give an index below that, or tier=None for all"
        )
    return [stores[tier]]


@contextlib.contextmanager
def tier_faults(
    target: Any, tier: int | None = 0, plan: FaultPlan | None = None
) -> Iterator[FaultPlan]:
    """Attaches a fault plan to tier ``tier`` of ``target`` for the duration of the block.

    Args:
      target: an offloaded optimizer state, its engine, or one tier store (see
        :func:`tier_stores`).
      tier: which tier (its index); None: every tier, one plan counting their requests
        together.
      plan: the plan to attach (default: a new, empty one; add rules to what is yielded).

    Yields:
      The plan. On exit it is detached and the requests it holds are released.

    Raises:
      ValueError: if there is no such tier.
      RuntimeError: if a tier already has a plan attached.
    """
    stores = tier_stores(target, tier)
    busy = [s.tier.path for s in stores if s.faults is not None]
    if busy:
        raise RuntimeError(f"tiers {busy} already have a fault plan attached")
    plan = plan if plan is not None else FaultPlan()
    for store in stores:
        store.faults = plan
    try:
        yield plan
    finally:
        for store in stores:
            store.faults = None
        plan.close()


@contextlib.contextmanager
def checkpoint_faults(plan: FaultPlan | None = None) -> Iterator[FaultPlan]:
    """Attaches a fault plan to the checkpoint's own file I/O for the duration of the block.

    Every save and restore of :mod:`jax_mlpo.checkpoint` in this process consults it, from
    whichever thread moves the bytes (see :mod:`jax_mlpo.checkpoint.file_io`). Requests are
    ``(op, kind, slot)``: ``"read"`` or ``"write"``; ``"state"`` (a piece of an offloaded
    state's array), ``"array"`` (a piece of a large host array, the params) or ``"manifest"``;
    the piece's index in its file.

    Args:
      plan: the plan to attach (default: a new, empty one; add rules to what is yielded).

    Yields:
      The plan. On exit it is detached and the requests it holds are released.

    Raises:
      RuntimeError: if the checkpoint's I/O already has a plan attached.
    """
    plan = plan if plan is not None else FaultPlan()
    file_io.attach_faults(plan)
    try:
        yield plan
    finally:
        file_io.attach_faults(None)
        plan.close()


def set_bandwidth_cap(target: Any, rate: float | None, tier: int | None = 0) -> None:
    """Changes the bandwidth cap of tier ``tier`` of ``target`` from its next request on.

    Args:
      target: an offloaded optimizer state, its engine, or one tier store.
      rate: bytes per second; None removes the cap.
      tier: which tier (its index); None: every tier.

    Raises:
      ValueError: if there is no such tier, or ``rate`` is not positive.
    """
    for store in tier_stores(target, tier):
        store.set_bandwidth_cap(rate)
