"""The tile program a jax.numpy rule compiles into (jax_mlpo/optimizers/rule_program.py,
jax_mlpo/ffi/rule_isa.cc), against XLA:CPU running the same function."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_mlpo import _native, native
from jax_mlpo.errors import UnsupportedRuleError
from jax_mlpo.optimizers.jax_rule import RuleRunner
from jax_mlpo.optimizers.rule_program import OP, compile_rule

BF16 = ml_dtypes.bfloat16
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1.0, -1.0, 0.5, 2.0],
                   np.float32)  # fmt: skip


def _inputs(k: int, n: int, seed: int = 0, low: float | None = None, high: float | None = None):
    """``k`` float32 arrays: normal values (or uniform in [low, high)) with special values in
    front, each array's shifted so that every pair of them meets."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(k):
        if low is None:
            x = rng.standard_normal(n, dtype=np.float32) * np.float32(3)
        else:
            x = rng.uniform(low, high, n).astype(np.float32)
        if low is None:  # every special value of array 0 meets every one of array 1
            pairs = (np.repeat if i % 2 else np.tile)(SPECIAL, len(SPECIAL))[:n]
            x[: len(pairs)] = pairs
        out.append(x)
    return out


def _run(fn, inputs, scalars=(), threads: int | None = None):
    """fn compiled into a tile program and run; its outputs."""
    dtypes = [x.dtype for x in inputs]
    tile = compile_rule(fn, dtypes, len(scalars))
    shapes = jax.eval_shape(fn, *inputs, *[np.float32(s) for s in scalars])
    outs = [np.empty(inputs[0].shape, o.dtype) for o in shapes]
    before = native.set_num_threads(threads) if threads else None
    try:
        tile.run(list(scalars), [*inputs, *outs])
    finally:
        if before is not None:
            native.set_num_threads(0)
    return outs


def _xla(fn, inputs, scalars=()):
    return [np.asarray(x) for x in jax.jit(fn)(*inputs, *[np.float32(s) for s in scalars])]


