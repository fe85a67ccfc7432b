"""Tests of jax_mlpo.native: the C++ kernels against the numpy reference (bitwise) and optax."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from helpers import (
    B1,
    B2,
    EPS,
    LR,
    assert_bits_equal,
    bits,
    isas,
    make_hyper,
    problem,
    view,
)

from jax_mlpo import native
from jax_mlpo.optimizers.adamw import adamw_step_reference
from jax_mlpo.types import BF16, F32, AdamWHyper

SIZES = (1, 7, 22, 64, 1000, 1048577)
MODES = (
    # fp32 params: the kernel returns the update, the caller applies it.
    "update",
    # fp32 master params updated in place, plus the update and a bf16 copy.
    "param",
    # bf16 params on the device: update = p32_new - f32(p_bf16), and the bf16 copy.
    "delta",
)
CPU = jax.devices("cpu")[0]

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: (
        _compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)


@functools.cache
def _optax_step(wd: float):
    optax = pytest.importorskip("optax")  # after the bitwise checks, which need only numpy
    opt = optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=wd)

    @jax.jit
    def step(p, state, g):
        u, state = opt.update(g, state, p)
        return optax.apply_updates(p, u), state

    return opt, step


@functools.cache
def _optax_params(n: int, grad_bf16: bool, wd: float) -> np.ndarray:
    p0, grads = problem(n, grad_bf16)
    opt, step = _optax_step(wd)
    p = jnp.asarray(p0)
    state = opt.init(p)
    for g in grads:
        p, state = step(p, state, jnp.asarray(g.astype(F32)))
    return np.asarray(p)


class _Segment:
    """One segment's host state (views into larger buffers) stepped by a kernel function."""

    def __init__(self, p0: np.ndarray):
        n = p0.size
        self.m, self.v, self.u, self.p, self.pb = view(n), view(n), view(n), view(n), view(n, BF16)
        self.p[...] = p0
        self.dev_bf16 = p0.astype(BF16)

    def step(self, kernel, g: np.ndarray, hyper: AdamWHyper, mode: str) -> None:
        m, v, u, p, pb = self.m, self.v, self.u, self.p, self.pb
        if mode == "update":
            p.setflags(write=False)  # only read: may be read-only
            kernel(m, v, g, p, u, hyper)
            p.setflags(write=True)
            p += u
        elif mode == "param":
            kernel(m, v, g, p, u, hyper, update_param=True, param_bf16_out=pb)
        else:
            kernel(m, v, g, p, u, hyper, update_param=True, delta_base=self.dev_bf16,
                   param_bf16_out=pb)  # fmt: skip
            # optax.apply_updates on the bf16 device params gives exactly the bf16 copy.
            self.dev_bf16 = (self.dev_bf16.astype(F32) + u).astype(BF16)
            assert_bits_equal(self.dev_bf16, pb, "apply_updates(bf16 params, update)")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wd", [0.0, 0.1], ids=["no_wd", "wd"])
@pytest.mark.parametrize("grad_bf16", [False, True], ids=["g_f32", "g_bf16"])
@pytest.mark.parametrize("n", SIZES)
def test_adamw_matches_reference_and_optax(n, grad_bf16, wd, mode):
    p0, grads = problem(n, grad_bf16)
    got, want = _Segment(p0), _Segment(p0)
    for t, g in enumerate(grads, start=1):
        hyper = make_hyper(t, wd)
        got.step(native.adamw_step, g, hyper, mode)
        want.step(adamw_step_reference, g, hyper, mode)
        for k in ("m", "v", "u", "p", "pb"):
            assert_bits_equal(getattr(got, k), getattr(want, k), f"{k} at step {t}")
    # optax: the same trajectory to float32 rounding (the kernel's fma emulation may round
    # differently from XLA's fma in rare double-rounding cases; nothing else differs).
    p_optax = _optax_params(n, grad_bf16, wd)
    assert np.all(np.abs(got.p - p_optax) <= 1e-6 * np.maximum(1.0, np.abs(p_optax)))
    if mode != "update":
        assert_bits_equal(got.pb, got.p.astype(BF16), "param_bf16_out")


