"""Bytes per worker per step and step time for a 10M-parameter MLP, n = 2 and 4 ranks.

    .venv/bin/python benchmarks/bytes_per_step.py            # launches horovodrun itself

For each method it runs `horovodrun -np N --gloo` on this machine and reports:
- accounted: what hvd_compress's exchanges say one worker sends per step;
- loopback: what crossed the loopback interface during the timed steps (the
  kernel's counter for `lo`, all ranks together, divided by N), which adds
  TCP/IP headers and Horovod's own negotiation messages to the payload;
- for sketches, the ring allreduce of r c + P k floats (+ the uncompressed ones);
- the dist-EF-SGD formula 2 (n-1)/n d (1/8 + 4/B) for the compressed tensors
  (one-way: (n-1) d (1/8 + 4/B)) plus the ring allreduce of the uncompressed
  ones (quantize, b bits: 2 (n-1)/n d (b/8 + 8/B), a scale and an offset per
  block), and how far the loopback measurement is from it;
- the median step time (forward, backward, exchange, update).
Methods: hc.methods' names (their defaults) and this benchmark's VARIANTS.
Writes results/bytes_per_step.json and prints a markdown table.
"""
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf_keras: the baselines are Horovod's Keras wrappers

from absl import app, flags  # noqa: E402

import launch  # noqa: E402
import results  # noqa: E402
from hvd_compress import methods as registry  # noqa: E402

flags.DEFINE_enum("role", "launcher", ["launcher", "worker"], "launcher starts the ranks.")
flags.DEFINE_list("ranks", ["2", "4"], "Numbers of ranks.")
flags.DEFINE_list("methods", ["none", "fp16", "onebit", "onebit_b256", "onebit_oneway", "quantize8", "quantize4",
                             "topk", "randomk", "sketch", "sketch32", "powersgd"],
                  "Methods to run: names of hc.methods' compressions (hc.methods.METHODS) or VARIANTS.")
flags.DEFINE_string("method", "none", "worker: the method.")
flags.DEFINE_integer("steps", 20, "Timed steps (after 3 warm-up steps).")
flags.DEFINE_integer("batch_size", 32, "Batch per rank.")
flags.DEFINE_string("result", None, "worker: where rank 0 writes its JSON.")
flags.DEFINE_string("out", "results/bytes_per_step.json", "launcher: the table's JSON.")
FLAGS = flags.FLAGS

LAYERS = [1000, 2000, 2000, 2000, 10]  # 10.0M parameters
#: this benchmark's methods beyond hc.methods' names: name -> (a name of hc.methods, its overrides)
VARIANTS = {"onebit_b256": ("onebit", dict(block_size=256)), "sketch32": ("sketch", dict(ratio=32))}
BASELINE = "none"  # fp32: Horovod's allreduce in hc.DistributedOptimizer


def loopback_bytes():
    for line in pathlib.Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmitted bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


def worker():
    import hvd_compress as hc
    import tensorflow as tf
    import horovod.tensorflow as hvd

    keras = hc.require_legacy_keras()
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    model = launch.mlp(keras, LAYERS)
    opt = launch.optimizer(hc, FLAGS.method, keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True), VARIANTS)
    step = launch.warm_step(keras, model, opt, FLAGS.batch_size)
    hvd.allreduce(tf.zeros([1]), name="before").numpy()
    before, times = loopback_bytes(), []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    hvd.allreduce(tf.zeros([1]), name="after").numpy()
    measured = (loopback_bytes() - before) / FLAGS.steps / hvd.size()

    ex = opt.compression_exchange
    n, layout, compression = hvd.size(), ex.layout, ex.compression
    compressed = sum(layout.sizes[i] for i in layout.compressed)
    dense = sum(layout.sizes[i] for i in layout.dense)
    block = getattr(compression, "block_size", None)
    formula = None
    if isinstance(compression, hc.Compression.sketch):  # ring allreduce of r c + P k floats, whatever n
        sketch = ex.exchanges[0]
        formula = 2 * (n - 1) / n * 4 * (sketch.rows * sketch.cols + sketch.num_candidates + dense)
    if isinstance(compression, hc.Compression.powersgd):  # ring allreduces of P [n, r] and Q [m, r] per matrix
        formula = 2 * (n - 1) / n * 4 * (sum(e.compressor.rank * sum(mat) for e in ex.exchanges
                                             for mat in e.matrices) + dense)
    if isinstance(compression, hc.Compression.onebit):
        num_blocks = sum(len(e.bounds) - 1 for e in ex.exchanges)
        bytes_per_element = 1 / 8 + 4 * num_blocks / compressed if block is None else 1 / 8 + 4 / block
        factor = 2 * (n - 1) / n if compression.two_way else n - 1  # two-way: sharded server; one-way: allgather
        formula = factor * compressed * bytes_per_element + 2 * (n - 1) / n * 4 * dense
    if isinstance(compression, hc.Compression.quantize):  # two-way, b-bit codes, a scale and an offset per block
        formula = 2 * (n - 1) / n * (compressed * (compression.bits / 8 + 8 / block) + 4 * dense)
    if hvd.rank() == 0:
        pathlib.Path(FLAGS.result).write_text(json.dumps(dict(
            method=FLAGS.method, ranks=n, params=int(sum(layout.sizes)), compressed=compressed,
            accounted=ex.bytes_sent, loopback=measured, formula=formula,
            fp32_allreduce=ex.uncompressed_bytes, step_ms=1000 * statistics.median(times))))


