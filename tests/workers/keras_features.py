"""Ordinary Keras features with every method, as users turn them on, in the Keras `tf.keras` is
(tf_keras under TF_USE_LEGACY_KERAS=1, Keras 3 otherwise: _worker.keras_and_broadcast).

Runs each case in --cases, one after another in this process; reports {case: results}.
matrix: for each row (mixed precision policies, an explicit LossScaleOptimizer, float16
variables, an Embedding, an unused layer, clipping) and each method (or each pair in --matrix),
model.fit on this rank's data; after every batch the ranks must hold identical weights (SGP:
checked after consensus); reports the loss per epoch, whether all state is finite, and the row's
own facts (the unused layer's weights, the loss scale).
overflow: mixed_float16; at batch OVERFLOW_AT one sample of rank 1 has an infinite weight,
so only rank 1's gradient overflows: every rank must skip that step (weights and state as they
were) and halve its loss scale alike.
clipping: a constant gradient (norm > 1) with clipnorm=1 / global_clipnorm=1 (or, --noboth_clips,
one of them in turn) for STEPS_CLIPPED steps: how far each method moves the weights, next to the
uncompressed exchange and to the same method fed the gradient clipped by hand.
metrics: hc.callbacks.MetricAverageCallback on ranks with different data: the logs a
later callback sees are the ranks' average.
"""
import glob
import hashlib
import os
import tempfile

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd_tf
import hvd_compress as hc
from _worker import (IdenticalRanks, compression, define_list_of, distributed_optimizer, is_gossip, keras_and_broadcast,
                     report, weights_digest)

ROWS = ["mixed_float16", "explicit_loss_scale", "mixed_bfloat16", "float16_variables", "bfloat16_variables",
        "embedding", "unused_layer", "clipnorm", "global_clipnorm"]
#: sgp_mpi: SGP over MPI point to point (an MPI launch).
METHODS = ["onebit", "onebit_oneway", "onebit_adamw", "topk", "randomk", "powersgd", "sketch", "fetchsgd", "sgp", "sgp_mpi",
           "fp16"]
CASES = ["matrix", "overflow", "clipping", "metrics"]
define_list_of("cases", CASES, CASES, "Cases.")
define_list_of("methods", METHODS, METHODS, "Methods.")
define_list_of("matrix", [f"{row}/{method}" for row in ROWS for method in METHODS], [],
               "The matrix's cases, <row>/<method> (default: every row with every one of --methods).")
flags.DEFINE_bool("both_clips", True, "clipping: every method under clipnorm and global_clipnorm (False: the methods "
                  "take them in turn; the uncompressed reference takes both).")
FLAGS = flags.FLAGS
BATCH, STEPS, EPOCHS, OVERFLOW_AT, STEPS_CLIPPED = 16, 6, 2, 3, 300
BROADCAST = None  # the broadcast callback users of this Keras add (set in main)


def wrap(sgd, method):
    if is_gossip(method):
        return hc.PushSumOptimizer(sgd, graph="exponential2", transport="mpi" if method == "sgp_mpi" else "alltoall")
    return distributed_optimizer(sgd, method, min_compress_size=64)


def digest(arrays):
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in arrays)).hexdigest()


def loss_scale(opt):
    """A LossScaleOptimizer's current scale (tf_keras: loss_scale, Keras 3: dynamic_scale)."""
    scale = getattr(opt, "loss_scale", getattr(opt, "dynamic_scale", None))
    return None if scale is None else float(np.array(scale))


def inner(opt):
    """The hvd_compress optimizer inside a LossScaleOptimizer (or itself)."""
    return getattr(opt, "inner_optimizer", opt)


def all_state(opt):
    """Every variable of the optimizer: replicated (optimizer.variables) and per-rank."""
    hc_opt = inner(opt)
    owner = hc_opt.pushsum if hasattr(hc_opt, "pushsum") else hc_opt.compression_exchange
    return list(hc_opt.variables) + list(owner.rank_state.variables.values())


def model_for(keras, row):
    if row == "unused_layer":  # an MLP with a layer whose weights get no gradient (None): built, never called
        unused = keras.layers.Dense(23)
        unused.build((None, 29))
        inputs = keras.layers.Input((29,))
        model = keras.Model(inputs, keras.layers.Dense(5)(keras.layers.Dense(37, activation="relu")(inputs)))
        model.unused = unused
        return model
    if row == "embedding":
        return keras.Sequential([keras.layers.Input((12,), dtype="int32"), keras.layers.Embedding(50, 16),
                                 keras.layers.Flatten(), keras.layers.Dense(37, activation="relu"),
                                 keras.layers.Dense(5), keras.layers.Activation("linear", dtype="float32")])
    return keras.Sequential([keras.layers.Input((29,)), keras.layers.Dense(37, activation="relu"),
                             keras.layers.Dense(23, activation="relu"), keras.layers.Dense(5),
                             keras.layers.Activation("linear", dtype="float32")])