@pytest.mark.parametrize("wd", [0.0, 0.1], ids=["no_wd", "wd"])
@pytest.mark.parametrize("n", SIZES)
def test_bf16_update_matches_reference_and_jnp(n, wd):
    """The update in the params' dtype, bf16(p32_new) - p_bf16, as jnp computes it in bfloat16,
    and apply_updates of it lands on bf16(p32_new) wherever the two are within 2x (Sterbenz)."""
    p0, grads = problem(n, True)
    dev = p0.astype(BF16)
    state = {k: [view(n), view(n), view(n)] for k in ("got", "want")}
    for k in state:
        state[k][2][...] = p0
    for t, g in enumerate(grads, start=1):
        hyper = make_hyper(t, wd)
        outs = {}
        for k, kernel in (("got", native.adamw_step), ("want", adamw_step_reference)):
            m, v, p = state[k]
            outs[k] = view(n, BF16)
            kernel(m, v, g, p, outs[k], hyper, update_param=True, delta_base=dev)
        for i in range(3):
            assert_bits_equal(state["got"][i], state["want"][i], f"state {i} at step {t}")
        assert_bits_equal(outs["got"], outs["want"], f"bf16 update at step {t}")
        new = state["got"][2].astype(BF16)
        expected = jnp.asarray(new) - jnp.asarray(dev)  # bfloat16 subtraction, in jnp
        assert_bits_equal(outs["got"], np.asarray(expected), "jnp's bf16(p_new) - p")
        applied = np.asarray(jnp.asarray(dev) + jnp.asarray(outs["got"]))
        a, b = new.astype(F32), dev.astype(F32)
        near = (
            (np.sign(a) == np.sign(b)) & (np.abs(a) <= 2 * np.abs(b)) & (np.abs(b) <= 2 * np.abs(a))
        )
        assert_bits_equal(applied[near], new[near], "apply_updates where within 2x")
        dev = applied


@pytest.mark.parametrize("mode", ["update", "delta", "delta_bf16"])
@pytest.mark.parametrize("n", [7, 1000, 1048577])
def test_update_may_overwrite_its_gradient(n, mode):
    """update_out is the gradient's own buffer (XLA aliases them): the same bits as apart."""
    p0, grads = problem(n, mode != "update")
    g = grads[0]
    out_dtype = BF16 if mode == "delta_bf16" else F32
    if mode == "delta":  # f32 update from bf16 gradients cannot share their buffer: f32 grads
        g = g.astype(F32)
    hyper = make_hyper(1, 0.1)
    dev = p0.astype(BF16)
    results = {}
    for where in ("apart", "in_place"):
        m, v, p = view(n), view(n), view(n)
        p[...] = p0
        grad = view(n, g.dtype)
        grad[...] = g
        out = grad if where == "in_place" else view(n, out_dtype)
        if mode == "update":
            native.adamw_step(m, v, grad, p, out, hyper)
        else:
            native.adamw_step(m, v, grad, p, out, hyper, update_param=True, delta_base=dev)
        results[where] = (m, v, p, out)
    for a, b, name in zip(results["apart"], results["in_place"], "mvpu", strict=True):
        assert_bits_equal(b, a, name)


def test_update_overlapping_its_gradient_elsewhere_is_refused():
    buf = np.zeros(100, F32)
    m, v, p = np.zeros(64, F32), np.zeros(64, F32), np.zeros(64, F32)
    with pytest.raises(ValueError, match="overlap"):
        native.adamw_step(m, v, buf[:64], p, buf[1:65], make_hyper(1, 0.0))
    with pytest.raises(ValueError, match="bfloat16"):
        native.adamw_step(m, v, buf[:64], p, np.zeros(64, BF16), make_hyper(1, 0.0))


