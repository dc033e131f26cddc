"""Step time with one slow rank: allreduce SGD (hc.methods' none) beside SGP and overlap SGP.

    .venv/bin/python benchmarks/straggler.py [--ranks=4] [--delay_ms=100]

Rank 1 sleeps `delay_ms` before every step (a straggler). The paper's claim is
that gossip tolerates stragglers better than allreduce. On Horovod every
collective, alltoall included, is negotiated by all ranks of its process set
and runs in lockstep, so a slow rank delays everyone's gossip too; this
measures how much of the claim survives. Prints a markdown table and writes
results/straggler.json.
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

flags.DEFINE_enum("role", "launcher", ["launcher", "worker"], "launcher starts the ranks.")
flags.DEFINE_integer("ranks", 4, "Ranks.")
flags.DEFINE_integer("delay_ms", 100, "Sleep of the slow rank before each step.")
flags.DEFINE_integer("steps", 30, "Timed steps.")
flags.DEFINE_string("method", "none", "worker: one of METHODS.")
flags.DEFINE_integer("delay", 0, "worker: this run's delay in ms.")
flags.DEFINE_string("result", None, "worker: where rank 0 writes its JSON.")
flags.DEFINE_string("out", "results/straggler.json", "launcher: the table's JSON.")
FLAGS = flags.FLAGS
LAYERS = [512, 1024, 1024, 10]  # 1.6M parameters
#: this benchmark's methods beyond hc.methods' names: name -> (a name of hc.methods, its overrides)
VARIANTS = {"sgp_overlap": ("sgp", dict(overlap=True))}
#: allreduce (Horovod's fp32 in hc.DistributedOptimizer), gossip, gossip overlapping the next step
METHODS = ("none", "sgp", "sgp_overlap")


def worker():
    import hvd_compress as hc
    import tensorflow as tf
    import horovod.tensorflow as hvd

    keras = hc.require_legacy_keras()
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    model = launch.mlp(keras, LAYERS)
    sgd = keras.optimizers.SGD(0.01, momentum=0.9)
    opt = launch.optimizer(hc, FLAGS.method, sgd, VARIANTS)
    step = launch.warm_step(keras, model, opt, 32)
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        if hvd.rank() == 1 and FLAGS.delay:
            time.sleep(FLAGS.delay / 1000)
        step().numpy()
        times.append(time.perf_counter() - start)
    # Every rank's median, so the fast ranks' view is visible too.
    medians = hvd.allgather_object(1000 * statistics.median(times), name="medians")
    if hvd.rank() == 0:
        pathlib.Path(FLAGS.result).write_text(json.dumps(medians))


def main(_):
    if FLAGS.role == "worker":
        return worker()
    rows = []
    for method in METHODS:
        for delay in (0, FLAGS.delay_ms):
            medians = launch.run_worker(__file__, FLAGS.ranks, [f"--method={method}", f"--delay={delay}",
                                                                f"--steps={FLAGS.steps}"])
            rows.append(dict(method=method, delay_ms=delay, median_step_ms=medians))
            print(f"{method} delay {delay} ms: median step per rank {[round(m, 1) for m in medians]}",
                  flush=True)
    print(f"\n{FLAGS.ranks} ranks, rank 1 sleeps before every step; median step time in ms "
          "(fastest rank / slowest rank)\n")
    print("| method | no straggler | straggler | added by the straggler |")
    print("|---|---:|---:|---:|")
    for method in METHODS:
        calm, slow = [r["median_step_ms"] for r in rows if r["method"] == method]
        print(f"| {method} | {min(calm):.1f} / {max(calm):.1f} | {min(slow):.1f} / {max(slow):.1f} | "
              f"{min(slow) - min(calm):.1f} |")
    results.save(FLAGS.out, rows)
    publish(rows)


def render(rows):
    """The rows as docs/benchmarks.md shows them: median step ms, fastest / slowest rank, without and with the
    straggler."""
    delay = max(r["delay_ms"] for r in rows)
    note = (f"{len(rows[0]['median_step_ms'])} ranks, 1.6M-parameter MLP; rank 1 sleeps {delay} ms before every "
            "step; median step ms, fastest rank / slowest rank.")
    table_rows = []
    for method in dict.fromkeys(r["method"] for r in rows):
        calm, slow = ([r["median_step_ms"] for r in rows if r["method"] == method and r["delay_ms"] == d][0]
                      for d in (0, delay))
        table_rows.append([method, f"{min(calm):.1f} / {max(calm):.1f}", f"{min(slow):.1f} / {max(slow):.1f}",
                           f"{min(slow) - min(calm):.1f}"])
    table = results.markdown_table(["method", "no straggler", "straggler", "added by the straggler"], table_rows)
    return f"{note}\n\n{table}"


def publish(rows):
    """The table in docs/benchmarks.md: straggler."""
    results.publish("straggler", render(rows), results.command_line(), source=FLAGS.out)


if __name__ == "__main__":
    app.run(results.run(main, publish))
