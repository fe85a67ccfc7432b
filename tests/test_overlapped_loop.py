"""jax_mlpo.OverlappedLoop: the overlapped loop of docs/flax.md, run as written, and its corner
cases, each against the plain loop bit for bit.

docs/flax.md's three loops are diffs from the plain loop: each test here takes both sides of
one from the file and runs them on the same model, batches, optimizer and a real checkpoint
manager (the test fails if the docs change so that either side no longer runs or trains
different params). The corner cases: steps a multiple of the save interval, a save at every
step, an evaluation between steps, an error in the loop body then the flush, ``has_aux``, a loop
dropped with an update pending, and the choice of ``overlap="auto"``.
"""

from __future__ import annotations

import gc
import re
import sys
import types
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

DOCS = Path(__file__).resolve().parents[1] / "docs" / "flax.md"
SUB = 4096
LR, WD = 1e-2, 0.1
STEPS, SAVE_EVERY = 6, 3  # the steps a multiple of the save interval
TRIAL_STEPS = 8  # overlap="auto": 3 plain, 1 gradients only, 1 compiling, 2 timed, 1 after


def doc_diff(name: str) -> tuple[str, str]:
    """The plain and the overlapped side of docs/flax.md's diff marked ``<!-- loop: name -->``."""
    text = DOCS.read_text()
    found = re.search(rf"<!-- loop: {name} -->\n```diff\n(.*?)\n```", text, re.S)
    assert found, f"docs/flax.md has no diff marked 'loop: {name}'"
    plain, over = [], []
    for line in found.group(1).split("\n"):
        mark, code = line[:1], line[1:]
        assert mark in " -+" or not line, f"not a diff line: {line!r}"
        if mark in " -" or not line:
            plain.append(code)
        if mark in " +" or not line:
            over.append(code)
    return "\n".join(plain), "\n".join(over)


def changed_lines(name: str) -> int:
    text = DOCS.read_text()
    body = re.search(rf"<!-- loop: {name} -->\n```diff\n(.*?)\n```", text, re.S).group(1)
    return sum(1 for line in body.split("\n") if line[:1] and line[:1] in "+-")


def tier_config(path: Path) -> jax_mlpo.OffloadConfig:
    """One file tier; the host cache holds three of the subgroups' blobs."""
    path.mkdir(parents=True, exist_ok=True)
    return jax_mlpo.OffloadConfig(
        host_cache=3 * 8 * SUB, subgroup_size=SUB, prefetch_depth=1, placement="even",
        tiers=[jax_mlpo.FileTier(str(path / "t0"), sync=False)],
    )  # fmt: skip


def offloaded_adamw(path: Path) -> optax.GradientTransformation:
    return jax_mlpo.adamw(LR, weight_decay=WD, offload=tier_config(path))


def batches(n: int = STEPS) -> list[tuple[jax.Array, jax.Array]]:
    out = []
    for i in range(n):
        key = jax.random.key(100 + i)
        out.append((jax.random.normal(key, (32, 64)),
                    jax.random.normal(jax.random.fold_in(key, 1), (32, 64))))  # fmt: skip
    return out


def make_params() -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = {"c_in": (64, 128), "d_mid": (128, 128), "a_out": (128, 64)}
    return {k: jax.random.normal(key, s) * 0.1
            for key, (k, s) in zip(keys, shapes.items(), strict=True)}  # fmt: skip


