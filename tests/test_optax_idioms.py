"""optax's protocols and state utilities on jax_mlpo's optimizers, each against optax's own
behaviour on the same inputs, with the state on a file tier (bytes on it, checked).

- ``update(..., **extra_args)``: accepted and ignored, as optax's optimizers do;
- ``optax.tree.map_params``, ``optax.tree.get``/``set``, alone and inside wrappers;
- ``jax.eval_shape(tx.init, params)``: the state's shapes, with nothing written or held;
- ``jax.jit(tx.init)``, a linen ``TrainState`` made under ``jit``, an ``nnx.Optimizer`` made
  under ``nnx.jit``: each run makes an engine, and trains as the eager init and as optax;
- a second ``init`` in one process: it replaces the first state, which then refuses clearly;
- ``optax.MultiSteps`` refusals that name the optimizer they wrap.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from processes import json_lines

import jax_mlpo
from jax_mlpo.transforms import runtime

SUB = 4096  # elements per subgroup
LR = 1e-2
STEPS = 3


def make_params() -> dict[str, jax.Array]:
    """A matrix of 8 subgroups (Muon's) and a vector (AdamW's, under Muon)."""
    w = jnp.linspace(-1.0, 1.0, 8 * SUB, dtype=jnp.float32).reshape(256, 128)
    return {"b": jnp.linspace(0.5, -0.5, 128, dtype=jnp.float32), "w": w}


def grads_for(params: dict[str, jax.Array], step: int) -> dict[str, jax.Array]:
    return jax.tree.map(lambda p: jnp.cos(p * (step + 1)) + 0.01 * step, params)


def file_config(path: Path, host_cache: int = 3 * 8 * SUB) -> jax_mlpo.OffloadConfig:
    """One file tier; the host cache holds the pipelines' buffers and little else (the
    default is AdamW's three blobs), so the state's subgroups live on the tier."""
    path.mkdir(parents=True, exist_ok=True)
    return jax_mlpo.OffloadConfig(
        host_cache=host_cache, subgroup_size=SUB, prefetch_depth=1, placement="even",
        tiers=[jax_mlpo.FileTier(str(path / "t0"), sync=False)],
    )  # fmt: skip


# name -> (jax_mlpo's factory, optax's factory), the same arguments
OPTIMIZERS: dict[str, tuple[Callable[..., optax.GradientTransformation], Callable]] = {
    "adamw": (lambda learning_rate, **k: jax_mlpo.adamw(learning_rate, weight_decay=0.1, **k),
              lambda learning_rate: optax.adamw(learning_rate, weight_decay=0.1)),
    "lion": (lambda learning_rate, **k: jax_mlpo.lion(learning_rate, weight_decay=0.1, **k),
             lambda learning_rate: optax.lion(learning_rate, weight_decay=0.1)),
    "muon": (lambda learning_rate, **k: jax_mlpo.muon(learning_rate, weight_decay=0.1, **k),
             lambda learning_rate: optax.contrib.muon(learning_rate, weight_decay=0.1)),
}  # fmt: skip


# a host cache per optimizer of about three of its blobs (Lion's and Muon's are 4 bytes per
# float32 param, AdamW's 8; Muon's vector's AdamW state is held whole)
HOST_CACHE = {"adamw": 3 * 8 * SUB, "lion": 3 * 4 * SUB, "muon": 3 * 4 * SUB + 2**12}


def assert_on_tier(config: jax_mlpo.OffloadConfig) -> None:
    """Blobs reached the tier (a state held whole in the host cache would prove nothing)."""
    blobs = list(Path(config.tiers[0].path).rglob("state-*.blob"))
    assert len(blobs) >= 4, blobs


def train(tx, steps: int = STEPS, params=None, state=None, start: int = 0, **extra_args):
    """``steps`` jitted updates; returns the params and the state."""
    params = make_params() if params is None else params
    state = tx.init(params) if state is None else state

    @jax.jit
    def step(params, state, i):
        updates, state = tx.update(grads_for(params, i), state, params, **extra_args)
        return optax.apply_updates(params, updates), state

    for i in range(start, start + steps):
        params, state = step(params, state, i)
    return jax.block_until_ready((params, state))


def assert_close(actual, expected) -> None:
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-7)


# -- extra arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_accepts_and_ignores_extra_args_as_optax_does(name, tmp_path):
    ours, theirs = OPTIMIZERS[name]
    config = file_config(tmp_path, HOST_CACHE[name])
    tx = ours(LR, offload=config)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert isinstance(theirs(LR), optax.GradientTransformationExtraArgs)
    extra = {"value": jnp.float32(2.5), "grad": None, "value_fn": None}
    expected, _ = train(theirs(LR), **extra)
    params, state = train(tx, **extra)
    assert_close(params, expected)
    assert_on_tier(config)
    jax_mlpo.close(state)


def test_multi_steps_passes_extra_args_as_optax_does(tmp_path):
    config = file_config(tmp_path)
    tx = jax_mlpo.MultiSteps(jax_mlpo.adamw(LR, offload=config), every_k_schedule=2)
    wrapped = tx.gradient_transformation()
    reference = optax.MultiSteps(optax.adamw(LR), every_k_schedule=2).gradient_transformation()
    # optax's update takes extra arguments (and hands them to the inner optimizer), though its
    # gradient_transformation() is typed plain; jax_mlpo's says so in its type too
    assert isinstance(wrapped, optax.GradientTransformationExtraArgs)
    expected, _ = train(reference, steps=4, value=jnp.float32(1.0))
    params, state = train(wrapped, steps=4, value=jnp.float32(1.0))
    assert_close(params, expected)
    assert_on_tier(config)
    jax_mlpo.close(state)


# -- optax's state utilities -------------------------------------------------------------------


def wrappers(make: Callable[[float], optax.GradientTransformation]) -> dict[str, Callable]:
    """The optimizer ``make(learning_rate)`` alone and inside the wrappers real loops use."""
    labels = {"b": "plain", "w": "inner"}
    return {
        "alone": lambda: make(LR),
        "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), make(LR)),
        "partition": lambda: optax.partition({"inner": make(LR), "plain": optax.sgd(LR)}, labels),
        "masked": lambda: optax.masked(make(LR), {"b": False, "w": True}),
        "inject": lambda: optax.inject_hyperparams(make)(LR),
    }


WRAPPERS = ["alone", "chain", "partition", "masked", "inject"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_map_params_maps_what_optax_maps_and_keeps_the_engine(name, wrapper, tmp_path):
    """optax.tree.map_params inits the optimizer on a placeholder to find the params-shaped
    parts of the state: jax_mlpo's state has none on the device (its moments live on the
    tiers), so the map leaves it as it is, and the placeholder's init neither fails nor takes
    the live engine's place: training goes on as optax's."""
    ours, theirs = OPTIMIZERS[name]
    config = file_config(tmp_path, HOST_CACHE[name])
    tx = wrappers(lambda learning_rate: ours(learning_rate, offload=config))[wrapper]()
    reference = wrappers(theirs)[wrapper]()
    params, state = train(tx, steps=1)
    expected_params, expected_state = train(reference, steps=1)
    open_before = runtime.RUNTIME.open_handles()

    def double(x):
        return 2 * x

    mapped = optax.tree.map_params(tx, double, state)
    expected_mapped = optax.tree.map_params(reference, double, expected_state)
    # optax maps the params-shaped copies and leaves the rest (counts, hyper-parameters) as
    # they are; jax_mlpo's state holds no params-shaped copy on the device, only the rest
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(expected_mapped), jax.tree.leaves(expected_state), strict=True
        )
    )
    counts = [v for _, v in optax.tree.get_all_with_path(mapped, "count")]
    expected_counts = [v for _, v in optax.tree.get_all_with_path(expected_mapped, "count")]
    assert {int(c) for c in counts} == {int(c) for c in expected_counts} == {1}
    assert jax.tree.structure(mapped) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(mapped), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    # the live engine is still this state's: no engine was made or closed by the placeholder
    assert set(runtime.RUNTIME.open_handles()) >= set(open_before)
    params, state = train(tx, steps=2, params=params, state=state, start=1)
    expected, _ = train(reference, steps=2, params=expected_params, state=expected_state, start=1)
    assert_close(params, expected)
    assert_on_tier(config)
    jax_mlpo.close(state)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_tree_get_and_set_as_on_optax_state(name, tmp_path):
    """optax.tree.get finds the step count; optax.tree.set changes an injected
    hyper-parameter, and the next updates follow it as optax's do."""
    ours, theirs = OPTIMIZERS[name]
    config = file_config(tmp_path, HOST_CACHE[name])
    tx = optax.inject_hyperparams(lambda learning_rate: ours(learning_rate, offload=config))(LR)
    reference = optax.inject_hyperparams(theirs)(LR)
    params, state = train(tx, steps=2)
    expected_params, expected_state = train(reference, steps=2)
    counts = [v for _, v in optax.tree.get_all_with_path(state, "count")]
    expected_counts = [v for _, v in optax.tree.get_all_with_path(expected_state, "count")]
    assert {int(c) for c in counts} == {int(c) for c in expected_counts} == {2}
    lr = optax.tree.get(state, "learning_rate")
    assert lr == optax.tree.get(expected_state, "learning_rate") == np.float32(LR)
    state = optax.tree.set(state, learning_rate=jnp.float32(LR / 4))
    expected_state = optax.tree.set(expected_state, learning_rate=jnp.float32(LR / 4))
    params, state = train(tx, steps=2, params=params, state=state, start=2)
    expected, _ = train(reference, steps=2, params=expected_params, state=expected_state, start=2)
    assert_close(params, expected)
    assert_on_tier(config)
    jax_mlpo.close(state)


