"""hc.DiLoCo in model.fit as users run it, in the Keras `tf.keras` is, on the digits CNN.

Per case of --cases:
- "baseline": hc.DistributedOptimizer(AdamW), uncompressed, for the accuracy DiLoCo is held next to;
- "plain", "topk": hc.DiLoCo(AdamW, sync_every=SYNC_EVERY) without and with top-k on the pseudo-gradient;
- "mixed": plain DiLoCo under the mixed_float16 policy (model.compile adds the LossScaleOptimizer);
- "streaming": Streaming DiLoCo, 4-bit pseudo-gradients in FRAGMENTS fragments whose exchanges run in the
  background for SYNC_DELAY steps (the probe compares theta, as the ranks' weights differ in the fragments that
  trained on since their sync; files are written with exchanges in flight);
- "classes": every optimizer class of keras.optimizers as the inner one, on a small dense model: a fit that
  ends on a sync, rank 0's file (.keras, or tf_keras's .h5) loaded with --loader, a fit on.
Each fits with the broadcast, metric-average and Consensus callbacks; a probe records the weights' fingerprint
after every batch that ended a sync, and the ranks compare them. After the fit (Consensus: every rank holds the
average) rank 0 saves a .keras file; every rank loads it with --loader (hc.load_model or
keras.models.load_model), checks that it holds the trained weights and DiLoCo's theta, and trains on for
RESUMED_EPOCHS on data of unknown length that is one batch shorter on rank 1 (the ranks end each epoch
together). Reports accuracy, losses, bytes and the checks."""
import pathlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import bits_fingerprint, define_list_of, keras_and_broadcast, report, weights_digest

import digits

CASES = ("baseline", "plain", "topk", "mixed", "streaming", "classes")
#: keras.optimizers' names that are no optimizer one trains with directly
NOT_OPTIMIZERS = {"LossScaleOptimizer", "MultiOptimizer", "Optimizer", "OptimizerMap"}
define_list_of("cases", CASES, list(CASES), "Cases.")
flags.DEFINE_enum("loader", "hc", ["hc", "keras"], "How every rank loads rank 0's file.")
flags.DEFINE_integer("epochs", 8, "Epochs of each fit.")
flags.DEFINE_string("files", None, "Folder of the cases' .keras files (default: --out_dir).")
flags.DEFINE_bool("resume", False, "Load every case's .keras file from --files, written by an earlier launch (maybe of "
                  "another size), and train on, without training first.")
FLAGS = flags.FLAGS
SYNC_EVERY, RESUMED_EPOCHS = 8, 2
FRAGMENTS, SYNC_DELAY = 4, 3


class SyncProbe(tf.keras.callbacks.Callback):
    """Fingerprints of the weights (streaming: of theta) after every batch that ended a sync period (DiLoCo's
    inner steps a multiple of H), compared across the ranks at each epoch's end; `synced` counts the syncs
    checked."""

    def __init__(self, every, case):
        super().__init__()
        self.every, self.case, self.recorded, self.synced, self.synced_at = every, case, [], 0, set()

    def on_train_begin(self, logs=None):
        self.fingerprint = None

    def on_train_batch_end(self, batch, logs=None):
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        if self.fingerprint is None:  # (theta is made at the first step)
            self.fingerprint = bits_fingerprint(self.model.trainable_weights if self.case != "streaming" else
                                                optimizer.diloco.snapshots)
        steps = int(optimizer.diloco.inner_steps.numpy())
        if steps % self.every == 0 and steps not in self.synced_at:
            self.synced_at.add(steps)
            self.recorded.append(f"{steps}:{self.fingerprint().numpy().tobytes().hex()}")

    def on_epoch_end(self, epoch, logs=None):
        everyone = hvd.allgather_object(self.recorded, name="sync_probe")
        assert all(len(set(at_sync)) == 1 for at_sync in zip(*everyone)), f"ranks differ after a sync: {everyone}"
        assert len({len(r) for r in everyone}) == 1, everyone
        self.synced += len(self.recorded)
        self.recorded = []


def optimizer_of(keras, case):
    if case == "baseline":
        return hc.DistributedOptimizer(keras.optimizers.AdamW(2e-3, weight_decay=0.01))
    inner = keras.optimizers.AdamW(2e-3, weight_decay=0.01)
    if case == "streaming":
        return hc.DiLoCo(inner, sync_every=SYNC_EVERY, compression=hc.Compression.quantize(bits=4),
                         fragments=FRAGMENTS, sync_delay=SYNC_DELAY)
    compression = hc.Compression.topk(ratio=0.05) if case == "topk" else hc.Compression.none
    return hc.DiLoCo(inner, sync_every=SYNC_EVERY, compression=compression)


def callbacks(keras, broadcast, case, probe):
    found = [broadcast(0), hc.callbacks.MetricAverageCallback()]
    return found + ([probe, hc.callbacks.Consensus()] if case != "baseline" else [])


def uneven(x, y):
    """This rank's shard as data of unknown length, one batch shorter on rank 1."""
    train_set, steps = digits.shard(x, y, hvd.rank(), hvd.size(), 32, 1)
    return train_set.take(steps - int(hvd.rank() == 1)).filter(lambda *_: True), steps


def run(keras, broadcast, case, data, directory):
    (x_train, y_train), (x_test, y_test) = data
    keras.mixed_precision.set_global_policy("mixed_float16" if case == "mixed" else "float32")
    tf.keras.utils.set_random_seed(hvd.rank())  # the ranks start apart; the broadcast makes them alike
    train_set, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), 32, 0)
    model = digits.cnn(keras, 0)
    optimizer = optimizer_of(keras, case)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    probe = SyncProbe(SYNC_EVERY, case)
    history = model.fit(train_set, epochs=FLAGS.epochs, steps_per_epoch=steps, verbose=0,
                        callbacks=callbacks(keras, broadcast, case, probe))
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    result = dict(accuracy=float(accuracy), loss=history.history["loss"], digest=weights_digest(model),
                  syncs_checked=probe.synced)
    if case == "baseline":
        return result
    return {**result, **train_on(keras, broadcast, case, data, directory / f"{case}.keras", model, optimizer)}


