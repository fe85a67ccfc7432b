"""jax_mlpo.extend: docs/extending.md's optimizers, run from the page, against optax.lion; the
scalar vector by name; jax_mlpo.muon built once."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_small, small_grads, small_params

import jax_mlpo
from jax_mlpo import extend
from jax_mlpo.engine.scalars import ScalarNames

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
# how far each of the page's optimizers may be from optax.lion (float32 params): the kernel
# computes optax's expressions; NumPy rounds (1 - b) * x + b * m twice where XLA fuses them
TOLERANCE = {"jax_lion": 1e-6, "numpy_lion": 1e-6, "native_lion": 1e-7}


def _page() -> dict:
    """The page's definitions (every block but the last), as a reader would paste them."""
    namespace: dict = {}
    for block in BLOCKS[:-1]:
        exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


def _config(path: Path, bytes_per_param: int = 4) -> jax_mlpo.OffloadConfig:
    # subgroups of 256 elements; the host cache is the pipeline's three buffers, so the state
    # (bytes_per_param: 4 for Lion's m, 8 with a master) lives on the tier
    tiers = [jax_mlpo.FileTier(str(path))]
    return jax_mlpo.OffloadConfig(host_cache=3 * bytes_per_param * 256, subgroup_size=256,
                                  prefetch_depth=1, tiers=tiers)  # fmt: skip


