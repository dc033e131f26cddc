"""A character-level language model with an Embedding, trained under mixed precision.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_text.py --method onebit
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_text.py --method horovod_fp16
    horovodrun -np 3 -H localhost:3 --mpi python examples/keras_text.py --method sgp --transport mpi --overlap

The text is Python's own documentation, which ships with every Python (`pydoc_data.topics`):
no download. The model predicts the next character from the previous CONTEXT characters:
Embedding -> Dense -> Dense. Under the `mixed_float16` policy (default) `compile()` wraps
the optimizer in a LossScaleOptimizer. --method picks the exchange by its name in
hvd_compress's registry, hc.methods (its defaults; the flags below change some): `onebit`
(two-way dist-EF-SGD), `onebit_oneway`, `quantize8`, `quantize4`, `topk`, `randomk`,
`powersgd`, `sketch` (sketched SGD), `fetchsgd`, `none`, `fp16`, Horovod's own
DistributedOptimizer, `horovod_fp16` (with Compression.fp16, the usual baseline) or
`horovod_fp32`, or `sgp`: hc.PushSumOptimizer's gossip instead of an average (--transport
mpi sends point to point and needs an MPI launch; --overlap mixes each message in one step
later), whose ranks are averaged once at the end of fit (hc.callbacks.Consensus). Rank 0
prints the test accuracy and the bytes each worker sent per step; --result writes them as JSON.
"""
import os

# tf_keras for tf.keras: the baseline is Horovod's own DistributedOptimizer, which needs it.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")  # docs/benchmarks.md, "The CPU allocator"

import json  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402
import hvd_compress as hc  # noqa: E402
from hvd_compress.exchange import allreduce_bytes  # noqa: E402
from pydoc_text import character_codes, next_character  # noqa: E402

#: (local steps, hc.methods.LOCAL_STEP_METHODS, train under AdamW: examples/keras_digits.py and
#: benchmarks/time_to_accuracy.py run them)
METHODS = [name for name in hc.methods.NAMES if name not in hc.methods.LOCAL_STEP_METHODS]
flags.DEFINE_enum("method", "onebit", METHODS, "How gradients are exchanged: a method of hc.methods.")
flags.DEFINE_string("policy", "mixed_float16", "Keras mixed-precision policy.")
flags.DEFINE_integer("epochs", 2, "Training epochs.")
flags.DEFINE_integer("batch_size", 64, "Batch size per rank.")
flags.DEFINE_float("lr", 0.05, "Learning rate per rank (scaled by the number of ranks).")
flags.DEFINE_integer("train_chars", 400_000, "Characters of text to train on.")
flags.DEFINE_integer("block_size", 256, "onebit, onebit_oneway: elements per scale (0: one scale per tensor, "
                     "hc.methods' default).")
flags.DEFINE_float("topk_ratio", 0.01, "topk, randomk: the fraction of coordinates sent (1 / (2 R) sends as many "
                   "bytes as the sketches at ratio R on 2 ranks).")
flags.DEFINE_float("sketch_ratio", 4.0, "sketch, fetchsgd: compression of bytes per step.")
flags.DEFINE_bool("apply_candidates", None, "sketch: apply every candidate's exact sum (False: the exact top-k).")
flags.DEFINE_bool("mask_momentum", None, "sketch: zero the momentum where the update was applied.")
flags.DEFINE_bool("stochastic", None, "quantize8, quantize4: stochastic rounding (False: to the nearest level).")
flags.DEFINE_bool("error_feedback", None, "quantize8, quantize4: keep worker and server residuals.")
flags.DEFINE_enum("transport", None, ["alltoall", "mpi"], "sgp: how the gossip travels (mpi: point to point, under "
                  "an MPI launch; default alltoall).")
flags.DEFINE_bool("overlap", None, "sgp: mix each step's messages in one step later (default False).")
flags.DEFINE_integer("seed", 0, "Seed for the initial weights and shuffling.")
flags.DEFINE_string("result", None, "Where rank 0 writes accuracy and bytes (JSON).")
FLAGS = flags.FLAGS
CONTEXT, STRIDE, TEST_CHARS = 24, 3, 20_000


