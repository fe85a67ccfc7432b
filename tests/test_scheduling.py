"""The suite's own scheduling: tests that share a module-scoped fixture run on one
pytest-xdist worker (tests/conftest.py), so that fixture's set-up (a training run, an S3
server) runs once, not once per worker."""

import os

import pytest


@pytest.fixture(scope="module")
def set_up_in() -> int:
    return os.getpid()


@pytest.mark.parametrize("case", range(4))
def test_tests_sharing_a_module_fixture_run_in_one_process(case, set_up_in, request):
    assert request.node.get_closest_marker("xdist_group").args == (__name__,)
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getvalue("loadgroup"):
        # pytest-xdist schedules by nodeid: a group it honours is a suffix of it
        assert request.node.nodeid.endswith(f"@{__name__}"), request.node.nodeid
    assert set_up_in == os.getpid()
