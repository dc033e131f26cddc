"""Trains the digits CNN with hc.DistributedOptimizer and checks, after every step, that all ranks
hold bit-identical parameters, in the Keras `tf.keras` is. Reports test accuracy and bytes per step."""
import hashlib

import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import keras_and_broadcast, report

import digits

flags.DEFINE_string("compression", "none", "none, fp16, onebit, topk or randomk.")
flags.DEFINE_bool("two_way", True, "onebit: two-way.")
flags.DEFINE_float("ratio", 0.01, "topk/randomk ratio.")
flags.DEFINE_float("sketch_ratio", 4.5, "sketch: compression of the compressed tensors' bytes.")
flags.DEFINE_integer("epochs", 16, "Epochs.")
flags.DEFINE_string("optimizer", "sgd", "sgd (Nesterov momentum) or adam.")
FLAGS = flags.FLAGS


def compression():
    return {"none": lambda: hc.Compression.none, "fp16": lambda: hc.Compression.fp16,
            "onebit": lambda: hc.Compression.onebit(),
            "topk": lambda: hc.Compression.topk(ratio=FLAGS.ratio),
            "randomk": lambda: hc.Compression.randomk(ratio=FLAGS.ratio),
            "sketch": lambda: hc.Compression.sketch(ratio=FLAGS.sketch_ratio),
            "powersgd": lambda: hc.Compression.powersgd(rank=4)}[FLAGS.compression]()


def weights_digest(model):
    return hashlib.sha256(b"".join(w.numpy().tobytes() for w in model.weights)).hexdigest()


class SameWeightsOnEveryRank(tf.keras.callbacks.Callback):
    """After every batch, all ranks must hold bit-identical weights."""

    def __init__(self):
        super().__init__()
        self.checked = 0

    def on_train_batch_end(self, batch, logs=None):
        digests = hvd.allgather_object(weights_digest(self.model), name="weights_digest")
        assert len(set(digests)) == 1, f"ranks diverged after batch {batch}: {digests}"
        self.checked += 1


def main(_):
    keras, broadcast = keras_and_broadcast()
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = digits.load(0)
    train, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), 32, 0)
    model = digits.cnn(keras, 0)
    inner = (keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9, nesterov=True)
             if FLAGS.optimizer == "sgd" else keras.optimizers.Adam(0.002))
    optimizer = hc.DistributedOptimizer(inner, compression=compression(), two_way=FLAGS.two_way)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    same = SameWeightsOnEveryRank()
    history = model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=steps, verbose=0,
                        callbacks=[broadcast(0), same,
                                   hc.callbacks.CompressionMetrics()])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    exchange = optimizer.compression_exchange
    report(hvd, accuracy=float(accuracy), bytes_per_step=exchange.bytes_sent,
           fp32_bytes_per_step=exchange.uncompressed_bytes, steps_checked=same.checked,
           logged_bytes=history.history["bytes_per_step"][-1],
           logged_residual_norm=history.history["residual_norm"][-1],
           digest=weights_digest(model))


if __name__ == "__main__":
    app.run(main)
