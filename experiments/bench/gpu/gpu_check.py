"""GPU check of jax_mlpo's CUDA copy handlers (run by gpu_check.sh on a GPU machine).

1. FFI device -> pinned host and pinned host -> device copies (cudaMemcpyAsync on XLA's stream)
   against a raw cudaMemcpyAsync of the same buffers: bandwidth and their ratio, medians.
2. The copies are exact, and a new host buffer does not recompile.
3. A jitted step whose gradients leave the GPU through the FFI, are updated on the host by the
   native AdamW kernel and come back through the FFI equals the CPU path (the CPU FFI kernel on
   the CPU device) bit for bit.
4. ``jax_mlpo.adamw`` itself on GPU params (the CUDA handler of the host update, subgroups
   staged through pinned buffers) equals the same run on the CPU device bit for bit.
5. The plain step against ``jax_mlpo.overlapped_step`` (a send and a receive per group,
   ``ffi/cuda_grouped.h``) on a small model: the same params bit for bit, each step's median
   time over a few rounds, and their ratio.

Prints a report; exits non-zero if a check fails.

    python -m experiments.bench.gpu.gpu_check [--mib 256] [--repeats 10]   # from the repo root
"""

from __future__ import annotations

import argparse
import functools
import logging
import pathlib
import statistics
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[3]
log = logging.getLogger("gpu_check")


def import_native():
    """jax_mlpo.native, even where the package's other dependencies are not installed."""
    try:
        import jax_mlpo  # noqa: F401
    except ImportError as e:
        log.warning("importing jax_mlpo failed (%s); loading jax_mlpo.native on its own", e)
        for name in [k for k in sys.modules if k == "jax_mlpo" or k.startswith("jax_mlpo.")]:
            del sys.modules[name]
        pkg = types.ModuleType("jax_mlpo")
        paths = [ROOT / "jax_mlpo"] + [pathlib.Path(p) / "jax_mlpo" for p in sys.path if p]
        pkg.__path__ = list(dict.fromkeys(str(p) for p in paths if p.is_dir()))
        sys.modules["jax_mlpo"] = pkg
    from jax_mlpo import native

    return native


native = import_native()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.bench.harness import median_time  # noqa: E402
from jax_mlpo.native import testing  # noqa: E402
from jax_mlpo.types import BF16, F32, AdamWHyper  # noqa: E402

_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: (
        _compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
)
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
    if not ok:
        FAILURES.append(what)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def raw_memcpy_seconds(dst: int, src: int, nbytes: int, kind: int, repeats: int) -> float:
    times = testing.cuda_memcpy_bench(dst, src, nbytes, to_device=kind == 1, iters=repeats + 1)
    return statistics.median(times[1:])  # the first copy is a warm-up


def bandwidth(gpu, nbytes: int, repeats: int) -> None:
    n = nbytes // 4
    x = jax.device_put(jnp.arange(n, dtype=jnp.float32) * 0.5 + 1.0, gpu)
    y = jax.device_put(jnp.zeros(n, jnp.float32), gpu)  # scratch for the raw H2D copies
    host = [np.empty(n, F32), np.empty(n, F32)]
    for h in host:
        native.cuda_host_register(h)
    try:
        to_host = jax.jit(lambda x, d: native.copy_to_host(x, d))
        from_host = jax.jit(lambda d: native.copy_from_host(d, (n,), jnp.float32))
        descs = [jax.device_put(native.host_descriptor(h), gpu) for h in host]

        t_ffi_d2h = median_time(lambda: to_host(x, descs[0]).block_until_ready(), repeats)
        check(same_bits(host[0], x), f"{nbytes >> 20} MiB FFI D2H copy is exact")
        t_ffi_h2d = median_time(lambda: from_host(descs[0]).block_until_ready(), repeats)
        check(same_bits(from_host(descs[0]), host[0]), f"{nbytes >> 20} MiB FFI H2D copy is exact")

        before = len(_compiles)
        to_host(x, descs[1]).block_until_ready()
        from_host(descs[1]).block_until_ready()
        check(len(_compiles) == before, "a new host buffer does not recompile")
        check(same_bits(host[1], x), "copy into the second host buffer is exact")

        xp, yp = x.unsafe_buffer_pointer(), y.unsafe_buffer_pointer()
        hp = host[0].__array_interface__["data"][0]
        t_raw_d2h = raw_memcpy_seconds(hp, xp, nbytes, 2, repeats)
        t_raw_h2d = raw_memcpy_seconds(yp, hp, nbytes, 1, repeats)
        for name, t_ffi, t_raw in (("D2H", t_ffi_d2h, t_raw_d2h), ("H2D", t_ffi_h2d, t_raw_h2d)):
            ffi_gbps, raw_gbps = nbytes / t_ffi / 1e9, nbytes / t_raw / 1e9
            print(
                f"RESULT {name} {nbytes >> 20:>5} MiB: FFI {ffi_gbps:7.2f} GB/s "
                f"({t_ffi * 1e3:8.3f} ms), raw cudaMemcpyAsync {raw_gbps:7.2f} GB/s "
                f"({t_raw * 1e3:8.3f} ms), FFI/raw {ffi_gbps / raw_gbps:5.3f}",
                flush=True,
            )
    finally:
        for h in host:
            native.cuda_host_unregister(h)


