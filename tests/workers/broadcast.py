"""Horovod's broadcasts with every method, as users write them, at any number of ranks.

For each method: model.fit with the broadcast callback users of this Keras add (Horovod's
BroadcastGlobalVariablesCallback(0) in tf_keras, which broadcasts model.variables and
optimizer.variables() after the first batch; hvd_compress's in Keras 3, or with --hc_callback,
which broadcasts them before the first step) and the same run without it;
after every batch all ranks must hold identical weights (SGP: its own check below), and the
per-rank state after step 2 must equal the run without the callback. Then
hvd.broadcast_variables(model.variables, 0) and hvd.broadcast_variables(opt.variables(), 0)
by hand (hc.broadcast_variables in Keras 3 and with --hc_callback) must leave the per-rank state as it
was, and training goes on.
FetchSGD has no per-rank state: its sketch-space state, which the broadcasts do carry, is watched
instead, and must be the same on every rank.
"""
import hashlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import IdenticalRanks, compression, distributed_optimizer, keras_and_broadcast, report

flags.DEFINE_list("methods", "onebit,onebit_oneway,onebit_adamw,topk,randomk,powersgd,sketch,fetchsgd,sgp",
                  "Methods to run.")
flags.DEFINE_bool("hc_callback", False, "Use hc.callbacks.BroadcastGlobalVariablesCallback in tf_keras too "
                  "(Keras 3 always does).")
FLAGS = flags.FLAGS
STEPS, BATCH = 4, 16


def make_optimizer(keras, method):
    sgd = keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)
    if method == "sgp":  # overlap: the mass in flight is per-rank state too
        return hc.PushSumOptimizer(sgd, graph="exponential2", overlap=True)
    # Odd sizes: 29*37 + 37*23 + 23*5 = 2039 compressed elements, shards unequal at 3, 5, 7 ranks.
    # AdamW's methods compress from step 2, so that their per-rank state (residuals) is in play by the digest after
    # it and in the broadcasts after the fit.
    return distributed_optimizer(sgd, method, min_compress_size=64, warmup_steps=1)


def kept_state(opt):
    """The per-rank state (FetchSGD, which has none: its replicated sketch-space state)."""
    if hasattr(opt, "pushsum"):
        return list(opt.pushsum.rank_state.variables.values())
    exchange = opt.compression_exchange
    return list((exchange.rank_state.variables or exchange.replicated).values())


def compared_state(opt):
    """The state compared with the run without the callback. SGP: its weight w_i only; the mass in
    flight holds w z of the model the callback has just broadcast, so it differs."""
    return [opt.pushsum.weight] if hasattr(opt, "pushsum") else kept_state(opt)


def digest(arrays):
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in arrays)).hexdigest()


class Watch(IdenticalRanks):
    """Identical weights on every rank after every batch (not SGP, IdenticalRanks); after batch
    1: the per-rank state's digest."""

    def __init__(self, method):
        super().__init__(method)
        self.state_after_step_2 = None

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if batch == 1:
            self.state_after_step_2 = digest(v.numpy() for v in compared_state(self.model.optimizer))


def train(method, broadcast_callback):
    keras, broadcast = keras_and_broadcast()
    if FLAGS.hc_callback:
        broadcast = hc.callbacks.BroadcastGlobalVariablesCallback
    tf.keras.utils.set_random_seed(0)  # the same initial weights on every rank
    model = keras.Sequential([keras.layers.Input((29,)), keras.layers.Dense(37, activation="relu"),
                              keras.layers.Dense(23, activation="relu"), keras.layers.Dense(5)])
    opt = make_optimizer(keras, method)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())  # each rank its own data, so per-rank state differs
    x = rng.standard_normal((STEPS * BATCH, 29)).astype(np.float32)
    y = rng.integers(0, 5, STEPS * BATCH)
    watch = Watch(method)
    callbacks = [broadcast(0)] if broadcast_callback else []
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks + [watch])
    return model, opt, x, y, watch


def main(_):
    hvd.init()
    results = {}
    for method in FLAGS.methods:
        _, _, _, _, without = train(method, broadcast_callback=False)
        model, opt, x, y, watch = train(method, broadcast_callback=True)
        state = kept_state(opt)
        before = digest(v.numpy() for v in state)
        by_hand = (hvd.broadcast_variables if tf.keras.__name__.startswith("tf_keras") and not FLAGS.hc_callback
                   else hc.broadcast_variables)  # Horovod's takes tf_keras's variables, not Keras 3's
        by_hand(model.variables, root_rank=0)
        by_hand(opt.variables() if callable(opt.variables) else opt.variables, root_rank=0)
        after = digest(v.numpy() for v in state)
        everyone = hvd.allgather_object(before, name="states")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Watch(method)])
        weights = [w for w in model.get_weights()]
        if method == "sgp":  # PushSum keeps sum_i (w_i + weight in flight to i) = n
            mass = hvd.allreduce(opt.pushsum.weight + opt.pushsum.in_flight[-1], op=hvd.Sum, name="mass")
            results["sgp_mass"] = float(mass.numpy())
        results[method] = dict(
            state_with_callback=watch.state_after_step_2, state_without=without.state_after_step_2,
            explicit_broadcast_kept_state=before == after, states_differ_by_rank=len(set(everyone)) > 1,
            steps_checked=watch.checked, finite=bool(all(np.isfinite(w).all() for w in weights)),
            shapes=sorted({tuple(v.shape) for v in state}))
    report(hvd, results=results)


if __name__ == "__main__":
    app.run(main)
