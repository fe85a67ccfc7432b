"""Where a jax.numpy rule's chunk spends its time, and what each other way of reaching XLA costs.

:mod:`jax_mlpo.optimizers.jax_rule` runs a rule chunk by chunk: the chunk's inputs become XLA
arrays without a copy, one call of the jitted rule, its outputs copied into the state. This
measures, in microseconds (min and median of ``--calls`` calls):

- ``dispatch``: one call of a program over three 1024-element arrays (the fixed cost of a
  call), on an asynchronous XLA:CPU client (jax's default) and on a synchronous one, through
  ``jax.jit``, the ahead-of-time ``jax.jit(f).lower(...).compile()`` and the loaded
  executable's own ``execute``;
- ``import``: a 2^16-element float32 chunk as an XLA array without a copy:
  ``jnp.from_dlpack(x, device=d)``, ``jax.device_put(x, d, may_alias=True)`` and jaxlib's
  dlpack import onto ``d`` (what the runner uses);
- ``donation``: whether an output of a program that donates its input lands in that input's
  memory, for an array XLA allocated and for a dlpack view of a NumPy array;
- ``stages``: the runner's three steps for one chunk of AdaBelief (import the 4 inputs, call,
  copy the 3 outputs into the state), chunk by chunk over a 2^23-element segment, for several
  chunk sizes, on one thread.

    python -m experiments.bench.mlpo.jax_rule_costs --json experiments/results/jax_rule_costs.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib import xla_client

from experiments.bench.harness import write_json
from experiments.bench.mlpo.jax_rule import HYPER, aligned
from experiments.optimizers.adabelief import AdaBelief
from jax_mlpo.optimizers.jax_rule import _store, _view

NAMES = tuple(sorted(HYPER))


def timed(fn: Callable[[int], object], calls: int) -> dict[str, float]:
    """Min and median microseconds of ``fn(i)`` for ``i`` in ``range(calls)``, after one."""
    fn(0)
    ts = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - start)
    return {"min_us": min(ts) * 1e6, "median_us": float(np.median(ts)) * 1e6}


def rule(m, s, g, h):
    hyper = {k: h[i] for i, k in enumerate(NAMES)}
    (m, s), u = AdaBelief().step((m, s), g, None, hyper, decay=False)
    return m, s, u


def _dispatch_one(asynchronous: bool, calls: int) -> dict:
    device = xla_client.make_cpu_client(asynchronous=asynchronous).devices()[0]
    x = jax.device_put(np.ones(1024, np.float32), device)
    h = jax.device_put(np.ones(len(NAMES), np.float32), device)
    jitted = jax.jit(rule)
    compiled = jitted.lower(x, x, x, h).compile()
    loaded = compiled._executable.xla_executable  # the executable under jax's call
    return {
        "jit": timed(lambda i: jax.block_until_ready(jitted(x, x, x, h)), calls),
        "aot_compiled": timed(lambda i: jax.block_until_ready(compiled(x, x, x, h)), calls),
        "execute": timed(lambda i: jax.block_until_ready(loaded.execute([x, x, x, h])), calls),
    }


def dispatch(calls: int) -> dict:
    return {"async_client": _dispatch_one(True, calls), "sync_client": _dispatch_one(False, calls)}


def imports(device: jax.Device, calls: int) -> dict:
    x = aligned(1 << 16)
    x.fill(1.0)
    return {
        "jnp_from_dlpack": timed(lambda i: jnp.from_dlpack(x, device=device), calls),
        "device_put_may_alias": timed(lambda i: jax.device_put(x, device, may_alias=True), calls),
        "jaxlib_dlpack": timed(lambda i: _view(x, device), calls),
    }  # fmt: skip


def donation(device: jax.Device) -> dict:
    """Whether the donated input's memory receives the output (read back through NumPy)."""
    double = jax.jit(lambda a: a * 2.0, donate_argnums=0)
    owned = jax.device_put(np.ones(1 << 16, np.float32), device) + 0.0
    owned_ptr = owned.unsafe_buffer_pointer()
    out = double(owned)
    host = aligned(1 << 16)
    host.fill(1.0)
    viewed = double(_view(host, device))
    return {
        "xla_owned_buffer_aliased": out.unsafe_buffer_pointer() == owned_ptr,
        "dlpack_view_aliased": bool(np.asarray(viewed)[0] == host[0]),  # 2.0 == 1.0: copied
    }


def stages(device: jax.Device, sizes: list[int], calls: int) -> dict:
    n = 1 << 23
    m, s, g, p, u = (aligned(n) for _ in range(5))
    for x in (m, s, g, p, u):
        x.fill(0.5)
    h = jax.device_put(np.array([HYPER[k] for k in NAMES], np.float32), device)
    program = jax.jit(rule, keep_unused=True)  # the runner imports p too
    out = {}
    for c in sizes:
        ts: dict[str, list[float]] = {"import": [], "call": [], "store": []}
        for i in range(calls + 1):  # the first compiles
            span = slice((i % (n // c)) * c, (i % (n // c)) * c + c)
            t0 = time.perf_counter()
            views = [_view(x[span], device) for x in (m, s, g, p)]
            t1 = time.perf_counter()
            values = jax.block_until_ready(program(*views[:3], h))
            t2 = time.perf_counter()
            for dst, value in zip((m, s, u), values, strict=True):
                _store(dst[span], value)
            t3 = time.perf_counter()
            if i:
                for key, dt in zip(ts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    ts[key].append(dt * 1e6)
        row = {k: {"min_us": min(v), "median_us": float(np.median(v))} for k, v in ts.items()}
        per_chunk = [sum(x) for x in zip(*ts.values(), strict=True)]
        row["gbps"] = {"best": 24 * c / min(per_chunk) / 1e3,
                       "median": 24 * c / float(np.median(per_chunk)) / 1e3}  # fmt: skip
        out[str(c)] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300, help="timed calls per figure")
    parser.add_argument("--json", type=str, default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    device = xla_client.make_cpu_client(asynchronous=False).devices()[0]
    result = {
        "dispatch": dispatch(args.calls),
        "import": imports(device, args.calls),
        "donation": donation(device),
        "stages": stages(device, [1 << 16, 1 << 18, 1 << 20], max(8, args.calls // 3)),
        "jax": jax.__version__,
    }
    rounded = jax.tree.map(lambda v: round(v, 1) if isinstance(v, float) else v, result)
    for part in ("dispatch", "import", "stages"):
        print(part)
        for key, value in rounded[part].items():
            print(f"  {key}: {value}")
    print("donation", result["donation"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
