"""The update of step t beside the forward pass of step t + 1, exactly.

A plain step runs forward and backward, then the update, and the model waits while the update
waits for the optimizer state's reads. :func:`overlapped_step` takes step t's gradients into
the next step's program, which first updates the params with them and then runs the forward
and backward pass on the new params: the plain loop's math, step for step. Every gradient
exists before the update starts, so ``optax.clip_by_global_norm`` sees the global norm as
before.

Inside it an offloaded update is split into one host call per group of param leaves, the
groups in the order the forward pass first uses the params (found from the loss function's
program, not from the pytree's key order). XLA starts every call at once; the engine updates
the groups in that order and completes each group's call as soon as its subgroups are done
(:mod:`jax_mlpo.engine.grouped`). Each group's update is added to its params where the forward
pass first reaches them (:func:`loss_at_first_use`), so the forward pass of the first layers
runs while the host still updates the last ones.

The step, beside the plain one::

    @jax.jit                                                    # plain
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))      # overlapped
    def step(params, opt_state, pending, batch):
        return jax_mlpo.overlapped_step(loss_fn, tx, params, opt_state, pending, batch)
        # -> (params, opt_state, grads, loss): the grads are the next step's pending

The first step has no gradients to apply: it only computes them (an update of zero gradients
would still decay the weights); on a mesh or several processes, compute them in their params'
shardings (:func:`tree_sharded_as_read` with :func:`read_shardings`), as the step returns its
own, so that XLA sums them as the plain step does. Before a checkpoint, an evaluation or the
end, apply the pending gradients with a plain update (the flush); the saved params and state
are then exactly the plain loop's, and the next step starts again with no pending gradients.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlpo.native.host_update import grouped_on_gpu
from jax_mlpo.transforms import overlap_cost

__all__ = [
    "OVERLAP_ARG", "Grouping", "forward_ranks", "leaf_groups", "loss_at_first_use",
    "overlapped_step", "read_shardings", "sharded_as_read", "tree_sharded_as_read",
    "update_in_groups",
]  # fmt: skip

# How many calls an update is split into at most (``groups="auto"`` takes fewer where the
# update is too small for each call to pay for itself: jax_mlpo.transforms.overlap_cost).
GROUPS = overlap_cost.MAX_GROUPS

# The keyword argument that hands an update traced inside overlapped_step its Grouping: optax
# passes extra keyword arguments to every transformation of a chain and through its wrappers
# (inject_hyperparams, masked, MultiSteps); jax_mlpo's transformations read it, others ignore it.
OVERLAP_ARG = "jax_mlpo_overlap"


@dataclasses.dataclass
class Grouping:
    """What an update traced inside :func:`overlapped_step` reads and leaves behind.

    Attributes:
      leaves: the traced param leaves (kept, so no other object takes their ids meanwhile).
      groups: each param leaf's group, by ``id`` of the traced leaf.
      platform: the platform the split calls are emitted for (``"cpu"``: one call per group;
        ``"cuda"``: a send and a receive per group, ``ffi/cuda_grouped.h``), or None: the
        update is not split.
      held: the values the grouped calls read or wrote besides their leaves (the scalars, each
        call's next count): the loss depends on them (:func:`negative_zero`), so that XLA gives
        none of their buffers to the forward pass while a call may still use it (which would
        make the forward pass wait for every call).
      rows: the groups of stacked layers that a scan consumes one row at a time, and their
        rows: an update may send such a group and leave a :class:`RowStream` in ``streams``.
      streams: the sent groups' :class:`RowStream`, by group.
      read_as: the sharding an update reads each param leaf's gradient in, by ``id`` of the
        traced leaf (:meth:`jax_mlpo.sharding.plan.ShardPlan.grad_shardings`): the step's new
        gradients are computed in it, as the plain step computes them.
    """

    leaves: list[Any]
    groups: dict[int, int]
    platform: str | None = "cpu"
    held: list[Any] = dataclasses.field(default_factory=list)
    rows: dict[int, int] = dataclasses.field(default_factory=dict)
    streams: dict[int, RowStream] = dataclasses.field(default_factory=dict)
    read_as: dict[int, Any] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(leaves: Sequence[Any], group: Sequence[int], platform: str | None) -> Grouping:
        """The grouping of traced ``leaves``, leaf ``k`` in group ``group[k]``."""
        return Grouping(list(leaves), {id(x): g for x, g in zip(leaves, group, strict=True)},
                        platform)  # fmt: skip

    @staticmethod
    def given(extra_args: Mapping[str, Any]) -> Grouping | None:
        """The grouping an update's extra keyword arguments carry (None: not inside
        :func:`overlapped_step`)."""
        return extra_args.get(OVERLAP_ARG)

    def group_of(self, leaf: Any) -> int | None:
        """A traced param leaf's group; None for a leaf it does not know (one of a
        ``lax.cond`` branch's own tracers)."""
        return self.groups.get(id(leaf))

    def reads(self, leaves: Sequence[Any], shardings: Sequence[Any]) -> None:
        """An update reads the gradients of traced param ``leaves`` in ``shardings``."""
        for leaf, sharding in zip(leaves, shardings, strict=True):
            if sharding is not None:
                self.read_as[id(leaf)] = sharding

    def hold(self, *values: Any) -> None:
        """Keeps ``values`` alive to the end of the step being traced."""
        self.held.extend(values)


