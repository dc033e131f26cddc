"""The default suite's time budget (conftest.py, pytest.ini's time_budget): a whole default run whose tests
took longer in sum fails, over every xdist worker; a selection of tests is not held to it."""
import pathlib
import shutil
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent


def run_suite(tmp_path, budget, *args):
    """A suite of two tests of 0.6 s each (on two workers) under this conftest.py and the given budget."""
    (tmp_path / "tests").mkdir(exist_ok=True)
    shutil.copy(TESTS / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_slow.py").write_text(
        "import time\n\ndef test_a():\n    time.sleep(0.6)\n\ndef test_b():\n    time.sleep(0.6)\n")
    (tmp_path / "pytest.ini").write_text(f"[pytest]\ntestpaths = tests\ntime_budget = {budget}\n")
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
