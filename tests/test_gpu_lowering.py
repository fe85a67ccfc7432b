"""The GPU path checked without a GPU: a jitted train step lowered for CUDA with ``jax.export``.

``jax.export`` lowers for a platform that is not present. The exported module shows what XLA
would hand the CUDA handler (``ffi/cuda_host_update.cu``): one side-effecting
``jax_mlpo_host_update`` custom call per update, its operands (handle, count, the f32[12]
scalars, every gradient, every param), the updates aliased onto the gradients, and row-major
layouts, which the handler's flat copies assume. What this cannot check: that the handlers run.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from processes import json_lines

import jax_mlpo
from jax_mlpo.native.host_update import NUM_SCALARS

ROOT = Path(__file__).resolve().parents[1]
TARGET = "jax_mlpo_host_update"


GROUPED = ("jax_mlpo_group_send", "jax_mlpo_group_receive")


def _export_for_cuda(step, *args) -> str:
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    exported = jax.export.export(
        jax.jit(step, donate_argnums=(0,)),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in (TARGET, *GROUPED)],
    )(*avals)
    assert exported.platforms == ("cuda",)
    return exported.mlir_module()


def _calls(module: str, target: str = TARGET) -> list[str]:
    return [line for line in module.splitlines() if f"custom_call @{target}(" in line]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_train_step_lowers_for_cuda(dtype, tmp_path):
    config = jax_mlpo.OffloadConfig(
        host_cache="1MiB", subgroup_size=256, tiers=[jax_mlpo.FileTier(str(tmp_path / "t"))]
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), jax_mlpo.adamw(1e-3, offload=config))
    params = {"b": jnp.ones((16,), dtype), "w": jnp.ones((32, 16), dtype)}
    state = tx.init(params)
    x = jnp.ones((4, 32), dtype)

    def step(params, state, x):
        def loss(p):
            return jnp.sum((x @ p["w"] + p["b"]).astype(jnp.float32) ** 2)

        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    module = _export_for_cuda(step, params, state, x)
    calls = _calls(module)
    assert len(calls) == 1, module  # one host update per step
    call = calls[0]
    assert "has_side_effect = true" in call  # never dropped, never duplicated by XLA
    el = "bf16" if dtype == jnp.bfloat16 else "f32"
    signature = call[call.rindex(": (") :]
    operands = f"(tensor<i32>, tensor<i32>, tensor<{NUM_SCALARS}xf32>, tensor<16x{el}>, "
    operands += f"tensor<32x16x{el}>, tensor<16x{el}>, tensor<32x16x{el}>)"
    assert signature.startswith(f": {operands} -> (tensor<i32>, tensor<16x{el}>, "), signature
    # the updates overwrite the gradients (operands 3 and 4): no device buffer of their own
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call)
    assert sorted(aliases) == [("1", "3"), ("2", "4")], call
    # row-major (XLA's default) layouts: the handler copies each buffer as one flat range
    layouts = re.search(r"operand_layouts = \[(.*?)\], output_operand", call).group(1)
    assert layouts.count("dense<[1, 0]>") == 2 and "dense<[0, 1]>" not in layouts
    jax_mlpo.close(state)


def test_the_handlers_agree_on_the_scalars_operand():
    """The C++ handlers (CPU and CUDA) and the Python transport agree on the scalars' length."""
    header = (ROOT / "jax_mlpo" / "ffi" / "host_update.h").read_text()
    assert re.search(rf"kNumScalars = {NUM_SCALARS};", header)
    cuda = (ROOT / "jax_mlpo" / "ffi" / "cuda_host_update.cu").read_text()
    assert "float values[kNumScalars];" in cuda and "kNumScalars * sizeof(float)" in cuda


_MESH = """
import os, sys, json
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "4"
import jax, jax.numpy as jnp, optax, jax_mlpo
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=jax.devices())
config = jax_mlpo.OffloadConfig(host_cache="1MiB", subgroup_size=256,
                                tiers=[jax_mlpo.FileTier(sys.argv[1])])
tx = jax_mlpo.adamw(1e-3, offload=config)
params = {"w": jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P("fsdp", "tensor")))}
state = tx.init(params)

def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                    (params, state, params))
exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=[
    jax.export.DisabledSafetyCheck.custom_call("jax_mlpo_host_update")])(*args)
calls = [l for l in exported.mlir_module().splitlines() if "custom_call @jax_mlpo_host_update" in l]
print(json.dumps({"calls": calls}))
"""


