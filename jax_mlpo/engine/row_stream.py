"""The update of stacked layers handed to a scan one row at a time.

A model that scans its layers (``lax.scan``, ``nnx.scan``, ``LlamaConfig(scan_layers=True)``)
keeps each param of its block stacked: one leaf of ``rows`` rows, row ``i`` read by the scan's
iteration ``i``. Inside :func:`jax_mlpo.overlapped_step` such a group is a send
(``jax_mlpo_host_send``: the group's gradients and params handed in, its updates written where
the gradients were) and, in the scan's body, one receive per row (``jax_mlpo_host_receive``),
the two joined by a stream number chosen when the step is traced. The engine updates the
group's subgroups row by row (:func:`row_rank`); :class:`RowBoard` hands row ``i`` of each
param and of its update to its receive (plain copies: the scan adds them as
``optax.apply_updates`` does) as soon as every subgroup holding a part of it is updated, so the
scan's iteration ``i`` runs while the engine updates the next rows.

The send stays pending until every row has been taken: its buffers are XLA's until then, and
the receives read from them. A receive may come before its row is updated (it then waits,
holding no XLA thread) or before the send itself (it waits for it). A failed update fails the
send and every receive of its round.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_mlpo.engine.layout import Layout, Subgroup

__all__ = ["DRAIN", "RowBoard", "RowBoards", "complete_later", "row_rank", "rows_of_subgroups"]

# The row a drain receives: every row at once, nothing copied (the send's updates were used
# whole, as an update in one call's are).
DRAIN = -1

# complete(completion, error): hands a receive or a send back to XLA (from a fresh thread)
Complete = Callable[[Any, BaseException | None], None]


def complete_later(completion: Any, error: BaseException | None) -> None:
    """Completes a deferred call from a fresh thread: XLA continues the program on the
    completing thread, and the engine's thread must go on with the next subgroups."""
    threading.Thread(target=completion, args=(error,), daemon=True,
                     name="jax_mlpo-update-complete").start()  # fmt: skip


