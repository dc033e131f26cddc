"""Point-to-point gossip with a straggler: rank 1 sleeps before every step, the others do not. Per case in --cases
(max_drift: "none" or D), every rank reports the time each of its steps ended and a digest of its variable; the
test counts how far ahead of the straggler the others ran."""
import hashlib
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import report_cases

flags.DEFINE_list("cases", ["none", "1"], "max_drift per case: none or a number of steps.")
flags.DEFINE_integer("steps", 25, "Gossip steps per case.")
flags.DEFINE_float("sleep_s", 0.2, "How long rank 1 sleeps before each step.")
flags.DEFINE_string("graph", "ring", "The gossip graph.")
FLAGS = flags.FLAGS


def gossip(keras, case):
    max_drift = None if case == "none" else int(case)
    v = tf.Variable(np.random.default_rng(hvd.rank()).standard_normal(1000).astype(np.float32))
    opt = hc.PushSumOptimizer(keras.optimizers.SGD(0.0), overlap=True, transport="mpi",
                              max_drift=max_drift, graph=FLAGS.graph)
    step = tf.function(lambda: opt.apply_gradients([(tf.zeros([1000]), v)]))
    step()  # traced; then every rank starts together
    hvd.allreduce(tf.constant(0.0), name=f"start.{case}")
    ended = []
    for _ in range(FLAGS.steps):
        if hvd.rank() == 1:
            time.sleep(FLAGS.sleep_s)
        step()
        ended.append(time.monotonic())
    opt.pushsum.flush()
    hvd.allreduce(tf.constant(0.0), name=f"end.{case}")
    return dict(ended=ended, digest=hashlib.sha256(v.numpy().tobytes()).hexdigest())


if __name__ == "__main__":
    app.run(lambda _: report_cases(gossip))
