"""Test settings shared by every test module: the environment, set before TensorFlow loads; the lock of the
tests that build networks."""
import fcntl
import os
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


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
