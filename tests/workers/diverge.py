"""IdenticalRanks must catch ranks that drift apart: 2 epochs of model.fit with onebit, and rank 1
nudges one weight after batch 2 of epoch 1 (as a wrong restore or a skipped step would). Every
rank reports the message its IdenticalRanks failed with (none: it did not catch the drift)."""
import numpy as np
import tensorflow as tf
from absl import app

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import IdenticalRanks, keras_and_broadcast, report


class NudgeOnRank1(tf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == 1 and (self.epoch, batch) == (1, 2):
            kernel = self.model.trainable_variables[0]
            kernel.assign_add(tf.fill(kernel.shape, 1e-3))


def main(_):
    keras, broadcast = keras_and_broadcast()
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((29,)), keras.layers.Dense(37), keras.layers.Dense(5)])
    model.compile(optimizer=hc.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=hc.Compression.onebit(),
                                                    min_compress_size=64),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.standard_normal((64, 29)).astype(np.float32), rng.integers(0, 5, 64)
    identical = IdenticalRanks("onebit")
    # The nudge comes first, so IdenticalRanks records the nudged weights after that batch.
    try:
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[broadcast(0), NudgeOnRank1(), identical])
        caught = None
    except AssertionError as e:
        caught = str(e)
    report(hvd, caught=caught, checked=identical.checked)


if __name__ == "__main__":
    app.run(main)
