"""Data-parallel Keras training on the bundled digits with a chosen compression.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py --compression onebit

Prints the test accuracy and the bytes each worker sent per step; --history writes the
per-epoch logs (test accuracy, cumulative bytes per worker) as JSON. --compression sgp trains
with Stochastic Gradient Push (hc.PushSumOptimizer) instead of averaging gradients, and
evaluates the consensus model at the end (per epoch: rank 0's own model).

It runs in the Keras `tf.keras` is: Keras 3 by default, tf_keras under TF_USE_LEGACY_KERAS=1
(hvd_compress takes either; its callbacks broadcast the initial state in both).
"""
import json

import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc

import digits
from hvd_compress.exchange import allreduce_bytes

flags.DEFINE_enum("compression", "onebit", ["none", "fp16", "onebit", "topk", "randomk", "sketch", "powersgd",
                                          "sgp"], "Gradient compression (sgp: gossip instead).")
flags.DEFINE_bool("two_way", True, "onebit: compress the averaged update again on a sharded server.")
flags.DEFINE_integer("block_size", None, "onebit: elements per scale (default: one block per tensor).")
flags.DEFINE_float("ratio", 0.01, "topk/randomk: fraction of each bucket sent.")
flags.DEFINE_float("sketch_ratio", 4.0, "sketch: compression of bytes per step (sizes chosen from it).")
flags.DEFINE_integer("rank", 4, "powersgd: rank of the approximation.")
flags.DEFINE_integer("epochs", 8, "Training epochs.")
flags.DEFINE_integer("batch_size", 32, "Batch size per rank.")
flags.DEFINE_float("lr", 0.05, "Learning rate per rank (scaled by the number of ranks).")
flags.DEFINE_integer("seed", 0, "Seed for the split, initial weights and shuffling.")
flags.DEFINE_string("history", None, "Where rank 0 writes the per-epoch logs (JSON).")
FLAGS = flags.FLAGS


def compression_from_flags():
    return {
        "none": lambda: hc.Compression.none,
        "fp16": lambda: hc.Compression.fp16,
        "onebit": lambda: hc.Compression.onebit(block_size=FLAGS.block_size),
        "topk": lambda: hc.Compression.topk(ratio=FLAGS.ratio),
        "randomk": lambda: hc.Compression.randomk(ratio=FLAGS.ratio, seed=FLAGS.seed),
        "sketch": lambda: hc.Compression.sketch(ratio=FLAGS.sketch_ratio, seed=FLAGS.seed),
        "powersgd": lambda: hc.Compression.powersgd(rank=FLAGS.rank, seed=FLAGS.seed),
    }[FLAGS.compression]()


def main(_):
    keras = tf.keras
    hvd.init()
    tf.keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = digits.load(FLAGS.seed)
    train, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), FLAGS.batch_size, FLAGS.seed)

    model = digits.cnn(keras, FLAGS.seed)
    sgd = keras.optimizers.SGD(FLAGS.lr * hvd.size(), momentum=0.9, nesterov=True)
    gossip = FLAGS.compression == "sgp"
    optimizer = (hc.PushSumOptimizer(sgd) if gossip else
                 hc.DistributedOptimizer(sgd, compression=compression_from_flags(), two_way=FLAGS.two_way))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hc.callbacks.BroadcastGlobalVariablesCallback(0)]
    callbacks += [] if gossip else [hc.callbacks.CompressionMetrics()]
    history = model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=steps,
                        callbacks=callbacks + [digits.TestAccuracy(x_test, y_test)],
                        verbose=2 if hvd.rank() == 0 else 0)

    if gossip:
        hc.gossip.consensus(model)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    sent = optimizer.pushsum.bytes_sent if gossip else optimizer.compression_exchange.bytes_sent
    fp32 = allreduce_bytes(4 * model.count_params(), hvd.size())
    if hvd.rank() == 0:
        print(f"compression={FLAGS.compression} two_way={FLAGS.two_way} ranks={hvd.size()} "
              f"test_accuracy={accuracy:.4f} bytes_per_step={sent:.0f} "
              f"fp32_allreduce_bytes_per_step={fp32:.0f} ratio={fp32 / max(sent, 1):.1f}x "
              f"total_MB={sent * steps * FLAGS.epochs / 1e6:.3f}")
        if FLAGS.history:
            with open(FLAGS.history, "w") as f:
                json.dump(dict(compression=FLAGS.compression, two_way=FLAGS.two_way, ranks=hvd.size(),
                               epochs=digits.epoch_logs(history, steps, bytes_per_step=sent),
                               test_accuracy=accuracy, total_bytes=sent * steps * FLAGS.epochs), f, indent=1)


if __name__ == "__main__":
    app.run(main)
