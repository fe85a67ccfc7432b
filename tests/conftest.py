"""Fixtures: a test that leaves an optimizer open fails (and its optimizers are closed);
``small_disk``; ``worker_env``; ``server`` (an S3 server).

(The repository root is on ``sys.path`` through pytest's ``pythonpath`` setting in
pyproject.toml, for ``models`` and ``experiments``.)
"""

import os
import subprocess

import jax.numpy as jnp
import pytest

from jax_mlpo.transforms import registry
from jax_mlpo.transforms.opt_state import OffloadedAdamWState


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item, for the fixtures' teardown to read."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def no_optimizer_left_open(request):
    """Fails a test that leaves an optimizer open (and closes it).

    An open optimizer keeps its tier locks and threads for the rest of the test run, and its
    tier directory's lock could make a later test fail for the wrong reason. A test that failed
    anyway is not failed twice: its optimizers are closed quietly.
    """
    before = set(registry.open_handles())  # module fixtures' optimizers stay open
    yield
    left = set(registry.open_handles()) - before
    for handle in left:
        registry.close(
            OffloadedAdamWState(count=jnp.zeros([], jnp.int32), handle=jnp.asarray(handle))
        )
    call = getattr(request.node, "report_call", None)
    if left and call is not None and call.passed:
        pytest.fail(
            f"the test left {len(left)} optimizer handle(s) open: close its optimizer state "
            "(jax_mlpo.close(opt_state), or with jax_mlpo.closing(opt_state))"
        )


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (needs root); unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True
    )
    if mount.returncode != 0:  # failed, not skipped: a skip would pass CI with nothing checked
        pytest.fail(
            "the full-disk tests need a small file system: mounting an 8 MiB tmpfs failed "
            f"({mount.stderr.decode().strip()}); run them as root (or where mount is allowed)"
        )
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture(scope="module")
def worker_env(tmp_path_factory) -> dict[str, str]:
    """Subprocess environment: CPU, and a compilation cache shared by the workers."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture(scope="module")
def server():
    """A real S3 server (moto_server) for the module, with dummy credentials in the
    environment."""
    from experiments.s3_server import S3Server, dummy_credentials

    with dummy_credentials():
        s3 = S3Server().start()
        yield s3
        s3.kill()