def test_adamw_grad_scale_and_special_values():
    n = 4099
    rng = np.random.default_rng(1)
    m = rng.standard_normal(n).astype(F32)
    v = np.abs(rng.standard_normal(n)).astype(F32)
    g = rng.standard_normal(n).astype(F32)
    p = rng.standard_normal(n).astype(F32)
    g[:6] = [np.inf, -np.inf, np.nan, 1e-42, -0.0, 3e38]  # inf, NaN, denormal, overflow
    p[6:10] = [np.inf, -0.0, 1e-45, np.nan]
    m[10:12] = [-0.0, 1e-40]
    hyper = AdamWHyper(0.19, 0.002, 3e-4, B1, B2, EPS, 0.01, grad_scale=0.25)
    arrays = [a.copy() for a in (m, v, g, p)] + [np.empty(n, F32), np.empty(n, BF16)]
    native.adamw_step(*arrays[:4], arrays[4], hyper, update_param=True, param_bf16_out=arrays[5])
    ref = [a.copy() for a in (m, v, g, p)] + [np.empty(n, F32), np.empty(n, BF16)]
    with np.errstate(all="ignore"):
        adamw_step_reference(*ref[:4], ref[4], hyper, update_param=True, param_bf16_out=ref[5])
    for name, a, e in zip(("m", "v", "g", "p", "u", "pb"), arrays, ref, strict=True):
        # NaN payloads of arithmetic are not part of the contract; everything else is.
        nan = np.isnan(a.astype(F32)) & np.isnan(e.astype(F32))
        assert_bits_equal(a[~nan], e[~nan], name)
        assert np.array_equal(np.isnan(a.astype(F32)), np.isnan(e.astype(F32))), name


# ---- bf16 <-> fp32 ------------------------------------------------------------------------------

SPECIAL_F32 = np.array(
    [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,  # NaN: quiet, signalling, signs
        0x7FA00000, 0x7F810000, 0x7F8000FF, 0x7FFFFFFF, 0x7FBFFFFF, 0xFFFFFFFF,  # NaN payloads
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # overflow to inf, and just below
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # ties to even, either side of a tie
        0x00000001, 0x00008000, 0x00018000, 0x0000FFFF, 0x007FFFFF, 0x80008000,  # denormals
        0x00800000, 0x007F8000,  # smallest normal, a denormal rounding up to it
    ],
    np.uint32,
)  # fmt: skip


def test_f32_to_bf16_matches_jnp_astype():
    rng = np.random.default_rng(2)
    patterns = np.concatenate([
        SPECIAL_F32,
        rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32),
        (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000,  # every tie
        (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x7FFF,
    ])  # fmt: skip
    src = patterns.view(F32)
    dst = np.empty(src.size, BF16)
    native.f32_to_bf16(src, dst)
    # The kernel runs on the host, so XLA:CPU's conversion is its reference. (XLA:GPU writes
    # every NaN as the canonical 0x7FFF; XLA:CPU keeps the sign and quiets the payload.)
    on_cpu = jax.device_put(src, jax.devices("cpu")[0])
    assert_bits_equal(dst, on_cpu.astype(jnp.bfloat16), "eager jnp.astype")
    jitted = jax.jit(lambda x: x.astype(jnp.bfloat16))(on_cpu)
    assert_bits_equal(dst, jitted, "jitted astype")


def test_bf16_to_f32_matches_jnp_astype():
    src = np.tile(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16), 3).view(BF16)
    dst = view(src.size)
    native.bf16_to_f32(src, dst)
    assert_bits_equal(dst, jnp.asarray(src).astype(jnp.float32), "jnp.astype")


# ---- threads and instruction sets ---------------------------------------------------------------


