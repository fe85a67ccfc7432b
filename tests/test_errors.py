"""One error model: every exception of the library under :class:`jax_mlpo.JaxMlpoError`,
defined in ``jax_mlpo/errors.py``, and an update's own exception recovered from the XLA error
that reports it, so a training loop catches a tier's failure by type."""

from __future__ import annotations

import errno
import importlib
import inspect
import pkgutil

import jax
import optax
import pytest
from fault_training import Training, file_config

import jax_mlpo
from jax_mlpo.testing import tier_faults


def library_exceptions() -> list[type]:
    found = {}
    for info in pkgutil.walk_packages(jax_mlpo.__path__, "jax_mlpo."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("jax_mlpo"):
                found[obj.__qualname__, obj.__module__] = obj
    return list(found.values())


def test_every_exception_derives_from_one_base_in_errors_py():
    classes = library_exceptions()
    assert len(classes) >= 12  # the base and the eleven the library raises
    assert {c.__module__ for c in classes} == {"jax_mlpo.errors"}
    # every error under the one base; a warning (not raised) is a UserWarning, filterable so
    warnings = [c for c in classes if issubclass(c, Warning)]
    assert warnings == [jax_mlpo.UnusedTiersWarning]
    assert all(issubclass(c, UserWarning) for c in warnings)
    assert all(issubclass(c, jax_mlpo.JaxMlpoError) for c in classes if c not in warnings)
    # the builtin bases callers already catch stay
    assert issubclass(jax_mlpo.TierIOError, OSError)
    assert issubclass(jax_mlpo.ConfigError, ValueError)


def test_a_tier_failure_in_a_jitted_step_is_caught_by_its_type(tmp_path):
    """An update that fails on a tier read reaches the step as XLA's error; errors.typed()
    re-raises the tier's own exception, with its errno, chained to XLA's."""
    run = Training(file_config(tmp_path / "run", write_behind=False, read_ahead=False))
    run.run(1)

    @jax.jit
    def step(params, state, grads):
        updates, state = run.tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = jax.tree.map(jax.numpy.ones_like, run.params)
    with tier_faults(run.state) as plan:
        plan.fail("read", nth=1, errno=errno.EIO)
        with pytest.raises(jax_mlpo.TierIOError) as caught, jax_mlpo.errors.typed():
            jax.block_until_ready(step(run.params, run.state, grads))
    error = caught.value
    assert "Input/output error" in str(error)
    chain, link = [], error.__cause__  # the tier's own causes, down to the failed read's
    while link is not None:
        chain.append(link)
        link = link.__cause__
    assert errno.EIO in [getattr(c, "errno", None) for c in chain]
    reported = error.__context__
    assert type(reported).__name__ == "JaxRuntimeError"  # what XLA raised, kept in the chain
    assert jax_mlpo.errors.cause(reported) is error
    assert run.engine.failed
    jax_mlpo.close(run.state)


def test_typed_passes_other_errors_through():
    with pytest.raises(ZeroDivisionError), jax_mlpo.errors.typed():
        _ = 1 / 0
    assert jax_mlpo.errors.cause(ValueError("no mark here")) is None


def test_a_new_optimizer_checkpoints_after_another_ones_update_failed(tmp_path):
    """JAX re-raises the last failed side-effecting call's error at every barrier: the barriers
    before a save and in ``metrics`` pass an update's own failure, which its engine reports,
    so a new optimizer after a failed one trains, reports and saves."""
    failed = Training(file_config(tmp_path / "failed", write_behind=False, read_ahead=False))
    failed.run(1)
    with tier_faults(failed.state) as plan:
        plan.fail("read", nth=1, errno=errno.EIO)
        with pytest.raises(jax_mlpo.TierIOError), jax_mlpo.errors.typed():
            failed.run(1)
    with pytest.raises(jax_mlpo.EngineFailedError, match="failed midway"):
        failed.save(tmp_path / "refused")
    jax_mlpo.close(failed.state)
    with pytest.raises(jax_mlpo.NoEngineError, match=r"was closed \(jax_mlpo.close\)"):
        jax_mlpo.engine_of(failed.state)

    fresh = Training(file_config(tmp_path / "fresh"))
    fresh.run(2)
    assert [m.step for m in jax_mlpo.metrics(fresh.state)] == [1, 2]
    mngr = fresh.save(tmp_path / "ckpt")
    assert mngr.latest_step() == 2
    jax_mlpo.close(fresh.state)
