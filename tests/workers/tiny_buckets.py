"""Two-way dist-EF-SGD on buckets of 1 to a few thousand elements (sizes not multiples of 8, shards
that come out empty) against the NumPy reference, on every rank; one-way and blocks too, and
Compression.fp16's sharded 16-bit exchange (variant fp16). Without --full_matrix the variants take
the two halves of --sizes in turn (every other size: each half has sizes under 8, some shards empty,
odd sizes and a large bucket), so every variant meets every kind of size; with it, every size.

One launch covers every world size from 1 to the number of ranks: each size n runs on the
Horovod process set of ranks 0..n-1 (hc.DistributedOptimizer's process_set=)."""
import hashlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
import np_reference as ref
from _worker import init_world_sizes, launch_size, report

flags.DEFINE_list("sizes", "1,5,7,9,17,23,63,65,1031,1919", "Bucket sizes (elements).")
flags.DEFINE_list("world_sizes", None, "World sizes to run (default: 1 to the number of ranks).")
flags.DEFINE_list("variants", "two_way,two_way_blocks,one_way,fp16", "dist-EF-SGD variants (and fp16) to run.")
flags.DEFINE_bool("full_matrix", False, "Every variant on every size (else on every other size, in turn).")
FLAGS = flags.FLAGS
STEPS, LR, MU = 3, 0.1, 0.9


def grad(rank, step, d):
    return np.random.default_rng([step, rank, d]).standard_normal(d).astype(np.float32)


def run(sizes, two_way, block_size, process_set, compression=None):
    """One variable per size, each its own bucket (fusion_threshold_bytes=1): one trace for all."""
    keras = hc.require_legacy_keras()
    ws = [tf.Variable(np.zeros(d, np.float32)) for d in sizes]
    opt = hc.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MU, nesterov=True),
                                  compression=compression or hc.Compression.onebit(block_size=block_size,
                                                                                  two_way=two_way),
                                  min_compress_size=1, fusion_threshold_bytes=1, process_set=process_set,
                                  name=f"hc.n{process_set.size()}.{two_way}.{block_size}")
    step = tf.function(lambda gs: opt.apply_gradients(zip(gs, ws)))
    for t in range(STEPS):
        step([tf.constant(grad(process_set.rank(), t, d)) for d in sizes])
    buckets = (opt.compression_exchange.dense_exchange.buckets if compression else
               opt.compression_exchange.layout.buckets)
    assert len(buckets) == len(sizes)
    return [w.numpy() for w in ws]


def reference(d, two_way, block_size, n):
    model = ref.DistEFSGD(d, n, MU, True, block_size, two_way)
    x = np.zeros(d, np.float32)
    for t in range(STEPS):
        model.step(x, [grad(r, t, d) for r in range(n)], LR)
    return x


def reference_fp16(d, two_way, block_size, n):
    """Keras SGD on the float16 mean (np_reference.half_mean)."""
    x, m = np.zeros(d, np.float32), np.zeros(d, np.float32)
    for t in range(STEPS):
        ref.keras_sgd(x, m, ref.half_mean([grad(r, t, d) for r in range(n)]), LR, MU, True)
    return x


def main(_):
    ranks = launch_size()
    digests, empty_shards = {}, {}
    for n, process_set in init_world_sizes([int(n) for n in FLAGS.world_sizes or range(1, ranks + 1)]).items():
        sizes, ran = [int(d) for d in FLAGS.sizes], set()
        variants = {"two_way": (True, None, None, reference), "two_way_blocks": (True, 4, None, reference),
                    "one_way": (False, None, None, reference),
                    "fp16": (True, None, hc.Compression.fp16, reference_fp16)}
        for turn, (two_way, block_size, compression, reference_of) in enumerate(variants[v] for v in FLAGS.variants):
            some = sizes if FLAGS.full_matrix else sizes[turn % 2::2]
            ran.update(some)
            for d, w in zip(some, run(some, two_way, block_size, process_set, compression)):
                np.testing.assert_allclose(w, reference_of(d, two_way, block_size, n), rtol=1e-5, atol=1e-6,
                                           err_msg=f"n={n} d={d} two_way={two_way} block_size={block_size}")
                assert np.abs(w).max() > 0
                digests[f"{n}/{d}/{two_way}/{block_size}/{compression}"] = hashlib.sha256(w.tobytes()).hexdigest()
        empty_shards[n] = sum(int(hc.exchange.shard_cuts(d, n)[-2] == d) for d in ran)
    report(hvd, digests=digests, empty_shards=empty_shards)


if __name__ == "__main__":
    app.run(main)
