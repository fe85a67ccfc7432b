"""Fixtures every test gets: the engines a test opened are closed when it ends, failed or not.

(The repository root is on ``sys.path`` through pytest's ``pythonpath`` setting in
pyproject.toml, for ``models`` and ``experiments``.)
"""

import jax.numpy as jnp
import pytest

from jax_mlpo import transform


@pytest.fixture(autouse=True)
def close_engines_left_open():
    """Closes the engines opened during the test that it did not close itself.

    A test whose assertion fails before its ``jax_mlpo.close`` would otherwise keep its tier
    locks and threads for the rest of the session (and its tier directory's lock could make a
    later test fail for the wrong reason).
    """
    before = set(transform._ENGINES)  # the registry behind jax_mlpo.close (module fixtures')
    yield
    for handle in set(transform._ENGINES) - before:
        state = transform.OffloadedAdamWState(
            count=jnp.zeros([], jnp.int32), handle=jnp.asarray(handle, jnp.int32)
        )
        transform.close(state)
