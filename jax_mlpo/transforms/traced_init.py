"""An init traced by ``jax.jit`` that makes its engines when the compiled program runs.

``jax.jit(tx.init)``, a linen ``TrainState`` made under ``jit`` and an ``nnx.Optimizer`` made
under ``nnx.jit`` trace ``init`` with abstract params. The engine is laid out by the params'
shapes, dtypes and shardings alone (the fp32 master of bfloat16 params is set from their values
by the first update), so the traced init puts the making of its engines into the program as one
host call (:func:`handles_at_run_time`) on stand-ins of the params, which returns their
handles: every run of the compiled init makes its engines, and ``jax.eval_shape``, which never
runs the program, makes nothing and writes nothing.

On a mesh the stand-ins carry the params' shardings as XLA compiled them
(:class:`CompiledShardings`): with Explicit axes they are the params' types, with Auto axes
what the compiler chose, which is what a ``jax.lax.with_sharding_constraint`` before the init
asks for. The state's handle has one element per device of the mesh, as an eager init's has,
so the mesh must be known when the init is traced: from the params' types (Explicit axes) or
from ``jax.set_mesh``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding

from jax_mlpo.sharding import processes as distributed
from jax_mlpo.sharding.plan import update_key
from jax_mlpo.transforms.runtime import RUNTIME

_NO_MESH_AT_TRACE = (
    "tx.init was traced under jax.jit with no mesh in sight (no jax.set_mesh, and params "
    "without a mesh in their types), but its params are on {devices} devices when the program "
    "runs: the state's handle holds one element per device of the params' mesh, and its shape "
    "is fixed when the init is traced. Trace the jitted init under `with jax.set_mesh(mesh):` "
    "(or init eagerly, on the placed params)"
)


def made_at_run_time(params: Any, *, on_mesh: bool = True) -> bool:
    """Whether a traced ``init`` of ``params`` makes its engines when the compiled program runs
    (:func:`handles_at_run_time`): params in one process, on one device or (``on_mesh``) a mesh.
    Across processes each process's engine is laid out by its own shards, and the handle is
    one element per process: a traced init returns a template
    (:func:`~jax_mlpo.transforms.offloaded.template_state`), whose use names the fix."""
    if distributed.is_multiprocess():
        return False
    return on_mesh or trace_mesh(params) is None


def trace_mesh(params: Any) -> jax.sharding.AbstractMesh | None:
    """The mesh of several devices that traced ``params`` are on, as far as the trace shows:
    the mesh in their types (Explicit axes), else ``jax.set_mesh``'s; None for one device."""
    for leaf in jax.tree.leaves(params):
        mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
        if mesh is not None and not mesh.empty and mesh.size > 1:
            return mesh
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size <= 1 else mesh


def handle_shape(params: Any) -> tuple[int, ...]:
    """The shape of the handle of a state over traced ``params``: one element per device of
    their mesh, a scalar on one device."""
    mesh = trace_mesh(params)
    return () if mesh is None else tuple(mesh.axis_sizes)


class CompiledShardings:
    """The shardings of traced params as XLA compiles the program, recorded at compile time by
    ``jax.debug.inspect_array_sharding`` and read by the program's host call when it runs.

    One trace may be compiled more than once (a jitted function with other ``out_shardings``
    shares the trace): a compile that gives a leaf another sharding makes the runs refuse, since
    a run cannot tell which compile it belongs to.
    """

    def __init__(self, params: Any) -> None:
        leaves = jax.tree.leaves(params)
        self._mesh = trace_mesh(params)
        self._types = [jax.typeof(x).sharding for x in leaves]
        self._ndims = [jnp.ndim(x) for x in leaves]
        self._seen: list[Any] = [None] * len(leaves)
        self._conflict = False
        self._lock = threading.Lock()
        for k, leaf in enumerate(leaves):
            jax.debug.inspect_array_sharding(leaf, callback=functools.partial(self._record, k))

    def _record(self, k: int, sharding: jax.sharding.Sharding) -> None:
        with self._lock:
            seen = self._seen[k]
            if seen is not None and not seen.is_equivalent_to(sharding, self._ndims[k]):
                self._conflict = True
            self._seen[k] = sharding

    def on_several_devices(self) -> bool:
        """Whether the program runs the init on several devices (as traced or as compiled)."""
        return self._mesh is not None or any(
            s is not None and len(s.device_set) > 1 for s in self._seen
        )

    def placed(self, stand_ins: Any) -> Any:
        """``stand_ins`` (``ShapeDtypeStruct``s of the params) with the compiled shardings, on
        the traced mesh (its axis types); unchanged on one device.

        Raises:
          ValueError: the params are on several devices but no mesh was in sight at trace
            time, or the compiles disagree, or the shardings were not recorded (naming why).
        """
        leaves, treedef = jax.tree.flatten(stand_ins)
        if self._mesh is None:
            devices = max((len(s.device_set) for s in self._seen if s is not None), default=1)
            if devices > 1:
                raise ValueError(_NO_MESH_AT_TRACE.format(devices=devices))
            return stand_ins
        if self._conflict:
            raise ValueError(
                "one traced tx.init was compiled with other shardings of its params (a jitted "
                "function sharing its trace, with other in_shardings or out_shardings): its "
                "runs cannot tell which shardings their engine is laid out by. Jit a function "
                "of its own for each set of shardings"
            )
        if any(s is None for s in self._seen):
            raise ValueError(
                "the shardings of the params of a jitted tx.init on a mesh were not recorded "
                "when it was compiled (a program loaded from JAX's persistent compilation "
                "cache is not compiled again): clear that cache for this function, or init "
                "eagerly, on the placed params"
            )
        structs = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._named(k, x.shape))
            for k, x in enumerate(leaves)
        ]
        return treedef.unflatten(structs)

    def _named(self, k: int, shape: tuple[int, ...]) -> NamedSharding:
        """Leaf ``k``'s compiled sharding as a ``NamedSharding`` on the traced mesh."""
        seen, traced = self._seen[k], self._mesh
        assert traced is not None
        spec = getattr(seen, "spec", None)
        if isinstance(seen, NamedSharding) and seen.mesh.axis_names == traced.axis_names:
            devices = seen.mesh.devices
        else:  # an explicitly sharded leaf may come back as an HLO sharding: its type's spec
            devices = np.asarray(getattr(seen, "_device_assignment", ()))
            spec = getattr(self._types[k], "spec", None)
        named = None
        if spec is not None and devices.size == traced.size:
            mesh = Mesh(devices.reshape(traced.axis_sizes), traced.axis_names,
                        axis_types=traced.axis_types)  # fmt: skip
            named = NamedSharding(mesh, spec)
        if named is None or not named.is_equivalent_to(seen, len(shape)):
            raise ValueError(
                f"param {k} of a jitted tx.init was compiled with sharding {seen}, not on the "
                f"mesh the init was traced with ({dict(traced.shape)}): place the params on "
                "the mesh set by jax.set_mesh"
            )
        return named


