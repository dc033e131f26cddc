"""Model files as Horovod users write and read them: rank 0 saves the whole model (ModelCheckpoint's
habit), every rank loads it, with keras.models.load_model and with hvd_compress.load_model, and
trains on.

For each optimizer class of the Keras `tf.keras` is (every class of keras.optimizers, and a user's
subclass registered with register_keras_serializable that has its own constructor argument) and
the method given to it: compile with hc.DistributedOptimizer, fit, save on rank 0 in each of this
Keras's model formats, then per format and loader: load, check what came back (a distributed
optimizer of the same class, the same compression and settings, the step count), fit on with each
rank on its own data, and report the digest of the weights after every batch. With --every_load each
format is loaded with both loaders; without, class i loads format j with loader (i + j) mod 2 only:
every class comes back from both loaders and from each format, and each format from both loaders
(files_to_load). Ranks must be bit-identical; an optimizer loaded undistributed would drift (the
`undistributed` control case shows it does: a plain file loaded with Keras's loader and trained with
allow_undistributed=True), and hc's callbacks refuse it (the `guard` case).

Reports {case: {...}} with case "<Class>/<method>/<format>/<loader>".
"""
import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
import _worker
from _worker import define_list_of, report, weights_digest

METHODS = ["none", "onebit", "topk", "powersgd"]
flags.DEFINE_list("optimizers", None, "Optimizer classes (default: every class of this Keras, and ScaledSGD).")
flags.DEFINE_integer("rotation", 0, "Optimizer i gets method i + rotation (mod 4): the launches of "
                     "tests/test_model_files.py (rotations 0-2) give every class three methods.")
define_list_of("methods", METHODS, METHODS, "The methods rotated through.")
flags.DEFINE_bool("every_load", False, "Load each format with both loaders (default: one loader a format, "
                  "in turn over the classes).")
flags.DEFINE_string("work_dir", None, "Where rank 0 saves.")
flags.DEFINE_enum("policy", "float32", ["float32", "mixed_float16"], "Keras's dtype policy.")
flags.DEFINE_bool("hierarchical_exchange", False, "Wrap with hierarchical=True (launched as hosts: tests/hvdrun.run_hosts; "
                  "horovodrun would take --hierarchical for its own options).")
FLAGS = flags.FLAGS
KERAS3 = not tf.keras.__name__.startswith("tf_keras")  # TF_USE_LEGACY_KERAS decides, as for users
if KERAS3:
    import keras
else:
    import tf_keras as keras
FORMATS = {"keras": "model.keras", "h5": "model.h5"} if KERAS3 else {"h5": "model.h5", "savedmodel": "model_tf"}
#: Composite optimizers (a map of optimizers to variables) and the base class are not trainable alone.
NOT_OPTIMIZERS = {"LossScaleOptimizer", "MultiOptimizer", "Optimizer", "OptimizerMap"}
BATCH, STEPS = 8, 3
#: What Keras itself cannot save, wrapped or not: Keras 3's h5 writer gives two of Adafactor's variables one name.
KERAS_CANNOT_SAVE = {("Adafactor", "h5")} if KERAS3 else set()
LOADERS = {"keras": keras.models.load_model, "hc": hc.load_model}


@keras.saving.register_keras_serializable(package="tests")
class ScaledSGD(keras.optimizers.SGD):
    """A user's optimizer with a constructor argument of its own: SGD on scale * gradient."""

    def __init__(self, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}

    def update_step(self, gradient, variable, *learning_rate):
        super().update_step(gradient * tf.cast(self.scale, gradient.dtype), variable, *learning_rate)


def optimizer_classes():
    names = FLAGS.optimizers or sorted(n for n in dir(keras.optimizers)
                                       if n[0].isupper() and n not in NOT_OPTIMIZERS) + ["ScaledSGD"]
    return {name: ScaledSGD if name == "ScaledSGD" else getattr(keras.optimizers, name) for name in names}


def new_optimizer(cls):
    if cls is ScaledSGD:
        return ScaledSGD(scale=0.5, learning_rate=0.05)
    if cls.__name__ == "Muon":  # Muon's own update is for 2-D kernels; it hands the rest to AdamW
        return cls(learning_rate=0.01)
    return cls(learning_rate=0.01)


def compression(method):
    """The method's compression; onebit one-way, so that a setting other than the default must come back."""
    return _worker.compression(method, **({"two_way": False} if method == "onebit" else {}))


def new_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])


def data(seed):
    """This rank's own data (the ranks differ, so ranks training alone would drift apart)."""
    rng = np.random.default_rng(1000 * hvd.rank() + seed)
    return rng.normal(size=(BATCH * STEPS, 12)).astype("float32"), rng.integers(0, 4, BATCH * STEPS)


