"""jax_mlpo.adamw on params sharded over a mesh of four devices in one process.

The cases run one after the other in an interpreter with four CPU devices (this test
process has one): tests/mesh_worker.py's 50 steps against optax.adamw on one device, to
tests/test_transform.py's tolerances, with the state stored once per distinct parameter and the
updates in the params' shardings (the main job on a mesh: tests/job/test_mesh_job.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from processes import json_lines

from jax_mlpo.sharding.mesh import DeviceCalls, LocalShard, MeshPlan

WORKER = Path(__file__).parent / "mesh_worker.py"
CASES = [
    ("data4", "float32", "jit", "chain"),
    ("fsdp2x2", "float32", "jit", "chain"),
    ("fsdp2x2", "float32", "nnx", "chain"),
    ("fsdp2x2", "bfloat16", "jit", "inside"),
    ("data4", "bfloat16", "nnx", "inside"),
]


def _worker(*args: str) -> list[dict]:
    """mesh_worker.py's JSON lines (one per case), in order."""
    return json_lines([str(WORKER), *args], 300)


@pytest.fixture(scope="module")
def four_device_runs(tmp_path_factory) -> dict[tuple[str, ...], dict]:
    """Every case of :data:`CASES` in one interpreter of four devices, one after the other."""
    root = tmp_path_factory.mktemp("four-devices")
    cases = [[*case, str(root / "-".join(case))] for case in CASES]
    outs = _worker("cases", json.dumps(cases))
    assert len(outs) == len(CASES), outs
    return dict(zip(CASES, outs, strict=True))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_parity_on_four_devices(case, four_device_runs):
    out = four_device_runs[case]
    assert out["devices"] == 4
    # every distinct parameter's state once: replicated leaves (and those replicated over one
    # mesh axis) are not stored per device
    assert out["state_bytes"] == out["per_elem"] * out["distinct_params"]
    assert out["tier_bytes"] == out["state_bytes"]  # closed: every subgroup on the tier
    assert all(out["params_keep_shardings"].values()), out["params_keep_shardings"]
    if case[2] == "jit":
        assert all(out["updates_keep_shardings"].values()), out["updates_keep_shardings"]


@pytest.mark.parametrize("dtype,clip", [("float32", "chain"), ("bfloat16", "inside")])
def test_parity_on_two_processes_of_two_devices(dtype, clip, tmp_path):
    """A (2, 2) fsdp x tensor mesh over 2 processes x 2 devices: each process stores the state
    of the distinct shards its devices hold (jax's own addressable shards, deduplicated), once."""
    from jax_mlpo.testing.processes import free_port, run_local

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2",
           "MESH_WORKER_PROCESSES": "2", "MESH_WORKER_PORT": str(free_port())}  # fmt: skip
    argv = [sys.executable, str(WORKER), "fsdp2x2", dtype, "jit", clip, str(tmp_path / "tier")]
    logs = tmp_path / "logs"
    logs.mkdir()
    done = run_local([[*argv, "0"], [*argv, "1"]], env, logs, 300)
    assert done.ok, "\n".join(text[-8000:] for text in done.logs)
    outs = [json.loads(text.strip().splitlines()[-1]) for text in done.logs]
    for out in outs:
        assert out["processes"] == 2 and out["devices"] == 4
        # fsdp splits over the processes: each holds a part, and replicated leaves whole
        assert out["all_params"] / 2 < out["distinct_params"] < out["all_params"]
        assert out["state_bytes"] == out["tier_bytes"] == out["per_elem"] * out["distinct_params"]
        assert all(out["params_keep_shardings"].values())
        assert all(out["updates_keep_shardings"].values())


def test_what_a_mesh_state_refuses(tmp_path):
    out = _worker("refusals", str(tmp_path / "tier"))[-1]
    assert "place every param on the same mesh" in out["two_meshes"]
    assert "needs every leaf placed with a NamedSharding on one mesh" in out["one_device_leaf"]


CHECKPOINTS = Path(__file__).parent / "mesh_checkpoint_worker.py"


def _checkpoint_worker(root: Path, devices: int, processes: int, *args: str) -> list[dict]:
    """tests/mesh_checkpoint_worker.py on ``processes`` processes of ``devices`` each."""
    from jax_mlpo.testing.processes import free_port, run_local

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}
    argv = [sys.executable, str(CHECKPOINTS), *args, str(root)]
    if processes > 1:
        env |= {"CKPT_WORKER_PROCESSES": str(processes), "CKPT_WORKER_PORT": str(free_port())}
        commands = [[*argv, str(k)] for k in range(processes)]
    else:
        commands = [argv]
    logs = root / f"logs-{'-'.join(args)}-{processes}"
    logs.mkdir()
    done = run_local(commands, env, logs, 300)
    assert done.ok, "\n".join(text[-8000:] for text in done.logs)
    return [json.loads(text.strip().splitlines()[-1]) for text in done.logs]


