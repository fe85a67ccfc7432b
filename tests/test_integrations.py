"""jax_mlpo inside the idioms real training loops use, each compared with optax's own behaviour.

- a Flax NNX loop and a linen ``TrainState`` loop on a 2x2 mesh, checkpointed by the loop's own
  orbax ``CheckpointManager`` (tests/integration_worker.py), resumed in a fresh process;
- a plain ``StandardSave`` of the offloaded state, refused at the first update after restoring;
- ``optax.inject_hyperparams(jax_mlpo.adamw)``, with and without ``static_args``;
- ``jax_mlpo.MultiSteps`` against ``optax.MultiSteps(optax.adamw)``;
- the lifecycle: a process that ends without ``close``, and one whose update failed.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from helpers import run_small, small_grads, small_params
from loops import run_loops, start_loops

import jax_mlpo
from jax_mlpo.transforms import runtime

ROOT = Path(__file__).resolve().parents[1]


def _assert_close_to_optax(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_checkpoint_in_the_loops_own_manager_resumes_exactly(kind, tmp_path):
    """Saved every step by the loop's own manager (async, LatestN(2), commit-file temporary
    paths) with OffloadSave, restored with OffloadRestore into a fresh model and optimizer in a
    new process: the resumed run's params are the uninterrupted run's bit for bit, and both
    follow optax.adamw."""
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    optax_run, whole, first = run_loops((kind, "optax", "all", tmp_path / "optax"),
                                        (kind, "mlpo", "all", tmp_path / "whole"),
                                        (kind, "mlpo", "first", tmp_path / "split"))  # fmt: skip
    [resumed] = run_loops((kind, "mlpo", "resume", tmp_path / "split"))
    assert whole["devices"] == 4
    assert first["steps"] == [2, 3]  # the preservation policy kept the latest two
    assert first["updates_run"] == 3 and resumed["updates_run"] == 3  # only the new steps
    assert resumed["params"] == whole["params"]  # bit for bit
    assert first["losses"] + resumed["losses"] == whole["losses"]
    _assert_close_to_optax(whole["params"], optax_run["params"], rtol=1e-6)
    step_dir = tmp_path / "split" / "ckpt" / "3" / "default"
    assert (step_dir / "jax_mlpo_state").is_dir()


def test_optax_loop_resumes_the_same_way(tmp_path):
    """The reference: the same loop with optax.adamw and StandardSave resumes bit for bit too
    (so the property above is orbax's, kept by jax_mlpo)."""
    (tmp_path / "split").mkdir()
    whole, _ = run_loops(("nnx", "optax", "all", tmp_path / "whole"),
                         ("nnx", "optax", "first", tmp_path / "split"))  # fmt: skip
    [resumed] = run_loops(("nnx", "optax", "resume", tmp_path / "split"))
    assert resumed["params"] == whole["params"]


def test_inject_hyperparams_on_a_mesh(tmp_path):
    """inject_hyperparams(jax_mlpo.adamw) in the NNX loop on the 2x2 mesh: the transformation
    re-created inside every update finds its engine and mesh plan (one engine for the run),
    and the run follows optax.inject_hyperparams(optax.adamw)."""
    (tmp_path / "mlpo").mkdir()
    want, got = run_loops(("nnx", "optax-inject", "all", tmp_path / "optax"),
                          ("nnx", "mlpo-inject", "all", tmp_path / "mlpo"))  # fmt: skip
    assert got["engines"] == 1 and got["updates_run"] == 6
    _assert_close_to_optax(got["params"], want["params"], rtol=1e-6)


def test_plain_standard_save_is_refused_with_the_fix(tmp_path):
    """StandardSave writes only the count and the handle; the restored state names no engine
    of the new process, and its first update says so and names OffloadSave/OffloadRestore."""
    (tmp_path / "plain").mkdir()
    run_loops(("nnx", "mlpo-plain", "first", tmp_path / "plain"))
    done = start_loops(("nnx", "mlpo-plain", "resume", tmp_path / "plain"))
    assert done.returncode != 0
    assert "does not hold the offloaded optimizer state" in done.stderr
    assert "OffloadSave / OffloadRestore" in done.stderr
    assert "Exception ignored in atexit" not in done.stderr  # one error, not three tracebacks


def test_offload_save_finds_the_state_inside_nnx_state(tmp_path):
    """nnx.state(optimizer) holds the state as a dict of variables; the save finds it there,
    and the restored tree has the target's structure, so nnx.update takes it."""
    config = jax_mlpo.OffloadConfig(host_cache="1MiB", subgroup_size=256,
                                    tiers=[jax_mlpo.FileTier(str(tmp_path / "tier"))])  # fmt: skip
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jax_mlpo.adamw(1e-2, offload=config), wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(1, args=jax_mlpo.checkpoint.OffloadSave({"optimizer": nnx.state(optimizer)}))
    mngr.wait_until_finished()
    saved_mu = jax_mlpo.engine_of(optimizer.opt_state).state_dict()["mu"]

    fresh_model = nnx.Linear(8, 8, rngs=nnx.Rngs(1))
    config2 = dataclasses.replace(config, tiers=[jax_mlpo.FileTier(str(tmp_path / "tier2"))])
    fresh = nnx.Optimizer(fresh_model, jax_mlpo.adamw(1e-2, offload=config2), wrt=nnx.Param)
    target = {"optimizer": nnx.state(fresh)}
    restored = mngr.restore(1, args=jax_mlpo.checkpoint.OffloadRestore(target))
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    nnx.update(fresh, restored["optimizer"])
    assert int(fresh.opt_state.count[...]) == 1
    got_mu = jax_mlpo.engine_of(fresh.opt_state).state_dict()["mu"]
    for got, want in zip(got_mu, saved_mu, strict=True):
        np.testing.assert_array_equal(got, want)
    # and training goes on from there
    fresh.update(fresh_model, grads)
    assert len(jax_mlpo.metrics(fresh.opt_state)) == 1
    mngr.close()
    jax_mlpo.close(optimizer.opt_state)
    jax_mlpo.close(fresh.opt_state)


def _wrapped(kind, config):
    inner = jax_mlpo.adamw(1e-2, offload=config)
    if kind == "partition":
        return optax.partition({"off": inner, "sgd": optax.sgd(1e-2)}, {"w": "off", "b": "sgd"})
    return optax.chain(optax.clip(1.0), optax.masked(inner, {"w": True, "b": False}))


@pytest.mark.parametrize("kind", ["partition", "masked"])
def test_offload_save_finds_the_state_in_optax_wrappers(kind, tmp_path):
    """The offloaded state inside optax.partition and optax.masked states is saved and
    restored like a top-level one: the restored moments are the saved ones, and the next
    update of the restored state equals the next update of the saved one."""
    params = small_params()
    tx = _wrapped(kind, _config(tmp_path / "a"))
    state = tx.init(params)
    for i in range(2):
        _, state = jax.jit(tx.update)(small_grads(i, params), state, params)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(2, args=jax_mlpo.checkpoint.OffloadSave({"opt": state}))
    mngr.wait_until_finished()
    assert (tmp_path / "ckpt" / "2" / "default" / "jax_mlpo_state").is_dir()
    fresh_tx = _wrapped(kind, _config(tmp_path / "b"))
    target = {"opt": fresh_tx.init(params)}
    restored = mngr.restore(2, args=jax_mlpo.checkpoint.OffloadRestore(target))["opt"]
    assert jax.tree.structure(restored) == jax.tree.structure(target["opt"])
    want, _ = jax.jit(tx.update)(small_grads(2, params), state, params)
    got, _ = jax.jit(fresh_tx.update)(small_grads(2, params), restored, params)
    for leaf in want:
        np.testing.assert_array_equal(got[leaf], want[leaf], err_msg=leaf)
    mngr.close()
    jax_mlpo.close((state, restored))


# the learning rate a loop sets by hand mid-run
LR_CHANGE = {"learning_rate": 3e-3}


def _config(path):
    return jax_mlpo.OffloadConfig(host_cache=3 * 8 * 256, subgroup_size=256, prefetch_depth=1,
                                  tiers=[jax_mlpo.FileTier(str(path))])  # fmt: skip


@pytest.mark.parametrize("form", ["numeric", "static_args"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_inject_hyperparams_matches_optax(form, jit, tmp_path):
    """optax.inject_hyperparams(jax_mlpo.adamw): the learning rate, b1, b2, eps and weight
    decay as per-step arrays (or static floats), the learning rate changed mid-run, within
    1e-6 of optax.inject_hyperparams(optax.adamw), with one engine for the whole run."""
    static = ("b1", "weight_decay") if form == "static_args" else ()
    hp = dict(learning_rate=1e-2, b1=0.8, b2=0.95, eps=1e-7, weight_decay=0.05)
    want, want_state = run_small(
        optax.inject_hyperparams(optax.adamw, static_args=static)(**hp),
        8,
        change_at=5,
        changes=LR_CHANGE,
    )
    engines_before = len(set(map(id, runtime.RUNTIME.open_engines())))
    tx = optax.inject_hyperparams(jax_mlpo.adamw, static_args=static)(
        **hp, offload=_config(tmp_path / "tier")
    )
    got, got_state = run_small(tx, 8, jit=jit, change_at=5, changes=LR_CHANGE)
    assert len(set(map(id, runtime.RUNTIME.open_engines()))) == engines_before + 1
    assert len(jax_mlpo.metrics(got_state)) == 8
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert float(got_state.hyperparams["learning_rate"]) == float(
        want_state.hyperparams["learning_rate"]
    )
    jax_mlpo.close(got_state)


def test_inject_hyperparams_b1_traced_changes_the_update(tmp_path):
    """A b1 changed in the state between steps is the one the host update uses: the run
    follows optax's with the same change (and not the b1 the engine was made with)."""
    hp = dict(learning_rate=1e-2, b1=0.9, b2=0.99, weight_decay=0.0)

    def run(tx):
        params, state = small_params(), None
        state = tx.init(params)
        for i in range(6):
            if i == 3:
                state.hyperparams["b1"] = jnp.asarray(0.5, jnp.float32)
            updates, state = jax.jit(tx.update)(small_grads(i, params), state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    want, _ = run(optax.inject_hyperparams(optax.adamw)(**hp))
    got, state = run(optax.inject_hyperparams(jax_mlpo.adamw, static_args="offload")(
        **hp, offload=_config(tmp_path / "tier")))  # fmt: skip
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    jax_mlpo.close(state)


@pytest.mark.parametrize("k", [1, 4])
def test_multi_steps_matches_optax_with_one_host_update_per_k(k, tmp_path):
    """jax_mlpo.MultiSteps(jax_mlpo.adamw) against optax.MultiSteps(optax.adamw): the same
    params within 1e-6, zero updates between, gradient_step and has_updated as optax's, and
    the host update run once per k micro-steps."""
    steps = 12
    want_tx = optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), every_k_schedule=k)
    tx = jax_mlpo.MultiSteps(
        jax_mlpo.adamw(1e-2, weight_decay=0.1, offload=_config(tmp_path / "tier")),
        every_k_schedule=k,
    )
    params = {"want": small_params(), "got": small_params()}
    states = {"want": want_tx.init(params["want"]), "got": tx.init(params["got"])}
    steppers = {name: jax.jit(t.update) for name, t in (("want", want_tx), ("got", tx))}
    for i in range(steps):
        for name in ("want", "got"):
            g = small_grads(i, params[name])
            updates, states[name] = steppers[name](g, states[name], params[name])
            if name == "got" and (i + 1) % k:
                assert all(not np.any(u) for u in jax.tree.leaves(updates))
            params[name] = optax.apply_updates(params[name], updates)
        assert int(states["got"].gradient_step) == int(states["want"].gradient_step)
        assert bool(tx.has_updated(states["got"])) == bool(want_tx.has_updated(states["want"]))
    for leaf in params["want"]:
        np.testing.assert_allclose(params["got"][leaf], params["want"][leaf], rtol=1e-6,
                                   atol=1e-7, err_msg=leaf)  # fmt: skip
    assert len(jax_mlpo.metrics(states["got"])) == steps // k  # host updates run
    jax_mlpo.close(states["got"])


@pytest.mark.parametrize("acc_dtype", [None, jnp.float32], ids=["default", "float32"])
def test_multi_steps_accumulates_as_optax_in_its_dtype(acc_dtype, tmp_path):
    """The accumulator is in the params' dtype by default (bfloat16 for a bfloat16 model), in
    float32 when asked: either way, between applied steps it holds optax.MultiSteps's
    accumulator of the same dtype, bit for bit (a float32 one is not rounded to bfloat16)."""
    params = {"w": jnp.linspace(-1.0, 1.0, 4096, dtype=jnp.bfloat16).reshape(64, 64)}
    want_dtype = jnp.bfloat16 if acc_dtype is None else acc_dtype
    want_tx = optax.MultiSteps(optax.adamw(1e-3), 4, accumulator_dtype=want_dtype)
    config = dataclasses.replace(_config(tmp_path / "tier"), host_cache="1MiB")
    inner = jax_mlpo.adamw(1e-3, offload=config)
    tx = jax_mlpo.MultiSteps(inner, every_k_schedule=4, accumulator_dtype=acc_dtype)
    state, want = tx.init(params), want_tx.init(params)
    assert state.acc_grads["w"].dtype == want_dtype
    for i in range(3):  # micro-steps that only accumulate
        grads = {"w": (jnp.sin(params["w"] * (i + 3)) / (i + 1)).astype(jnp.bfloat16)}
        updates, state = jax.jit(tx.update)(grads, state, params)
        _, want = jax.jit(want_tx.update)(grads, want, params)
        assert not np.any(np.asarray(updates["w"], np.float32))
        np.testing.assert_array_equal(state.acc_grads["w"], want.acc_grads["w"], strict=True)
    assert len(jax_mlpo.metrics(state)) == 0  # no host update yet
    jax_mlpo.close(state)


def test_optax_multi_steps_refusal_names_the_replacement(tmp_path):
    tx = optax.MultiSteps(jax_mlpo.adamw(1e-3, offload=_config(tmp_path / "t")), 4)
    with pytest.raises(ValueError, match=r"jax_mlpo\.MultiSteps\(tx, every_k_schedule=k\)"):
        tx.init(small_params())


def test_closed_state_says_it_was_closed(tmp_path):
    tx = jax_mlpo.adamw(1e-3, offload=_config(tmp_path / "t"))
    params = small_params()
    with jax_mlpo.closing(tx.init(params)) as state:
        _, state = tx.update(small_grads(0, params), state, params)
    with pytest.raises(jax.errors.JaxRuntimeError, match="was closed"):
        _, state = tx.update(small_grads(1, params), state, params)
        jax.block_until_ready(state.count)


def test_handles_are_unique_and_not_counters(tmp_path):
    """Two engines never share a handle, and a handle is not the small counter another
    process would also have drawn (it would name that process's engine)."""
    txs = [jax_mlpo.adamw(1e-3, offload=_config(tmp_path / f"t{k}")) for k in range(3)]
    states = [tx.init(small_params()) for tx in txs]
    handles = {int(s.handle) for s in states}
    assert len(handles) == 3 and all(h > 1000 for h in handles)
    jax_mlpo.close(states)


_SCRIPT = """
import sys, jax, jax.numpy as jnp, optax, jax_mlpo
cfg = jax_mlpo.OffloadConfig(host_cache="4MiB", subgroup_size=65536,
                             tiers=[jax_mlpo.FileTier(sys.argv[1])])
tx = jax_mlpo.adamw(1e-3, offload=cfg)
p = {"w": jnp.ones((1024, 1024))}
s = tx.init(p)

@jax.jit
def step(p, s):
    u, s = tx.update(p, s, p)
    return optax.apply_updates(p, u), s, jnp.sum(u["w"])

p, s, loss = step(p, s)
print(float(loss))
if sys.argv[2] == "fail":
    s = s._replace(count=s.count + 5)  # a state that is not the last one returned
    p, s, loss = step(p, s)
    try:
        with jax_mlpo.errors.typed():
            print(float(loss))
    except jax_mlpo.StaleStateError as e:
        print("caught", type(e).__name__)
"""


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_process_may_end_without_close(mode, tmp_path):
    """Retained subgroups and tier locks need no close at exit: no warning at a normal exit,
    and after a failed update one line, not JAX's exit hooks' repeated tracebacks."""
    (tmp_path / "t").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(tmp_path / "t"), mode],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    if mode == "ok":
        assert done.stderr == ""
    else:
        assert "caught StaleStateError" in done.stdout
        assert "Exception ignored in atexit" not in done.stderr
        assert done.stderr.strip().splitlines() == [
            "jax_mlpo: an optimizer update failed in this process (StaleStateError, raised by "
            "the step)"
        ]
