"""Bad input refused with the cause and the fix; optax compositions against optax itself.

Each misuse gets an error that names what is wrong and what to do, never a silent wrong
result; each composition follows the same composition of ``optax.adamw`` within 1e-6.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax_mlpo
from jax_mlpo.checkpoint.manifest import CHECKSUMS_FILE, FORMAT

STEPS = 6


def _config(tmp_path, name="tier"):
    return jax_mlpo.OffloadConfig(host_cache=3 * 8 * 256, subgroup_size=256, prefetch_depth=1,
                                  tiers=[jax_mlpo.FileTier(str(tmp_path / name))])  # fmt: skip


def _params(extra=None):
    rng = np.random.default_rng(0)
    params = {"b": jnp.asarray(rng.standard_normal(24), jnp.float32),
              "w": jnp.asarray(rng.standard_normal((32, 24)), jnp.float32)}  # fmt: skip
    return {**params, **(extra or {})}


def _grads(step, params):
    return jax.tree.map(lambda p: jnp.cos(p * (step + 1)) * 0.3 + 0.01 * step, params)


def _train(tx, params, steps=STEPS):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(steps):
        updates, state = update(_grads(i, params), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _assert_params_close(got, want):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):  # fmt: skip
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.int32])
def test_params_of_other_dtypes_are_refused_with_the_fix(dtype, tmp_path):
    tx = jax_mlpo.adamw(1e-3, offload=_config(tmp_path))
    expected = r"optimizers support float32 and bfloat16 params.*optax\.masked"
    with pytest.raises(ValueError, match=expected):
        tx.init({"w": jnp.ones((4,), dtype)})


def test_a_mask_of_arrays_is_refused(tmp_path):
    tx = jax_mlpo.adamw(1e-3, offload=_config(tmp_path), mask={"b": jnp.array(False),
                                                               "w": jnp.array(True)})  # fmt: skip
    with pytest.raises(ValueError, match="mask leaves must be Python bools fixed at init"):
        tx.init(_params())


@pytest.mark.parametrize("change", ["tree", "reshape"])
def test_params_changed_after_init_are_refused(change, tmp_path):
    """A leaf added, or one reshaped to the same size (which the flat host state alone would
    not notice), fails the update with both shapes named."""
    params = _params()
    tx = jax_mlpo.adamw(1e-3, offload=_config(tmp_path))
    state = tx.init(params)
    if change == "tree":
        other = _params({"c": jnp.ones((3,))})
    else:
        other = {"b": params["b"], "w": params["w"].reshape(24, 32)}
    with pytest.raises(ValueError, match=r"not those the optimizer was initialised with.*\(32, "):
        jax.jit(tx.update)(other, state, other)
    _, state = jax.jit(tx.update)(params, state, params)  # the state is unharmed
    assert len(jax_mlpo.metrics(state)) == 1
    jax_mlpo.close(state)


def _saved_step_1(tmp_path):
    """A checkpoint of step 1 in ``tmp_path / "ckpt"``: the state saved, its manager, and a
    fresh optimizer's target to restore into."""
    params = _params()
    tx = jax_mlpo.adamw(1e-3, offload=_config(tmp_path))
    _, state = _train(tx, params, steps=1)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(1, args=jax_mlpo.checkpoint.OffloadSave({"opt": state}))
    mngr.wait_until_finished()
    target = {"opt": jax_mlpo.adamw(1e-3, offload=_config(tmp_path, "t2")).init(params)}
    return state, mngr, target


def test_restoring_a_missing_step_names_it(tmp_path):
    state, mngr, target = _saved_step_1(tmp_path)
    with pytest.raises(FileNotFoundError, match="5"):
        mngr.restore(5, args=jax_mlpo.checkpoint.OffloadRestore(target))
    mngr.close()
    jax_mlpo.close((state, target))


def test_an_unknown_checkpoint_format_is_refused_by_name(tmp_path):
    """A checkpoint whose manifest names a format this version cannot read is refused before
    anything is loaded, naming the formats it reads."""
    state, mngr, target = _saved_step_1(tmp_path)
    manifest = tmp_path / "ckpt" / "1" / "default" / CHECKSUMS_FILE
    body = json.loads(manifest.read_text())
    assert body["format"] == FORMAT
    body["format"] = 999
    manifest.write_text(json.dumps(body))
    with pytest.raises(jax_mlpo.CorruptCheckpointError, match="999"):
        mngr.restore(1, args=jax_mlpo.checkpoint.OffloadRestore(target))
    mngr.close()
    jax_mlpo.close((state, target))


# -- optax compositions, against the same composition of optax.adamw ---------------------------

HYPER = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.05)  # none of them the defaults


def _compose(kind, adamw):
    if kind == "plain":
        return adamw(3e-3, **HYPER)
    if kind == "pytree-mask":  # weight decay on the matrix only, as a pytree of bools
        return adamw(3e-3, mask={"b": False, "w": True}, **HYPER)
    if kind == "masked":
        return optax.masked(adamw(3e-3, **HYPER), {"b": False, "w": True})
    if kind == "multi_transform":
        return optax.multi_transform(
            {"adam": adamw(3e-3, **HYPER), "sgd": optax.sgd(1e-2)}, {"b": "sgd", "w": "adam"}
        )
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["plain", "pytree-mask", "masked", "multi_transform"])
def test_compositions_follow_optax(kind, tmp_path):
    params = _params()
    want, _ = _train(_compose(kind, optax.adamw), params)

    def offloaded(lr, **kwargs):
        return jax_mlpo.adamw(lr, offload=_config(tmp_path), **kwargs)

    got, state = _train(_compose(kind, offloaded), params)
    _assert_params_close(got, want)
    jax_mlpo.close(state)


def test_zero_size_leaves_follow_optax(tmp_path):
    """Empty leaves (a (0, 3) array) come back as empty updates; the others as optax's."""
    params = _params({"e": jnp.ones((0, 3)), "z": jnp.ones((5, 0))})
    want, _ = _train(optax.adamw(3e-3, **HYPER), params)
    got, state = _train(jax_mlpo.adamw(3e-3, offload=_config(tmp_path), **HYPER), params)
    assert got["e"].shape == (0, 3) and got["z"].shape == (5, 0)
    _assert_params_close(got, want)
    jax_mlpo.close(state)
