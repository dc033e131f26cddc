"""The bundled task of the examples and tests: scikit-learn's 8x8 handwritten digits.

1797 images ship with scikit-learn, so nothing is downloaded. A fixed
stratified 80/20 split; each rank trains on its own equal-size shard.
"""
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def load(seed=0):
    """(x_train, y_train), (x_test, y_test): float32 images [N, 8, 8, 1] in [0, 1], int labels."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y)
    return (x_train, y_train), (x_test, y_test)


def shard(x, y, rank, size, batch_size, seed=0):
    """This rank's slice as a repeating dataset of full batches, and its steps per epoch.

    Every rank gets the same number of steps, so collectives always pair up.
    """
    steps = len(x) // (size * batch_size)
    x, y = x[rank::size][:steps * batch_size], y[rank::size][:steps * batch_size]
    ds = (tf.data.Dataset.from_tensor_slices((x, y))
          .shuffle(len(x), seed=seed + rank, reshuffle_each_iteration=True)
          .batch(batch_size, drop_remainder=True).repeat())
    return ds, steps


def cnn(keras, seed=0):
    """A small CNN (about 20k parameters) for 8x8 digits."""
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([
        keras.layers.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", kernel_initializer=init),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu", kernel_initializer=init),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu", kernel_initializer=init),
        keras.layers.Dense(10, kernel_initializer=init),
    ])


class TestAccuracy(tf.keras.callbacks.Callback):
    """Adds test_accuracy to every epoch's logs (for accuracy-versus-bytes curves)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def on_epoch_end(self, epoch, logs=None):
        logs["test_accuracy"] = float(self.model.evaluate(self.x, self.y, verbose=0)[1])


def epoch_logs(history, steps_per_epoch, bytes_per_step=None):
    """One dict of floats per epoch from a Keras History, with cumulative_bytes (per worker):
    from the logs when a callback counted them (Accordion), else steps x bytes_per_step."""
    epochs, total = [], 0.0
    for epoch in range(len(history.epoch)):
        logs = {key: float(values[epoch]) for key, values in history.history.items()}
        if "cumulative_bytes" not in logs:
            total += steps_per_epoch * (logs["bytes_per_step"] if bytes_per_step is None else bytes_per_step)
            logs["cumulative_bytes"] = total
        epochs.append(logs)
    return epochs