def test_a_mesh_step_lowers_for_cuda_with_one_call_per_device_shard(tmp_path):
    """Params on a 2x2 mesh: the update is one call over each device's shard (inside
    shard_map), with the per-device shapes, the updates aliased onto the gradients."""
    (tmp_path / "t").mkdir()
    out = json_lines(["-c", textwrap.dedent(_MESH), str(tmp_path / "t")], 120)[-1]
    assert len(out["calls"]) == 1, out
    call = out["calls"][0]
    # each device holds a 16x8 block of the 32x16 leaf, and its own handle (a scalar)
    signature = call[call.rindex(": (") :]
    assert signature.startswith(
        f": (tensor<i32>, tensor<i32>, tensor<{NUM_SCALARS}xf32>, tensor<16x8xf32>, "
        "tensor<16x8xf32>) -> "
        "(tensor<i32>, tensor<16x8xf32>)"
    ), signature
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call)
    assert aliases == [("1", "3")], call


def test_an_overlapped_step_lowers_for_cuda_as_a_send_and_a_receive_per_group(tmp_path):
    """overlapped_step(platform="cuda"): the trace cannot know the platform it is exported for
    (jax.default_backend() is this machine's CPU), so the step names it. Each group is a send
    (its scalars, gradients and params to the host) and a receive (its updates back) that takes
    every send's token, so that XLA sends every group before it waits for any."""
    config = jax_mlpo.OffloadConfig(
        host_cache="1MiB", subgroup_size=256, tiers=[jax_mlpo.FileTier(str(tmp_path / "t"))]
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    # forward order c, a, b: not the pytree's
    params = {"a": jnp.ones((32, 16)), "b": jnp.ones((16, 32)), "c": jnp.ones((16, 32))}
    state = tx.init(params)
    x = jnp.ones((4, 16))

    def loss_fn(p, x):
        return jnp.sum(((x @ p["c"]) @ p["a"]) @ p["b"])

    def step(params, state, pending, x):
        return jax_mlpo.overlapped_step(loss_fn, tx, params, state, pending, x, groups=3,
                                        platform="cuda")  # fmt: skip

    module = _export_for_cuda(step, params, state, params, x)
    jax_mlpo.close(state)
    sends, receives = _calls(module, GROUPED[0]), _calls(module, GROUPED[1])
    assert len(sends) == 3 and len(receives) == 3 and not _calls(module), module
    leaf_ids = {"c": 2, "a": 0, "b": 1}  # each leaf's index in the engine (pytree order)
    shapes = {"a": "32x16", "b": "16x32", "c": "16x32"}
    sent = {}
    for group, name in enumerate(["c", "a", "b"]):  # numbered in forward order
        attrs = f"f32_updates = false, group = {group} : i32, groups = 3 : i32, "
        attrs += f"leaf_ids = dense<{leaf_ids[name]}> : tensor<1xi32>"
        (send,) = [c for c in sends if attrs in c]
        (receive,) = [c for c in receives if attrs.replace("f32_updates = false, ", "") in c]
        assert "has_side_effect = true" in send and "has_side_effect = true" in receive
        el = f"tensor<{shapes[name]}xf32>"
        assert send[send.rindex(": (") :].startswith(
            f": (tensor<i32>, tensor<i32>, tensor<{NUM_SCALARS}xf32>, {el}, {el}) -> tensor<i32> "
        ), send
        assert receive[receive.rindex(": (") :].startswith(
            ": (tensor<i32>, tensor<i32>, tensor<i32>) -> (tensor<i32>, " + el + ") "
        ), receive
        sent[group] = re.match(r"\s*(%[\w#]+)", send).group(1)
    # every receive takes every send's token, in group order
    tokens = ", ".join(sent[g] for g in range(3))
    assert all(f"({tokens})" in r for r in receives), (tokens, receives)


def test_an_overlapped_step_exported_without_a_platform_splits_as_its_backend_does(tmp_path):
    """Without platform=, the split follows the default backend (here a CPU: one
    jax_mlpo_host_update call per group), whatever platform the export is for."""
    config = jax_mlpo.OffloadConfig(
        host_cache="1MiB", subgroup_size=256, tiers=[jax_mlpo.FileTier(str(tmp_path / "t"))]
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)
    params = {"a": jnp.ones((32, 16)), "b": jnp.ones((16, 8))}
    state = tx.init(params)
    x = jnp.ones((4, 32))

    def step(params, state, pending, x):
        def loss_fn(p, x):
            return jnp.sum((x @ p["a"]) @ p["b"])

        return jax_mlpo.overlapped_step(loss_fn, tx, params, state, pending, x, groups=2)

    module = _export_for_cuda(step, params, state, params, x)
    jax_mlpo.close(state)
    assert jax.default_backend() == "cpu"
    calls = _calls(module)
    assert len(calls) == 2 and all("groups = 2 : i32" in c for c in calls), calls
    assert not _calls(module, GROUPED[0])
