"""jax_mlpo.lion against optax.lion: the kernel, parity across layouts and tiers, the wrappers,
checkpoints in the loop's own manager on a mesh, and what a Lion state moves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_bits_equal, isas, run_small, small_grads, small_params, view
from loops import run_loops
from parity import (
    CASES,
    NUM_PARAMS,
    SCHEDULE,
    assert_matches_reference,
    chain,
    no_decay_on_vectors,
    offload_config,
    optax_optimizer,
    run_offloaded,
)

import jax_mlpo
from jax_mlpo import native
from jax_mlpo.optimizers.lion import lion_step_reference
from jax_mlpo.types import BF16, F32, LionHyper

SUBGROUP = 65_536  # 16 subgroups of the state, 3 of them in the host cache
HYPER = LionHyper(lr=3e-3, b1=0.9, b2=0.99, weight_decay=0.1)


def offloaded_lion(config, **kwargs):
    return chain(
        jax_mlpo.lion(SCHEDULE, weight_decay=0.1, mask=no_decay_on_vectors, offload=config,
                      **kwargs)
    )  # fmt: skip


# ---- the kernel ------------------------------------------------------------------------------


def _segment(n: int, grad_dtype, mu_dtype, seed: int):
    rng = np.random.default_rng(seed)
    m = (rng.standard_normal(n) * 0.1).astype(mu_dtype)
    m[:7] = 0.0  # with zero gradients below: sign(+-0) is +-0, as jnp.sign's
    grad = (rng.standard_normal(n) * 0.1).astype(grad_dtype)
    grad[:7] = 0.0
    param = rng.standard_normal(n).astype(F32)
    return m, grad, param


@pytest.mark.parametrize("out", ["update", "in_place", "master_f32", "master_bf16"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("mu_dtype", [F32, BF16], ids=["mu32", "mu16"])
@pytest.mark.parametrize("grad_dtype", [F32, BF16], ids=["g32", "g16"])
def test_native_kernel_equals_the_reference_bit_for_bit(grad_dtype, mu_dtype, wd, out):
    """Every instruction set, every variant: the moment, the update and the master in place,
    the update written over its own gradient, bfloat16 outputs; sizes off the vector width and
    above the threshold that splits a call over threads."""
    hyper = HYPER._replace(weight_decay=wd)
    for n in (1, 37, 200_003):
        m0, grad0, param0 = _segment(n, grad_dtype, mu_dtype, seed=n)
        results = []
        for isa in ["reference", *isas()]:
            m, param = view(n, mu_dtype), view(n)
            m[...], param[...] = m0, param0
            grad = view(n, grad_dtype)
            grad[...] = grad0
            kwargs = {}
            if out == "update":
                update = view(n)
            elif out == "in_place":
                update = grad if grad_dtype == F32 else view(n)
            else:
                base = param0.astype(BF16)
                update = view(n, BF16 if out == "master_bf16" else F32)
                kwargs = {"update_param": True, "delta_base": base,
                          "param_bf16_out": view(n, BF16)}  # fmt: skip
            step = lion_step_reference if isa == "reference" else native.lion_step
            step(m, grad, param, update, hyper, **kwargs)
            results.append((isa, m.copy(), param.copy(), update.copy()))
        _, *want = results[0]
        for isa, *got in results[1:]:
            for name, a, b in zip(("m", "param", "update"), got, want, strict=True):
                assert_bits_equal(a, b, f"{isa} n={n} {name}")


def test_the_reference_is_optax_lion_bit_for_bit():
    """The reference's float32 operations are a jitted optax.lion update's, moment included,
    with float32 and bfloat16 moments."""
    n = 4099
    m0, grad, param = _segment(n, F32, F32, seed=1)
    for mu_dtype in (jnp.float32, jnp.bfloat16):
        tx = optax.lion(HYPER.lr, HYPER.b1, HYPER.b2, mu_dtype=mu_dtype,
                        weight_decay=HYPER.weight_decay)  # fmt: skip
        state = tx.init(jnp.asarray(param))
        state = (state[0]._replace(mu=jnp.array(m0, mu_dtype)), *state[1:])
        want_u, want_state = jax.jit(tx.update)(jnp.asarray(grad), state, jnp.asarray(param))
        jax.block_until_ready(want_state)  # before the reference changes m in place
        m = np.array(m0, np.dtype(mu_dtype))
        update = np.zeros(n, F32)
        lion_step_reference(m, grad, param, update, HYPER)
        assert_bits_equal(update, want_u, f"update, mu {mu_dtype}")
        assert_bits_equal(m, want_state[0].mu, f"moment, mu {mu_dtype}")


def test_the_kernel_refuses_overlapping_outputs():
    m, grad, param = _segment(64, F32, F32, seed=2)
    with pytest.raises(ValueError, match="overlap"):
        native.lion_step(m, grad, param, m, HYPER)


# ---- parity with optax.lion ------------------------------------------------------------------


# Lion's update is the sign of an interpolation: where it is near zero, a gradient one ulp off
# flips the step by 2 lr. So each run is compared with optax.lion fed the same gradient bits:
# the jitted step here, the same mode below. With bfloat16 params, more elements than AdamW's
# take the update's one bfloat16 rounding (every element moves by the full lr, where AdamW's
# normalised step is smaller for most): 0.155% of them here, within the same per-element bound.
BF16_DIFFER = 2e-3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parity_jit(case, dtype, tmp_path):
    config = offload_config(case, dtype, tmp_path, moments=1)
    params = run_offloaded(offloaded_lion(config), dtype, "jit")
    assert_matches_reference(params, dtype, optimizer="lion", max_differ=BF16_DIFFER)


@pytest.mark.parametrize("mode", ["eager", "nnx"])
def test_parity_eager_and_nnx(mode, tmp_path):
    """Eagerly and in an nnx.Optimizer, against optax.lion run the same way."""
    config = offload_config(CASES[1], jnp.float32, tmp_path, moments=1)
    got = run_offloaded(offloaded_lion(config), jnp.float32, mode)
    want = run_offloaded(chain(optax_optimizer("lion")), jnp.float32, mode, offloaded=False)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_parity_with_a_bfloat16_moment(tmp_path):
    config = offload_config(CASES[2], jnp.float32, tmp_path, moments=1)
    params = run_offloaded(offloaded_lion(config, mu_dtype=jnp.bfloat16), jnp.float32, "jit")
    assert_matches_reference(params, jnp.float32, mu_dtype=jnp.bfloat16, optimizer="lion")


def test_parity_bf16_with_float32_update(tmp_path):
    config = offload_config(CASES[1], jnp.bfloat16, tmp_path, moments=1)
    tx = offloaded_lion(config, update_dtype=jnp.float32)
    params = run_offloaded(tx, jnp.bfloat16, "jit")
    assert_matches_reference(params, jnp.bfloat16, update_bf16=False, optimizer="lion")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_the_state_is_one_moment_and_moves_a_third_less_than_adamw(dtype, tmp_path):
    """4 (float32 params) or 8 (bfloat16, with the master) bytes per param, against AdamW's 8
    and 12; a step of the same layout reads and writes that many bytes fewer."""
    moved = {}
    master = 4 if dtype == jnp.bfloat16 else 0
    for name, factory, moments in (("adamw", jax_mlpo.adamw, 2), ("lion", jax_mlpo.lion, 1)):
        per_param = 4 * moments + master
        config = jax_mlpo.OffloadConfig(
            host_cache=3 * per_param * SUBGROUP, subgroup_size=SUBGROUP, prefetch_depth=1,
            tiers=[jax_mlpo.FileTier(str(tmp_path / name))], read_ahead=False,
        )  # fmt: skip
        tx = factory(1e-3, offload=config)
        params = {"w": jnp.zeros((NUM_PARAMS,), dtype)}
        state = tx.init(params)
        engine = jax_mlpo.engine_of(state)
        assert engine.layout.state_bytes == per_param * NUM_PARAMS
        for _ in range(2):
            _, state = jax.jit(tx.update)({"w": jnp.full((NUM_PARAMS,), 0.1, dtype)}, state,
                                          params)  # fmt: skip
        engine.drain()
        last = jax_mlpo.metrics(state)[-1]
        moved[name] = (per_param, sum(last.bytes_read.values()) + sum(last.bytes_written.values()))
        assert last.subgroups - last.cache_hits >= 10  # most subgroups came from the tier
        jax_mlpo.close(state)
    assert moved["adamw"][0] == master + 8 and moved["lion"][0] == master + 4
    ratio = moved["lion"][1] / moved["adamw"][1]
    assert ratio == pytest.approx(moved["lion"][0] / moved["adamw"][0], rel=0.05)


# ---- wrappers and loops ----------------------------------------------------------------------


# what the loops change by hand mid-run
CHANGES = {"learning_rate": 3e-3, "b1": 0.5}


def _config(path):
    return jax_mlpo.OffloadConfig(host_cache=3 * 4 * 256, subgroup_size=256, prefetch_depth=1,
                                  tiers=[jax_mlpo.FileTier(str(path))])  # fmt: skip


def test_inject_hyperparams_matches_optax(tmp_path):
    """The learning rate, b1, b2 and weight decay as per-step arrays, two of them changed
    mid-run: the run follows optax.inject_hyperparams(optax.lion), with one engine."""
    hp = dict(learning_rate=1e-2, b1=0.8, b2=0.95, weight_decay=0.05)
    want, _ = run_small(optax.inject_hyperparams(optax.lion)(**hp), 8, change_at=5, changes=CHANGES)
    tx = optax.inject_hyperparams(jax_mlpo.lion, static_args="offload")(
        **hp, offload=_config(tmp_path / "tier"))  # fmt: skip
    got, state = run_small(tx, 8, change_at=5, changes=CHANGES)
    assert len(jax_mlpo.metrics(state)) == 8
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    jax_mlpo.close(state)


def test_multi_steps_matches_optax(tmp_path):
    """jax_mlpo.MultiSteps(jax_mlpo.lion) against optax.MultiSteps(optax.lion): the same params
    and one host update per 3 micro-steps."""
    want, _ = run_small(optax.MultiSteps(optax.lion(1e-2, weight_decay=0.1), every_k_schedule=3), 9)
    tx = jax_mlpo.MultiSteps(
        jax_mlpo.lion(1e-2, weight_decay=0.1, offload=_config(tmp_path / "tier")),
        every_k_schedule=3,
    )
    got, state = run_small(tx, 9)
    assert len(jax_mlpo.metrics(state)) == 3
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    jax_mlpo.close(state)


def test_optax_multi_steps_is_refused_naming_lion(tmp_path):
    with pytest.raises(ValueError, match=r"jax_mlpo.lion cannot be wrapped in optax.MultiSteps"):
        optax.MultiSteps(jax_mlpo.lion(1e-3, offload=_config(tmp_path / "t")), 2).init(
            small_params()
        )


def test_q8_moment_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        jax_mlpo.lion(1e-3, mu_dtype="q8", offload=_config(tmp_path / "t"))


# ---- checkpoints -----------------------------------------------------------------------------


def test_checkpoint_on_a_mesh_in_the_loops_own_manager_resumes_exactly(tmp_path):
    """The NNX loop on a 2x2 mesh with jax_mlpo.lion, saved by its own orbax manager and
    resumed in a new process: bit for bit the uninterrupted run, which follows optax.lion."""
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    want, whole, _ = run_loops(("nnx", "optax-lion", "all", tmp_path / "optax"),
                               ("nnx", "mlpo-lion", "all", tmp_path / "whole"),
                               ("nnx", "mlpo-lion", "first", tmp_path / "split"))  # fmt: skip
    [resumed] = run_loops(("nnx", "mlpo-lion", "resume", tmp_path / "split"))
    assert whole["devices"] == 4 and resumed["updates_run"] == 3
    assert resumed["params"] == whole["params"]
    for name in want["params"]:
        np.testing.assert_allclose(whole["params"][name], want["params"][name], rtol=1e-6,
                                   atol=1e-7, err_msg=name)  # fmt: skip
    saved = tmp_path / "split" / "ckpt" / "3" / "default" / "jax_mlpo_state"
    assert saved.is_dir() and not list(saved.rglob("nu*"))  # one moment saved


def test_checkpoint_restores_across_layouts_and_refuses_adamw(tmp_path):
    """A Lion state saved with one subgroup size restores into another layout, and its next
    update is the saved state's; restoring it into an AdamW state names the mismatch."""
    params = small_params()
    tx = jax_mlpo.lion(1e-2, offload=_config(tmp_path / "a"))
    state = tx.init(params)
    for i in range(2):
        _, state = jax.jit(tx.update)(small_grads(i, params), state, params)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(2, args=jax_mlpo.checkpoint.OffloadSave({"opt": state}))
    mngr.wait_until_finished()
    other = jax_mlpo.OffloadConfig(host_cache=4 * 4 * 100, subgroup_size=100, prefetch_depth=1,
                                   tiers=[jax_mlpo.FileTier(str(tmp_path / "b"))])  # fmt: skip
    fresh_tx = jax_mlpo.lion(1e-2, offload=other)
    restored = mngr.restore(
        2, args=jax_mlpo.checkpoint.OffloadRestore({"opt": fresh_tx.init(params)})
    )["opt"]
    want, _ = jax.jit(tx.update)(small_grads(2, params), state, params)
    got, _ = jax.jit(fresh_tx.update)(small_grads(2, params), restored, params)
    for leaf in want:
        np.testing.assert_array_equal(got[leaf], want[leaf], err_msg=leaf)
    adamw_config = jax_mlpo.OffloadConfig(host_cache=3 * 8 * 256, subgroup_size=256,
                                          tiers=[jax_mlpo.FileTier(str(tmp_path / "c"))],
                                          prefetch_depth=1)  # fmt: skip
    adamw_tx = jax_mlpo.adamw(1e-2, offload=adamw_config)
    adamw_state = adamw_tx.init(params)
    with pytest.raises(ValueError, match="nu"):
        mngr.restore(2, args=jax_mlpo.checkpoint.OffloadRestore({"opt": adamw_state}))
    mngr.close()
    jax_mlpo.close((state, restored, adamw_state))
