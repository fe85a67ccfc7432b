"""jax_mlpo.muon against optax.contrib.muon: the host passes' kernels, parity across layouts,
tiers and modes (matrices split over subgroups, a mesh), the wrappers, checkpoints, and what a
Muon state holds and moves; and jax_mlpo.adamw's nesterov, which Muon's other leaves use."""

from __future__ import annotations

import dataclasses

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
    SCHEDULE,
    Case,
    assert_matches_reference,
    chain,
    no_decay_on_vectors,
    offload_config,
    optax_optimizer,
    run_offloaded,
)
from processes import run_data_parallel

import jax_mlpo
from jax_mlpo import native
from jax_mlpo.engine.layout import build_layout
from jax_mlpo.engine.plan import StateShape, split_host_cache
from jax_mlpo.optimizers.adamw import adamw_step_reference
from jax_mlpo.optimizers.muon import apply_step_reference, momentum_step_reference
from jax_mlpo.types import BF16, F32, AdamWHyper, ApplyHyper, MomentumHyper

# Matrices as a transformer's, with a vector AdamW updates; 388,120 params in subgroups of
# 65,536, so every matrix spans subgroups.
MATRICES = {"a_w": (384, 520), "b_bias": (520,), "c_w": (520, 362)}
# Newton-Schulz normalizes each momentum by its norm, a sum XLA orders by how it compiles the
# program around it: the parity suite's (1, 1000003) leaf moves by 7e-7 of its largest update
# per step between optax's program and this one (measured), so runs are 20 steps.
STEPS = 20
# With bfloat16 params the update is returned in bfloat16 and rounded once: where that lands a
# bfloat16 ulp off bf16(master) (within the suite's per-element bound), the element differs.
# Muon's orthogonalized step moves every element of a matrix by a similar amount, so more of
# them than AdamW's take that rounding: 0.35% of the (1, 1000003) leaf (0.0035% with a float32
# update), and 3 of the 520-element vector's in the matrices' run (measured).
BF16_DIFFER = 6e-3


def offloaded_muon(config, **kwargs):
    return chain(
        jax_mlpo.muon(SCHEDULE, weight_decay=0.1, weight_decay_mask=no_decay_on_vectors,
                      offload=config, **kwargs)
    )  # fmt: skip


# ---- the kernels -----------------------------------------------------------------------------


def _segment(n: int, grad_dtype, mu_dtype, seed: int):
    rng = np.random.default_rng(seed)
    m = (rng.standard_normal(n) * 0.1).astype(mu_dtype)
    grad = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(grad_dtype)
    return m, grad


MOMENTUM = MomentumHyper(beta=0.95, bc=1 - 0.95**3, bc_next=1 - 0.95**4, nesterov=True)


# (a float32 output overwrites float32 gradients only)
GRAD_OUT = [(F32, False), (F32, True), (BF16, False)]


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("mu_dtype", [F32, BF16], ids=["mu32", "mu16"])
@pytest.mark.parametrize(("grad_dtype", "in_place"), GRAD_OUT, ids=["g32", "g32-in-place", "g16"])
def test_momentum_kernel_equals_the_reference_bit_for_bit(grad_dtype, in_place, mu_dtype,
                                                          nesterov):  # fmt: skip
    """Every instruction set and variant, the output over its own float32 gradient included,
    on sizes off the vector width and above the threshold that splits a call over threads."""
    hyper = MOMENTUM._replace(nesterov=nesterov)
    for n in (1, 37, 200_003):
        m0, grad0 = _segment(n, grad_dtype, mu_dtype, seed=n)
        results = []
        for isa in ["reference", *isas()]:
            m, grad = view(n, mu_dtype), view(n, grad_dtype)
            m[...], grad[...] = m0, grad0
            out = grad if in_place else view(n)
            step = momentum_step_reference if isa == "reference" else native.momentum_step
            step(m, grad, out, hyper)
            results.append((isa, m.copy(), out.copy()))
        _, *want = results[0]
        for isa, *got in results[1:]:
            for name, a, b in zip(("m", "out"), got, want, strict=True):
                assert_bits_equal(a, b, f"{isa} n={n} {name}")


