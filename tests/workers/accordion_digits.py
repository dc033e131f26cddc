"""Runs examples/keras_accordion.py (its flags) and reports rank 0's history."""
import json
import pathlib

from absl import app, flags

import horovod.tensorflow.keras as hvd
import keras_accordion
from _worker import report

FLAGS = flags.FLAGS


def main(argv):
    FLAGS.history = str(pathlib.Path(FLAGS.out_dir) / "history.json")
    keras_accordion.main(argv)
    report(hvd, **(json.loads(pathlib.Path(FLAGS.history).read_text()) if hvd.rank() == 0 else {}))


if __name__ == "__main__":
    app.run(main)
