"""The GPU kernels of tf_ops/gpu/, standalone: each against the NumPy reference of its op (tests/np_reference.py,
the one the CPU kernels are tested against) on many sizes, bit for bit,
on a non-blocking CUDA stream (as TensorFlow runs them), and its throughput in GB/s (bytes read + written over the kernel's time) beside a device-to-device copy.

    python tests/gpu/harness.py                      # on a machine with a CUDA GPU, nvcc and CuPy
    python tests/gpu/harness.py --publish_only       # the table in docs/gpu.md, again from --out

Needs no TensorFlow. Builds the kernels with nvcc (tests/gpu/kernels.py) unless --library names a built one. Exits 1
when a check fails. Each family of ops has its module (check_<family>.py: `check(run)` and `bench(run)`)."""
import importlib
import json
import pathlib
import sys
import time

import numpy as np
from absl import app, flags

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "benchmarks")]
import kernels  # noqa: E402
import results  # noqa: E402

FAMILIES = ["check_sign", "check_feedback", "check_adam", "check_half", "check_topk", "check_quantize",
            "check_sketch", "check_pushsum"]

flags.DEFINE_string("out", "results/gpu_kernels.json", "Where the results go (JSON).")
flags.DEFINE_string("library", None, "A built kernel library to use (default: build tf_ops/gpu/*.cu with nvcc).")
flags.DEFINE_integer("n", 1 << 26, "Elements of the throughput runs.")
flags.DEFINE_integer("repeats", 20, "Timed runs per kernel (the median is reported).")
flags.DEFINE_string("commit", None, "The commit the working tree was copied from (where it travels without .git).")
flags.DEFINE_list("families", FAMILIES, "Families of kernels to run.")
FLAGS = flags.FLAGS


