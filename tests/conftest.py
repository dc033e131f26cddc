"""Test settings shared by every test module: the environment, set before TensorFlow loads; the lock of the
tests that build networks; the full matrix (--full), which the default run leaves out."""
import fcntl
import os
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# `@pytest.mark.full` marks the cases of a matrix that repeat, on another Keras, world size or layout, what a
# case of the default run already covers. `pytest --full` (`make test-full`) runs them too; the default run
# (`make test`) skips them, to keep the suite short on 2 cores.


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the full matrix: every Keras, world size and layout of the multi-rank tests")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: a case of the full matrix, run only with --full")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="full matrix only: pytest --full (make test-full)")
    for item in items:
        if item.get_closest_marker("full"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def full_matrix(request):
    """True under `pytest --full`: for a launch that covers a matrix inside one worker, the whole cross product
    instead of the default run's rotation, in which every pair of factors still meets."""
    return request.config.getoption("--full")


@pytest.fixture
def network_to_itself():
    """For tests that run a benchmark on its network namespaces (hc-wire-*, benchmarks/netns.py): one at a time
    on this machine. pytest-xdist runs test files side by side, and two such runs would share the namespaces'
    names and see each other's namespaces in their check that nothing is left behind."""
    # (read-only: a lock file another user made works too)
    lock = os.open(os.path.join(tempfile.gettempdir(), "hc-wire-tests.lock"), os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)
