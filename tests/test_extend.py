"""jax_mlpo.extend: docs/extending.md's optimizers, run from the page, against optax.lion; the
scalar vector by name; jax_mlpo.muon built once."""

from __future__ import annotations

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
TOLERANCE = {"numpy_lion": 1e-6, "native_lion": 1e-7}


def _page() -> dict:
    """The page's definitions (its first two blocks), as a reader would paste them."""
    namespace: dict = {}
    for block in BLOCKS[:2]:
        exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


def _config(path: Path) -> jax_mlpo.OffloadConfig:
    # subgroups of 256 elements, most of them on the tier (8 bytes each: m and a master)
    return jax_mlpo.OffloadConfig(host_cache=3 * 8 * 256, subgroup_size=256, prefetch_depth=1,
                                  tiers=[jax_mlpo.FileTier(str(path))])  # fmt: skip


def _decay_matrices(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def test_the_page_has_its_three_blocks_and_its_loop_runs(tmp_path, monkeypatch):
    assert len(BLOCKS) == 3
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loop uses the native one: no NumPy warning
        for block in BLOCKS:
            exec(compile(block, str(PAGE), "exec"), namespace)
    assert namespace["state"].count == 3


CLASSES = {"numpy_lion": "NumpyLion", "native_lion": "NativeLion"}


@pytest.mark.parametrize("masked", [False, True], ids=["page", "mask"])
@pytest.mark.parametrize("factory", ["numpy_lion", "native_lion"])
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


@pytest.mark.parametrize("factory", ["numpy_lion", "native_lion"])
def test_bfloat16_params_keep_an_fp32_master(factory, tmp_path):
    """bfloat16 params: the state's fp32 master follows optax.lion on float32 params fed the
    same gradients, and the params are that master rounded (``update_dtype=float32`` makes
    ``apply_updates`` land on it exactly)."""
    optimizer = _page()[CLASSES[factory]]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tx = extend.offloaded_transformation(
            optimizer, learning_rate=1e-2, offload=_config(tmp_path / "tier"),
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


def test_inject_hyperparams_reaches_the_numpy_update(tmp_path):
    """The learning rate and b1 as per-step arrays, changed mid-run, read by name on the host."""
    make = _page()["numpy_lion"]
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

    config = jax_mlpo.OffloadConfig(host_cache="16MiB", tiers=[jax_mlpo.FileTier(str(tmp_path))])
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
