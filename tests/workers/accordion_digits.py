"""Runs examples/keras_accordion.py (its flags) once per --modes x --seeds, in one process, and
reports rank 0's history of each run under "<mode>/<seed>"."""
import json
import pathlib

import tensorflow as tf
from absl import app, flags

import horovod.tensorflow.keras as hvd
import keras_accordion
from _worker import report

flags.DEFINE_list("modes", None, "Modes to run (each as --mode).")
flags.DEFINE_list("seeds", None, "Seeds to run (each as --seed).")
FLAGS = flags.FLAGS


def main(argv):
    runs = {}
    for mode in FLAGS.modes or [FLAGS.mode]:
        for seed in FLAGS.seeds or [FLAGS.seed]:
            FLAGS.mode, FLAGS.seed = mode, int(seed)
            tf.keras.backend.clear_session()  # layer names as in a fresh process: dense, not dense_1
            FLAGS.history = str(pathlib.Path(FLAGS.out_dir) / f"history-{mode}-{seed}.json")
            keras_accordion.main(argv)
            if hvd.rank() == 0:
                runs[f"{mode}/{seed}"] = json.loads(pathlib.Path(FLAGS.history).read_text())
    report(hvd, **runs)


if __name__ == "__main__":
    app.run(main)
