"""What Horovod's collectives cost the CPU between the ranks of one host: the cost model's two CPU terms, measured.

    .venv/bin/python benchmarks/host_collectives.py [--ranks=2] [--launchers=gloo,mpi]

Runs --ranks ranks on this host (loopback, no shaping) under each launcher and times, median of --repeats after
one untimed call, each collective on `--elements` float32 values (the 25M MLP's gradient by default):
- allreduce of the whole vector in float32 and in float16, and of half of it in float32: the float16 one moves
  the same bytes as the half, so their difference is what adding float16 costs beyond float32. Gloo adds
  float16 in software, one element at a time; the cost model charges it per element a rank reduces
  ((n - 1) / n of the vector in a ring), as `half_sum_ns` (cost.Machine.half_sum_per_element_s);
- an alltoall of the vector and an allgather of a 1 / n share of it: the two full-precision stages inside a host
  of `hierarchical=True`, whose bytes (2 (n - 1) / n x 4 bytes an element) over their time are the rate the
  ranks of one CPU host reach each other (`loopback_gbit`: cost.Machine.loopback_rate_bps);
- the probe's pass (cost.probe_s), on every rank at once, which scales these figures to another machine.
Writes --out and publishes the table `host_collectives` in docs/cost_model.md.
"""
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import launch  # noqa: E402
import results  # noqa: E402

flags.DEFINE_enum("role", "launcher", ["launcher", "worker"], "launcher starts the ranks.")
flags.DEFINE_integer("ranks", 2, "Ranks on this host.")
flags.DEFINE_list("launchers", ["gloo", "mpi"], "Launchers to measure under (Horovod's collectives over each).")
flags.DEFINE_integer("elements", 25_236_710, "float32 elements of the vector (default: the 25M MLP's gradient).")
flags.DEFINE_integer("repeats", 7, "Timed calls of each collective (the median is reported).")
flags.DEFINE_string("result", None, "worker: where rank 0 writes its JSON.")
flags.DEFINE_string("out", "results/host_collectives.json", "launcher: the table's JSON.")
FLAGS = flags.FLAGS


def worker():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvd_compress import cost

    hvd.init()
    n, d = hvd.size(), FLAGS.elements

    def median_ms(collective, x):
        run = tf.function(collective)
        run(x).numpy()
        times = []
        for _ in range(FLAGS.repeats):
            hvd.allreduce(tf.zeros([1]), name="host_collectives.barrier").numpy()
            begin = time.perf_counter()
            run(x).numpy()
            times.append(time.perf_counter() - begin)
        return 1e3 * statistics.median(times)

    whole = tf.random.uniform([d])
    half = whole[: d // 2]
    ms = dict(
        allreduce_fp32=median_ms(lambda x: hvd.allreduce(x, op=hvd.Sum, name="fp32"), whole),
        allreduce_fp16=median_ms(lambda x: hvd.allreduce(x, op=hvd.Sum, name="fp16"), tf.cast(whole, tf.float16)),
        allreduce_fp32_half=median_ms(lambda x: hvd.allreduce(x, op=hvd.Sum, name="fp32_half"), half),
        alltoall=median_ms(lambda x: hvd.alltoall(x, name="alltoall")[0], whole[: d - d % n]),
        allgather_share=median_ms(lambda x: hvd.allgather(x, name="allgather"), whole[: d // n]))
    hvd.allreduce(tf.zeros([1]), name="host_collectives.before_probe").numpy()
    probe_ms = 1e3 * cost.probe_s()
    figures = dict(ranks=n, elements=d, ms=ms, probe_ms=max(hvd.allgather_object(probe_ms, name="probes")),
                   half_sum_ns=1e6 * (ms["allreduce_fp16"] - ms["allreduce_fp32_half"]) / ((n - 1) / n * d),
                   loopback_gbit=2 * 4 * d * (n - 1) / n * 8 / (ms["alltoall"] + ms["allgather_share"]) / 1e6)
    if hvd.rank() == 0:
        pathlib.Path(FLAGS.result).write_text(json.dumps(figures))


def render(rows):
    note = ("Horovod's collectives between ranks of this host (loopback), median ms of each call. *float16's sum*: "
            "the float16 allreduce less the float32 allreduce of the same bytes, per element a rank adds "
            "((n - 1) / n of the vector); *between ranks*: the alltoall's and the allgather's bytes (a "
            "hierarchical exchange's stages inside a host) over their time; *probe*: cost.probe_s on every rank "
            "at once, the slowest.")
    table = results.markdown_table(
        ["launcher", "ranks", "elements", "allreduce fp32", "allreduce fp16", "fp32, half the elements",
         "alltoall", "allgather of 1/n", "float16's sum ns/element", "between ranks Gbit/s", "probe ms"],
        [[r["launcher"], r["ranks"], f"{r['elements']:,}", *(f"{r['ms'][k]:,.1f}" for k in (
            "allreduce_fp32", "allreduce_fp16", "allreduce_fp32_half", "alltoall", "allgather_share")),
          f"{r['half_sum_ns']:.1f}", f"{r['loopback_gbit']:.1f}", f"{r['probe_ms']:.1f}"] for r in rows])
    return f"{note}\n\n{table}"


def publish(rows):
    results.publish("host_collectives", render(rows), source=FLAGS.out, doc=results.REPO / "docs" / "cost_model.md")


def main(_):
    if FLAGS.role == "worker":
        return worker()
    launch.check_names("host_collectives.py", "launchers", FLAGS.launchers, ("gloo", "mpi"))
    rows = []
    for launcher in FLAGS.launchers:
        figures = launch.run_worker(__file__, FLAGS.ranks, [f"--elements={FLAGS.elements}",
                                                            f"--repeats={FLAGS.repeats}"], launcher=launcher)
        rows.append(dict(launcher=launcher, **figures))
        print(f"{launcher}: {json.dumps(figures)}", flush=True)
    results.save(FLAGS.out, rows)
    print("\n" + render(rows))
    publish(rows)


if __name__ == "__main__":
    app.run(results.run(main, publish))
