"""SGP in model.fit as users run it: PushSumOptimizer over MPI point to point with overlap (wrapping SGD with
momentum in case "final", AdamW in "every_epoch"), validation data, and
hc.callbacks.Consensus before a rank-0 ModelCheckpoint (every epoch) and an EarlyStopping that stops the
run after 2 of its 4 epochs (on every rank alike: no rank's val_loss gains 1.0). Per case in --cases ("final":
Consensus() at fit's end only; "every_epoch": Consensus(every_epoch=True)) each rank reports, per epoch, the
digest of its weights when validation begins and when the epoch ends, the validation loss, and the digest after
fit; and whether the file rank 0 saved holds the weights every rank ended with."""
import pathlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import keras_and_broadcast, report, weights_digest

import digits

flags.DEFINE_list("cases", ["final", "every_epoch"], "Cases: final, every_epoch.")
flags.DEFINE_integer("epochs", 4, "Epochs per case (EarlyStopping, asking a gain of 1.0 in val_loss, stops after 2).")
FLAGS = flags.FLAGS


class Probe(tf.keras.callbacks.Callback):
    """After Consensus in the list: what the callbacks after it see."""

    def __init__(self):
        super().__init__()
        self.at_validation, self.at_epoch_end, self.val_loss = [], [], []

    def on_test_begin(self, logs=None):
        self.at_validation.append(weights_digest(self.model))

    def on_epoch_end(self, epoch, logs=None):
        self.at_epoch_end.append(weights_digest(self.model))
        self.val_loss.append(float(logs["val_loss"]))


def run(keras, broadcast, case, data, directory):
    (x_train, y_train), (x_test, y_test) = data
    tf.keras.utils.set_random_seed(hvd.rank())  # the ranks start apart; the broadcast makes them alike
    train_set, steps = digits.shard(x_train, y_train, hvd.rank(), hvd.size(), 32, 0)
    model = digits.cnn(keras, 0)
    inner = (keras.optimizers.SGD(0.05, momentum=0.9) if case == "final" else
             keras.optimizers.AdamW(1e-3, weight_decay=0.01))
    model.compile(optimizer=hc.PushSumOptimizer(inner, overlap=True, transport="mpi"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    probe, path = Probe(), str(directory / f"{case}.weights.h5")
    checkpoints = [keras.callbacks.ModelCheckpoint(path, save_weights_only=True)] if hvd.rank() == 0 else []
    model.fit(train_set, epochs=FLAGS.epochs, steps_per_epoch=steps, validation_data=(x_test, y_test), verbose=0,
              callbacks=[broadcast(0), hc.callbacks.Consensus(every_epoch=case == "every_epoch"), probe,
                         *checkpoints, keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=1.0)])
    final = [w.copy() for w in model.get_weights()]
    hvd.allreduce(tf.constant(0.0), name=f"saved.{case}")  # rank 0's file is written
    saved = None
    if case == "every_epoch":  # the last epoch's consensus model
        model.load_weights(path)
        saved = all(np.array_equal(a, b) for a, b in zip(final, model.get_weights()))
    return dict(at_validation=probe.at_validation, at_epoch_end=probe.at_epoch_end, val_loss=probe.val_loss,
                after_fit=weights_digest(model), saved_is_final=saved)


def main(_):
    keras, broadcast = keras_and_broadcast()
    hvd.init()
    data = digits.load(0)
    directory = pathlib.Path(FLAGS.out_dir)
    report(hvd, results={case: run(keras, broadcast, case, data, directory) for case in FLAGS.cases})


if __name__ == "__main__":
    app.run(main)
