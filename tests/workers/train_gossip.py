"""Trains the digits CNN with PushSumOptimizer (SGP), logs the per-rank parameter spread,
and evaluates the consensus (allreduce-averaged) model."""
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow.keras as hvd
import hvd_compress as hc
from _worker import report

import digits

flags.DEFINE_string("graph", "exponential", "Graph.")
flags.DEFINE_bool("overlap", False, "Overlap SGP.")
flags.DEFINE_integer("epochs", 16, "Epochs.")
FLAGS = flags.FLAGS


class Spread(tf.keras.callbacks.Callback):
    """Logs how far apart the ranks' parameters are (max over parameters of max - min)."""

    def on_epoch_end(self, epoch, logs=None):
        logs["parameter_spread"] = hc.gossip.parameter_spread(self.model)


def main(_):
    keras = hc.require_legacy_keras()
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = digits.load(0)
    train, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), 32, 0)
    model = digits.cnn(keras, 0)
    opt = hc.PushSumOptimizer(keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9, nesterov=True),
                              graph=FLAGS.graph, overlap=FLAGS.overlap)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=steps, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Spread()])
    _, local_accuracy = model.evaluate(x_test, y_test, verbose=0)
    hc.gossip.consensus(model)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    report(hvd, accuracy=float(accuracy), local_accuracy=float(local_accuracy),
           spread=history.history["parameter_spread"], after=hc.gossip.parameter_spread(model),
           weight=float(opt.pushsum.weight.numpy()), bytes_sent=opt.pushsum.bytes_sent)


if __name__ == "__main__":
    app.run(main)
