"""``jax_mlpo.muon``: ``optax.contrib.muon`` with its state offloaded.

Muon orthogonalizes each matrix's momentum by Newton-Schulz iterations, which need the whole
matrix: they run where the params are (the accelerator, inside the user's jitted step). What is
elementwise runs on the host, streamed subgroup by subgroup through the host cache and the
tiers like AdamW's state, in up to three engines (:mod:`jax_mlpo.optimizers.muon` has the math):

1. the momentum pass over the matrices (``muon_weight_dimension_numbers``; 2-D by default):
   advances the momentum and hands the device the momentum to orthogonalize, in float32;
2. on the device, optax's own ``scale_by_muon`` orthogonalizes it (with its momentum set to
   pass the given one through unchanged), then ``scale_by_shape``'s scaling; for float32
   params weight decay and the learning rate follow there too;
3. the master pass (bfloat16 params only): weight decay and the learning rate applied to the
   fp32 master, the update returned in the params' dtype;

and the other leaves get :func:`jax_mlpo.adamw` with optax.contrib.muon's ``adam_*`` arguments.
Since the orthogonalization sees whole arrays on the device, subgroups may cut through
matrices: the host passes are elementwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine.layout import build_layout, check_moment_dtypes, resolve_mask
from jax_mlpo.engine.plan import StateShape, layout_plan, split_host_cache, warn_unused_tiers
from jax_mlpo.engine.scalars import concrete
from jax_mlpo.optimizers.muon import MuonMaster, MuonMomentum
from jax_mlpo.transforms import overlap
from jax_mlpo.transforms.elementwise import adamw, check_offload, check_scalars, check_update_dtype
from jax_mlpo.transforms.offloaded import (
    EmptyGroup,
    is_traced,
    offloaded,
    refuse_discarding_wrappers,
    template_state,
)
from jax_mlpo.transforms.opt_state import OffloadedState
from jax_mlpo.transforms.traced_init import handles_at_run_time, made_at_run_time, stand_ins_of
from jax_mlpo.types import BF16, F32


class OffloadedMuonState(NamedTuple):
    """The states of ``jax_mlpo.muon``'s engines (an engine over no leaves where a group is
    empty)."""

    momentum: Any  # OffloadedState: the matrices' momentum
    master: Any  # OffloadedState: the fp32 master of bfloat16 matrices
    adam: Any  # OffloadedState: AdamW's state of the other leaves


class _Groups(NamedTuple):
    """Which leaves (indices in ``jax.tree.leaves`` order) each engine updates."""

    muon: list[int]  # orthogonalized
    dims: list[MuonDimensionNumbers]  # each muon leaf's
    master: list[int]  # positions in ``muon`` of its bfloat16 leaves
    adam: list[int]  # the rest


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def leaf_groups(params: Any, dimension_numbers: Any) -> _Groups:
    """optax.contrib.muon's partition of the leaves: Muon where the dimension numbers give a
    spec (every 2-D leaf by default), AdamW elsewhere."""
    leaves = jax.tree.leaves(params)
    if dimension_numbers is None:
        specs = [MuonDimensionNumbers() if jnp.ndim(x) == 2 else None for x in leaves]
    else:
        tree = dimension_numbers(params) if callable(dimension_numbers) else dimension_numbers
        specs = []
        jax.tree.map(
            lambda spec, sub: specs.extend([spec] * len(jax.tree.leaves(sub))),
            tree, params, is_leaf=_is_spec,
        )  # fmt: skip
    muon = [i for i, s in enumerate(specs) if s is not None]
    master = [k for k, i in enumerate(muon) if jnp.dtype(leaves[i].dtype) == BF16]
    adam = [i for i, s in enumerate(specs) if s is None]
    return _Groups(muon, [specs[i] for i in muon], master, adam)


def _scale_by_shape(x: jax.Array, dims: MuonDimensionNumbers, consistent_rms: Any) -> jax.Array:
    """optax.contrib.scale_by_shape on one leaf, its expressions as optax writes them."""
    axes = [dims.reduction_axis, dims.output_axis]
    red, out = ((a,) if isinstance(a, int) else tuple(a) for a in axes)
    fan_in = 1
    for ax in red:
        fan_in *= x.shape[ax % x.ndim]
    fan_out = 1
    for ax in out:
        fan_out *= x.shape[ax % x.ndim]
    if consistent_rms is not None:
        scale = jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms
    else:
        scale = jnp.sqrt(jnp.maximum(1, fan_out / fan_in))
    return scale * x


def _ns_coeffs(ns_coeffs: Any, ns_steps: Any) -> Any:
    """A preset's name resolved by optax itself (its table is not exported)."""
    if not isinstance(ns_coeffs, str):
        return ns_coeffs
    tx = optax.contrib.muon(0.0, ns_coeffs=ns_coeffs, ns_steps=ns_steps)
    state = tx.init({"w": jnp.zeros((2, 2))})
    found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MuonState))
             if isinstance(x, MuonState)]  # fmt: skip
    return found[0].ns_coeffs


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: float | None = None,
    offload: OffloadConfig,
    update_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Muon with its state (momentum, fp32 master, the other leaves' AdamW state) offloaded.

    ``optax.contrib.muon``'s arguments and meaning: the matrices chosen by
    ``muon_weight_dimension_numbers`` (every 2-D leaf by default) get

    .. math::
      m_t = \beta m_{t-1} + (1-\beta) g_t, \quad
      u_t = -\eta_t \left(s \cdot \mathrm{NS}(\hat m_t) + \lambda p_{t-1}\right)

    with :math:`\hat m_t` the bias-corrected (Nesterov) momentum, NS optax's Newton-Schulz
    orthogonalization and :math:`s` ``scale_by_shape``'s factor; the other leaves get
    ``adamw(adam_learning_rate, adam_b1, adam_b2, eps, adam_weight_decay, nesterov)``. The
    state is 4 bytes per float32 matrix parameter (the momentum) and 8 per bfloat16 one (with
    its fp32 master), against AdamW's 8 and 12; a step moves a third fewer bytes. The device
    receives the momentum to orthogonalize in float32: for bfloat16 gradients that is a fresh
    buffer of 4 bytes per matrix parameter during the update (float32 gradients are
    overwritten). Everything :func:`jax_mlpo.adamw` says of wrappers, checkpoints and meshes
    holds here. The host cache is shared by the engines in proportion to their states
    (:func:`jax_mlpo.engine.plan.split_host_cache`), and each keeps its files in a subdirectory of
    every tier (``momentum``, ``master``, ``adam``).

    Args:
      learning_rate: a float or an optax schedule.
      ns_coeffs: Newton-Schulz coefficients, ``(3,)`` or ``(n, 3)``, or a preset's name.
      ns_steps: Newton-Schulz iterations.
      beta: the momentum's decay.
      eps: Newton-Schulz's and AdamW's epsilon.
      weight_decay: the matrices' decoupled weight decay, multiplied by the learning rate.
      weight_decay_mask: where it applies (a pytree of bools or a callable; resolved per leaf
        against the params at init).
      mu_dtype: None (float32) or ``jnp.bfloat16``: the momentum's (and AdamW's first moment's)
        storage dtype, with optax's meaning. Unlike optax, None is float32 for bfloat16 params.
      nesterov: Nesterov momentum (both groups).
      adaptive: scale each orthogonalized update by its dual norm.
      preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or ``"schatten"``.
      adam_b1, adam_b2, adam_weight_decay: AdamW's, for the other leaves.
      adam_eps_root: must be 0 (jax_mlpo.adamw has no eps_root).
      adam_learning_rate: AdamW's learning rate; None: ``learning_rate``.
      muon_weight_dimension_numbers: a pytree (or a prefix, or a callable returning one) of
        ``optax.contrib.MuonDimensionNumbers``, None for the leaves AdamW updates.
      consistent_rms: ``scale_by_shape``'s consistent RMS scaling, or None.
      offload: where the state lives; see :class:`jax_mlpo.OffloadConfig`.
      update_dtype: None (the params' dtype) or ``jnp.float32``, for bfloat16 params.

    Returns:
      An optax ``GradientTransformation`` whose ``update`` requires ``params``.

    Raises:
      ConfigError: at construction for a tier path that is missing or not writable; at init
        for a host cache too small for the engines' pipelines.
      ValueError: at construction, for a nonzero ``adam_eps_root``, a ``mu_dtype`` other than
        None, float32 and bfloat16, or an ``update_dtype`` other than None and float32.
    """
    check_offload(offload)
    check_scalars({"beta": beta, "weight_decay": weight_decay})
    eps_root = concrete(adam_eps_root)  # NaN when traced (inject_hyperparams): checked at init
    if not math.isnan(eps_root) and eps_root != 0.0:
        raise ValueError(f"adam_eps_root={adam_eps_root!r}: jax_mlpo.muon's AdamW has no eps_root")
    if isinstance(mu_dtype, str):
        raise ValueError(f"mu_dtype={mu_dtype!r}: jax_mlpo.muon stores its momentum in float32 "
                         "or bfloat16 (jnp.bfloat16)")  # fmt: skip
    moment = check_moment_dtypes([F32 if mu_dtype is None else mu_dtype], ["mu"])
    check_update_dtype(update_dtype)
    settings = MuonSettings(
        learning_rate=learning_rate, coeffs=_ns_coeffs(ns_coeffs, ns_steps), ns_steps=ns_steps,
        beta=beta, eps=eps, weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
        moment=moment, nesterov=nesterov, adaptive=adaptive, preconditioning=preconditioning,
        dimension_numbers=muon_weight_dimension_numbers, consistent_rms=consistent_rms,
        offload=offload, update_dtype=update_dtype,
    )  # fmt: skip
    adam_tx = adamw(
        learning_rate if adam_learning_rate is None else adam_learning_rate, adam_b1, adam_b2,
        eps, adam_weight_decay, offload=offload, mu_dtype=mu_dtype, nesterov=nesterov,
        update_dtype=update_dtype,
    )  # fmt: skip
    tx = Muon(settings, adam_tx)
    return optax.GradientTransformationExtraArgs(tx.init, tx.update)


class MuonSettings(NamedTuple):
    """:func:`muon`'s arguments, checked, that its engines and device passes read."""

    learning_rate: optax.ScalarOrSchedule
    coeffs: Any  # the Newton-Schulz coefficients (a preset resolved)
    ns_steps: int
    beta: float
    eps: float
    weight_decay: float
    weight_decay_mask: Any
    moment: tuple[Any, ...]  # the momentum's storage dtype
    nesterov: bool
    adaptive: bool
    preconditioning: str
    dimension_numbers: Any
    consistent_rms: float | None
    offload: OffloadConfig
    update_dtype: Any


class Muon:
    """``jax_mlpo.muon``'s ``init`` and ``update`` over three offloaded parts.

    Each part is made once: it keeps the shapes it was initialised with (its update checks
    them) and its jitted update, so an eager step compiles nothing new; each part's init takes
    its own config (a subdirectory of every tier) and mask.

    Attributes:
      settings: the optimizer's arguments.
      momentum_tx: the matrices' momentum (:class:`~jax_mlpo.optimizers.muon.MuonMomentum`).
      master_tx: the fp32 master of bfloat16 matrices (:class:`MuonMaster`).
      adam_tx: AdamW on the other leaves.
      part_configs: each engine's config, by the engines' state shapes: made (and its tier
        directories probed) once, so that a second init of this optimizer takes its engines'
        places by the same configs (a place without tiers is its config object:
        :func:`jax_mlpo.transforms.runtime.place_of`). An empty group's engine holds nothing
        (no share of the host cache, no blob in its tier subdirectories); its subdirectories
        are its place, for the next init to replace.
    """

    def __init__(self, settings: MuonSettings, adam_tx: optax.GradientTransformationExtraArgs
                 ) -> None:  # fmt: skip
        self.settings = s = settings
        self.momentum_tx = offloaded(
            "muon", MuonMomentum(bool(s.nesterov)), learning_rate=0.0,
            hyperparams={"beta": s.beta},
            device_scalars=lambda count_inc, hp, lr, updates: {
                "bc": 1 - hp["beta"] ** count_inc,
                "bc_next": 1 - hp["beta"] ** optax.safe_increment(count_inc)},
            moment_dtypes=s.moment, mask=None, offload=s.offload, update_dtype=jnp.float32,
            keeps_master=False,
        )  # fmt: skip
        self.master_tx = offloaded(
            "muon", MuonMaster(), learning_rate=s.learning_rate,
            hyperparams={"weight_decay": s.weight_decay},
            device_scalars=lambda count_inc, hp, lr, updates: {"lr": lr}, moment_dtypes=(),
            mask=None, offload=s.offload, update_dtype=s.update_dtype,
        )  # fmt: skip
        self.adam_tx = adam_tx
        self.part_configs: dict[tuple[Any, ...], dict[str, OffloadConfig]] = {}
        # jitted once here: eagerly, optax's Newton-Schulz scan would compile at every step
        self._orthogonalize = jax.jit(self._orthogonalized, static_argnums=1)

    def _decay_flags(self, params: Any, groups: _Groups) -> list[bool]:
        flags = resolve_mask(self.settings.weight_decay_mask, params)
        return [flags[i] for i in groups.muon]

    def _configs_for(self, shapes: dict[str, StateShape | None]) -> dict[str, OffloadConfig]:
        key = tuple(shapes.items())
        if key not in self.part_configs:
            offload = self.settings.offload
            held = [name for name, shape in shapes.items() if shape is not None]
            shares = dict(zip(held, split_host_cache(offload, [shapes[n] for n in held]),
                              strict=True))  # fmt: skip
            configs = {}
            for name in shapes:
                tiers = tuple(t.for_part(name) for t in offload.tiers)
                configs[name] = dataclasses.replace(
                    offload, tiers=tiers, host_cache=shares.get(name, 0)
                )
                configs[name].validate()
            self.part_configs[key] = configs
        return self.part_configs[key]

    def init(self, params: Any, *, host_arrays: bool = False) -> OffloadedMuonState:
        """optax's ``init``; ``host_arrays``: the state as NumPy scalars (made inside a
        compiled init's host call)."""
        refuse_discarding_wrappers("muon")
        if not jax.tree.leaves(params) or (
            is_traced(params) and not made_at_run_time(params, on_mesh=False)
        ):  # optax.tree.map_params's placeholder, a trace on a mesh: the state's shapes only
            return OffloadedMuonState(*(template_state(params) for _ in range(3)))
        if is_traced(params):  # jax.jit(tx.init): the engines are made when the program runs
            stand_ins = stand_ins_of(params)
            handles = handles_at_run_time(
                lambda: [s.handle for s in self.init(stand_ins, host_arrays=True)], [()] * 3
            )
            zero = jnp.zeros([], jnp.int32)
            return OffloadedMuonState(*(OffloadedState(zero, h) for h in handles))
        s = self.settings
        groups = leaf_groups(params, s.dimension_numbers)
        leaves = jax.tree.leaves(params)
        muon_leaves = [leaves[i] for i in groups.muon]
        bf16 = [muon_leaves[k] for k in groups.master]
        adam_params = [leaves[i] for i in groups.adam]
        flags = self._decay_flags(params, groups)
        size = s.offload.subgroup_size
        parts = {
            "momentum": muon_leaves and build_layout(muon_leaves, size, None, s.moment, ("mu",),
                                                     keeps_master=False),
            "master": bf16 and build_layout(bf16, size, None, (), ()),
            "adam": adam_params and build_layout(adam_params, size, None, (*s.moment, F32)),
        }  # fmt: skip
        configs = self._configs_for({n: StateShape.of(x) if x else None for n, x in parts.items()})
        # An empty group still has its state (an engine over no leaves, which holds nothing),
        # so the state's structure does not depend on the params, as optax's partition
        # states do not: optax.tree.map_params inits on a placeholder with no leaves.
        masked = [flags[k] for k in groups.master]
        held = [n for n, x in parts.items() if x]
        warn_unused_tiers("muon", s.offload, [StateShape.of(parts[n]) for n in held],
                          [layout_plan(configs[n], parts[n]) for n in held])  # fmt: skip
        return OffloadedMuonState(
            momentum=self.momentum_tx.init(muon_leaves or EmptyGroup(),
                                           part_offload=configs["momentum"],
                                           host_arrays=host_arrays),
            master=self.master_tx.init(bf16 or EmptyGroup(), part_offload=configs["master"],
                                       part_mask=masked if bf16 else None,
                                       host_arrays=host_arrays),
            adam=self.adam_tx.init(adam_params or EmptyGroup(), part_offload=configs["adam"],
                                   host_arrays=host_arrays),
        )  # fmt: skip

    def _orthogonalized(self, mu_hat: list[jax.Array], dims: tuple[MuonDimensionNumbers, ...]
                        ) -> list[jax.Array]:  # fmt: skip
        # optax's scale_by_muon with beta 0 and no nesterov passes the momentum it is given
        # through unchanged ((1 - 0) m + 0 m, divided by 1 - 0^1): what is left is its
        # orthogonalization (and adaptive scaling), computed by optax's own code.
        s = self.settings
        tx = scale_by_muon(s.coeffs, s.ns_steps, beta=0.0, eps=s.eps, nesterov=False,
                           adaptive=s.adaptive, preconditioning=s.preconditioning,
                           weight_dimension_numbers=list(dims))  # fmt: skip
        state = tx.init(mu_hat)._replace(mu=mu_hat)  # its zeros are never read
        out, _ = tx.update(mu_hat, state)
        return [_scale_by_shape(x, d, s.consistent_rms) for x, d in zip(out, dims, strict=True)]

    def update(self, updates: Any, state: OffloadedMuonState, params: Any = None,
               **extra_args: Any) -> tuple[Any, OffloadedMuonState]:  # fmt: skip
        """optax's ``update``: other extra arguments are accepted and ignored, as
        optax.contrib.muon's update does; an overlapped step's grouping goes on to the parts."""
        grouping = overlap.Grouping.given(extra_args)
        parts = {} if grouping is None else {overlap.OVERLAP_ARG: grouping}
        if params is None:
            raise ValueError(
                "jax_mlpo.muon needs params in update (tx.update(grads, state, params)): they "
                "are read for weight decay and for the bfloat16 master copy"
            )
        s = self.settings
        groups = leaf_groups(params, s.dimension_numbers)
        grads, treedef = jax.tree.flatten(updates)
        leaves = treedef.flatten_up_to(params)
        out: list[Any] = list(grads)
        momentum, master, adam = state
        if groups.muon:
            muon_params = [leaves[i] for i in groups.muon]
            count = momentum.count
            mu_hat, momentum = self.momentum_tx.update(
                [grads[i] for i in groups.muon], momentum, muon_params, **parts
            )
            directions = self._orthogonalize(mu_hat, tuple(groups.dims))
            flags = self._decay_flags(params, groups)
            in_master = set(groups.master)
            on_device = [k for k in range(len(groups.muon)) if k not in in_master]
            if on_device:
                # optax's own transformations, as optax.contrib.muon chains them
                on_params = [muon_params[k] for k in on_device]
                decay = optax.add_decayed_weights(s.weight_decay, [flags[k] for k in on_device])
                decayed, _ = decay.update(
                    [directions[k] for k in on_device], decay.init(on_params), on_params
                )
                scale = optax.scale_by_learning_rate(s.learning_rate)
                schedule = scale.init(on_params)
                if callable(s.learning_rate):  # evaluated at the step count, as its state's
                    schedule = optax.ScaleByScheduleState(count=count)
                scaled, _ = scale.update(decayed, schedule)
                for k, u in zip(on_device, scaled, strict=True):
                    out[groups.muon[k]] = u
            if groups.master:
                applied, master = self.master_tx.update(
                    [directions[k] for k in groups.master], master,
                    [muon_params[k] for k in groups.master], **parts,
                )  # fmt: skip
                for k, u in zip(groups.master, applied, strict=True):
                    out[groups.muon[k]] = u
        if groups.adam:
            adam_updates, adam = self.adam_tx.update(
                [grads[i] for i in groups.adam], adam, [leaves[i] for i in groups.adam], **parts
            )
            for i, u in zip(groups.adam, adam_updates, strict=True):
                out[i] = u
        # an empty group's engine runs nothing; its count advances as optax's states' do
        momentum, master, adam = (
            x if ran else x._replace(count=optax.safe_increment(x.count))
            for x, ran in zip((momentum, master, adam), (groups.muon, groups.master, groups.adam),
                              strict=True)
        )  # fmt: skip
        return treedef.unflatten(out), OffloadedMuonState(momentum, master, adam)
