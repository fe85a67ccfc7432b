"""8-bit blockwise moments (``mu_dtype="q8"``, ``nu_dtype="q8"``): the code's bits against its
numpy reference on every instruction set, its error bound, fixed points, rounding and edge
cases; the fused kernel against the reference; training beside optax.adamw; the tier bytes."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import parity as tt
import pytest
from helpers import assert_bits_equal, isas, view
from helpers import make_hyper as _hyper
from helpers import problem as _problem

import jax_mlpo
from jax_mlpo import native
from jax_mlpo.engine.quantize import (
    BLOCK,
    Quantized,
    decode_reference,
    encode_reference,
    num_blocks,
)
from jax_mlpo.native.kernels import q8_decode, q8_encode
from jax_mlpo.optimizers import fma64
from jax_mlpo.optimizers.adamw import adamw_step_reference
from jax_mlpo.types import BF16, F32


def empty_q8(n: int) -> Quantized:
    return Quantized(np.full(n, 0xAA, np.uint8), np.full(num_blocks(n), np.nan, F32))


def moment_values(n: int, signed: bool, seed: int = 0) -> np.ndarray:
    """Values over ~30 binades, zeros among them, like a moment's."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.uniform(-30, 4, n))).astype(F32)
    x[::11] = 0.0
    return x if signed else np.square(x) * np.float32(0.1)


def assert_q8_equal(got: Quantized, want: Quantized, what: str) -> None:
    np.testing.assert_array_equal(got.codes, want.codes, err_msg=f"{what}: codes")
    assert_bits_equal(got.scales, want.scales, f"{what}: scales")


@pytest.mark.parametrize("n", [1, 255, 257, 70_001])  # 70_001: split over the kernel's threads
@pytest.mark.parametrize("signed", [True, False], ids=["m", "v"])
@pytest.mark.parametrize("seed", [None, 1234], ids=["nearest", "stochastic"])
def test_encode_and_decode_match_the_reference_on_every_isa(n, signed, seed):
    x = moment_values(n, signed)
    want = encode_reference(x, signed=signed, seed=seed)
    want_values = decode_reference(want, signed=signed)
    for isa in isas():
        got = empty_q8(n)
        q8_encode(x, got, signed=signed, seed=seed)
        assert_q8_equal(got, want, isa)
        assert_bits_equal(q8_decode(got, signed=signed), want_values, f"decoded on {isa}")


@pytest.mark.parametrize("signed", [True, False], ids=["m", "v"])
def test_nearest_is_within_a_sixteenth_and_decoded_values_encode_to_themselves(signed):
    """In its range (2^-15 (m) or 2^-31 (v) of the block's scale and up) a value is rounded by
    at most 1/16 of itself; a decoded block encodes to the same values, whatever the rounding,
    which is what makes a checkpoint (float32 files) resume exactly."""
    x = moment_values(8 * BLOCK, signed)
    q = encode_reference(x, signed=signed)
    y = decode_reference(q, signed=signed)
    scale = np.repeat(q.scales, BLOCK)[: x.size]
    in_range = np.abs(x) >= scale * (2.0**-15 if signed else 2.0**-31)
    assert in_range.mean() > 0.25  # the rest are below the range (m: rounded to 0)
    rel = np.abs(y - x)[in_range] / np.abs(x)[in_range]
    assert rel.max() <= 1 / 16
    assert rel.max() > 1 / 20  # the bound is tight: 3 mantissa bits
    for seed in (None, 99):
        again = decode_reference(encode_reference(y, signed=signed, seed=seed), signed=signed)
        assert_bits_equal(again, y, f"re-encoded (seed {seed})")


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    """4095 copies of a value 0.3 of the way between two codes: stochastic rounding's mean is
    the value (to 4 standard errors), nearest rounding's is the lower code."""
    step = 0.5 / 8  # codes in [0.5, 1) of a block whose scale is 1 (it holds 1.0)
    lower = 0.5 + 3 * step
    x = np.full(4096, lower + 0.3 * step, F32)
    x[0] = 1.0
    for seed, want_bias in ((7, 0.0), (None, -0.3)):
        y = decode_reference(encode_reference(x, signed=False, seed=seed), signed=False)[1:]
        assert set(np.unique(y)) <= {np.float32(lower), np.float32(lower + step)}
        bias = (y.mean() - x[1]) / step
        assert abs(bias - want_bias) < 4 * np.sqrt(0.21 / y.size), (seed, bias)


def test_a_decaying_v_is_stuck_under_nearest_and_decays_under_stochastic_rounding():
    """v with b2 = 0.999 and no new gradient: each step's 0.1% decay is below half a code's
    step, so nearest rounding never moves it, while stochastic rounding follows b2^t on
    average (why stochastic rounding exists here)."""
    v0 = np.full(4 * BLOCK, 0.7, F32)
    runs = {}
    for name, stochastic in (("nearest", False), ("stochastic", True)):
        v = v0.copy()
        for t in range(700):
            seed = t if stochastic else None
            v = decode_reference(encode_reference(v * np.float32(0.999), signed=False, seed=seed),
                                 signed=False)  # fmt: skip
        runs[name] = v.mean()
    start = decode_reference(encode_reference(v0, signed=False), signed=False).mean()
    assert runs["nearest"] == start
    assert abs(runs["stochastic"] / (start * 0.999**700) - 1) < 0.1