def _one_step(n: int) -> list[np.ndarray]:
    p0, grads = problem(n, True)
    arrays = [np.full(n, 0.01, F32), np.full(n, 0.02, F32), p0.copy(), np.empty(n, F32),
              np.empty(n, BF16)]  # fmt: skip
    m, v, p, u, pb = arrays
    native.adamw_step(m, v, grads[0], p, u, make_hyper(1, 0.1), update_param=True,
                      delta_base=p0.astype(BF16), param_bf16_out=pb)  # fmt: skip
    return arrays


def test_results_do_not_depend_on_threads_or_isa():
    n = (1 << 18) + 5
    want = _one_step(n)
    try:
        for threads in (1, 3):
            native.set_num_threads(threads)
            for a, e in zip(_one_step(n), want, strict=True):
                assert_bits_equal(a, e, f"{threads} threads")
        native.set_num_threads(None)
        for name in isas():
            for a, e in zip(_one_step(n), want, strict=True):
                assert_bits_equal(a, e, name)
    finally:
        native.set_num_threads(None)


def test_concurrent_callers_and_fork():
    # Python threads call in at once (the kernels release the GIL; large calls share the pool).
    n = (1 << 18) + 5
    want = _one_step(n)
    results = [None] * 4

    def work(i):
        results[i] = _one_step(n)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        for a, e in zip(got, want, strict=True):
            assert_bits_equal(a, e, "concurrent call")
    # A forked child (multiprocessing's default on Linux) starts its own pool.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX warns that fork() and threads do not mix
        pid = os.fork()
    if pid == 0:  # the child must never return into pytest
        code = 1
        try:
            pairs = zip(_one_step(n), want, strict=True)
            code = 0 if all(np.array_equal(bits(a), bits(e)) for a, e in pairs) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_num_threads_env_override():
    code = "from jax_mlpo import native; print(native.num_threads())"
    env = dict(os.environ, JAX_MLPO_NUM_THREADS="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


# ---- XLA FFI ------------------------------------------------------------------------------------


def _ffi_inputs(n: int, grad_bf16: bool):
    rng = np.random.default_rng(3)
    m = (rng.standard_normal(n) * 0.1).astype(F32)
    v = (np.abs(rng.standard_normal(n)) * 0.01).astype(F32)
    g = rng.standard_normal(n).astype(F32)
    p = rng.standard_normal(n).astype(F32)
    g[:4] = [1e-41, -3e-39, 0.0, 1e-45]  # denormals: XLA's threads flush them, the kernel must not
    m[4:8] = [1e-40, -1e-44, 2e-39, -0.0]
    return m, v, g.astype(BF16) if grad_bf16 else g, p


@pytest.mark.parametrize("update_buffer", [False, True], ids=["fresh_u", "donated_u"])
@pytest.mark.parametrize("update_param", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05], ids=["no_wd", "wd"])
@pytest.mark.parametrize("grad_bf16", [False, True], ids=["g_f32", "g_bf16"])
def test_ffi_adamw_in_jit_matches_direct_call(grad_bf16, wd, update_param, update_buffer):
    n = (1 << 17) + 3  # large enough for XLA's worker threads and the kernel's pool
    m, v, g, p = _ffi_inputs(n, grad_bf16)
    hyper = AdamWHyper(0.271, 0.00399, 2e-3, B1, B2, EPS, wd, grad_scale=0.5)
    donate = (0, 1, 4) + ((3,) if update_param else ())

    @functools.partial(jax.jit, donate_argnums=donate)
    def step(m, v, g, p, u, lr, bc1, bc2):
        h = hyper._replace(lr=lr, bc1=bc1, bc2=bc2)
        return native.adamw_update(
            m, v, g, p, h, update_param=update_param, update_buffer=u if update_buffer else None
        )

    def inputs():
        arrays = (m, v, g, p, np.full(n, np.nan, F32))
        return [jax.device_put(x, CPU) for x in arrays]

    scalars = [jnp.float32(x) for x in (hyper.lr, hyper.bc1, hyper.bc2)]
    out = step(*inputs(), *scalars)
    want = [m.copy(), v.copy(), p.copy(), np.empty(n, F32)]
    native.adamw_step(want[0], want[1], g, want[2], want[3], hyper, update_param=update_param)
    for name, a, e in zip(("m", "v", "param", "update"), out, want, strict=True):
        assert_bits_equal(a, e, name)
    # A new learning rate is a runtime value: no recompilation.
    before = len(_compiles)
    step(*inputs(), jnp.float32(1e-4), *scalars[1:])
    assert len(_compiles) == before
    assert step._cache_size() == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_ffi_copies_roundtrip_without_recompiling(dtype):
    n = (1 << 18) + 1
    # Fresh functions, so that the jit caches are this test's alone.
    to_host = jax.jit(lambda x, d: native.copy_to_host(x, d))
    from_host = jax.jit(lambda d, s, t: native.copy_from_host(d, s, t), static_argnums=(1, 2))
    x = jax.device_put(jnp.arange(n).astype(dtype), CPU)
    bufs = [np.zeros(n, np.dtype(dtype)), np.zeros(n + 10, np.dtype(dtype))[5 : 5 + n]]
    before = None
    for i, buf in enumerate(bufs):
        token = to_host(x, jax.device_put(native.host_descriptor(buf), CPU))
        token.block_until_ready()
        assert_bits_equal(buf, x, "to_host")
        y = from_host(token, (n,), dtype)  # the token orders the read after the write
        assert_bits_equal(y, x, "from_host")
        if i == 0:
            before = len(_compiles)
    assert len(_compiles) == before, "a new host buffer recompiled"
    assert to_host._cache_size() == 1 and from_host._cache_size() == 1


