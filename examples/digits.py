"""The bundled task of the examples and tests: the 8x8 handwritten digits of the UCI repository.

The 1797 images (Alpaydin and Kaynak, "Optical Recognition of Handwritten Digits", UCI Machine Learning
Repository, 1998; CC BY 4.0, as scikit-learn also bundles them) ship beside this file as digits.npz,
so nothing is downloaded and nothing heavier than NumPy is imported. A fixed stratified 80/20 split;
each rank trains on its own equal-size shard.
"""
import pathlib

import numpy as np
import tensorflow as tf

DATA = pathlib.Path(__file__).with_name("digits.npz")
TEST_FRACTION = 0.2


def load(seed=0):
    """(x_train, y_train), (x_test, y_test): float32 images [N, 8, 8, 1] in [0, 1], int labels."""
    with np.load(DATA) as data:
        x = (data["images"] / 16.0).astype(np.float32)[..., None]
        y = data["labels"].astype(np.int64)
    train, test = stratified_split(y, TEST_FRACTION, seed)
    return (x[train], y[train]), (x[test], y[test])


def stratified_split(labels, test_fraction, seed):
    """Indices (train, test) of a shuffled split that keeps each class's share in both parts.

    The rule of scikit-learn's train_test_split(stratify=labels, random_state=seed), which made every
    figure measured on this task, so its splits are the same: ceil(test_fraction n) test samples; each
    class gets the floor of its proportional share of the training samples, then of the test samples
    among what it has left, and the shares still missing go one each to the classes with the largest
    fractional parts (ties drawn at random); each class's samples are permuted and dealt out, then
    both parts are permuted. All draws come from one numpy RandomState(seed) in that order."""
    rng = np.random.RandomState(seed)
    n_test = int(np.ceil(test_fraction * len(labels)))
    classes, inverse = np.unique(labels, return_inverse=True)
    counts = np.bincount(inverse)
    members = np.split(np.argsort(inverse, kind="mergesort"), np.cumsum(counts)[:-1])
    n_train = proportional_shares(counts, len(labels) - n_test, rng)
    n_test_of = proportional_shares(counts - n_train, n_test, rng)
    train, test = [], []
    for of_class, k_train, k_test in zip(members, n_train, n_test_of):
        dealt = of_class[rng.permutation(len(of_class))]
        train.extend(dealt[:k_train])
        test.extend(dealt[k_train:k_train + k_test])
    return rng.permutation(train), rng.permutation(test)


def proportional_shares(counts, draws, rng):
    """`draws` shared out over classes of `counts` samples in proportion, as whole numbers: floors, then one
    more for the largest remainders (classes tied at a remainder drawn at random without replacement)."""
    exact = counts / counts.sum() * draws
    shares = np.floor(exact)
    missing = int(draws - shares.sum())
    remainders = exact - shares
    for value in np.sort(np.unique(remainders))[::-1]:
        if missing <= 0:
            break
        tied = np.flatnonzero(remainders == value)
        chosen = rng.choice(tied, size=min(len(tied), missing), replace=False)
        shares[chosen] += 1
        missing -= len(chosen)
    return shares.astype(int)


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
