"""Rank 1 never joins the collective: the harness must kill the job at its timeout."""
import time

import tensorflow as tf
from absl import app

import horovod.tensorflow as hvd
import _worker  # noqa: F401  (defines --out_dir)


def main(_):
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(3600)
    hvd.allreduce(tf.ones([4]), name="never_completes")


if __name__ == "__main__":
    app.run(main)