def test_ffi_copy_rejects_a_small_host_buffer():
    x = jax.device_put(jnp.zeros(100, jnp.float32), CPU)
    small = np.zeros(99, np.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="400 bytes but the host buffer only 396"):
        jax.jit(native.copy_to_host)(x, native.host_descriptor(small)).block_until_ready()
    with pytest.raises(jax.errors.JaxRuntimeError, match="400 bytes but the host buffer only 396"):
        desc = jax.device_put(native.host_descriptor(small, writable=False), CPU)
        jax.jit(native.copy_from_host, static_argnums=(1, 2))(desc, (100,), jnp.float32)


# ---- errors -------------------------------------------------------------------------------------


def _err_cases():
    n = 8
    hyper = make_hyper(1, 0.0)
    f, b = np.zeros(n, F32), np.zeros(n, BF16)
    ro = np.zeros(n, F32)
    ro.setflags(write=False)
    m = np.zeros(n, F32)
    return [
        ("dtype", lambda: native.adamw_step(f.astype(np.float64), f.copy(), f, f, None, hyper),
         "m must be float32 or bfloat16, got float64"),
        ("grad dtype", lambda: native.adamw_step(f.copy(), f.copy(), f.astype(np.float16), f,
                                                 None, hyper), "grad must be float32 or bfloat16"),
        ("strided", lambda: native.adamw_step(np.zeros(2 * n, F32)[::2], f.copy(), f, f, None,
                                              hyper), "m must be C-contiguous"),
        ("size", lambda: native.adamw_step(f.copy(), np.zeros(n + 1, F32), f, f, None, hyper),
         "v has 9 elements but m has 8"),
        ("read-only m", lambda: native.adamw_step(ro, f.copy(), f, f, None, hyper),
         "m is read-only"),
        ("read-only param", lambda: native.adamw_step(f.copy(), f.copy(), f, ro, None, hyper,
                                                      update_param=True), "param is read-only"),
        ("not an array", lambda: native.adamw_step([0.0] * n, f.copy(), f, f, None, hyper),
         "m must be a writable numpy array"),
        ("overlap", lambda: native.adamw_step(m, f.copy(), f, f, m, hyper), "must not overlap"),
        ("delta without out", lambda: native.adamw_step(f.copy(), f.copy(), f, f, None, hyper,
                                                        delta_base=b), "delta_base needs"),
        ("bf16 out dtype", lambda: native.adamw_step(f.copy(), f.copy(), f, f, None, hyper,
                                                     param_bf16_out=f.copy()),
         "param_bf16_out must be bfloat16"),
        ("convert dtype", lambda: native.f32_to_bf16(b, b.copy()), "src must be float32"),
        ("convert size", lambda: native.bf16_to_f32(b, np.zeros(n - 1, F32)), "dst has 7"),
        ("convert overlap", lambda: native.bf16_to_f32(m.view(BF16)[:4], m[:4]),
         "must not overlap"),
        ("descriptor", lambda: native.host_descriptor(ro), "read-only"),
    ]  # fmt: skip


