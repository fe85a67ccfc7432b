"""Fixtures: a test that leaves an optimizer open fails (and its optimizers are closed);
``small_disk``; ``worker_env``; ``server`` (an S3 server).

(The repository root is on ``sys.path`` through pytest's ``pythonpath`` setting in
pyproject.toml, for ``models``, and for ``experiments`` in the job's tests under ``tests/job``.)
"""

import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import pytest

from jax_mlpo.transforms import runtime
from jax_mlpo.transforms.opt_state import OffloadedAdamWState


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item, for the fixtures' teardown to read."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


# The persistent compilation cache's settings: every program, however quick to compile.
_CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def pytest_configure(config):
    """One persistent JAX compilation cache for the whole run: this process, the pytest-xdist
    workers and every subprocess a test starts (they inherit the environment) compile a
    program once and load it after that, where each would compile it again.

    A cache directory given in the environment is used as it is; otherwise the first process
    (pytest-xdist's controller, or a plain run) makes one, and removes it at the end.
    """
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config.jax_cache_made = tempfile.mkdtemp(prefix="jax_mlpo-tests-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config.jax_cache_made
    for name, value in _CACHE_ENV.items():
        os.environ.setdefault(name, value)
    # jax read the environment when this file imported it: tell this process too
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    min_s = float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)
    min_bytes = int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"])
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_bytes)


def pytest_unconfigure(config):
    made = getattr(config, "jax_cache_made", None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the marks
def pytest_collection_modifyitems(config, items):
    """Keeps the tests that share a module-scoped fixture on one pytest-xdist worker.

    Such a fixture is the module's expensive set-up (a training run in subprocesses, an S3
    server, a compilation cache): under ``--dist loadgroup`` the tests using it form one unit
    of work, so it is built once, as in a serial run; every other test is scheduled alone.
    """
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("xdist_group"):
            continue
        defs = info.name2fixturedefs
        if any(d[-1].scope in ("module", "package") for d in defs.values() if d):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(autouse=True)
def no_optimizer_left_open(request):
    """Fails a test that leaves an optimizer open (and closes it).

    An open optimizer keeps its tier locks and threads for the rest of the test run, and its
    tier directory's lock could make a later test fail for the wrong reason. A test that failed
    anyway is not failed twice: its optimizers are closed quietly.
    """
    before = set(runtime.RUNTIME.open_handles())  # module fixtures' optimizers stay open
    yield
    left = set(runtime.RUNTIME.open_handles()) - before
    for handle in left:
        runtime.close(
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
def worker_env() -> dict[str, str]:
    """Subprocess environment: CPU, and the run's compilation cache (``pytest_configure``)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def server():
    """A real S3 server (moto_server) for the module, with dummy credentials in the
    environment."""
    from jax_mlpo.testing.s3_server import S3Server, dummy_credentials

    with dummy_credentials():
        s3 = S3Server().start()
        yield s3
        s3.kill()
