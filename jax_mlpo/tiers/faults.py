"""Fault injection: chosen reads and writes of a tier or a checkpoint fail, corrupt, slow or hang.

Every blob read and write of a tier (:class:`~jax_mlpo.tiers.file.FileTierStore`, whatever its
I/O engine: posix files, tensorstore's zarr3, an object store) passes through one place, which
asks the store's :class:`FaultPlan` what to do with it when one is attached
(``store.faults``; None, the default, costs one attribute check per request). A checkpoint's
own file I/O has such a place too (:mod:`jax_mlpo.checkpoint.file_io`: the pieces of its arrays
and its manifest), where the kinds are ``"state"``, ``"array"`` and ``"manifest"`` and a slot is
a piece's index in its file; an injected failure there fails the save or restore. The plan acts
inside the request, after its permit and bandwidth reservation, so an injected fault looks to
the engine exactly as the device's own would: an ``OSError`` becomes the tier's
:class:`~jax_mlpo.tiers.errors.TierIOError` (``ENOSPC``:
:class:`~jax_mlpo.tiers.errors.TierFullError`) naming the blob's file and the fix, a corrupted
blob fails its checksum (:class:`~jax_mlpo.tiers.errors.CorruptBlobError`), a hung request
holds its permit and counts as busy until ``io_timeout_s`` gives up on it.

Rules say which requests to touch: the ``nth`` request (counted from 1, from when the rule is
added) of an operation (``"read"`` or ``"write"``) that matches the rule's ``kind`` and
``slot`` (None: any), and ``count`` requests from there (None: every one). A request may match
several rules; their actions run in the order the rules were added. The plan records every
request it sees in :attr:`FaultPlan.trace`, as ``(op, kind, slot, outcome, where)``, so a test
can assert on counts and orders rather than times::

    with jax_mlpo.testing.tier_faults(opt_state, tier=0) as plan:
        plan.fail("write", nth=3, errno=errno.EIO)
        ...
    assert plan.outcomes("write").count("failed") == 1

:mod:`jax_mlpo.testing` attaches a plan to an optimizer's tiers or to the checkpoint's I/O; it
is for tests only.
"""

from __future__ import annotations

import dataclasses
import errno as errno_codes
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

OPS = ("read", "write")
_OUTCOMES = {
    "fail": "failed",
    "corrupt": "corrupted",
    "delay": "delayed",
    "hang": "hung",
    "call": "called",
}


class FaultyStore(Protocol):
    """What the plan needs of the store a request goes to: a tier store, a checkpoint's file."""

    @property
    def where(self) -> str:
        """Names the store in the trace (a tier's path, a checkpoint file's)."""

    def blob_path(self, slot: int, kind: str = "state") -> str:
        """The file (or object key) that holds the blob."""

    def damage_blob(self, slot: int, kind: str = "state") -> None:
        """Flips a bit of the stored blob."""


class FaultEvent(NamedTuple):
    """A request the plan saw, and what it did to it.

    ``outcome`` is ``"passed"`` (untouched) or the actions taken, joined by ``+``:
    ``"delayed"``, ``"hung"``, ``"called"``, ``"corrupted"``, ``"failed"``. ``where``: the tier's
    path, or the checkpoint file's.
    """

    op: str
    kind: str
    slot: int
    outcome: str
    where: str


@dataclasses.dataclass
class _Rule:
    op: str
    action: str  # "fail", "corrupt", "delay", "hang", "call"
    nth: int
    count: int | None
    kind: str | None
    slot: int | None
    errno: int = errno_codes.EIO
    seconds: float | Callable[[], float] = 0.0
    call: Callable[[], object] | None = None
    limit_s: float = 60.0
    release: threading.Event = dataclasses.field(default_factory=threading.Event)
    seen: int = 0

    def matches(self, op: str, kind: str, slot: int) -> bool:
        # kind "state" covers "state.alt", the copy-on-write blob of the same subgroup
        kind_ok = self.kind is None or kind == self.kind or kind.startswith(self.kind + ".")
        return op == self.op and kind_ok and (self.slot is None or slot == self.slot)

    def fires(self) -> bool:
        """Counts a matching request; whether this one is among those the rule touches."""
        self.seen += 1
        return self.seen >= self.nth and (self.count is None or self.seen < self.nth + self.count)


