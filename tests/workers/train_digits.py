"""Trains the digits CNN once per run named in --runs, one after another in this process, in the
Keras `tf.keras` is. hc.DistributedOptimizer runs check after every step that all ranks hold
bit-identical weights and report test accuracy and bytes per step; the SGP run (PushSumOptimizer)
logs the ranks' parameter spread per epoch and evaluates the consensus model."""
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import IdenticalRanks, define_list_of, keras_and_broadcast, report, weights_digest

import digits

#: Run name -> (method of hvd_compress.methods, its overrides, optimizer); "sgp" is PushSumOptimizer over the same SGD.
RUNS = {
    "none": ("none", {}, "sgd"),
    "onebit": ("onebit", {}, "sgd"),
    "onebit_oneway": ("onebit_oneway", {}, "sgd"),
    "quantize8": ("quantize8", {}, "sgd"),
    "quantize4": ("quantize4", {}, "sgd"),
    "topk": ("topk", {}, "sgd"),
    "randomk": ("randomk", dict(ratio=0.1), "sgd"),
    # Sketched SGD at 4.1x and 8.1x of all bytes (4.5x and 10x of the compressed tensors', biases travel dense).
    "sketch": ("sketch", dict(ratio=4.5), "sgd"),
    "sketch8": ("sketch", dict(ratio=10), "sgd"),
    "fetchsgd": ("fetchsgd", dict(ratio=4.5), "sgd"),  # 4.1x too
    "powersgd": ("powersgd", {}, "sgd"),
    "adam": ("none", {}, "adam"),
    "onebit_adam": ("onebit", {}, "adam"),  # 1-bit Adam, compressed after ADAM_WARMUP steps
    "sgp": ("sgp", {}, "sgd"),
}
define_list_of("runs", RUNS, ["none"], "Runs.")
ADAM_WARMUP = 40  # of 22 steps an epoch
flags.DEFINE_integer("epochs", 16, "Epochs of each run.")
FLAGS = flags.FLAGS


class Spread(tf.keras.callbacks.Callback):
    """Logs how far apart the ranks' parameters are (max over parameters of max - min)."""

    def on_epoch_end(self, epoch, logs=None):
        logs["parameter_spread"] = hc.gossip.parameter_spread(self.model)


def train(keras, broadcast, run, data):
    (x_train, y_train), (x_test, y_test) = data
    tf.keras.utils.set_random_seed(0)
    train_set, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), 32, 0)
    model = digits.cnn(keras, 0)
    method, overrides, inner_name = RUNS[run]
    inner = (keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9, nesterov=True) if inner_name == "sgd"
             else keras.optimizers.Adam(0.002))
    identical = IdenticalRanks(run)
    if run == "sgp":
        optimizer, callbacks = hc.PushSumOptimizer(inner), [Spread()]
    else:
        optimizer = hc.DistributedOptimizer(inner, compression=hc.methods.compression(method, **overrides),
                                            warmup_steps=ADAM_WARMUP if inner_name == "adam" else None)
        callbacks = [identical, hc.callbacks.CompressionMetrics(recall=run.startswith("sketch"))]
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(train_set, epochs=FLAGS.epochs, steps_per_epoch=steps, verbose=0,
                        callbacks=[broadcast(0), *callbacks])
    if run == "sgp":
        _, local_accuracy = model.evaluate(x_test, y_test, verbose=0)
        hc.gossip.consensus(model)
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        return dict(accuracy=float(accuracy), local_accuracy=float(local_accuracy),
                    spread=history.history["parameter_spread"], after=hc.gossip.parameter_spread(model),
                    bytes_sent=optimizer.pushsum.bytes_sent)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    exchange = optimizer.compression_exchange
    recall = {key: history.history[key] for key in ("recall", "captured_mass") if key in history.history}
    return dict(accuracy=float(accuracy), bytes_per_step=exchange.bytes_sent, **recall,
                fp32_bytes_per_step=exchange.uncompressed_bytes, steps_checked=identical.checked,
                logged_bytes=history.history["bytes_per_step"][-1],
                logged_residual_norm=history.history["residual_norm"][-1], digest=weights_digest(model))


def main(_):
    keras, broadcast = keras_and_broadcast()
    hvd.init()
    data = digits.load(0)
    report(hvd, results={run: train(keras, broadcast, run, data) for run in FLAGS.runs})


if __name__ == "__main__":
    app.run(main)
