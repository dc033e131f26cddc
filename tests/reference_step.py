"""The suite's yardstick of machine speed (conftest.py scales the time budget by it): what most of the suite's time
is, one process importing TensorFlow and fitting a small Keras model on one thread. Prints its seconds."""
import time

started = time.perf_counter()

import numpy as np  # noqa: E402 (the imports are part of what is timed)
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
x = np.random.default_rng(0).standard_normal((1024, 64)).astype("float32")
y = x[:, :10].argmax(1)
model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(128, activation="relu"),
                             tf.keras.layers.Dense(10)])
model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=3, verbose=0)
print(f"{time.perf_counter() - started:.3f}")
