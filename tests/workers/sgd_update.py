"""SGD's update inside hc.DistributedOptimizer against the unwrapped Keras SGD, bit for bit.

The wrapper applies SGD's update (momentum, Nesterov, none) in TensorFlow's fused kernels
(keras_compat.fused_sgd_update). Per case, two copies of one model start alike on every rank:
- the first trains with hc.DistributedOptimizer(SGD(...)) (Compression.none: the mean of the
  ranks' gradients, as Horovod computes it);
- the second with the same SGD unwrapped, given hvd.grouped_allreduce's mean of the same gradients.
After every step both copies' weights and momenta must be bit-identical (on 2 ranks a mean is one
sum of two terms, the same in any fusion). Cases: a learning-rate schedule with Nesterov momentum,
plain momentum, none, weight decay; float16 variables and a subclass of SGD with its own
update_step keep Keras's (and the subclass's) update.
The report says, per case, which update ops the wrapper's step ran.
"""
import numpy as np
import tensorflow as tf
from absl import app

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import op_types, report

STEPS, BATCH = 6, 8


def cases(keras):
    """name -> (SGD class, its arguments, the model's dtype)."""
    sgd = keras.optimizers.SGD

    class DoubledSGD(sgd):
        """A user's SGD with its own update_step (in either Keras's signature): its override must run."""

        def update_step(self, gradient, *args):
            return super().update_step(gradient * 2.0, *args)

    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.1, 0.02])
    return {
        "nesterov, schedule": (sgd, dict(learning_rate=schedule, momentum=0.9, nesterov=True), "float32"),
        "momentum": (sgd, dict(learning_rate=0.05, momentum=0.9), "float32"),
        "no momentum": (sgd, dict(learning_rate=0.05), "float32"),
        "weight decay": (sgd, dict(learning_rate=0.05, momentum=0.9, weight_decay=0.01), "float32"),
        "float16 variables": (sgd, dict(learning_rate=0.05, momentum=0.9, nesterov=True), "float16"),
        "subclass with its own update_step": (DoubledSGD, dict(learning_rate=0.05, momentum=0.9), "float32"),
    }


def model_of(keras, dtype):
    inputs = keras.Input((7,))
    hidden = keras.layers.Dense(13, activation="tanh", dtype=dtype)(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, dtype=dtype)(hidden))


def slots(opt):
    """The momenta (tf_keras and Keras 3 name them alike), as NumPy arrays."""
    return [np.asarray(m) for m in getattr(opt, "momentums", [])]


def run_case(keras, sgd, config, dtype):
    keras.utils.set_random_seed(1)
    wrapped, plain = model_of(keras, dtype), model_of(keras, dtype)
    initial = wrapped.get_weights()
    plain.set_weights(initial)
    hc_sgd = hc.DistributedOptimizer(sgd(**config))
    keras_sgd = sgd(**config)
    rng = np.random.default_rng(10 + hvd.rank())  # each rank its own data
    x = rng.normal(size=(STEPS, BATCH, 7)).astype(np.float32)
    y = rng.normal(size=(STEPS, BATCH, 3)).astype(np.float32)

    def gradients(model, xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(xb), tf.float32) - yb))
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def step(xb, yb):
        hc_sgd.apply_gradients(zip(gradients(wrapped, xb, yb), wrapped.trainable_variables))
        averaged = hvd.grouped_allreduce(gradients(plain, xb, yb), op=hvd.Average)
        keras_sgd.apply_gradients(zip(averaged, plain.trainable_variables))

    identical = []
    for t in range(STEPS):
        step(tf.constant(x[t]), tf.constant(y[t]))
        same_weights = all(np.array_equal(a, b, equal_nan=True)
                           for a, b in zip(wrapped.get_weights(), plain.get_weights()))
        same_slots = all(np.array_equal(a, b) for a, b in zip(slots(hc_sgd), slots(keras_sgd)))
        identical.append(bool(same_weights and same_slots))
    ran = op_types(step, tf.TensorSpec((BATCH, 7)), tf.TensorSpec((BATCH, 3)))
    return {"identical": identical, "fused_ops": sorted(op for op in ran if op.startswith("ResourceApply")),
            "slots": len(slots(hc_sgd)), "iterations": int(np.asarray(hc_sgd.iterations)),
            "moved": float(max(np.abs(w - w0).max() for w, w0 in zip(wrapped.get_weights(), initial)))}


def main(_):
    hvd.init()
    keras = tf.keras
    report(hvd, results={name: run_case(keras, *case) for name, case in cases(keras).items()})


if __name__ == "__main__":
    app.run(main)