def dict_loss(params: dict[str, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[Any, Any]:
    x, y = b
    h = jnp.tanh(x @ params["c_in"])
    h = jnp.tanh(h @ params["d_mid"])
    err = h @ params["a_out"] - y
    return jnp.mean(err**2), {"max_err": jnp.max(jnp.abs(err))}


class DropoutMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = nnx.Linear(64, 128, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.second = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.second(self.drop(jnp.tanh(self.first(x))))


def nnx_loss(model: DropoutMlp, b: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = b
    return jnp.mean((model(x) - y) ** 2)


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        h = nn.Dropout(0.2, deterministic=not train)(jnp.tanh(nn.Dense(128)(x)))
        return nn.Dense(64)(h)


def assert_bits_equal(a: Any, b: Any) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert np.array_equal(_bits(x), _bits(y)), "not bit for bit"


def _bits(x: Any) -> np.ndarray:
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


class ForcedOverlap(jax_mlpo.OverlappedLoop):
    """OverlappedLoop always overlapped, in two groups: the docs' code as written, with the
    choice that ``overlap="auto"`` makes by timing fixed."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **{**kw, "overlap": True, "groups": 2})

    @staticmethod
    def nnx(step_fn: Any = None, **kw: Any) -> Any:
        return jax_mlpo.OverlappedLoop.nnx(step_fn, **{**kw, "overlap": True, "groups": 2})


# the sides of a docs diff: the plain loop, the overlapped one as written (overlap="auto"),
# and the overlapped one with the overlap forced on
SIDES = ("plain", "auto", "overlapped")


def run_doc(code: str, names: dict[str, Any], ckpt: Path, side: str) -> dict[str, Any]:
    """Runs one side of a docs diff with a real orbax manager; its namespace afterwards."""
    module = jax_mlpo
    if side == "overlapped":
        public = {k: getattr(jax_mlpo, k) for k in dir(jax_mlpo) if not k.startswith("_")}
        module = types.SimpleNamespace(**{**public, "OverlappedLoop": ForcedOverlap})
    ns = {"jax": jax, "jnp": jnp, "optax": optax, "nnx": nnx, "jax_mlpo": module,
          "batches": batches(), "save_every": SAVE_EVERY, **names}  # fmt: skip
    with ocp.CheckpointManager(ckpt) as mngr:
        ns["mngr"] = mngr
        exec(compile(code, "docs/flax.md", "exec"), ns)
        mngr.wait_until_finished()
        ns["saved_steps"] = sorted(mngr.all_steps())
    return ns


def test_the_docs_optax_loop_runs_and_trains_the_plain_loops_params(tmp_path):
    plain_code, over_code = doc_diff("optax")
    runs = {}
    for side in SIDES:
        tx = offloaded_adamw(tmp_path / side)
        params = make_params()
        code = plain_code if side == "plain" else over_code
        names = {"loss_fn": dict_loss, "tx": tx, "params": params, "opt_state": tx.init(params)}
        ns = run_doc(code, names, tmp_path / f"ckpt-{side}", side)
        runs[side] = ns
        assert ns["saved_steps"] == [SAVE_EVERY, 2 * SAVE_EVERY]
    for side in SIDES[1:]:
        assert_bits_equal(runs[side]["params"], runs["plain"]["params"])
        assert_bits_equal(runs[side]["metrics"], runs["plain"]["metrics"])
        assert float(runs[side]["loss"]) == float(runs["plain"]["loss"])
    assert any(m.beside_s > 0 for m in jax_mlpo.metrics(runs["overlapped"]["opt_state"]))
    for ns in runs.values():
        jax_mlpo.close(ns["opt_state"])


def test_the_docs_nnx_loop_changes_four_lines_and_trains_the_plain_loops_params(tmp_path):
    plain_code, over_code = doc_diff("nnx")
    runs = {}
    for side in SIDES:
        model = DropoutMlp(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, offloaded_adamw(tmp_path / side), wrt=nnx.Param)
        code = plain_code if side == "plain" else over_code
        ns = run_doc(code, {"loss_fn": nnx_loss, "model": model, "optimizer": optimizer},
                     tmp_path / f"ckpt-{side}", side)  # fmt: skip
        runs[side] = ns
        assert ns["saved_steps"] == [SAVE_EVERY, 2 * SAVE_EVERY]
        assert int(optimizer.step[...]) == STEPS
    for side in SIDES[1:]:  # the params and the dropout's rng state
        assert_bits_equal(nnx.state(runs[side]["model"]), nnx.state(runs["plain"]["model"]))
    steps = jax_mlpo.metrics(runs["overlapped"]["optimizer"].opt_state)
    assert any(m.beside_s > 0 for m in steps)
    for ns in runs.values():
        jax_mlpo.close(ns["optimizer"].opt_state)
    # the decorator, and a flush before the save and at the end
    assert changed_lines("nnx") <= 6


def test_the_docs_linen_loop_runs_and_trains_the_plain_loops_params(tmp_path):
    plain_code, over_code = doc_diff("linen")
    model = LinenMlp()
    runs = {}
    for side in SIDES:
        code = plain_code if side == "plain" else over_code
        params = model.init(jax.random.key(0), batches()[0][0], train=False)["params"]
        state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                              tx=offloaded_adamw(tmp_path / side))  # fmt: skip

        def loss_fn(params, b, key):
            x, y = b
            out = model.apply({"params": params}, x, rngs={"dropout": key})
            return jnp.mean((out - y) ** 2)

        ns = run_doc(code, {"loss_fn": loss_fn, "state": state, "key": jax.random.key(7)},
                     tmp_path / f"ckpt-{side}", side)  # fmt: skip
        runs[side] = ns
        assert ns["saved_steps"] == [SAVE_EVERY, 2 * SAVE_EVERY]
        assert int(ns["state"].step) == STEPS
    for side in SIDES[1:]:
        assert_bits_equal(runs[side]["state"].params, runs["plain"]["state"].params)
    assert any(m.beside_s > 0 for m in jax_mlpo.metrics(runs["overlapped"]["state"].opt_state))
    for ns in runs.values():
        jax_mlpo.close(ns["state"].opt_state)


# -- the corner cases, on a plain optax loop -------------------------------------------------


def plain_run(tx, steps: int) -> list[Any]:
    """The plain loop's params after each step (a copy per step)."""
    params = make_params()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, b):
        (loss, _), grads = jax.value_and_grad(dict_loss, has_aux=True)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    out = []
    for b in batches(steps):
        params, opt_state = step(params, opt_state, b)
        out.append(jax.tree.map(np.asarray, params))
    jax_mlpo.close(opt_state)
    return out


@pytest.fixture(scope="module")
def plain_params(tmp_path_factory) -> list[Any]:
    return plain_run(offloaded_adamw(tmp_path_factory.mktemp("plain")), TRIAL_STEPS)


def new_loop(path: Path, **kw: Any) -> jax_mlpo.OverlappedLoop:
    tx = offloaded_adamw(path)
    params = make_params()
    kw = {"overlap": True, "groups": 2, **kw}
    return jax_mlpo.OverlappedLoop(dict_loss, tx, params, tx.init(params), has_aux=True, **kw)


def test_a_save_at_every_step_and_the_end_each_the_plain_loops(tmp_path, plain_params):
    """Save interval 1: each step flushes, so the next only computes gradients; the params at
    each save are the plain loop's at that step, and the end's flush has nothing left."""
    loop = new_loop(tmp_path)
    for i, b in enumerate(batches()):
        loop.step(b)
        assert_bits_equal(loop.params, plain_params[i])  # a flush, as a save makes
        assert not loop.pending
    loop.flush()  # nothing pending: nothing to do, no error
    assert len(jax_mlpo.metrics(loop.opt_state)) == STEPS
    jax_mlpo.close(loop.opt_state)


def test_steps_a_multiple_of_the_save_interval_and_an_evaluation_between(tmp_path, plain_params):
    """Saves at 3 and 6 of 6 steps (the last save flushed: the end has nothing pending), and an
    evaluation after step 2 that reads the flushed params, between two overlapped steps."""
    loop = new_loop(tmp_path)
    with loop:
        for step, b in enumerate(batches(), 1):
            loop.step(b)
            if step == 2:  # an evaluation: the params of the plain loop's step 2
                assert_bits_equal(loop.params, plain_params[1])
            if step % SAVE_EVERY == 0:
                assert_bits_equal(loop.params, plain_params[step - 1])
    assert not loop.pending
    assert_bits_equal(loop.params, plain_params[STEPS - 1])
    steps = jax_mlpo.metrics(loop.opt_state)
    # updates 1, 4 and 5 ran beside a forward pass; 2, 3 and 6 were flushes
    assert len(steps) == STEPS and sum(m.beside_s > 0 for m in steps) >= 2
    assert all(0 <= m.beside_s <= m.total_s for m in steps)  # one span, one clock
    jax_mlpo.close(loop.opt_state)


def test_an_error_in_the_loop_body_then_the_flush_keeps_the_last_step(tmp_path, plain_params):
    """An error raised between steps (a data loader's, say) leaves the last step's update
    pending: leaving ``with`` applies it, so the params are the plain loop's at that step."""
    loop = new_loop(tmp_path)
    with pytest.raises(KeyError, match="a data error"), loop:
        for step, b in enumerate(batches(), 1):
            loop.step(b)
            if step == 4:
                assert loop.pending
                raise KeyError("a data error")
    assert not loop.pending
    assert_bits_equal(loop.params, plain_params[3])
    # and the run goes on from there, as the plain loop would
    loop.step(batches()[4])
    assert_bits_equal(loop.params, plain_params[4])
    jax_mlpo.close(loop.opt_state)


def test_a_bad_batch_inside_the_step_loses_nothing(tmp_path, plain_params):
    """A step that fails before its program runs (a batch of the wrong shape) consumed
    nothing: the pending update is still there, and flushes."""
    loop = new_loop(tmp_path)
    for b in batches(3):
        loop.step(b)
    with pytest.raises(TypeError):
        loop.step((jnp.zeros((32, 5)), jnp.zeros((32, 64))))
    assert loop.pending
    assert_bits_equal(loop.params, plain_params[2])
    jax_mlpo.close(loop.opt_state)


def test_has_aux_gives_the_plain_steps_loss_and_aux(tmp_path, plain_params):
    """Step k's loss and aux are the plain step's: at the params after k - 1 updates."""
    loop = new_loop(tmp_path)
    at = [make_params()] + plain_params
    for k, b in enumerate(batches(4)):
        loss, aux = loop.step(b)
        want_loss, want_aux = jax.jit(dict_loss)(at[k], b)
        assert float(loss) == float(want_loss)
        assert_bits_equal(aux, want_aux)
    jax_mlpo.close(loop.opt_state)


def test_a_loop_dropped_with_an_update_pending_reports_it(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    loop = new_loop(tmp_path)
    for b in batches(2):
        loop.step(b)
    assert loop.pending
    opt_state = loop._opt_state
    del loop
    gc.collect()
    assert len(seen) == 1 and isinstance(seen[0], jax_mlpo.PendingUpdateError)
    assert "flush" in str(seen[0])
    jax_mlpo.close(opt_state)


def test_an_nnx_model_refuses_a_read_while_an_update_is_pending(tmp_path):
    model = DropoutMlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, offloaded_adamw(tmp_path), wrt=nnx.Param)

    @jax_mlpo.OverlappedLoop.nnx(overlap=True, groups=2)
    def train_step(model, optimizer, b):
        optimizer.update(model, nnx.grad(nnx_loss)(model, b))

    for b in batches(2):
        train_step(model, optimizer, b)
    with pytest.raises((RuntimeError, ValueError), match="deleted"):
        model(batches()[0][0])
    train_step.flush()
    model(batches()[0][0])  # readable again
    other = DropoutMlp(nnx.Rngs(1))
    with pytest.raises(jax_mlpo.PendingUpdateError, match="another model"):
        train_step(other, optimizer, batches()[0])
    jax_mlpo.close(optimizer.opt_state)


def test_auto_runs_the_plain_step_where_two_groups_cannot_pay(tmp_path, plain_params):
    """The test's update (33K elements) is too small for two calls to each carry ten times a
    call's cost: ``overlap="auto"`` runs the plain step, never compiling the overlapped one."""
    from jax_mlpo.transforms import overlap_cost

    elements = sum(int(np.size(x)) for x in jax.tree.leaves(make_params()))
    assert overlap_cost.auto_groups(elements) == 1
    loop = new_loop(tmp_path, overlap="auto", groups="auto")
    for i, b in enumerate(batches()):
        loop.step(b)
        assert not loop.pending  # the plain step: nothing left pending
        assert_bits_equal(loop.params, plain_params[i])
    assert loop.overlapped is False
    assert all(m.beside_s == 0 for m in jax_mlpo.metrics(loop.opt_state))
    jax_mlpo.close(loop.opt_state)


def test_auto_times_both_steps_and_keeps_the_plain_loops_params(tmp_path, plain_params):
    """Where two groups can pay (given here), ``overlap="auto"`` times the plain and the
    overlapped step once compiled and keeps one; the params are the plain loop's either way."""
    loop = new_loop(tmp_path, overlap="auto", groups=2)
    for b in batches(TRIAL_STEPS):
        loop.step(b)
    assert loop.overlapped in (True, False)
    trial = loop._trial
    assert len(trial.times[False]) == trial.rounds and len(trial.times[True]) == trial.rounds
    assert_bits_equal(loop.params, plain_params[TRIAL_STEPS - 1])
    jax_mlpo.close(loop.opt_state)


def nnx_plain_state(tmp_path: Path, steps: int) -> Any:
    """The plain NNX loop's model state (params and dropout rngs) after ``steps`` steps."""
    model = DropoutMlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, offloaded_adamw(tmp_path), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, b):
        optimizer.update(model, nnx.grad(nnx_loss)(model, b))

    for b in batches(steps):
        train_step(model, optimizer, b)
    jax_mlpo.close(optimizer.opt_state)
    return nnx.state(model)


def test_an_nnx_step_left_by_an_error_flushes_and_goes_on(tmp_path):
    """An error in the loop body after step 4: leaving ``with train_step`` applies step 4's
    update, the model is the plain loop's at step 4, and the run goes on to step 5 as the plain
    loop does, its optimizer's step counting every update."""
    model = DropoutMlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, offloaded_adamw(tmp_path / "b"), wrt=nnx.Param)

    @jax_mlpo.OverlappedLoop.nnx(overlap=True, groups=2)
    def train_step(model, optimizer, b):
        loss, grads = nnx.value_and_grad(nnx_loss)(model, b)
        optimizer.update(model, grads)
        return loss

    with pytest.raises(KeyError), train_step:
        for step, b in enumerate(batches(), 1):
            train_step(model, optimizer, b)
            if step == 4:
                raise KeyError("a data error")
    assert not train_step.pending and int(optimizer.step[...]) == 4
    assert_bits_equal(nnx.state(model), nnx_plain_state(tmp_path / "a4", 4))
    train_step(model, optimizer, batches()[4])
    train_step.flush()
    assert int(optimizer.step[...]) == 5
    assert_bits_equal(nnx.state(model), nnx_plain_state(tmp_path / "a5", 5))
    assert all(0 <= m.beside_s <= m.total_s for m in jax_mlpo.metrics(optimizer.opt_state))
    jax_mlpo.close(optimizer.opt_state)


def test_an_nnx_step_that_uses_the_optimizer_otherwise_is_refused(tmp_path):
    model = DropoutMlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, offloaded_adamw(tmp_path), wrt=nnx.Param)

    @jax_mlpo.OverlappedLoop.nnx(overlap=True, groups=2)
    def reads_the_step(model, optimizer, b):
        optimizer.update(model, nnx.grad(nnx_loss)(model, b))
        return optimizer.step[...]

    with pytest.raises(AttributeError, match=r"only optimizer.update.*optimizer.step"):
        reads_the_step(model, optimizer, batches()[0])

    @jax_mlpo.OverlappedLoop.nnx(overlap=True, groups=2)
    def updates_twice(model, optimizer, b):
        optimizer.update(model, nnx.grad(nnx_loss)(model, b))
        optimizer.update(model, nnx.grad(nnx_loss)(model, b))

    with pytest.raises(ValueError, match="once; it called it 2 times"):
        updates_twice(model, optimizer, batches()[0])
    model(batches()[0][0])  # nothing was taken: the model is readable
    jax_mlpo.close(optimizer.opt_state)


