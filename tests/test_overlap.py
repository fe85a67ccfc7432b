"""jax_mlpo.overlap_with: the update of step t beside the forward pass of step t + 1.

Exact: the same params as the plain loop, bit for bit, and within optax's tolerance of optax,
through nnx.Optimizer, a linen TrainState, optax's wrappers, a mesh, and a checkpoint and
resume. Overlapped, shown by order, not time: a read of the last subgroup in forward order is
held until the forward pass's first layer has run, which cannot happen if the forward pass
waited for the whole update.
"""

from __future__ import annotations

import errno
import functools
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import jax_mlpo
from jax_mlpo.testing import tier_faults
from jax_mlpo.transforms.overlap import forward_ranks, leaf_groups

SUB = 4096
LR, WD = 1e-2, 0.1
STEPS = 6


def make_params() -> dict[str, jax.Array]:
    """Four layers whose keys sort against the forward order (c, d, b, a): the forward order
    must come from the program."""
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = {"c_in": (64, 128), "d_mid": (128, 128), "b_top": (128, 128), "a_out": (128, 64)}
    return {k: jax.random.normal(key, s) * 0.1
            for key, (k, s) in zip(keys, shapes.items(), strict=True)}  # fmt: skip


def loss_fn(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    h = jnp.tanh(x @ params["c_in"])
    h = jnp.tanh(h @ params["d_mid"])
    h = jnp.tanh(h @ params["b_top"])
    return jnp.mean((h @ params["a_out"] - y) ** 2)


def batch(step: int) -> tuple[jax.Array, jax.Array]:
    key = jax.random.key(100 + step)
    return (
        jax.random.normal(key, (32, 64)),
        jax.random.normal(jax.random.fold_in(key, 1), (32, 64)),
    )


def file_config(path: Path, blob: int = 8 * SUB, **switches) -> jax_mlpo.OffloadConfig:
    """One file tier; the host cache holds three blobs (float32 params': ``8 * SUB`` bytes) of
    the 12 subgroups' state."""
    path.mkdir(parents=True, exist_ok=True)
    return jax_mlpo.OffloadConfig(
        host_cache=3 * blob, subgroup_size=SUB, prefetch_depth=1, placement="even",
        tiers=[jax_mlpo.FileTier(str(path / "t0"), sync=False)], **switches,
    )  # fmt: skip


def plain(tx, steps: int = STEPS, params=None, state=None, start: int = 0, loss_of=loss_fn):
    """The plain loop: forward and backward, then the update, one jitted step."""
    params = make_params() if params is None else params
    state = tx.init(params) if state is None else state

    @jax.jit
    def step(params, state, b):
        loss, grads = jax.value_and_grad(loss_of)(params, b)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(start, start + steps):
        params, state, loss = step(params, state, batch(i))
        losses.append(float(loss))
    return params, state, losses


def overlapped_step(tx, loss=loss_fn, groups: int = 4):
    """The overlapped step of jax_mlpo.transforms.overlap's module doc, and its flush."""

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, state, pending, b):
        return jax_mlpo.overlapped_step(loss, tx, params, state, pending, b, groups=groups)

    @jax.jit
    def flush(params, state, pending):
        updates, state = tx.update(pending, state, params)
        return optax.apply_updates(params, updates), state

    return step, flush


def overlapped(tx, steps: int = STEPS, params=None, state=None, start: int = 0, loss_of=loss_fn):
    """The overlapped loop: the first step only computes gradients, the last flushes."""
    params = make_params() if params is None else params
    state = tx.init(params) if state is None else state
    step, flush = overlapped_step(tx, loss_of)
    losses = []
    value, pending = jax.jit(jax.value_and_grad(loss_of))(params, batch(start))
    losses.append(float(value))
    for i in range(start + 1, start + steps):
        params, state, pending, value = step(params, state, pending, batch(i))
        losses.append(float(value))
    params, state = flush(params, state, pending)
    return params, state, losses


def assert_bits_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_close(a, b, tol: float = 1e-6) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def offloaded_adamw(config, **kwargs):
    return jax_mlpo.adamw(LR, weight_decay=WD, offload=config, **kwargs)


