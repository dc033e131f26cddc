"""What wrapping keeps and what hvd_compress refuses, as users meet it (Keras 3 or tf_keras, as
TF_USE_LEGACY_KERAS says). Runs the cases given; reports {case: facts}.

- exclusions: AdamW with exclude_from_weight_decay(var_names=["bias"]), wrapped: zero gradients
  leave the bias alone and decay the kernel.
- trained: an SGD that already ran 5 steps keeps its step count and momenta when wrapped; the model's
  old traced step is refused, and after model.compile the ranks train identically.
- subclass: a subclass's own constructor argument (ScaledSGD(scale=0)) holds: nothing moves.
- callables: a callable learning rate and an unregistered LearningRateSchedule train wrapped.
- tape: hc.DistributedGradientTape with Compression.none and fp16 inside a tf.function (Horovod's
  custom loop): the ranks end identical.
- lazy: a Sequential without keras.Input and a subclassed Model, with hc's broadcast callback: the
  ranks are identical from the second step on.
- uneven: one rank has 5 batches, the other 4: model.fit refuses before the first step.
- load_weights: a .weights.h5 (Keras 3) or h5 weights file loaded into a fresh model whose
  optimizer is not built: the log says the optimizer was not restored.
- guard: a plain optimizer with hc's callbacks: refused at more than one rank, trains at one.
- files: hc.load_model's compression= replaces the saved one; a PushSumOptimizer file comes back
  from either loader; rank 0 alone loads (compile=True) and evaluates a file.
- mixed_without_callbacks: mixed_float16 and model.fit with no callback at all (Keras 3's
  LossScaleOptimizer builds its inner optimizer inside the traced step): trains, ranks identical.
"""
import logging

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import LoggedLines, define_list_of, report, weights_digest

CASES = ["exclusions", "trained", "subclass", "callables", "tape", "lazy", "uneven", "load_weights", "guard",
         "mixed_without_callbacks", "files"]
define_list_of("cases", CASES, CASES, "Cases.")
flags.DEFINE_string("work_dir", None, "Where rank 0 saves.")
FLAGS = flags.FLAGS
KERAS3 = not tf.keras.__name__.startswith("tf_keras")
if KERAS3:
    import keras
else:
    import tf_keras as keras


def everyone(value, name):
    return hvd.allgather_object(value, name=f"wrapping.{name}")


def dense_model(lazy=False):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    return keras.Sequential(layers if lazy else [keras.Input((6,))] + layers)


def data(batches=4, batch=4):
    rng = np.random.default_rng(hvd.rank())
    return rng.normal(size=(batches * batch, 6)).astype("float32"), rng.integers(0, 3, batches * batch)


def compile_fit(model, optimizer, batches=4, callbacks=(), allow_undistributed=False):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    digests = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: digests.append(weights_digest(model)))
    model.fit(*data(batches), batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[hc.callbacks.BroadcastGlobalVariablesCallback(0, allow_undistributed=allow_undistributed),
                         *callbacks, record])
    return digests


def exclusions():
    model = dense_model()
    adamw = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    adamw.exclude_from_weight_decay(var_names=["bias"])
    opt = hc.DistributedOptimizer(adamw)
    model.build((None, 6))
    before = [v.numpy().copy() for v in model.trainable_variables]
    opt.apply_gradients([(tf.zeros_like(v), v) for v in model.trainable_variables])
    moved = {v.name.split(":")[0].split("/")[-1]: bool(np.any(v.numpy() != b))
             for v, b in zip(model.trainable_variables, before)}
    return {"same_object": opt is adamw, "moved": moved}


def trained():
    """An optimizer that trained alone on each rank, then wrapped: its step count and slots are kept,
    a model still holding the step it traced before the wrap is refused after one batch, and after
    model.compile the ranks train identically."""
    model = dense_model()
    sgd = keras.optimizers.SGD(0.01, momentum=0.9)
    model.compile(optimizer=sgd, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(*data(5), batch_size=4, verbose=0)  # alone on each rank
    slots = [v.numpy().copy() for v in sgd.variables]
    opt = hc.DistributedOptimizer(sgd)
    facts = {"same_object": opt is sgd, "iterations": int(opt.iterations.numpy()), "slots_kept": all(
        np.array_equal(a, v.numpy()) for a, v in zip(slots, opt.variables)), "count_kept": len(slots) == len(opt.variables)}
    try:
        model.fit(*data(), batch_size=4, verbose=0, callbacks=[hc.callbacks.BroadcastGlobalVariablesCallback(0)])
        facts["stale_step_refused"] = None
    except ValueError as e:
        facts["stale_step_refused"] = str(e)
    facts["digests"] = compile_fit(model, opt)
    return facts


def files():
    """Model files beyond the matrix of workers/model_files.py: hc.load_model's compression replaces the
    saved one; a PushSumOptimizer comes back from either loader; rank 0 alone loads and evaluates a
    file (no collective at load, so the other rank does not have to)."""
    import pathlib
    path = str(pathlib.Path(FLAGS.work_dir) / ("onebit.keras" if KERAS3 else "onebit.h5"))
    model = dense_model()
    compile_fit(model, hc.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                               compression=hc.Compression.onebit(), min_compress_size=8))
    gossip_path = path.replace("onebit", "pushsum")
    gossip = dense_model()
    compile_fit(gossip, hc.PushSumOptimizer(keras.optimizers.SGD(0.1)))
    if hvd.rank() == 0:
        model.save(path)
        gossip.save(gossip_path)
    everyone(0, "files_saved")
    facts = {}
    if hvd.rank() == 0:  # alone: compile=True builds the optimizer, and must not wait for the other ranks
        alone = keras.models.load_model(path)
        facts["alone_loss"] = float(alone.evaluate(*data(), verbose=0))
    everyone(0, "files_alone")
    overridden = hc.load_model(path, compression=hc.Compression.fp16)
    facts["overridden"] = repr(overridden.optimizer.compression_exchange.compression)
    facts["overridden_digests"] = compile_fit(overridden, overridden.optimizer)
    for name, load in (("keras", keras.models.load_model), ("hc", hc.load_model)):
        loaded = load(gossip_path)
        facts[f"pushsum_{name}"] = (type(loaded.optimizer).__name__, loaded.optimizer.pushsum.graph)
    return facts