def stand_ins_of(params: Any) -> Any:
    """Traced ``params`` as ``ShapeDtypeStruct``s: what an engine is laid out by (the fp32
    master of bfloat16 params is set from their values by the first update)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)


def handles_at_run_time(
    make: Callable[[], Sequence[Any]],
    shapes: Sequence[tuple[int, ...]],
    on_failure: Callable[[Exception], Sequence[Any]] | None = None,
) -> list[jax.Array]:
    """int32 handles of ``shapes`` that ``make`` returns when the compiled program runs.

    A traced ``init`` (``jax.jit(tx.init)``, a linen ``TrainState`` made under ``jit``, an
    ``nnx.Optimizer`` made under ``nnx.jit``) puts the making of its engines into the program
    as a host call: every run of it makes new engines (each replacing the engine at its place,
    as a second eager init does), and ``jax.eval_shape``, which never runs the program, makes
    nothing and writes nothing.

    Args:
      make: returns one handle array per state, each of its shape in ``shapes``.
      shapes: each state's handle shape: a scalar, or one element per device of a mesh.
      on_failure: where ``make`` raises, the handles to return instead (None: raise): an error
        raised in a program on several devices fails its device's part alone, and the others
        wait for it in their collectives until XLA ends the process.
    """
    sizes = [int(np.prod(s)) for s in shapes]

    def call() -> np.ndarray:
        try:
            made = [np.asarray(h, np.int32) for h in make()]
        except Exception as e:
            if on_failure is None:
                raise
            made = [np.asarray(h, np.int32) for h in on_failure(e)]
        got = [h.shape for h in made]
        if got != [tuple(s) for s in shapes]:
            raise ValueError(
                f"a jitted tx.init traced for state handles of shapes {list(shapes)} made "
                f"engines with handles of shapes {got} when it ran: place the params inside "
                "the jitted function on the mesh set by jax.set_mesh"
            )
        return np.concatenate([h.reshape(-1) for h in made]) if made else np.zeros(0, np.int32)

    out = io_callback(call, jax.ShapeDtypeStruct((sum(sizes),), jnp.int32))
    starts = np.cumsum([0, *sizes])
    return [out[a:b].reshape(s) for a, b, s in zip(starts[:-1], starts[1:], shapes, strict=True)]


def wait_for_traced_inits(key: tuple[Any, ...]) -> None:
    """Waits for the runs of traced inits in flight (with the other effects of dispatched
    programs), where any was traced, so that an update traced right after such an init is
    dispatched finds what its run registered for ``key``: its state's plan, not an earlier
    one, or its failure, which this raises.

    Raises:
      NoEngineError: the last init of ``key`` failed inside its program.
    """
    if RUNTIME.inits_traced:
        with contextlib.suppress(Exception):  # a failed program's error: its caller's to see
            jax.effects_barrier()
        RUNTIME.check_init(key)


def handle_at_run_time(params: Any, init: Callable[[Any], Any]) -> jax.Array:
    """The handle of the state that ``init`` makes on stand-ins of traced ``params`` (with
    their compiled shardings on a mesh) when the compiled program runs."""
    RUNTIME.inits_traced = True
    compiled = CompiledShardings(params)
    stand_ins = stand_ins_of(params)
    shape = handle_shape(params)

    def on_failure(error: Exception) -> list[np.ndarray]:
        if not compiled.on_several_devices():
            raise error
        key = update_key(shape, jax.tree.leaves(stand_ins))
        return [np.full(shape, RUNTIME.init_failed(error, key), np.int32)]

    (handle,) = handles_at_run_time(
        lambda: [init(compiled.placed(stand_ins)).handle], [shape], on_failure
    )
    return handle
