"""A small causal transformer (character-level) trained as transformers are trained today: AdamW with
decoupled weight decay, a linear warm-up into a cosine decay, global-norm clipping, mixed_float16.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_transformer.py --method onebit
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_transformer.py --method horovod_fp16

The task is examples/transformer.py's: Python's own documentation, read 64 characters at a time, each next
one predicted (2 blocks of causal multi-head attention and a GELU feed-forward, pre-layer-norm, dropout).
Test accuracy: next-character accuracy on the last 65,000 characters, which training never sees. --method picks the exchange from hvd_compress's
registry (hc.methods): under AdamW, `onebit` trains 1-bit Adam (Adam's momentum exchanged in 1 bit after
--compression_warmup full-precision steps; `--method onebit_oneway --block_size 256` kept AdamW's accuracy
closest); the others compress the gradient with error feedback, and Adam's variance stays as the warm-up left it;
or Horovod's
own DistributedOptimizer, `horovod_fp32` and `horovod_fp16`. Rank 0 prints the test accuracy and the bytes
each worker sent per step; --history writes them as JSON.
"""
import os

# tf_keras for tf.keras: the baselines are Horovod's own DistributedOptimizer, which needs it.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")  # docs/benchmarks.md, "The CPU allocator"

import json  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402
import hvd_compress as hc  # noqa: E402
from hvd_compress.exchange import allreduce_bytes  # noqa: E402
import transformer  # noqa: E402

METHODS = [name for name in hc.methods.NAMES if name != "sgp" and name not in hc.methods.LOCAL_STEP_METHODS]
flags.DEFINE_enum("method", "onebit", METHODS, "How gradients are exchanged: a method of hc.methods.")
flags.DEFINE_string("policy", "mixed_float16", "Keras mixed-precision policy.")
flags.DEFINE_integer("epochs", 3, "Training epochs.")
flags.DEFINE_integer("batch_size", 32, "Sequences per rank and step.")
flags.DEFINE_float("lr", 2e-3, "AdamW's peak learning rate.")
flags.DEFINE_float("lr_warmup", 0.1, "Fraction of the steps spent warming the learning rate up from 0.")
flags.DEFINE_float("weight_decay", 0.01, "AdamW's decoupled weight decay.")
flags.DEFINE_float("global_clipnorm", 1.0, "Clip each rank's gradient to this global norm.")
flags.DEFINE_float("compression_warmup", 0.15, "Fraction of the steps at full precision before compression "
                   "starts (hc.DistributedOptimizer's warmup_steps; Adam's variance is frozen after it; 1-bit Adam "
                   "refuses 0).")
flags.DEFINE_float("topk_ratio", 0.01, "topk, randomk: the fraction of coordinates sent.")
flags.DEFINE_integer("powersgd_rank", 4, "powersgd: the rank of each matrix's approximation.")
flags.DEFINE_integer("block_size", 0, "onebit, onebit_oneway: elements per scale (0: one scale per tensor, "
                     "hc.methods' default).")
flags.DEFINE_integer("evaluations_per_epoch", 1, "Test evaluations per epoch (each one logged).")
flags.DEFINE_integer("seed", 0, "Seed for the initial weights, dropout and shuffling.")
flags.DEFINE_string("history", None, "Where rank 0 writes accuracy, bytes and the evaluations (JSON).")
FLAGS = flags.FLAGS


def optimizer_for(keras, steps):
    """transformer.adamw, wrapped as --method trains."""
    adamw = transformer.adamw(keras, steps, lr=FLAGS.lr, lr_warmup=FLAGS.lr_warmup, weight_decay=FLAGS.weight_decay,
                              global_clipnorm=FLAGS.global_clipnorm)
    if FLAGS.method.startswith("horovod_"):
        return hc.methods.distributed_optimizer(FLAGS.method, adamw)
    overrides = ({"ratio": FLAGS.topk_ratio} if FLAGS.method in ("topk", "randomk") else
                 {"rank": FLAGS.powersgd_rank} if FLAGS.method == "powersgd" else
                 {"block_size": FLAGS.block_size} if FLAGS.method.startswith("onebit") and FLAGS.block_size else {})
    return hc.methods.distributed_optimizer(FLAGS.method, adamw, overrides=overrides,
                                            warmup_steps=int(FLAGS.compression_warmup * steps))


class Evaluate(tf.keras.callbacks.Callback):
    """Test accuracy every `every` steps (and at the end), into `accuracies` as (step, accuracy)."""

    def __init__(self, x, y, every):
        super().__init__()
        self.x, self.y, self.every, self.step, self.accuracies = x, y, every, 0, []

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step % self.every == 0:
            _, accuracy = self.model.evaluate(self.x, self.y, verbose=0, batch_size=256)
            self.accuracies.append((self.step, float(accuracy)))
            if hvd.rank() == 0:
                print(f"step {self.step}: test accuracy {accuracy:.4f}", flush=True)


class BytesSent(tf.keras.callbacks.Callback):
    """The bytes one worker sends over the run: every step's exchange's, full-precision steps included (a step that
    loss scaling skipped counts, though it sent nothing: none here)."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer, self.total = optimizer, 0.0

    def on_train_begin(self, logs=None):
        self.optimizer.build(self.model.trainable_variables)  # the exchange's plan, before its first step

    def on_train_batch_begin(self, batch, logs=None):
        self.total += float(self.optimizer.compression_exchange.bytes_sent)  # what the coming step sends


def main(_):
    keras = hc.require_legacy_keras()
    hvd.init()
    keras.mixed_precision.set_global_policy(FLAGS.policy)
    tf.keras.utils.set_random_seed(FLAGS.seed)
    (x, y), (x_test, y_test), vocab_size = transformer.load_text()
    order = np.random.default_rng(FLAGS.seed).permutation(len(x))
    steps_per_epoch = len(x) // (hvd.size() * FLAGS.batch_size)
    mine = order[hvd.rank()::hvd.size()][:steps_per_epoch * FLAGS.batch_size]
    model = transformer.transformer(keras, vocab_size)
    optimizer = optimizer_for(keras, FLAGS.epochs * steps_per_epoch)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    evaluate = Evaluate(x_test, y_test, max(1, steps_per_epoch // FLAGS.evaluations_per_epoch))
    horovod = FLAGS.method.startswith("horovod_")
    bytes_sent = None if horovod else BytesSent(optimizer)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), evaluate] + ([] if horovod else [bytes_sent])
    model.fit(x[mine], y[mine], batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, shuffle=True, verbose=0,
              callbacks=callbacks)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0, batch_size=256)
    if horovod:  # Horovod's ring allreduce of every gradient in 16 or 32 bits
        sent = allreduce_bytes((2 if FLAGS.method == "horovod_fp16" else 4) * model.count_params(), hvd.size())
    else:
        sent = optimizer.compression_exchange.bytes_sent  # after the warm-up: the compressed exchange's
    result = dict(method=FLAGS.method, policy=FLAGS.policy, ranks=hvd.size(), seed=FLAGS.seed,
                  test_accuracy=float(accuracy), bytes_per_step=float(sent), parameters=int(model.count_params()),
                  steps=FLAGS.epochs * steps_per_epoch, accuracies=evaluate.accuracies,
                  bytes_per_run=float(sent) * FLAGS.epochs * steps_per_epoch if horovod else bytes_sent.total)
    if hvd.rank() == 0:
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
                       if k != "accuracies"))
        if FLAGS.history:
            with open(FLAGS.history, "w") as f:
                json.dump(result, f)


if __name__ == "__main__":
    app.run(main)
