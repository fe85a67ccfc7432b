"""The offloaded optimizer state as it appears in a user's tree, in every form it takes there.

The state of every offloaded optimizer (``jax_mlpo.adamw``, ``lion``, each part of ``muon``) is
:class:`OffloadedState`: the step count and a handle naming the host engine that owns the fp32
master and the moments.
Inside a training loop the state is seldom seen as that NamedTuple:

- ``nnx.Optimizer`` wraps each leaf in an ``nnx.OptArray`` variable
  (``OffloadedState(count=OptArray(...), handle=OptArray(...))``), and ``nnx.state(optimizer)``
  turns the NamedTuple into a state dict ``{"count": OptArray, "handle": OptArray}``;
- ``nnx.to_pure_dict`` gives ``{"count": array, "handle": array}``;
- a linen ``TrainState``, ``optax.chain``/``masked``/``partition`` states hold the NamedTuple.

Everything that looks for the state (checkpoints, ``close``, ``metrics``) finds it through
:func:`is_offloaded` and reads it through :func:`count_of`/:func:`handle_of`, so it is found in
each of these forms, and :func:`with_count` gives back the form it was found in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

_FIELDS = frozenset({"count", "handle"})


class OffloadedState(NamedTuple):
    """What the accelerator holds; the fp32 master and the moments live in the host cache and
    the file tiers."""

    count: jax.Array  # shape=(), int32: updates applied so far
    handle: jax.Array  # shape=(), int32 (int32[processes] across processes): its engine's key


# The same class under AdamW's name, which code may import.
OffloadedAdamWState = OffloadedState


def unwrap(x: Any) -> Any:
    """The value inside a flax.nnx variable (``nnx.Optimizer`` wraps state leaves), else ``x``."""
    get = getattr(x, "get_value", None)
    return get() if callable(get) else x


def is_offloaded(x: Any) -> bool:
    """Whether ``x`` is an offloaded state, as the NamedTuple or as its dict form (a flax.nnx
    state dict or a pure dict with exactly the keys ``count`` and ``handle``)."""
    if isinstance(x, OffloadedState):
        return True
    return isinstance(x, Mapping) and len(x) == 2 and set(x.keys()) == _FIELDS


def count_of(state: Any) -> Any:
    """The step count array of an offloaded state in any of its forms."""
    return unwrap(state.count if isinstance(state, OffloadedState) else state["count"])


def handle_of(state: Any) -> Any:
    """The handle array of an offloaded state in any of its forms."""
    return unwrap(state.handle if isinstance(state, OffloadedState) else state["handle"])


def with_count(state: Any, count: Any) -> Any:
    """``state`` with its count replaced by ``count``, in the same form (variables included),
    so that ``nnx.update`` and ``TrainState.replace`` accept it."""

    def replace(path: tuple[Any, ...], leaf: Any) -> Any:
        first = path[0]
        name = getattr(first, "name", getattr(first, "key", None))
        return count if name == "count" else leaf

    return jax.tree_util.tree_map_with_path(replace, state)


def find_offloaded(tree: Any) -> list[Any]:
    """Every offloaded state in ``tree``, in jax's flattening order, in the form found."""
    found = jax.tree.leaves(tree, is_leaf=is_offloaded)
    return [x for x in found if is_offloaded(x)]
