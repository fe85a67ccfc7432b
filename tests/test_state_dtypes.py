"""Moments stored in bfloat16 (``mu_dtype``, ``nu_dtype``): the kernel's bits on every
instruction set, parity with ``optax.adamw(mu_dtype=jnp.bfloat16)`` (params and the stored first
moment bit for bit) across layouts, tiers and modes, and checkpoints restored across dtypes."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import parity as tt
import pytest
from helpers import assert_bits_equal, isas, view
from helpers import make_hyper as _hyper
from helpers import problem as _problem

import jax_mlpo
from jax_mlpo import native
from jax_mlpo.engine.quantize import decode_reference, encode_reference
from jax_mlpo.optimizers.adamw import adamw_step_reference
from jax_mlpo.types import BF16, F32

MOMENTS = [(BF16, F32), (F32, BF16), (BF16, BF16)]
IDS = ["mu_bf16", "nu_bf16", "both_bf16"]


@pytest.mark.parametrize("moments", MOMENTS, ids=IDS)
@pytest.mark.parametrize("grad_bf16", [False, True], ids=["g_f32", "g_bf16"])
@pytest.mark.parametrize("n", [7, 70_001])  # 70_001: split over the kernel's threads
def test_native_equals_the_reference_on_every_isa(n, grad_bf16, moments):
    p0, grads = _problem(n, grad_bf16)
    want_m, want_v = view(n, moments[0]), view(n, moments[1])
    want_u = view(n)
    for t, g in enumerate(grads[:3], start=1):
        adamw_step_reference(want_m, want_v, g, p0, want_u, _hyper(t, 0.1))
    for isa in isas():
        m, v, u = view(n, moments[0]), view(n, moments[1]), view(n)
        for t, g in enumerate(grads[:3], start=1):
            native.adamw_step(m, v, g, p0, u, _hyper(t, 0.1))
        for got, want, name in ((m, want_m, "m"), (v, want_v, "v"), (u, want_u, "u")):
            assert got.dtype == want.dtype
            assert_bits_equal(got, want, f"{name} on {isa}")


def test_the_kernel_stores_optax_mu_bit_for_bit():
    """One segment against a jitted ``optax.scale_by_adam(mu_dtype=bfloat16)``: the same
    bfloat16 m after every step, and the same update (it is computed from the float32 m before
    the rounding, as optax does)."""
    n = 65_536
    p0, grads = _problem(n, False)
    opt = optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, mu_dtype=jnp.bfloat16)
    state, update = opt.init(jnp.asarray(p0)), jax.jit(opt.update)
    m, v, u = np.zeros(n, BF16), np.zeros(n, F32), np.empty(n, F32)
    hyper = _hyper(1, 0.0)._replace(lr=-1.0)  # the kernel's update times -lr: scale_by_adam's
    for t, g in enumerate(grads[:4], start=1):
        want_u, state = update(jnp.asarray(g), state)
        bc1, bc2 = (float(np.float32(1) - np.float32(b) ** np.float32(t)) for b in (0.9, 0.999))
        native.adamw_step(m, v, g, p0, u, hyper._replace(bc1=bc1, bc2=bc2))
        assert_bits_equal(m, np.asarray(state.mu), f"m at step {t}")
        assert_bits_equal(v, np.asarray(state.nu), f"v at step {t}")
        np.testing.assert_allclose(u, np.asarray(want_u), rtol=2e-7, atol=0)


def _check_mu_parity(case, dtype, mode, tmp_path):
    """float32 params: optax's params to 1e-6 and its bfloat16 m bit for bit.

    A bfloat16 m turns a last-bit difference into a whole bf16 ulp of m where m sits on a
    rounding boundary, so both sides must compute the same gradients and moments: the
    reference is a jitted step with the clipping, the context the kernel's arithmetic follows
    (test_eager_is_the_jitted_update_bit_for_bit says why eager is checked against jit).

    bfloat16 params are clipped in float32 on both sides (``max_grad_norm``); even so the
    reference's float32 m differs from ours in the last bits on most elements (77% with a
    float32 m: XLA fuses its clipping and moment update with excess precision), and a bfloat16
    m turns the few of those that sit on a rounding boundary into whole bf16 ulps of m, which
    move the master copy enough to cross a bf16 rounding boundary of the params now and then.
    So there: m bit for bit on all but 1e-4 of the elements, and the params as the bf16 suite
    but for 2e-4 of them (measured: 1.1e-4).
    """
    seen = {}
    config = tt.offload_config(case, dtype, tmp_path)
    bf16 = dtype == jnp.bfloat16
    if bf16:
        tx = jax_mlpo.adamw(
            tt.SCHEDULE, weight_decay=0.1, mask=tt.no_decay_on_vectors, offload=config,
            max_grad_norm=1.0, mu_dtype=jnp.bfloat16,
        )  # fmt: skip
    else:
        tx = tt.offloaded_adamw(config, mu_dtype=jnp.bfloat16)
    params = tt.run_offloaded(
        tx, dtype, mode, before_close=lambda s: seen.update(jax_mlpo.engine_of(s).state_dict())
    )
    ref, _, mu = tt.reference(dtype, clip_in_float32=bf16, mu_dtype=jnp.bfloat16)
    if not bf16:
        tt.assert_matches_reference(params, dtype, mu_dtype=jnp.bfloat16)
    for i, name in enumerate(tt.SHAPES):  # the leaves in tree order
        want = np.asarray(mu[name])
        assert want.dtype == BF16
        got = seen["mu"][i].astype(BF16)
        if not bf16:
            assert_bits_equal(got, want, f"mu of {name}")
            continue
        assert (got.view(np.uint16) != want.view(np.uint16)).mean() <= 1e-4, name
        g32, w32 = (np.asarray(x[name], F32) for x in (params, ref))
        differ = g32 != w32
        assert differ.mean() <= 1e-3, f"{name}: {differ.mean():.3%} of params differ"
        allowed = np.maximum(tt.bf16_ulp(w32), 1e-6 * np.maximum(1.0, np.abs(w32)))
        beyond = np.abs(g32 - w32) > allowed
        assert beyond.mean() <= 2e-4, f"{name}: {beyond.mean():.3%} beyond the bf16 suite's bound"


PARITY_CASES = [tt.CASES[0], tt.CASES[2], tt.CASES[5]]


@pytest.mark.parametrize("case", PARITY_CASES, ids=[c.name for c in PARITY_CASES])
def test_mu_bf16_matches_optax(case, tmp_path):
    _check_mu_parity(case, jnp.float32, "jit", tmp_path)


def test_mu_bf16_matches_optax_with_bf16_params(tmp_path):
    _check_mu_parity(tt.CASES[2], jnp.bfloat16, "jit", tmp_path)


def test_mu_bf16_matches_optax_through_nnx(tmp_path):
    _check_mu_parity(tt.CASES[1], jnp.float32, "nnx", tmp_path)


def test_eager_is_the_jitted_update_bit_for_bit(tmp_path):
    """Eager and jitted updates give the same params and m, bit for bit (unclipped: an eager
    optax.clip_by_global_norm sums the norm in another order than under jit).

    Not against optax eagerly: what XLA contracts into fused multiply-adds depends on what the
    moment update is fused with. In a jitted step whose gradients come from clipping it is
    ``fma(1 - b1, g, b1 * m)``, the kernel's; straight from ``jax.grad`` it is
    ``fma(b1, m, (1 - b1) * g)`` (measured: 30% of a float32 m differs after the second step).
    """
    kwargs = dict(weight_decay=0.1, mask=tt.no_decay_on_vectors, mu_dtype=jnp.bfloat16)
    runs = {}
    for mode in ("jit", "eager"):
        seen = {}
        (tmp_path / mode).mkdir()
        config = tt.offload_config(tt.CASES[1], jnp.float32, tmp_path / mode)
        tx = jax_mlpo.adamw(tt.SCHEDULE, offload=config, **kwargs)
        params = tt.run_offloaded(
            tx,
            jnp.float32,
            mode,
            lambda s, seen=seen: seen.update(jax_mlpo.engine_of(s).state_dict()),
        )
        runs[mode] = (params, seen["mu"])
    for i, name in enumerate(tt.SHAPES):
        assert_bits_equal(runs["eager"][0][name], runs["jit"][0][name], f"params {name}")
        assert_bits_equal(runs["eager"][1][i], runs["jit"][1][i], f"mu {name}")


def test_moment_dtypes_other_than_float32_bfloat16_and_q8_are_refused(tmp_path):
    config = tt.offload_config(tt.CASES[0], jnp.float32, tmp_path)
    with pytest.raises(ValueError, match="nu_dtype=float16: jax_mlpo stores moments in float32, "):
        jax_mlpo.adamw(1e-3, offload=config, nu_dtype=jnp.float16)


def narrowed(engine, wide: dict[str, list[np.ndarray]], name: str) -> list[np.ndarray]:
    """Float32 moments as ``engine`` stores them: rounded to bfloat16, or encoded as q8 (to
    nearest) segment by segment, its blocks starting where the engine's segments do."""
    signed = name == "mu"
    out = [np.array(x, F32) for x in wide[name]]
    dtype = engine.layout.moment_dtypes[0 if signed else 1]
    if dtype == BF16:
        return [x.astype(BF16).astype(F32) for x in out]
    for sg in engine.layout.subgroups:
        for seg in sg.segments:
            flat = out[seg.leaf].reshape(-1)
            code = encode_reference(flat[seg.leaf_span], signed=signed)
            flat[seg.leaf_span] = decode_reference(code, signed=signed)
    return out