@pytest.mark.parametrize("out", ["update", "in_place", "master_f32", "master_bf16"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_apply_kernel_equals_the_reference_bit_for_bit(wd, out):
    hyper = ApplyHyper(lr=3e-3, weight_decay=wd)
    for n in (1, 37, 200_003):
        rng = np.random.default_rng(n)
        d0, param0 = rng.standard_normal(n).astype(F32), rng.standard_normal(n).astype(F32)
        results = []
        for isa in ["reference", *isas()]:
            d, param = view(n), view(n)
            d[...], param[...] = d0, param0
            kwargs = {}
            if out in ("update", "in_place"):
                update = d if out == "in_place" else view(n)
            else:
                update = view(n, BF16 if out == "master_bf16" else F32)
                kwargs = {"update_param": True, "delta_base": param0.astype(BF16),
                          "param_bf16_out": view(n, BF16)}  # fmt: skip
            step = apply_step_reference if isa == "reference" else native.apply_step
            step(d, param, update, hyper, **kwargs)
            results.append((isa, param.copy(), update.copy()))
        _, *want = results[0]
        for isa, *got in results[1:]:
            for name, a, b in zip(("param", "update"), got, want, strict=True):
                assert_bits_equal(a, b, f"{isa} n={n} {name}")


@pytest.mark.parametrize("mu_dtype", [jnp.float32, jnp.bfloat16], ids=["mu32", "mu16"])
def test_the_momentum_reference_is_optax_bit_for_bit(mu_dtype):
    """The momentum optax.contrib.scale_by_muon stores, and the (nesterov) momentum it hands
    Newton-Schulz, written with optax's own tree functions and jitted."""
    beta, count = 0.95, 3
    m0, grad = _segment(4099, F32, np.dtype(mu_dtype), seed=1)

    @jax.jit
    def optax_momentum(g, m, count):
        mu = optax.tree.update_moment(g, m, beta, 1)
        count_inc = optax.safe_increment(count)
        mu_hat = jax.tree.map(
            lambda m, g: beta * m + (1 - beta) * g,
            optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc)),
            optax.tree.bias_correction(g, beta, count_inc),
        )
        return optax.tree.cast(mu, mu_dtype), mu_hat

    want_m, want_hat = optax_momentum(jnp.asarray(grad), jnp.asarray(m0), jnp.int32(count))
    # the bias corrections as the transformation's update computes them, on the device
    bc, bc_next = jax.jit(lambda c: (1 - beta ** (c + 1), 1 - beta ** (c + 2)))(count)
    m, out = np.array(m0), np.zeros(grad.size, F32)
    momentum_step_reference(m, grad, out, MomentumHyper(beta, float(bc), float(bc_next), True))
    assert_bits_equal(m, want_m, "momentum")
    # The blend b m' + (1 - b) g' has two products, and XLA:CPU fuses one or the other into an
    # fma depending on what else the program computes from m (measured: the first when m is
    # also an output, the second here with a bfloat16 m). The reference fuses the first, so
    # they agree to two roundings of the larger product: what the program around optax changes.
    terms = np.maximum(np.abs(beta * m.astype(F32) / float(bc_next)),
                       np.abs((1 - beta) * grad / float(bc)))  # fmt: skip
    err = np.abs(out.astype(np.float64) - np.asarray(want_hat, np.float64))
    assert np.all(err <= 2.0**-22 * terms), np.max(err / terms)


def test_the_nesterov_adamw_reference_is_optax_bit_for_bit():
    """jax_mlpo.adamw(nesterov=True)'s element math is a jitted optax.adamw(nesterov=True)
    update's, moments included."""
    n, lr, wd = 4099, 3e-3, 0.1
    rng = np.random.default_rng(3)
    grad = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(F32)
    param = rng.standard_normal(n).astype(F32)
    m0 = (rng.standard_normal(n) * 0.1).astype(F32)
    v0 = np.abs(rng.standard_normal(n) * 0.01).astype(F32)
    tx = optax.adamw(lr, weight_decay=wd, nesterov=True)
    state = tx.init(jnp.asarray(param))
    count = 4
    state = (state[0]._replace(count=jnp.int32(count), mu=jnp.asarray(m0), nu=jnp.asarray(v0)),
             *state[1:])  # fmt: skip
    want_u, want_state = jax.jit(tx.update)(jnp.asarray(grad), state, jnp.asarray(param))
    bc1, bc2, bc1_next = jax.jit(
        lambda c: (1 - 0.9 ** (c + 1), 1 - 0.999 ** (c + 1), 1 - 0.9 ** (c + 2))
    )(count)
    hyper = AdamWHyper(float(bc1), float(bc2), lr, 0.9, 0.999, 1e-8, wd, nesterov=True,
                       bc1_next=float(bc1_next))  # fmt: skip
    for kernel in (adamw_step_reference, native.adamw_step):
        m, v, update = m0.copy(), v0.copy(), np.zeros(n, F32)
        kernel(m, v, grad, param, update, hyper)
        assert_bits_equal(m, want_state[0].mu, f"{kernel.__name__} m")
        assert_bits_equal(v, want_state[0].nu, f"{kernel.__name__} v")
        assert_bits_equal(update, want_u, f"{kernel.__name__} update")