def main(_):
    if FLAGS.role == "worker":
        return worker()
    launch.check_names("bytes_per_step.py", "methods", FLAGS.methods, [*registry.METHODS, *VARIANTS])
    rows = []
    for ranks in map(int, FLAGS.ranks):
        for method in FLAGS.methods:
            rows.append(launch.run_worker(
                __file__, ranks, [f"--method={method}", f"--steps={FLAGS.steps}",
                                  f"--batch_size={FLAGS.batch_size}"],
                threads_per_rank=max(1, os.cpu_count() // ranks)))
            r = rows[-1]
            print(f"n={ranks} {method}: accounted {r['accounted']:.0f} B, loopback {r['loopback']:.0f} B, "
                  f"step {r['step_ms']:.1f} ms", flush=True)
    print("\n| n | method | accounted bytes/step | loopback bytes/step | formula | loopback vs formula "
          f"| fp32 / ours | step ms | step vs {launch.label(BASELINE)} |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        fp32 = next((x for x in rows if x["ranks"] == r["ranks"] and x["method"] == BASELINE), None)
        step_versus = f"{r['step_ms'] / fp32['step_ms']:.2f}" if fp32 else "-"
        formula = f"{r['formula']:.0f}" if r["formula"] else "-"
        versus = f"{r['loopback'] / r['formula'] - 1:+.1%}" if r["formula"] else "-"
        print(f"| {r['ranks']} | {r['method']} | {r['accounted']:.0f} | {r['loopback']:.0f} | {formula} | "
              f"{versus} | {r['fp32_allreduce'] / r['accounted']:.1f}x | {r['step_ms']:.1f} | "
              f"{step_versus} |")
    print(f"\n{rows[0]['params']} parameters")
    results.save(FLAGS.out, rows)
    publish(rows)


def render(rows):
    """The rows as docs/benchmarks.md shows them: accounted and loopback bytes per worker per step, the formula,
    and the step time against fp32's at the same number of ranks."""
    note = (f"{rows[0]['params']:,}-parameter MLP on loopback (Gloo); bytes per worker per step; median step "
            "ms; step vs fp32: this step over fp32's at the same number of ranks.")
    table_rows = []
    for r in rows:
        fp32 = next((x for x in rows if x["ranks"] == r["ranks"] and x["method"] in ("none", "fp32")), None)
        table_rows.append([r["ranks"], r["method"], results.count(r["accounted"]), results.count(r["loopback"]),
                           results.count(r["formula"]) if r["formula"] else "-",
                           f"{r['loopback'] / r['formula'] - 1:+.1%}" if r["formula"] else "-",
                           f"{r['fp32_allreduce'] / r['accounted']:.1f}x", f"{r['step_ms']:.1f}",
                           f"{r['step_ms'] / fp32['step_ms']:.2f}" if fp32 else "-"])
    table = results.markdown_table(["n", "method", "accounted", "loopback", "formula", "loopback vs formula",
                                    "fp32 / method", "step ms", "step vs fp32"], table_rows,
                                   align=["r", "l"] + ["r"] * 7)
    return f"{note}\n\n{table}"


def publish(rows):
    """The table in docs/benchmarks.md: bytes_per_step."""
    results.publish("bytes_per_step", render(rows), results.command_line(), source=FLAGS.out)


if __name__ == "__main__":
    app.run(results.run(main, publish))