def test_the_forward_order_comes_from_the_program():
    params = make_params()
    ranks = forward_ranks(jax.make_jaxpr(loss_fn)(params, batch(0)).jaxpr)[:4]  # then the batch
    keys = sorted(params)  # jax.tree.leaves order: a_out, b_top, c_in, d_mid
    order = sorted(range(4), key=lambda k: ranks[k])
    assert [keys[k] for k in order] == ["c_in", "d_mid", "b_top", "a_out"]
    groups = leaf_groups(ranks, [int(np.size(x)) for x in jax.tree.leaves(params)], 4)
    assert dict(zip(keys, groups, strict=True)) == {"c_in": 0, "d_mid": 1, "b_top": 2, "a_out": 3}
    # leaves first used by one equation (a scan's stacked weights) are never split apart
    assert leaf_groups([0, 5, 5, 5, 9], [1, 4, 4, 4, 1], 8) == [0, 4, 4, 4, 7]
    # a layer's bias stays with its weight (the cut moves to the next weight), not alone
    # at the head of the next group: w1 80% of the elements, b1, w2, b2
    assert leaf_groups([0, 1, 2, 3], [4096, 64, 1024, 16], 2) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="groups must be >= 1"):
        jax_mlpo.overlapped_step(loss_fn, optax.sgd(LR), params, None, params, batch(0), groups=0)


def scanned_params() -> dict[str, jax.Array]:
    """Three layers of one kind stacked in one [layers, ...] leaf (as nnx.scan lays them out)
    between an input and an output layer."""
    keys = jax.random.split(jax.random.key(1), 3)
    shapes = {"in": (64, 128), "layers": (3, 128, 128), "out": (128, 64)}
    return {k: jax.random.normal(key, s) * 0.1
            for key, (k, s) in zip(keys, shapes.items(), strict=True)}  # fmt: skip


def scanned_loss(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    h = jnp.tanh(x @ params["in"])
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, params["layers"])
    return jnp.mean((h @ params["out"] - y) ** 2)


def test_a_scanned_stack_is_one_group_and_follows_the_plain_loop(tmp_path):
    """One scan equation consumes every layer of a stacked leaf: the leaf is one group (its
    rows are received inside the scan, tests/test_overlap_scan.py), and the step is still the
    plain loop's, bit for bit."""
    params = scanned_params()
    ranks = forward_ranks(jax.make_jaxpr(scanned_loss)(params, batch(0)).jaxpr)[:3]
    groups = leaf_groups(ranks, [int(np.size(x)) for x in jax.tree.leaves(params)], 4)
    assert dict(zip(sorted(params), groups, strict=True)) == {"in": 0, "layers": 2, "out": 3}
    tx = offloaded_adamw(file_config(tmp_path / "a"))
    expected, state, expected_losses = plain(tx, params=params, loss_of=scanned_loss)
    jax_mlpo.close(state)
    tx = offloaded_adamw(file_config(tmp_path / "b"))
    got, state, losses = overlapped(tx, params=scanned_params(), loss_of=scanned_loss)
    assert all(m.beside_s > 0 for m in jax_mlpo.metrics(state)[:-1])
    jax_mlpo.close(state)
    assert_bits_equal(got, expected)
    assert losses == expected_losses


@pytest.mark.parametrize("clip", ["none", "max_grad_norm"])
def test_bit_for_bit_the_plain_loop_and_within_optax(clip, tmp_path):
    kwargs = {"max_grad_norm": 1.0} if clip == "max_grad_norm" else {}
    expected, state, expected_losses = plain(offloaded_adamw(file_config(tmp_path / "a"), **kwargs))
    jax_mlpo.close(state)
    params, state, losses = overlapped(offloaded_adamw(file_config(tmp_path / "b"), **kwargs))
    steps = jax_mlpo.metrics(state)
    assert [m.step for m in steps] == list(range(1, STEPS + 1))
    # every update but the flush ran in groups, handing its first groups back before its end
    assert all(m.beside_s > 0 for m in steps[:-1]) and steps[-1].beside_s == 0
    assert any(m.bytes_read for m in steps)  # the state streamed through the tier
    engine = jax_mlpo.engine_of(state)
    assert engine.order.forward is not None  # the forward pass's order, from the program
    jax_mlpo.close(state)
    assert_bits_equal(params, expected)
    assert losses == expected_losses
    reference = optax.adamw(LR, weight_decay=WD)
    if clip == "max_grad_norm":
        reference = optax.chain(optax.clip_by_global_norm(1.0), reference)
    assert_close(params, plain(reference)[0])


