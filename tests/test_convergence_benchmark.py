"""benchmarks/convergence.py refuses a launch it cannot run, naming the fix, before any rank starts."""
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("flags, message", [
    (["--task=text", "--text_methods=none,sgp_mpi"],
     "methods ['sgp_mpi'] send point to point over MPI: add --launcher=mpi."),
    (["--task=digits", "--launcher=mpi"], "--launcher=mpi applies to --task=text only; the digits task launches with "
                                          "Gloo: drop --launcher."),
])
def test_a_launch_it_cannot_run_is_refused_before_anything_starts(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "convergence.py"), *flags, f"--out={tmp_path / 'c.json'}"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "c.json").exists()