def test_nesterov_is_refused_with_q8_moments(tmp_path):
    with pytest.raises(ValueError, match="nesterov=True needs float32 or bfloat16"):
        jax_mlpo.adamw(1e-3, nesterov=True, mu_dtype="q8", offload=_config(tmp_path / "t"))


# ---- parity with optax.contrib.muon ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parity_jit(case, dtype, tmp_path):
    """The parity suite's layouts: its (1, 1000003) leaf is a matrix to optax.contrib.muon."""
    config = offload_config(case, dtype, tmp_path, moments=2)
    params = run_offloaded(offloaded_muon(config), dtype, "jit", steps=STEPS)
    assert_matches_reference(params, dtype, optimizer="muon", steps=STEPS,
                             max_differ=BF16_DIFFER)  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_parity_with_matrices_split_over_subgroups_and_two_tiers(dtype, tmp_path):
    """Transformer-shaped matrices, each cut by subgroup boundaries, on two tiers with part of
    the state in the host cache."""
    case = Case("matrices-2tiers", 65_536, 2, "part")
    config = offload_config(case, dtype, tmp_path, moments=2)
    params = run_offloaded(offloaded_muon(config), dtype, "jit", shapes=MATRICES, steps=STEPS)
    assert_matches_reference(params, dtype, optimizer="muon", shapes=MATRICES, steps=STEPS,
                             max_differ=BF16_DIFFER)  # fmt: skip


def test_parity_bf16_with_float32_update(tmp_path):
    """With a float32 update the suite's tight bound holds (0.1% of elements may differ)."""
    config = offload_config(CASES[1], jnp.bfloat16, tmp_path, moments=2)
    tx = offloaded_muon(config, update_dtype=jnp.float32)
    params = run_offloaded(tx, jnp.bfloat16, "jit", steps=STEPS)
    assert_matches_reference(params, jnp.bfloat16, update_bf16=False, optimizer="muon",
                             steps=STEPS)  # fmt: skip