def data(row, rank):
    rng = np.random.default_rng([rank, 7])
    if row == "embedding":
        x = rng.integers(0, 50, (STEPS * BATCH, 12)).astype(np.int32)
        return x, (x[:, 0] % 5)
    x = rng.standard_normal((STEPS * BATCH, 29)).astype(np.float32)
    return x, (x[:, :5]).argmax(1)


def policy_for(row):
    return {"mixed_float16": "mixed_float16", "explicit_loss_scale": "mixed_float16",
            "mixed_bfloat16": "mixed_bfloat16", "float16_variables": "float16",
            "bfloat16_variables": "bfloat16"}.get(row, "float32")


def train(keras, row, method):
    keras.mixed_precision.set_global_policy(policy_for(row))
    try:
        tf.keras.utils.set_random_seed(0)
        model = model_for(keras, row)
        clip = {"clipnorm": dict(clipnorm=0.5), "global_clipnorm": dict(global_clipnorm=0.5)}.get(row, {})
        decay = dict(weight_decay=1e-2) if row == "unused_layer" else {}
        opt = wrap(keras.optimizers.SGD(0.05, momentum=0.9, **clip, **decay), method)
        if row == "explicit_loss_scale":
            opt = keras.mixed_precision.LossScaleOptimizer(opt)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        unused_before = [np.array(w) for w in model.unused.weights] if row == "unused_layer" else []
        identical = IdenticalRanks(method)
        x, y = data(row, hvd_tf.rank())
        # Horovod's broadcast has no bfloat16 (its own limit): there the same seed gives the same start.
        broadcast = [] if row == "bfloat16_variables" else [BROADCAST(0)]
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                            callbacks=broadcast + [identical])
        if is_gossip(method):
            hc.gossip.consensus(model)
            everyone = hvd_tf.allgather_object(weights_digest(model), name="consensus")
            assert len(set(everyone)) == 1, "sgp: ranks differ after consensus"
        opt = model.optimizer
        result = dict(
            losses=[float(v) for v in history.history["loss"]], steps_checked=identical.checked,
            finite=bool(all(np.isfinite(v.numpy().astype(np.float32)).all() for v in all_state(opt))),
            weights_finite=bool(all(np.isfinite(w.astype(np.float32)).all() for w in model.get_weights())),
            loss_scale=loss_scale(opt),
            variable_dtypes=sorted({tf.as_dtype(v.dtype).name for v in model.trainable_variables}),
            optimizer=type(opt).__name__)
        if row == "unused_layer":
            result["unused_moved"] = float(max(np.abs(np.array(w) - b).max()
                                               for w, b in zip(model.unused.weights, unused_before)))
        if not is_gossip(method):
            result["bytes_per_step"] = float(inner(opt).compression_exchange.bytes_sent)
            result["uncompressed_bytes_per_step"] = float(inner(opt).compression_exchange.uncompressed_bytes)
        return result
    finally:
        keras.mixed_precision.set_global_policy("float32")