class Run:
    """What a family's checks and benchmarks use: the kernels, CuPy, a seeded generator, and the records."""

    def __init__(self, library, cp):
        self.k = kernels.Kernels(library, current_stream=lambda: cp.cuda.get_current_stream().ptr)
        self.cp, self.rng = cp, np.random.default_rng(0)
        self.checks, self.speeds = [], []
        self.copy_gbps = {}

    def expect(self, kernel, case, got, want):
        """Records whether `got` (device or host array) equals `want` (NumPy) bit for bit (NaN equals NaN: their
        payloads differ between processors)."""
        got = self.cp.asnumpy(got) if hasattr(got, "device") else np.asarray(got)
        want = np.asarray(want)
        ok = got.shape == want.shape and got.dtype == want.dtype
        worst = None
        if ok:
            if got.dtype.kind == "f":
                nan = np.isnan(got) & np.isnan(want)
                bits = got.view(f"u{got.itemsize}") == want.view(f"u{want.itemsize}")
                both = np.isfinite(got) & np.isfinite(want)
                diff = np.abs(got[both].astype(np.float64) - want[both].astype(np.float64))
                worst = float(diff.max()) if diff.size else 0.0
                ok = bool(np.all(bits | nan))
            else:
                ok = bool(np.array_equal(got, want))
        self.checks.append(dict(kernel=kernel, case=case, ok=ok, max_abs_diff=worst))
        if not ok:
            print(f"FAILED {kernel} [{case}]: max |diff| {worst}, shapes {got.shape}/{want.shape}, "
                  f"dtypes {got.dtype}/{want.dtype}", flush=True)

    def seconds(self, fn):
        """Median seconds of fn() over --repeats runs, after a warm-up, by CUDA events."""
        cp = self.cp
        fn()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(FLAGS.repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        return float(np.median(times))

    def time(self, kernel, case, n, nbytes, fn):
        """Records fn's throughput: nbytes (read + written) over its median time, and that as a fraction of a
        device-to-device copy that reads and writes as many bytes."""
        seconds = self.seconds(fn)
        gbps = nbytes / seconds / 1e9
        copy = self.copy(nbytes)
        self.speeds.append(dict(kernel=kernel, case=case, n=n, bytes=nbytes, ms=seconds * 1e3, gbps=gbps,
                                copy_gbps=copy, of_copy=gbps / copy))
        print(f"{kernel:28s} {case:32s} n={n}: {seconds * 1e3:8.3f} ms {gbps:8.1f} GB/s ({gbps / copy:.2f} of a copy)",
              flush=True)

    def copy(self, nbytes):
        """GB/s of a device-to-device copy of nbytes / 2 bytes (nbytes read + written)."""
        half = max(1, nbytes // 2)
        if half not in self.copy_gbps:
            x = self.cp.ones(half, self.cp.uint8)
            y = self.cp.empty_like(x)
            self.copy_gbps[half] = nbytes / self.seconds(lambda: y.__setitem__(Ellipsis, x)) / 1e9
        return self.copy_gbps[half]


def device_facts(cp):
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return dict(gpu=name, driver=cp.cuda.runtime.driverGetVersion(), runtime=cp.cuda.runtime.runtimeGetVersion(),
                nvcc=kernels.nvcc())


def main(_):
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        sys.exit(f"The GPU harness needs CuPy and a CUDA GPU: {e}")
    library = FLAGS.library or kernels.build()
    run = Run(library, cp)
    with cp.cuda.Stream(non_blocking=True):  # as TensorFlow's streams: no implicit order with the default stream
        for name in FLAGS.families:
            family = importlib.import_module(name)
            started = time.time()
            family.check(run)
            family.bench(run, FLAGS.n)
            print(f"{name}: {time.time() - started:.1f} s", flush=True)
    facts = device_facts(cp)
    failed = [c for c in run.checks if not c["ok"]]
    print(f"{len(run.checks) - len(failed)} of {len(run.checks)} checks passed on {facts['gpu']}", flush=True)
    results.save(FLAGS.out, dict(facts, checks=run.checks, speeds=run.speeds))
    if FLAGS.commit:  # the copy on a GPU machine may travel without .git
        facts_file = results.run_file(FLAGS.out)
        run_facts = json.loads(facts_file.read_text())
        run_facts["commit"] = FLAGS.commit
        facts_file.write_text(json.dumps(run_facts, indent=2) + "\n")
    if failed:
        sys.exit(1)


def publish(data):
    """The table of kernels: checks passed, throughput and its fraction of a copy."""
    rows = []
    for speed in data["speeds"]:
        checks = [c for c in data["checks"] if c["kernel"] == speed["kernel"]]
        rows.append([f"`{speed['kernel']}`", speed["case"], f"{sum(c['ok'] for c in checks)}/{len(checks)}",
                     f"{speed['n']:,}",
                     f"{speed['ms']:.3f}", f"{speed['gbps']:.0f}", f"{speed['of_copy']:.2f}"])
    table = results.markdown_table(["kernel", "timed case", "checks passed, bit for bit", "n", "ms", "GB/s",
                                    "of a copy"], rows, align=["l", "l", "r", "r", "r", "r", "r"])
    timed = {speed["kernel"] for speed in data["speeds"]}
    untimed = sorted({c["kernel"] for c in data["checks"]} - timed)
    checked = ", ".join(f"`{k}` ({sum(c['ok'] for c in data['checks'] if c['kernel'] == k)}/"
                        f"{sum(c['kernel'] == k for c in data['checks'])})" for k in untimed)
    passed = sum(c["ok"] for c in data["checks"])
    note = (f"On {data['gpu']} (CUDA driver API {version(data['driver'])}, runtime {version(data['runtime'])}): "
            f"{passed} of {len(data['checks'])} checks passed over {len(timed) + len(untimed)} launchers. GB/s counts "
            f"the bytes a kernel reads and writes; *of a copy* divides it by a device-to-device copy of as many bytes.")
    rest = f"\n\nChecked, not timed (checks passed): {checked}." if untimed else ""
    results.publish("gpu_kernels", note + "\n\n" + table + rest, source=FLAGS.out,
                    doc=results.REPO / "docs" / "gpu.md")


def version(number):
    """CUDA's version number (13020) as 13.2."""
    return f"{number // 1000}.{number % 1000 // 10}"


if __name__ == "__main__":
    app.run(results.run(main, publish))