def test_small_and_non_finite_values():
    """A positive v is never rounded to 0 (the update would divide by eps alone); m below 2^-16
    of its block is; a block below 2^-90 is stored as zeros; a non-finite value makes its block
    NaN (as a float32 moment would be), and no other block."""
    v = np.full(2 * BLOCK, 1e-20, F32)
    v[0] = 1.0  # the first block's scale: 1e-20 is far below its range
    q = encode_reference(v, signed=False)
    y = decode_reference(q, signed=False)
    assert (y[1:BLOCK] > 0).all() and (y[1:BLOCK] < 1e-9).all()
    np.testing.assert_allclose(y[BLOCK:], 1e-20, rtol=1 / 16)
    m = np.full(BLOCK, 1e-6, F32)
    m[0] = -1.0
    y = decode_reference(encode_reference(m, signed=True), signed=True)
    assert y[0] == -1.0 and (y[1:] == 0).all()
    tiny = np.full(BLOCK, 1e-28, F32)  # below 2^-90
    assert (decode_reference(encode_reference(tiny, signed=False), signed=False) == 0).all()
    for bad in (np.inf, np.nan):
        x = np.ones(2 * BLOCK, F32)
        x[3] = bad
        for isa in isas():
            got = empty_q8(x.size)
            q8_encode(x, got, signed=True)
            y = q8_decode(got, signed=True)
            assert np.isnan(y[:BLOCK]).all() and (y[BLOCK:] == 1.0).all(), isa


MOMENT_KINDS = {"q8": "q8", "f32": F32, "bf16": BF16}


def moment(kind: str, n: int, signed: bool):
    """A moment of ``kind`` holding a running AdamW's values (not zeros)."""
    x = moment_values(n, signed, seed=5) * np.float32(1e-4)
    if kind == "q8":
        return encode_reference(x, signed=signed)
    return x.astype(MOMENT_KINDS[kind])


def copy_moment(x):
    return Quantized(x.codes.copy(), x.scales.copy()) if isinstance(x, Quantized) else x.copy()


@pytest.mark.parametrize("kinds", [("q8", "q8"), ("q8", "f32"), ("bf16", "q8")],
                         ids=["both", "m_q8", "v_q8"])  # fmt: skip
