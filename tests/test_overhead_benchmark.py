"""benchmarks/overhead.py as its users run it, small: every row beside the floor (no_exchange, the bare optimizer)
of the same optimizer, and the wrapped methods compressing from the first timed step under AdamW."""
import json
import os
import pathlib
import subprocess
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def test_every_row_stands_beside_no_exchange_of_the_same_optimizer(tmp_path):
    out = tmp_path / "overhead.json"  # outside the repository: nothing is published
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "overhead.py"), "--models=digits_cnn",
                           "--methods=no_exchange,horovod_fp16,onebit", "--optimizer=adamw", "--steps=2", "--warmup=2",
                           "--profile_steps=1", f"--out={out}"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"no_exchange", "horovod_fp16", "onebit"}
    assert {r["optimizer"] for r in rows.values()} == {"adamw"} and all(r["step_ms"] > 0 for r in rows.values())
    assert {r["tf_cpu_allocator"] for r in rows.values()} == {"bfc"}  # the benchmarks' default allocator
    assert "| method | step ms | vs no_exchange |" in proc.stdout
    assert "| onebit |" in proc.stdout and "AdamW(1e-3, weight_decay=0.01)" in proc.stdout
