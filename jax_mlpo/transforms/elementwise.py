"""The offloaded optax optimizers: ``jax_mlpo.adamw`` and ``jax_mlpo.lion``.

Each takes its optax namesake's arguments and meaning, plus ``offload`` (where the state
lives), and returns an optax ``GradientTransformation`` whose state is two int32 scalars
(:mod:`jax_mlpo.transforms.offloaded`); its per-subgroup math runs on the host
(:mod:`jax_mlpo.optimizers`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine.layout import check_moment_dtypes
from jax_mlpo.engine.quantize import Q8
from jax_mlpo.optimizers.adamw import AdamW
from jax_mlpo.optimizers.lion import Lion
from jax_mlpo.transforms.offloaded import offloaded
from jax_mlpo.transforms.runtime import RUNTIME


def check_offload(offload: Any) -> None:
    """Raises unless ``offload`` is an ``OffloadConfig``; checks its tiers once."""
    if not isinstance(offload, OffloadConfig):
        raise TypeError(f"offload must be a jax_mlpo.OffloadConfig, got {type(offload).__name__}")
    RUNTIME.validate_once(offload)


def check_scalars(scalars: dict[str, Any]) -> None:
    for name, value in scalars.items():
        if not isinstance(value, int | float) and np.shape(value) != ():
            raise ValueError(f"{name} must be a float or a scalar array, got shape "
                             f"{np.shape(value)}")  # fmt: skip


def check_update_dtype(update_dtype: Any) -> None:
    if update_dtype is not None and jnp.dtype(update_dtype) != jnp.float32:
        raise ValueError(
            f"update_dtype must be None (the params' dtype) or float32, got {update_dtype!r}"
        )


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
    *,
    offload: OffloadConfig,
    max_grad_norm: float | None = None,
    update_dtype: Any = None,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    q8_rounding: str = "stochastic",
    nesterov: bool = False,
) -> optax.GradientTransformation:
    r"""AdamW with its state (fp32 master params, m, v) offloaded to host memory and files.

    The update is ``optax.adamw``'s, operation for operation in float32:

    .. math::
      m_t = b_1 m_{t-1} + (1-b_1) g_t, \quad v_t = b_2 v_{t-1} + (1-b_2) g_t^2, \\
      u_t = -\eta_t \left(\frac{m_t / (1-b_1^t)}{\sqrt{v_t / (1-b_2^t)} + \epsilon}
            + \lambda\, p_{t-1}\right)

    where the weight decay :math:`\lambda` applies where ``mask`` is True. For float32 params
    ``optax.apply_updates(params, u)`` gives optax.adamw's params (to float32 rounding). For
    bfloat16 params the tiers also keep an fp32 master copy, and the update is in the params'
    dtype, as optax's convention is: ``bfloat16(master_new) - params``, computed from the
    params handed to this update. ``apply_updates`` then yields ``bfloat16(master_new)``
    exactly wherever the new and old values are within a factor 2 of each other (Sterbenz) and
    within a bfloat16 rounding of it elsewhere; the master copy itself stays exact, and the next
    update is computed from the params as they are, so no difference accumulates
    (docs/precision.md, "The bf16 update", has the measured fractions).
    ``update_dtype=jnp.float32`` returns ``master_new - float32(params)`` instead, with which
    ``apply_updates`` gives ``bfloat16(master_new)`` bit for bit, at 4 bytes of update per param.

    Memory: the update is written over the gradients where their dtypes agree (bfloat16
    gradients of bfloat16 params, or float32 of float32), so inside a jitted train step the
    device holds params and gradients and nothing else of the model's size; the host holds the
    host cache and nothing that grows with the model.

    p, m and v never live on the accelerator: the returned state is two int32 scalars, and the
    moments are advanced on the host by every update that runs. Each update must therefore be
    handed the state returned by the previous one; wrappers that compute and then discard an
    update (``optax.MultiSteps``) are refused: :class:`jax_mlpo.MultiSteps` accumulates
    gradients with its semantics. ``optax.inject_hyperparams(jax_mlpo.adamw)`` works as for
    ``optax.adamw``: the transformation it re-creates in every update finds the engine its
    state names.

    Args:
      learning_rate: a float or an optax schedule (evaluated on the device at the step count).
      b1: exponential decay of the first moment.
      b2: exponential decay of the second moment.
      eps: added to the denominator outside the square root.
      weight_decay: decoupled weight decay, multiplied by the learning rate as in optax.
        Each of these four may be a Python float (kept in double precision, as optax uses
        it) or a scalar array that may change from step to step (as
        ``optax.inject_hyperparams`` passes them: float32, as optax computes with them).
      mask: a pytree of bools (or a prefix of the params tree), or a callable returning one:
        where weight decay applies. Resolved once, at init.
      offload: where the state lives; see :class:`jax_mlpo.OffloadConfig`.
      max_grad_norm: if set, gradients are clipped to this global norm first, as
        ``optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw(...))`` does, but without
        writing the scaled gradients: the norm is taken on the device (in float32) and the scale
        is applied inside the host update, where the gradients are read anyway. That saves a
        pass over the gradients and a fresh buffer of their size every step (0.13 s of 0.15 s at
        97.5M bfloat16 params on 2 CPU cores). With bfloat16 gradients the norm and the scaling
        are float32 (optax's chain computes both in bfloat16); with float32 ones they agree with
        the chain to rounding.
      update_dtype: None (the params' dtype, the default) or ``jnp.float32``: the update's dtype
        for bfloat16 params (float32 params always get a float32 update).
      mu_dtype: None (float32) or ``jnp.bfloat16``: the dtype the first moment is stored in on
        the tiers, with optax's meaning: the moment is advanced and the update computed in
        float32 (the decay rounded to bfloat16, as optax's weak-typed ``b1 * mu`` does), then
        stored rounded to nearest even; so ``optax.adamw(mu_dtype=jnp.bfloat16)``'s m bit for
        bit.
      nu_dtype: None (float32) or ``jnp.bfloat16``: the same for the second moment (optax has
        no such option); its decay stays float32. Both bfloat16 cut the state from 12 (bfloat16
        params) or 8 (float32) bytes per param to 8 or 4.
        Either may also be ``"q8"``: 8-bit blockwise (:mod:`jax_mlpo.engine.quantize`: a byte per
        element with 3 mantissa bits, a power-of-two scale per 256 elements), decoded to
        float32 inside the update and encoded again; both q8 make the state 6.03 bytes per
        param with bfloat16 params (2.03 with float32 ones). Not exact to optax: the moments
        carry a rounding error of at most 1/16 (nearest) each step.
      q8_rounding: how q8 moments are rounded: ``"stochastic"`` (unbiased; its random bits
        are a hash of the step, the subgroup and the element, so a resumed run draws the same
        ones) or ``"nearest"``, which leaves moments that change by under 3-6% a step where
        they are: a 125M model's loss ended 5% above the float32 state's with it, 0.5% below
        with stochastic rounding (docs/benchmarks.md).
      nesterov: optax's ``nesterov``: the update uses ``b1 m_t / (1 - b1^(t+1)) + (1 - b1)
        g_t / (1 - b1^t)`` for the first moment (float32 and bfloat16 moments; not with q8).

    Returns:
      An optax ``GradientTransformation`` whose ``update`` requires ``params``.

    Raises:
      ConfigError: at construction, for a tier path that is missing or not writable; at init,
        for a host cache too small for the pipeline.
      ValueError: at construction, for a ``max_grad_norm`` that is not positive, an
        ``update_dtype`` other than None and float32, a ``mu_dtype``/``nu_dtype`` other than
        None, float32, bfloat16 and "q8", a ``q8_rounding`` other than those two, or ``nesterov``
        with a q8 moment.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_mlpo
      >>> tx = jax_mlpo.adamw(1e-3, offload=jax_mlpo.OffloadConfig(host_cache="64MiB"))
      >>> params = {"w": jnp.ones((4, 4))}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> jax_mlpo.close(state)
    """
    check_offload(offload)
    hyperparams = {"b1": b1, "b2": b2, "eps": eps, "weight_decay": weight_decay}
    check_scalars(hyperparams)
    moments = check_moment_dtypes([jnp.float32 if d is None else d for d in (mu_dtype, nu_dtype)])
    if q8_rounding not in ("nearest", "stochastic"):
        raise ValueError(f'q8_rounding must be "nearest" or "stochastic", got {q8_rounding!r}')
    if nesterov and Q8 in moments:
        raise ValueError("nesterov=True needs float32 or bfloat16 moments (not q8)")
    if max_grad_norm is not None and not float(max_grad_norm) > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None: no clipping), got {max_grad_norm!r}")
    check_update_dtype(update_dtype)
    optimizer = AdamW(stochastic_rounding=q8_rounding == "stochastic", nesterov=bool(nesterov))

    def device_scalars(count_inc, hp, lr, updates):
        # the same expressions optax evaluates, on the device, so they match it bit for bit
        bc1 = 1 - hp["b1"] ** count_inc
        bc2 = 1 - hp["b2"] ** count_inc
        # with max_grad_norm, offloaded() sets grad_scale: optax.clip_by_global_norm's rule
        scale = 1.0
        bc1_next = 1 - hp["b1"] ** optax.safe_increment(count_inc) if nesterov else 1.0
        return {"lr": lr, "bc1": bc1, "bc2": bc2, "grad_scale": scale, "bc1_next": bc1_next}

    return offloaded(
        "adamw", optimizer, learning_rate=learning_rate, hyperparams=hyperparams,
        device_scalars=device_scalars, moment_dtypes=moments, mask=mask, offload=offload,
        update_dtype=update_dtype, max_grad_norm=max_grad_norm,
    )  # fmt: skip


def lion(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Any = None,
    weight_decay: float = 1e-3,
    mask: Any = None,
    *,
    offload: OffloadConfig,
    update_dtype: Any = None,
) -> optax.GradientTransformation:
    r"""Lion with its state (fp32 master params, m) offloaded to host memory and files.

    The update is ``optax.lion``'s (``scale_by_lion``, ``add_decayed_weights``,
    ``scale_by_learning_rate``), operation for operation in float32:

    .. math::
      u_t = -\eta_t \left(\operatorname{sign}\left((1-b_1) g_t + b_1 m_{t-1}\right)
            + \lambda\, p_{t-1}\right), \quad m_t = b_2 m_{t-1} + (1-b_2) g_t

    where the weight decay :math:`\lambda` applies where ``mask`` is True. One moment: the
    state is 4 bytes per float32 param and 8 per bfloat16 one (with its fp32 master), two
    thirds of AdamW's, and each step moves that much less through the tiers. bfloat16 params
    get their update in their dtype, ``bfloat16(master_new) - params``, as with
    :func:`jax_mlpo.adamw` (``update_dtype=jnp.float32`` for a float32 one). Everything
    :func:`jax_mlpo.adamw` says of wrappers (``inject_hyperparams``, :class:`jax_mlpo.MultiSteps`),
    checkpoints and meshes holds here.

    Args:
      learning_rate: a float or an optax schedule (evaluated on the device at the step count).
      b1: the rate that mixes the gradient into the moment for the update's sign.
      b2: the moment's exponential decay.
      mu_dtype: None (float32) or ``jnp.bfloat16``: the moment's storage dtype, with optax's
        meaning (advanced in float32, the decays rounded to bfloat16 where they multiply it,
        stored rounded to nearest even). Unlike optax, None is float32 for bfloat16 params too.
      weight_decay: decoupled weight decay, multiplied by the learning rate as in optax. This
        and ``b1``, ``b2`` may be Python floats or scalar arrays (inject_hyperparams).
      mask: a pytree of bools (or a prefix of the params tree), or a callable returning one:
        where weight decay applies. Resolved once, at init.
      offload: where the state lives; see :class:`jax_mlpo.OffloadConfig`.
      update_dtype: None (the params' dtype) or ``jnp.float32``, for bfloat16 params.

    Returns:
      An optax ``GradientTransformation`` whose ``update`` requires ``params``.

    Raises:
      ConfigError: at construction, for a tier path that is missing or not writable; at init,
        for a host cache too small for the pipeline.
      ValueError: at construction, for a ``mu_dtype`` other than None, float32 and bfloat16,
        or an ``update_dtype`` other than None and float32.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_mlpo
      >>> tx = jax_mlpo.lion(1e-4, offload=jax_mlpo.OffloadConfig(host_cache="64MiB"))
      >>> params = {"w": jnp.ones((4, 4))}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
      >>> jax_mlpo.close(state)
    """
    check_offload(offload)
    hyperparams = {"b1": b1, "b2": b2, "weight_decay": weight_decay}
    check_scalars(hyperparams)
    if mu_dtype is not None and isinstance(mu_dtype, str):
        raise ValueError(f'mu_dtype={mu_dtype!r}: jax_mlpo.lion stores its moment in float32 '
                         "or bfloat16 (jnp.bfloat16)")  # fmt: skip
    moments = check_moment_dtypes([jnp.float32 if mu_dtype is None else mu_dtype], ["mu"])
    check_update_dtype(update_dtype)
    return offloaded(
        "lion", Lion(), learning_rate=learning_rate, hyperparams=hyperparams,
        device_scalars=lambda count_inc, hp, lr, updates: {"lr": lr}, moment_dtypes=moments,
        mask=mask, offload=offload, update_dtype=update_dtype,
    )  # fmt: skip