def test_inject_hyperparams_follows_the_plain_loop_bit_for_bit(tmp_path):
    def mine(path):
        return optax.inject_hyperparams(
            lambda learning_rate: jax_mlpo.adamw(
                learning_rate, weight_decay=WD, max_grad_norm=0.5, offload=file_config(path)
            )
        )(LR)

    expected, state, _ = plain(mine(tmp_path / "a"))
    jax_mlpo.close(state)
    params, state, _ = overlapped(mine(tmp_path / "b"))
    assert all(m.beside_s > 0 for m in jax_mlpo.metrics(state)[:-1])
    jax_mlpo.close(state)
    assert_bits_equal(params, expected)
    reference = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(
            optax.clip_by_global_norm(0.5), optax.adamw(learning_rate, weight_decay=WD)
        )
    )(LR)
    assert_close(params, plain(reference)[0])


def test_a_chain_with_clip_by_global_norm_follows_the_plain_loop(tmp_path):
    """optax.clip_by_global_norm in a chain sees every gradient before the update, as in the
    plain loop. Not bit for bit: XLA fuses the norm's float32 sum into the backward pass of the
    plain step, where the overlapped step reads the carried gradients back (a sum in another
    order); jax_mlpo.adamw's own max_grad_norm is bit for bit (above)."""

    def make(offload=None):
        inner = (optax.adamw(LR, weight_decay=WD) if offload is None
                 else jax_mlpo.adamw(LR, weight_decay=WD, offload=offload))  # fmt: skip
        return optax.chain(optax.clip_by_global_norm(0.5), inner)

    expected, state, _ = plain(make(file_config(tmp_path / "a")))
    jax_mlpo.close(state)
    params, state, _ = overlapped(make(file_config(tmp_path / "b")))
    assert all(m.beside_s > 0 for m in jax_mlpo.metrics(state)[:-1])
    jax_mlpo.close(state)
    assert_close(params, expected)
    assert_close(params, plain(make())[0])


def test_multi_steps_runs_in_one_call_and_follows_the_plain_loop(tmp_path):
    """Inside jax_mlpo.MultiSteps the inner update runs under lax.cond, where the params are the
    branch's own tracers: one call, exact, not overlapped."""

    def tx_of(path):
        return jax_mlpo.MultiSteps(offloaded_adamw(file_config(path)), every_k_schedule=2)

    expected, state, _ = plain(tx_of(tmp_path / "a"))
    jax_mlpo.close(state)
    params, state, _ = overlapped(tx_of(tmp_path / "b"))
    steps = jax_mlpo.metrics(state)
    assert len(steps) == STEPS // 2 and all(m.beside_s == 0 for m in steps)
    jax_mlpo.close(state)
    assert_bits_equal(params, expected)
    reference = optax.MultiSteps(optax.adamw(LR, weight_decay=WD), every_k_schedule=2)
    assert_close(params, plain(reference, steps=STEPS)[0])


def test_a_wrapper_that_drops_extra_arguments_runs_in_one_call(tmp_path):
    """The step hands its groups to the update as optax's extra argument jax_mlpo_overlap: a
    user's wrapper that passes it on (optax.GradientTransformationExtraArgs) is overlapped, one
    that drops extra arguments gets the update in one call; both are the plain loop exactly."""

    def passing(inner):
        return optax.GradientTransformationExtraArgs(
            inner.init, lambda u, s, p=None, **extra: inner.update(u, s, p, **extra)
        )

    def dropping(inner):
        return optax.GradientTransformation(inner.init, lambda u, s, p=None: inner.update(u, s, p))

    expected, state, _ = plain(offloaded_adamw(file_config(tmp_path / "plain")))
    jax_mlpo.close(state)
    for wrap, overlaps in ((passing, True), (dropping, False)):
        params, state, _ = overlapped(wrap(offloaded_adamw(file_config(tmp_path / wrap.__name__))))
        steps = jax_mlpo.metrics(state)
        jax_mlpo.close(state)
        assert len(steps) == STEPS and steps[-1].beside_s == 0  # the flush: one call
        assert all((m.beside_s > 0) == overlaps for m in steps[:-1]), wrap.__name__
        assert_bits_equal(params, expected)


