"""When the update beside the next forward pass pays, and into how many calls it is split.

An update split into ``n`` host calls (:func:`jax_mlpo.transforms.overlap.overlapped_step`)
costs ``n`` times a call's fixed cost (the host callback, the thread that wakes, the forward
pass cut into smaller programs); it gains what the forward pass runs while later groups are
updated. A group must carry enough work to pay for its call: :func:`auto_groups` gives the
number of calls from the update's elements, the host update's time per element and the fixed
cost of one call, both measured in this process (:func:`call_cost_s`, :func:`element_cost_s`).
An update that no two groups can carry cannot run beside anything: :func:`worth_trying` says
no without compiling the overlapped step.

Where two groups can pay, whether the overlapped step wins is measured, not modelled
(:class:`OverlapTrial`): a few plain and overlapped steps after their programs compiled, the
faster kept. Either step trains the same params, bit for bit, so a trial changes no number.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlpo.transforms.runtime import RUNTIME

__all__ = ["OverlapTrial", "auto_groups", "call_cost_s", "element_cost_s", "worth_trying"]

# The most calls an update is split into: the first group is then an eighth of the update,
# which the forward pass waits for; more calls cut that wait by less than they cost.
MAX_GROUPS = 8
# A group's work is at least this many times its call's fixed cost: the calls then cost at
# most a tenth of the update they split.
PAYBACK = 10
# Below any host call's fixed cost (a thread woken, XLA's callback dispatched; measured at
# 100-400 us on a 2-core AMD EPYC): an update whose work does not carry two calls at this cost
# is one group without compiling the calibration's program.
CALL_FLOOR_S = 10e-6
# Timed repetitions of each calibration (the fastest kept: pre-emption only adds time); both
# together take ~0.1 s, most of it compiling the callback's program (the element cost alone,
# all a small update needs, ~10 ms).
_ROUNDS = 7


def call_cost_s() -> float:
    """The fixed cost of one host call inside a jitted program: a program of one no-op
    callback, the fastest of ``_ROUNDS`` runs (measured once per process; a run pre-empted by
    other work only takes longer; the program's own dispatch, ~10 us, is counted in, erring
    toward fewer calls)."""
    return RUNTIME.measured_once("call_cost_s", _measure_call_cost)


def _measure_call_cost() -> float:
    x = jnp.zeros((8,), jnp.float32)

    def noop(v: np.ndarray) -> np.ndarray:
        return v

    with_call = jax.jit(lambda v: jax.pure_callback(noop, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                                    v + 1) * 2)  # fmt: skip
    return max(_fastest_s(with_call, x), 1e-6)


def element_cost_s() -> float:
    """The host update's time per element: the engine's own fused AdamW kernel
    (:func:`jax_mlpo.native.kernels.adamw_step`) over 256K float32 elements in memory, the
    fastest of ``_ROUNDS`` runs (measured once per process). An update that waits for its
    tiers costs more per element, so this errs toward fewer calls."""
    return RUNTIME.measured_once("element_cost_s", _measure_element_cost)


def _measure_element_cost() -> float:
    from jax_mlpo.native.kernels import adamw_step
    from jax_mlpo.types import AdamWHyper

    n = 1 << 18
    m, v, g, p, u = (np.full(n, 0.5, np.float32) for _ in range(5))
    hyper = AdamWHyper(bc1=0.1, bc2=0.001, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8,
                       weight_decay=0.1)  # fmt: skip
    return _fastest_s(lambda: adamw_step(m, v, g, p, u, hyper)) / n


def _fastest_s(fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compiled, caches warm
    times = []
    for _ in range(_ROUNDS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def auto_groups(elements: int, per_element_s: float | None = None,
                per_call_s: float | None = None) -> int:  # fmt: skip
    """How many calls an update of ``elements`` is split into: each carries at least
    ``PAYBACK`` times a call's fixed cost of work, at most ``MAX_GROUPS``, at least 1.

    Args:
      elements: the update's elements (the offloaded params' sizes added up).
      per_element_s: the host update's time per element (None: :func:`element_cost_s`).
      per_call_s: a call's fixed cost (None: :func:`call_cost_s`).

    Returns:
      The number of calls.
    """
    work = elements * (element_cost_s() if per_element_s is None else per_element_s)
    if per_call_s is None and work < 2 * PAYBACK * CALL_FLOOR_S:
        return 1  # not two groups even at the cheapest call: no need to measure one
    call = call_cost_s() if per_call_s is None else per_call_s
    return int(min(MAX_GROUPS, max(1, work // (PAYBACK * call))))


def worth_trying(leaf_sizes: Sequence[int], groups: int) -> bool:
    """Whether an update over leaves of ``leaf_sizes`` can run beside the forward pass at all:
    two groups or more, each paying for its call (with ``groups`` given, as asked)."""
    return groups >= 2 and len([s for s in leaf_sizes if s]) >= 2


class OverlapTrial:
    """Times the plain and the overlapped step after each compiled, and keeps the faster.

    The steps are the run's own (either trains the same params): the plain one first
    ``rounds + 1`` times, then the overlapped one (its first run compiles it, the run before it
    has nothing pending), then :attr:`overlap` is set from the fastest of each's timed runs.

    Args:
      rounds: timed runs of each step.
    """

    def __init__(self, rounds: int = 2) -> None:
        self.rounds = rounds
        self.times: dict[bool, list[float]] = {False: [], True: []}
        self.overlap: bool | None = None  # None: still trying
        self._compiled: set[bool] = set()

    def next_overlapped(self) -> bool:
        """Whether the next step should be overlapped (after the trial: the winner)."""
        if self.overlap is not None:
            return self.overlap
        return len(self.times[False]) >= self.rounds

    def record(self, overlapped: bool, seconds: float, applied_update: bool = True) -> None:
        """A step's time; a program's first run (its compilation) and a step that applied no
        update (nothing was pending) are not samples."""
        if self.overlap is not None or not applied_update:
            return
        if overlapped not in self._compiled:
            self._compiled.add(overlapped)
            return
        self.times[overlapped].append(seconds)
        if len(self.times[True]) >= self.rounds:
            self.overlap = min(self.times[True]) < min(self.times[False])

    def decide(self, overlap: bool) -> None:
        """Ends the trial with ``overlap`` (a choice made without timing)."""
        self.overlap = overlap
