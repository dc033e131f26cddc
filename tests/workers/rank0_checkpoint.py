"""Checkpoints as Horovod users write them: rank 0 saves, every rank (of this or another world
size) restores that one file.

Phase `full` trains the digits CNN for EPOCHS epochs with every method, rank 0 saving after
epoch EPOCHS / 2 in every format (ModelCheckpoint of the whole model in h5 and in the TF
format, ModelCheckpoint with save_weights_only, tf.train.Checkpoint), and reports the final
accuracy and, per rank, the per-rank state at the save. Phase `resume` (a new process, maybe
another number of ranks) restores rank 0's file of each case (method/format) on every rank, checks
what each rank holds right after the restore, trains the second half with identical ranks checked
after every step (SGP: consensus at the end) and reports the accuracy and the lines hvd_compress logged.
"""
import hashlib
import json
import pathlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd_tf
hvd = hvd_tf  # rank, size and init; no Keras layer of Horovod here

import hvd_compress as hc
from _worker import IdenticalRanks, LoggedLines, distributed_optimizer, keras_and_broadcast, report, weights_digest
from _worker import compression as small_model_compression

import digits

flags.DEFINE_enum("phase", "full", ["full", "resume"], "Which half.")
flags.DEFINE_string("work_dir", None, "Shared between the phases.")
flags.DEFINE_list("methods", "onebit,onebit_oneway,onebit_adamw,topk,randomk,powersgd,sketch,fetchsgd,sgp", "Methods.")
flags.DEFINE_list("cases", None, "Resume: the method/format pairs to restore, e.g. onebit/h5 (default: every "
                  "method of --methods in every format of this Keras).")
flags.DEFINE_integer("epochs", 8, "Epochs in all (saved after half).")
flags.DEFINE_bool("mutate", False, "Resume: give rank 1 rank 0's per-rank state after the restore, as "
                  "a broken restore would (the test must catch it).")
FLAGS = flags.FLAGS
# Model files (whole model, by ModelCheckpoint), weights (ModelCheckpoint save_weights_only) and
# tf.train.Checkpoint, as each Keras writes them.
BROADCAST = None  # the broadcast callback users of this Keras add (set in main)
FORMATS = {"h5": "model.h5", "savedmodel": "model_tf", "weights": "weights", "checkpoint": "ckpt"}
if not tf.keras.__name__.startswith("tf_keras"):  # Keras 3
    FORMATS = {"keras": "model.keras", "weights": "model.weights.h5", "checkpoint": "ckpt"}
MODEL_FILES = ("h5", "savedmodel", "keras")


def new_model(keras, method):
    tf.keras.utils.set_random_seed(0)
    model = digits.cnn(keras, 0)
    sgd = keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9, nesterov=True)
    model.compile(optimizer=optimizer(sgd, method), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def compression(method):
    """The registry's method; the digits CNN is large enough for the defaults of top-k and PowerSGD."""
    return small_model_compression(method, **{"topk": dict(ratio=0.01), "powersgd": dict(rank=4)}.get(method, {}))


def optimizer(sgd, method):
    if method == "sgp":  # overlap: the mass in flight is per-rank state (without it w_i stays 1)
        return hc.PushSumOptimizer(sgd, overlap=True)
    return distributed_optimizer(sgd, method, chosen=compression(method))


def rank_state(opt):
    return (opt.pushsum if hasattr(opt, "pushsum") else opt.compression_exchange).rank_state


def state_digest(opt):
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in rank_state(opt).variables.values())).hexdigest()


def zero_digest(opt):
    return hashlib.sha256(b"".join(s.initial_value().numpy().tobytes()
                                   for s in rank_state(opt).specs.values())).hexdigest()


class SaveOnRankZero(tf.keras.callbacks.Callback):
    """At the end of epoch `at`: rank 0 writes tf.train.Checkpoint; every rank records its per-rank
    state (so the resume can tell whose state it holds)."""

    def __init__(self, at, directory):
        super().__init__()
        self.at, self.directory, self.state = at, directory, None

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 != self.at:
            return
        if hvd.rank() == 0:
            tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer).write(
                str(self.directory / FORMATS["checkpoint"]))
        self.state = state_digest(self.model.optimizer)


def train_epochs(model, data, first, last, callbacks=()):
    """Epochs first..last-1, each on this rank's shard in an order that depends on the epoch only,
    so a resumed run sees the batches the uninterrupted run saw."""
    (x, y), _ = data
    for epoch in range(first, last):
        order = np.random.default_rng(epoch).permutation(len(x))
        model.fit(x[order], y[order], batch_size=32, initial_epoch=epoch, epochs=epoch + 1, shuffle=False,
                  verbose=0, callbacks=list(callbacks))


