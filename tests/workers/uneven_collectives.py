"""Horovod's alltoall (uneven splits) and allgather (uneven first dimensions), large and small,
against NumPy: the collectives patches/horovod-0.28.1.patch reorders in Gloo (receives posted
before sends)."""
import numpy as np
import tensorflow as tf
from absl import app

import horovod.tensorflow as hvd
from _worker import report


def block(sender, receiver, length):
    """What `sender` sends `receiver`: distinct values, so a misplaced block shows."""
    return np.arange(length, dtype=np.float32) + 1e6 * sender + 1e4 * receiver


def split(sender, receiver, scale):
    return scale * (1 + sender + 2 * receiver) + 7 * receiver  # uneven, and different per pair


def main(_):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = []
    for scale in (3, 300_001):  # a few values, and blocks of megabytes
        splits = [split(rank, j, scale) for j in range(size)]
        sent = np.concatenate([block(rank, j, splits[j]) for j in range(size)])
        received, received_splits = hvd.alltoall(tf.constant(sent), splits=splits, name=f"alltoall.{scale}")
        want = np.concatenate([block(i, rank, split(i, rank, scale)) for i in range(size)])
        np.testing.assert_array_equal(received.numpy(), want)
        assert received_splits.numpy().tolist() == [split(i, rank, scale) for i in range(size)]

        rows = scale * (rank + 1)
        gathered = hvd.allgather(tf.constant(block(rank, 0, rows)), name=f"allgather.{scale}")
        np.testing.assert_array_equal(gathered.numpy(),
                                      np.concatenate([block(i, 0, scale * (i + 1)) for i in range(size)]))
        checked.append(scale)
    report(hvd, size=size, checked=checked)


if __name__ == "__main__":
    app.run(main)
