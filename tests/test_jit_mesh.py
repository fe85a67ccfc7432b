"""Optimizer states made under ``jax.jit`` / ``nnx.jit`` on a (2, 2) mesh, with Explicit axes
(``jax.make_mesh``'s default) and Auto axes (tests/jit_mesh_worker.py, in a process of four
CPU devices: the device count is fixed when JAX starts).

A linen ``TrainState`` made by ``jax.jit(create, out_shardings=...)`` and an ``nnx.Optimizer``
made under ``nnx.jit`` with Flax's sharded-init idiom: the compiled init makes an engine laid
out by the params' shards over ``fsdp``, the state's arrays have the shardings asked for, and a
few steps train as the eager init bit for bit and as optax to float32 rounding. Two runs of one
compiled init make two engines with tier files of their own. What a jitted init on a mesh
cannot lay out is refused at run time or at the first update, naming the fix.
"""

from __future__ import annotations

import pathlib

import pytest
from processes import ROOT, json_lines

WORKER = pathlib.Path(__file__).with_name("jit_mesh_worker.py")
ENV = {"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
TOL = 1e-6
SCENARIOS = ["linen-explicit", "linen-auto", "nnx-explicit", "nnx-auto", "refusals"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("jit-mesh")
    return json_lines([str(WORKER), str(root), *SCENARIOS], 300, ENV)[-1]


@pytest.mark.parametrize("types", ["explicit", "auto"])
def test_a_linen_train_state_made_under_jit_on_a_mesh(results, types):
    out = results[f"linen-{types}"]
    assert out["shardings_as_asked"]
    assert out["handle_shape"] == [2, 2]  # one handle per device, as an eager init's
    assert out["layout_as_asked"]  # the engine holds the fsdp shards, as an eager init's
    assert out["from_eager"] == 0.0
    assert out["from_optax"] <= TOL
    assert out["params_keep_shardings"]


@pytest.mark.parametrize("types", ["explicit", "auto"])
def test_two_runs_of_one_jitted_init_on_a_mesh_make_two_engines(results, types):
    second = results[f"linen-{types}"]["second_run"]
    assert second["new_handle"] and second["first_refused"]
    assert second["first_files"] >= 4 and second["new_files"]
    assert second["same_params"]


@pytest.mark.parametrize("types", ["explicit", "auto"])
def test_an_nnx_optimizer_made_under_nnx_jit_on_a_mesh(results, types):
    out = results[f"nnx-{types}"]
    assert out["handle_shape"] == [2, 2]
    assert out["layout_as_asked"]
    assert out["tier_files"] >= 4
    assert out["from_eager"] == 0.0
    assert out["from_optax"] <= TOL
    assert out["params_keep_shardings"]


def test_what_a_jitted_init_on_a_mesh_refuses(results):
    out = results["refusals"]
    for use in ("no_mesh_at_trace", "no_mesh_at_trace_engine_of"):  # the update, engine_of
        assert "tx.init that made this optimizer state failed when its program ran" in out[use]
        assert "with no mesh in sight" in out[use] and "jax.set_mesh" in out[use]
    placed = out["placed_by_out_shardings_only"]
    assert "was laid out at init by params sharded" in placed
    assert "before tx.init (jax.sharding.reshard" in placed
