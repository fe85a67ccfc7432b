"""jax_mlpo.overlapped_step on meshes: Explicit axes under ``jax.set_mesh`` (``jax.make_mesh``'s
default, with ``out_sharding`` einsums), a 1x1 Explicit mesh, Auto axes, and an
``nnx.Optimizer`` on a mesh (tests/overlap_mesh_worker.py, in processes of their own: the
device count is fixed when JAX starts).

On every one the update is split into group calls that every device makes with its own
shards, the first groups are handed back before the update ends, and the forward pass of the
first layer runs while the last subgroup's read is still held. The params are the plain loop's
bit for bit, with the fused ``max_grad_norm`` too (its norm summed in one order in both
programs: jax_mlpo/sharding/norm.py), and within optax's tolerance of optax; with
``optax.clip_by_global_norm`` in a chain, within optax's tolerance of the plain loop. A tier failing
in an overlapped step on the mesh fails it with the typed error, and the last checkpoint
resumes bit for bit.
"""

from __future__ import annotations

import pathlib

import pytest
from processes import ROOT, json_lines

WORKER = pathlib.Path(__file__).with_name("overlap_mesh_worker.py")
TOL = 1e-6


def run_worker(tmp_path: pathlib.Path, *scenarios: str) -> dict[str, dict]:
    env = {"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return json_lines([str(WORKER), str(tmp_path), *scenarios], 900, env)[-1]


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory) -> dict[str, dict]:
    return run_worker(tmp_path_factory.mktemp("mesh"), "explicit2x2", "auto2x2", "nnx2x2")


def check(out: dict) -> None:
    for kind in ("none", "fused", "chain"):
        beside = out["beside"][kind]
        # every update but the flush ran in groups, its first groups handed back early
        assert all(b > 0 for b in beside[:-1]) and beside[-1] == 0, beside
        assert out["optax_err"][kind] <= TOL
        assert out["plain_err"][kind] <= TOL
    # the chain's clip_by_global_norm is the user's reduction, compiled with each program
    assert out["bit_for_bit"]["none"] and out["bit_for_bit"]["fused"], out["plain_err"]
    if "first_layer_before_last_read" in out:
        # one run of the first layer per device, each while the last read was held
        assert len(out["first_layer_before_last_read"]) == out["devices"]
        assert all(out["first_layer_before_last_read"])
    if "shardings" in out:
        assert out["shardings"]
        # the gradients carried to the next step are computed in the sharding the update
        # reads them in, as the plain step's are (else XLA may sum them in another order)
        assert out["grads_as_params"]


def test_a_tier_failing_on_the_mesh_fails_typed_and_resumes_bit_for_bit(four_devices):
    """A tier write that fails in an overlapped step on the 2x2 Explicit mesh: the step raises
    TierIOError, the engine refuses to go on, and the last orbax checkpoint resumes to the
    uninterrupted plain loop's params, bit for bit."""
    assert four_devices["explicit2x2"]["fault"] == {
        "typed_error": True,
        "engine_failed": True,
        "resumed": True,
    }


@pytest.mark.parametrize("scenario", ["explicit2x2", "auto2x2", "nnx2x2"])
def test_overlapped_on_a_2x2_mesh(four_devices, scenario):
    check(four_devices[scenario])


def test_overlapped_on_a_1x1_explicit_mesh(tmp_path):
    check(run_worker(tmp_path, "explicit1x1")["explicit1x1"])
