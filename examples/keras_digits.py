"""Data-parallel Keras training on the bundled digits with a chosen compression.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py --compression onebit

--compression is a method of hvd_compress's registry, hc.methods (its names and defaults; the
flags below change some of them): none, fp16, onebit (two-way dist-EF-SGD), onebit_oneway,
quantize8, quantize4, topk, randomk, powersgd, sketch, fetchsgd; sgp, which trains with
Stochastic Gradient Push (hc.PushSumOptimizer) instead of averaging gradients; or the local-step methods diloco,
sparseloco, diloco_q4 and streaming_diloco, which take 20 local steps of AdamW (DiLoCo's inner optimizer; --lr is
then AdamW's) between syncs (hc.DiLoCo). Where the ranks hold different models (sgp, the local-step methods), fit ends on their average (hc.callbacks.Consensus),
which is evaluated (per epoch: rank 0's own model). Horovod's own baselines
(horovod_fp32, horovod_fp16) need tf_keras: see keras_text.py.
Prints the test accuracy and the bytes each worker sent per step; --history writes the
per-epoch logs (test accuracy, cumulative bytes per worker) as JSON.

It runs in the Keras `tf.keras` is: Keras 3 by default, tf_keras under TF_USE_LEGACY_KERAS=1
(hvd_compress takes either; its callbacks broadcast the initial state in both).
"""
import json
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")  # docs/benchmarks.md, "The CPU allocator"

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import hvd_compress as hc  # noqa: E402

import digits  # noqa: E402
from hvd_compress.exchange import allreduce_bytes  # noqa: E402

#: Horovod's own DistributedOptimizer needs tf_keras, and this example runs in whichever Keras tf.keras is
METHODS = [name for name in hc.methods.NAMES if not name.startswith("horovod_")]
flags.DEFINE_enum("compression", "onebit", METHODS, "Method of hc.methods (sgp: gossip instead of averaging; diloco, "
                  "sparseloco, diloco_q4, streaming_diloco: local AdamW steps).")
flags.DEFINE_integer("block_size", None, "onebit, onebit_oneway, quantize8, quantize4: elements per scale "
                     "(default: hc.methods', one block per tensor for onebit).")
flags.DEFINE_float("ratio", None, "topk, randomk: fraction of each bucket sent (default: hc.methods').")
flags.DEFINE_float("sketch_ratio", None, "sketch, fetchsgd: compression of bytes per step (default: hc.methods').")
flags.DEFINE_integer("rank", None, "powersgd: rank of the approximation (default: hc.methods').")
flags.DEFINE_bool("stochastic", None, "quantize8, quantize4: stochastic rounding (default: hc.methods').")
flags.DEFINE_integer("epochs", 8, "Training epochs.")
flags.DEFINE_integer("batch_size", 32, "Batch size per rank.")
flags.DEFINE_float("lr", None, "SGD's learning rate per rank, scaled by the number of ranks (default 0.05); for the "
                   "local-step methods AdamW's (default 0.002).")
flags.DEFINE_integer("seed", 0, "Seed for the split, initial weights, shuffling and the compressions that draw.")
flags.DEFINE_string("history", None, "Where rank 0 writes the per-epoch logs (JSON).")
FLAGS = flags.FLAGS


#: flag -> (the argument of the compression it sets, the methods it applies to); an unset flag (None) keeps
#: hc.methods' default
FLAG_ARGUMENTS = {
    "block_size": ("block_size", ("onebit", "onebit_oneway", "quantize8", "quantize4")),
    "ratio": ("ratio", ("topk", "randomk")),
    "sketch_ratio": ("ratio", ("sketch", "fetchsgd")),
    "rank": ("rank", ("powersgd",)),
    "stochastic": ("stochastic", ("quantize8", "quantize4")),
    "seed": ("seed", ("quantize8", "quantize4", "randomk", "powersgd", "sketch", "fetchsgd")),
}


def overrides():
    """What the flags change in --compression's arguments."""
    return {argument: FLAGS[flag].value for flag, (argument, methods) in FLAG_ARGUMENTS.items()
            if FLAGS.compression in methods and FLAGS[flag].value is not None}


def main(_):
    keras = tf.keras
    hvd.init()
    tf.keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = digits.load(FLAGS.seed)
    train, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), FLAGS.batch_size, FLAGS.seed)

    model = digits.cnn(keras, FLAGS.seed)
    if FLAGS.compression in hc.methods.LOCAL_STEP_METHODS:
        inner = keras.optimizers.AdamW(FLAGS.lr or 0.002, weight_decay=0.01)
    else:
        inner = keras.optimizers.SGD((FLAGS.lr or 0.05) * hvd.size(), momentum=0.9, nesterov=True)
    optimizer = hc.methods.distributed_optimizer(FLAGS.compression, inner, overrides=overrides())
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hc.callbacks.BroadcastGlobalVariablesCallback(0)]
    # the ranks' average once fit ends where they train apart; else the bytes and residuals per epoch
    callbacks += [hc.callbacks.Consensus()] if optimizer.ranks_diverge else [hc.callbacks.CompressionMetrics()]
    history = model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=steps,
                        callbacks=callbacks + [digits.TestAccuracy(x_test, y_test)],
                        verbose=2 if hvd.rank() == 0 else 0)

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    sent = optimizer.bytes_per_step
    fp32 = allreduce_bytes(4 * model.count_params(), hvd.size())
    if hvd.rank() == 0:
        print(f"compression={FLAGS.compression} ranks={hvd.size()} "
              f"test_accuracy={accuracy:.4f} bytes_per_step={sent:.0f} "
              f"fp32_allreduce_bytes_per_step={fp32:.0f} ratio={fp32 / max(sent, 1):.1f}x "
              f"total_MB={sent * steps * FLAGS.epochs / 1e6:.3f}")
        if FLAGS.history:
            with open(FLAGS.history, "w") as f:
                json.dump(dict(compression=FLAGS.compression, arguments=overrides(), ranks=hvd.size(),
                               epochs=digits.epoch_logs(history, steps, bytes_per_step=sent),
                               test_accuracy=accuracy, total_bytes=sent * steps * FLAGS.epochs), f, indent=1)


if __name__ == "__main__":
    app.run(main)