def _flushed(x: np.ndarray) -> np.ndarray:
    """Denormals as XLA:CPU gives them: zero, signed (it flushes them; the tile program, as the
    native kernels, keeps them)."""
    x = x.astype(np.float32)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x)


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, any NaN matching any NaN, denormals flushed."""
    g, w = _flushed(got), _flushed(want)
    both_nan = np.isnan(g) & np.isnan(w)
    diff = ~both_nan & (g.view(np.uint32) != w.view(np.uint32))
    if diff.any():
        at = np.argmax(diff)
        raise AssertionError(f"{diff.sum()} differ, first at {at}: {g[at]} against {w[at]}")


EXACT = {
    "neg": lambda x, y, z: (-x,),
    "abs": lambda x, y, z: (jnp.abs(x),),
    "sign": lambda x, y, z: (jnp.sign(x),),
    "sqrt": lambda x, y, z: (jnp.sqrt(x),),
    "floor_ceil": lambda x, y, z: (jnp.floor(x), jnp.ceil(x)),
    "add_sub_mul_div": lambda x, y, z: (x + y, x - y, x * y, x / y),
    "max_min": lambda x, y, z: (jnp.maximum(x, y), jnp.minimum(x, y)),
    "compare": lambda x, y, z: tuple(
        jnp.where(c, 1.0, 0.0) for c in (x < y, x <= y, x > y, x >= y, x == y, x != y)
    ),
    "logic": lambda x, y, z: (
        jnp.where((x > 0) & (y > 0), x, y),
        jnp.where((x > 0) | ~(y > 0), x, y),
        jnp.where((x > 0) ^ (y > 0), x, z),
    ),  # fmt: skip
    "select": lambda x, y, z: (jnp.where(x > y, x, z),),
    "clip": lambda x, y, z: (jnp.clip(x, -jnp.abs(y), jnp.abs(z)),),
    "is_finite": lambda x, y, z: (jnp.where(jnp.isfinite(x), x, 0.0),),
    "square_and_powers": lambda x, y, z: (jnp.square(x), x**3, x**-2, x**0, x**1),
    "bfloat16": lambda x, y, z: ((x * y).astype(jnp.bfloat16), x.astype(jnp.bfloat16) + y),
    "fma_first": lambda x, y, z: (x * y + z, z + x * y, x * y - z, z - x * y, x * y + z * y),
    "by_a_scalar": lambda x, y, z: (x / 0.19, (x - y) / 3.0),
    "barrier": lambda x, y, z: jax.lax.optimization_barrier((x * y, z)),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_an_operation_is_bit_for_bit_xla(name):
    """Arithmetic, comparisons, selects, rounding to bfloat16, a product fused into the sum
    that is its only use and a division by a scalar are XLA:CPU's, bit for bit, on special
    values (+-0, +-inf, NaN, denormals, the largest floats) and normal ones."""
    fn = EXACT[name]
    inputs = _inputs(3, 5000)
    for got, want in zip(_run(fn, inputs), _xla(fn, inputs), strict=True):
        _same(got, want)


APPROXIMATE = {
    "exp": (lambda x: (jnp.exp(x), jnp.exp2(x), jnp.expm1(x)), -20.0, 20.0),
    "log": (lambda x: (jnp.log(x), jnp.log1p(x)), 0.01, 100.0),
    "tanh_logistic": (lambda x: (jnp.tanh(x), jax.nn.sigmoid(x)), -8.0, 8.0),
    "rsqrt_pow": (lambda x: (jax.lax.rsqrt(x), x**0.75), 0.01, 100.0),
    "sin_cos": (lambda x: (jnp.sin(x), jnp.cos(x)), -3.0, 3.0),
}


@pytest.mark.parametrize("name", sorted(APPROXIMATE))
def test_a_transcendental_is_within_a_few_ulps_of_xla(name):
    """libm's functions against XLA's own approximations (its exp2 goes through exp: 8 ulps)."""
    fn, low, high = APPROXIMATE[name]
    (x,) = _inputs(1, 5000, low=low, high=high)
    for got, want in zip(_run(fn, [x]), _xla(fn, [x]), strict=True):
        np.testing.assert_array_max_ulp(got, want, maxulp=8)


def test_the_step_scalars_and_constants_reach_the_program():
    """Scalars arrive by position; what depends on them alone is computed once (the
    prologue); literals and scalars broadcast against the arrays."""

    def fn(m, g, b1, lr):
        bc = 1 - b1**3
        return (b1 * m + (1 - b1) * g, -lr * (m / bc) + 0.5)

    inputs = _inputs(2, 3000, low=-1.0, high=1.0)
    for got, want in zip(_run(fn, inputs, (0.9, 1e-3)), _xla(fn, inputs, (0.9, 1e-3)),
                         strict=True):  # fmt: skip
        _same(got, want)


def test_bfloat16_arrays_load_widened_and_store_rounded():
    def fn(m, g, c):
        new = (c * g + m.astype(jnp.float32)).astype(jnp.bfloat16)
        return new, jnp.sqrt(jnp.abs(new.astype(jnp.float32))) * g

    m = _inputs(1, 4000, 1, -2.0, 2.0)[0].astype(BF16)
    g = _inputs(1, 4000, 2, -2.0, 2.0)[0]
    for got, want in zip(_run(fn, [m, g], (0.3,)), _xla(fn, [m, g], (0.3,)), strict=True):
        assert got.dtype == want.dtype
        _same(got, want)


def test_every_length_and_thread_split_gives_the_same_values():
    """Partial tiles, one thread and several (calls from 2^16 elements are split): each
    length's values are those of the same elements in the longest call, and XLA's (within
    1 ulp: XLA:CPU's own code for a length-1 array fuses products differently)."""

    def fn(m, v, g, c1, c2):
        m = c1 * g + (1 - c1) * m
        v = c2 * g * g + (1 - c2) * v
        return m, v, m / (jnp.sqrt(v) + 1e-8)

    longest = (1 << 18) + 129
    inputs = _inputs(3, longest, 3, -1.0, 1.0)
    inputs[1] = np.abs(inputs[1])
    whole = _run(fn, inputs, (0.1, 0.01), threads=2)
    for want, xla in zip(whole, _xla(fn, inputs, (0.1, 0.01)), strict=True):
        np.testing.assert_array_max_ulp(want, xla, maxulp=1)
    for n in (0, 1, 255, 256, 257, 1000, (1 << 16) + 3, longest):
        for threads in (1, 2):
            got = _run(fn, [x[:n] for x in inputs], (0.1, 0.01), threads=threads)
            for g, w in zip(got, whole, strict=True):
                _same(g, w[:n])


def test_an_output_may_be_its_inputs_memory():
    """Moments advanced in place, and the update written over the gradient (an input the
    program would otherwise read in place): the values of separate outputs."""

    def fn(m, g, c):
        m = c * g + m
        return m, -0.1 * m + g

    m, g = _inputs(2, 70000, 4, -1.0, 1.0)
    want = _xla(fn, [m, g], (0.5,))
    tile = compile_rule(fn, [np.float32, np.float32], 1)
    tile.run([0.5], [m, g, m, g])
    _same(m, want[0])
    _same(g, want[1])


def test_registers_are_reused_and_dead_code_dropped():
    def fn(x, y):
        acc = x
        for _ in range(40):
            acc = jnp.sqrt(jnp.abs(acc * y + 1.0))
        unused = jnp.exp(x) * 3  # never returned
        del unused
        return (acc,)

    tile = compile_rule(fn, [np.float32, np.float32], 0)
    assert tile.tile_regs <= 4 and tile.body_len <= 3 * 40 + 3  # fma, abs, sqrt a layer
    x, y = _inputs(2, 3000, 5, -1.0, 1.0)
    _same(_run(fn, [x, y])[0], _xla(fn, [x, y])[0])


@pytest.mark.parametrize(
    "fn, what",
    [
        (lambda x, y: (x * jnp.sum(y),), "reduce_sum"),
        (lambda x, y: (jnp.cumsum(x),), "cumsum"),
        (lambda x, y: (x.astype(jnp.int32).astype(jnp.float32),), "int32"),
        (lambda x, y: (x + jnp.arange(x.shape[0], dtype=jnp.float32),), "iota"),
    ],
)
def test_a_rule_a_tile_program_cannot_run_is_named(fn, what):
    with pytest.raises(UnsupportedRuleError, match=what):
        compile_rule(fn, [np.float32, np.float32], 0)


def test_the_runner_falls_back_to_xla_with_a_warning_naming_the_cause():
    """A rule with an operation a tile program lacks (arctan): the runner warns once and runs
    the rule through XLA, with XLA's values."""

    def step(moments, grad, param, hyper, *, decay):
        (m,) = moments
        m = hyper["b"] * m + jnp.arctan(grad)
        return (m,), -hyper["lr"] * m

    n = 3000
    m, g = _inputs(2, n, 6, -1.0, 1.0)
    p, u = np.zeros(n, np.float32), np.zeros(n, np.float32)
    want = _xla(lambda m, g, b, lr: step((m,), g, None, {"b": b, "lr": lr}, decay=False)[0]
                + (None,), [m, g], (0.9, 0.1))[0]  # fmt: skip
    runner = RuleRunner(step, "arctangent", threads=1, chunk=1 << 18)
    seg = (SimpleNamespace(decay=False), (m,), g, p, u, None)
    with pytest.warns(UserWarning, match=r"arctangent: .*atan.*through XLA"):
        runner.run([seg], {"b": 0.9, "lr": 0.1})
    runner.close()
    _same(m, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        runner.run([seg], {"b": 0.9, "lr": 0.1})
    runner.close()


def _program(body, *, tile_regs=2, arrays=2, prologue=(), setup=(), scalar_regs=1):
    code = lambda rows: np.array(rows, np.int32).reshape(-1, 5)  # noqa: E731
    return _native.TileProgram(code(prologue), code(setup), code(body), scalar_regs, tile_regs,
                               arrays)  # fmt: skip


def test_a_malformed_program_or_call_is_refused():
    load, store, add = OP["LoadF32"], OP["StoreF32"], OP["Add"]
    good = [[load, 0, 0, -1, -1], [OP["Neg"], 1, 0, -1, -1], [store, 1, 1, -1, -1]]
    program = _program(good)
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    program.run(np.zeros(1, np.float32), [x, out])
    np.testing.assert_array_equal(out, -x)
    for body, match in [
        ([[99, 0, 0, -1, -1]], "unknown operation"),
        ([[add, 5, 0, 0, -1]], "out of range"),
        ([[add, 0, 0, 1, -1]], "writes one of its operands"),
        ([[OP["Neg"], 1, 0, 0, -1]], "unused operand"),
        ([[load, 0, 7, -1, -1]], "array index"),
        ([[load, 0, 0, -1, -1], [OP["StoreBf16"], 0, 0, -1, -1]], "two types"),
    ]:
        with pytest.raises(ValueError, match=match):
            _program(body)
    with pytest.raises(ValueError, match="differ in size"):
        program.run(np.zeros(1, np.float32), [x, np.zeros(5, np.float32)])
    with pytest.raises(ValueError, match="must be float32"):
        program.run(np.zeros(1, np.float32), [x, np.zeros(4, np.uint16)])
    read_only = np.zeros(4, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        program.run(np.zeros(1, np.float32), [x, read_only])
    with pytest.raises(ValueError, match="scalar registers"):
        program.run(np.zeros(3, np.float32), [x, out])


def test_the_runner_runs_a_supported_rule_without_xla():
    """AdaBelief's rule (docs/extending.md) compiles into a tile program: no XLA client is
    made, and no warning is given."""

    def step(moments, grad, param, hyper, *, decay):
        m, s = moments
        m = hyper["c1"] * grad + hyper["b1"] * m
        s = hyper["c2"] * jnp.square(grad - m) + hyper["b2"] * s + hyper["eps_root"]
        u = (m / hyper["bc1"]) / (jnp.sqrt(s / hyper["bc2"]) + hyper["eps"])
        return (m, s), -hyper["lr"] * u

    hyper = {"lr": 1e-3, "bc1": 0.19, "bc2": 0.002, "c1": 0.1, "c2": 0.001, "b1": 0.9,
             "b2": 0.999, "eps": 1e-16, "eps_root": 1e-16}  # fmt: skip
    m, s, g = _inputs(3, 5000, 7, 0.0, 1.0)
    p, u = np.zeros_like(g), np.zeros_like(g)
    want = _xla(lambda m, s, g, *h: (lambda r: (*r[0], r[1]))(
        step((m, s), g, None, dict(zip(sorted(hyper), h, strict=True)), decay=False)),
        [m, s, g], [hyper[k] for k in sorted(hyper)])  # fmt: skip
    runner = RuleRunner(step, "adabelief", threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.run([(SimpleNamespace(decay=False), (m, s), g, p, u, None)], hyper)
    assert runner._device is None  # the XLA path's client was never made
    # XLA fuses the other product of s's sum of two into an fma (LLVM's choice): 1 ulp in s,
    # 3 in the update
    for got, w in zip((m, s, u), want, strict=True):
        np.testing.assert_array_max_ulp(got, w, maxulp=4)
