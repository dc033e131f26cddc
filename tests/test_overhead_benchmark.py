"""benchmarks/overhead.py as its users run it, small: every row beside the floor (no_exchange, the bare optimizer)
of the same optimizer, its steps taken in turn with the floor's, and the wrapped methods compressing from the first
timed step under AdamW."""
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
    methods = ["no_exchange", "horovod_fp16", "onebit"]
    assert all(r["interleaved"] == methods and len(r["step_ms_each"]) == 2 for r in rows.values())
    assert rows["no_exchange"]["added_ms"] is None
    assert all(0 < r["probe_ms"] < 1e4 for r in rows.values())  # the machine's pass that cost.py scales its costs by
    for method in methods[1:]:  # the median of the paired differences: of two, their mean
        paired = [t - f for t, f in zip(rows[method]["step_ms_each"], rows["no_exchange"]["step_ms_each"])]
        assert abs(rows[method]["added_ms"] - sum(paired) / 2) < 1e-9
    assert "| method | step ms | added to no_exchange, ms |" in proc.stdout
    assert "| onebit |" in proc.stdout and "AdamW(1e-3, weight_decay=0.01)" in proc.stdout


def test_a_published_table_names_the_cpus_generation(tmp_path):
    """benchmarks/results.machine, which every published table names: where the model name is only "AMD EPYC" (as
    in the virtual machines measured here, Zen 2 to Zen 4), the family, model and vector width tell them apart."""
    sys.path.insert(0, str(BENCHMARKS))
    import results
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 avx512f\n\nprocessor\t: 1\n"
                       "model name\t: other\n")
    assert results.machine(cpuinfo).endswith("CPUs (AMD EPYC, family 25 model 17, AVX-512)")
    cpuinfo.write_text("model name\t: Intel Xeon\nflags\t\t: fpu avx avx2\n")
    assert results.machine(cpuinfo).endswith("CPUs (Intel Xeon, AVX2)")
    assert results.machine(tmp_path / "absent").endswith("CPUs")