class Overflow(tf.keras.callbacks.Callback):
    """Around batch OVERFLOW_AT: every piece of state and the loss scale, before and after."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == OVERFLOW_AT:
            self.before = self.snapshot()

    def on_train_batch_end(self, batch, logs=None):
        if batch == OVERFLOW_AT:
            self.after = self.snapshot()

    def snapshot(self):
        opt = self.model.optimizer
        inner_opt = inner(opt)
        state = [v for v in all_state(opt) if v is not inner_opt.iterations]
        return dict(weights=weights_digest(self.model), state=digest(v.numpy() for v in state),
                    loss_scale=loss_scale(opt), iterations=int(inner_opt.iterations.numpy()))


def overflow(keras, method):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        tf.keras.utils.set_random_seed(0)
        model = model_for(keras, "mlp")
        model.compile(optimizer=wrap(keras.optimizers.SGD(0.05, momentum=0.9), method),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = data("mlp", hvd_tf.rank())
        weights = np.ones(len(x), np.float32)
        if hvd_tf.rank() == 1:
            weights[OVERFLOW_AT * BATCH] = np.inf  # only rank 1's gradient overflows
        watch = Overflow()
        model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[BROADCAST(0), watch])
        everyone = hvd_tf.allgather_object(weights_digest(model), name="after_overflow")
        return dict(before=watch.before, after=watch.after, identical=len(set(everyone)) == 1 or is_gossip(method),
                    inner_is_loss_scaled=type(model.optimizer).__name__)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def movement(keras, method, g, clip):
    """Mean |change| per coordinate after STEPS_CLIPPED steps of the same constant gradient g, and
    the same with the worker's residual added (what it still holds back, to be applied later)."""
    w = tf.Variable(tf.zeros(g.shape))
    sgd = keras.optimizers.SGD(0.01, **clip)
    opt = hc.DistributedOptimizer(sgd, min_compress_size=64) if method == "none" else wrap(sgd, method)

    @tf.function
    def steps():
        for _ in tf.range(STEPS_CLIPPED):
            opt.apply_gradients([(g, w)])

    steps()
    exchange = getattr(opt, "compression_exchange", None)
    residuals = [r for r in (exchange.residuals if exchange else []) if r is not None]
    held = residuals[0] if residuals else tf.zeros_like(w)  # without momentum: e - w = lr * (sum of g)
    return float(tf.reduce_mean(tf.abs(w)).numpy()), float(tf.reduce_mean(tf.abs(w - held)).numpy())


def clipped_movements(keras, methods):
    """{"<clip>/<method>": ...}: each method with clipping, and without clipping on the gradient clipped by hand
    (the same if clipping happens once, on each rank's gradient before error feedback)."""
    clips = {"clipnorm": dict(clipnorm=1.0), "global_clipnorm": dict(global_clipnorm=1.0)}
    g = tf.constant(np.random.default_rng(3).uniform(0.5, 1.5, (64, 64)).astype(np.float32))
    results = {}
    for i, method in enumerate(methods):
        # g is one variable: both clippings give g / |g|, so one run by hand serves both
        by_hand, _ = movement(keras, method, g * (1.0 / tf.norm(g)), {})
        for name in clips if FLAGS.both_clips or method == "none" else [list(clips)[i % 2]]:
            clipped, with_residual = movement(keras, method, g, clips[name])
            results[f"{name}/{method}"] = dict(clipped=clipped, clipped_by_hand=by_hand,
                                               clipped_with_residual=with_residual)
    return results


class EpochLogs(tf.keras.callbacks.Callback):
    """The logs as this callback sees them at each epoch end."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append({key: float(value) for key, value in logs.items()})


def tensorboard_tags(log_dir):
    """The scalar tags in the TensorBoard event files under log_dir."""
    tags = set()
    for path in glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(value.tag for value in event.summary.value)
    return sorted(tags)


def averaged_metrics(keras):
    """MetricAverageCallback's logs beside each rank's own, with CompressionMetrics and, on rank 0, Keras's
    TensorBoard after them (as the docs suggest): the tags TensorBoard wrote."""
    tf.keras.utils.set_random_seed(0)
    model = model_for(keras, "mlp")
    model.compile(optimizer=wrap(keras.optimizers.SGD(0.05), "onebit"), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data("mlp", hvd_tf.rank())
    local, averaged = EpochLogs(), EpochLogs()
    log_dir = tempfile.mkdtemp(prefix="tensorboard")
    board = [keras.callbacks.TensorBoard(log_dir)] if hvd_tf.rank() == 0 else []
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[BROADCAST(0), local, hc.callbacks.MetricAverageCallback(), averaged,
                         hc.callbacks.CompressionMetrics(), *board])
    return dict(local=local.seen, averaged=averaged.seen, tensorboard=tensorboard_tags(log_dir))


def run_case(keras, case):
    if case == "matrix":
        cases = FLAGS.matrix or [f"{row}/{method}" for row in ROWS for method in FLAGS.methods]
        return {key: train(keras, *key.split("/")) for key in cases}
    if case == "metrics":
        return averaged_metrics(keras)
    if case == "overflow":
        return {method: overflow(keras, method) for method in FLAGS.methods}
    return clipped_movements(keras, ["none"] + [m for m in FLAGS.methods if not is_gossip(m)])


def main(_):
    global BROADCAST
    keras, BROADCAST = keras_and_broadcast()
    hvd_tf.init()
    report(hvd_tf, results={case: run_case(keras, case) for case in FLAGS.cases})


if __name__ == "__main__":
    app.run(main)