@dataclasses.dataclass
class RowStream:
    """A group of stacked layers sent to the engine whose rows a scan receives one at a time
    (:mod:`jax_mlpo.engine.row_stream`).

    Attributes:
      params: the group's traced param leaves (the update's own, by identity).
      updates: the send's update of each, whole: valid only once every row was received (or
        drained); where the step's updates are exactly these, the scan receives them by row.
      receive: ``receive(row)``: row ``row`` of each param, then of each update (inside the
        scan's body); ``receive(None)`` drains: it takes every row at once and gives a
        token.
    """

    params: list[Any]
    updates: list[Any]
    receive: Callable[[Any], list[Any]]


def update_in_groups(
    tx: optax.GradientTransformation, grouping: Grouping, grads: Any, opt_state: Any,
    params: Any, **extra_args: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """``tx.update`` traced inside an overlapped step, handed ``grouping``: a transformation
    without extra keyword arguments updates in one call."""
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        extra_args = {**extra_args, OVERLAP_ARG: grouping}
    return tx.update(grads, opt_state, params, **extra_args)


def overlapped_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    pending: Any,
    *args: Any,
    has_aux: bool = False,
    groups: int | str = "auto",
    platform: str | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Applies ``pending`` (the last step's gradients) with ``tx``, then the forward and
    backward pass of ``loss_fn(new_params, *args)``, in one program (module doc).

    Call it inside the jitted step. On a mesh (Explicit or Auto axes) and on several processes
    every device makes each group's call with its own shards, on CPU. Updates it does not split
    (inside ``lax.cond``, as ``jax_mlpo.MultiSteps`` runs its inner update; params on several
    devices of a GPU machine; a GPU whose CUDA module or driver lacks the grouped handlers) run
    in one call, as in the plain loop: exact, not overlapped.

    The split depends on the platform (a GPU's calls differ from a CPU's), which a trace does
    not know: it is the default backend's unless ``platform`` names it. Name it to export the
    step for another platform (``jax.export`` with ``platforms=["cuda"]`` on a CPU machine).

    Args:
      loss_fn: ``loss_fn(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      tx: the optimizer; its offloaded parts run beside the forward pass.
      params: the params before the update.
      opt_state: ``tx``'s state.
      pending: the gradients of the last step (``params``' structure).
      *args: the rest of ``loss_fn``'s arguments (the batch).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      groups: how many calls the offloaded update is split into; ``"auto"``: as many as each
        carry enough work to pay for a call (``overlap_cost.auto_groups``: the params'
        elements against a call's cost measured in this process).
      platform: ``"cpu"`` or ``"cuda"``: the platform the step is lowered for (None: the
        default backend, split on a GPU only where its handlers are available).

    Returns:
      ``(params, opt_state, grads, value)``: the updated params and state, the gradients at
      the updated params (the next step's ``pending``), and ``loss_fn``'s value there.

    Raises:
      ValueError: if ``groups`` < 1.
    """
    if groups == "auto":
        groups = overlap_cost.auto_groups(sum(int(np.size(x)) for x in jax.tree.leaves(params)))
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be >= 1 (or 'auto'), got {groups!r}")
    if platform not in (None, "cpu", "cuda"):
        raise ValueError(f"platform must be None, 'cpu' or 'cuda', got {platform!r}")
    leaves, treedef = jax.tree.flatten(params)
    closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(params, *args)
    ranks = forward_ranks(closed.jaxpr)[: len(leaves)]
    group = leaf_groups(ranks, [int(np.size(x)) for x in leaves], groups)
    # stacked layers a scan consumes: a group of their own, received row by row in the scan
    # (one call where one is asked for)
    scans = stacked_scans(closed.jaxpr, len(leaves)) if groups > 1 else {}
    group, rows = scans_apart(group, ranks, scans)
    grouping = Grouping.of(leaves, group, platform or default_split())
    grouping.rows = rows
    updates, opt_state = update_in_groups(tx, grouping, pending, opt_state, params)
    out_tree = jax.tree.structure(out_shape)
    arg_leaves = jax.tree.leaves(args)
    update_leaves = treedef.flatten_up_to(updates)
    by_row = rows_received(grouping, leaves, update_leaves, scans)
    for scan in by_row.values():
        for k in scan.leaves:  # the updates come from the scan's receives; this carries the
            # gradient (x + -0.0 == x, bit for bit)
            update_leaves[k] = jnp.full(jnp.shape(leaves[k]), -0.0, update_leaves[k].dtype)

    def loss_of_updates(update_leaves: list[Any]) -> tuple[Any, Any]:
        # The loss at params + updates, each group's update added where the forward pass
        # reaches it: the gradient with respect to the updates is the gradient with respect to
        # the new params. The new params come from those same additions: a second addition
        # (optax.apply_updates after the step) would be merged with them by XLA and scheduled
        # at the program's start, and the forward pass would wait for every update.
        outs, new_params = loss_at_first_use(closed, leaves, update_leaves, arg_leaves,
                                             _apply_update, by_row)  # fmt: skip
        out = jax.tree.unflatten(out_tree, outs)
        if has_aux:
            return out[0], (out[1], new_params)
        return out, new_params

    (value, aux), grads = jax.value_and_grad(loss_of_updates, has_aux=True)(update_leaves)
    aux, new_params = aux if has_aux else (None, aux)
    grads = [sharded_as_read(g.astype(jnp.result_type(p)), grouping.read_as.get(id(p)))
             for g, p in zip(grads, leaves, strict=True)]  # fmt: skip
    # the values the grouped calls read and wrote besides their leaves live until the loss
    value = value + negative_zero(*grouping.held).astype(jnp.result_type(value))
    value = (value, aux) if has_aux else value
    params = jax.tree.unflatten(treedef, new_params)
    return params, opt_state, jax.tree.unflatten(treedef, grads), value


@dataclasses.dataclass(frozen=True)
class ScanRows:
    """A scan whose stacked param leaves are updated by row inside its body.

    Attributes:
      length: the scan's rows.
      leaves: the param leaves it consumes as stacked ``xs`` (indices into the params' leaves).
      stream: the group's :class:`RowStream` (set once the update sent the group).
    """

    length: int
    leaves: tuple[int, ...]
    stream: RowStream | None = None


def stacked_scans(jaxpr: jex_core.Jaxpr, n: int) -> dict[int, ScanRows]:
    """The scans of ``jaxpr`` (by equation index) that consume some of its first ``n`` inputs
    (the params) whole as stacked ``xs``, one row per iteration, where that is their first
    use and their only operand of the scan: those params can be updated row by row."""
    position = {v: k for k, v in enumerate(jaxpr.invars[:n])}
    first = forward_ranks(jaxpr)
    out = {}
    for e, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "scan":
            continue
        length, skip = eqn.params["length"], eqn.params["num_consts"] + eqn.params["num_carry"]
        uses = collections.Counter(v for v in eqn.invars if isinstance(v, jex_core.Var))
        stacked = tuple(
            position[v] for v in eqn.invars[skip:]
            if v in position and first[position[v]] == e and uses[v] == 1
            and np.ndim(v.aval) >= 1 and v.aval.shape[0] == length
        )  # fmt: skip
        if stacked and length > 1:
            out[e] = ScanRows(length, stacked)
    return out


def scans_apart(group: Sequence[int], ranks: Sequence[int], scans: Mapping[int, ScanRows]
                ) -> tuple[list[int], dict[int, int]]:  # fmt: skip
    """``group`` renumbered so that each scan's stacked leaves are a group of their own, in the
    forward order (a group's leaves used before a scan, the scan's, those used after):
    ``(group, rows of each scan's group)``."""
    stacked = {k: e for e, scan in scans.items() for k in scan.leaves}

    def key(k: int) -> tuple[int, int]:
        before = sum(1 for e, scan in scans.items()
                     if e < ranks[k] and group[scan.leaves[0]] == group[k])  # fmt: skip
        return group[k], 2 * before + (1 if k in stacked else 0)

    keys = sorted({key(k) for k in range(len(group))})
    number = {kk: i for i, kk in enumerate(keys)}
    renumbered = [number[key(k)] for k in range(len(group))]
    rows = {renumbered[scan.leaves[0]]: scan.length for scan in scans.values()}
    return renumbered, rows


def rows_received(grouping: Grouping, params: Sequence[Any], updates: Sequence[Any],
                  scans: Mapping[int, ScanRows]) -> dict[int, ScanRows]:  # fmt: skip
    """The scans whose stacked leaves' updates the scan receives by row: each group the update
    sent (``grouping.streams``) whose updates reach the step unchanged (a transformation after
    jax_mlpo's in a chain would change them: then the step uses them whole). Every other sent
    group is drained: its rows taken at once, so that the send completes."""
    index = {id(x): k for k, x in enumerate(params)}
    out = {}
    for stream in grouping.streams.values():
        ks = [index.get(id(p)) for p in stream.params]
        scan = next((e for e, s in scans.items() if set(s.leaves) == set(ks)), None)
        if scan is None or any(updates[k] is not u for k, u in zip(ks, stream.updates,
                                                                   strict=True)):  # fmt: skip
            grouping.hold(*stream.receive(None))
            continue
        out[scan] = ScanRows(scans[scan].length, tuple(ks), stream)
    return out


def default_split() -> str | None:
    """Where the default backend's update splits: on CPU, and on a GPU that has the grouped
    handlers (``ffi/cuda_grouped.h``); None: in one call."""
    backend = jax.default_backend()
    if backend == "cpu":
        return "cpu"
    if backend == "gpu" and grouped_on_gpu():
        return "cuda"
    return None


def forward_ranks(jaxpr: jex_core.Jaxpr) -> list[int]:
    """Each input's first use in ``jaxpr`` (its equation order, the order the forward pass runs
    in); an input the program does not use ranks last."""
    position = {v: k for k, v in enumerate(jaxpr.invars)}
    first = [len(jaxpr.eqns)] * len(jaxpr.invars)
    for e, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            k = position.get(v) if isinstance(v, jex_core.Var) else None
            if k is not None and first[k] > e:
                first[k] = e
    return first


def leaf_groups(ranks: Sequence[int], sizes: Sequence[int], groups: int) -> list[int]:
    """Each leaf's group: the leaves in forward order, cut into ``groups`` runs of about equal
    elements. A leaf is never split, and leaves first used by the same equation (a scan over
    stacked layers uses them all at once) share a group: the forward pass needs them together,
    so more calls would only cost. Each run goes to the group its middle falls in, but a small
    run (under an eighth of a group's share: a bias, a norm scale) never opens a group: it
    stays with the run before it, which its layer uses just before it, so that layer does not
    wait for the next group's update."""
    order = sorted(range(len(ranks)), key=lambda k: (ranks[k], k))
    total = max(1, sum(sizes))
    out = [0] * len(ranks)
    done, i, last = 0, 0, None
    while i < len(order):
        j = i
        while j < len(order) and ranks[order[j]] == ranks[order[i]]:
            j += 1
        size = sum(sizes[k] for k in order[i:j])
        g = min(groups - 1, (2 * done + size) * groups // (2 * total))
        if last is not None and 8 * size * groups < total:
            g = last
        for k in order[i:j]:
            out[k] = g
        done, i, last = done + size, j, g
    return out


def negative_zero(*values: Any) -> jax.Array:
    """-0.0, computed from ``values``: adding it changes no number (``x + -0.0 == x`` for every
    ``x``, bit for bit, -0.0 and NaN included), but what it is added to now depends on
    ``values``, a dependency XLA keeps. (An ``optimization_barrier`` does not order anything on
    XLA:CPU: it is expanded before scheduling.)"""
    zero = jnp.float32(-0.0)
    for x in values:
        if np.size(x) == 0:
            continue
        spec = _explicit_spec(x)
        if spec is None:
            zero = _or_sign(zero, _negative_zero_of(jax.lax.stop_gradient(x)))
            continue
        # Explicit axes: slicing a sharded array is a type error, and a slice would move data
        # between devices anyway. Each device takes -0.0 from its own block: equal on every
        # device, so the replicated result is true without a collective.
        local = jax.shard_map(_negative_zero_of, mesh=jax.typeof(x).sharding.mesh,
                              in_specs=spec, out_specs=P(), check_vma=False)  # fmt: skip
        zero = _or_sign(zero, local(jax.lax.stop_gradient(x)))
    return zero


def _negative_zero_of(x: jax.Array) -> jax.Array:
    """-0.0 from the bits of ``x``'s first element (a dependency on ``x``, no number of it)."""
    first = jax.lax.reshape(x, (x.size,))[:1] if x.ndim != 1 else x[:1]
    if jnp.dtype(first.dtype).itemsize != 4:
        first = first.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(first[0], jnp.uint32)
    return jax.lax.bitcast_convert_type(((bits >> 31) << 31) | jnp.uint32(0x80000000), jnp.float32)


def _or_sign(a: jax.Array, b: jax.Array) -> jax.Array:
    """-0.0 depending on both ``a`` and ``b`` (each -0.0)."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32) | jax.lax.bitcast_convert_type(b, jnp.uint32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def sharded_as_read(grad: Any, sharding: Any) -> Any:
    """``grad`` computed in ``sharding`` (the one its update reads it in; None: as it is).

    Where the plain step's gradient feeds its update, XLA partitions the gradient's reduction
    by the sharding the update asks for; a gradient that leaves the program (the overlapped
    step's, the first step's) gets a sharding of XLA's choosing, and its terms may be summed
    in another order (seen on 2 processes: the first layer's weight gradient split by columns,
    not rows, 181 of 4096 elements 1 ulp apart). With Explicit axes the gradient's type
    already carries its param's sharding."""
    if sharding is None or _explicit_spec(grad) is not None:
        return grad
    return jax.lax.with_sharding_constraint(grad, sharding)


def tree_sharded_as_read(grads: Any, shardings: Sequence[Any]) -> Any:
    """:func:`sharded_as_read` for each leaf of ``grads``, leaf ``k`` in ``shardings[k]`` (a
    tree of other leaves than the params, an NNX step's own, is left as it is)."""
    leaves, treedef = jax.tree.flatten(grads)
    if len(leaves) != len(shardings):
        return grads
    pairs = zip(leaves, shardings, strict=True)
    return treedef.unflatten([sharded_as_read(g, s) for g, s in pairs])


def read_shardings(params: Any) -> list[Any]:
    """The sharding of each leaf of concrete ``params`` that its gradient is read in (None:
    not on a mesh): the update reads a gradient in its param's sharding, so the first step's
    gradients, computed before any update, are sharded so too (:func:`sharded_as_read`)."""
    return [x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else None
            for x in jax.tree.leaves(params)]  # fmt: skip


def _explicit_spec(x: Any) -> P | None:
    """``x``'s partition where its type carries a mesh with Explicit axes (None: Auto axes or
    no mesh, where XLA partitions a slice itself)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if (
        mesh is None
        or mesh.empty
        or not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    ):
        return None
    return sharding.spec


def _apply_update(param: Any, update: Any) -> Any:
    """optax.apply_updates's rule for one leaf."""
    return jnp.asarray(param + update).astype(jnp.asarray(param).dtype)


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def loss_at_first_use(
    closed: jex_core.ClosedJaxpr,
    params: Sequence[Any],
    updates: Sequence[Any],
    args: Sequence[Any],
    apply: Callable[[Any, Any], Any],
    by_row: Mapping[int, ScanRows] | None = None,
) -> tuple[list[Any], list[Any]]:
    """``closed``'s outputs on ``apply(params, updates)`` leaf by leaf and ``args``, each
    param's update applied where the program first combines it with an activation.

    Args:
      closed: the loss function's jaxpr over ``(params leaves..., args leaves...)``.
      params: the param leaves (before the update).
      updates: their updates (each group's comes from its own host call).
      args: the other inputs' leaves (the batch).
      apply: ``apply(param, update) -> new param`` (optax.apply_updates's rule).
      by_row: the scans (by equation index) whose stacked leaves are updated row by row
        inside their body, each row received from the engine (:func:`scan_by_row`); their
        ``updates`` are -0.0, which carries the gradient.

    Returns:
      ``(outputs, new_params)``: the jaxpr's outputs, and every param leaf with its update
      applied (where the forward pass applied it; a leaf it never uses, at the end).
    """
    jaxpr = closed.jaxpr
    n = len(params)
    env: dict[Any, Any] = {}  # evaluated vars: activations and constants
    lazy: dict[Any, tuple[Any, frozenset[int]]] = {}  # param-derived vars: (eqn, params)
    new: dict[int, Any] = {}  # the new params applied so far

    def updated(k: int, update: Any) -> Any:
        # Materialized once, where the forward pass first needs it: XLA would otherwise fuse
        # the addition into each of the new param's readers (the backward pass's too) and keep
        # the old param alive to the end, and the new params, which take the old ones' donated
        # buffers, would need a copy of every param (2 B/param of bfloat16 params:
        # experiments/bench/memory.py, jax_mlpo_overlap). The scalars' barrier (offloaded.py)
        # keeps this from making the forward pass wait for the last group.
        return jax.lax.optimization_barrier(apply(params[k], update))

    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = c
    for k, v in enumerate(jaxpr.invars[:n]):
        lazy[v] = (None, frozenset([k]))
    for v, a in zip(jaxpr.invars[n:], args, strict=True):
        env[v] = a

    def force(v: Any) -> Any:
        """The value of a param-derived var, its params' new values applied already."""
        if v in env:
            return env[v]
        eqn, _ = lazy[v]
        if eqn is None:  # a param itself (applied here if no activation ever met it)
            k = jaxpr.invars.index(v)
            if k not in new:
                new[k] = updated(k, updates[k])
            return new[k]
        outs = _bind(eqn, [read(x) for x in eqn.invars])
        for out_var, out in zip(eqn.outvars, outs, strict=True):
            env[out_var] = out
        return env[v]

    def read(v: Any) -> Any:
        if isinstance(v, jex_core.Literal):
            return v.val
        return force(v) if v in lazy else env[v]

    by_row = by_row or {}
    for e, eqn in enumerate(jaxpr.eqns):
        vars_in = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        derived = [v for v in vars_in if v in lazy and v not in env]
        active = [v for v in vars_in if v in env and v not in lazy]
        if derived and not active:  # computed from params alone: when an activation needs it
            touched = frozenset().union(*(lazy[v][1] for v in derived))
            for out_var in eqn.outvars:
                lazy[out_var] = (eqn, touched)
            continue
        streamed = by_row[e].leaves if e in by_row else ()
        if derived:
            pending = sorted(frozenset().union(*(lazy[v][1] for v in derived)) - set(new))
            pending = [k for k in pending if k not in streamed]
            if pending:  # the forward pass reaches these params: their new values, now
                zero = negative_zero(*(env[v] for v in active))
                for k in pending:
                    new[k] = updated(k, updates[k] + zero.astype(updates[k].dtype))
        if streamed:
            stacked = {jaxpr.invars[k]: k for k in streamed}
            invals = [params[stacked[v]] if v in stacked else read(v) for v in eqn.invars]
            outs, rows = scan_by_row(eqn, invals, by_row[e], updates, apply, stacked)
            new.update(rows)
            for out_var, out in zip(eqn.outvars, outs, strict=True):
                env[out_var] = out
            continue
        outs = _bind(eqn, [read(v) for v in eqn.invars])
        for out_var, out in zip(eqn.outvars, outs, strict=True):
            env[out_var] = out
    outs = [read(v) for v in jaxpr.outvars]
    return outs, [new[k] if k in new else updated(k, updates[k]) for k in range(n)]


def scan_by_row(eqn: Any, invals: list[Any], scan: ScanRows, updates: Sequence[Any],
                apply: Callable[[Any, Any], Any], leaf_of: Mapping[Any, int]
                ) -> tuple[list[Any], dict[int, Any]]:  # fmt: skip
    """A scan equation on ``invals`` whose stacked param leaves ``scan.leaves`` (among its
    ``xs``, ``leaf_of`` their vars) are updated inside its body: iteration ``i`` receives row
    ``i`` of each param and of its update from the engine and adds them (``apply``), so the
    body runs as soon as that row is updated.

    The old params are not the loop's operands: the send reads them, and the loop would wait
    for it. The new stacked params are the old ones plus the send's updates, added after the
    loop (where XLA may add them in place): the loop holds no second copy of the stack, and the
    send's buffers stay theirs until it has ended.

    Returns:
      ``(outputs, new params)``: the equation's outputs and each stacked leaf's new value, by
      leaf index.
    """
    p = eqn.params
    nc, ncar, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"]
    consts, carry = invals[:nc], invals[nc : nc + ncar]
    xs_vars = eqn.invars[nc + ncar :]
    stacked = {i: leaf_of[v] for i, v in enumerate(xs_vars) if v in leaf_of}
    xs = [x for i, x in enumerate(invals[nc + ncar :]) if i not in stacked]
    position = {k: j for j, k in enumerate(scan.leaves)}
    assert scan.stream is not None
    stream = scan.stream

    def step(c: list[Any], x: tuple[list[Any], list[Any], Any]) -> tuple[list[Any], Any]:
        others, deltas, i = x
        got = stream.receive(i)
        olds, news = got[: len(position)], got[len(position) :]
        others, delta = iter(others), iter(deltas)
        rows_in = [
            apply(olds[position[stacked[at]]], news[position[stacked[at]]] + next(delta))
            if at in stacked else next(others)
            for at in range(len(xs_vars))
        ]  # fmt: skip
        outs = jex_core.jaxpr_as_fun(body)(*consts, *c, *rows_in)
        return list(outs[:ncar]), list(outs[ncar:])

    deltas = [updates[k] for k in stacked.values()]
    carry_out, ys = jax.lax.scan(
        step, list(carry), (xs, deltas, jnp.arange(length, dtype=jnp.int32)),
        length=length, reverse=p["reverse"], unroll=p["unroll"],
    )  # fmt: skip
    outs = [*carry_out, *ys]
    after = negative_zero(*[o for o in outs if jnp.issubdtype(o.dtype, jnp.floating)][:1])
    new = {}
    for at, k in stacked.items():
        update = stream.updates[position[k]]
        new[k] = apply(invals[nc + ncar + at], update + after.astype(update.dtype))
    return outs, new