@pytest.mark.parametrize("mode", ["eager", "nnx"])
def test_parity_eager_and_nnx(mode, tmp_path):
    """Eagerly and in an nnx.Optimizer, against optax.contrib.muon run the same way."""
    case = Case("matrices-2tiers", 65_536, 2, "none")
    config = offload_config(case, jnp.float32, tmp_path, moments=2)
    got = run_offloaded(offloaded_muon(config), jnp.float32, mode, shapes=MATRICES, steps=STEPS)
    want = run_offloaded(chain(optax_optimizer("muon")), jnp.float32, mode, offloaded=False,
                         shapes=MATRICES, steps=STEPS)  # fmt: skip
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_parity_with_a_bfloat16_momentum_and_no_nesterov(tmp_path):
    config = offload_config(CASES[2], jnp.float32, tmp_path, moments=2)
    tx = offloaded_muon(config, mu_dtype=jnp.bfloat16, nesterov=False)
    got = run_offloaded(tx, jnp.float32, "jit", shapes=MATRICES, steps=STEPS)
    ref = optax.contrib.muon(SCHEDULE, weight_decay=0.1, weight_decay_mask=no_decay_on_vectors,
                             mu_dtype=jnp.bfloat16, nesterov=False)  # fmt: skip
    want = run_offloaded(chain(ref), jnp.float32, "jit", offloaded=False, shapes=MATRICES,
                         steps=STEPS)  # fmt: skip
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_dimension_numbers_adaptive_and_a_preset(tmp_path):
    """Muon's options pass through: explicit dimension numbers (a 3-D leaf as a batch of
    matrices, a matrix left to AdamW), adaptive scaling, consistent RMS, a preset's name."""
    shapes = {"a_w": (4, 48, 40), "b_bias": (40,), "c_w": (40, 56)}
    dims = {"a_w": optax.contrib.MuonDimensionNumbers(1, 2), "b_bias": None, "c_w": None}
    kwargs = dict(muon_weight_dimension_numbers=dims, adaptive=True, consistent_rms=0.2,
                  ns_coeffs="dion", ns_steps=5)  # fmt: skip
    config = offload_config(Case("small", 4096, 1, "none"), jnp.float32, tmp_path, moments=2)
    got = run_offloaded(offloaded_muon(config, **kwargs), jnp.float32, "jit", shapes=shapes,
                        steps=STEPS)  # fmt: skip
    ref = optax.contrib.muon(SCHEDULE, weight_decay=0.1, weight_decay_mask=no_decay_on_vectors,
                             **kwargs)  # fmt: skip
    want = run_offloaded(chain(ref), jnp.float32, "jit", offloaded=False, shapes=shapes,
                         steps=STEPS)  # fmt: skip
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_adamw_nesterov_parity(tmp_path):
    """jax_mlpo.adamw(nesterov=True) against optax.adamw(nesterov=True) on the parity suite."""
    config = offload_config(CASES[1], jnp.float32, tmp_path)
    tx = chain(jax_mlpo.adamw(SCHEDULE, weight_decay=0.1, mask=no_decay_on_vectors,
                              nesterov=True, offload=config))  # fmt: skip
    got = run_offloaded(tx, jnp.float32, "jit")
    ref = optax.adamw(SCHEDULE, weight_decay=0.1, mask=no_decay_on_vectors, nesterov=True)
    want = run_offloaded(chain(ref), jnp.float32, "jit", offloaded=False)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


# ---- the state -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_the_state_is_the_momentum_and_moves_a_third_less_than_adamw(dtype, tmp_path):
    """A matrix's state is 4 (float32) or 8 (bfloat16, with its master) bytes per param against
    AdamW's 8 and 12, in engines of their own tier subdirectories; a step moves that much
    less."""
    n, sub = 1024, 16_384
    master = 4 if dtype == jnp.bfloat16 else 0
    moved = {}
    for name, factory, per_param in (("adamw", jax_mlpo.adamw, 8 + master),
                                     ("muon", jax_mlpo.muon, 4 + master)):  # fmt: skip
        tier = tmp_path / name
        config = jax_mlpo.OffloadConfig(host_cache=3 * 12 * sub, subgroup_size=sub,
                                        prefetch_depth=1, tiers=[jax_mlpo.FileTier(str(tier))],
                                        read_ahead=False)  # fmt: skip
        tx = factory(1e-3, offload=config)
        params = {"w": jnp.zeros((n, n), dtype)}
        state = tx.init(params)
        engines = [
            jax_mlpo.engine_of(s) for s in jax_mlpo.transforms.opt_state.find_offloaded(state)
        ]
        # an empty group's engine (Muon's AdamW here; its master for float32) holds nothing
        engines = [e for e in engines if e.layout.num_params]
        assert len(engines) == (1 if name == "adamw" else 1 + bool(master))
        assert sum(e.layout.state_bytes for e in engines) == per_param * n * n
        for _ in range(2):
            grads = {"w": jnp.full((n, n), 0.1, dtype) + jnp.eye(n, dtype=dtype)}
            _, state = jax.jit(tx.update)(grads, state, params)
        jax.effects_barrier()  # the host updates have run
        total = 0
        for engine in engines:
            engine.drain()
            last = engine.metrics[-1]
            assert last.subgroups - last.cache_hits >= 40  # most came from the tier
            total += sum(last.bytes_read.values()) + sum(last.bytes_written.values())
        moved[name] = total
        # jax_mlpo.metrics reports the step of every engine, not the first one's
        steps = jax_mlpo.metrics(state)
        assert len(steps) == 2
        assert sum(steps[-1].bytes_read.values()) + sum(steps[-1].bytes_written.values()) == total
        assert steps[-1].subgroups == sum(e.metrics[-1].subgroups for e in engines)
        if name == "muon":
            parts = sorted(p.name for p in tier.iterdir() if p.is_dir())
            assert parts == ["adam", "master", "momentum"]
            # an empty group's engine (AdamW's here; the master's for float32) holds no blob
            assert not list((tier / "adam").glob("state-*"))
            assert bool(master) == bool(list((tier / "master").glob("state-*")))
        jax_mlpo.close(state)
    assert moved["muon"] / moved["adamw"] == pytest.approx((4 + master) / (8 + master), rel=0.1)


