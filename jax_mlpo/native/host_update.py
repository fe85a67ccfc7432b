"""The update transport: one XLA FFI call that runs the host engine on XLA's own buffers.

:func:`host_update_call` emits a side-effecting custom call, ``jax_mlpo_host_update``, whose
C++ handler (``jax_mlpo/ffi/host_update.cc``) hands every gradient, param and update buffer to
the function given to :func:`connect_cpu`, as numpy views: the engine reads
the gradients and params and writes the update in place, with no staging copy. The update
results are aliased onto the gradients wherever dtype and shape allow (inside a jitted train
step the gradients are intermediates, so XLA reuses their buffers), so an update costs no
device memory of its own.

Ordering: the call also returns the next step count, which becomes the optimizer state's
count, so every later update depends on it through its data. XLA never drops the call (it has
a side effect) and runs it once per executed update; ``lax.cond`` (``optax.apply_if_finite``)
runs it only on the branch taken.

Deferred updates: the handler is asynchronous on CPU. A runner may keep a call's buffers and
return :data:`DEFERRED`; the call then stays pending in XLA (its thread free for other work)
until the :class:`Completion` it was handed is called, from another thread. Params on a mesh
use this: each device's call hands its buffers in, and the last one runs the engine over all
of them (:mod:`jax_mlpo.sharding.mesh`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_mlpo import errors
from jax_mlpo.native.copies import cuda_module
from jax_mlpo.native.library import NATIVE

__all__ = [
    "DEFERRED", "CallGroup", "Completion", "DeviceBuffer", "check_platform", "connect_cpu",
    "connect_cuda", "group_receive_call", "group_send_call", "grouped_on_gpu",
    "host_receive_call", "host_update_call",
]  # fmt: skip

logger = logging.getLogger(__name__)

# The scalars operand's length (kNumScalars, ffi/host_update.h): the optimizer's scalars for the
# step (each optimizer's hyper() in jax_mlpo.optimizers reads its own), padded with NaN.
NUM_SCALARS = NATIVE.NUM_SCALARS
for _name, _target in NATIVE.registrations().items():
    jax.ffi.register_ffi_target(_name, _target, platform="cpu")


class DeviceBuffer(NamedTuple):
    """A flat XLA buffer in device memory: its address, byte count and dtype."""

    address: int
    nbytes: int
    dtype: np.dtype

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize


class CallGroup(NamedTuple):
    """Which of the engine's leaves one call carries: group ``group`` of ``groups`` (an update
    split into one call per group of layers, numbered in the order the forward pass consumes
    them: :mod:`jax_mlpo.overlap`), and the engine's index of each of the call's leaves.
    ``rows`` > 0: the leaves are stacked layers of that many rows, which a scan consumes one
    row at a time (the call is a send; :func:`host_receive_call` of the same ``stream`` takes
    each new row)."""

    group: int
    groups: int
    leaf_ids: tuple[int, ...]
    rows: int = 0
    stream: int = 0

    @property
    def whole(self) -> bool:
        """Whether this one call carries the whole update."""
        return self.groups == 1


class Completion:
    """Completes one deferred call: ``completion(None)`` succeeds it, ``completion(error)``
    fails it with the error's message. Call it once, from a thread that may go on to run the
    device's next work (XLA continues the device's program on the completing thread)."""

    def __init__(self, pending: object) -> None:
        self._pending = pending  # the call's Deferral (ffi/host_update_bindings.cc)

    def __call__(self, error: BaseException | None) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("a deferred jax_mlpo update was completed twice")
        # complete() releases the GIL: XLA may run the device's next work on this thread
        pending.complete(None if error is None else _message(error))


# What a runner returns when it keeps the call's buffers and completes it later.
DEFERRED = "deferred"

Leaf = np.ndarray | DeviceBuffer
HostUpdate = Callable[
    [int, int, np.ndarray, CallGroup, list[Leaf], list[Leaf], list[Leaf], int | None,
     Completion | None],
    str | None,
]  # fmt: skip
# receiver(stream, row, outs, completion): a receive of one row of a send's params and updates
Receiver = Callable[[int, int, list[np.ndarray], Completion], str | None]


def _message(error: BaseException) -> str:
    """What the failed call reports: the exception's type and text, and its mark, by which
    :func:`jax_mlpo.errors.cause` gives the exception itself back (ahead of the text, which
    the error's capacity may cut)."""
    return f"{errors.tag(error)} {type(error).__name__}: {error}"


def _dtype(view) -> np.dtype:
    name = view.dtype  # raises TypeError for an element type no leaf may have
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _array(view, *, writable: bool) -> np.ndarray:
    """A numpy view of one XLA buffer in host memory, valid only while the handler runs."""
    dtype = _dtype(view)
    if view.nbytes == 0 or not view.address:
        return np.empty(0, dtype)
    return view.host(writable).view(dtype)


def _device(view, *, writable: bool) -> DeviceBuffer:
    del writable
    return DeviceBuffer(view.address, view.nbytes, _dtype(view))


def _handler(runner: HostUpdate) -> Callable[..., bool]:
    """What the C++ handler calls (``host_update_bindings.cc``): ``runner`` on the call's
    views."""

    def handle_call(handle, count, scalars, group, grads, params, updates, stream, pending):
        # Runs on an XLA thread, with the GIL (the C++ handler takes it); returns whether the
        # runner deferred the call. Every exception becomes the message of the ffi::Error the
        # custom call fails with: its str() is _message's text, the exception's mark first.
        try:
            leaf = _array if stream is None else _device
            completion = Completion(pending) if pending is not None else None
            outcome = runner(
                handle, count, scalars, CallGroup(*group),
                [leaf(v, writable=False) for v in grads],
                [leaf(v, writable=False) for v in params],
                [leaf(v, writable=True) for v in updates], stream, completion,
            )  # fmt: skip
            if outcome == DEFERRED:
                if completion is None:
                    raise RuntimeError("a jax_mlpo update on a GPU cannot be deferred")
                return True
            return False
        except BaseException as e:  # noqa: BLE001 - reported through XLA, see above
            # the C++ handler takes str() of what escapes as the failed call's message
            raise RuntimeError(_message(e)) from None

    return handle_call


def _receive_handler(receiver: Receiver) -> Callable[..., bool]:
    """What the C++ receive calls (``host_update_bindings.cc``): ``receiver`` on its views."""

    def handle_receive(stream, row, outs, pending) -> bool:
        # Runs on an XLA thread, with the GIL; errors are reported as handle_call's are.
        try:
            outcome = receiver(stream, row, [_array(v, writable=True) for v in outs],
                               Completion(pending))  # fmt: skip
            return outcome == DEFERRED
        except BaseException as e:  # noqa: BLE001 - reported through XLA, see _handler
            raise RuntimeError(_message(e)) from None

    return handle_receive


# send(stream, group, grads, params, updates, ticket): a grouped update's send on a GPU
GroupSend = Callable[[int, CallGroup, list[np.ndarray], list[np.ndarray], list[np.ndarray],
                      object], None]  # fmt: skip


def _group_handler(send: GroupSend) -> Callable[..., None]:
    """What the CUDA module's group send calls (``ffi/cuda_grouped_bindings.cc``): ``send``
    on the group's views."""

    def handle_send(stream, group, grads, params, updates, ticket) -> None:
        # Runs on XLA's launching thread, with the GIL; the views are the group's pinned
        # staging, host memory. Errors are reported as handle_call's are.
        try:
            send(
                stream, CallGroup(*group), [_array(v, writable=False) for v in grads],
                [_array(v, writable=False) for v in params],
                [_array(v, writable=True) for v in updates], ticket,
            )  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - reported through XLA, see _handler
            raise RuntimeError(_message(e)) from None

    return handle_send


def connect_cpu(runner: HostUpdate, receiver: Receiver) -> None:
    """Sets the function every CPU ``jax_mlpo_host_update`` call runs (the process's runtime
    does, when it is made).

    Args:
      runner: ``runner(handle, count, scalars, group, grads, params, updates, stream,
        completion)``: ``scalars`` is ``float32[NUM_SCALARS]``, the optimizer's (its
        :meth:`~jax_mlpo.optimizers.HostOptimizer.hyper` reads them); ``group`` a
        :class:`CallGroup`, which of the engine's leaves the call carries; the three lists hold
        XLA's buffers per leaf, valid until the call completes (``updates[k]`` may share
        ``grads[k]``'s memory): flat numpy views on CPU (``stream`` None),
        :class:`DeviceBuffer` s on a GPU (``stream`` is XLA's ``cudaStream_t``; copy through it
        and synchronize before returning). It raises to fail the call. On CPU ``completion``
        is a :class:`Completion`: returning :data:`DEFERRED` leaves the call pending until it
        is called; otherwise the call completes when the runner returns.
      receiver: ``receiver(stream, row, outs, completion)``, every
        ``jax_mlpo_host_receive`` (:func:`host_receive_call`): it writes row ``row`` of send
        ``stream``'s params, then of its updates, into ``outs`` (numpy views; a drain's token
        for ``row`` < 0), deferring as ``runner`` may.
    """
    NATIVE.set_host_update(_handler(runner))
    NATIVE.set_host_receive(_receive_handler(receiver))


def connect_cuda(runner: HostUpdate, send: GroupSend) -> None:
    """Sets the functions the CUDA module's calls run and registers its FFI targets (once per
    process: the runtime calls it at the first init on a GPU).

    Args:
      runner: as :func:`connect_cpu`'s, for the CUDA ``jax_mlpo_host_update``.
      send: ``send(stream, group, grads, params, updates, ticket)``, every
        ``jax_mlpo_group_send`` (an update in groups on a GPU): the group's leaves as numpy
        views of its pinned host staging, valid until its ticket is released; the grads and
        params are there once ``ticket.wait(timeout_s)`` returns True; it writes the updates,
        then calls ``ticket.release(next_count)``. It must return at once (the stream copies
        the inputs after it returns) and raises to fail the call.

    Raises:
      ImportError: if the CUDA module was not built, with how to build it.
    """
    cuda = _cuda()
    cuda.set_host_update(_handler(runner))
    cuda.set_group_send(_group_handler(send))
    for name, target in cuda.registrations().items():
        jax.ffi.register_ffi_target(name, target, platform="CUDA")


def grouped_on_gpu() -> bool:
    """Whether an update in groups can run on a GPU here: the CUDA module is built and the
    driver has the stream wait its receive needs (``cuStreamWaitValue32``)."""
    try:
        return bool(cuda_module().grouped_available())
    except ImportError:
        return False


def check_platform(platform: str) -> None:
    """Checks that the host update has handlers on ``platform`` (``"cpu"``, or
    ``"gpu"``/``"cuda"``).

    Raises:
      ImportError: on a GPU, if the CUDA module was not built, with how to build it.
      NotImplementedError: for any other platform.
    """
    if platform == "cpu":
        return
    if platform not in ("gpu", "cuda"):
        raise NotImplementedError(
            f"jax_mlpo's update transport has handlers for CPU and CUDA, not {platform!r}"
        )
    _cuda()


def _cuda() -> Any:
    try:
        return cuda_module()
    except ImportError as e:
        raise ImportError(
            f"{e}. On a GPU jax_mlpo needs its CUDA handlers: rebuild with "
            "JAX_MLPO_ENABLE_CUDA=ON (pip install --no-build-isolation -e . with nvcc on PATH)"
        ) from None


def host_update_call(
    handle: jax.Array,
    count: jax.Array,
    scalars: jax.Array,
    grads: Sequence[jax.Array],
    params: Sequence[jax.Array],
    update_dtypes: Sequence[jnp.dtype],
    group: CallGroup | None = None,
) -> tuple[jax.Array, list[jax.Array]]:
    """Emits the host update's FFI call (inside ``jax.jit``; CPU).

    Args:
      handle: int32 scalar naming the engine.
      count: int32 scalar, the step count of the state handed to the update.
      scalars: ``float32[NUM_SCALARS]``: the optimizer's scalars.
      grads: the gradient leaves.
      params: the param leaves (same shapes).
      update_dtypes: each update's dtype; where it is the gradient's, the update takes over the
        gradient's buffer.
      group: which of the engine's leaves these are (one group of an update split into several
        calls); None: all of them, in the engine's order. A group with ``rows`` is a send: its
        updates are taken row by row by :func:`host_receive_call`, and the call completes
        once every row was taken.

    Returns:
      ``(count + 1, updates)``: the next count (its data orders later updates after this one)
      and the update leaves, of the params' shapes.
    """
    n = len(grads)
    outs = [jax.ShapeDtypeStruct(jnp.shape(p), dt) for p, dt in zip(params, update_dtypes,
                                                                   strict=True)]  # fmt: skip
    aliases = {
        3 + k: 1 + k
        for k, (g, out) in enumerate(zip(grads, outs, strict=True))
        if g.dtype == out.dtype and jnp.shape(g) == out.shape and np.prod(out.shape) > 0
    }
    if group is None:
        group = CallGroup(0, 1, tuple(range(n)))
    call = jax.ffi.ffi_call(
        "jax_mlpo_host_send" if group.rows else "jax_mlpo_host_update",
        (jax.ShapeDtypeStruct((), jnp.int32), *outs),
        has_side_effect=True,
        input_output_aliases=aliases,
    )
    rows = {"rows": np.int32(group.rows), "stream": np.int32(group.stream)} if group.rows else {}
    results = call(
        handle, count, scalars, *grads, *params, group=np.int32(group.group),
        groups=np.int32(group.groups), leaf_ids=np.asarray(group.leaf_ids, np.int32), **rows,
    )  # fmt: skip
    assert len(results) == n + 1
    return results[0], list(results[1:])


def host_receive_call(
    stream: int, row: jax.Array, outs: Sequence[jax.ShapeDtypeStruct]
) -> list[jax.Array]:
    """Emits the receive of row ``row`` of a send's leaves (CPU; inside a scan's body): it
    completes once the engine has updated every subgroup holding the row. Its only operand is
    the row (``ffi/host_update.cc`` says why).

    Args:
      stream: the send's ``CallGroup.stream``.
      row: int32 scalar, the row (the scan's iteration); < 0 drains: every row at once, none
        returned (the send's updates were used whole).
      outs: the shape and dtype of one row of each of the send's params, then of each of its
        updates (none to drain).

    Returns:
      Row ``row`` of each param as the send read it, then of each update (a drain: an int32
      token).
    """
    results = (*outs,) if outs else (jax.ShapeDtypeStruct((), jnp.int32),)
    call = jax.ffi.ffi_call("jax_mlpo_host_receive", results, has_side_effect=True)
    got = call(row, stream=np.int32(stream))
    return list(got) if isinstance(got, list | tuple) else [got]


def group_send_call(
    handle: jax.Array, count: jax.Array, scalars: jax.Array, grads: Sequence[jax.Array],
    params: Sequence[jax.Array], group: CallGroup, *, f32_updates: bool,
) -> jax.Array:  # fmt: skip
    """Emits one group's send of an update in groups on a GPU (``ffi/cuda_grouped.h``): the
    copies of its scalars, gradients and params to the host, and the engine's notice.

    Args:
      handle, count, scalars: as :func:`host_update_call`'s.
      grads, params: the group's leaves.
      group: which of the engine's leaves these are.
      f32_updates: whether the updates are float32 (else each param's dtype).

    Returns:
      The send's token, an int32 scalar: every group's receive takes every token, so that XLA
      runs every send before any receive.
    """
    call = jax.ffi.ffi_call(
        "jax_mlpo_group_send", jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True
    )
    return call(
        handle, count, scalars, *grads, *params, group=np.int32(group.group),
        groups=np.int32(group.groups), leaf_ids=np.asarray(group.leaf_ids, np.int32),
        f32_updates=np.bool_(f32_updates),
    )  # fmt: skip


def group_receive_call(
    tokens: Sequence[jax.Array], outs: Sequence[jax.ShapeDtypeStruct], group: CallGroup
) -> tuple[jax.Array, list[jax.Array]]:
    """Emits one group's receive (``ffi/cuda_grouped.h``): the stream waits until the engine
    has updated the group, then copies its updates and the next count to the device.

    Args:
      tokens: every group's send token.
      outs: the group's updates' shapes and dtypes.
      group: which of the engine's leaves these are.

    Returns:
      ``(count + 1, updates)``, as :func:`host_update_call`.
    """
    call = jax.ffi.ffi_call(
        "jax_mlpo_group_receive",
        (jax.ShapeDtypeStruct((), jnp.int32), *outs),
        has_side_effect=True,
    )
    results = call(
        *tokens, group=np.int32(group.group), groups=np.int32(group.groups),
        leaf_ids=np.asarray(group.leaf_ids, np.int32),
    )  # fmt: skip
    return results[0], list(results[1:])