def test_a_checkpoint_in_the_middle_resumes_bit_for_bit(tmp_path):
    """Flush, save with OffloadSave, restore into a fresh init and go on with no pending
    gradients: the params of the uninterrupted overlapped run."""
    expected, state, expected_losses = overlapped(offloaded_adamw(file_config(tmp_path / "u")))
    jax_mlpo.close(state)
    config = file_config(tmp_path / "run")
    params, state, first = overlapped(offloaded_adamw(config), steps=3)
    mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    mngr.save(3, args=jax_mlpo.checkpoint.OffloadSave({"params": params, "opt": state}))
    mngr.wait_until_finished()
    jax_mlpo.close(state)
    tx = offloaded_adamw(config)  # a new process's optimizer
    target = {"params": make_params(), "opt": tx.init(make_params())}
    restored = mngr.restore(3, args=jax_mlpo.checkpoint.OffloadRestore(target))
    params, state, rest = overlapped(
        tx, steps=STEPS - 3, params=restored["params"], state=restored["opt"], start=3
    )
    jax_mlpo.close(state)
    mngr.close()
    assert_bits_equal(params, expected)
    assert first + rest == expected_losses


def last_read(engine) -> int:
    """The last subgroup the engine's next update reads: the last of its order (what the last
    update kept comes first, and is not read)."""
    order = engine.order.of_step(engine.step_count)
    assert order[-1] not in engine.order.kept
    return order[-1]


def test_the_forward_pass_runs_while_the_last_group_is_updated(tmp_path):
    """The read of the last subgroup the update reads (one of a_out's, the last leaf the
    forward pass needs) is held until the forward pass's first layer has run: had the forward
    pass waited for the whole update, the hold would only end at its limit, before the first
    layer ran, and the test fail."""
    tx = offloaded_adamw(file_config(tmp_path, read_ahead=False, overlap_order="forward"))
    params = make_params()
    state = tx.init(params)
    ran_first_layer = threading.Event()
    held_when_it_ran: list[int] = []
    probe: dict[str, Any] = {"plan": None}  # armed for the second step only

    def first_layer_ran(_):
        plan = probe["plan"]
        if plan is not None and not ran_first_layer.is_set():
            # the engine reaches the last subgroup while the first layer's forward pass waits
            # here; had the forward pass waited for the update, the hold would be over already
            deadline = time.monotonic() + 30
            while plan.hanging == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            held_when_it_ran.append(plan.hanging)
            ran_first_layer.set()
            plan.release()

    def loss_with_probe(params, b):
        x, y = b
        h = jnp.tanh(x @ params["c_in"])
        jax.debug.callback(first_layer_ran, h[0, 0])
        h = jnp.tanh(h @ params["d_mid"])
        h = jnp.tanh(h @ params["b_top"])
        return jnp.mean((h @ params["a_out"] - y) ** 2)

    step, flush = overlapped_step(tx, loss=loss_with_probe)
    pending = jax.jit(jax.grad(loss_fn))(params, batch(0))
    params, state, pending, _ = step(params, state, pending, batch(1))  # warm: order learned
    jax.block_until_ready(pending)
    last = last_read(jax_mlpo.engine_of(state))
    with tier_faults(state) as plan:
        plan.hang("read", slot=last, limit_s=60)
        probe["plan"] = plan
        params, state, pending, _ = step(params, state, pending, batch(2))
        jax.block_until_ready((params, pending))
        assert ran_first_layer.is_set()
        assert held_when_it_ran == [1]  # the forward pass ran while that read was held
        assert "hung" in " ".join(plan.outcomes("read"))
    probe["plan"] = None
    flush(params, state, pending)
    jax_mlpo.close(state)


