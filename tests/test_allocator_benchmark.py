"""benchmarks/allocator.py as its users run it, on one example: each allocator's run is timed in the same
run, and the examples themselves default to the BFC allocator where the environment names none."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_the_digits_example_runs_with_either_allocator(tmp_path):
    out = tmp_path / "allocator.json"  # outside the repository: nothing is published
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "allocator.py"), "--examples=keras_digits",
                           "--timeout=240", f"--out={out}"],
                          capture_output=True, text=True, timeout=280, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["examples"]) == {"keras_digits"} and figures["ranks"] == 2
    assert set(figures["examples"]["keras_digits"]) == {"default", "bfc"}
    assert all(seconds > 0 for seconds in figures["examples"]["keras_digits"].values())
    assert re.search(r"\| keras_digits \| --epochs=2 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", proc.stdout)


def test_every_example_sets_the_bfc_allocator_before_tensorflow_starts():
    for script in sorted((REPO / "examples").glob("keras_*.py")):
        text = script.read_text()
        line = text.find('os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")')
        assert line >= 0, f"{script.name} does not set TF_CPU_ALLOCATOR_USE_BFC"
        assert line < text.find("import tensorflow"), f"{script.name} sets it after importing TensorFlow"
