"""Compression.auto() in model.fit as users run it, in the Keras `tf.keras` is, on the digits CNN.

Per case of --cases, hc.DistributedOptimizer(..., compression=hc.Compression.auto(calibration_steps=CALIBRATION,
link=...)) fits EPOCHS epochs with the broadcast and metric-average callbacks:
- "slow": AdamW on a given link of 10 Mbit/s, where the gradient's allreduce outlasts the step's compute: the choice
  must compress (under AdamW the low-risk method is 1-bit Adam);
- "fast": SGD on a given link of 1,000 Gbit/s, where nothing pays: the choice must be full precision;
- "measured": SGD on this machine's own loopback, the link measured: whatever it chooses, every rank the same;
- "mixed": "slow" under the mixed_float16 policy (model.compile adds the LossScaleOptimizer around it);
- "loop": "slow" in a custom loop as hvd_compress/auto.py's docstring writes it (each step through
  auto.train_step, the tf.function made anew once it decides), the variables broadcast as the README's
  custom loop says (no model file: the loop compiles nothing to save).
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

CASES = ("slow", "fast", "measured", "mixed", "loop")
define_list_of("cases", CASES, list(CASES), "Cases.")
flags.DEFINE_enum("loader", "hc", ["hc", "keras"], "How every rank loads rank 0's file.")
FLAGS = flags.FLAGS
CALIBRATION, EPOCHS = 6, 3
# mixed_float16 on a CPU makes the step itself 150-500 ms (the others' 5-15 ms), next to which 10 Mbit/s's 90 ms of
# full-precision link is not the 15% that auto asks a method to save: its slow link is slower.
SETTINGS = {"slow": ("adamw", "10mbit"), "fast": ("sgd", "1000gbit"), "measured": ("sgd", None),
            "mixed": ("adamw", "1mbit"), "loop": ("adamw", "10mbit")}


class BytesProbe(tf.keras.callbacks.Callback):
    """The optimizer's bytes per step after every batch (its exchange is built at the first step)."""

    def __init__(self):
        super().__init__()
        self.bytes = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        self.bytes.append(float(optimizer.bytes_per_step))


def stale_step_refused(step, x, y, opt, model):
    """Runs `step`, traced before auto decided: (its error's message, whether the weights and the optimizer's step
    stayed as they were)."""
    before, iterations = weights_digest(model), int(opt.iterations.numpy())
    try:
        step(x, y)
        message = None
    except tf.errors.InvalidArgumentError as error:
        message = error.message
    return dict(message=message, unchanged=weights_digest(model) == before and int(opt.iterations.numpy()) == iterations)


def custom_loop(keras, data):
    """The "loop" case: the digits CNN under AdamW in a custom loop, auto() given a 10 Mbit/s link."""
    (x_train, y_train), (x_test, y_test) = data
    keras.mixed_precision.set_global_policy("float32")
    tf.keras.utils.set_random_seed(hvd.rank())
    train_set, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), 32, 0)
    model = digits.cnn(keras, 0)
    auto = hc.Compression.auto(calibration_steps=CALIBRATION, link="10mbit")
    # (a loop's length is unknown to the optimizer: 1-bit Adam's warm-up is given, as the docs say)
    opt = hc.DistributedOptimizer(keras.optimizers.AdamW(2e-3, weight_decay=0.01), compression=auto,
                                  warmup_steps=2 * CALIBRATION)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_one_batch(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    logged = LoggedLines.attach()
    hc.broadcast_variables(model.variables, 0)
    step, losses, sent = tf.function(train_one_batch), [], []
    for i, (x, y) in enumerate(train_set.take(EPOCHS * steps)):
        loss, decided = auto.train_step(opt, model.trainable_variables, lambda: step(x, y).numpy())
        if decided:  # the calibration's step, run once more as a loop that kept it would: it fails, changing nothing
            stale = stale_step_refused(step, x, y, opt, model)
            step = tf.function(train_one_batch)  # the chosen exchange's step
        if i == 0:
            hc.broadcast_variables(opt.variables() if callable(opt.variables) else opt.variables, 0)
        losses.append(float(loss))
        sent.append(float(opt.bytes_per_step))
    logging.getLogger("hvd_compress").removeHandler(logged)
    logits = model(x_test, training=False)
    return dict(decision=auto.decision, compression=type(opt.compression_exchange.compression).__name__,
                logged=[line for line in logged.lines if "Compression.auto()" in line], stale=stale,
                bytes_before=sent[0], bytes_after=sent[-1],
                allreduce_bytes=hc.exchange.allreduce_bytes(4.0 * model.count_params(), hvd.size()),
                loss=[sum(losses[e * steps:(e + 1) * steps]) / steps for e in range(EPOCHS)],
                accuracy=float(tf.reduce_mean(tf.cast(tf.argmax(logits, -1) == y_test, tf.float32))),
                digest=weights_digest(model))


def run(keras, broadcast, case, data, directory):
    if case == "loop":
        return custom_loop(keras, data)
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