def train_on(keras, broadcast, case, data, path, model=None, optimizer=None):
    """Rank 0's file of the trained `model` (written here where the model is given, else by an earlier launch,
    --resume; rank 0 also loads it alone) loaded on every rank with --loader, checked against the model where there is
    one, and trained on for RESUMED_EPOCHS over data of unknown length, uneven across the ranks."""
    (x_train, y_train), (x_test, y_test) = data
    result = {}
    if model is None:  # (another launch wrote it)
        keras.mixed_precision.set_global_policy("mixed_float16" if case == "mixed" else "float32")
    else:
        result.update(bytes_per_step=optimizer.diloco.bytes_per_step, peak_bytes=optimizer.diloco.peak_bytes_per_step,
                      bytes_per_sync=optimizer.diloco.bytes_per_sync,
                      allreduce_bytes_per_step=optimizer.diloco.uncompressed_bytes)
        thetas = [s.numpy() for s in optimizer.diloco.snapshots]
        if hvd.rank() == 0:
            model.save(path)
            # alone (compile=True builds the optimizer, and must not wait for the other ranks)
            result["alone_loss"] = float(keras.models.load_model(path).evaluate(x_test, y_test, verbose=0)[0])
        hvd.allreduce(tf.constant(0.0), name=f"saved.{case}")  # rank 0's file is written
    path = str(path)
    loaded = hc.load_model(path) if FLAGS.loader == "hc" else keras.models.load_model(path)
    inner = getattr(loaded.optimizer, "inner_optimizer", loaded.optimizer)
    result["loaded_class"] = type(inner).__name__
    result["loaded_loss"] = float(loaded.evaluate(x_test, y_test, verbose=0)[0])
    if model is not None:
        result["loaded_weights"] = weights_digest(loaded) == weights_digest(model)
        result["loaded_theta"] = all(np.array_equal(a, b.numpy()) for a, b in zip(thetas, inner.diloco.snapshots))
        result["trained_loss"] = float(model.evaluate(x_test, y_test, verbose=0)[0])
        if case == "streaming":  # the averaged changes of exchanges in flight when rank 0 saved, to land after loading
            pending = [p.numpy() for fragment in optimizer.diloco.pending for p in fragment]
            result["loaded_pending"] = (max(np.abs(p).max() for p in pending) > 0 and all(
                np.array_equal(a, b.numpy()) for a, b in zip(pending, sum(inner.diloco.pending, []))))
    uneven_set, _ = uneven(x_train, y_train)
    resumed_probe = SyncProbe(SYNC_EVERY, case)
    resumed = loaded.fit(uneven_set, epochs=RESUMED_EPOCHS, verbose=0,
                         callbacks=callbacks(keras, broadcast, case, resumed_probe))
    result.update(resumed_loss=resumed.history["loss"], resumed_digest=weights_digest(loaded),
                  resumed_steps=int(inner.iterations.numpy()), resumed_syncs_checked=resumed_probe.synced,
                  resumed_accuracy=float(loaded.evaluate(x_test, y_test, verbose=0)[1]))
    keras.mixed_precision.set_global_policy("float32")
    return result


def every_class(keras, broadcast, directory):
    """{class name: (the ranks agree after the fit's last sync, the file's optimizer, its theta kept, the loss of
    the fit on)}."""
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.normal(size=(64, 12)).astype("float32"), rng.integers(0, 4, 64)
    results = {}
    for name in sorted(n for n in dir(keras.optimizers) if n[0].isupper() and n not in NOT_OPTIMIZERS):
        cls = getattr(keras.optimizers, name)
        if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
            continue
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        model.compile(hc.DiLoCo(cls(learning_rate=0.01), sync_every=4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[broadcast(0)])  # 8 steps: 2 syncs
        digests = hvd.allgather_object(weights_digest(model), name=f"classes.{name}")
        path = str(directory / f"{name}.{'h5' if keras.__name__.startswith('tf_keras') else 'keras'}")
        if hvd.rank() == 0:
            model.save(path)
        hvd.allreduce(tf.constant(0.0), name=f"saved.{name}")
        loaded = hc.load_model(path) if FLAGS.loader == "hc" else keras.models.load_model(path)
        thetas = all(np.array_equal(a.numpy(), b.numpy()) for a, b in
                     zip(model.optimizer.diloco.snapshots, loaded.optimizer.diloco.snapshots))
        history = loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[broadcast(0)])
        results[name] = dict(agree=len(set(digests)) == 1, loaded=type(loaded.optimizer).__name__, theta=thetas,
                             loss=float(history.history["loss"][-1]),
                             agree_after=len(set(hvd.allgather_object(weights_digest(loaded),
                                                                      name=f"after.{name}"))) == 1)
    return results


def main(_):
    keras, broadcast = keras_and_broadcast()
    hvd.init()
    data = digits.load(0)
    directory = pathlib.Path(FLAGS.files or FLAGS.out_dir)
    if FLAGS.resume:
        report(hvd, results={case: train_on(keras, broadcast, case, data, directory / f"{case}.keras")
                             for case in FLAGS.cases})
        return
    report(hvd, results={case: every_class(keras, broadcast, directory) if case == "classes" else
                         run(keras, broadcast, case, data, directory) for case in FLAGS.cases})


if __name__ == "__main__":
    app.run(main)
