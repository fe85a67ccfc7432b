"""The host update pipeline: make a subgroup resident, run AdamW on it, write it back.

Reads of the next subgroups are in flight while the current one computes, and write-backs drain
behind it. The subgroups the next step starts with stay in host memory across the step boundary
(retention; the whole state when it fits the host budget). Subgroups live on tiers placed by
the bandwidth model, re-planned online. All host memory the pipeline uses is allocated (and
touched) once, when the engine is created.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from jax_mlpo import kernels, native, placement, scheduler
from jax_mlpo.config import ConfigError, OffloadConfig
from jax_mlpo.kernels import BF16, F32, AdamWHyper
from jax_mlpo.layout import Layout, Subgroup
from jax_mlpo.metrics import StepMetrics
from jax_mlpo.tiers.file import FileTierStore, TierIOError
from jax_mlpo.tiers.permits import TierPermits
from jax_mlpo.tiers.posix import aligned_empty

logger = logging.getLogger(__name__)


class StaleStateError(RuntimeError):
    """The optimizer state handed to update is not the one the host state was last advanced to."""


# A tier's (bytes read, bytes written, busy seconds) so far.
TierCounters = tuple[int, int, float]


class EngineFailedError(RuntimeError):
    """A previous update failed midway; the host state is not consistent any more."""


def _split(sg: Subgroup, blob: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Views of a subgroup's blob: the fp32 master p (or None), m and v."""
    n = sg.size
    if sg.has_master:
        return blob[:n], blob[n : 2 * n], blob[2 * n : 3 * n]
    return None, blob[:n], blob[n : 2 * n]


def _remove(buffers: list[np.ndarray], buf: np.ndarray) -> None:
    """Removes ``buf`` itself (not an equal array) from ``buffers``."""
    del buffers[next(k for k, b in enumerate(buffers) if b is buf)]


def _touched(n: int) -> np.ndarray:
    buf = aligned_empty(n, F32)  # page-aligned: the tiers' O_DIRECT requests use it in place
    buf.fill(0.0)  # first touch now, not inside the first step
    return buf