def test_the_host_cache_is_shared_in_proportion_and_never_exceeded(tmp_path):
    """Each engine gets its pipeline's minimum (or its whole state, if smaller), the rest in
    proportion to what it still has on the tiers; the shares never sum above host_cache."""
    sub = 1000
    layouts = [
        build_layout([jnp.zeros((40_000,))], sub, None, (F32,), ("mu",)),  # 4 B/param
        build_layout([jnp.zeros((10_000,))], sub, None, (F32, F32)),  # 8 B/param
        build_layout([jnp.zeros((100,))], sub, None, (F32, F32)),  # smaller than a pipeline
    ]
    config = jax_mlpo.OffloadConfig(host_cache=100_000, subgroup_size=sub, prefetch_depth=1,
                                    tiers=[jax_mlpo.FileTier(str(tmp_path / "t"))])  # fmt: skip
    shapes = [StateShape.of(x) for x in layouts]
    shares = split_host_cache(config, shapes)
    need = [3 * 4 * sub, 3 * 8 * sub, 800]  # (1 x 1 tier + 2) buffers, or the whole state
    assert sum(shares) <= config.host_cache
    assert all(s >= n for s, n in zip(shares, need, strict=True))
    assert shares[2] == 800
    rest = [s - n for s, n in zip(shares, need, strict=True)]
    left = [160_000 - need[0], 80_000 - need[1]]  # each state's bytes beyond its minimum
    assert rest[0] / rest[1] == pytest.approx(left[0] / left[1], rel=1e-3)
    roomy = dataclasses.replace(config, host_cache=10**6)
    assert split_host_cache(roomy, shapes) == [160_000, 80_000, 800]  # all host-resident


def test_a_host_cache_below_the_engines_pipelines_names_the_size(tmp_path):
    config = jax_mlpo.OffloadConfig(host_cache=4096, subgroup_size=4096, prefetch_depth=1,
                                    tiers=[jax_mlpo.FileTier(str(tmp_path / "t"))])  # fmt: skip
    tx = jax_mlpo.muon(1e-3, offload=config)
    with pytest.raises(jax_mlpo.ConfigError, match=r"raise host_cache to at least \d+"):
        tx.init({"w": jnp.zeros((256, 256)), "b": jnp.zeros((256,))})


def test_refusals_name_the_cause(tmp_path):
    config = _config(tmp_path / "t")
    with pytest.raises(ValueError, match="eps_root"):
        jax_mlpo.muon(1e-3, adam_eps_root=1e-8, offload=config)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        jax_mlpo.muon(1e-3, mu_dtype="q8", offload=config)
    with pytest.raises(ValueError, match=r"jax_mlpo.muon cannot be wrapped in optax.MultiSteps"):
        optax.MultiSteps(jax_mlpo.muon(1e-3, offload=config), 2).init(small_params())


# ---- wrappers and loops ----------------------------------------------------------------------


# what the loops change by hand mid-run
CHANGES = {"learning_rate": 3e-3, "beta": 0.5}


def _config(path):
    return jax_mlpo.OffloadConfig(host_cache=3 * 12 * 256, subgroup_size=256, prefetch_depth=1,
                                  tiers=[jax_mlpo.FileTier(str(path))])  # fmt: skip


def test_inject_hyperparams_matches_optax(tmp_path):
    """The learning rate, beta and both weight decays as per-step arrays, two changed mid-run:
    the run follows optax.inject_hyperparams(optax.contrib.muon)."""
    hp = dict(learning_rate=1e-2, beta=0.9, weight_decay=0.05, adam_weight_decay=0.05)
    static = ("ns_steps", "offload")
    want, _ = run_small(optax.inject_hyperparams(optax.contrib.muon, static_args=static[:1])(**hp),
                   8, change_at=5, changes=CHANGES)  # fmt: skip
    tx = optax.inject_hyperparams(jax_mlpo.muon, static_args=static)(
        **hp, offload=_config(tmp_path / "tier"))  # fmt: skip
    got, state = run_small(tx, 8, change_at=5, changes=CHANGES)
    assert len(jax_mlpo.metrics(state)) == 8
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
    jax_mlpo.close(state)


