"""Resuming model.fit from rank 0's model file, as a user does: every case trains the digits CNN with model.fit for
4 epochs on a repeating dataset, rank 0 writing a `.keras` file at each epoch's end with ModelCheckpoint (phase
`full`); a new job (phase `resume`) loads rank 0's epoch-3 file on every rank (keras.models.load_model or
hc.load_model) and fits epoch 4 with initial_epoch=3. Each rank reports the losses of each epoch; IdenticalRanks
checks the ranks after every batch.

The cases: 1-bit Adam, Adam with a frozen variance under top-k and under 8-bit quantization (AdamW(1e-3,
weight_decay=0.01), warmup_steps=20), and dist-EF-SGD (onebit under SGD(0.05, momentum 0.9)).
"""
import pathlib

import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import IdenticalRanks, keras_and_broadcast, report

import digits

#: case -> (compression, optimizer, loader of the resume)
CASES = {
    "onebit_adamw": (lambda: hc.Compression.onebit(), "adamw", "keras"),
    "topk_adamw": (lambda: hc.Compression.topk(ratio=0.01), "adamw", "hc"),
    "quantize_adamw": (lambda: hc.Compression.quantize(bits=8), "adamw", "keras"),
    "onebit_sgd": (lambda: hc.Compression.onebit(), "sgd", "hc"),
}
EPOCHS, WARMUP_STEPS = 4, 20
flags.DEFINE_enum("phase", "full", ["full", "resume"], "Which job.")
flags.DEFINE_string("work_dir", None, "Shared between the phases.")
flags.DEFINE_list("cases", list(CASES), "Cases.")
FLAGS = flags.FLAGS


def new_model(keras, case):
    compression, optimizer, _ = CASES[case]
    keras.utils.set_random_seed(0)
    model = digits.cnn(keras, 0)
    if optimizer == "adamw":
        opt = hc.DistributedOptimizer(keras.optimizers.AdamW(1e-3, weight_decay=0.01), compression=compression(),
                                      warmup_steps=WARMUP_STEPS)
    else:
        opt = hc.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=compression())
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main(_):
    keras, broadcast = keras_and_broadcast()
    hvd.init()
    (x, y), _ = digits.load(0)
    dataset, steps = digits.shard(x, y, hvd.rank(), hvd.size(), 32, seed=0)
    results = {}
    for case in FLAGS.cases:
        work = pathlib.Path(FLAGS.work_dir) / case
        work.mkdir(parents=True, exist_ok=True)
        same = IdenticalRanks(case)
        if FLAGS.phase == "full":
            model = new_model(keras, case)
            callbacks = [broadcast(0), same]
            if hvd.rank() == 0:
                callbacks.append(keras.callbacks.ModelCheckpoint(str(work / "epoch{epoch}.keras")))
            history = model.fit(dataset, steps_per_epoch=steps, epochs=EPOCHS, callbacks=callbacks, verbose=0)
        else:
            path = str(work / f"epoch{EPOCHS - 1}.keras")
            model = keras.models.load_model(path) if CASES[case][2] == "keras" else hc.load_model(path)
            history = model.fit(dataset, steps_per_epoch=steps, epochs=EPOCHS, initial_epoch=EPOCHS - 1,
                                callbacks=[broadcast(0), same], verbose=0)
        results[case] = dict(loss=[float(v) for v in history.history["loss"]], checked=same.checked,
                             optimizer=type(model.optimizer).__name__)
    report(hvd, results=results)


if __name__ == "__main__":
    app.run(main)
