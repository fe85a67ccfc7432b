"""The host update pipeline: make a subgroup resident, run AdamW on it, write it back.

Reads of the next subgroups are in flight while the current one computes, and write-backs drain
behind it. Subgroups that fit in the host cache stay resident and are neither read nor written.
All host memory the pipeline uses is allocated (and touched) once, when the engine is created.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Sequence

import numpy as np

from jax_mlpo import kernels
from jax_mlpo.config import ConfigError, OffloadConfig
from jax_mlpo.kernels import BF16, F32, AdamWHyper
from jax_mlpo.layout import Layout, Subgroup
from jax_mlpo.metrics import StepMetrics
from jax_mlpo.tiers.file import FileTierStore, TierIOError

logger = logging.getLogger(__name__)


class StaleStateError(RuntimeError):
    """The optimizer state handed to update is not the one the host state was last advanced to."""


class EngineFailedError(RuntimeError):
    """A previous update failed midway; the host state is not consistent any more."""


def _touched(n: int) -> np.ndarray:
    buf = np.empty(n, F32)
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
        self._static = dict(b1=float(b1), b2=float(b2), eps=float(eps))
        self._weight_decay = float(weight_decay)
        self.step_count = 0
        self.metrics: collections.deque[StepMetrics] = collections.deque(maxlen=100_000)
        self._failed: BaseException | None = None
        self._closed = False
        self._kernel = kernels.adamw_step

        self.resident, spilled = self._plan_cache(layout, config)
        self.tiers: list[FileTierStore] = []
        # subgroup index -> (tier number, slot); interleaved so consecutive reads hit all tiers
        self.placement: dict[int, tuple[int, int]] = {}
        self._cache = {i: _touched(layout.subgroups[i].state_elems) for i in sorted(self.resident)}
        self._buffers: list[np.ndarray] = []
        if spilled:
            per_tier: list[list[int]] = [[] for _ in config.tiers]
            for k, i in enumerate(spilled):
                per_tier[k % len(config.tiers)].append(i)
            try:
                for tier, members in zip(config.tiers, per_tier, strict=True):
                    if not members:
                        continue
                    elems = [layout.subgroups[i].state_elems for i in members]
                    self.tiers.append(FileTierStore(tier, elems))
                    for slot, i in enumerate(members):
                        self.placement[i] = (len(self.tiers) - 1, slot)
                depth = config.prefetch_depth + 2
                self._buffers = [_touched(layout.max_state_elems) for _ in range(depth)]
                self._write_initial_state()
            except BaseException:
                self.close()
                raise
        self._outs_shaped = [np.zeros(shape, F32) for shape in layout.shapes]
        self._outs = [out.reshape(-1) for out in self._outs_shaped]
        logger.info(
            "jax_mlpo engine: %d params in %d subgroups (%.1f MiB of state), %d resident in "
            "host memory, %d on %d tier(s)",
            layout.num_params,
            len(layout.subgroups),
            layout.state_bytes / 2**20,
            len(self.resident),
            len(self.placement),
            len(self.tiers),
        )

    @staticmethod
    def _plan_cache(layout: Layout, config: OffloadConfig) -> tuple[set[int], list[int]]:
        """Which subgroups stay in host memory, and which go to the tiers (in order)."""
        sgs = layout.subgroups
        if layout.state_bytes <= config.host_cache:
            return {sg.index for sg in sgs}, []
        pipeline = (config.prefetch_depth + 2) * 4 * layout.max_state_elems
        if not config.tiers:
            raise ConfigError(
                f"host_cache={config.host_cache} bytes cannot hold the optimizer state "
                f"({layout.state_bytes} bytes) and no tiers are configured: add a FileTier, or "
                f"raise host_cache to at least {layout.state_bytes}"
            )
        if config.host_cache < pipeline:
            raise ConfigError(
                f"host_cache={config.host_cache} bytes is smaller than the pipeline's buffers: "
                f"(prefetch_depth {config.prefetch_depth} + 2) x {4 * layout.max_state_elems} "
                f"bytes per subgroup = {pipeline} bytes. Raise host_cache to at least {pipeline}, "
                "or lower subgroup_size or prefetch_depth."
            )
        budget = config.host_cache - pipeline
        resident: set[int] = set()
        for sg in sgs:
            if sg.state_bytes > budget:
                break
            resident.add(sg.index)
            budget -= sg.state_bytes
        return resident, [sg.index for sg in sgs if sg.index not in resident]

    def _write_initial_state(self) -> None:
        zeros = self._buffers[0]
        zeros.fill(0.0)
        futures = [
            self.tiers[t].write(slot, zeros[: self.layout.subgroups[i].state_elems])
            for i, (t, slot) in self.placement.items()
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
        before = [(t.bytes_read, t.bytes_written) for t in self.tiers]
        t_start = time.monotonic()
        try:
            self._run(grads, params, (no_decay, decay), count == 0, metrics)
        except BaseException as e:
            self._failed = e
            raise
        metrics.total_s = time.monotonic() - t_start
        for tier, (read, written) in zip(self.tiers, before, strict=True):
            metrics.bytes_read[tier.tier.path] = tier.bytes_read - read
            metrics.bytes_written[tier.tier.path] = tier.bytes_written - written
        self.metrics.append(metrics)
        self.step_count += 1
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

    def _run(self, grads, params, hypers, init_master, metrics: StepMetrics) -> None:
        order = range(len(self.layout.subgroups))
        upcoming = [i for i in order if i in self.placement]
        free = collections.deque(self._buffers)
        reads: dict[int, tuple[concurrent.futures.Future, np.ndarray]] = {}
        writes: collections.deque[tuple[concurrent.futures.Future, np.ndarray, int]] = (
            collections.deque()
        )
        next_read = 0

        def reclaim(block: bool) -> None:
            while writes and (block or writes[0][0].done()):
                future, buf, i = writes.popleft()
                t0 = time.monotonic()
                self._result(future, i)
                metrics.write_wait_s += time.monotonic() - t0
                free.append(buf)
                block = False

        def issue(block: bool) -> bool:
            nonlocal next_read
            if not free:
                reclaim(block)
            if not free:
                return False
            i = upcoming[next_read]
            t, slot = self.placement[i]
            buf = free.popleft()
            reads[i] = (self.tiers[t].read(slot, buf[: self.layout.subgroups[i].state_elems]), buf)
            next_read += 1
            return True

        try:
            for i in order:
                sg = self.layout.subgroups[i]
                if i in self.placement:
                    if i not in reads:
                        issue(block=True)
                    future, buf = reads.pop(i)
                while next_read < len(upcoming) and len(reads) < self.config.prefetch_depth:
                    if not issue(block=False):
                        break
                if i in self.placement:
                    t0 = time.monotonic()
                    self._result(future, i)
                    metrics.read_wait_s += time.monotonic() - t0
                else:
                    buf = self._cache[i]
                    metrics.cache_hits += 1
                t0 = time.monotonic()
                self._update_subgroup(sg, buf, grads, params, hypers, init_master)
                metrics.compute_s += time.monotonic() - t0
                metrics.subgroups += 1
                if i in self.placement:
                    t, slot = self.placement[i]
                    writes.append((self.tiers[t].write(slot, buf[: sg.state_elems]), buf, i))
                reclaim(block=False)
            while writes:
                reclaim(block=True)
        except BaseException:
            # Let nothing outlive the step: a read or write still running would touch buffers.
            for future, _ in reads.values():
                future.cancel()
            concurrent.futures.wait([f for f, _ in reads.values()] + [f for f, _, _ in writes])
            raise

    def _result(self, future: concurrent.futures.Future, index: int) -> None:
        try:
            future.result()
        except TierIOError as e:
            raise type(e)(f"subgroup {index}: {e}") from e

    def _update_subgroup(
        self,
        sg: Subgroup,
        blob: np.ndarray,
        grads: Sequence[np.ndarray],
        params: Sequence[np.ndarray],
        hypers: tuple[AdamWHyper, AdamWHyper],
        init_master: bool,
    ) -> None:
        n = sg.size
        if sg.has_master:
            p, m, v = blob[:n], blob[n : 2 * n], blob[2 * n : 3 * n]
        else:
            p, m, v = None, blob[:n], blob[n : 2 * n]
        for seg in sg.segments:
            s = slice(seg.start, seg.start + seg.size)
            leaf = slice(seg.leaf_start, seg.leaf_start + seg.size)
            param = params[seg.leaf][leaf]
            hyper = hypers[seg.decay]
            out = self._outs[seg.leaf][leaf]
            if seg.master:
                master = p[s]
                if init_master:  # the fp32 master starts as the exact value of the bf16 params
                    master[...] = param.astype(F32)
                self._kernel(
                    m[s], v[s], grads[seg.leaf][leaf], master, out, hyper,
                    update_param=True, delta_base=param,
                )  # fmt: skip
            else:
                self._kernel(m[s], v[s], grads[seg.leaf][leaf], param, out, hyper)

    def close(self) -> None:
        """Waits for in-flight I/O and releases the tiers. Idempotent."""
        self._closed = True
        for tier in self.tiers:
            tier.close()
        self.tiers = []