def test_a_tier_failing_beside_the_forward_pass_fails_clearly_and_resumes(tmp_path):
    """A write that fails while the update runs beside the forward pass: the step raises the
    tier's error, typed, the optimizer refuses to go on, and the last checkpoint resumes as
    the uninterrupted run."""
    config = file_config(tmp_path / "run", write_behind=False)
    tx = offloaded_adamw(config)
    params, state, _ = overlapped(tx, steps=2)  # two updates, the last flushed
    mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    mngr.save(2, args=jax_mlpo.checkpoint.OffloadSave({"params": params, "opt": state}))
    mngr.wait_until_finished()
    step, _ = overlapped_step(tx)
    pending = jax.jit(jax.grad(loss_fn))(params, batch(2))
    engine = jax_mlpo.engine_of(state)  # the step donates the state
    with tier_faults(state) as plan:
        plan.fail("write", nth=2, errno=errno.EIO)
        failing = pytest.raises(jax_mlpo.TierIOError, match="Input/output error")
        with failing, jax_mlpo.errors.typed():
            jax.block_until_ready(step(params, state, pending, batch(3)))
    assert engine.failed
    engine.close()
    tx = offloaded_adamw(config)
    target = {"params": make_params(), "opt": tx.init(make_params())}
    restored = mngr.restore(2, args=jax_mlpo.checkpoint.OffloadRestore(target))
    mngr.close()
    params, state, _ = overlapped(tx, steps=STEPS - 2, params=restored["params"],
                                  state=restored["opt"], start=2)  # fmt: skip
    jax_mlpo.close(state)
    expected, state, _ = plain(offloaded_adamw(file_config(tmp_path / "u")))
    jax_mlpo.close(state)
    assert_bits_equal(params, expected)