def shapes(tree):
    return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_eval_shape_of_init_writes_nothing_and_holds_nothing(name, wrapper, tmp_path):
    """jax.eval_shape(tx.init, params), how Flax and orbax make restore targets: the shapes
    of what tx.init returns, as for optax, with no file written and no engine made."""
    ours, theirs = OPTIMIZERS[name]
    config = file_config(tmp_path, HOST_CACHE[name])
    tier = Path(config.tiers[0].path)
    before = sorted(p.name for p in tier.rglob("*"))
    tx = wrappers(lambda learning_rate: ours(learning_rate, offload=config))[wrapper]()
    reference = wrappers(theirs)[wrapper]()
    params = make_params()
    open_before = runtime.RUNTIME.open_handles()
    abstract = jax.eval_shape(tx.init, params)
    assert runtime.RUNTIME.open_handles() == open_before  # no engine
    assert sorted(p.name for p in tier.rglob("*")) == before  # no lock, no blob, no directory
    expected = jax.eval_shape(reference.init, params)
    assert shapes(expected) == shapes(reference.init(params))  # optax's own contract
    state = tx.init(params)
    assert shapes(abstract) == shapes(state)
    # the template trains nothing: its use names the cause and the fix
    template = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    with (
        pytest.raises(
            jax_mlpo.NoEngineError,
            match=r"made by tx.init under a JAX trace that makes no engine \(jax.eval_shape.*"
            r"with tx.init\(params\), eagerly or under jax.jit",
        ),
        jax_mlpo.errors.typed(),
    ):
        train(tx, steps=1, state=template)
    params, state = train(tx, steps=STEPS, state=state)
    assert_close(params, train(reference)[0])
    assert_on_tier(config)
    jax_mlpo.close(state)


