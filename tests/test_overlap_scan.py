"""The overlapped step on scanned layers: each row of a stacked leaf is updated inside the scan,
when the scan reaches it (jax_mlpo.engine.row_stream), exactly as the plain loop updates it.

Each test compares with the plain loop (forward and backward, then the update) of the same
optimizer, bit for bit, and with optax itself; and shows by order (a held tier read) that the
scan's first rows ran while the engine was still updating its last one.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.extend import core as jex_core
from test_overlap import (
    LR,
    SUB,
    WD,
    assert_bits_equal,
    assert_close,
    batch,
    file_config,
    offloaded_adamw,
    overlapped,
    overlapped_step,
    plain,
)

import jax_mlpo
from jax_mlpo.engine.layout import build_layout, stacked_runs
from jax_mlpo.engine.row_stream import DRAIN, RowBoards, rows_of_subgroups
from jax_mlpo.testing import tier_faults
from jax_mlpo.transforms.overlap import stacked_scans

LAYERS = 6
# This model against optax.adamw after 6 steps. jax_mlpo's update is optax's to float32
# rounding, but XLA:CPU fuses optax's own step (its update, with the gradients and the addition
# to the params) differently per instruction set: on an AVX2-only AMD EPYC the params are 1 ulp
# apart on 13-20% of the elements after step 1. Adam then amplifies an ulp where a gradient is
# near zero: 2.3e-6 in one of 8192 elements of "out" after 6 steps there (within 1e-6 on the
# AVX-512 machines).
OPTAX_TOL = 1e-5


def stacked_params() -> dict[str, jax.Array]:
    """Six layers of one kind stacked in one [layers, ...] leaf between an input and an output
    layer; each layer (64K elements) spans several subgroups."""
    keys = jax.random.split(jax.random.key(1), 3)
    shapes = {"in": (64, 128), "layers": (LAYERS, 128, 128), "out": (128, 64)}
    return {k: jax.random.normal(key, s) * 0.1
            for key, (k, s) in zip(keys, shapes.items(), strict=True)}  # fmt: skip


def scanned_loss(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    h = jnp.tanh(x @ params["in"])
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, params["layers"])
    return jnp.mean((h @ params["out"] - y) ** 2)


def receives_in_scan(tx, loss, params, b=None) -> tuple[int, int]:
    """How many receives the traced overlapped step has inside a scan's body, and outside."""
    state = tx.init(params)
    b = batch(0) if b is None else b
    jaxpr = jax.make_jaxpr(
        lambda p, s, g: jax_mlpo.overlapped_step(loss, tx, p, s, g, b, groups=4)
    )(params, state, params)
    jax_mlpo.close(state)
    found = {True: 0, False: 0}

    def walk(eqns, in_scan: bool) -> None:
        for eqn in eqns:
            if "jax_mlpo_host_receive" in str(eqn.params.get("target_name", "")):
                found[in_scan] += 1
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(getattr(sub, "jaxpr", sub).eqns, in_scan or eqn.primitive.name == "scan")

    walk(jaxpr.jaxpr.eqns, False)
    return found[True], found[False]


def test_a_scan_over_stacked_params_is_found():
    params = stacked_params()
    scans = stacked_scans(jax.make_jaxpr(scanned_loss)(params, batch(0)).jaxpr, 3)
    assert [(s.length, s.leaves) for s in scans.values()] == [(LAYERS, (1,))]  # "layers"


@pytest.mark.parametrize("clip", ["none", "max_grad_norm"])
def test_rows_are_received_in_the_scan_bit_for_bit_the_plain_loop(clip, tmp_path):
    kwargs = {"max_grad_norm": 1.0} if clip == "max_grad_norm" else {}
    params = stacked_params()
    tx = offloaded_adamw(file_config(tmp_path / "a"), **kwargs)
    expected, state, expected_losses = plain(tx, params=params, loss_of=scanned_loss)
    jax_mlpo.close(state)
    tx = offloaded_adamw(file_config(tmp_path / "b"), **kwargs)
    assert receives_in_scan(tx, scanned_loss, params) == (1, 0)
    got, state, losses = overlapped(tx, params=stacked_params(), loss_of=scanned_loss)
    assert all(m.beside_s > 0 for m in jax_mlpo.metrics(state)[:-1])
    jax_mlpo.close(state)
    assert_bits_equal(got, expected)
    assert losses == expected_losses
    reference = optax.adamw(LR, weight_decay=WD)
    if kwargs:
        reference = optax.chain(optax.clip_by_global_norm(1.0), reference)
    assert_close(got, plain(reference, params=stacked_params(), loss_of=scanned_loss)[0],
                 tol=OPTAX_TOL)  # fmt: skip


