"""An elementwise update rule written in ``jax.numpy``, run by the engine over its host state.

:class:`jax_mlpo.extend.JaxElementwiseOptimizer` hands its rule here. Each variant of the rule
(weight decay or not, fp32 master or not, the dtypes) runs as a tile program
(:mod:`jax_mlpo.optimizers.rule_program`: one pass over a segment, on the kernels' threads)
where it compiles into one. Otherwise (a reduction, an integer, an operation a tile program
lacks; warned once) XLA compiles it for the CPU, once per chunk shape, into vectorised loops,
one per output (XLA:CPU does not fuse several outputs into one loop; each recomputes what it
needs from the inputs). The engine's subgroups live in its own host buffers, not in XLA's, so
each segment is cut into chunks of :data:`CHUNK` elements, each one call of the jitted rule on a
synchronous XLA:CPU client of the runner's own: the chunk's inputs become XLA arrays without a
copy (jaxlib's dlpack import; an unaligned chunk is first copied into a reused aligned buffer),
and the fresh outputs are copied into the state. The chunks are spread over
``native.num_threads()`` threads, one job each (XLA and the copies release the GIL).

Where a chunk's time goes, and why not the alternatives (``python -m
experiments.bench.mlpo.jax_rule_costs``, ``experiments/results/jax_rule_costs.json``: AMD EPYC,
2 cores shared with other jobs, load average 7, 2026-12-06; microseconds, min/median):

- the call: the fixed cost of one call is 11/12 on a synchronous client and 21/50 on an
  asynchronous one (jax's default, which hands each call to a thread of its own and waits for
  it); ``jax.jit`` costs no more than the ahead-of-time ``lower().compile()`` executable
  (11.7/12.3) or its ``execute`` (15.5/16.2), so the runner keeps ``jax.jit``;
- the inputs: jaxlib's import takes 3.3/3.5 per array, ``jnp.from_dlpack(x, device=d)`` 68/73
  (it imports onto the default client, then moves the array) and ``jax.device_put(x, d,
  may_alias=True)`` 25/26, more than a small chunk's arithmetic;
- the outputs: XLA writes them into buffers of its own. An input donated to the call would
  take them in place for a buffer XLA allocated, but a dlpack view of the engine's memory is
  copied instead (measured: the output is not in the view), so the outputs are copied;
- the chunk: per 2^18-element chunk of AdaBelief, importing 4 inputs 25, the call 260 and the
  3 copies 106, 15.9 GB/s on one thread at best; 2^16 elements pay the fixed costs 4 times as
  often (11.7 GB/s), and 2^20 elements' fresh 4 MiB outputs are new pages on most calls
  (12.2 GB/s at best, 6.4 at the median); one call over a whole segment, its outputs then
  copied, is slower still (``experiments/bench/mlpo/jax_rule.py``'s ``jax_whole_segment``).

NumPy evaluates one expression at a time with a temporary each, on one core. The native
kernels read and write each array once in one loop; the XLA path also writes the outputs once
more and recomputes within XLA's loops: some 3x slower than the tile program
(docs/extending.md).
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib import xla_client

from jax_mlpo.engine.quantize import Quantized
from jax_mlpo.errors import UnsupportedRuleError
from jax_mlpo.optimizers.rule_program import TileRule, compile_rule
from jax_mlpo.types import BF16, F32

CHUNK = 1 << 18  # elements per XLA call: 1 MiB per float32 array (the docstring says why)
MIN_CHUNK = 1 << 10  # the smallest compiled chunk; a shorter tail gets its own shape
_ALIGN = 64  # bytes: XLA:CPU takes a buffer without a copy from this alignment
_DL_CPU = 1  # dlpack's device type of host memory

# a rule: (moments, grad, param, hyper, *, decay) -> (new moments, update), in jax.numpy
Rule = Callable[..., tuple[tuple[jax.Array, ...], jax.Array]]


def chunks(n: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """``[start, stop)`` pieces of ``n`` elements: whole chunks, then the tail in powers of two
    down to :data:`MIN_CHUNK` and one last piece, so that few shapes are ever compiled."""
    out, start = [], 0
    while n - start >= chunk:
        out.append((start, start + chunk))
        start += chunk
    size = chunk // 2
    while size >= MIN_CHUNK:
        if n - start >= size:
            out.append((start, start + size))
            start += size
        size //= 2
    if start < n:
        out.append((start, n))
    return out


def _dlpack_import() -> Callable[[np.ndarray, jax.Device], jax.Array] | None:
    """jaxlib's own dlpack import onto a given device, a few microseconds; None where this
    jaxlib lacks it. (``jnp.from_dlpack(x, device=d)`` imports onto the default client, then
    moves the array to ``d``'s: some 70 microseconds, more than a chunk's arithmetic.)"""
    try:
        from jax._src.lib import _jax, jaxlib_extension_version
    except ImportError:
        return None
    convert = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
    if convert is None:
        return None
    if jaxlib_extension_version >= 467:
        return lambda x, device: convert(x.__dlpack__(), device, None, False, _DL_CPU)
    return lambda x, device: convert(x.__dlpack__(), device, None, False)


_IMPORT = _dlpack_import()


def _view(x: np.ndarray, device: jax.Device) -> jax.Array:
    """A 64-byte aligned, contiguous, writeable host array (or bfloat16 bits) as an array of
    ``device``, without a copy."""
    if _IMPORT is not None:
        return _IMPORT(x, device)
    return jax.device_put(x, device, may_alias=True)  # zero-copy too, at ~25 microseconds


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16) if x.dtype == BF16 else x  # dlpack has no bfloat16


def _viewable(x: np.ndarray) -> bool:
    """Whether XLA can take ``x``'s chunks as they are: every chunk starts a multiple of
    :data:`MIN_CHUNK` elements from ``x``, so it is aligned where ``x`` is."""
    return x.ctypes.data % _ALIGN == 0 and x.flags.c_contiguous and x.flags.writeable


def _staged(x: np.ndarray, staging: dict[int, np.ndarray], slot: int) -> np.ndarray:
    """A copy of ``x`` in the thread's aligned buffer for argument ``slot``, which the next
    chunk reuses (in the cache, where a fresh XLA buffer would be a new allocation)."""
    buf = staging.get(slot)
    if buf is None or buf.nbytes < x.nbytes:
        raw = np.empty(x.nbytes + _ALIGN, np.uint8)
        staging[slot] = buf = raw[-raw.ctypes.data % _ALIGN :][: x.nbytes]
    dst = buf[: x.nbytes].view(x.dtype)
    np.copyto(dst, x)
    return dst


def _from_bits(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if dtype == BF16 else x


def _to_bits(x: jax.Array, dtype: np.dtype) -> jax.Array:
    x = x.astype(jnp.bfloat16 if dtype == BF16 else jnp.float32)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if dtype == BF16 else x


def _store(dst: np.ndarray, value: jax.Array) -> None:
    np.copyto(dst.view(np.uint16) if dst.dtype == BF16 else dst, np.asarray(value))


class RuleRunner:
    """Runs one optimizer's ``jax.numpy`` rule over segments of the engine's state.

    Args:
      rule: the rule (:meth:`jax_mlpo.extend.JaxElementwiseOptimizer.step`).
      name: the optimizer's name, for messages.
      threads: the threads the chunks are spread over.
      chunk: elements per XLA call.
      tile: run the rule as a tile program where it compiles into one (the default); False:
        always through XLA.
    """

    def __init__(self, rule: Rule, name: str, threads: int, chunk: int = CHUNK, *,
                 tile: bool = True) -> None:  # fmt: skip
        self._rule, self._name, self._chunk, self._tile = rule, name, chunk, tile
        self._tiles: dict[tuple[Any, ...], TileRule | None] = {}
        self._warned = False
        self._threads = max(1, threads)
        self._programs: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # each thread's staging buffers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # XLA:CPU of its own: the update runs inside a call of the training step's program,
        # and a program of the same client launched from there may wait behind that very
        # program (the client runs a device's programs on its own threads). Synchronous: a
        # call runs on the calling thread, where an asynchronous client hands each one to a
        # thread of its own and waits for it (some 40 microseconds a call on a busy host).
        self._device: jax.Device | None = None

    def _tile_rule(self, key: tuple[Any, ...]) -> TileRule | None:
        """The variant's tile program, or None where the rule needs XLA (warned once)."""
        if not self._tile:
            return None
        with self._lock:
            if key in self._tiles:
                return self._tiles[key]
            decay, moment_dtypes, grad_dtype, master, out_dtype, names = key
            program = self._build(*key, bits=False)
            n = len(moment_dtypes)
            dtypes = [*moment_dtypes, grad_dtype, F32] + ([BF16] if master else [])

            def flat(*args):
                base = args[n + 2] if master else None
                stored, p_new, out = program(args[:n], args[n], args[n + 1], base,
                                             args[len(dtypes) :])  # fmt: skip
                return tuple(x for x in (*stored, p_new, out) if x is not None)

            try:
                found = compile_rule(flat, dtypes, len(names))
            except UnsupportedRuleError as e:
                found = None
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"{self._name}: {e}; the rule runs through XLA instead, "
                                  "several times slower", stacklevel=2)  # fmt: skip
            self._tiles[key] = found
            return found

    def _program(self, key: tuple[Any, ...]) -> Callable[..., Any]:
        with self._lock:
            found = self._programs.get(key)
            if found is None:
                found = self._programs[key] = jax.jit(self._build(*key))
            return found

    def _build(self, decay: bool, moment_dtypes: tuple[np.dtype, ...], grad_dtype: np.dtype,
               master: bool, out_dtype: np.dtype | None, names: tuple[str, ...],
               bits: bool = True) -> Callable[..., Any]:  # fmt: skip
        """The step of one variant: ``(moments, grad, param, base, scalars) -> (moments, new
        param, update)``; ``bits``: bfloat16 arrays cross as their uint16 bits (for XLA)."""
        rule = self._rule
        from_bits = _from_bits if bits else (lambda x, dtype: x)
        to_bits = _to_bits if bits else (lambda x, dtype: x.astype(dtype))

        def program(moments, grad, param, base, scalars):
            hyper = {k: scalars[i] for i, k in enumerate(names)}  # one argument, not one each
            moments = tuple(from_bits(m, d) for m, d in zip(moments, moment_dtypes, strict=True))
            g = from_bits(grad, grad_dtype).astype(jnp.float32)
            new, u = rule(moments, g, param, hyper, decay=decay)
            new = tuple(new)
            if len(new) != len(moment_dtypes):
                raise ValueError(f"{self._name}.step returned {len(new)} moments, it keeps "
                                 f"{len(moment_dtypes)}")  # fmt: skip
            stored = tuple(to_bits(m, d) for m, d in zip(new, moment_dtypes, strict=True))
            u = jnp.asarray(u, jnp.float32)
            if not master:
                return stored, None, u if out_dtype is not None else None
            p_new = param + u
            if out_dtype is None:
                out = None
            elif out_dtype == BF16:  # write_update's bfloat16(master_new) - params
                b = from_bits(base, BF16).astype(jnp.float32)
                out = to_bits(p_new.astype(jnp.bfloat16).astype(jnp.float32) - b, BF16)
            else:
                out = p_new - from_bits(base, BF16).astype(jnp.float32)
            return stored, p_new, out

        return program

    def run(
        self, segments: list[tuple[Any, tuple[Any, ...], np.ndarray, np.ndarray, Any, Any]],
        hyper: Mapping[str, Any],
    ) -> None:  # fmt: skip
        """One step of ``segments`` (:func:`jax_mlpo.optimizers.segment_calls`' tuples)."""
        names = tuple(sorted(hyper))
        values = [hyper[k] for k in names]
        tasks, scalars = [], None
        for seg, moments, grad, param, out, base in segments:
            for m in moments:
                if isinstance(m, Quantized):
                    raise ValueError(f"{self._name}: a jax.numpy rule takes float32 or bfloat16 "
                                     "moments, not q8")  # fmt: skip
            key = (bool(seg.decay), tuple(m.dtype for m in moments), grad.dtype,
                   base is not None, None if out is None else out.dtype, names)  # fmt: skip
            tile = self._tile_rule(key)
            if tile is not None:  # the whole segment in one pass, on the kernels' threads
                inputs = [x for x in (*moments, grad, param, base) if x is not None]
                outputs = [x for x in (*moments, param if base is not None else None, out)
                           if x is not None]  # fmt: skip
                tile.run(values, inputs + outputs)
                continue
            if scalars is None:
                if self._device is None:
                    self._device = xla_client.make_cpu_client(asynchronous=False).devices()[0]
                scalars = jax.device_put(np.array(values, F32), self._device)
            program = self._program(key)
            inputs = [_bits(x) for x in (*moments, grad, param, base) if x is not None]
            viewable = [_viewable(x) for x in inputs]
            stores = [*moments, param if base is not None else None, out]
            for start, stop in chunks(param.shape[0], self._chunk):
                span = slice(start, stop)
                tasks.append((program, len(moments), inputs, viewable, stores, span))
        if not tasks:
            return
        device = self._device
        if len(tasks) <= 1 or self._threads == 1:
            self._chunk_steps(device, scalars, tasks)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix=f"jax_mlpo-{self._name}"
            )
        # one job per thread over every threads-th chunk: no task objects or futures per chunk
        futures = [self._pool.submit(self._chunk_steps, device, scalars, tasks[k :: self._threads])
                   for k in range(self._threads)]  # fmt: skip
        for future in futures:
            future.result()

    def _chunk_steps(self, device: jax.Device, scalars: jax.Array, tasks: list[tuple]) -> None:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = {}
        for program, n, inputs, viewable, stores, span in tasks:
            views = [_view(x[span] if ok else _staged(x[span], staging, k), device)
                     for k, (x, ok) in enumerate(zip(inputs, viewable, strict=True))]  # fmt: skip
            base = views[n + 2] if len(views) > n + 2 else None
            stored, p_new, u = program(tuple(views[:n]), views[n], views[n + 1], base, scalars)
            for dst, value in zip(stores, (*stored, p_new, u), strict=True):
                if value is not None:
                    _store(dst[span], value)

    def close(self) -> None:
        """Stops the threads (a later :meth:`run` starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def check_float(moment_dtypes: tuple[np.dtype, ...], name: str) -> None:
    """Refuses q8 moments for a ``jax.numpy`` rule, naming the fix."""
    for d in moment_dtypes:
        if d not in (F32, BF16):
            raise ValueError(
                f"{name}: a jax.numpy rule keeps its moments in float32 or bfloat16, not {d}"
            )