@pytest.mark.parametrize("seed", [None, 31], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("grad_bf16", [False, True], ids=["g_f32", "g_bf16"])
@pytest.mark.parametrize("n", [1000, 70_001])
def test_kernel_equals_the_reference_on_every_isa(n, grad_bf16, seed, kinds):
    """Three steps of the fused kernel, bit for bit the reference's: the moments' codes and
    scales and the update; float32 params in place, and bf16 params through the master copy
    with the bf16 update written over the gradient (XLA's aliasing)."""
    p0, grads = _problem(n, grad_bf16)
    m0, v0 = moment(kinds[0], n, True), moment(kinds[1], n, False)
    runs = {}
    for isa in ["reference", *isas()]:
        step = adamw_step_reference if isa == "reference" else native.adamw_step
        m, v, p, u = copy_moment(m0), copy_moment(v0), p0.copy(), view(n)
        master = p0.copy()
        base = p0.astype(BF16)
        for t, g in enumerate(grads[:3], start=1):
            step(m, v, g, p, u, _hyper(t, 0.1), update_param=True, seed=seed)
            g16 = g.astype(BF16)  # a writable bf16 gradient the update overwrites
            step(copy_moment(m), copy_moment(v), g16, master, g16, _hyper(t, 0.1),
                 update_param=True, delta_base=base, seed=seed)  # fmt: skip
        runs[isa] = (m, v, p, u, g16)
    want = runs.pop("reference")
    for isa, got in runs.items():
        for name, a, b in zip("mvpug", got, want, strict=True):
            if isinstance(a, Quantized):
                assert_q8_equal(a, b, f"{name} on {isa}")
            else:
                assert_bits_equal(a, b, f"{name} on {isa}")


def test_the_q8_kernel_rounds_its_fma_once():
    """With both moments q8 the kernel computes (1 - b1) * g + b1 * m with one rounding (the
    float32 fma, as XLA:CPU does), not the float64 emulation the float32 path matches optax's
    reference with: built so that the two differ (the float64 sum lands exactly on a float32
    midpoint), the kernel's update is the single rounding's."""
    c1 = np.float32((1 + 2**-12) / 2)  # (1 - b1) * g = 0.5 + 2^-12 + 2^-25: a midpoint
    b1 = 1.0 - float(c1)
    g = np.array([1 + 2**-12], F32)
    m = encode_reference(np.array([2.0**-60], F32), signed=True)  # b1 * m: below a float64 ulp
    v = encode_reference(np.array([1.0], F32), signed=False)
    # v stays 1.0 (b2 rounds to 1 in float32, and 2^-30 * g^2 is lost in the sum): u = m
    hyper = jax_mlpo.types.AdamWHyper(bc1=1.0, bc2=1.0, lr=-1.0, b1=b1, b2=1.0 - 2**-30,
                                        eps=0.0, weight_decay=0.0)  # fmt: skip
    updates = {}
    for name, step in (("native", native.adamw_step), ("reference", adamw_step_reference)):
        u = np.empty(1, F32)
        step(copy_moment(m), copy_moment(v), g, np.zeros(1, F32), u, hyper)
        updates[name] = u[0]
    once = np.float32(0.5 + 2**-12 + 2**-24)  # the exact sum, rounded up
    twice = np.float32(0.5 + 2**-12)  # the float64 sum is the midpoint: ties to even, down
    assert fma64(c1, g, np.float32(b1) * np.float32(2.0**-60))[0] == twice
    assert updates["native"] == updates["reference"] == once


def q8_adamw(config, rounding="stochastic"):
    return tt.offloaded_adamw(config, mu_dtype="q8", nu_dtype="q8", q8_rounding=rounding)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_training_follows_optax_within_the_codes_error(dtype, tmp_path):
    """50 steps of the parity suite's problem (3 tiers, subgroups cutting leaves, gradients over
    3 decades) with q8 m and v (stochastic rounding) beside optax.adamw's float32 moments: the
    params end within 10% of the distance they moved (measured: 2.1-6.5% per leaf; 4.7% at most
    with nearest rounding, 1.2-2.1% with bfloat16 moments, 1e-6 with float32 ones)."""
    config = tt.offload_config(tt.CASES[1], dtype, tmp_path)
    params = tt.run_offloaded(q8_adamw(config), dtype, "jit")
    ref = tt.reference(dtype)[0]
    start = tt.make_params(dtype)
    for k in tt.SHAPES:
        got, want, p0 = (np.asarray(x[k], F32) for x in (params, ref, start))
        moved = np.linalg.norm(want - p0)
        err = np.linalg.norm(got - want)
        assert err <= 0.1 * moved, f"{k}: {err / moved:.3%} of the distance moved"


def test_stochastic_rounding_is_deterministic(tmp_path):
    """The random bits are a hash of the step, the subgroup and the element: the same run
    twice gives the same params bit for bit, and nearest rounding other ones."""
    runs = {}
    for name, rounding in (("a", "stochastic"), ("b", "stochastic"), ("c", "nearest")):
        (tmp_path / name).mkdir()
        config = tt.offload_config(tt.CASES[0], jnp.float32, tmp_path / name)
        runs[name] = tt.run_offloaded(q8_adamw(config, rounding), jnp.float32, "jit")
    for k in tt.SHAPES:
        assert_bits_equal(runs["a"][k], runs["b"][k], k)
    assert any(not np.array_equal(runs["a"][k], runs["c"][k]) for k in tt.SHAPES)


@pytest.mark.parametrize("dtype,bytes_per_param",
                         [(jnp.float32, 2 + 8 / BLOCK), (jnp.bfloat16, 6 + 8 / BLOCK)],
                         ids=["fp32", "bf16"])  # fmt: skip
def test_the_tiers_hold_a_byte_per_moment_and_its_scales(dtype, bytes_per_param, tmp_path):
    """The blob is p | m codes | v codes | their scales: the tiers hold the layout's bytes, 1 +
    4/256 per moment and param (a little more: each segment's last block has a whole scale)."""
    case = tt.Case("x", 131_072, 2, "none")
    config = tt.offload_config(case, dtype, tmp_path)
    config = dataclasses.replace(config, host_cache=int(6 * bytes_per_param * 131_072) + 2**16)
    state = q8_adamw(config).init(tt.make_params(dtype))
    layout = jax_mlpo.engine_of(state).layout
    blobs = list(tmp_path.glob("tier*/state-*.blob"))
    held = sum(int.from_bytes(p.read_bytes()[-4096 + 8 : -4096 + 16], "little") for p in blobs)
    assert held == layout.state_bytes
    # the extra: a partial last block per segment and moment, m and v padded to whole words
    segments = sum(len(sg.segments) for sg in layout.subgroups)
    extra = 2 * 4 * segments + 2 * 3 * len(layout.subgroups)
    assert bytes_per_param * tt.NUM_PARAMS <= held <= bytes_per_param * tt.NUM_PARAMS + extra
    jax_mlpo.close(state)


@pytest.mark.parametrize("spec", ["int8", jnp.uint8, "Q8"])
def test_other_8_bit_dtypes_are_refused(spec, tmp_path):
    config = tt.offload_config(tt.CASES[0], jnp.float32, tmp_path)
    with pytest.raises(ValueError, match='or "q8" \\(8-bit blockwise\\)'):
        jax_mlpo.adamw(1e-3, offload=config, mu_dtype=spec)
    with pytest.raises(ValueError, match="q8_rounding must be"):
        jax_mlpo.adamw(1e-3, offload=config, mu_dtype="q8", q8_rounding="up")