def step_parity(gpu, cpu, n: int, steps: int) -> None:
    """GPU grads -> FFI D2H -> native AdamW on the host -> FFI H2D equals the CPU FFI path."""
    hyper0 = AdamWHyper(1.0, 1.0, 1e-3, 0.9, 0.999, 1e-8, 0.01)
    p0 = np.random.default_rng(0).standard_normal(n).astype(F32)

    def grads(p_bf16, t):  # the same bits on either device: the f32 product is exact
        return (p_bf16.astype(jnp.float32) * (0.25 * t)).astype(jnp.bfloat16)

    # GPU path: host buffers owned by "the engine", pinned.
    m, v, p32 = np.zeros(n, F32), np.zeros(n, F32), p0.copy()
    g_host, pb_host, u_host = np.empty(n, BF16), np.empty(n, BF16), np.empty(n, F32)
    for h in (g_host, pb_host):
        native.cuda_host_register(h)
    try:
        d2h = jax.jit(lambda p, t, d: native.copy_to_host(grads(p, t), d))
        h2d = jax.jit(lambda d: native.copy_from_host(d, (n,), jnp.bfloat16))
        desc_g = jax.device_put(native.host_descriptor(g_host), gpu)
        desc_pb = jax.device_put(native.host_descriptor(pb_host, writable=False), gpu)
        p_gpu = jax.device_put(p0.astype(BF16), gpu)

        # CPU path: the same step with the CPU FFI kernel inside jit, state on the CPU device.
        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def cpu_step(m, v, p32, p_bf16, t, lr, bc1, bc2):
            h = hyper0._replace(lr=lr, bc1=bc1, bc2=bc2)
            m, v, p32, _ = native.adamw_update(m, v, grads(p_bf16, t), p32, h, update_param=True)
            return m, v, p32, p32.astype(jnp.bfloat16)

        state = [jax.device_put(a, cpu) for a in (np.zeros(n, F32), np.zeros(n, F32), p0)]
        p_cpu = jax.device_put(p0.astype(BF16), cpu)

        for t in range(1, steps + 1):
            bc1, bc2 = np.float32(1 - 0.9**t), np.float32(1 - 0.999**t)
            hyper = hyper0._replace(bc1=float(bc1), bc2=float(bc2))
            d2h(p_gpu, np.float32(t), desc_g).block_until_ready()
            native.adamw_step(m, v, g_host, p32, u_host, hyper, update_param=True,
                              param_bf16_out=pb_host)  # fmt: skip
            p_gpu = h2d(desc_pb)
            p_gpu.block_until_ready()
            *state, p_cpu = cpu_step(*state, p_cpu, np.float32(t), np.float32(hyper.lr), bc1, bc2)
        ok = all(same_bits(a, b) for a, b in zip((m, v, p32), state, strict=True))
        check(ok and same_bits(p_gpu, p_cpu),
              f"{steps} steps through FFI D2H/H2D equal the CPU path bit for bit")  # fmt: skip
    finally:
        for h in (g_host, pb_host):
            native.cuda_host_unregister(h)


def transport_parity(gpu, cpu, steps: int, **moments) -> None:
    """jax_mlpo.adamw on GPU params (the CUDA host-update handler: subgroups staged through
    pinned buffers on XLA's stream) equals the same run on the CPU device bit for bit
    (``moments``: ``mu_dtype``/``nu_dtype``, e.g. q8)."""
    import tempfile
    import time

    import optax

    import jax_mlpo

    shapes = {"a": (1000, 1003), "b": (77,), "c": (3, 5)}

    def run(dev):
        with jax.default_device(dev), tempfile.TemporaryDirectory() as tier:
            params = {
                k: jnp.asarray(np.random.default_rng(i).standard_normal(shape), jnp.bfloat16)
                for i, (k, shape) in enumerate(shapes.items())
            }
            config = jax_mlpo.OffloadConfig(host_cache="64MiB", tiers=[tier], subgroup_size=1 << 18)
            tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config, **moments)
            state = tx.init(params)

            @jax.jit
            def step(p, s, t):
                g = jax.tree.map(lambda x: (x.astype(jnp.float32) * (0.25 * t)).astype(x.dtype), p)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            times = []
            for t in range(1, steps + 2):
                t0 = time.perf_counter()
                params, state = jax.block_until_ready(step(params, state, np.float32(t)))
                times.append(time.perf_counter() - t0)
            host_bytes = jax_mlpo.engine_of(state).host_bytes
            jax_mlpo.close(state)
        print(f"  {dev.platform}: median step {statistics.median(times[1:]) * 1e3:.1f} ms, "
              f"engine host memory {host_bytes / 2**20:.1f} MiB")  # fmt: skip
        return jax.device_get(params)

    results = {dev.platform: run(dev) for dev in (gpu, cpu)}
    ok = all(same_bits(results["gpu"][k], results["cpu"][k]) for k in shapes)
    what = f" ({', '.join(f'{k}={v}' for k, v in moments.items())})" if moments else ""
    check(ok, f"{steps + 1} jax_mlpo.adamw steps{what} on the GPU equal the CPU run bit for bit")