def test_nnx_eval_shape_of_an_optimizer_writes_nothing(tmp_path):
    config = file_config(tmp_path)
    tier = Path(config.tiers[0].path)

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(128, 256, rngs=rngs)

    tx = jax_mlpo.adamw(LR, offload=config)
    open_before = runtime.RUNTIME.open_handles()
    abstract = nnx.eval_shape(lambda: nnx.Optimizer(Model(nnx.Rngs(0)), tx, wrt=nnx.Param))
    assert runtime.RUNTIME.open_handles() == open_before
    assert list(tier.rglob("*")) == []
    real = nnx.Optimizer(Model(nnx.Rngs(0)), tx, wrt=nnx.Param)
    assert shapes(nnx.state(abstract)) == shapes(nnx.state(real))
    jax_mlpo.close(real.opt_state)


def test_schedule_free_around_adamw_follows_optax(tmp_path):
    config = file_config(tmp_path)
    tx = optax.contrib.schedule_free(jax_mlpo.adamw(LR, b1=0.0, offload=config), LR)
    reference = optax.contrib.schedule_free(optax.adamw(LR, b1=0.0), LR)
    params, state = train(tx, steps=4)
    assert_close(params, train(reference, steps=4)[0])
    assert_on_tier(config)
    jax_mlpo.close(state)


JIT_WRAPPERS = ["alone", "chain", "inject"]