def test_multi_steps_matches_optax(tmp_path):
    want, _ = run_small(optax.MultiSteps(optax.contrib.muon(1e-2, weight_decay=0.1),
                                    every_k_schedule=3), 9)  # fmt: skip
    tx = jax_mlpo.MultiSteps(
        jax_mlpo.muon(1e-2, weight_decay=0.1, offload=_config(tmp_path / "tier")),
        every_k_schedule=3,
    )
    got, state = run_small(tx, 9)
    assert len(jax_mlpo.metrics(state)) == 3
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
    jax_mlpo.close(state)


# ---- checkpoints -----------------------------------------------------------------------------


def test_on_a_mesh_in_the_loops_own_manager_resumes_exactly(tmp_path):
    """The NNX loop on a 2x2 mesh with jax_mlpo.muon (Newton-Schulz on sharded momenta), saved
    by its own orbax manager and resumed in a new process: bit for bit the uninterrupted run,
    which follows optax.contrib.muon."""
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    want, whole, _ = run_loops(("nnx", "optax-muon", "all", tmp_path / "optax"),
                               ("nnx", "mlpo-muon", "all", tmp_path / "whole"),
                               ("nnx", "mlpo-muon", "first", tmp_path / "split"))  # fmt: skip
    [resumed] = run_loops(("nnx", "mlpo-muon", "resume", tmp_path / "split"))
    assert whole["devices"] == 4 and resumed["updates_run"] == 3
    assert resumed["params"] == whole["params"]
    for name in want["params"]:
        np.testing.assert_allclose(whole["params"][name], want["params"][name], rtol=1e-6,
                                   atol=1e-6, err_msg=name)  # fmt: skip


def test_data_parallel_over_processes_matches_one_process(tmp_path):
    """jax_mlpo.muon on 2 processes (jax.distributed; each process's engines hold its shards,
    Newton-Schulz runs on the momenta sharded over both): the single-process run's params."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    want, _, _ = run_data_parallel(1, tmp_path / "one", mode="muon")
    got, infos, _ = run_data_parallel(2, tmp_path / "two", mode="muon")
    assert all(not info["host_only"] for info in infos)
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=0, atol=1e-6, err_msg=name)


def test_linen_train_state_follows_optax(tmp_path):
    """A linen TrainState on the 2x2 mesh: jax_mlpo.muon's run is optax.contrib.muon's."""
    want, got = run_loops(("linen", "optax-muon", "all", tmp_path),
                          ("linen", "mlpo-muon", "all", tmp_path))  # fmt: skip
    for name in want["params"]:
        np.testing.assert_allclose(got["params"][name], want["params"][name], rtol=1e-6,
                                   atol=1e-6, err_msg=name)  # fmt: skip


def test_checkpoint_restores_across_layouts(tmp_path):
    """A Muon state (bfloat16 params: momentum, master and AdamW engines) saved with one
    subgroup size restores into another layout, and its next update is the saved state's."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), small_params())
    tx = jax_mlpo.muon(1e-2, offload=_config(tmp_path / "a"))
    state = tx.init(params)
    for i in range(2):
        _, state = jax.jit(tx.update)(small_grads(i, params), state, params)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(2, args=jax_mlpo.checkpoint.OffloadSave({"opt": state}))
    mngr.wait_until_finished()
    other = jax_mlpo.OffloadConfig(host_cache=6 * 12 * 100, subgroup_size=100, prefetch_depth=1,
                                   tiers=[jax_mlpo.FileTier(str(tmp_path / "b"))])  # fmt: skip
    fresh_tx = jax_mlpo.muon(1e-2, offload=other)
    restored = mngr.restore(
        2, args=jax_mlpo.checkpoint.OffloadRestore({"opt": fresh_tx.init(params)})
    )["opt"]
    want, _ = jax.jit(tx.update)(small_grads(2, params), state, params)
    got, _ = jax.jit(fresh_tx.update)(small_grads(2, params), restored, params)
    for leaf in want:
        np.testing.assert_array_equal(got[leaf], want[leaf], err_msg=leaf)
    mngr.close()
    jax_mlpo.close((state, restored))
