"""Data of unknown length that runs out at different steps on different ranks, as a user meets it: each rank's
dataset is a generator (tf.data cannot know its length) of BATCHES[rank] batches; model.fit with hvd_compress's
callbacks, or the custom loop of hvd_compress.stop_together. Every epoch must end on every rank at the shortest
rank's count, with no hang, and the ranks bit-identical after every batch (IdenticalRanks).

Cases: the loop (fit, loop), the compression, and what else a user adds: steps_per_execution, mixed precision's
LossScaleOptimizer, a DistributedGradientTape. Each rank reports per case and epoch the batches it trained, the
seconds from its last batch to the epoch's end, the losses, and the digest of its weights after the case.
"""
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import IdenticalRanks, report, weights_digest

#: case -> (loop, compression, extra)
CASES = {
    "fit_none": ("fit", "none", None),
    "fit_onebit": ("fit", "onebit", None),
    "fit_topk": ("fit", "topk", None),
    "fit_onebit_steps_per_execution": ("fit", "onebit", "steps_per_execution"),
    "fit_topk_loss_scale": ("fit", "topk", "loss_scale"),
    "loop_none": ("loop", "none", None),
    "loop_onebit": ("loop", "onebit", None),
    "loop_topk": ("loop", "topk", None),
    "loop_topk_tape": ("loop", "topk", "tape"),
}
BATCHES = [10, 8, 9, 11, 12]  # per rank
EPOCHS, BATCH = 2, 16
flags.DEFINE_list("cases", list(CASES), "Cases.")
FLAGS = flags.FLAGS


def dataset(rank, seed):
    """A generator of BATCHES[rank] batches: tf.data's cardinality is unknown."""
    def batches():
        rng = np.random.default_rng(1000 * seed + rank)
        for _ in range(BATCHES[rank]):
            x = rng.standard_normal([BATCH, 8]).astype(np.float32)
            yield x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)

    spec = (tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None], tf.int64))
    data = tf.data.Dataset.from_generator(batches, output_signature=spec)
    assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    return data


def compression(name):
    return {"none": hc.Compression.none, "onebit": hc.Compression.onebit(),
            "topk": hc.Compression.topk(ratio=0.05)}[name]


def new_model(keras):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.layers.Input([8]), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(3)])  # (4,096 compressed)


class EpochTimes(tf.keras.callbacks.Callback):
    """Per epoch: the optimizer steps taken and the seconds from the last batch's end to the epoch's end."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        self.steps, self.after_last_batch, self.last, self.first = [], [], None, None

    def on_epoch_begin(self, epoch, logs=None):
        self.first, self.last = int(self.optimizer.iterations.numpy()), time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        self.last = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        self.after_last_batch.append(time.monotonic() - self.last)
        self.steps.append(int(self.optimizer.iterations.numpy()) - self.first)


def run_fit(keras, method, extra):
    model = new_model(keras)
    opt = hc.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=compression(method))
    if extra == "loss_scale":
        opt = keras.mixed_precision.LossScaleOptimizer(opt)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=3 if extra == "steps_per_execution" else 1)
    # Under Keras 3, with steps_per_execution > 1 the last execution of an epoch ends on_train_batch_end where the
    # data ran out, but not where a step found another rank out of data: IdenticalRanks compares a record a batch.
    times = EpochTimes(opt)
    same = IdenticalRanks(method) if extra != "steps_per_execution" else None
    history = model.fit(dataset(hvd.rank(), 0), epochs=EPOCHS, verbose=0, callbacks=[
        hc.callbacks.BroadcastGlobalVariablesCallback(0), hc.callbacks.MetricAverageCallback(), times,
        *([same] if same else [])])
    return dict(steps=times.steps, after_last_batch=times.after_last_batch, loss=history.history["loss"],
                checked=same.checked if same else None, digest=weights_digest(model))


def run_loop(keras, method, extra):
    model = new_model(keras)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if extra == "tape":
        opt = keras.optimizers.SGD(0.05, momentum=0.9)
        exchange = hc.GradientExchange(compression(method))
    else:
        opt = hc.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=compression(method))

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if extra == "tape":
            tape = hc.DistributedGradientTape(tape, exchange=exchange)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    hc.broadcast_variables(model.variables, 0)
    steps, after_last_batch, losses, digests = [], [], [], []
    for epoch in range(EPOCHS):
        steps.append(0)
        total = 0.0
        last = time.monotonic()
        with hc.stop_together():
            for x, y in dataset(hvd.rank(), 0):
                total += float(train_step(x, y))
                steps[-1] += 1
                digests.append(weights_digest(model))
                last = time.monotonic()
                if epoch == 0 and steps[-1] == 1:
                    hc.broadcast_variables(opt.variables, 0)
        after_last_batch.append(time.monotonic() - last)
        losses.append(total / max(steps[-1], 1))
    everyone = hvd.allgather_object(digests, name="uneven.loop_digests")
    assert all(len(set(step)) == 1 for step in zip(*everyone)) and len({len(d) for d in everyone}) == 1
    return dict(steps=steps, after_last_batch=after_last_batch, loss=losses, checked=len(digests),
                digest=weights_digest(model))


def main(_):
    hvd.init()
    keras = tf.keras
    results = {}
    for case in FLAGS.cases:
        loop, method, extra = CASES[case]
        results[case] = (run_fit if loop == "fit" else run_loop)(keras, method, extra)
    report(hvd, results=results)


if __name__ == "__main__":
    app.run(main)