class Engine:
    """Owns the AdamW state of one params pytree, in host memory and file tiers.

    Args:
      layout: the subgroups of the params.
      config: the offload configuration (already validated).
      b1, b2, eps, weight_decay: AdamW hyper-parameters fixed for the run.

    Raises:
      ConfigError: if the host cache cannot hold the pipeline's buffers, or the state does not
        fit in the host cache and no tier is configured.
    """

    def __init__(
        self,
        layout: Layout,
        config: OffloadConfig,
        *,
        b1: float,
        b2: float,
        eps: float,
        weight_decay: float,
    ) -> None:
        self.layout = layout
        self.config = config
        self._weight_decay = float(weight_decay)
        self.step_count = 0
        self.metrics: collections.deque[StepMetrics] = collections.deque(maxlen=100_000)
        self._failed: BaseException | None = None
        self._closed = False
        self._kernel = kernels.native_adamw_step()
        sgs = layout.subgroups
        # subgroup -> its buffer, for subgroups resident in host memory (dirty: newer than disk)
        self._cache: dict[int, np.ndarray] = {}
        # subgroup -> a free buffer still holding its state as last written (clean)
        self._clean: dict[int, np.ndarray] = {}
        # write-backs still in flight after the last update returned (write_behind)
        self._writes: collections.deque = collections.deque()  # (future, buffer, subgroup)
        # the tiers' counters when the last update's figures were taken: what moves after it
        # (its write-behind) is added to that update's figures by the next update or drain
        self._io_mark: list[TierCounters] | None = None
        self.tiers: list[FileTierStore] = []
        self.tier_of: list[int] = []  # where each subgroup's blob is on disk
        self._target: list[int] = []  # where it goes on its next write-back (re-planning)
        self._retain_counts: list[int] = []
        self._buffers: list[np.ndarray] = []
        self._grad_buffers: dict[int, np.ndarray] = {}  # id(state buffer) -> its grad buffer
        self.host_only = layout.state_bytes <= config.host_cache
        if self.host_only:
            self._cache = {sg.index: _touched(sg.state_elems) for sg in sgs}
        else:
            try:
                self._open_tiers()
            except BaseException:
                self.close()
                raise
        self._outs_shaped = [np.zeros(shape, F32) for shape in layout.shapes]
        self._outs = [out.reshape(-1) for out in self._outs_shaped]
        # Host buffers the device copies gradients and params into (XLA FFI copies; see
        # transform.py); gradient buffers follow the gradients' dtypes, known at the update.
        # flat views, as the kernel reads them, made once
        self._staged_params = [np.zeros(shape, dt).reshape(-1) for shape, dt in zip(
            layout.shapes, layout.dtypes, strict=True)]  # fmt: skip
        self._staged_grads: list[np.ndarray] = []
        self._stage_descriptors = np.zeros((2 * len(layout.shapes), 4), np.uint32)
        self.out_descriptors = np.stack(
            [native.host_descriptor(x) if x.size else np.zeros(4, np.uint32) for x in self._outs]
            or [np.zeros(4, np.uint32)]
        )
        self._strikes = [0] * len(self.tiers)
        self._ratio_sum = [0.0] * len(self.tiers)
        logger.info(
            "jax_mlpo engine: %d params in %d subgroups (%.1f MiB of state); %s",
            layout.num_params,
            len(sgs),
            layout.state_bytes / 2**20,
            "all in host memory"
            if self.host_only
            else f"{len(self._buffers)} host buffers, {sum(self._retain_counts)} retained across "
            f"steps, tiers {[self.tier_of.count(k) for k in range(len(self.tiers))]} subgroups",
        )

    def staging(self, grad_dtypes: Sequence[np.dtype]) -> np.ndarray:
        """Descriptors (``uint32[2 * leaves, 4]``) of the host buffers the next update's
        gradients (first) and params are copied into; zero rows for empty leaves."""
        if [g.dtype for g in self._staged_grads] != [np.dtype(d) for d in grad_dtypes]:
            self._staged_grads = [
                np.zeros(shape, dt).reshape(-1)
                for shape, dt in zip(self.layout.shapes, grad_dtypes, strict=True)
            ]
            for k, x in enumerate(self._staged_grads + self._staged_params):
                if x.size:
                    self._stage_descriptors[k] = native.host_descriptor(x)
        return self._stage_descriptors

    def step_staged(self, count: int, hyper: AdamWHyper) -> np.ndarray:
        """:meth:`step` on the staged gradients and params; returns the update's descriptors."""
        self.step(count, hyper, self._staged_grads, self._staged_params)
        return self.out_descriptors

    @property
    def failed(self) -> bool:
        """Whether an update failed midway (the host state is then partly updated)."""
        return self._failed is not None

    def _open_tiers(self) -> None:
        layout, config = self.layout, self.config
        sgs = layout.subgroups
        if not config.tiers:
            raise ConfigError(
                f"host_cache={config.host_cache} bytes cannot hold the optimizer state "
                f"({layout.state_bytes} bytes) and no tiers are configured: add a FileTier, or "
                f"raise host_cache to at least {layout.state_bytes}"
            )
        tiers = config.tiers[:1] if config.placement == "first" else config.tiers
        grad_elems = 0 if config.delayed_conversion else max(sg.size for sg in sgs)
        per_buffer = 4 * (layout.max_state_elems + grad_elems)
        minimum = config.prefetch_depth * len(tiers) + 2
        if config.host_cache < minimum * per_buffer:
            # the whole state in host memory needs no pipeline, and may be the smaller fix
            needed = min(minimum * per_buffer, layout.state_bytes)
            raise ConfigError(
                f"host_cache={config.host_cache} bytes is smaller than the pipeline's buffers: "
                f"(prefetch_depth {config.prefetch_depth} x {len(tiers)} tier(s) + 2) x "
                f"{per_buffer} bytes per subgroup = {minimum * per_buffer} bytes. Raise "
                f"host_cache to at least {needed}, or lower subgroup_size or prefetch_depth."
            )
        buffers = config.host_cache // per_buffer
        if not config.retain:
            retained = 0
        elif config.order == "alternate":
            # Every buffer: the next step starts with the subgroups this one ends with, so each
            # buffer's subgroup is updated again before any read needs the buffer, and writing
            # it back at the end of this step would only write it twice (measured: 20% fewer
            # bytes written per step than keeping only the buffers beyond the pipeline, in the
            # same time on one disk; experiments/results/retain_all.txt).
            retained = min(buffers, len(sgs))
        else:  # the next step starts elsewhere: the pipeline's buffers must be free then
            retained = min(buffers - minimum, len(sgs))
        kinds = {"state": [sg.state_elems for sg in sgs]}
        if not config.delayed_conversion:
            kinds["grad"] = [sg.size for sg in sgs]
        probe_elems = min(layout.max_state_elems, 8 * 2**20)
        if config.placement == "measured":
            kinds["probe"] = [probe_elems] * 4
        for tier in tiers:
            permits = TierPermits(
                tier.permits_key or tier.path,
                tier.max_concurrency,
                tier.max_concurrency,
                config.node_permits_dir if tier.node_max_concurrency else None,
                tier.node_max_concurrency or 1,
                tier.node_max_concurrency or 1,
                node_shared=tier.node_permits == "tier",
            )
            self.tiers.append(FileTierStore(tier, kinds, permits, config.node_permits_dir))
        if config.placement == "measured":
            self.bandwidth = [self._bandwidth(store, probe_elems) for store in self.tiers]
        else:
            self.bandwidth = [(1.0, 1.0)] * len(self.tiers)
        self._retain_counts = placement.retained_per_tier(
            self._effective(), retained, config.retain_policy
        )
        self.tier_of = self._plan()
        self._target = list(self.tier_of)
        self._buffers = [_touched(layout.max_state_elems) for _ in range(buffers)]
        if grad_elems:
            self._grad_buffers = {id(b): _touched(grad_elems) for b in self._buffers}
        self._write_initial_state()

    @staticmethod
    def _bandwidth(store: FileTierStore, probe_elems: int) -> tuple[float, float]:
        tier = store.tier
        if tier.read_bandwidth and tier.write_bandwidth:
            return float(tier.read_bandwidth), float(tier.write_bandwidth)
        read, write = placement.cached_probe(store, probe_elems)
        return float(tier.read_bandwidth or read), float(tier.write_bandwidth or write)

    def _effective(self) -> list[float]:
        return [placement.effective_bandwidth(r, w) for r, w in self.bandwidth]

    def _plan(self) -> list[int]:
        counts = placement.tier_counts(
            len(self.layout.subgroups), self._effective(), self._retain_counts
        )
        return placement.interleave(counts)

    def _write_initial_state(self) -> None:
        zeros = self._buffers[0]
        zeros.fill(0.0)
        futures = [
            self.tiers[t].write(i, zeros[: self.layout.subgroups[i].state_elems])
            for i, t in enumerate(self.tier_of)
        ]
        for f in futures:
            f.result()

    # -- the update ---------------------------------------------------------------------------

    def step(
        self,
        count: int,
        hyper: AdamWHyper,
        grads: Sequence[np.ndarray],
        params: Sequence[np.ndarray],
    ) -> list[np.ndarray]:
        """Runs one AdamW update over every subgroup.

        Args:
          count: the optimizer step count in the state handed to update (0 for the first).
          hyper: the step's scalars; its ``weight_decay`` is ignored (the layout's mask decides).
          grads: the gradient leaves, flattened (float32 or bfloat16).
          params: the param leaves, flattened (float32 or bfloat16).

        Returns:
          The float32 update per leaf, in buffers the next step overwrites (the callback that
          returns them copies them out).

        Raises:
          StaleStateError: if ``count`` is not the step the host state is at.
          EngineFailedError: if an earlier update failed midway.
        """
        if self._closed:
            raise EngineFailedError("this optimizer was closed (jax_mlpo.close); init a new one")
        if self._failed is not None:
            raise EngineFailedError(
                f"an earlier update failed midway ({self._failed!r}), so the offloaded state is "
                "partly updated. Restore from your last checkpoint and init a new optimizer."
            ) from self._failed
        if count != self.step_count:
            raise StaleStateError(
                f"update was called with an optimizer state at step {count}, but the offloaded "
                f"state is at step {self.step_count}. jax_mlpo keeps AdamW's state on the host "
                "and advances it on every update, so each update must receive the state returned "
                "by the previous one. A wrapper that computes an update and then discards it "
                "(optax.MultiSteps, a retried or skipped step) cannot be used around it."
            )
        self._check_leaves(grads, params)
        decay = hyper._replace(weight_decay=self._weight_decay)
        no_decay = hyper._replace(weight_decay=0.0)
        metrics = StepMetrics(step=count + 1)
        self._count_late_io()
        before = self._io_mark
        order = scheduler.step_order(len(self.layout.subgroups), count, self.config.order)
        retain = (
            set(order)
            if self.host_only
            else scheduler.retain_set(order, self.tier_of, self._retain_counts)
        )
        t_start = time.monotonic()
        try:
            if not self.config.delayed_conversion and not self.host_only:
                self._write_gradients(order, grads, metrics)
                metrics.grad_write_s = time.monotonic() - t_start
            self._run(order, retain, grads, params, (no_decay, decay), count == 0, metrics)
        except BaseException as e:
            self._failed = e
            raise
        metrics.total_s = time.monotonic() - t_start
        self._io_mark = self._tier_counters()
        self._add_tier_io(metrics, before, self._io_mark)
        self.metrics.append(metrics)
        self.step_count += 1
        if self.config.replan and self.config.placement == "measured":
            self._check_model(metrics)
        return self._outs_shaped

    def _check_leaves(self, grads: Sequence[np.ndarray], params: Sequence[np.ndarray]) -> None:
        shapes = self.layout.shapes
        if len(grads) != len(shapes) or len(params) != len(shapes):
            raise ValueError(
                f"update got {len(grads)} gradient and {len(params)} param leaves; the optimizer "
                f"was initialised with {len(shapes)}"
            )
        for i, (g, p) in enumerate(zip(grads, params, strict=True)):
            size = int(np.prod(shapes[i], dtype=np.int64))
            if g.size != size or p.size != size:
                raise ValueError(f"leaf {i}: expected {size} elements, got {g.size}/{p.size}")
            if g.dtype not in (F32, BF16):
                raise ValueError(f"leaf {i}: gradients must be float32 or bfloat16, got {g.dtype}")
            if p.dtype != self.layout.dtypes[i]:
                raise ValueError(
                    f"leaf {i}: param dtype {p.dtype} differs from {self.layout.dtypes[i]} at init"
                )

    def _write_gradients(self, order, grads, metrics: StepMetrics) -> None:
        """The baseline's gradient path: fp32 gradients to the tier before the update."""
        free = collections.deque(self._grad_buffers.values())
        pending: collections.deque = collections.deque()
        for i in order:
            if i in self._cache:
                continue
            if not free:
                future, buf, j = pending.popleft()
                self._result(future, j)
                free.append(buf)
            sg = self.layout.subgroups[i]
            full = free.popleft()
            buf = full[: sg.size]
            t0 = time.monotonic()
            for seg in sg.segments:
                leaf = slice(seg.leaf_start, seg.leaf_start + seg.size)
                buf[seg.start : seg.start + seg.size] = grads[seg.leaf][leaf]
            metrics.compute_s += time.monotonic() - t0
            pending.append((self.tiers[self.tier_of[i]].write(i, buf, kind="grad"), full, i))
        t0 = time.monotonic()
        for future, _, j in pending:
            self._result(future, j)
        metrics.write_wait_s += time.monotonic() - t0

    def _run(self, order, retain, grads, params, hypers, init_master, metrics) -> None:
        """The pipeline of one step: reads ahead, updates in ``order``, writes back.

        Host buffers are a cache of subgroups: dirty retained ones (``self._cache``, not on disk
        yet) and, with retention and delayed conversion, clean ones (``self._clean``: written
        back, still in a free buffer). Either is updated without a read. A read takes an empty
        buffer, or evicts the clean subgroup needed last (Belady), never one needed before the
        subgroup it reads. With the alternating order the subgroups the last step wrote last
        are the first this step needs, so the whole cache is reused, not just the retained part.
        """
        sgs = self.layout.subgroups
        delayed = self.config.delayed_conversion or self.host_only
        reuse = delayed and self.config.retain
        clean = self._clean
        position = {i: n for n, i in enumerate(order)}
        cursor = -1  # position in order of the subgroup being updated
        cached_ids = {id(b) for b in self._cache.values()}
        free = [b for b in self._buffers if id(b) not in cached_ids]
        reads: dict[int, tuple[list[concurrent.futures.Future], np.ndarray]] = {}
        writes = self._writes  # the last step's write-behind first
        free = [b for b in free if all(b is not w[1] for w in writes)]

        def reclaim(block: bool) -> None:
            while writes and (block or writes[0][0].done()):
                t0 = time.monotonic()
                i, buf = self._reclaim_one()
                metrics.write_wait_s += time.monotonic() - t0
                free.append(buf)
                if reuse:
                    clean[i] = buf
                block = False

        def next_use(j: int) -> float:
            n = position[j]
            return n if n > cursor else math.inf  # updated already: needed next step at most

        def take(u: int, block: bool) -> np.ndarray | None:
            """A buffer to read subgroup ``u`` into (None: only by evicting something sooner)."""
            reclaim(block=False)
            while True:
                holder = {id(buf): j for j, buf in clean.items()}  # clean buffer -> subgroup
                best, best_key = None, -1.0
                for buf in free:
                    j = holder.get(id(buf))
                    key = math.inf if j is None else next_use(j)
                    if key > best_key:
                        best, best_key = buf, key
                if best is not None and (block or best_key > position[u]):
                    break
                if not block:
                    return None
                if writes:
                    reclaim(block=True)
                elif not evict_kept():
                    return None
            _remove(free, best)
            j = holder.get(id(best))
            if j is not None:
                del clean[j]
            return best

        def evict_kept() -> bool:
            """Writes back the kept subgroup needed last and frees its buffer (False: none).

            Only when every buffer holds a kept (dirty) subgroup and no write is in flight: a
            tier that retains nothing (``retain_policy="slow_tiers"``) can need a read before
            any kept subgroup is written back.
            """
            if not self._cache:
                return False
            j = max(self._cache, key=next_use)
            buf = self._cache.pop(j)
            self.tier_of[j] = self._target[j]
            writes.append((self.tiers[self.tier_of[j]].write(j, buf[: sgs[j].state_elems]), buf, j))
            reclaim(block=True)
            return True

        def issue(u: int, block: bool) -> bool:
            buf = take(u, block)
            if buf is None:
                return False
            store = self.tiers[self.tier_of[u]]
            futures = [store.read(u, buf[: sgs[u].state_elems])]
            if not delayed:
                grad = self._grad_buffers[id(buf)][: sgs[u].size]
                futures.append(store.read(u, grad, kind="grad"))
            reads[u] = (futures, buf)
            return True

        def in_flight(tier: int) -> int:
            return sum(1 for j in reads if self.tier_of[j] == tier)

        def writing(j: int) -> bool:
            return any(w[2] == j for w in writes)

        try:
            for cursor, i in enumerate(order):
                while writing(i):  # the last step's write-back of i: its buffer is a hit then
                    reclaim(block=True)
                hit = True
                if i in self._cache:
                    buf = self._cache.pop(i)
                    futures = []
                elif i in clean:
                    buf = clean.pop(i)
                    _remove(free, buf)
                    futures = []
                else:
                    hit = False
                    if i not in reads and not issue(i, block=True):
                        raise RuntimeError(f"jax_mlpo: no host buffer for subgroup {i}")
                    futures, buf = reads.pop(i)
                metrics.cache_hits += hit
                for j in itertools.islice(order, cursor + 1, None):  # prefetch_depth per tier
                    if j in self._cache or j in clean or j in reads or writing(j):
                        continue
                    if in_flight(self.tier_of[j]) >= self.config.prefetch_depth:
                        break
                    if not issue(j, block=False):
                        break
                t0 = time.monotonic()
                for future in futures:
                    self._result(future, i)
                metrics.read_wait_s += time.monotonic() - t0
                t0 = time.monotonic()
                # a hit's gradient comes from this step's grads (the baseline path re-reads
                # only the gradients of subgroups it reads from a tier)
                grad_blob = None if delayed or hit else self._grad_buffers[id(buf)][: sgs[i].size]
                self._update_subgroup(sgs[i], buf, grads, grad_blob, params, hypers, init_master)
                metrics.compute_s += time.monotonic() - t0
                metrics.subgroups += 1
                if i in retain:
                    self._cache[i] = buf
                else:
                    self.tier_of[i] = self._target[i]  # a re-planned subgroup moves here
                    store = self.tiers[self.tier_of[i]]
                    writes.append((store.write(i, buf[: sgs[i].state_elems]), buf, i))
                reclaim(block=False)
            if not self.config.write_behind:
                while writes:
                    reclaim(block=True)
            # else the remaining writes finish while the caller runs; their buffers stay busy
            # (and out of the clean cache) until the next step reclaims them
        except BaseException:
            clean.clear()
            # Let nothing outlive the step: a read or write still running would touch buffers.
            pending = [f for futures, _ in reads.values() for f in futures]
            pending += [f for f, _, _ in writes]
            for f in pending:
                f.cancel()
            writes.clear()
            # a hung tier is abandoned after the timeout: the engine is failed from here on
            concurrent.futures.wait(pending, timeout=self.config.io_timeout_s)
            raise

    def _tier_counters(self) -> list[TierCounters]:
        return [(t.bytes_read, t.bytes_written, t.busy_s) for t in self.tiers]

    def _add_tier_io(
        self, metrics: StepMetrics, before: list[TierCounters], after: list[TierCounters]
    ) -> None:
        """Adds each tier's bytes and busy time between two ``_tier_counters`` to ``metrics``."""
        for tier, (r0, w0, b0), (r1, w1, b1) in zip(self.tiers, before, after, strict=True):
            path = tier.tier.path
            metrics.bytes_read[path] = metrics.bytes_read.get(path, 0) + r1 - r0
            metrics.bytes_written[path] = metrics.bytes_written.get(path, 0) + w1 - w0
            metrics.tier_busy_s[path] = metrics.tier_busy_s.get(path, 0.0) + b1 - b0

    def _count_late_io(self) -> None:
        """Adds the tier I/O since the last update's figures were taken to them.

        Between two updates the tiers only finish the last one's write-behind (flush, state
        dict and load move their own bytes after a drain and then reset the mark), so a step's
        figures hold all its writes, whether they ended inside it, during the caller's work or
        in a drain.
        """
        now = self._tier_counters()
        if self.metrics and self._io_mark is not None:
            self._add_tier_io(self.metrics[-1], self._io_mark, now)
        self._io_mark = now

    def _reclaim_one(self) -> tuple[int, np.ndarray]:
        """Waits for the oldest write-back in flight (falling back on a full tier)."""
        future, buf, i = self._writes.popleft()
        try:
            self._result(future, i)
        except TierIOError as e:
            if not self._fall_back(i, buf[: self.layout.subgroups[i].state_elems], e):
                raise
        return i, buf

    def drain(self) -> None:
        """Waits for the write-backs the last update left in flight (``write_behind``).

        Raises:
          TierIOError: if one failed (and no other tier took it); the engine is failed then.
        """
        if not self._writes:
            return
        t0 = time.monotonic()
        try:
            while self._writes:
                i, buf = self._reclaim_one()
                if self.config.retain and self.config.delayed_conversion:
                    self._clean[i] = buf
            if self.metrics:  # the last step's figures include its late write-backs
                last = self.metrics[-1]
                last.write_wait_s += time.monotonic() - t0
                last.total_s += time.monotonic() - t0
            self._count_late_io()
        except BaseException as e:
            self._failed = e
            self._clean.clear()
            pending = [f for f, _, _ in self._writes]
            self._writes.clear()
            concurrent.futures.wait(pending, timeout=self.config.io_timeout_s)
            raise

    def _fall_back(self, index: int, blob: np.ndarray, error: TierIOError) -> bool:
        """Writes a subgroup whose tier is full to another tier; False if none takes it.

        The blob left behind on the full tier is never read again (``tier_of`` moves), and the
        buffer still holds the subgroup's state, so nothing is lost.
        """
        if not self.config.fallback_on_full or "No space left" not in str(error):
            return False
        full = self.tier_of[index]
        for k, store in enumerate(self.tiers):
            if k == full:
                continue
            try:
                self._result(store.write(index, blob), index)
            except TierIOError:
                continue
            self.tier_of[index] = self._target[index] = k
            logger.warning(
                "jax_mlpo: tier %r is full; subgroup %d moved to tier %r",
                self.tiers[full].tier.path, index, store.tier.path,
            )  # fmt: skip
            return True
        return False

    def _check_model(self, metrics: StepMetrics) -> None:
        """Re-plans when a tier's I/O time stays > 25% off the bandwidth model for 3 steps.

        The tiers' bandwidths are rescaled by the mean ratio of observed to modelled time over
        those steps. Subgroups move only if the new plan cuts the slowest tier's modelled time
        by more than 10%: moving costs I/O, and latency-bound tiers (small blobs) would
        otherwise make the plan swing back and forth.
        """
        ratios = []
        for k, store in enumerate(self.tiers):
            path = store.tier.path
            read_bw, write_bw = self.bandwidth[k]
            model = metrics.bytes_read[path] / read_bw + metrics.bytes_written[path] / write_bw
            observed = metrics.tier_busy_s[path]
            ratio = observed / model if model > 0 else 1.0
            ratios.append(ratio)
            off = abs(ratio - 1.0) > 0.25
            self._strikes[k] = self._strikes[k] + 1 if off else 0
            self._ratio_sum[k] = self._ratio_sum[k] + ratio if off else 0.0
        if max(self._strikes, default=0) < 3:
            return
        scale = [total / n if n else 1.0 for total, n in zip(self._ratio_sum, self._strikes,
                                                              strict=True)]  # fmt: skip
        self.bandwidth = [(r / q, w / q) for (r, w), q in zip(self.bandwidth, scale, strict=True)]
        self._strikes = [0] * len(self.tiers)
        self._ratio_sum = [0.0] * len(self.tiers)
        plan = self._plan()
        before, after = self._slowest_tier_time(self._target), self._slowest_tier_time(plan)
        moves = sum(a != b for a, b in zip(plan, self._target, strict=True))
        if moves and after < 0.9 * before:
            self._target = plan
        else:
            moves = 0
        logger.log(
            logging.INFO if moves else logging.DEBUG,
            "jax_mlpo: tier I/O time %s the model; bandwidths rescaled, %d subgroup(s) migrate",
            ", ".join(f"{q:.2f}x" for q in scale),
            moves,
        )

    def _slowest_tier_time(self, tier_of: Sequence[int]) -> float:
        """Modelled per-step I/O time of the busiest tier if subgroups lived at ``tier_of``."""
        time_of = [0.0] * len(self.tiers)
        retained = scheduler.retain_set(
            range(len(tier_of)), tier_of, self._retain_counts
        )  # same count either way the order runs
        for i, k in enumerate(tier_of):
            if i not in retained:
                read_bw, write_bw = self.bandwidth[k]
                nbytes = self.layout.subgroups[i].state_bytes
                time_of[k] += nbytes / read_bw + nbytes / write_bw
        return max(time_of, default=0.0)

    def _result(self, future: concurrent.futures.Future, index: int) -> None:
        timeout = self.config.io_timeout_s
        try:
            future.result(timeout=timeout)
        except TierIOError as e:
            raise type(e)(f"subgroup {index}: {e}") from e
        except concurrent.futures.TimeoutError:
            where = self.tiers[self.tier_of[index]].tier.path if self.tier_of else "?"
            raise TierIOError(
                f"subgroup {index}: tier {where!r} did not complete a request within "
                f"io_timeout_s={timeout} s. The file system may be hung or overloaded: check "
                "it, or raise io_timeout_s if it is just slow."
            ) from None

    def _update_subgroup(
        self,
        sg: Subgroup,
        blob: np.ndarray,
        grads: Sequence[np.ndarray],
        grad_blob: np.ndarray | None,
        params: Sequence[np.ndarray],
        hypers: tuple[AdamWHyper, AdamWHyper],
        init_master: bool,
    ) -> None:
        p, m, v = _split(sg, blob)
        for seg in sg.segments:
            s = slice(seg.start, seg.start + seg.size)
            leaf = slice(seg.leaf_start, seg.leaf_start + seg.size)
            param = params[seg.leaf][leaf]
            hyper = hypers[seg.decay]
            out = self._outs[seg.leaf][leaf]
            grad = grads[seg.leaf][leaf] if grad_blob is None else grad_blob[s]
            if seg.master:
                master = p[s]
                if init_master:  # the fp32 master starts as the exact value of the bf16 params
                    master[...] = param.astype(F32)
                self._kernel(
                    m[s], v[s], grad, master, out, hyper,
                    update_param=True, delta_base=param,
                )  # fmt: skip
            else:
                self._kernel(m[s], v[s], grad, param, out, hyper)

    # -- state in the logical layout (checkpoints) ------------------------------------------

    def _blobs(self):
        """Yields (subgroup, blob) for every subgroup, reading the ones on tiers."""
        self.drain()
        scratch = aligned_empty(self.layout.max_state_elems, F32)
        for sg in self.layout.subgroups:
            if sg.index in self._cache:
                yield sg, self._cache[sg.index]
                continue
            blob = scratch[: sg.state_elems]
            self._result(self.tiers[self.tier_of[sg.index]].read(sg.index, blob), sg.index)
            yield sg, blob
        self._io_mark = self._tier_counters()  # these reads belong to no update

    def state_dict(self) -> dict[str, list[np.ndarray]]:
        """AdamW's state per parameter leaf, independent of subgroups and tiers.

        Returns:
          ``{"mu": [...], "nu": [...], "master": [...]}``, float32 arrays of each leaf's shape
          (``master`` holds the fp32 master copy of bfloat16 leaves and None for float32 ones,
          whose master copy is the params themselves).
        """
        self._check_usable()
        out = {
            name: [np.zeros(shape, F32) for shape in self.layout.shapes] for name in ("mu", "nu")
        }
        out["master"] = [
            np.zeros(shape, F32) if dt == BF16 else None
            for shape, dt in zip(self.layout.shapes, self.layout.dtypes, strict=True)
        ]
        for sg, blob in self._blobs():
            p, m, v = _split(sg, blob)
            for seg in sg.segments:
                s = slice(seg.start, seg.start + seg.size)
                leaf = slice(seg.leaf_start, seg.leaf_start + seg.size)
                out["mu"][seg.leaf].reshape(-1)[leaf] = m[s]
                out["nu"][seg.leaf].reshape(-1)[leaf] = v[s]
                if seg.master:
                    out["master"][seg.leaf].reshape(-1)[leaf] = p[s]
        return out

    def load_state_dict(self, step: int, state: dict[str, list[np.ndarray | None]]) -> None:
        """Replaces AdamW's state with ``state`` (as :meth:`state_dict` gives it) at ``step``.

        Raises:
          ValueError: if the leaves' shapes differ from the layout's.
        """
        self._check_usable()
        for name in ("mu", "nu"):
            shapes = tuple(tuple(np.shape(x)) for x in state[name])
            if shapes != self.layout.shapes:
                raise ValueError(f"{name}: leaf shapes {shapes} differ from {self.layout.shapes}")
        sgs = self.layout.subgroups
        self.drain()
        self._clean.clear()  # the tiers are about to hold other state
        scratch = aligned_empty(self.layout.max_state_elems, F32)
        for sg in sgs:
            blob = self._cache.get(sg.index, scratch)
            p, m, v = _split(sg, blob)
            for seg in sg.segments:
                s = slice(seg.start, seg.start + seg.size)
                leaf = slice(seg.leaf_start, seg.leaf_start + seg.size)
                m[s] = np.asarray(state["mu"][seg.leaf], F32).reshape(-1)[leaf]
                v[s] = np.asarray(state["nu"][seg.leaf], F32).reshape(-1)[leaf]
                if seg.master:
                    master = state["master"][seg.leaf]
                    if master is None:
                        raise ValueError(f"leaf {seg.leaf} is bfloat16 but has no master copy")
                    p[s] = np.asarray(master, F32).reshape(-1)[leaf]
            if sg.index not in self._cache:
                store = self.tiers[self.tier_of[sg.index]]
                self._result(store.write(sg.index, blob[: sg.state_elems]), sg.index)
        self._io_mark = self._tier_counters()  # these writes belong to no update
        self.step_count = int(step)

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineFailedError("this optimizer was closed (jax_mlpo.close); init a new one")
        if self._failed is not None:
            raise EngineFailedError(
                f"an earlier update failed midway ({self._failed!r}); its state is inconsistent"
            ) from self._failed

    def flush(self) -> None:
        """Writes the subgroups retained in host memory to their tiers (they stay cached)."""
        if self.host_only or self._failed is not None:
            return
        self.drain()
        futures = [
            (self.tiers[self.tier_of[i]].write(i, buf[: self.layout.subgroups[i].state_elems]), i)
            for i, buf in self._cache.items()
        ]
        for future, i in futures:
            self._result(future, i)
        self._io_mark = self._tier_counters()  # these writes belong to no update

    def close(self) -> None:
        """Flushes retained subgroups, waits for in-flight I/O, releases the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.tiers:
                self.flush()
        finally:
            for tier in self.tiers:
                tier.close()
            self.tiers = []
