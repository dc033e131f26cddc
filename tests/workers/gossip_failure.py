"""A rank of a point-to-point gossip (hc.PushSumOptimizer(transport="mpi", overlap=True)) fails at --fail_step:
it exits (--fail=exit) or hangs (--fail=hang). The job must end with an error, not hang: a rank that exits ends an
MPI job (mpirun aborts the others); the peers of a rank that hangs give up waiting for its messages after
--collect_timeout seconds with an error that says so. Writes no result: it must not get that far."""
import os
import time

import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from hvd_compress import p2p
from rule_inputs import grads_of, train
import _worker  # noqa: F401 (its flags: --out_dir)

flags.DEFINE_enum("fail", "exit", ["exit", "hang"], "How the failing rank fails.")
flags.DEFINE_integer("fail_rank", 1, "The rank that fails.")
flags.DEFINE_integer("fail_step", 3, "The step at which it fails.")
flags.DEFINE_integer("collect_timeout", 10, "Seconds the others wait for a step's messages.")
FLAGS = flags.FLAGS


def main(_):
    hc.require_legacy_keras()
    hvd.init()
    p2p.COLLECT_TIMEOUT_SECONDS = FLAGS.collect_timeout
    _, _, _, step = train(tf.keras.optimizers.SGD(0.1), FLAGS.fail_step, hvd.rank(), wrap=hc.PushSumOptimizer,
                          overlap=True, transport="mpi")
    if hvd.rank() == FLAGS.fail_rank:
        if FLAGS.fail == "exit":
            os._exit(3)
        time.sleep(3600)
    for t in range(FLAGS.fail_step, FLAGS.fail_step + 5):
        step(*map(tf.constant, grads_of(hvd.rank(), t)))


if __name__ == "__main__":
    app.run(main)
