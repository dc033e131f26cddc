"""PushSum with no gradients: every rank's parameters converge to the exact average, the
weights (with the mass in flight) always sum to n, and all of it after any number of ranks."""
import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import report

flags.DEFINE_string("graph", "exponential", "Graph.")
flags.DEFINE_bool("overlap", False, "Overlap SGP.")
flags.DEFINE_integer("steps", 30, "Gossip steps.")
flags.DEFINE_integer("average_every", None, "Exact allreduce average every H steps.")
FLAGS = flags.FLAGS


def main(_):
    keras = hc.require_legacy_keras()
    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    starts = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in range(n)]
    start, target = starts[rank], np.mean(starts, axis=0)
    v = tf.Variable(start)
    opt = hc.PushSumOptimizer(keras.optimizers.SGD(0.0), graph=FLAGS.graph, overlap=FLAGS.overlap,
                              average_every=FLAGS.average_every)
    step = tf.function(lambda: opt.apply_gradients([(tf.zeros([1000]), v)]))
    errors, mass = [], []
    for _ in range(FLAGS.steps):
        step()
        errors.append(float(np.abs(v.numpy() - target).max()))
        w = opt.pushsum.weight + (opt.pushsum.in_flight[-1] if FLAGS.overlap else 0.0)
        mass.append(float(hvd.allreduce(w, op=hvd.Sum, name="mass")))
    report(hvd, errors=errors, mass=mass, weight=float(opt.pushsum.weight.numpy()),
           bytes_sent=opt.pushsum.bytes_sent)


if __name__ == "__main__":
    app.run(main)
