"""Test settings shared by every test module: the environment, set before TensorFlow loads; the lock of the
tests that build networks; the full matrix (--full), which the default run leaves out; and the default
suite's time budget (pytest.ini's time_budget), which fails a whole default run whose tests took longer in
sum, scaled to this machine's speed."""
import fcntl
import os
import pathlib
import subprocess
import sys
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
    parser.addini("time_budget", "seconds the default suite's tests may take in sum (set-up, call and "
                  "teardown, over every worker); a whole default run over it fails", default="0")
    parser.addini("time_budget_reference_step", "seconds tests/reference_step.py took on the machine where "
                  "time_budget was set; where given, the budget is scaled by this machine's time of the same "
                  "step", default="0")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: a case of the full matrix, run only with --full")
    if not hasattr(config, "workerinput") and _whole_default_run(config):
        config.hc_reference_step = reference_step_seconds(config)


#: runs of tests/reference_step.py whose fastest is this machine's time of it
REFERENCE_STEP_RUNS = 3


def reference_step_seconds(config):
    """This machine's seconds for tests/reference_step.py (the fastest of REFERENCE_STEP_RUNS runs, before the
    workers start), where pytest.ini gives the reference machine's; else None (the budget is not scaled)."""
    if not float(config.getini("time_budget_reference_step")):
        return None
    script = pathlib.Path(__file__).with_name("reference_step.py")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return min(float(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                                    env=env, timeout=300).stdout.split()[-1]) for _ in range(REFERENCE_STEP_RUNS))


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


#: Seconds each test took (set-up, call and teardown), as the workers report them.
_durations = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def _whole_default_run(config):
    """The default suite as `make test` runs it: every test path, no selection, not the full matrix."""
    option = config.option
    return (not config.getoption("--full") and not option.keyword and not option.markexpr
            and not getattr(option, "lf", False) and not getattr(option, "failedfirst", False)
            and set(config.args) <= {str(p) for p in config.getini("testpaths")} | {"tests", str(config.rootpath / "tests")})


_budget_line = []


def pytest_sessionfinish(session):
    """The suite's summed test time against its budget; over it, a whole default run fails (the slowest
    tests, --durations, say where the time went). Runs before the terminal's summary, which prints the line.

    The budget is pytest.ini's time_budget, times this machine's time of tests/reference_step.py over the
    reference machine's where pytest.ini gives that: the same suite took 2,996 s in sum on one 2-core AMD EPYC and
    4,942 s on another, so a budget in plain seconds fails on slower machines without the suite having grown."""
    budget = float(session.config.getini("time_budget"))
    if not budget or not _durations or hasattr(session.config, "workerinput"):  # (the controller sums)
        return
    spent = sum(_durations.values())
    budget_said = f"{budget:.0f} s (pytest.ini)"
    step, reference = getattr(session.config, "hc_reference_step", None), float(
        session.config.getini("time_budget_reference_step"))
    if step:
        budget_said = (f"{budget * step / reference:.4g} s ({budget:.4g} s in pytest.ini at a reference step of "
                       f"{reference:.4g} s; this machine's took {step:.3f} s)")
        budget *= step / reference
    line = f"summed test time {spent:.1f} s against the default suite's budget of {budget_said}"
    if not _whole_default_run(session.config):
        _budget_line.append((line + ": not checked, not a whole default run", {}))
    elif spent > budget:
        _budget_line.append((line + ": OVER BUDGET, so the run fails; make the slowest tests cheaper", {"red": True}))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        _budget_line.append((line, {"green": True}))


def pytest_terminal_summary(terminalreporter):
    for line, markup in _budget_line:
        terminalreporter.write_line(line, **markup)
