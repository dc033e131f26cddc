"""PushSum with no gradients, once per case in --cases: every rank's parameters converge to the
exact average, the weights (with the mass in flight) always sum to n, and all of it after any
number of ranks. A case is "<n>/<graph>", optionally with "+overlap" and "+every<H>" (an exact
allreduce average every H steps), run on the process set of ranks 0..n-1, so that one launch covers
several world sizes: "3/ring+every4+overlap"."""
import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import init_world_sizes, report

flags.DEFINE_list("cases", ["2/exponential"], "Cases: <n>/graph[+overlap][+every<H>].")
flags.DEFINE_integer("steps", 40, "Gossip steps per case.")
FLAGS = flags.FLAGS


def gossip(keras, case, process_set):
    graph, *options = case.split("/")[1].split("+")
    overlap = "overlap" in options
    every = next((int(o.removeprefix("every")) for o in options if o.startswith("every")), None)
    n, rank = process_set.size(), process_set.rank()
    starts = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in range(n)]
    target = np.mean(starts, axis=0)
    v = tf.Variable(starts[rank])
    opt = hc.PushSumOptimizer(keras.optimizers.SGD(0.0), graph=graph, overlap=overlap,
                              average_every=every, process_set=process_set)
    step = tf.function(lambda: opt.apply_gradients([(tf.zeros([1000]), v)]))
    errors, mass = [], []
    for _ in range(FLAGS.steps):
        step()
        errors.append(float(np.abs(v.numpy() - target).max()))
        w = opt.pushsum.weight + (opt.pushsum.in_flight[-1] if overlap else 0.0)
        mass.append(float(hvd.allreduce(w, op=hvd.Sum, name=f"mass.{case}", process_set=process_set)))
    return dict(errors=errors, mass=mass)


def main(_):
    keras = hc.require_legacy_keras()
    size = {case: int(case.split("/")[0]) for case in FLAGS.cases}
    process_sets = init_world_sizes(set(size.values()))
    report(hvd, results={case: gossip(keras, case, process_sets[size[case]])
                         for case in FLAGS.cases if size[case] in process_sets})


if __name__ == "__main__":
    app.run(main)