def overlap_timing(gpu, steps: int, rounds: int, width: int = 2048, layers: int = 8) -> None:
    """The plain step against the overlapped one on an MLP of ``layers`` square layers
    (``width``² float32 each), the state on a file tier: median step time of each round's
    steps (the first step of a round compiles or fills the cache and is left out), the median
    over the rounds, and overlapped / plain."""
    import tempfile
    import time

    import optax

    import jax_mlpo

    keys = jax.random.split(jax.random.key(0), layers)
    names = [f"layer{k:02d}" for k in range(layers)]

    def loss_fn(params, x):
        for name in names:
            x = jnp.tanh(x @ params[name])
        return jnp.mean(x**2)

    def fresh():
        with jax.default_device(gpu):
            return {n: jax.random.normal(k, (width, width)) / width**0.5
                    for n, k in zip(names, keys, strict=True)}  # fmt: skip

    x = jax.device_put(jax.random.normal(jax.random.key(1), (256, width)), gpu)

    def run(kind: str, tier: str):
        config = jax_mlpo.OffloadConfig(host_cache="1GiB", tiers=[tier], subgroup_size=1 << 20)
        tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)
        params = fresh()
        state = tx.init(params)
        if kind == "plain":

            @jax.jit
            def step(params, state, x):
                loss, grads = jax.value_and_grad(loss_fn)(params, x)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state, loss

            carry = (params, state)
        else:

            @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
            def step(params, state, pending, x):
                return jax_mlpo.overlapped_step(loss_fn, tx, params, state, pending, x, groups=8)

            pending = jax.jit(jax.grad(loss_fn))(params, x)
            carry = (params, state, pending)
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            out = jax.block_until_ready(step(*carry, x))
            times.append(time.perf_counter() - t0)
            carry = out[:2] if kind == "plain" else out[:3]
        beside = [m.beside_s for m in jax_mlpo.metrics(carry[1])]
        jax_mlpo.close(carry[1])
        return statistics.median(times[1:]), beside

    medians: dict[str, list[float]] = {"plain": [], "overlapped": []}
    beside: list[float] = []
    for _ in range(rounds):
        for kind in medians:
            with tempfile.TemporaryDirectory() as tier:
                t, b = run(kind, tier)
            medians[kind].append(t)
            beside += b if kind == "overlapped" else []
    plain_s = statistics.median(medians["plain"])
    overlapped_s = statistics.median(medians["overlapped"])
    size = layers * width * width * 4 / 2**20
    print(f"RESULT overlap: {layers} x {width}^2 fp32 ({size:.0f} MiB of params), "
          f"{rounds} rounds of {steps} steps: plain {plain_s * 1e3:.1f} ms, overlapped "
          f"{overlapped_s * 1e3:.1f} ms, overlapped/plain {overlapped_s / plain_s:.3f}, "
          f"median beside_s {statistics.median(beside) * 1e3:.1f} ms", flush=True)  # fmt: skip
    check(all(b > 0 for b in beside), "every overlapped update handed groups back early")


def small_buffer_error(gpu) -> None:
    x = jax.device_put(jnp.zeros(1000, jnp.float32), gpu)
    small = np.zeros(999, F32)
    try:
        desc = jax.device_put(native.host_descriptor(small), gpu)
        jax.jit(native.copy_to_host)(x, desc).block_until_ready()
        check(False, "a too small host buffer is rejected")
    except Exception as e:  # noqa: BLE001 - XLA raises its runtime error type
        check("host buffer only" in str(e), f"a too small host buffer is rejected ({e!s:.80})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 256, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--overlap-rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(f"jax {jax.__version__}, devices {jax.devices()}, native isa {native.isa()}")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print("FAIL: no GPU backend")
        return 2
    testing._ensure_cuda_targets()
    print(f"CUDA devices seen by _native_cuda: {testing.cuda_device_count()}")
    cpu = jax.devices("cpu")[0]
    checks = [lambda: step_parity(gpus[0], cpu, (1 << 20) + 3, args.steps)]
    checks += [lambda: transport_parity(gpus[0], cpu, args.steps)]
    checks += [lambda: transport_parity(gpus[0], cpu, args.steps, mu_dtype="q8", nu_dtype="q8")]
    checks += [functools.partial(bandwidth, gpus[0], mib << 20, args.repeats) for mib in args.mib]
    checks += [lambda: small_buffer_error(gpus[0])]
    checks += [lambda: overlap_timing(gpus[0], 2 * args.steps, args.overlap_rounds)]
    for fn in checks:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report and go on with the other checks
            log.exception("check crashed")
            check(False, f"check crashed: {type(e).__name__}: {e}")
    print(f"SUMMARY: {len(FAILURES)} failure(s)" + "".join(f"\n  - {f}" for f in FAILURES))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