class Digests(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.digests = []

    def on_train_batch_end(self, batch, logs=None):
        self.digests.append(weights_digest(self.model))


def fit(model, seed, **callback_args):
    digests = Digests()
    model.fit(*data(seed), batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[hc.callbacks.BroadcastGlobalVariablesCallback(0, **callback_args), digests])
    return digests.digests


def inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


def barrier(name):
    hvd.allgather_object(0, name=name)


def files_to_load(i, name):
    """The (format, loader) pairs the i-th class loads (--every_load: every pair). Where Keras cannot save
    the class in a format, the other format takes both loaders."""
    formats = [fmt for fmt in FORMATS if (name, fmt) not in KERAS_CANNOT_SAVE]
    if FLAGS.every_load:
        return [(fmt, loader) for fmt in formats for loader in LOADERS]
    return [(formats[j % len(formats)], list(LOADERS)[(i + j) % 2]) for j in range(len(FORMATS))]


def saved_and_loaded(cls, method, path, loads):
    """Trains a wrapped `cls` with `method`, saves it on rank 0 in the formats of `loads`; yields
    (format, loader, its model) for each (format, loader) of `loads`, with what the original had at the save."""
    model = new_model()
    optimizer = new_optimizer(cls)
    wrapped = hc.DistributedOptimizer(optimizer, compression=compression(method), min_compress_size=64,
                                      hierarchical=FLAGS.hierarchical_exchange)
    assert wrapped is optimizer
    model.compile(optimizer=wrapped, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(model, 0)
    for name in dict.fromkeys(fmt for fmt, _ in loads):  # each format saved once
        if hvd.rank() == 0:
            model.save(str(path / FORMATS[name]))
        barrier(f"saved.{path.name}.{name}")
        for loader in (loader for fmt, loader in loads if fmt == name):
            yield name, loader, LOADERS[loader](str(path / FORMATS[name])), wrapped


def check(loaded, saved):
    """What a loaded model's optimizer must be: distributed, of the saved class, with the saved
    compression and settings and step count."""
    optimizer = inner(loaded.optimizer)
    exchange = getattr(optimizer, "compression_exchange", None)
    return {"class": optimizer._hc_base.__name__ if exchange else type(optimizer).__name__, "is_saved_class": isinstance(optimizer, saved._hc_base),
            "distributed": exchange is not None,
            "loss_scaled": loaded.optimizer is not optimizer,
            "compression": repr(exchange.compression) if exchange else None,
            "same_compression": exchange is not None and repr(exchange.compression) == repr(
                saved.compression_exchange.compression),
            "same_settings": exchange is not None and exchange.min_compress_size == 64
            and exchange.hierarchical == FLAGS.hierarchical_exchange,
            "iterations": int(optimizer.iterations.numpy()), "saved_iterations": int(saved.iterations.numpy()),
            "scale": getattr(optimizer, "scale", None)}


def main(_):
    hvd.init()
    keras.mixed_precision.set_global_policy(FLAGS.policy)
    import pathlib
    work = pathlib.Path(FLAGS.work_dir)
    results = {}
    for i, (name, cls) in enumerate(optimizer_classes().items()):
        method = FLAGS.methods[(i + FLAGS.rotation) % len(FLAGS.methods)]
        case_dir = work / f"{name}-{method}"
        if hvd.rank() == 0:
            case_dir.mkdir(parents=True, exist_ok=True)
        if name == "Adafactor" and method == "topk":
            try:
                hc.DistributedOptimizer(cls(), compression=compression(method))
                results[f"{name}/{method}"] = {"refused": None}
            except ValueError as e:
                results[f"{name}/{method}"] = {"refused": str(e)}
            continue
        for fmt, loader, model, saved in saved_and_loaded(cls, method, case_dir, files_to_load(i, name)):
            facts = check(model, saved)
            facts["digests"] = fit(model, 1)
            results[f"{name}/{method}/{fmt}/{loader}"] = facts
    # Controls: a plain optimizer's file, loaded with Keras's loader, is not distributed.
    model = new_model()
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    path = work / f"plain.{'keras' if KERAS3 else 'h5'}"
    if hvd.rank() == 0:
        model.save(str(path))
    barrier("plain")
    plain = keras.models.load_model(str(path))
    try:
        fit(plain, 1)
        results["guard"] = {"refused": None}
    except ValueError as e:
        results["guard"] = {"refused": str(e)}
    results["undistributed"] = {"digests": fit(plain, 1, allow_undistributed=True)}
    wrapped = hc.load_model(str(path), compression=hc.Compression.topk(ratio=0.1), min_compress_size=64)
    results["plain/hc"] = dict(check_plain=repr(inner(wrapped.optimizer).compression_exchange.compression),
                               iterations=int(inner(wrapped.optimizer).iterations.numpy()),
                               digests=fit(wrapped, 2))
    report(hvd, **results)


if __name__ == "__main__":
    app.run(main)