def load_text():
    """(train windows, train targets), (test windows, test targets), vocabulary size."""
    codes, vocab_size = character_codes(FLAGS.train_chars + TEST_CHARS)
    return (next_character(codes[:FLAGS.train_chars], CONTEXT, STRIDE),
            next_character(codes[FLAGS.train_chars:], CONTEXT, STRIDE), vocab_size)


def model_for(keras, vocab_size):
    return keras.Sequential([
        keras.layers.Input((CONTEXT,), dtype="int32"),
        keras.layers.Embedding(vocab_size, 32),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(vocab_size),
        keras.layers.Activation("linear", dtype="float32"),  # logits in float32 under mixed precision
    ])


#: flag -> (the argument of the compression it sets, the methods it applies to)
FLAG_ARGUMENTS = {
    "block_size": ("block_size", ("onebit", "onebit_oneway")),
    "topk_ratio": ("ratio", ("topk", "randomk")),
    "sketch_ratio": ("ratio", ("sketch", "fetchsgd")),
    "apply_candidates": ("apply_candidates", ("sketch",)),
    "mask_momentum": ("mask_momentum", ("sketch",)),
    "seed": ("seed", ("sketch", "fetchsgd")),
    "stochastic": ("stochastic", ("quantize8", "quantize4")),
    "error_feedback": ("error_feedback", ("quantize8", "quantize4")),
    "transport": ("transport", ("sgp",)),
    "overlap": ("overlap", ("sgp",)),
}


def overrides():
    """What the flags change in --method's arguments (--block_size=0: hc.methods' default)."""
    values = dict(FLAGS.flag_values_dict(), block_size=FLAGS.block_size or None)
    return {argument: values[flag] for flag, (argument, methods) in FLAG_ARGUMENTS.items()
            if FLAGS.method in methods and values[flag] is not None}


def optimizer_for(keras):
    sgd = keras.optimizers.SGD(FLAGS.lr * hvd.size(), momentum=0.9, nesterov=True)
    return hc.methods.distributed_optimizer(FLAGS.method, sgd, overrides=overrides())


def main(_):
    keras = hc.require_legacy_keras()
    hvd.init()
    keras.mixed_precision.set_global_policy(FLAGS.policy)
    tf.keras.utils.set_random_seed(FLAGS.seed)
    (x, y), (x_test, y_test), vocab_size = load_text()
    order = np.random.default_rng(FLAGS.seed).permutation(len(x))
    steps = len(x) // (hvd.size() * FLAGS.batch_size)
    mine = order[hvd.rank()::hvd.size()][:steps * FLAGS.batch_size]
    model = model_for(keras, vocab_size)
    optimizer = optimizer_for(keras)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    ours = not FLAGS.method.startswith("horovod_")
    # where the ranks train apart (sgp), their average once fit ends: the model to test
    callbacks += [hc.callbacks.Consensus()] if ours and optimizer.ranks_diverge else []
    model.fit(x[mine], y[mine], batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, shuffle=True,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0, batch_size=1024)
    if FLAGS.method.startswith("horovod_"):  # Horovod's ring allreduce of every gradient in 16 or 32 bits
        sent = allreduce_bytes((2 if FLAGS.method == "horovod_fp16" else 4) * model.count_params(), hvd.size())
    else:
        sent = optimizer.bytes_per_step
    result = dict(method=FLAGS.method, arguments=overrides(), policy=FLAGS.policy, ranks=hvd.size(),
                  test_accuracy=float(accuracy), bytes_per_step=float(sent), steps=steps * FLAGS.epochs,
                  loss_scale_optimizer=type(model.optimizer).__name__, parameters=int(model.count_params()))
    if hvd.rank() == 0:
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
        if FLAGS.result:
            with open(FLAGS.result, "w") as f:
                json.dump(result, f)


if __name__ == "__main__":
    app.run(main)
