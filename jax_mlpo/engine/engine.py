"""The host update: the optimizer over every subgroup, its state streamed through the host cache.

One step is MLP-Offload's per-subgroup loop, in the order :mod:`jax_mlpo.engine.retention` gives:
make the subgroup resident (a cache hit, or the read prefetched from its tier), prefetch the next
ones, take its gradients (converted to fp32 inside the kernel: :mod:`jax_mlpo.engine.leaves`),
run the fused kernel, then retain it in host memory or write it back behind the next subgroups
(:mod:`jax_mlpo.engine.buffers`). The buffers are :mod:`jax_mlpo.engine.plan`'s; where subgroups
live is :mod:`jax_mlpo.engine.placement`'s; :mod:`jax_mlpo.engine.storage` opens the tiers and makes
the cache. Two collaborators do the rest: :class:`~jax_mlpo.engine.idle_io.IdleIO` the I/O between
updates, :class:`~jax_mlpo.engine.state_io.StateIO` the state's snapshots and loads.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.profiler import TraceAnnotation

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine import retention
from jax_mlpo.engine.idle_io import EngineHealth, IdleIO, ReadAhead, TierIOWindow
from jax_mlpo.engine.layout import Layout, Subgroup
from jax_mlpo.engine.leaves import HostLeaves, Leaves, SubgroupStaging
from jax_mlpo.engine.optimizer import HostOptimizer
from jax_mlpo.engine.placement import TierAssignment, TierSplit
from jax_mlpo.engine.plan import HostPlan, layout_plan
from jax_mlpo.engine.scalars import ScalarNames
from jax_mlpo.engine.snapshot import StateSnapshot
from jax_mlpo.engine.state_io import StateIO
from jax_mlpo.engine.step_metrics import StepMetrics
from jax_mlpo.engine.storage import host_storage, open_storage
from jax_mlpo.errors import CheckpointInProgressError, StaleStateError
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.types import F32

logger = logging.getLogger(__name__)


class Engine:
    """Owns the optimizer state of one params pytree, in host memory and file tiers.

    Args:
      layout: the subgroups of the params (laid out for ``optimizer``'s moments).
      config: the offload configuration (already validated).
      optimizer: the per-subgroup math (:mod:`jax_mlpo.optimizers`).
      scalars: the layout of the scalar vector each update hands in, with the hyper-parameters
        given at construction (an update may pass others: optax.inject_hyperparams).

    Raises:
      ConfigError: if the host cache cannot hold the pipeline's buffers, or the state does not
        fit in the host cache and no tier is configured.
    """

    def __init__(
        self, layout: Layout, config: OffloadConfig, optimizer: HostOptimizer,
        scalars: ScalarNames,
    ) -> None:  # fmt: skip
        if layout.moment_names != optimizer.moment_names:
            raise ValueError(
                f"the layout has moments {layout.moment_names}, {optimizer.name} keeps "
                f"{optimizer.moment_names}"
            )
        self.layout, self.config, self.optimizer = layout, config, optimizer
        self.scalars = scalars
        self._step_lock = threading.Lock()
        self._staging: SubgroupStaging | None = None
        self._releases: dict[Any, Callable[[], None]] = {}  # run at close (on_close)
        self.step_count = 0
        self.metrics: collections.deque[StepMetrics] = collections.deque(maxlen=100_000)
        self.health = EngineHealth()
        self.plan: HostPlan = layout_plan(config, layout)
        self.tiers: list[FileTierStore] = []
        self.idle: IdleIO | None = None  # made once the storage is open
        try:
            storage = (
                host_storage(config, layout) if self.host_only
                else open_storage(config, layout, self.plan, self.tiers)
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.cache, self.pipeline = storage.cache, storage.pipeline
        self.kinds, self._gradients = storage.kinds, storage.gradients
        self._assignment: TierAssignment | None = storage.assignment
        # Not with the baseline's fp32 gradients: a subgroup's read includes its gradient blob,
        # which the next backward pass has not produced yet.
        read_ahead = None
        if not self.host_only and config.read_ahead and config.delayed_conversion:
            read_ahead = ReadAhead(self.pipeline)
        self.order = retention.UpdateOrder(
            len(layout.subgroups), config.order, alternating=config.overlap_order == "alternate"
        )
        self.idle = IdleIO(
            self.pipeline, read_ahead, TierIOWindow(self.tiers), self.metrics, self.health,
            lambda: self.order.of_step(self.step_count), self.host_only,
        )  # fmt: skip
        self.state = StateIO(self, self.idle, self.health, self._step_lock)
        self.idle.resume()
        logger.info(
            "jax_mlpo engine: %d params in %d subgroups (%.1f MiB of state); %s",
            layout.num_params, len(layout.subgroups), layout.state_bytes / 2**20,
            "all in host memory" if self.host_only else
            f"{self.plan.buffers} host buffers, {self.plan.retained} retained across steps, "
            f"tiers {list(self.split.counts)} subgroups",
        )  # fmt: skip

    @property
    def host_only(self) -> bool:
        """Whether the whole state lives in host memory (no tiers, no pipeline)."""
        return self.plan.host_only

    @property
    def split(self) -> TierSplit | None:
        """Subgroups and retained subgroups per tier (None when the state is all in host memory)."""
        return self._assignment.split if self._assignment else None

    @property
    def tier_of(self) -> list[int]:
        """The tier each subgroup's blob is on (empty when the state is all in host memory)."""
        return self._assignment.tier_of if self._assignment else []

    @property
    def bandwidth(self) -> list[tuple[float, float]]:
        """Each tier's (read, write) bytes/s in the placement model (rescaled by re-plans)."""
        return self._assignment.bandwidth if self._assignment else []

    @property
    def host_bytes(self) -> int:
        """The host memory the engine holds: its cache's buffers (within ``host_cache``), the
        baseline's fp32 gradient buffers, and on a GPU the subgroup staging."""
        cached = sum(b.nbytes for b in self.cache.buffers)
        staging = self._staging.nbytes if self._staging is not None else 0
        return cached + self._gradients.host_bytes + staging

    @property
    def failed(self) -> bool:
        """Whether an update failed midway (the host state is then partly updated)."""
        return self.health.failed is not None

    # -- what the collaborators do, as the engine's own ----------------------------------------

    def snapshot(self, *, concurrent: bool = False) -> StateSnapshot:
        """:meth:`jax_mlpo.engine.state_io.StateIO.snapshot`."""
        return self.state.snapshot(concurrent=concurrent)

    def state_dict(self) -> dict[str, list[np.ndarray | None]]:
        """:meth:`jax_mlpo.engine.state_io.StateIO.state_dict`."""
        return self.state.state_dict()

    def load_state_dict(self, step: int, state: dict[str, list[np.ndarray | None]]) -> None:
        """:meth:`jax_mlpo.engine.state_io.StateIO.load_state_dict`."""
        self.state.load_state_dict(step, state)

    def load(self, step: int, fill: Callable[[Subgroup, np.ndarray], None]) -> None:
        """:meth:`jax_mlpo.engine.state_io.StateIO.load`."""
        self.state.load(step, fill)

    def drain(self) -> None:
        """:meth:`jax_mlpo.engine.idle_io.IdleIO.drain`."""
        self.idle.drain()

    def flush(self) -> None:
        """:meth:`jax_mlpo.engine.idle_io.IdleIO.flush`."""
        self.idle.flush()

    # -- the update ---------------------------------------------------------------------------

    def step(
        self, count: int, hyper: Any, grads: Sequence[np.ndarray],
        params: Sequence[np.ndarray], updates: Sequence[np.ndarray] | None = None,
    ) -> list[np.ndarray]:  # fmt: skip
        """Runs one update of the optimizer over every subgroup.

        Args:
          count: the optimizer step count in the state handed to update (0 for the first).
          hyper: the step's scalars (the optimizer's: :class:`~jax_mlpo.types.AdamWHyper`,
            :class:`~jax_mlpo.types.LionHyper`); weight decay applies where the mask is set.
          grads: the gradient leaves, flattened (float32 or bfloat16).
          params: the param leaves, flattened (float32 or bfloat16).
          updates: the flat update leaves to write (XLA's buffers, ``updates[k]`` possibly
            ``grads[k]``'s memory): float32, or bfloat16 for bfloat16 params (then
            ``bfloat16(master_new) - params``). None: new float32 arrays.

        Returns:
          ``updates`` (or the new arrays).

        Raises:
          StaleStateError: if ``count`` is not the step the host state is at.
          EngineFailedError: if an earlier update failed midway.
        """
        if updates is None:
            updates = [np.zeros(np.size(p), F32) for p in params]
        self.step_leaves(count, hyper, HostLeaves(grads, params, updates))
        return list(updates)

    def step_leaves(
        self, count: int, hyper: Any, leaves: Leaves, forward: list[int] | None = None
    ) -> None:
        """:meth:`step` on leaves wherever they are (:mod:`jax_mlpo.engine.leaves`).

        Args:
          forward: the subgroups in the order the program's forward pass needs them (an update
            beside the forward pass): this and every later update follow it
            (:class:`~jax_mlpo.engine.retention.UpdateOrder`). None: the order so far.
        """
        # the lock: XLA may run two programs' calls at once (a discarded update)
        with self._step_lock, TraceAnnotation("jax_mlpo.update", step=count + 1):
            if forward is not None:
                self.order.follow(forward)
            self._step(count, hyper, leaves)

    def subgroup_staging(
        self, pin: Callable[[np.ndarray], None], unpin: Callable[[np.ndarray], None]
    ) -> SubgroupStaging:
        """The host buffers a subgroup's leaves are staged through when XLA's are on a device
        (3 x 4 B x the largest subgroup, beyond ``host_cache``; made and pinned at the first
        use, unpinned by :meth:`close`)."""
        if self._staging is None:
            self._staging = SubgroupStaging(self.layout.max_subgroup_elems, pin, unpin)
        return self._staging

    def on_close(self, release: Callable[[], None]) -> None:
        """Runs ``release`` when the engine closes (once, however often it is given): the
        host memory an update's transport holds for it, such as a GPU's grouped staging."""
        self._releases.setdefault(release, release)

    def _step(self, count: int, hyper: Any, leaves: Leaves) -> None:
        self.health.check_usable()
        snapshot = self.state.open_snapshot
        if snapshot is not None and not snapshot.concurrent:
            raise CheckpointInProgressError(
                "an update ran while a synchronous snapshot of its state was open"
            )
        if count != self.step_count:
            raise StaleStateError(
                f"update got an optimizer state at step {count}, but its offloaded state is at "
                f"step {self.step_count}: each update must receive the state the previous one "
                "returned. The state was restored from a checkpoint that does not hold the "
                "offloaded state (use jax_mlpo.checkpoint.OffloadSave/OffloadRestore), an update "
                "was computed and discarded (for optax.MultiSteps use jax_mlpo.MultiSteps), or a "
                "step was retried."
            )
        leaves.check(self.layout)
        metrics = StepMetrics(step=count + 1)
        window = self.idle.window
        window.close_into(self.metrics[-1] if self.metrics else None)  # late write-backs
        spare = self.plan.buffers - self.plan.minimum
        order = self.order.of_step(count)
        keep = (
            set(order) if self.host_only
            else self.order.keep(order, self.tier_of, self.split.retained, spare)
        )  # fmt: skip
        io, sgs = self.pipeline, self.layout.subgroups
        t_start = time.monotonic()
        self.idle.take(metrics)
        try:
            self._gradients.before_update(order, leaves, metrics)
            io.begin_step(order, metrics)
            for i in order:
                resident = io.acquire(i)  # a cache hit, or the read issued for it
                io.prefetch()  # the next subgroups' reads, prefetch_depth per tier
                with TraceAnnotation("jax_mlpo.read_wait", subgroup=i):
                    io.await_reads(i, resident)
                t0 = time.monotonic()
                with TraceAnnotation(f"jax_mlpo.{self.optimizer.name}", subgroup=i):
                    leaves.fetch(sgs[i])
                    grad_blob = self._gradients.subgroup(resident.slot, sgs[i].size, resident.hit)
                    blob = self.cache.blob(i, resident.slot)
                    self.optimizer.update(sgs[i], blob, leaves, grad_blob, hyper, count=count)
                    leaves.store(sgs[i])
                metrics.compute_s += time.monotonic() - t0
                metrics.subgroups += 1
                metrics.cache_hits += resident.hit
                with TraceAnnotation("jax_mlpo.release", subgroup=i):
                    io.release(i, resident.slot, keep=i in keep)  # retain, or write behind
            leaves.finish()
            io.end_step(write_behind=self.config.write_behind)
        except BaseException as e:
            self.health.failed = e
            io.abort()
            raise
        t_end = time.monotonic()
        metrics.total_s = t_end - t_start
        # an update in groups (jax_mlpo.engine.grouped): its time after the first group was
        # handed back, on the same clock and inside the same span as total_s, so never above it
        first_done = getattr(leaves, "first_done", None)
        if first_done is not None:
            metrics.beside_s = t_end - min(max(first_done, t_start), t_end)
        window.close_into(metrics)
        self.metrics.append(metrics)
        self.step_count += 1
        if self._assignment:
            self._assignment.observe(metrics)
        self.idle.resume()

    def close(self, *, flush: bool = True) -> None:
        """Flushes retained subgroups, waits for in-flight I/O, releases the tiers. Idempotent.

        Args:
          flush: write the retained subgroups to their tiers first; False where the state is
            discarded (at interpreter exit: tiers are never read back by another process).
        """
        if self.health.closed:
            return
        snapshot = self.state.open_snapshot if self.idle is not None else None
        if snapshot is not None and not snapshot.wait_closed(timeout=1.0):
            logger.info("jax_mlpo: waiting for the checkpoint being written before closing")
            snapshot.wait_closed()
        self.health.closed = True
        try:
            if self.idle is not None:  # None: the storage did not open
                self.idle.pause(cancel=True)
                if flush and self.tiers and self.health.failed is None:
                    self.idle.flush_retained()
        finally:
            for tier in self.tiers:
                tier.close()
            self.tiers = []
            if self._staging is not None:
                self._staging.release()
            for release in self._releases.values():
                release()
            self._releases.clear()