def test_a_transformation_after_jax_mlpo_takes_the_stack_whole(tmp_path):
    """A chain that scales jax_mlpo's updates: the scan must see the scaled update, so the stack
    is drained (every row taken at once) and applied where the scan first needs it."""
    params = stacked_params()

    def tx_of(path: Path) -> optax.GradientTransformation:
        return optax.chain(offloaded_adamw(file_config(path)), optax.scale(0.5))

    expected, state, _ = plain(tx_of(tmp_path / "a"), params=params, loss_of=scanned_loss)
    jax_mlpo.close(state)
    tx = tx_of(tmp_path / "b")
    assert receives_in_scan(tx, scanned_loss, params) == (0, 1)  # the drain
    got, state, _ = overlapped(tx, params=stacked_params(), loss_of=scanned_loss)
    jax_mlpo.close(state)
    assert_bits_equal(got, expected)


def last_row_read(state) -> int:
    """The last subgroup of the stack (the "layers" leaf, index 1) that the next update reads
    (what the last update kept it does not read)."""
    engine = jax_mlpo.engine_of(state)
    holding = {sg.index for sg in engine.layout.subgroups for seg in sg.segments if seg.leaf == 1}
    read = [i for i in engine.order.of_step(engine.step_count) if i in holding - engine.order.kept]
    assert len(read) > 1  # a row after the first
    return read[-1]


def test_the_first_rows_run_while_the_last_row_is_updated(tmp_path):
    """The read of the last subgroup of the stack the update reads is held until the scan's
    first iteration has run: had the scan waited for the whole stack's update, the hold would end at
    its limit before the first iteration ran, and the test fail."""
    tx = offloaded_adamw(file_config(tmp_path, read_ahead=False, overlap_order="forward"))
    params = stacked_params()
    state = tx.init(params)
    held_when_it_ran: list[int] = []
    probe: dict[str, Any] = {"plan": None}

    def first_row_ran(_):
        plan = probe["plan"]
        if plan is not None and not held_when_it_ran:
            deadline = time.monotonic() + 30
            while plan.hanging == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            held_when_it_ran.append(plan.hanging)
            plan.release()

    def loss_with_probe(params, b):
        x, y = b
        h = jnp.tanh(x @ params["in"])

        def layer(h, w):
            h = jnp.tanh(h @ w)
            jax.debug.callback(first_row_ran, h[0, 0])
            return h, None

        h, _ = jax.lax.scan(layer, h, params["layers"])
        return jnp.mean((h @ params["out"] - y) ** 2)

    step, flush = overlapped_step(tx, loss=loss_with_probe)
    pending = jax.jit(jax.grad(scanned_loss))(params, batch(0))
    params, state, pending, _ = step(params, state, pending, batch(1))  # the order learned
    jax.block_until_ready(pending)
    last = last_row_read(state)
    with tier_faults(state) as plan:
        plan.hang("read", slot=last, limit_s=60)
        probe["plan"] = plan
        params, state, pending, _ = step(params, state, pending, batch(2))
        jax.block_until_ready((params, pending))
        probe["plan"] = None
        assert held_when_it_ran == [1]  # the first row ran while a later row's read was held
        assert "hung" in " ".join(plan.outcomes("read"))
    flush(params, state, pending)
    jax_mlpo.close(state)


