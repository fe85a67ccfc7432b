"""The staged leaves (a GPU's path: a subgroup at a time through pinned buffers) against XLA's
buffers used in place, on this CPU: the same bits, and the staging never holds more than a
subgroup.

On a GPU the copier is ``cudaMemcpyAsync`` on XLA's stream (experiments/bench/gpu/gpu_check.py
runs that); here the "device" is host memory and the copier a plain memmove, so everything but
the CUDA calls themselves is exercised.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mlpo
from jax_mlpo import FileTier, OffloadConfig
from jax_mlpo.engine.leaves import HostLeaves, StagedLeaves, SubgroupStaging
from jax_mlpo.native.host_update import DeviceBuffer
from jax_mlpo.types import BF16, F32, AdamWHyper

# a bf16 matrix spanning subgroups, an fp32 vector inside one with it, a tiny bf16 leaf
SHAPES = {"a": ((30, 101), BF16), "b": ((77,), F32), "c": ((5,), BF16)}
SUBGROUP = 1000


class MemmoveCopier:
    """The copier of a "device" that is host memory; counts the bytes it moves."""

    def __init__(self) -> None:
        self.moved = 0
        self.largest = 0

    def to_host(self, dst: np.ndarray, src: int) -> None:
        ctypes.memmove(dst.ctypes.data, src, dst.nbytes)
        self.moved += dst.nbytes
        self.largest = max(self.largest, dst.nbytes)

    def to_device(self, dst: int, src: np.ndarray) -> None:
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)
        self.moved += src.nbytes

    def synchronize(self) -> None:
        pass


def device(x: np.ndarray) -> DeviceBuffer:
    return DeviceBuffer(x.ctypes.data, x.nbytes, x.dtype)


def make_engine(tmp_path, name: str, delayed: bool):
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s).astype(dt)) for k, (s, dt) in SHAPES.items()}
    config = OffloadConfig(
        host_cache=6 * 12 * SUBGROUP, tiers=[FileTier(str(tmp_path / name))],
        subgroup_size=SUBGROUP, prefetch_depth=1, delayed_conversion=delayed,
    )  # fmt: skip
    state = jax_mlpo.adamw(1e-2, weight_decay=0.1, offload=config).init(params)
    return state, [np.asarray(x).reshape(-1) for x in jax.tree.leaves(params)]


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "gradient-round-trip"])
def test_staged_leaves_give_the_in_place_bits(tmp_path, delayed):
    in_place, params = make_engine(tmp_path, "in_place", delayed)
    staged, _ = make_engine(tmp_path, "staged", delayed)
    engines = [jax_mlpo.engine_of(s) for s in (in_place, staged)]
    staging = SubgroupStaging(engines[1].layout.max_subgroup_elems)
    copier = MemmoveCopier()
    rng = np.random.default_rng(1)
    p = {"in_place": [x.copy() for x in params], "staged": [x.copy() for x in params]}
    for step in range(4):
        hyper = AdamWHyper(1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1), 1e-2, 0.9, 0.999,
                           1e-8, 0.0)  # fmt: skip
        grads = [rng.standard_normal(x.size).astype(x.dtype) for x in params]
        updates = {}
        for name, engine in zip(p, engines, strict=True):
            g = [x.copy() for x in grads]
            u = g  # the updates over their gradients, as XLA aliases them
            if name == "in_place":
                engine.step_leaves(step, hyper, HostLeaves(g, p[name], u))
            else:
                leaves = StagedLeaves([device(x) for x in g], [device(x) for x in p[name]],
                                      [device(x) for x in u], copier, staging)  # fmt: skip
                engine.step_leaves(step, hyper, leaves)
            updates[name] = u
            p[name] = [(x.astype(F32) + d.astype(F32)).astype(x.dtype)
                       for x, d in zip(p[name], u, strict=True)]  # fmt: skip
        for a, b in zip(updates["in_place"], updates["staged"], strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for name, state in (("in_place", in_place), ("staged", staged)):
        assert jax_mlpo.engine_of(state).step_count == 4, name
    want, got = (jax_mlpo.engine_of(s).state_dict() for s in (in_place, staged))
    for key in want:
        for a, b in zip(want[key], got[key], strict=True):
            if a is not None:
                np.testing.assert_array_equal(a, b)
    # a subgroup at a time: no single copy larger than a subgroup's leaf segment
    assert 0 < copier.largest <= 4 * SUBGROUP
    assert staging.nbytes == 3 * 4 * SUBGROUP
    for state in (in_place, staged):
        jax_mlpo.close(state)


def test_staged_leaves_refuse_a_wrong_size(tmp_path):
    state, params = make_engine(tmp_path, "t", True)
    engine = jax_mlpo.engine_of(state)
    staging = SubgroupStaging(engine.layout.max_subgroup_elems)
    bad = [device(x) for x in params]
    bad[0] = DeviceBuffer(bad[0].address, bad[0].nbytes - 2, bad[0].dtype)
    leaves = StagedLeaves(bad, [device(x) for x in params], [device(x) for x in params],
                          MemmoveCopier(), staging)  # fmt: skip
    hyper = AdamWHyper(0.1, 0.001, 1e-2, 0.9, 0.999, 1e-8, 0.0)
    with pytest.raises(ValueError, match="leaf 0: expected 3030 elements"):
        engine.step_leaves(0, hyper, leaves)
    jax_mlpo.close(state)
