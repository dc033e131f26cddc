"""Each rank packs its own vector, the payloads are allgathered, every rank decodes the mean."""
import hashlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import np_reference as ref
from _worker import report
from hvd_compress import Compression

flags.DEFINE_integer("n", 10007, "Elements per rank.")
FLAGS = flags.FLAGS


def rank_vector(rank, n):
    return np.random.default_rng(1000 + rank).standard_normal(n).astype(np.float32)


def main(_):
    hvd.init()
    n, size = FLAGS.n, hvd.size()
    digests = {}
    for block_size in (None, 256):
        onebit = Compression.onebit(block_size=block_size)
        bounds = onebit.bounds(n)
        bits, scales = onebit.encode(rank_vector(hvd.rank(), n), bounds)
        gathered = (hvd.allgather(bits, name=f"bits{block_size}"),
                    hvd.allgather(scales, name=f"scales{block_size}"))
        mean = onebit.decode_mean(gathered, bounds).numpy()
        payloads = [ref.pack(rank_vector(r, n), bounds.numpy()) for r in range(size)]
        want = ref.unpack_mean([p[0] for p in payloads], [p[1] for p in payloads], bounds.numpy())
        np.testing.assert_array_equal(mean, want)
        digests[str(block_size)] = hashlib.sha256(mean.tobytes()).hexdigest()

    # fp16 (and bf16, which travels as fp16) through Horovod's own allreduce.
    x = tf.constant(rank_vector(hvd.rank(), 1000))
    averaged = hvd.allreduce(x, compression=Compression.fp16, name="fp16")
    want = np.mean([rank_vector(r, 1000).astype(np.float16) for r in range(size)], axis=0)
    np.testing.assert_allclose(averaged.numpy(), want, rtol=2e-3, atol=2e-3)
    bf16 = hvd.allreduce(tf.cast(x, tf.bfloat16), compression=Compression.fp16, name="bf16")
    assert bf16.dtype == tf.bfloat16, bf16.dtype
    report(hvd, size=size, digests=digests)


if __name__ == "__main__":
    app.run(main)
