"""Fixtures: every test's engines are closed when it ends, failed or not; ``small_disk``.

(The repository root is on ``sys.path`` through pytest's ``pythonpath`` setting in
pyproject.toml, for ``models`` and ``experiments``.)
"""

import subprocess

import jax.numpy as jnp
import pytest

from jax_mlpo import registry
from jax_mlpo.opt_state import OffloadedAdamWState


@pytest.fixture(autouse=True)
def close_engines_left_open():
    """Closes the engines opened during the test that it did not close itself.

    A test whose assertion fails before its ``jax_mlpo.close`` would otherwise keep its tier
    locks and threads for the rest of the session (and its tier directory's lock could make a
    later test fail for the wrong reason).
    """
    before = set(registry._ENGINES)  # the registry behind jax_mlpo.close (module fixtures')
    yield
    for handle in set(registry._ENGINES) - before:
        state = OffloadedAdamWState(
            count=jnp.zeros([], jnp.int32), handle=jnp.asarray(handle, jnp.int32)
        )
        registry.close(state)


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (needs root); unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
