"""The full-precision warm-up as model.fit users meet it, under AdamW (hvd_compress/adam.py): every method of
the registry with its defaults over a fit of a few hundred steps (its bytes per step once its warm-up is over,
1-bit Adam's warm-up chosen from the fit's length and kept in the optimizer's config), a learning-rate
schedule's warm-up taken for 1-bit Adam's, and a warm-up that covers a whole fit said before its first step
(or, for a fit of unknown length, after it). hvd_compress's broadcast and metric callbacks, as users add them;
the ranks bit-identical after every batch.

Reports {case: {...}} for the cases of --cases: "defaults/<method>", "schedule", "covers", "unknown_length"."""
import logging

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import IdenticalRanks, LoggedLines, report

flags.DEFINE_list("cases", None, "Cases to run, in order.")
FLAGS = flags.FLAGS
keras = tf.keras  # tf_keras or Keras 3 (TF_USE_LEGACY_KERAS decides)
#: A fit of "a few hundred steps": EPOCHS x STEPS, batches of BATCH.
EPOCHS, STEPS, BATCH = 8, 25, 8


def new_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(4)])


def data(steps):
    rng = np.random.default_rng(hvd.rank())
    return rng.normal(size=(steps * BATCH, 32)).astype("float32"), rng.integers(0, 4, steps * BATCH)


class LinesBeforeTheFirstStep(keras.callbacks.Callback):
    """What hvd_compress had logged on this rank when the first batch began."""

    def __init__(self, logged):
        super().__init__()
        self.logged, self.lines = logged, None

    def on_train_batch_begin(self, batch, logs=None):
        if self.lines is None:
            self.lines = list(self.logged.lines)


def fit(optimizer, x, epochs=EPOCHS, steps_per_epoch=None, y=None):
    """model.fit with hvd_compress's callbacks; (history, lines logged before the first step, all lines)."""
    model = new_model()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logged = LoggedLines.attach()
    before = LinesBeforeTheFirstStep(logged)
    try:
        history = model.fit(x, y, batch_size=None if y is None else BATCH, epochs=epochs,
                            steps_per_epoch=steps_per_epoch, verbose=0, shuffle=False,
                            callbacks=[hc.callbacks.BroadcastGlobalVariablesCallback(0),
                                       hc.callbacks.MetricAverageCallback(), before, hc.callbacks.CompressionMetrics(),
                                       IdenticalRanks("warmup")])
    finally:
        logging.getLogger("hvd_compress").removeHandler(logged)
    return history.history, before.lines, logged.lines


def wrapped(method=None, learning_rate=1e-3, **settings):
    adamw = keras.optimizers.AdamW(learning_rate, weight_decay=0.01)
    if method is None:
        return adamw, hc.DistributedOptimizer(adamw, compression=hc.Compression.onebit(), **settings)
    return adamw, hc.methods.distributed_optimizer(method, adamw, min_compress_size=64, **settings)


def facts(optimizer, history, before, lines):
    exchange = optimizer.compression_exchange
    return dict(warmup_steps=exchange.warmup_steps, saved_warmup_steps=optimizer.get_config()["warmup_steps"],
                iterations=int(optimizer.iterations.numpy()), bytes_per_step=history["bytes_per_step"],
                uncompressed_bytes=float(exchange.uncompressed_bytes), before_first_step=before, logged=lines)


def run(case):
    x, y = data(STEPS)
    if case.startswith("defaults/"):
        try:
            optimizer = wrapped(case.split("/")[1])[1]
        except ValueError as e:
            return {"refused": str(e)}
        return facts(optimizer, *fit(optimizer, x, y=y))
    if case == "schedule":
        schedule = keras.optimizers.schedules.CosineDecay(0.0, EPOCHS * STEPS - 7, warmup_target=1e-3, warmup_steps=7)
        optimizer = wrapped(learning_rate=schedule, min_compress_size=64)[1]
        return facts(optimizer, *fit(optimizer, x, y=y))
    if case == "covers":
        optimizer = wrapped(min_compress_size=64, warmup_steps=1000)[1]
        return facts(optimizer, *fit(optimizer, x, epochs=2, y=y))
    if case == "unknown_length":  # a generator's dataset: Keras knows no steps per epoch
        def batches():
            for i in range(10):
                yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

        dataset = tf.data.Dataset.from_generator(batches, output_signature=(
            tf.TensorSpec((None, 32), tf.float32), tf.TensorSpec((None,), tf.int64)))
        optimizer = wrapped(min_compress_size=64)[1]
        return facts(optimizer, *fit(optimizer, dataset, epochs=1))
    raise ValueError(case)


def main(_):
    hvd.init()
    report(hvd, **{case: run(case) for case in FLAGS.cases})


if __name__ == "__main__":
    app.run(main)
