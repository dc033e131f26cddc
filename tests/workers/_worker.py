"""What every test worker shares: flags, horovod start-up and the per-rank result file."""
import hashlib
import json
import logging
import os
import pathlib

import horovod.tensorflow as hvd_tf
import tensorflow as tf
from absl import flags

flags.DEFINE_string("out_dir", None, "Where each rank writes rank<N>.json.")
FLAGS = flags.FLAGS


def keras_and_broadcast():
    """The Keras `tf.keras` is (TF_USE_LEGACY_KERAS decides, as for users), and the callback that
    broadcasts rank 0's initial state which its users add: Horovod's own for tf_keras,
    hvd_compress's under Keras 3 (where Horovod's fails)."""
    if tf.keras.__name__.startswith("tf_keras"):
        import horovod.tensorflow.keras as hvd_keras
        return tf.keras, hvd_keras.callbacks.BroadcastGlobalVariablesCallback
    import hvd_compress as hc
    return tf.keras, hc.callbacks.BroadcastGlobalVariablesCallback


def report(hvd, **result):
    """Writes this rank's result for tests/hvdrun.run_ranks."""
    path = pathlib.Path(FLAGS.out_dir) / f"rank{hvd.rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


class LoggedLines(logging.Handler):
    """Collects what hvd_compress logs on this rank (attach with `LoggedLines.attach()`)."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    @classmethod
    def attach(cls):
        handler = cls()
        logging.getLogger("hvd_compress").addHandler(handler)
        return handler


def weights_digest(model):
    """A digest of the model's weights: equal on two ranks only if every weight is bit-identical."""
    return hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()


class IdenticalRanks(tf.keras.callbacks.Callback):
    """After every batch: every rank must hold bit-identical weights (counted in `checked`).
    Skipped for SGP, whose ranks agree only after gossip.consensus."""

    def __init__(self, method):
        super().__init__()
        self.method, self.checked = method, 0

    def on_train_batch_end(self, batch, logs=None):
        if self.method == "sgp":
            return
        everyone = hvd_tf.allgather_object(weights_digest(self.model), name="identical_ranks")
        assert len(set(everyone)) == 1, f"{self.method}: ranks differ after batch {batch}"
        self.checked += 1
