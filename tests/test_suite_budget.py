"""The default suite's time budget (conftest.py, pytest.ini's time_budget): a whole default run whose tests
took longer in sum fails, over every xdist worker; a selection of tests is not held to it; with a reference step's
time in pytest.ini, the budget follows this machine's time of tests/reference_step.py."""
import pathlib
import shutil
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent


def run_suite(tmp_path, budget, *args, reference_step=None):
    """A suite of two tests of 0.6 s each (on two workers) under this conftest.py and the given budget (at the
    reference step's seconds, where given)."""
    (tmp_path / "tests").mkdir(exist_ok=True)
    for name in ("conftest.py", "reference_step.py"):
        shutil.copy(TESTS / name, tmp_path / "tests" / name)
    (tmp_path / "tests" / "test_slow.py").write_text(
        "import time\n\ndef test_a():\n    time.sleep(0.6)\n\ndef test_b():\n    time.sleep(0.6)\n")
    reference = "" if reference_step is None else f"time_budget_reference_step = {reference_step}\n"
    (tmp_path / "pytest.ini").write_text(f"[pytest]\ntestpaths = tests\ntime_budget = {budget}\n{reference}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout


@pytest.mark.parametrize("budget, passes", [(1.0, False), (30, True)])
def test_a_default_run_over_its_budget_fails(tmp_path, budget, passes):
    code, out = run_suite(tmp_path, budget)
    assert "2 passed" in out, out
    assert (code == 0) == passes, out
    assert ("OVER BUDGET" in out) != passes, out
    spent = float(out.split("summed test time ")[1].split(" s")[0])
    assert 1.2 <= spent < 30, out  # both workers' tests, summed


def test_a_selection_is_not_held_to_the_budget(tmp_path):
    code, out = run_suite(tmp_path, 1.0, "-k", "test_a or test_b")
    assert code == 0 and "not checked" in out, out


@pytest.mark.parametrize("budget, reference_step, passes", [(30, 1000, False), (1.0, 0.001, True)])
def test_the_budget_follows_the_machines_time_of_the_reference_step(tmp_path, budget, reference_step, passes):
    """30 s at a reference step of 1,000 s is well under a second here (the step takes seconds), and 1 s at a
    step of a millisecond thousands of seconds."""
    code, out = run_suite(tmp_path, budget, reference_step=reference_step)
    assert "2 passed" in out and "this machine's took" in out, out
    assert (code == 0) == passes and ("OVER BUDGET" in out) != passes, out
    step = float(out.split("this machine's took ")[1].split(" s")[0])
    scaled = float(out.split("budget of ")[1].split(" s")[0])
    assert 0.5 < step < 60 and abs(scaled / (budget * step / reference_step) - 1) < 0.01, out