class ScaledSGD(keras.optimizers.SGD):
    def __init__(self, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def update_step(self, gradient, variable, *learning_rate):
        super().update_step(gradient * tf.cast(self.scale, gradient.dtype), variable, *learning_rate)


def subclass():
    model = dense_model()
    model.build((None, 6))
    before = weights_digest(model)
    compile_fit(model, hc.DistributedOptimizer(ScaledSGD(scale=0.0, learning_rate=0.1),
                                               compression=hc.Compression.topk(ratio=0.5), min_compress_size=8))
    return {"moved": weights_digest(model) != before}


class HalvingSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Not registered for serialization: wrapping must not need to serialize it."""

    def __call__(self, step):
        return 0.1 / (1.0 + tf.cast(step, tf.float32))


def callables():
    results = {}
    for name, rate in (("callable", lambda: 0.05), ("schedule", HalvingSchedule())):
        model = dense_model()
        digests = compile_fit(model, hc.DistributedOptimizer(keras.optimizers.SGD(rate),
                                                             compression=hc.Compression.fp16))
        results[name] = digests[-1]
    return results


def tape():
    results = {}
    for name, compression in (("none", hc.Compression.none), ("fp16", hc.Compression.fp16)):
        model = dense_model()
        for v in model.variables:  # each rank its own initial weights: the broadcast must fix them
            v.assign(v + float(hvd.rank()))
        opt = keras.optimizers.SGD(0.1)
        hc.broadcast_variables(model.variables, 0)  # as the README's custom loop
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as t:
                loss = loss_fn(y, model(x, training=True))
            tape_ = hc.DistributedGradientTape(t, compression=compression)
            grads = tape_.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        x, y = data()
        for i in range(3):
            step(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4])
        results[name] = weights_digest(model)
    return results


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


def lazy():
    results = {}
    for name, new in (("sequential", lambda: dense_model(lazy=True)), ("subclassed", Subclassed)):
        keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast must fix them
        results[name] = compile_fit(new(), hc.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                                   compression=hc.Compression.topk(ratio=0.5),
                                                                   min_compress_size=8))
    return results


def uneven():
    model = dense_model()
    try:
        compile_fit(model, hc.DistributedOptimizer(keras.optimizers.SGD(0.1)), batches=5 if hvd.rank() == 0 else 4)
        return {"refused": None}
    except ValueError as e:
        return {"refused": str(e)}


def load_weights():
    import pathlib
    path = str(pathlib.Path(FLAGS.work_dir) / ("model.weights.h5" if KERAS3 else "weights.h5"))
    model = dense_model()
    compile_fit(model, hc.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)))
    if hvd.rank() == 0:
        model.save_weights(path)
    everyone(0, "saved")
    fresh = dense_model()
    fresh.compile(optimizer=hc.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    lines = LoggedLines.attach()
    fresh.load_weights(path)
    logging.getLogger("hvd_compress").removeHandler(lines)
    return {"lines": lines.lines, "same_weights": weights_digest(fresh) == weights_digest(model)}


def guard():
    model = dense_model()
    try:
        compile_fit(model, keras.optimizers.SGD(0.1))
        refused = None
    except ValueError as e:
        refused = str(e)
    try:
        compile_fit(dense_model(), keras.optimizers.SGD(0.1), allow_undistributed=True,
                    callbacks=[hc.callbacks.MetricAverageCallback(allow_undistributed=True)])
        opted_out = None
    except ValueError as e:
        opted_out = str(e)
    return {"refused": refused, "opted_out_refused": opted_out, "size": hvd.size()}


def mixed_without_callbacks():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = dense_model()
        model.compile(optimizer=hc.DistributedOptimizer(keras.optimizers.Adam(0.01), compression=hc.Compression.topk(
            ratio=0.5), min_compress_size=8), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(*data(), batch_size=4, verbose=0, shuffle=False)
        return {"digest": weights_digest(model), "loss_scaled": model.optimizer is not model.optimizer.inner_optimizer}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def main(_):
    hvd.init()
    results = {}
    for case in FLAGS.cases:
        results[case] = globals()[case]()
    report(hvd, **results)


if __name__ == "__main__":
    app.run(main)
