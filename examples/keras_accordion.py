"""Accordion on the bundled digits: adaptive compression (or batch size) against static settings.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_accordion.py --mode accordion
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_accordion.py --mode low
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_accordion.py --mode high

--family picks the compressor whose strength Accordion switches (PowerSGD
rank 4 <-> 1 by default; each setting a method of hc.methods with some of its
arguments changed, SETTINGS); --mode batch switches the batch size instead
(small <-> large per rank, at a fixed compression). The learning rate drops
10x at each epoch in --lr_drops (a drop marks a critical regime). Prints the
test accuracy and the total bytes one worker sent; --history writes the
per-epoch logs (regime per layer, cumulative bytes, test accuracy) as JSON.
"""
import json
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")  # docs/benchmarks.md, "The CPU allocator"

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import hvd_compress as hc  # noqa: E402

import digits  # noqa: E402

#: family -> (low, high), the critical-regime setting and the calm one: each a method of hc.methods and
#: the arguments it changes
SETTINGS = {
    "powersgd": (("powersgd", dict(rank=4)), ("powersgd", dict(rank=1))),
    "topk": (("topk", dict(ratio=0.1)), ("topk", dict(ratio=0.01))),
    "randomk": (("randomk", dict(ratio=0.25)), ("randomk", dict(ratio=0.05))),
    "sketch": (("sketch", dict(ratio=2)), ("sketch", dict(ratio=4))),
    "onebit": (("none", {}), ("onebit", {})),
}

flags.DEFINE_enum("mode", "accordion", ["low", "high", "accordion", "batch"],
                  "Static low or high compression, Accordion between them, or Accordion's batch size.")
flags.DEFINE_enum("family", "powersgd", list(SETTINGS), "Compressor family whose strength is switched (SETTINGS).")
flags.DEFINE_float("eta", 0.5, "Accordion: relative norm change that marks a critical regime.")
flags.DEFINE_integer("small_batch", 16, "--mode batch: batch per rank in critical regimes.")
flags.DEFINE_integer("large_batch", 64, "--mode batch: batch per rank otherwise.")
flags.DEFINE_integer("epochs", 16, "Training epochs.")
flags.DEFINE_list("lr_drops", [], "Epochs at which the learning rate drops 10x (none by default).")
flags.DEFINE_float("lr", 0.05, "Learning rate per rank for batches of 32 (scaled linearly).")
flags.DEFINE_integer("seed", 0, "Seed for the split, initial weights and shuffling.")
flags.DEFINE_string("history", None, "Where rank 0 writes the per-epoch logs (JSON).")
FLAGS = flags.FLAGS


def main(_):
    keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1
    hvd.init()
    tf.keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = digits.load(FLAGS.seed)
    batch = FLAGS.small_batch if FLAGS.mode == "batch" else 32
    train, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), batch, FLAGS.seed)

    low, high = (hc.methods.compression(name, **arguments) for name, arguments in SETTINGS[FLAGS.family])
    lr = FLAGS.lr * hvd.size() * batch / 32  # the linear rule from --lr's batch of 32 per rank
    drops = sorted(int(e) for e in FLAGS.lr_drops)
    schedule = keras.callbacks.LearningRateScheduler(
        lambda epoch: lr * 0.1 ** sum(epoch >= d for d in drops))
    callbacks = [hc.callbacks.BroadcastGlobalVariablesCallback(0), schedule]
    if FLAGS.mode == "accordion":
        callbacks.append(hc.callbacks.Accordion(low=low, high=high, eta=FLAGS.eta))
    elif FLAGS.mode == "batch":
        callbacks.append(hc.callbacks.AccordionBatchSize(FLAGS.small_batch, FLAGS.large_batch, eta=FLAGS.eta))
    callbacks += [hc.callbacks.CompressionMetrics(), digits.TestAccuracy(x_test, y_test)]

    model = digits.cnn(keras, FLAGS.seed)
    static = {"low": low, "high": high}.get(FLAGS.mode, high)
    optimizer = hc.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9, nesterov=True),
                                        compression=static)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=steps, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)
    epochs = digits.epoch_logs(history, steps)
    accuracy, total = epochs[-1]["test_accuracy"], epochs[-1]["cumulative_bytes"]
    if hvd.rank() == 0:
        print(f"mode={FLAGS.mode} family={FLAGS.family} ranks={hvd.size()} test_accuracy={accuracy:.4f} "
              f"total_MB={total / 1e6:.3f}")
        if FLAGS.history:
            with open(FLAGS.history, "w") as f:
                json.dump(dict(mode=FLAGS.mode, family=FLAGS.family, ranks=hvd.size(), epochs=epochs,
                               test_accuracy=accuracy, total_bytes=total), f, indent=1)


if __name__ == "__main__":
    app.run(main)