def test_a_tier_failing_inside_the_scan_fails_clearly_and_resumes(tmp_path):
    """A write that fails while the scan receives its rows: the step raises the tier's error,
    typed (no receive waits for ever), and the last checkpoint resumes as the uninterrupted
    run."""
    config = file_config(tmp_path / "run", write_behind=False)
    tx = offloaded_adamw(config)
    params, state, _ = overlapped(tx, steps=2, params=stacked_params(), loss_of=scanned_loss)
    mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    mngr.save(2, args=jax_mlpo.checkpoint.OffloadSave({"params": params, "opt": state}))
    mngr.wait_until_finished()
    step, _ = overlapped_step(tx, loss=scanned_loss)
    pending = jax.jit(jax.grad(scanned_loss))(params, batch(2))
    engine = jax_mlpo.engine_of(state)
    with tier_faults(state) as plan:
        plan.fail("write", nth=2, errno=errno.EIO)
        failing = pytest.raises(jax_mlpo.TierIOError, match="Input/output error")
        with failing, jax_mlpo.errors.typed():
            jax.block_until_ready(step(params, state, pending, batch(3)))
    assert engine.failed
    engine.close()
    tx = offloaded_adamw(config)
    target = {"params": stacked_params(), "opt": tx.init(stacked_params())}
    restored = mngr.restore(2, args=jax_mlpo.checkpoint.OffloadRestore(target))
    mngr.close()
    got, state, _ = overlapped(tx, steps=4, params=restored["params"], state=restored["opt"],
                               start=2, loss_of=scanned_loss)  # fmt: skip
    jax_mlpo.close(state)
    tx = offloaded_adamw(file_config(tmp_path / "u"))
    expected, state, _ = plain(tx, params=stacked_params(), loss_of=scanned_loss)
    jax_mlpo.close(state)
    assert_bits_equal(got, expected)


def test_a_scanned_llama_follows_the_plain_loop_and_optax(tmp_path):
    """``LlamaConfig(scan_layers=True)``: the blocks' stacked params (9 leaves) are one send,
    received row by row inside the model's own scan."""
    from models.llama import Llama, LlamaConfig, loss_fn

    config = LlamaConfig(vocab_size=128, hidden=64, layers=4, heads=4, kv_heads=2, ffn=128,
                         max_seq_len=32, scan_layers=True)  # fmt: skip
    graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)

    def loss(p, b):
        return loss_fn(nnx.merge(graphdef, p), b[0])

    def tokens(i: int) -> tuple[jax.Array, jax.Array]:
        return (jax.random.randint(jax.random.key(i), (4, 17), 0, 128), jnp.zeros(()))

    def run(tx, overlap: bool):
        state = tx.init(params)
        p = params
        if not overlap:
            step = jax.jit(lambda p, s, b: _plain_step(tx, loss, p, s, b))
            for i in range(4):
                p, state = step(p, state, tokens(i))
            return p, state
        step = jax.jit(lambda p, s, g, b: jax_mlpo.overlapped_step(loss, tx, p, s, g, b))
        pending = jax.jit(jax.grad(loss))(p, tokens(0))
        for i in range(1, 4):
            p, state, pending, _ = step(p, state, pending, tokens(i))
        updates, state = jax.jit(tx.update)(pending, state, p)
        return optax.apply_updates(p, updates), state

    def offloaded(path: str):
        tiers = [jax_mlpo.FileTier(str(tmp_path / path), sync=False)]
        cfg = jax_mlpo.OffloadConfig(host_cache="256KiB", subgroup_size=SUB, prefetch_depth=1,
                                     tiers=tiers)  # fmt: skip
        return jax_mlpo.adamw(1e-3, weight_decay=0.1, max_grad_norm=1.0, offload=cfg)

    tx = offloaded("b")
    assert receives_in_scan(tx, loss, params, tokens(0)) == (1, 0)
    expected, state = run(offloaded("a"), overlap=False)
    jax_mlpo.close(state)
    got, state = run(tx, overlap=True)
    jax_mlpo.close(state)
    assert_bits_equal(got, expected)
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    assert_close(got, run(reference, overlap=False)[0])


def _plain_step(tx, loss, params, state, b):
    grads = jax.grad(loss)(params, b)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


class Block(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.linear(x))


