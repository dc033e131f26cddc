"""Bad input across ranks: a NaN on one rank must reach every rank's update, and ranks started
with different settings must fail with a clear error rather than hang."""
import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import report

flags.DEFINE_enum("mode", "nan", ["nan", "mismatch"], "What to break.")
FLAGS = flags.FLAGS


def one_step(compression, poison_rank):
    keras = hc.require_legacy_keras()
    w = tf.Variable(np.zeros(4096, np.float32))
    opt = hc.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=compression)
    g = np.random.default_rng(hvd.rank()).standard_normal(4096).astype(np.float32)
    if hvd.rank() == poison_rank:
        g[123] = np.nan
    try:
        tf.function(lambda: opt.apply_gradients([(tf.constant(g), w)]))()
    except tf.errors.InvalidArgumentError as e:  # the optimizer applied it: hvd_compress's finiteness check
        assert "weights became non-finite" in e.message, e.message
        return "raised"
    return w.numpy()


def main(_):
    hvd.init()
    if FLAGS.mode == "mismatch":
        compression = hc.Compression.onebit() if hvd.rank() == 0 else hc.Compression.topk(ratio=0.1)
        one_step(compression, poison_rank=-1)
        return
    cases = {"onebit two-way": hc.Compression.onebit(block_size=256),
             "onebit one-way": hc.methods.compression("onebit_oneway"),
             "quantize 4-bit": hc.methods.compression("quantize4"),
             "topk": hc.methods.compression("topk"),
             "randomk": hc.methods.compression("randomk")}
    non_finite = {}
    for name, compression in cases.items():
        w = one_step(compression, poison_rank=1)
        non_finite[name] = "raised" if isinstance(w, str) else bool(not np.all(np.isfinite(w)))
    report(hvd, non_finite=non_finite)


if __name__ == "__main__":
    app.run(main)