@pytest.mark.parametrize("saved_on", [1, 2])
def test_a_mesh_checkpoint_restores_on_other_meshes_and_process_counts(saved_on, tmp_path):
    """Saved with bfloat16 params on a (2, 2) fsdp x tensor mesh of four devices (1 process,
    or 2 of 2 devices), restored on the same mesh over 2 processes of 2 devices, on one device,
    and on a (4,) mesh splitting other dimensions, into optimizers with other subgroups and host
    caches: the next update's params equal the uninterrupted run's bit for bit."""
    _checkpoint_worker(tmp_path, 4 // saved_on, saved_on, "save")
    restores = {1: [(2, 2, "fsdp2x2"), (1, 1, "none")], 2: [(4, 1, "data4")]}[saved_on]
    for devices, processes, mesh in restores:
        for out in _checkpoint_worker(tmp_path, devices, processes, "restore", mesh):
            assert out["step"] == 3 and out["processes"] == processes
            assert not any(out["differing_elements"].values()), (mesh, out)


class _Completions:
    """The completions handed to DeviceCalls: each records its outcome and its thread."""

    def __init__(self) -> None:
        self.outcomes: dict[int, BaseException | None] = {}
        self.threads: dict[int, threading.Thread] = {}
        self._done = threading.Condition()

    def of(self, slot: int):
        def complete(error: BaseException | None) -> None:
            with self._done:
                self.outcomes[slot] = error
                self.threads[slot] = threading.current_thread()
                self._done.notify_all()

        return complete

    def wait(self, count: int) -> None:
        with self._done:
            assert self._done.wait_for(lambda: len(self.outcomes) == count, 30)


def _plan() -> MeshPlan:
    """Two leaves on four device slots: leaf 0 split in two (slots 0, 1 hold one half, 2, 3 the
    other), leaf 1 replicated on every slot."""
    shards = (LocalShard(0, ((0, 2),), 0, (1,)), LocalShard(0, ((2, 4),), 2, (3,)),
              LocalShard(1, ((0, 3),), 0, (1, 2, 3)))  # fmt: skip
    return MeshPlan(None, (), ((4,), (3,)), (None,) * 4, shards)


def _call(slot: int, count: int = 5) -> tuple:
    grads = [np.full(2, slot, np.float32), np.full(3, 10 + slot, np.float32)]
    params = [np.zeros(2, np.float32), np.zeros(3, np.float32)]
    updates = [np.full(2, -1, np.float32), np.full(3, -1, np.float32)]
    return count, np.ones(4, np.float32), grads, params, updates


def test_device_calls_leave_every_call_but_the_last_pending():
    """The devices' calls of one step, made one after another from a single thread: none waits
    for the others (each returns pending), and the last runs the engine once over the owners'
    buffers, copies each update to its replicas, and completes the others, each on a thread of
    its own (XLA goes on with that device's program there)."""
    ran = []

    def run(count, scalars, grads, params, updates):
        ran.append((count, [g.copy() for g in grads]))
        for g, u in zip(grads, updates, strict=True):
            np.negative(g, out=u)

    done = _Completions()
    device_calls = DeviceCalls(_plan(), run)
    calls = [_call(k) for k in range(4)]
    assert [device_calls.arrive(k, calls[k], done.of(k)) for k in (1, 3, 0)] == [True] * 3
    assert not ran and not done.outcomes
    assert device_calls.arrive(2, calls[2], done.of(2)) is False
    assert len(ran) == 1 and ran[0][0] == 5
    # the engine saw the owners' shards: slot 0's half of leaf 0, slot 2's, slot 0's leaf 1
    np.testing.assert_array_equal(np.concatenate(ran[0][1]), [0, 0, 2, 2, 10, 10, 10])
    for k in range(4):
        owner_of_half = 0 if k < 2 else 2
        np.testing.assert_array_equal(calls[k][4][0], [-owner_of_half] * 2)
        np.testing.assert_array_equal(calls[k][4][1], [-10] * 3)
    done.wait(3)
    assert done.outcomes == {0: None, 1: None, 3: None}
    assert len({*done.threads.values(), threading.current_thread()}) == 4
    # the next step is a round of its own
    assert device_calls.arrive(0, _call(0, 6), done.of(0)) is True


def test_device_calls_hand_the_update_error_to_every_call():
    def run(*args):
        raise OSError("tier gone")

    done = _Completions()
    device_calls = DeviceCalls(_plan(), run)
    for k in range(3):
        assert device_calls.arrive(k, _call(k), done.of(k)) is True
    with pytest.raises(OSError, match="tier gone"):
        device_calls.arrive(3, _call(3), done.of(3))
    done.wait(3)
    assert all(isinstance(e, OSError) and "tier gone" in str(e) for e in done.outcomes.values())
    with pytest.raises(RuntimeError, match="slot 0 called the update twice"):
        device_calls.arrive(0, _call(0), done.of(0))
        device_calls.arrive(0, _call(0), done.of(0))


def test_device_calls_fail_a_step_whose_devices_do_not_all_come():
    done = _Completions()
    device_calls = DeviceCalls(_plan(), lambda *args: None, wait_s=0.2)
    for k in (0, 1):
        assert device_calls.arrive(k, _call(k), done.of(k)) is True
    done.wait(2)
    for k in (0, 1):
        assert "2 of this process's 4 devices ran the update within 0 s" in str(done.outcomes[k])
    # a late call starts a new step instead of joining the failed one
    assert device_calls.arrive(2, _call(2), done.of(2)) is True