@pytest.mark.parametrize("wrapper", JIT_WRAPPERS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_jitted_init_trains_as_the_eager_init_and_as_optax(name, wrapper, tmp_path):
    """jax.jit(tx.init)(params): the compiled init makes the engine when it runs; training from
    its state is the eager init's bit for bit, and optax's to float32 rounding."""
    ours, theirs = OPTIMIZERS[name]
    config = file_config(tmp_path, HOST_CACHE[name])
    tx = wrappers(lambda learning_rate: ours(learning_rate, offload=config))[wrapper]()
    open_before = set(runtime.RUNTIME.open_handles())
    state = jax.jit(tx.init)(make_params())
    assert set(runtime.RUNTIME.open_handles()) > open_before  # an engine, made by the program's run
    jitted, state = train(tx, state=state)
    assert_on_tier(config)
    jax_mlpo.close(state)
    eager, state = train(tx)
    jax_mlpo.close(state)
    for a, e in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    assert_close(jitted, train(wrappers(theirs)[wrapper]())[0])


def test_each_run_of_a_jitted_init_makes_its_own_engine_and_tier_files(tmp_path):
    """Two calls of one compiled init: two engines, the second taking the first's place as a
    second eager init does, each with a set of tier files of its own."""
    config = file_config(tmp_path)
    tier = Path(config.tiers[0].path)
    tx = jax_mlpo.adamw(LR, weight_decay=0.1, offload=config)
    init = jax.jit(tx.init)
    first = train(tx, steps=1, state=init(make_params()))[1]
    blobs = sorted(tier.rglob("state-*.blob"))
    assert len(blobs) >= 4
    kept = [tmp_path / f"kept-{k}" for k in range(len(blobs))]
    for blob, link in zip(blobs, kept, strict=True):
        link.hardlink_to(blob)  # the first engine's files stay reachable (and their inodes)
    second = init(make_params())
    assert runtime.key_of(second.handle) != runtime.key_of(first.handle)
    with pytest.raises(jax_mlpo.NoEngineError, match="was replaced: a later tx.init"):
        jax_mlpo.engine_of(first)
    params, second = train(tx, state=second)
    assert_close(params, train(optax.adamw(LR, weight_decay=0.1))[0])
    now = sorted(tier.rglob("state-*.blob"))
    assert now and not any(b.samefile(k) for b in now for k in kept)  # a new set of files
    jax_mlpo.close(second)


def test_a_linen_train_state_made_under_jit_trains_as_optax(tmp_path):
    """linen's idiom: the TrainState (params and optimizer state) made by a jitted function,
    its out_shardings from jax.eval_shape of the same function."""
    from flax import linen as nn  # noqa: PLC0415
    from flax.training import train_state  # noqa: PLC0415

    model = nn.Dense(128)
    x = jnp.linspace(-1.0, 1.0, 4 * 256, dtype=jnp.float32).reshape(4, 256)

    def create(tx):
        params = model.init(jax.random.key(0), x)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss(params, batch):
        return jnp.mean(jnp.square(model.apply({"params": params}, batch) - 0.5))

    @jax.jit
    def step(state, batch):
        return state.apply_gradients(grads=jax.grad(loss)(state.params, batch))

    def run(tx, jitted):
        make = functools.partial(create, tx)
        if jitted:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: device, jax.eval_shape(make))
            state = jax.jit(make, out_shardings=shardings)()
        else:
            state = make()
        for i in range(STEPS):
            state = step(state, x * (i + 1))
        return jax.block_until_ready(state)

    config = file_config(tmp_path, 3 * 8 * SUB)
    tx = jax_mlpo.adamw(LR, weight_decay=0.1, offload=config)
    jitted = run(tx, jitted=True)
    assert_on_tier(config)
    jax_mlpo.close(jitted.opt_state)
    eager = run(tx, jitted=False)
    jax_mlpo.close(eager.opt_state)
    for a, e in zip(jax.tree.leaves(jitted.params), jax.tree.leaves(eager.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    assert_close(jitted.params, run(optax.adamw(LR, weight_decay=0.1), jitted=True).params)


def test_an_nnx_optimizer_made_under_nnx_jit_trains_as_optax(tmp_path):
    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(256, 128, rngs=rngs)

        def __call__(self, x):
            return self.linear(x)

    x = jnp.linspace(-1.0, 1.0, 4 * 256, dtype=jnp.float32).reshape(4, 256)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss(model):
            return jnp.mean(jnp.square(model(batch) - 0.5))

        optimizer.update(model, nnx.grad(loss)(model))

    def run(tx, jitted):
        def make():
            model = Model(nnx.Rngs(0))
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        model, optimizer = nnx.jit(make)() if jitted else make()
        for i in range(STEPS):
            step(model, optimizer, x * (i + 1))
        return model, optimizer

    config = file_config(tmp_path, 3 * 8 * SUB)
    tx = jax_mlpo.adamw(LR, weight_decay=0.1, offload=config)
    jitted, optimizer = run(tx, jitted=True)
    assert_on_tier(config)
    jax_mlpo.close(optimizer.opt_state)
    eager, optimizer = run(tx, jitted=False)
    jax_mlpo.close(optimizer.opt_state)
    got, want = nnx.state(jitted, nnx.Param), nnx.state(eager, nnx.Param)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    expected = nnx.state(run(optax.adamw(LR, weight_decay=0.1), jitted=True)[0], nnx.Param)
    assert_close(got, expected)


# -- re-initialisation -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_second_init_replaces_the_first_and_trains_as_optax(name, tmp_path):
    """A second init of the same transformation (a restore target, a re-created optimizer)
    takes over the tiers: the first state's engine is closed, its host cache freed, and the
    first state refuses updates with the cause and the fix."""
    ours, theirs = OPTIMIZERS[name]
    config = file_config(tmp_path, HOST_CACHE[name])
    tx = ours(LR, offload=config)
    first = train(tx, steps=2)[1]
    engines_before = len(runtime.RUNTIME.open_handles())
    second = tx.init(make_params())
    assert len(runtime.RUNTIME.open_handles()) == engines_before  # replaced, not added
    with (
        pytest.raises(
            jax_mlpo.NoEngineError,
            match=re.escape("was replaced: a later tx.init in this process took its place (tiers"),
        ),
        jax_mlpo.errors.typed(),
    ):
        train(tx, steps=1, state=first)
    params, state = train(tx, state=second)
    assert_close(params, train(theirs(LR))[0])
    assert_on_tier(config)
    # a transformation re-created on the same directories (a notebook cell run again)
    again = ours(LR, offload=file_config(tmp_path, HOST_CACHE[name]))
    params, state = train(again, state=again.init(make_params()))
    assert_close(params, train(theirs(LR))[0])
    jax_mlpo.close(state)


def test_a_second_init_without_tiers_replaces_the_first(tmp_path):
    config = jax_mlpo.OffloadConfig(host_cache="16MiB", subgroup_size=SUB)
    tx = jax_mlpo.adamw(LR, offload=config)
    first = tx.init(make_params())
    held = jax_mlpo.engine_of(first).host_bytes
    assert held > 0
    second = tx.init(make_params())
    assert jax_mlpo.engine_of(second).host_bytes == held
    with pytest.raises(jax_mlpo.NoEngineError, match="was replaced.*the same OffloadConfig"):
        jax_mlpo.engine_of(first)
    params, state = train(tx, state=second)
    assert_close(params, train(optax.adamw(LR, weight_decay=1e-4))[0])
    jax_mlpo.close(state)


def test_restoring_into_a_fresh_init_in_the_training_process(tmp_path):
    """The README's restore, in the process that trains: the target's init replaces the
    training state's engine, and the restored state goes on as optax."""
    config = file_config(tmp_path / "run")
    tx = jax_mlpo.adamw(LR, weight_decay=0.1, offload=config)
    params, state = train(tx, steps=2)
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"), options=options)
    mngr.save(2, args=jax_mlpo.checkpoint.OffloadSave({"params": params, "opt": state}))
    mngr.wait_until_finished()
    target = {"params": params, "opt": tx.init(params)}
    restored = mngr.restore(2, args=jax_mlpo.checkpoint.OffloadRestore(target))
    params, state = train(tx, steps=2, params=restored["params"], state=restored["opt"], start=2)
    assert_close(params, train(optax.adamw(LR, weight_decay=0.1), steps=4)[0])
    assert_on_tier(config)
    jax_mlpo.close(state)


# -- accumulation on a mesh -------------------------------------------------------------------


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_multi_steps_on_a_mesh_follows_optax_in_the_params_shardings(axes, tmp_path):
    """jax_mlpo.MultiSteps on a (2, 2) mesh, its axes Explicit (sharding in the array types)
    or Auto, beside optax.MultiSteps(optax.adamw) on the same mesh (tests/
    accumulation_mesh_worker.py, in an interpreter of four devices)."""
    worker = Path(__file__).parent / "accumulation_mesh_worker.py"
    out = json_lines([str(worker), axes, str(tmp_path / "tier")], 300)[-1]
    assert out["devices"] == 4
    assert out["max_abs_diff"] <= 1e-6  # params of magnitude 1: float32 rounding
    for what in ("params", "accumulator", "updates"):
        assert all(out[f"{what}_keep_shardings"].values()), (what, out)
    assert out["tier_bytes"] > 0
    assert out["eval_shape_matches_init"]  # the handle has one element per device


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optax_multi_steps_refusal_names_the_optimizer(name, tmp_path):
    ours, _ = OPTIMIZERS[name]
    tx = optax.MultiSteps(ours(LR, offload=file_config(tmp_path)), every_k_schedule=2)
    with pytest.raises(ValueError, match=rf"^jax_mlpo\.{name} cannot be wrapped in "
                                         r"optax\.MultiSteps.*jax_mlpo\.MultiSteps"):  # fmt: skip
        tx.init(make_params())