def test_an_nnx_step_too_small_to_split_runs_as_nnx_jit(tmp_path):
    """``overlap="auto"`` on the test's small model: the plain step (nnx.jit of the user's),
    nothing pending after a step, the plain loop's state."""
    from jax_mlpo.transforms import overlap_cost

    model = DropoutMlp(nnx.Rngs(0))
    elements = sum(int(np.size(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert overlap_cost.auto_groups(elements) == 1  # 17K elements: one group pays at most
    optimizer = nnx.Optimizer(model, offloaded_adamw(tmp_path / "b"), wrt=nnx.Param)

    @jax_mlpo.OverlappedLoop.nnx
    def train_step(model, optimizer, b):
        optimizer.update(model, nnx.grad(nnx_loss)(model, b))

    for b in batches(3):
        train_step(model, optimizer, b)
        assert not train_step.pending
    assert train_step.overlapped is False
    assert_bits_equal(nnx.state(model), nnx_plain_state(tmp_path / "a", 3))
    jax_mlpo.close(optimizer.opt_state)


def test_groups_carry_ten_times_a_calls_cost_each():
    from jax_mlpo.transforms import overlap_cost

    # 1 us an element, 100 us a call: a group needs 1 ms of work, 1000 elements
    assert overlap_cost.auto_groups(999, 1e-6, 1e-4) == 1
    assert overlap_cost.auto_groups(2_500, 1e-6, 1e-4) == 2
    assert overlap_cost.auto_groups(10**6, 1e-6, 1e-4) == overlap_cost.MAX_GROUPS
    assert not overlap_cost.worth_trying([10**6], 2)  # one leaf: one group whatever is asked
    assert overlap_cost.worth_trying([10, 10], 2) and not overlap_cost.worth_trying([10, 10], 1)


def test_the_trial_skips_compiling_runs_and_steps_without_an_update():
    from jax_mlpo.transforms import overlap_cost

    trial = overlap_cost.OverlapTrial(rounds=2)
    order = []
    for seconds in (9.0, 1.0, 1.2):  # the plain step: compiled, then two timed runs
        order.append(trial.next_overlapped())
        trial.record(False, seconds)
    order.append(trial.next_overlapped())
    trial.record(True, 5.0, applied_update=False)  # gradients only: nothing pending before
    trial.record(True, 9.0)  # the overlapped program compiled
    assert trial.overlap is None
    trial.record(True, 0.9)
    trial.record(True, 1.1)
    assert order == [False, False, False, True]
    assert trial.times == {False: [1.0, 1.2], True: [0.9, 1.1]} and trial.overlap is True