class FaultPlan:
    """The faults to inject into the requests of one or more tier stores, or of checkpoints.

    Each method adds a rule and returns the plan, so rules chain. Thread-safe: requests come
    from the tiers' I/O threads.
    """

    def __init__(self) -> None:
        self.trace: list[FaultEvent] = []
        self._rules: list[_Rule] = []
        self._hanging = 0
        self._closed = False
        self._lock = threading.Condition()

    # -- rules ----------------------------------------------------------------------------------

    def fail(
        self, op: str, *, nth: int = 1, count: int | None = 1, errno: int = errno_codes.EIO,
        kind: str | None = None, slot: int | None = None,
    ) -> FaultPlan:  # fmt: skip
        """Fails matching requests with ``OSError(errno)``, as the device would.

        Args:
          op: ``"read"`` or ``"write"``.
          nth: the first matching request to fail, counted from 1.
          count: how many in a row (None: every one from ``nth``).
          errno: the error's code, e.g. ``errno.EIO`` (a device error) or ``errno.ENOSPC`` (a
            full file system: the store raises ``TierFullError``).
          kind: only blobs of this kind (``"state"``, which covers ``"state.alt"``,
            ``"grad"``, ``"probe"``; a checkpoint's: ``"state"``, ``"array"``, ``"manifest"``);
            None: any.
          slot: only this slot (the subgroup's index; a checkpoint's: the piece's index in its
            file); None: any.

        Returns:
          The plan.
        """
        return self._add(_Rule(op, "fail", nth, count, kind, slot, errno=errno))

    def corrupt(
        self, *, nth: int = 1, count: int | None = 1, kind: str | None = None,
        slot: int | None = None,
    ) -> FaultPlan:  # fmt: skip
        """Flips a bit of the stored blob (a checkpoint's piece) just before matching reads, as
        bit rot or a torn write would leave it: the read's checksum must catch it. It stays
        damaged for later reads too.

        Args:
          nth, count, kind, slot: which reads (as for :meth:`fail`).

        Returns:
          The plan.
        """
        return self._add(_Rule("read", "corrupt", nth, count, kind, slot))

    def delay(
        self, op: str, seconds: float | Callable[[], float], *, nth: int = 1,
        count: int | None = 1, kind: str | None = None, slot: int | None = None,
    ) -> FaultPlan:  # fmt: skip
        """Slows matching requests by ``seconds`` (or what the callable returns for each).

        Args:
          op: ``"read"`` or ``"write"``.
          seconds: the delay, or a function giving each request's (e.g. a random one).
          nth, count, kind, slot: which requests (as for :meth:`fail`).

        Returns:
          The plan.
        """
        return self._add(_Rule(op, "delay", nth, count, kind, slot, seconds=seconds))

    def hang(
        self, op: str, *, nth: int = 1, count: int | None = 1, kind: str | None = None,
        slot: int | None = None, limit_s: float = 60.0,
    ) -> FaultPlan:  # fmt: skip
        """Holds matching requests until :meth:`release` (or the plan is detached), as a file
        system that stops answering; then they go on.

        Args:
          op: ``"read"`` or ``"write"``.
          nth, count, kind, slot: which requests (as for :meth:`fail`).
          limit_s: a held request goes on after this long even unreleased, so that code
            which never gives up on it fails its test rather than hanging it.

        Returns:
          The plan.
        """
        return self._add(_Rule(op, "hang", nth, count, kind, slot, limit_s=limit_s))

    def on(
        self, op: str, action: Callable[[], object], *, nth: int = 1, count: int | None = 1,
        kind: str | None = None, slot: int | None = None,
    ) -> FaultPlan:  # fmt: skip
        """Calls ``action()`` inside matching requests, before their I/O (e.g. to stop the
        server of an object tier mid-run). What it raises is the request's error.

        Args:
          op: ``"read"`` or ``"write"``.
          action: called with no arguments.
          nth, count, kind, slot: which requests (as for :meth:`fail`).

        Returns:
          The plan.
        """
        return self._add(_Rule(op, "call", nth, count, kind, slot, call=action))

    def _add(self, rule: _Rule) -> FaultPlan:
        if rule.op not in OPS:
            raise ValueError(f"op={rule.op!r}: a fault applies to {OPS[0]!r} or {OPS[1]!r}")
        if rule.nth < 1 or (rule.count is not None and rule.count < 1):
            raise ValueError(f"nth={rule.nth}, count={rule.count}: both count from 1")
        with self._lock:
            if self._closed:
                raise RuntimeError("this fault plan was detached; start a new one")
            self._rules.append(rule)
        return self

    # -- control and results --------------------------------------------------------------------

    def release(self) -> None:
        """Lets every request held by :meth:`hang`, now or later, go on."""
        with self._lock:
            for rule in self._rules:
                rule.release.set()

    def close(self) -> None:
        """Releases the held requests; the plan takes no more rules (its stores detach it)."""
        with self._lock:
            self._closed = True
        self.release()

    @property
    def hanging(self) -> int:
        """How many requests :meth:`hang` holds now."""
        with self._lock:
            return self._hanging

    def outcomes(self, op: str | None = None, kind: str | None = None) -> list[str]:
        """The outcome of each request seen (of ``op`` and ``kind`` when given), in order."""
        with self._lock:
            return [
                e.outcome
                for e in self.trace
                if (op is None or e.op == op) and (kind is None or e.kind == kind)
            ]

    def wait_for(
        self, n: int, *, op: str | None = None, outcome: str | None = None, timeout_s: float = 60.0
    ) -> None:
        """Waits until the plan has seen ``n`` requests (of ``op``, with ``outcome``).

        Raises:
          TimeoutError: if they do not come within ``timeout_s``.
        """

        def seen() -> int:
            return sum(
                1
                for e in self.trace
                if (op is None or e.op == op) and (outcome is None or e.outcome == outcome)
            )

        with self._lock:
            if not self._lock.wait_for(lambda: seen() >= n, timeout_s):
                raise TimeoutError(
                    f"the plan saw {seen()} requests (op={op!r}, outcome={outcome!r}) within "
                    f"{timeout_s} s, not {n}: {self.trace[-5:]}"
                )

    # -- the hook -------------------------------------------------------------------------------

    def before(self, store: FaultyStore, op: str, slot: int, kind: str) -> None:
        """Applies the rules to a request of ``store``, before its I/O (the store calls it).

        Raises:
          OSError: an injected failure (or whatever an :meth:`on` action raised).
        """
        with self._lock:
            fired = [r for r in self._rules if r.matches(op, kind, slot) and r.fires()]
            outcome = "+".join(_OUTCOMES[r.action] for r in fired) or "passed"
            self.trace.append(FaultEvent(op, kind, slot, outcome, store.where))
            self._lock.notify_all()
        for rule in fired:
            if rule.action == "delay":
                seconds = rule.seconds() if callable(rule.seconds) else rule.seconds
                time.sleep(max(0.0, float(seconds)))
            elif rule.action == "hang":
                with self._lock:
                    self._hanging += 1
                try:
                    rule.release.wait(rule.limit_s)
                finally:
                    with self._lock:
                        self._hanging -= 1
            elif rule.action == "call":
                rule.call()
            elif rule.action == "corrupt":
                store.damage_blob(slot, kind)
            else:
                path = store.blob_path(slot, kind)
                raise OSError(rule.errno, os.strerror(rule.errno), path)