@pytest.mark.parametrize(("fn", "match"), [c[1:] for c in _err_cases()],
                         ids=[c[0] for c in _err_cases()])  # fmt: skip
def test_bad_inputs_raise_clear_errors(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def test_ffi_adamw_rejects_bad_grad_dtype():
    x = jax.device_put(jnp.zeros(8, jnp.float32), CPU)
    with pytest.raises(jax.errors.JaxRuntimeError, match="grad must be float32 or bfloat16"):
        step = native.adamw_update(x, x, x.astype(jnp.float16), x, make_hyper(1, 0.0))
        step[0].block_until_ready()


# ---- CUDA (only on a GPU machine) ---------------------------------------------------------------


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.skipif(
    not _gpus() or importlib.util.find_spec("jax_mlpo._native_cuda") is None,
    reason="needs a GPU backend and the _native_cuda module (JAX_MLPO_ENABLE_CUDA=ON)",
)
def test_cuda_copies_roundtrip():
    gpu = _gpus()[0]
    n = (1 << 20) + 3
    x = jax.device_put(jnp.arange(n, dtype=jnp.float32), gpu)
    buf = np.zeros(n, F32)
    native.cuda_host_register(buf)
    try:
        desc = jax.device_put(native.host_descriptor(buf), gpu)
        token = jax.jit(native.copy_to_host)(x, desc)
        token.block_until_ready()
        assert_bits_equal(buf, x, "to_host")
        y = jax.jit(native.copy_from_host, static_argnums=(1, 2))(token, (n,), jnp.float32)
        assert_bits_equal(y, x, "from_host")
    finally:
        native.cuda_host_unregister(buf)


# -- crc32c -------------------------------------------------------------------------------------


def crc32c_bitwise(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_crc32c_standard_vectors_and_streaming():
    # RFC 3720 (iSCSI) B.4 vectors and the usual check value
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(bytes(32)) == 0x8A9136AA
    assert native.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert native.crc32c(bytes(range(32))) == 0x46DD794E
    assert native.crc32c(b"") == 0
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 4099, dtype=np.uint8)
    for start, stop in [(0, 4099), (1, 4099), (3, 10), (7, 7), (5, 4000)]:  # odd alignments
        part = data[start:stop]
        assert native.crc32c(part) == crc32c_bitwise(part.tobytes()), (start, stop)
    split = native.crc32c(data[1000:], native.crc32c(data[:1000]))
    assert split == native.crc32c(data)


def test_crc32c_equals_zarr3_codec(tmp_path):
    # The tiers' checksums are the standard CRC-32C: the same as tensorstore's zarr3 codec stores.
    data = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(tmp_path / "a")},
        "metadata": {
            "shape": [1000],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1000]}},
            "data_type": "float32",
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
        },
    }
    ts.open(spec, create=True).result().write(data).result()
    raw = (tmp_path / "a" / "c" / "0").read_bytes()
    assert raw[:-4] == data.tobytes()
    assert int.from_bytes(raw[-4:], "little") == native.crc32c(data)
