"""Data-parallel Keras training on the bundled digits with a chosen compression.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py --compression fp16

Prints the test accuracy and the bytes each worker sent per step.
"""
import hvd_compress as hc  # first: selects Keras 2 for tf.keras

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow.keras as hvd
from hvd_compress import exchange

import digits

flags.DEFINE_enum("compression", "none", ["none", "fp16"], "Gradient compression.")
flags.DEFINE_integer("epochs", 8, "Training epochs.")
flags.DEFINE_integer("batch_size", 32, "Batch size per rank.")
flags.DEFINE_float("lr", 0.05, "Learning rate per rank (scaled by the number of ranks).")
flags.DEFINE_integer("seed", 0, "Seed for the split, initial weights and shuffling.")
FLAGS = flags.FLAGS

COMPRESSORS = {"none": hc.Compression.none, "fp16": hc.Compression.fp16}
WIRE_BYTES = {"none": 4, "fp16": 2}


def main(_):
    keras = hc.require_legacy_keras()
    hvd.init()
    tf.keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = digits.load(FLAGS.seed)
    train, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), FLAGS.batch_size, FLAGS.seed)

    model = digits.cnn(keras, FLAGS.seed)
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(FLAGS.lr * hvd.size(), momentum=0.9, nesterov=True),
        compression=COMPRESSORS[FLAGS.compression])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=steps,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
              verbose=2 if hvd.rank() == 0 else 0)

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    per_step = exchange.allreduce_bytes(params * WIRE_BYTES[FLAGS.compression], hvd.size())
    if hvd.rank() == 0:
        print(f"compression={FLAGS.compression} ranks={hvd.size()} test_accuracy={accuracy:.4f} "
              f"bytes_per_step={per_step:.0f} (fp32 allreduce: "
              f"{exchange.allreduce_bytes(params * 4, hvd.size()):.0f}) "
              f"total_MB={per_step * steps * FLAGS.epochs / 1e6:.2f} params={params}")


if __name__ == "__main__":
    app.run(main)
