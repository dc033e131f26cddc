"""Elastic training as Horovod users write it, with hc.elastic.KerasState: the world goes from
--start_hosts (3 ranks on one host; or 2 hosts of 2 ranks, hierarchical) to --shrunk_hosts (2 ranks;
one host of 2) and back in the middle of model.fit.

Run under `horovodrun --min-np 2 --host-discovery-script discover_hosts.sh` (tests/hvdrun.run_elastic).
Rank 0 writes the new hosts into $HC_SLOTS_FILE at the end of epochs --shrink_at and --grow_at and
waits until Horovod's driver has notified it, so that the resize lands at that epoch's commit. After
every batch all ranks must hold identical weights; at every epoch end each rank records the world size,
its shards, the host layout and the loss; in every reset it records whether its per-rank state started
afresh and its replicated state was kept.
"""
import hashlib
import os
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_compress as hc
from _worker import LoggedLines, report, weights_digest

flags.DEFINE_integer("epochs", 8, "Epochs in all.")
flags.DEFINE_integer("shrink_at", 2, "After this epoch the world shrinks to --shrunk_hosts.")
flags.DEFINE_integer("grow_at", 5, "After this epoch the world grows back to --start_hosts.")
flags.DEFINE_list("start_hosts", ["localhost:3"], "The hosts (host discovery's lines) at the start and after "
                  "--grow_at.")
flags.DEFINE_list("shrunk_hosts", ["localhost:2"], "The hosts between --shrink_at and --grow_at.")
flags.DEFINE_bool("hierarchical_exchange", False, "hc.DistributedOptimizer(hierarchical=True) (horovodrun would "
                  "take --hierarchical for its own options).")
FLAGS = flags.FLAGS
STEPS, BATCH, MOST_RANKS = 4, 16, 4


def digest(variables):
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in variables)).hexdigest()


def set_hosts(state, hosts):
    """Rank 0: changes the host-discovery answer and waits (up to 60 s) until the driver's
    notification has reached this coordinator, so the next commit raises the resize. Horovod
    ignores a host update in the same wall-clock second as the last one, hence the first wait.
    (`_last_updated_timestamp` and `_host_messages` are Horovod internals; a test may use them.)"""
    while int(time.time()) <= getattr(state, "_last_updated_timestamp", 0) + 1:
        time.sleep(0.05)
    path = os.environ["HC_SLOTS_FILE"]
    with open(path + ".tmp", "w") as f:
        f.write("".join(f"{h}\n" for h in hosts))
    os.replace(path + ".tmp", path)
    deadline = time.time() + 60
    while state._host_messages.empty() and time.time() < deadline:
        time.sleep(0.05)


class Record(tf.keras.callbacks.Callback):
    """Identical weights after every batch; per epoch: size, shard lengths, loss; rank 0 resizes."""

    def __init__(self, state):
        super().__init__()
        self.state, self.epochs, self.resets, self.steps_checked = state, [], [], 0
        self.replicated_at_epoch_end = None

    def on_train_batch_end(self, batch, logs=None):
        everyone = hvd_tf.allgather_object(weights_digest(self.model), name="elastic.weights")
        assert len(set(everyone)) == 1, f"ranks differ after batch {batch} at size {hvd.size()}"
        self.steps_checked += 1

    def on_epoch_end(self, epoch, logs=None):
        exchange = self.model.optimizer.compression_exchange
        self.epochs.append(dict(epoch=self.state.epoch, size=hvd.size(), loss=float(logs["loss"]),
                                shards=[int(v.shape[0]) for v in exchange.server_residuals],
                                layout=exchange.hosts.layout if exchange.hosts else None))
        self.replicated_at_epoch_end = digest(self.model.optimizer.variables)
        hosts = {FLAGS.shrink_at: FLAGS.shrunk_hosts, FLAGS.grow_at: FLAGS.start_hosts}.get(self.state.epoch)
        if hvd.rank() == 0 and hosts is not None:
            set_hosts(self.state, hosts)

    def on_reset(self):
        """Runs after hc.elastic.KerasState's own reset callback (the re-plan), survivors only."""
        rank_state = self.model.optimizer.compression_exchange.rank_state
        fresh = all(np.array_equal(v.numpy(), rank_state.specs[k].initial_value().numpy())
                    for k, v in rank_state.variables.items())
        self.resets.append(dict(size=hvd.size(), rank_state_fresh=fresh, owner=rank_state.owner.numpy().tolist(),
                                replicated_kept=digest(self.model.optimizer.variables)
                                == self.replicated_at_epoch_end))


def main(_):
    keras = tf.keras  # tf_keras or Keras 3: TF_USE_LEGACY_KERAS decides
    hvd.init()
    lines = LoggedLines.attach()
    tf.keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((29,)), keras.layers.Dense(37, activation="relu"),
                              keras.layers.Dense(23, activation="relu"), keras.layers.Dense(5)])
    model.compile(optimizer=hc.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                    compression=hc.Compression.onebit(), min_compress_size=64,
                                                    hierarchical=FLAGS.hierarchical_exchange),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = hc.elastic.KerasState(model, batch=0, epoch=0)
    record = Record(state)
    state.register_reset_callbacks([record.on_reset])
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((MOST_RANKS * STEPS * BATCH, 29)).astype(np.float32)
    y = (x[:, :5] @ rng.standard_normal((5, 5))).argmax(1)

    @hvd.elastic.run
    def train(state):
        shard = slice(hvd.rank() * STEPS * BATCH, (hvd.rank() + 1) * STEPS * BATCH)
        # Horovod's epoch callback counts from state.epoch: fit only the epochs left, from 0.
        model.fit(x[shard], y[shard], batch_size=BATCH, epochs=FLAGS.epochs - state.epoch, shuffle=False, verbose=0,
                  callbacks=[hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                             record, hvd.elastic.CommitStateCallback(state)])

    train(state)
    report(hvd, epochs=record.epochs, resets=record.resets, steps_checked=record.steps_checked,
           logged=lines.lines, weights=weights_digest(model), pid=os.getpid())


if __name__ == "__main__":
    app.run(main)
