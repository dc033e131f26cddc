"""Step time with slow ranks: allreduce SGD (hc.methods' none) beside SGP and overlap SGP, over Horovod's
alltoall and over MPI's point-to-point transport.

    .venv/bin/python benchmarks/straggler.py [--ranks=4] [--delay_ms=100]

Three conditions per method: no straggler; a persistent straggler (rank 1 sleeps `delay_ms` before every
step); random stragglers (before every step one rank, drawn from a seeded generator that every rank
shares, sleeps `delay_ms`). The paper's claim is that gossip tolerates stragglers: a late rank delays only
the ranks that wait for its messages. Over `hvd.alltoall` (sgp, sgp_overlap) every rank takes part in every
exchange in lockstep, so a slow rank delays everyone; over MPI (sgp_mpi, sgp_overlap_mpi:
PushSumOptimizer(transport="mpi")) a rank waits only for its in-peers, and with overlap only for what they
sent a step earlier, so a delay shorter than a step's compute is absorbed. Every method runs under the same
MPI launch (horovodrun --mpi), so the rows compare. Prints a markdown table and writes results/straggler.json.
"""
import collections
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
flags.DEFINE_integer("delay_ms", 100, "Sleep of a straggler before a step.")
flags.DEFINE_integer("steps", 100, "Timed steps (random stragglers: the more, the closer each rank's share of the "
                     "sleeps comes to 1 / ranks).")
flags.DEFINE_list("methods", ["none", "sgp", "sgp_overlap", "sgp_mpi", "sgp_overlap_mpi"], "Methods (METHODS).")
flags.DEFINE_string("method", "none", "worker: one of METHODS.")
flags.DEFINE_enum("straggler", "none", ["none", "persistent", "random"], "worker: who sleeps before a step.")
flags.DEFINE_string("result", None, "worker: where rank 0 writes its JSON.")
flags.DEFINE_string("out", "results/straggler.json", "launcher: the table's JSON.")
FLAGS = flags.FLAGS
LAYERS = [512, 1024, 1024, 10]  # 1.6M parameters
#: allreduce (Horovod's fp32 in hc.DistributedOptimizer), gossip, gossip overlapping the next step, both over MPI
METHODS = ("none", "sgp", "sgp_overlap", "sgp_mpi", "sgp_overlap_mpi")
STRAGGLERS = ("none", "persistent", "random")


def sleeper(straggler, step, ranks):
    """The rank that sleeps before `step` under `straggler` (None: nobody)."""
    import numpy as np

    if straggler == "persistent":
        return 1
    if straggler == "random":
        return int(np.random.default_rng([7, step]).integers(ranks))
    return None


def worker():
    import hvd_compress as hc
    import tensorflow as tf
    import horovod.tensorflow as hvd

    keras = hc.require_legacy_keras()
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    model = launch.mlp(keras, LAYERS)
    sgd = keras.optimizers.SGD(0.01, momentum=0.9)
    opt = launch.optimizer(hc, FLAGS.method, sgd, launch.GOSSIP_VARIANTS)
    step = launch.warm_step(keras, model, opt, 32)
    times = []
    for t in range(FLAGS.steps):
        start = time.perf_counter()
        if sleeper(FLAGS.straggler, t, hvd.size()) == hvd.rank():
            time.sleep(FLAGS.delay_ms / 1000)
        step().numpy()
        times.append(time.perf_counter() - start)
    if hasattr(opt, "pushsum"):
        hc.gossip.consensus(model)  # every rank's own steps done: one consensus (and nothing left in flight)
    # Every rank's median, so the fast ranks' view is visible too.
    medians = hvd.allgather_object(1000 * statistics.median(times), name="medians")
    if hvd.rank() == 0:
        pathlib.Path(FLAGS.result).write_text(json.dumps(medians))


def main(_):
    if FLAGS.role == "worker":
        return worker()
    launch.check_names("straggler.py", "methods", FLAGS.methods, METHODS)
    rows = []
    for method in FLAGS.methods:
        for straggler in STRAGGLERS:
            medians = launch.run_worker(__file__, FLAGS.ranks, [f"--method={method}", f"--straggler={straggler}",
                                                                f"--delay_ms={FLAGS.delay_ms}",
                                                                f"--steps={FLAGS.steps}"], launcher="mpi")
            rows.append(dict(method=method, straggler=straggler, delay_ms=FLAGS.delay_ms, steps=FLAGS.steps,
                             median_step_ms=medians))
            print(f"{method}, straggler {straggler}: median step per rank {[round(m, 1) for m in medians]}",
                  flush=True)
    results.save(FLAGS.out, rows)
    print("\n" + render(rows))
    publish(rows)


def render(rows):
    """The rows as docs/benchmarks.md shows them: median step ms of the fastest and the slowest rank in each
    condition, what the straggler added to the fastest rank's, and the slowest rank's median against
    allreduce's in the same condition."""
    delay, ranks, steps = rows[0]["delay_ms"], len(rows[0]["median_step_ms"]), rows[0].get("steps")
    draw = ""
    if steps:  # (rows written before the count of steps was kept: without it)
        most = max(collections.Counter(sleeper("random", t, ranks) for t in range(steps)).values())
        draw = f" (the rank drawn most often slept before {most} of the {steps} timed steps; {steps / ranks:g} if even)"
    note = (f"{ranks} ranks (horovodrun --mpi), 1.6M-parameter MLP; persistent: rank 1 sleeps {delay} ms before every "
            f"step; random: before every step a rank drawn at random sleeps {delay} ms{draw}. Median step ms, fastest "
            "rank / slowest rank; *added*: to the fastest rank's median; *vs allreduce*: the slowest rank's median "
            "over allreduce's, same condition.")
    by = {(r["method"], r["straggler"]): r["median_step_ms"] for r in rows}
    table_rows = []
    for method in dict.fromkeys(r["method"] for r in rows):
        cells = [method]
        for straggler in STRAGGLERS:
            medians = by[(method, straggler)]
            cells.append(f"{min(medians):.1f} / {max(medians):.1f}")
            if straggler != "none":
                cells.append(f"{min(medians) - min(by[(method, 'none')]):.1f}")
            if ("none", straggler) in by:
                cells.append(f"{max(medians) / max(by[('none', straggler)]):.2f}x")
        table_rows.append(cells)
    header = ["method", "no straggler", "vs allreduce", "persistent", "added", "vs allreduce", "random", "added",
              "vs allreduce"]
    if ("none", "none") not in by:
        header = [h for h in header if h != "vs allreduce"]
    table = results.markdown_table(header, table_rows)
    return f"{note}\n\n{table}"


def publish(rows):
    """The table in docs/benchmarks.md: straggler."""
    results.publish("straggler", render(rows), results.command_line(), source=FLAGS.out)


if __name__ == "__main__":
    app.run(results.run(main, publish))