class TwoLayers(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = nnx.Linear(64, 128, rngs=rngs)
        self.second = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.second(jnp.tanh(self.first(x)))


def nnx_loss(model: TwoLayers, b: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = b
    return jnp.mean((model(x) - y) ** 2)


def nnx_run(tx, overlap: bool) -> Any:
    """nnx.Optimizer with nnx.jit: the plain step, or the overlapped step of docs/flax.md."""
    model = TwoLayers(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def plain_step(model, optimizer, b):
        grads = nnx.grad(nnx_loss)(model, b)
        optimizer.update(model, grads)

    @nnx.jit
    def first(model, b):
        return nnx.grad(nnx_loss)(model, b).to_pure_dict()

    @nnx.jit
    def step(model, optimizer, pending, b):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of(pure, b):
            nnx.replace_by_pure_dict(params, pure)
            return nnx_loss(nnx.merge(graphdef, params, rest), b)

        new, opt_state, grads, _ = jax_mlpo.overlapped_step(
            loss_of, optimizer.tx, params.to_pure_dict(), nnx.as_pure(optimizer.opt_state),
            pending, b, groups=2,
        )  # fmt: skip
        nnx.replace_by_pure_dict(params, new)
        nnx.update(model, params)
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
        optimizer.step[...] += 1
        return grads

    if not overlap:
        for i in range(STEPS):
            plain_step(model, optimizer, batch(i))
    else:
        pending = first(model, batch(0))
        for i in range(1, STEPS):
            pending = step(model, optimizer, pending, batch(i))

        @nnx.jit
        def flush(model, optimizer, pending):
            grads = nnx.state(model, nnx.Param)
            nnx.replace_by_pure_dict(grads, pending)
            optimizer.update(model, grads)

        flush(model, optimizer, pending)
    assert int(optimizer.step[...]) == STEPS
    return nnx.as_pure(nnx.state(model, nnx.Param)), optimizer


def test_nnx_optimizer_overlapped_follows_the_plain_loop_and_optax(tmp_path):
    expected, optimizer = nnx_run(offloaded_adamw(file_config(tmp_path / "a")), overlap=False)
    jax_mlpo.close(optimizer.opt_state)
    params, optimizer = nnx_run(offloaded_adamw(file_config(tmp_path / "b")), overlap=True)
    steps = jax_mlpo.metrics(optimizer.opt_state)
    assert len(steps) == STEPS and all(m.beside_s > 0 for m in steps[:-1])
    jax_mlpo.close(optimizer.opt_state)
    assert_bits_equal(params, expected)
    assert_close(params, nnx_run(optax.adamw(LR, weight_decay=WD), overlap=False)[0])


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(64)(jnp.tanh(nn.Dense(128)(x)))


def linen_run(tx, overlap: bool) -> train_state.TrainState:
    """A linen TrainState: apply_gradients, or the overlapped step and apply_gradients to
    flush."""
    model = Mlp()
    params = model.init(jax.random.key(0), batch(0)[0])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss(params, b):
        x, y = b
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    @jax.jit
    def plain_step(state, b):
        return state.apply_gradients(grads=jax.grad(loss)(state.params, b))

    @jax.jit
    def step(state, pending, b):
        params, opt_state, grads, _ = jax_mlpo.overlapped_step(
            loss, state.tx, state.params, state.opt_state, pending, b, groups=2
        )
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), grads

    if not overlap:
        for i in range(STEPS):
            state = plain_step(state, batch(i))
        return state
    pending = jax.jit(jax.grad(loss))(state.params, batch(0))
    for i in range(1, STEPS):
        state, pending = step(state, pending, batch(i))
    return jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, pending)


def test_linen_train_state_overlapped_follows_the_plain_loop_and_optax(tmp_path):
    expected = linen_run(offloaded_adamw(file_config(tmp_path / "a")), overlap=False)
    jax_mlpo.close(expected.opt_state)
    state = linen_run(offloaded_adamw(file_config(tmp_path / "b")), overlap=True)
    assert int(state.step) == STEPS
    assert all(m.beside_s > 0 for m in jax_mlpo.metrics(state.opt_state)[:-1])
    jax_mlpo.close(state.opt_state)
    assert_bits_equal(state.params, expected.params)
    assert_close(state.params, linen_run(optax.adamw(LR, weight_decay=WD), overlap=False).params)


def test_a_bf16_llama_runs_its_first_block_beside_the_last_subgroup(tmp_path):
    """A 6-block bf16 LLaMA, its new params materialized where the forward pass needs them:
    the read of the last subgroup in forward order (the head's) is held until the first
    block's forward pass has run, and that happens before the read ends. Had the forward pass
    waited for the whole update (a buffer of the calls reused by its temporaries), the read
    would have ended at its limit first."""
    from models.llama import Llama, LlamaConfig, _run_block

    config = LlamaConfig(vocab_size=256, hidden=128, layers=6, heads=4, kv_heads=2, ffn=384,
                         max_seq_len=64, param_dtype="bfloat16", dtype="bfloat16")  # fmt: skip
    graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    armed: dict[str, Any] = {"plan": None, "last": None}
    unfinished: list[bool] = []

    def first_block_ran(_):
        plan = armed["plan"]
        if plan is not None:
            started = any(e.op == "read" and e.slot == armed["last"] for e in plan.trace)
            unfinished.append(plan.hanging > 0 or not started)
            plan.release()

    def loss(p, tokens, probe=False):
        model = nnx.merge(graphdef, p)
        x = model.embed(tokens[:, :-1])
        for i, block in enumerate(model.blocks):
            x = _run_block(block, x)
            if probe and i == 0:
                jax.debug.callback(first_block_ran, x)
        logits = model.lm_head(model.final_norm(x)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def tokens(i: int) -> jax.Array:
        return jax.random.randint(jax.random.key(i), (4, 65), 0, 256)

    config = jax_mlpo.OffloadConfig(
        host_cache="1MiB", subgroup_size=16384, prefetch_depth=1, read_ahead=False,
        overlap_order="forward", tiers=[jax_mlpo.FileTier(str(tmp_path / "t"), sync=False)],
    )  # fmt: skip
    tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)
    state = tx.init(params)
    step = jax.jit(
        lambda p, s, g, b: jax_mlpo.overlapped_step(
            functools.partial(loss, probe=True), tx, p, s, g, b, groups=8
        ),
        donate_argnums=(0, 1, 2),
    )
    pending = jax.jit(jax.grad(loss))(params, tokens(0))
    params, state, pending, _ = step(params, state, pending, tokens(1))  # the order learned
    jax.block_until_ready(pending)
    engine = jax_mlpo.engine_of(state)
    armed["last"] = last_read(engine)
    with tier_faults(state) as plan:
        plan.hang("read", slot=armed["last"], limit_s=60)
        armed["plan"] = plan
        params, state, pending, _ = step(params, state, pending, tokens(2))
        jax.block_until_ready((params, pending))
        armed["plan"] = None
        assert "hung" in " ".join(plan.outcomes("read"))
    jax_mlpo.close(state)
    assert unfinished == [True]
