"""Compression.auto() in model.fit as users run it, in the Keras `tf.keras` is, on the digits CNN.

Per case of --cases, hc.DistributedOptimizer(..., compression=hc.Compression.auto(calibration_steps=CALIBRATION,
link=...)) fits EPOCHS epochs with the broadcast and metric-average callbacks:
- "slow": AdamW on a given link of 10 Mbit/s, where the gradient's allreduce outlasts the step's compute: the choice
  must compress (under AdamW the low-risk method is 1-bit Adam);
- "fast": SGD on a given link of 1,000 Gbit/s, where nothing pays: the choice must be full precision;
- "measured": SGD on this machine's own loopback, the link measured: whatever it chooses, every rank the same;
- "mixed": "slow" under the mixed_float16 policy (model.compile adds the LossScaleOptimizer around it).
After the fit: the decision on every rank, what rank 0 logged, the bytes per step before and after, the weights'
digest, the losses; rank 0's .keras file loaded on every rank with --loader, which must hold the choice (not auto)
and train on."""
import logging
import pathlib

import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import LoggedLines, define_list_of, keras_and_broadcast, report, weights_digest

import digits

CASES = ("slow", "fast", "measured", "mixed")
define_list_of("cases", CASES, list(CASES), "Cases.")
flags.DEFINE_enum("loader", "hc", ["hc", "keras"], "How every rank loads rank 0's file.")
FLAGS = flags.FLAGS
CALIBRATION, EPOCHS = 6, 3
SETTINGS = {"slow": ("adamw", "10mbit"), "fast": ("sgd", "1000gbit"), "measured": ("sgd", None),
            "mixed": ("adamw", "10mbit")}


class BytesProbe(tf.keras.callbacks.Callback):
    """The optimizer's bytes per step after every batch (its exchange is built at the first step)."""

    def __init__(self):
        super().__init__()
        self.bytes = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        self.bytes.append(float(optimizer.bytes_per_step))


def run(keras, broadcast, case, data, directory):
    (x_train, y_train), (x_test, y_test) = data
    kind, link = SETTINGS[case]
    keras.mixed_precision.set_global_policy("mixed_float16" if case == "mixed" else "float32")
    tf.keras.utils.set_random_seed(hvd.rank())  # the ranks start apart; the broadcast makes them alike
    train_set, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), 32, 0)
    model = digits.cnn(keras, 0)
    inner = (keras.optimizers.AdamW(2e-3, weight_decay=0.01) if kind == "adamw" else
             keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))
    auto = hc.Compression.auto(calibration_steps=CALIBRATION, link=link)
    optimizer = hc.DistributedOptimizer(inner, compression=auto)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    probe, logged = BytesProbe(), LoggedLines.attach()
    history = model.fit(train_set, epochs=EPOCHS, steps_per_epoch=steps, verbose=0,
                        callbacks=[broadcast(0), hc.callbacks.MetricAverageCallback(), probe])
    logging.getLogger("hvd_compress").removeHandler(logged)
    result = dict(decision=auto.decision,
                  compression=type(optimizer.compression_exchange.compression).__name__,
                  logged=[line for line in logged.lines if "Compression.auto()" in line],
                  bytes_before=probe.bytes[0], bytes_after=probe.bytes[-1],
                  allreduce_bytes=hc.exchange.allreduce_bytes(4.0 * model.count_params(), hvd.size()), loss=history.history["loss"],
                  accuracy=float(model.evaluate(x_test, y_test, verbose=0)[1]), digest=weights_digest(model))
    path = directory / f"{case}.keras"
    if hvd.rank() == 0:
        model.save(path)
    hvd.allgather_object(0, name=f"saved.{case}")  # every rank waits for rank 0's file
    loaded = hc.load_model(path) if FLAGS.loader == "hc" else keras.models.load_model(path)
    resumed = loaded.fit(train_set, epochs=1, steps_per_epoch=steps, verbose=0,
                         callbacks=[broadcast(0), hc.callbacks.MetricAverageCallback()])
    loaded_optimizer = getattr(loaded.optimizer, "inner_optimizer", loaded.optimizer)
    result.update(loaded_compression=type(loaded_optimizer.compression_exchange.compression).__name__,
                  loaded_auto=loaded_optimizer.hc_auto is not None, resumed_loss=resumed.history["loss"][-1],
                  resumed_digest=weights_digest(loaded))
    return result


def main(argv):
    del argv
    keras, broadcast = keras_and_broadcast()
    hvd.init()
    data = digits.load()
    directory = pathlib.Path(FLAGS.out_dir)
    report(hvd, results={case: run(keras, broadcast, case, data, directory) for case in FLAGS.cases})


if __name__ == "__main__":
    app.run(main)