def accuracy(model, method, x_test, y_test):
    if method == "sgp":
        hc.gossip.consensus(model)
    return float(model.evaluate(x_test, y_test, verbose=0)[1])


def full(method, keras, data, directory):
    _, (x_test, y_test) = data
    model = new_model(keras, method)
    half = FLAGS.epochs // 2
    rank0 = [keras.callbacks.ModelCheckpoint(str(directory / FORMATS[fmt]), save_weights_only=fmt == "weights")
             for fmt in FORMATS if fmt != "checkpoint"]
    broadcast, save = BROADCAST(0), SaveOnRankZero(half, directory)
    train_epochs(model, data, 0, half - 1, [broadcast])
    # ModelCheckpoint writes at every epoch's end: given only the epoch before the save, it writes once.
    train_epochs(model, data, half - 1, half, [broadcast, save] + (rank0 if hvd.rank() == 0 else []))
    train_epochs(model, data, half, FLAGS.epochs)
    return dict(accuracy=accuracy(model, method, x_test, y_test), saved_state=save.state)


def resume(method, fmt, keras, data, directory, saved):
    _, (x_test, y_test) = data
    path = str(directory / FORMATS[fmt])
    if fmt in MODEL_FILES:
        if method == "sgp":
            model = hc.load_model(path, optimizer_wrapper=lambda sgd: hc.PushSumOptimizer(sgd, overlap=True))
        else:
            model = hc.load_model(path, compression=compression(method))
    else:
        model = new_model(keras, method)
        if fmt == "weights":
            if "keras" in FORMATS:  # Keras 3 skips the optimizer's saved state unless it is built
                model.optimizer.build(model.trainable_variables)
            model.load_weights(path)
        else:
            tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path).assert_existing_objects_matched()
    opt = model.optimizer
    opt.build(model.trainable_variables)  # deferred restores happen here, as at a first step
    if FLAGS.mutate and hvd.size() > 1:
        theirs = hvd_tf.broadcast_object([v.numpy() for v in rank_state(opt).variables.values()], 0, name="mutate")
        if hvd.rank() == 1 and all(a.shape == v.shape for a, v in zip(theirs, rank_state(opt).variables.values())):
            for v, a in zip(rank_state(opt).variables.values(), theirs):
                v.assign(a)
    after_restore = state_digest(opt)
    same = IdenticalRanks(method)
    half = FLAGS.epochs // 2
    train_epochs(model, data, half, FLAGS.epochs, [same])
    return dict(accuracy=accuracy(model, method, x_test, y_test), steps_checked=same.checked,
                kept_own=after_restore == saved["saved_state"], reset=after_restore == zero_digest(opt))


def main(_):
    global BROADCAST
    keras, BROADCAST = keras_and_broadcast()
    hvd.init()
    lines = LoggedLines.attach()
    (x, y), test = digits.load(0)
    steps = len(x) // (hvd.size() * 32)  # the same number of steps on every rank
    data = (x[hvd.rank()::hvd.size()][:steps * 32], y[hvd.rank()::hvd.size()][:steps * 32]), test
    work = pathlib.Path(FLAGS.work_dir)
    results = {}
    if FLAGS.phase == "full":
        for method in FLAGS.methods:
            (work / method).mkdir(parents=True, exist_ok=True)
            results[method] = full(method, keras, data, work / method)
        (work / f"saved_state_rank{hvd.rank()}.json").write_text(json.dumps(results))
    else:
        saved_by = work / f"saved_state_rank{hvd.rank()}.json"  # none for a rank the first run had not
        saved = json.loads(saved_by.read_text()) if saved_by.exists() else {}
        for case in FLAGS.cases or [f"{method}/{fmt}" for method in FLAGS.methods for fmt in FORMATS]:
            method, fmt = case.split("/")
            before = len(lines.lines)
            results[case] = resume(method, fmt, keras, data, work / method, saved.get(method, {"saved_state": None}))
            # what the resume said of its state (not the compression onebit() settles on under AdamW, said when a
            # resume that makes its optimizer anew wraps it)
            results[case]["logged"] = [line for line in lines.lines[before:] if " trains as " not in line]
    report(hvd, results=results, size=hvd.size())


if __name__ == "__main__":
    app.run(main)
