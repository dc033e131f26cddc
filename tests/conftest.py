"""Test settings shared by every test module: the environment, set before TensorFlow loads; how pytest-xdist
shares the tests among its workers; the lock of the tests that build networks."""
import fcntl
import os
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the marks into the tests' ids
def pytest_collection_modifyitems(items):
    """pytest-xdist (--dist loadgroup) runs the tests that share a fixture of module scope (mostly one horovodrun
    launch that several tests read) on one worker, one group per value of its parameters (test_keras_features.py's
    launch in each Keras: two groups); every other test goes to whichever worker is free. Groups go first (their
    tests are many: --loadscope-reorder), so the long launches start early and the single tests fill the end."""
    for item in items:
        shared = sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                        if defs[-1].scope != "function" and defs[-1].baseid.startswith("tests/"))
        if shared:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            values = "".join(f"-{name}={params[name]}" for name in shared if name in params)  # as pytest shares them
            item.add_marker(pytest.mark.xdist_group(item.path.stem + values))


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
