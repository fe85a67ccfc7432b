"""The host cache: page-aligned buffers (*slots*) that hold subgroups between tiers and optimizer.

Every slot holds at most one subgroup's ``[p | m | v]`` blob, in one of three ways:

- **dirty**: updated and kept, newer than its tier (retention across steps);
- **clean**: written back, still intact in a free slot (a hit until a read reuses the slot);
- **busy**: a read filling it or a write-back reading from it (the I/O pipeline's,
  :mod:`jax_mlpo.engine.buffers.pipeline`), neither dirty nor free.

A read takes an empty slot, or evicts the clean subgroup needed last in this step's order
(Belady), never one needed before the subgroup it reads. With the alternating order the
subgroups the last step wrote last are the first this step needs, so the whole cache is reused,
not only its dirty part: cache reuse with Belady eviction. All memory is allocated (and
touched) when the cache is made.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np

from jax_mlpo.tiers.posix import aligned_empty


def touched_buffer(n: int) -> np.ndarray:
    """A page-aligned float32 buffer of ``n`` elements, touched once now.

    Page-aligned so the tiers' O_DIRECT requests use it in place; touched now so that its page
    faults are not paid inside the first step.
    """
    buf = aligned_empty(n, np.float32)
    buf.fill(0.0)
    return buf


class SlotCache:
    """Slots caching subgroups: which are dirty, clean or free, and which a read evicts.

    Args:
      buffers: the slots (float32, page-aligned, each at least the largest blob).
      blob_elems: each subgroup's state length in float32.
      reuse_clean: whether written-back subgroups stay usable as clean hits.
      resident: subgroup -> slot of the subgroups dirty from the start (all of them for a
        host-only state).
    """

    def __init__(
        self,
        buffers: Sequence[np.ndarray],
        blob_elems: Sequence[int],
        *,
        reuse_clean: bool,
        resident: dict[int, int] | None = None,
    ) -> None:
        self.buffers = list(buffers)
        self._elems = list(blob_elems)
        self._reuse_clean = reuse_clean
        self.dirty: dict[int, int] = dict(resident or {})  # subgroup -> slot, newer than disk
        self.clean: dict[int, int] = {}  # subgroup -> free slot still holding it as written
        self._free: list[int] = []
        self._position: dict[int, int] = {}
        self._cursor = -1

    @property
    def blob_elems(self) -> list[int]:
        """Each subgroup's state length in float32."""
        return self._elems

    def blob(self, index: int, slot: int) -> np.ndarray:
        """Subgroup ``index``'s blob in ``slot``."""
        return self.buffers[slot][: self._elems[index]]

    @property
    def cursor(self) -> int:
        """The position in this step's order of the subgroup the step is at (-1: none yet)."""
        return self._cursor

    def holds(self, index: int) -> bool:
        """Whether subgroup ``index`` is resident (dirty or clean)."""
        return index in self.dirty or index in self.clean

    def begin_step(self, order: Sequence[int], busy: Collection[int]) -> None:
        """Starts a step that needs subgroups in ``order``; ``busy`` slots are in I/O."""
        self._position, self._cursor = {i: n for n, i in enumerate(order)}, -1
        taken = set(self.dirty.values()) | set(busy)
        self._free = [s for s in range(len(self.buffers)) if s not in taken]

    def reach(self, index: int) -> None:
        """Marks ``index`` as the subgroup the step is at (those before it are done)."""
        self._cursor = self._position[index]

    def hit(self, index: int) -> int | None:
        """Takes subgroup ``index``'s slot if it is resident (dirty or clean), else None."""
        if index in self.dirty:
            return self.dirty.pop(index)
        if index in self.clean:
            slot = self.clean.pop(index)
            self._free.remove(slot)
            return slot
        return None

    def keep(self, index: int, slot: int) -> None:
        """Keeps the updated subgroup ``index`` in ``slot``, dirty."""
        self.dirty[index] = slot

    def written(self, index: int, slot: int) -> None:
        """Frees ``slot`` once subgroup ``index``'s write-back from it has landed (a clean hit
        from then on, where clean reuse is on)."""
        self._free.append(slot)
        if self._reuse_clean:
            self.clean[index] = slot

    def give_back(self, slot: int) -> None:
        """Frees ``slot``, whose read was dropped before anything used it."""
        self._free.append(slot)

    def claim(self, index: int, *, evict_sooner: bool) -> int | None:
        """A free slot to read subgroup ``index`` into, taken from the free ones.

        An empty slot first, else the one whose clean subgroup is needed last (evicted).

        Args:
          index: the subgroup to read (in this step's order).
          evict_sooner: whether a clean subgroup needed before ``index`` may be evicted.

        Returns:
          The slot, or None: no free slot, or only by evicting a subgroup needed sooner.
        """
        holder = {slot: j for j, slot in self.clean.items()}
        best, best_key = None, -1.0
        for slot in self._free:
            j = holder.get(slot)
            key = math.inf if j is None else self._next_use(j)
            if key > best_key:
                best, best_key = slot, key
        if best is None or not (evict_sooner or best_key > self._position[index]):
            return None
        self._free.remove(best)
        j = holder.get(best)
        if j is not None:
            del self.clean[j]
        return best

    def dirty_needed_last(self) -> tuple[int, int] | None:
        """Takes the dirty subgroup needed last out of the cache, as ``(index, slot)``; None if
        there is none. Its slot is busy until the caller has written it back."""
        if not self.dirty:
            return None
        j = max(self.dirty, key=self._next_use)
        return j, self.dirty.pop(j)

    def free_buffers(self, busy: Collection[int]) -> list[np.ndarray]:
        """The buffers holding no dirty subgroup and not ``busy``, emptied of their clean ones,
        for work between steps."""
        self.clean.clear()
        taken = set(self.dirty.values()) | set(busy)
        return [b for slot, b in enumerate(self.buffers) if slot not in taken]

    def position(self, index: int) -> int:
        """Where subgroup ``index`` is in this step's order."""
        return self._position[index]

    def needed_after(self, j: int, index: int) -> bool:
        """Whether this step needs subgroup ``j`` after subgroup ``index``."""
        return self._position[j] > self._position[index]

    def _next_use(self, index: int) -> float:
        n = self._position[index]
        return n if n > self._cursor else math.inf  # updated already: needed next step at most