NARROW = {
    "bf16": dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
    "q8": dict(mu_dtype="q8", nu_dtype="q8", q8_rounding="stochastic"),
}


@pytest.mark.parametrize("kind", list(NARROW))
def test_checkpoints_resume_narrow_moments_exactly_and_restore_across_dtypes(kind, tmp_path):
    """A checkpoint of bfloat16 or q8 moments resumes bit for bit (q8: the files hold the
    decoded values, which encode to themselves; stochastic rounding draws the same bits);
    restored into float32 moments they are widened exactly, and float32 moments restored into
    narrow ones are rounded to nearest. The manifest says which dtype the engine kept each
    array in."""
    import crash_worker as job
    from checkpoint_job import assert_states_equal, logical_state, spec_for, start_job

    from jax_mlpo import checkpoint

    bf16 = NARROW[kind]  # the narrow moments' arguments

    def start(root, **kwargs):
        spec = spec_for(tmp_path / root, "bfloat16", 1, "none", True, subgroup_size=20_011)
        return spec, *start_job(spec, **kwargs)[1:]

    spec, update, params, opt_state = start("a", **bf16)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 2)
    mngr = checkpoint.manager(spec["ckpt"], async_save=False)
    checkpoint.save(mngr, 2, params, opt_state, {"step": 2})
    saved = logical_state(opt_state)
    want, opt_state, _ = job.train(update, params, opt_state, 2, 4)
    jax_mlpo.close(opt_state)
    item = Path(spec["ckpt"]) / "2" / "opt_state"
    records = checkpoint.OffloadCheckpointHandler().metadata(item)
    stored = {k: r["state_dtype"] for k, r in records.items() if "state_dtype" in r}
    assert {v for k, v in stored.items() if "/mu/" in k or "/nu/" in k} == {
        "q8" if kind == "q8" else "bfloat16"
    }
    assert {v for k, v in stored.items() if "/master/" in k} == {"float32"}

    _, update, fresh, opt_state = start("b", **bf16)
    _, got, opt_state, _ = checkpoint.restore(mngr, fresh, opt_state)
    assert_states_equal(logical_state(opt_state), saved)
    got, opt_state, _ = job.train(update, got, opt_state, 2, 4)
    for name, bits in job.as_bits(want).items():
        assert_bits_equal(job.as_bits(got)[name], bits, f"resumed {name}")
    jax_mlpo.close(opt_state)

    _, update, fresh, opt_state = start("c")  # float32 moments: the same values, widened
    _, got, opt_state, _ = checkpoint.restore(mngr, fresh, opt_state)
    assert_states_equal(logical_state(opt_state), saved)
    got, opt_state, _ = job.train(update, got, opt_state, 2, 3)  # moments no narrow type holds
    checkpoint.save(mngr, 3, got, opt_state, {"step": 3})
    wide = logical_state(opt_state)
    jax_mlpo.close(opt_state)

    # and back into narrow moments, onto other subgroups: rounded to nearest
    spec = spec_for(tmp_path / "d", "bfloat16", 1, "none", True, subgroup_size=30_011)
    _, _, fresh, opt_state = start_job(spec, **bf16)
    mngr.reload()
    _, _, opt_state, _ = checkpoint.restore(mngr, fresh, opt_state, step=3)
    narrow = logical_state(opt_state)
    engine = jax_mlpo.engine_of(opt_state)
    for name in ("mu", "nu"):
        want = narrowed(engine, wide, name)
        assert not all(np.array_equal(a, b) for a, b in zip(want, wide[name], strict=True))
        for a, b in zip(narrow[name], want, strict=True):
            np.testing.assert_array_equal(a, b)
    jax_mlpo.close(opt_state)
    mngr.close()