def _decay_matrices(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def test_the_page_has_its_five_blocks_and_its_loop_runs_on_its_tier(tmp_path, monkeypatch):
    assert len(BLOCKS) == 5
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NumPy Lion's, at its definition only
        for block in BLOCKS[:-1]:
            exec(compile(block, str(PAGE), "exec"), namespace)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loop's jax.numpy Lion, its tier in use: no warning
        exec(compile(BLOCKS[-1], str(PAGE), "exec"), namespace)
    assert namespace["state"].count == 3
    assert len(list((tmp_path / "opt_state").rglob("state-*.blob"))) >= 4


def test_the_pages_adabelief_is_the_file():
    source = Path(__file__).resolve().parents[1] / "experiments" / "optimizers" / "adabelief.py"
    assert BLOCKS[1] == source.read_text()


CLASSES = {"jax_lion": "JaxLion", "numpy_lion": "NumpyLion", "native_lion": "NativeLion"}


@pytest.mark.parametrize("masked", [False, True], ids=["page", "mask"])
@pytest.mark.parametrize("factory", ["jax_lion", "numpy_lion", "native_lion"])
def test_matches_optax_lion(factory, masked, tmp_path):
    """The page's factory, and ``offloaded_transformation`` with a ``mask`` (the vector not
    decayed, as optax.lion's mask says)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if masked:
            tx = extend.offloaded_transformation(
                _page()[CLASSES[factory]](), learning_rate=1e-2,
                offload=_config(tmp_path / "tier"), mask=_decay_matrices,
                hyperparams={"b1": 0.9, "b2": 0.99, "weight_decay": 0.1},
            )  # fmt: skip
        else:
            tx = _page()[factory](1e-2, weight_decay=0.1, offload=_config(tmp_path / "tier"))
    mask = _decay_matrices if masked else None
    want, _ = run_small(optax.lion(1e-2, weight_decay=0.1, mask=mask), 8)
    got, state = run_small(tx, 8)
    assert int(state.count) == 8
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=TOLERANCE[factory],
                                   atol=TOLERANCE[factory], err_msg=k)  # fmt: skip
    jax_mlpo.close(state)


@pytest.mark.parametrize("factory", ["jax_lion", "numpy_lion", "native_lion"])
def test_bfloat16_params_keep_an_fp32_master(factory, tmp_path):
    """bfloat16 params: the state's fp32 master follows optax.lion on float32 params fed the
    same gradients, and the params are that master rounded (``update_dtype=float32`` makes
    ``apply_updates`` land on it exactly)."""
    optimizer = _page()[CLASSES[factory]]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tx = extend.offloaded_transformation(
            optimizer, learning_rate=1e-2, offload=_config(tmp_path / "tier", 8),
            hyperparams={"b1": 0.9, "b2": 0.99, "weight_decay": 0.1},
            update_dtype=jnp.float32,
        )  # fmt: skip
    ref_tx = optax.lion(1e-2, weight_decay=0.1)
    master = small_params()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
    master = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), master)
    state, ref_state = tx.init(params), ref_tx.init(master)
    update, ref_update = jax.jit(tx.update), jax.jit(ref_tx.update)
    for i in range(6):
        grads = small_grads(i, params)  # from the bfloat16 params, for both
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = ref_update(
            jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state, master
        )
        master = optax.apply_updates(master, ref_updates)
        for k in params:
            want = np.asarray(master[k].astype(jnp.bfloat16), np.float32)
            got = np.asarray(params[k], np.float32)
            # a master within TOLERANCE of optax's rounds to the same bfloat16 value except
            # where it lies that close to a rounding boundary
            ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
            assert np.all(np.abs(got - want) <= ulp), (i, k)
            assert np.mean(got != want) <= 0.01, (i, k)
    jax_mlpo.close(state)


@pytest.mark.parametrize("factory", ["jax_lion", "numpy_lion"])
def test_inject_hyperparams_reaches_the_host_rule(factory, tmp_path):
    """The learning rate and b1 as per-step arrays, changed mid-run, read by name on the host."""
    make = _page()[factory]
    hp = dict(learning_rate=1e-2, b1=0.8, b2=0.95, weight_decay=0.05)
    changes = {"learning_rate": 3e-3, "b1": 0.5}
    want, _ = run_small(optax.inject_hyperparams(optax.lion)(**hp), 8, change_at=5, changes=changes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tx = optax.inject_hyperparams(make, static_args="offload")(
            **hp, offload=_config(tmp_path / "tier")
        )
    got, state = run_small(tx, 8, change_at=5, changes=changes)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
    jax_mlpo.close(state)


def test_a_numpy_update_says_it_is_slow_and_a_native_one_does_not(tmp_path):
    page = _page()
    with pytest.warns(UserWarning, match="numpy_lion's update runs in NumPy"):
        page["numpy_lion"](1e-3, offload=_config(tmp_path / "a"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        page["native_lion"](1e-3, offload=_config(tmp_path / "b"))


# ---- AdaBelief and ADOPT in jax.numpy (experiments/optimizers) ---------------------------------

CONTRIB = ["adabelief", "adopt"]


def _contrib(name: str):
    module = importlib.import_module(f"experiments.optimizers.{name}")
    return getattr(module, name), module.reference


def _on_tier(path: Path) -> None:
    assert len(list(path.rglob("state-*.blob"))) >= 4  # the state lives on the tier


@pytest.fixture(params=["tile", "xla"])
def rule_path(request, monkeypatch):
    """The two ways a jax.numpy rule runs: a tile program (the default) and XLA."""
    if request.param == "xla":
        monkeypatch.setattr(extend.JaxElementwiseOptimizer, "tile_program", False)
    return request.param


@pytest.mark.parametrize("name", CONTRIB)
def test_a_jax_numpy_optimizer_matches_optax_on_a_file_tier(name, rule_path, tmp_path):
    ours, theirs = _contrib(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy warning, and the tier is in use
        tx = ours(1e-2, offload=_config(tmp_path / "tier", 8))
        got, state = run_small(tx, 8)
    want, _ = run_small(theirs(1e-2), 8)
    _on_tier(tmp_path / "tier")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
    jax_mlpo.close(state)


@pytest.mark.parametrize("name", CONTRIB)
def test_a_jax_numpy_optimizer_keeps_an_fp32_master_of_bfloat16_params(name, rule_path, tmp_path):
    """bfloat16 params: the update lands on the fp32 master (update_dtype=float32), which
    follows optax on float32 params fed the same gradients."""
    ours, theirs = _contrib(name)
    tx = ours(1e-2, offload=_config(tmp_path / "tier", 12), update_dtype=jnp.float32)
    ref_tx = theirs(1e-2)
    master = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), small_params())
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
    state, ref_state = tx.init(params), ref_tx.init(master)
    update, ref_update = jax.jit(tx.update), jax.jit(ref_tx.update)
    ours_master = master
    for i in range(6):
        grads = small_grads(i, params)
        updates, state = update(grads, state, params)
        ours_master = jax.tree.map(lambda p, u: p.astype(jnp.float32) + u, params, updates)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = ref_update(
            jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state, master
        )
        master = optax.apply_updates(master, ref_updates)
    _on_tier(tmp_path / "tier")
    for k in master:  # params + the float32 update is the new master
        np.testing.assert_allclose(ours_master[k], master[k], rtol=1e-6, atol=1e-6, err_msg=k)
    jax_mlpo.close(state)


@pytest.mark.parametrize("name", CONTRIB)
def test_a_jax_numpy_optimizer_under_inject_hyperparams(name, rule_path, tmp_path):
    ours, theirs = _contrib(name)
    hp = {"learning_rate": 1e-2, "b1": 0.8, "b2": 0.95}
    changes = {"learning_rate": 3e-3, "b1": 0.5}
    static = ("clip_value_fn",) if name == "adopt" else ()  # a function, not a schedule
    reference = optax.inject_hyperparams(theirs, static_args=static)(**hp)
    want, _ = run_small(reference, 8, change_at=5, changes=changes)
    tx = optax.inject_hyperparams(ours, static_args=("offload", *static))(
        **hp, offload=_config(tmp_path / "tier", 8)
    )
    got, state = run_small(tx, 8, change_at=5, changes=changes)
    _on_tier(tmp_path / "tier")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
    jax_mlpo.close(state)


def _adabelief_state(n: int, offset: int) -> list[np.ndarray]:
    """m, s, g, p, u: float32[n] starting ``offset`` elements past a 64-byte boundary."""
    rng = np.random.default_rng(0)
    out = []
    for k in range(5):
        raw = np.empty(n + 32, np.float32)
        start = (-raw.ctypes.data % 64) // 4 + offset
        x = raw[start : start + n]
        x[...] = rng.standard_normal(n, dtype=np.float32) if k < 4 else 0.0
        out.append(x)
    out[1] = np.abs(out[1])  # s: a variance
    return out


@pytest.mark.parametrize("tile", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_jax_rule_gives_unaligned_and_read_only_chunks_the_values_of_aligned_ones(
    threads, tile
):
    """The runner takes aligned chunks as they are and copies the others into its staging
    buffers: the state it writes is the same, and what NumPy computes from the same rule."""
    from types import SimpleNamespace

    from jax_mlpo.optimizers.jax_rule import RuleRunner

    ours, _ = _contrib("adabelief")
    hyper = {"lr": 1e-3, "bc1": 0.19, "bc2": 0.002, "c1": 0.1, "c2": 0.001, "b1": 0.9,
             "b2": 0.999, "eps": 1e-16, "eps_root": 1e-16}  # fmt: skip
    n = 5 * 1024 + 7  # whole chunks, a power-of-two tail and a last short piece
    results = []
    for offset, read_only in ((0, False), (1, False), (0, True)):
        m, s, g, p, u = _adabelief_state(n, offset)
        f = {k: np.float32(v) for k, v in hyper.items()}
        want_m = f["c1"] * g + f["b1"] * m
        want_s = f["c2"] * np.square(g - want_m) + f["b2"] * s + f["eps_root"]
        want_u = -f["lr"] * ((want_m / f["bc1"]) / (np.sqrt(want_s / f["bc2"]) + f["eps"]))
        g.flags.writeable = not read_only
        runner = RuleRunner(importlib.import_module(ours.__module__).AdaBelief().step,
                            "adabelief", threads, chunk=2048, tile=tile)  # fmt: skip
        runner.run([(SimpleNamespace(decay=False), (m, s), g, p, u, None)], hyper)
        runner.close()
        for got, want in ((m, want_m), (s, want_s), (u, want_u)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)  # XLA fuses: FMAs
        results.append([m.copy(), s.copy(), u.copy()])
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            np.testing.assert_array_equal(got, want)


# ---- the scalar vector -----------------------------------------------------------------------


def test_scalars_are_read_back_by_name_with_defaults_where_not_passed():
    names = ScalarNames.of(("lr", "bc"), {"b1": 0.9, "eps": jnp.float32(1e-8)})
    vector = np.asarray(names.vector({"bc": 0.5, "lr": 0.25}, {"eps": jnp.float32(1e-6)}))
    assert vector.shape == (12,) and np.isnan(vector[4:]).all()
    read = names.read(vector)
    assert read == {"lr": 0.25, "bc": 0.5, "b1": 0.9, "eps": float(np.float32(1e-6))}


def test_scalars_named_twice_or_too_many_are_refused_at_construction(tmp_path):
    page = _page()
    with pytest.raises(ValueError, match=r"the scalars \['lr'\] are named twice"):
        extend.offloaded_transformation(
            page["NativeLion"](), learning_rate=1e-3, offload=_config(tmp_path / "a"),
            hyperparams={"lr": 0.1, "b1": 0.9, "b2": 0.99, "weight_decay": 0.0},
        )  # fmt: skip
    many = {f"h{i}": 0.1 for i in range(12)}
    with pytest.raises(ValueError, match=r"13 scalars .* at most 12"):
        extend.offloaded_transformation(
            page["NativeLion"](), learning_rate=1e-3, offload=_config(tmp_path / "b"),
            hyperparams=many,
        )  # fmt: skip


def test_device_scalars_that_miss_a_name_are_refused_when_traced(tmp_path):
    class Two(extend.ElementwiseOptimizer):
        name = "two"
        moment_names = ()
        scalar_names = ("lr", "scale")

        def update(self, *args, **kwargs):  # never reached
            raise AssertionError

    tx = extend.offloaded_transformation(Two(), learning_rate=1e-3, offload=_config(tmp_path))
    params = small_params()
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"computed the scalars \['lr'\], but the optimizer reads"):
        tx.update(params, state, params)
    jax_mlpo.close(state)


# ---- jax_mlpo.muon, built once ---------------------------------------------------------------


def test_eager_muon_compiles_nothing_after_its_first_step(tmp_path):
    """Its three parts are made at construction: each eager update after the first reuses their
    compiled programs (compilations counted by jax.monitoring), and the parts check the params'
    shapes against init."""
    compiles: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    config = jax_mlpo.OffloadConfig(host_cache="16MiB")  # compilations: host memory will do
    tx = jax_mlpo.muon(1e-2, weight_decay=0.1, offload=config)
    params = {"w": jnp.ones((32, 24), jnp.bfloat16), "x": jnp.ones((24, 16), jnp.float32),
              "b": jnp.zeros((24,), jnp.float32)}  # fmt: skip
    state = tx.init(params)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        per_step = []
        for i in range(4):
            before = len(compiles)
            updates, state = tx.update(small_grads(i, params), state, params)
            params = optax.apply_updates(params, updates)
            per_step.append(len(compiles) - before)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert per_step[0] > 0 and per_step[1:] == [0, 0, 0], per_step
    other = {**params, "w": jnp.ones((24, 32), jnp.bfloat16)}
    with pytest.raises(ValueError, match="not those the optimizer was initialised with"):
        tx.update(small_grads(0, other), state, other)
    jax_mlpo.close(state)