def rows_of_subgroups(layout: Layout, rows_of_leaf: Sequence[int]) -> dict[int, set[int]]:
    """The rows of stacked leaves each subgroup holds a part of, by subgroup index (only those
    holding any): leaf ``k`` has ``rows_of_leaf[k]`` rows (0: not streamed by row)."""
    out: dict[int, set[int]] = {}
    for sg in layout.subgroups:
        for seg in sg.segments:
            rows = rows_of_leaf[seg.leaf]
            if rows <= 0 or seg.size == 0:
                continue
            per_row = max(1, int(np.prod(layout.shapes[seg.leaf], dtype=np.int64)) // rows)
            first, last = seg.leaf_start // per_row, (seg.leaf_start + seg.size - 1) // per_row
            out.setdefault(sg.index, set()).update(range(first, last + 1))
    return out


def row_rank(sg: Subgroup, rows: dict[int, set[int]]) -> int:
    """Where a subgroup comes within its group: by the first row it holds a part of (0 for a
    subgroup of no stacked leaf), so that the rows are updated in the scan's order."""
    return min(rows.get(sg.index, (0,)))


class RowBoard:
    """The rows of one streamed group's update in one round: which are updated, the receives
    waiting for them, and the send that stays pending until every row was taken.

    Each method is called under the owner's lock; ``complete`` hands a call back to XLA.

    Args:
      rows: the group's rows.
      complete: ``complete(completion, error)``.
    """

    def __init__(self, rows: int, complete: Complete) -> None:
        self.rows = rows
        self._complete = complete
        self._done: set[int] = set()
        self._waiting: dict[int, tuple[list[np.ndarray], Any]] = {}
        self._taken = 0
        self._sources: list[tuple[np.ndarray, np.ndarray]] | None = None  # (param, update)
        self._send: Any = None
        self.error: BaseException | None = None

    @property
    def taken(self) -> bool:
        """Whether every row was taken: the next receive or send starts a new board."""
        return self.rows > 0 and self._taken >= self.rows

    def sent(self, params: Sequence[np.ndarray], updates: Sequence[np.ndarray],
             completion: Any) -> None:  # fmt: skip
        """The send arrived: its param and update buffers (flat, the rows' source) and its
        completion.

        Raises:
          RuntimeError: a send of the same stream is still in flight (one compiled step run
            twice at once, on two states: their rows would mix).
        """
        if self._send is not None:
            raise RuntimeError(
                "jax_mlpo: two runs of one compiled overlapped step are in flight at once; "
                "run them one after another, or jit a step per optimizer state"
            )
        self._sources = list(zip(params, updates, strict=True))
        self._send = completion

    def updated(self, row: int) -> None:
        """The engine updated every subgroup holding a part of ``row``."""
        self._done.add(row)
        if row in self._waiting:
            outs, completion = self._waiting.pop(row)
            error = self._take(row, outs)
            self._complete(completion, error)
            if error is not None:
                self.fail(error)
                return
        if DRAIN in self._waiting and self.rows and len(self._done) >= self.rows:
            _, completion = self._waiting.pop(DRAIN)
            self._taken = self.rows
            self._complete(completion, None)
        self._finish()

    def receive(self, row: int, outs: list[np.ndarray], completion: Any) -> bool:
        """A receive of ``row`` (:data:`DRAIN`: every row): copies the row into ``outs`` if it
        is updated and returns False, else keeps the receive and returns True.

        Raises:
          BaseException: the round's error, if it failed.
          ValueError: ``row`` is not one of the group's rows.
        """
        if self.error is not None:
            raise self.error
        if row != DRAIN and self.rows and not 0 <= row < self.rows:
            raise ValueError(f"row {row} of stacked layers of {self.rows} rows")
        if row == DRAIN:
            if not self.rows or len(self._done) < self.rows:  # (no rows yet: before the send)
                self._waiting[DRAIN] = (outs, completion)
                return True
            self._taken = self.rows
            self._finish()
            return False
        if row not in self._done or self._sources is None:
            self._waiting[row] = (outs, completion)
            return True
        error = self._take(row, outs)
        if error is not None:  # the send and the other receives fail too: none waits for ever
            self.fail(error)
            raise error
        self._finish()
        return False

    def fail(self, error: BaseException) -> None:
        """The round failed: every waiting receive and the send fail with ``error``, and so
        does every later receive of this round."""
        self.error = error
        waiting, self._waiting = self._waiting, {}
        for _, completion in waiting.values():
            self._complete(completion, error)
        send, self._send = self._send, None
        if send is not None:
            self._complete(send, error)

    def _take(self, row: int, outs: list[np.ndarray]) -> BaseException | None:
        """Copies row ``row`` of each param, then of each update, into ``outs``."""
        try:
            assert self._sources is not None
            n = len(self._sources)
            if len(outs) != 2 * n:
                raise RuntimeError(f"a receive of {len(outs)} rows from a send of {n} leaves")
            for k, (param, update) in enumerate(self._sources):
                for out, source in ((outs[k], param), (outs[n + k], update)):
                    size = out.size
                    np.copyto(out, source[row * size : (row + 1) * size])
        except BaseException as e:  # noqa: BLE001 - the receive fails with it
            return e
        self._taken += 1
        return None

    def _finish(self) -> None:
        if self._taken >= self.rows and self._send is not None:
            send, self._send = self._send, None
            self._complete(send, None)


class RowBoards:
    """The boards of a process's streamed groups, by stream number, each for the round in
    flight; a receive that comes before its send makes the board the send then finds."""

    def __init__(self, complete: Complete = complete_later) -> None:
        self._complete = complete
        self._lock = threading.Lock()
        self._boards: dict[int, RowBoard] = {}

    def _board(self, stream: int, rows: int | None) -> RowBoard:
        """The board of ``stream``'s round in flight (``rows`` given: a send arrived). A round
        ends once every row was taken; a failed one only at the next send, so that each of
        its receives fails."""
        board = self._boards.get(stream)
        failed = board is not None and board.error is not None and rows is not None
        if board is None or board.taken or failed:
            board = self._boards[stream] = RowBoard(rows or 0, self._complete)
        elif rows is not None:
            board.rows = rows
        return board

    def sent(self, stream: int, rows: int, params: Sequence[np.ndarray],
             updates: Sequence[np.ndarray], completion: Any) -> None:  # fmt: skip
        with self._lock:
            self._board(stream, rows).sent(params, updates, completion)

    def updated(self, stream: int, row: int) -> None:
        with self._lock:
            self._board(stream, None).updated(row)

    def receive(self, stream: int, row: int, outs: list[np.ndarray], completion: Any) -> bool:
        with self._lock:
            return self._board(stream, None).receive(row, outs, completion)

    def fail(self, stream: int, error: BaseException) -> None:
        with self._lock:
            self._board(stream, None).fail(error)