class ScannedMLP(nnx.Module):
    """Blocks made with ``nnx.vmap`` and run with ``nnx.scan``, as Flax's guide writes them."""

    def __init__(self, dim: int, layers: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Linear(64, dim, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Block:
            return Block(dim, rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(dim, 64, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return self.head(run(jnp.tanh(self.embed(x)), self.blocks))


def test_an_nnx_scan_model_follows_the_plain_loop_and_optax(tmp_path):
    graphdef, state = nnx.split(ScannedMLP(128, LAYERS, nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(state)

    def fresh() -> Any:  # the overlapped step donates its params
        return jax.tree.map(jnp.copy, params)

    def loss(p, b):
        x, y = b
        return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

    tx = offloaded_adamw(file_config(tmp_path / "b"))
    assert receives_in_scan(tx, loss, params) == (1, 0)
    expected, state, expected_losses = plain(offloaded_adamw(file_config(tmp_path / "a")),
                                             params=fresh(), loss_of=loss)  # fmt: skip
    jax_mlpo.close(state)
    got, state, losses = overlapped(tx, params=fresh(), loss_of=loss)
    jax_mlpo.close(state)
    assert_bits_equal(got, expected)
    assert losses == expected_losses
    assert_close(got, plain(optax.adamw(LR, weight_decay=WD), params=fresh(), loss_of=loss)[0])


def test_a_row_board_hands_each_row_over_once_it_is_updated():
    """A receive before its send and before its row waits; one after its row is served at
    once (the row of the param, then of its update); the send completes when every row was
    taken; a drain takes them all; a failed round fails its receives and its send."""
    done: list[tuple[str, BaseException | None]] = []
    boards = RowBoards(lambda c, e: done.append((c, e)))
    params = [np.arange(6, dtype=np.float32)]
    updates = [np.full(6, 0.5, np.float32)]

    def rows() -> list[np.ndarray]:
        return [np.zeros(2, np.float32), np.zeros(2, np.float32)]

    early = rows()
    assert boards.receive(7, 0, early, "r0") is True  # before the send: waits
    boards.sent(7, 3, params, updates, "send")
    boards.updated(7, 0)
    np.testing.assert_array_equal(early, [[0.0, 1.0], [0.5, 0.5]])
    boards.updated(7, 1)
    late = rows()
    assert boards.receive(7, 1, late, "r1") is False  # updated already: served at once
    np.testing.assert_array_equal(late, [[2.0, 3.0], [0.5, 0.5]])
    assert done == [("r0", None)]
    assert boards.receive(7, 2, rows(), "r2") is True
    boards.updated(7, 2)
    assert done == [("r0", None), ("r2", None), ("send", None)]
    boards.sent(7, 3, params, updates, "send2")  # the next round: a new board
    assert boards.receive(7, DRAIN, [np.zeros((), np.int32)], "drain") is True
    for row in range(3):
        boards.updated(7, row)
    assert done[-2:] == [("drain", None), ("send2", None)]
    boards.sent(7, 3, params, updates, "send3")
    with pytest.raises(RuntimeError, match="in flight at once"):  # rows would mix
        boards.sent(7, 3, params, updates, "another state's send")
    assert boards.receive(7, 0, rows(), "w") is True
    error = OSError(errno.EIO, "tier lost")
    boards.fail(7, error)
    assert done[-2:] == [("w", error), ("send3", error)]
    with pytest.raises(OSError, match="tier lost"):
        boards.receive(7, 1, rows(), "after")
    boards.sent(7, 3, params, updates, "send4")  # a receive that cannot take its row
    boards.updated(7, 0)
    with pytest.raises(RuntimeError, match="a receive of 1 rows from a send of 1 leaves"):
        boards.receive(7, 0, rows()[:1], "short")
    assert done[-1][0] == "send4" and isinstance(done[-1][1], RuntimeError)  # not left pending


def test_stacked_layers_are_laid_out_row_by_row():
    """A scanned LLaMA's block leaves share their leading [layers] axis: their subgroups hold
    whole layers (row 0 of each leaf, then row 1...); an unrolled one's leaves stay whole."""
    from models.llama import Llama, LlamaConfig

    def params_of(scan: bool) -> Any:
        config = LlamaConfig(vocab_size=128, hidden=64, layers=4, heads=4, kv_heads=2, ffn=128,
                             max_seq_len=32, scan_layers=scan)  # fmt: skip
        model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    scanned = params_of(True)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(scanned)[0]]
    runs = stacked_runs(scanned)
    assert [[names[i] for i in run] for run in runs] == [[n for n in names if "blocks" in n]]
    layout = build_layout(scanned, 64 * 64 * 16, by_row=True)
    first = layout.subgroups[0].segments
    assert [(s.leaf, s.leaf_start) for s in first[: len(runs[0])]] == [(i, 0) for i in runs[0]]
    rows = rows_of_subgroups(layout, [4 if i in runs[0] else 0 for i in range(len(names))])
    assert rows[0] == {0, 1} and max(rows[max(rows)]) == 3  # layer by layer
    assert stacked_runs(params_of(False)) == []
    leaf_major = build_layout(scanned, 64 * 64 * 16)
    assert len(leaf_major.subgroups) == len(layout.subgroups)
