"""Per-rank checkpoints. Phase `full` trains 2S steps, each rank saving its own file at step S;
phase `resume` (a new process) restores step S and trains to 2S; both run every case of --cases
(format/compression) in turn, in one process. Each rank reports the model,
the replicated state (optimizer.variables()) and the per-rank state when saved, when restored
and at the end: a checkpoint (tf.train.Checkpoint, save_weights) resumes all of it bit for bit;
a model file (h5, SavedModel; Keras 3: .keras) holds the model and replicated state only. In the
Keras `tf.keras` is (TF_USE_LEGACY_KERAS decides)."""
import hashlib
import pathlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import compression, distributed_optimizer, is_gossip, report

import digits

flags.DEFINE_enum("phase", "full", ["full", "resume"], "Which half.")
flags.DEFINE_list("cases", ["checkpoint/onebit"], "format/compression pairs. Formats: checkpoint, weights, "
                  "savedmodel, h5 (tf_keras), keras (Keras 3); compressions: onebit, topk, randomk, sketch, "
                  "powersgd, onebit_adamw (1-bit AdamW), topk_adamw (top-k under AdamW), sgp (PushSumOptimizer) or sgp_mpi (over MPI: an MPI "
                  "launch).")
flags.DEFINE_string("work_dir", None, "Shared between the phases.")
flags.DEFINE_string("export_dir", None, "Full phase: rank 0 exports the first case's model here (model.save).")
FLAGS = flags.FLAGS
#: Saved at step STEPS, after _worker.ADAMW_WARMUP's full-precision steps: the AdamW cases save compressed state too.
STEPS, BATCH = 6, 32


def batch(step, x, y):
    """The same batch for a (step, rank) in both phases; no iterator state to restore."""
    order = np.random.default_rng(step).permutation(len(x))
    rows = order[hvd.rank() * BATCH:(hvd.rank() + 1) * BATCH]
    return x[rows], y[rows]


def new_model_and_optimizer(keras, method):
    model = digits.cnn(keras, seed=0)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=5, decay_rate=0.7)
    sgd = keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True)
    chosen = None if is_gossip(method) else compression(method)
    if is_gossip(method):
        opt = pushsum(sgd, method)
    else:  # (onebit_adamw, topk_adamw: AdamW, compressed from step _worker.ADAMW_WARMUP on)
        opt = distributed_optimizer(sgd, method, chosen=chosen)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, opt, chosen


def pushsum(sgd, method):
    """SGP's optimizer for `method` (sgp, sgp_mpi): with overlap, so the mass in flight must be restored too."""
    return hc.PushSumOptimizer(sgd, graph="exponential2", overlap=True,
                               transport="mpi" if method == "sgp_mpi" else "alltoall")


def digest(variables):
    return hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in variables)).hexdigest()


def states(model, opt):
    """Digests of the model, the replicated state and the per-rank state (and what fresh per-rank
    state would be)."""
    rank_state = (opt.pushsum if hasattr(opt, "pushsum") else opt.compression_exchange).rank_state
    return dict(model=digest(model.get_weights()), replicated=digest(opt.variables),
                rank_state=digest(v.numpy() for v in rank_state.variables.values()),
                fresh_rank_state=digest(s.initial_value().numpy() for s in rank_state.specs.values()))


def run_case(keras, x, y, save_format, method, work, export_dir):
    """Trains one case's phase; its results."""
    path = str(work / {"h5": "model.h5", "weights": "weights", "keras": "model.keras"}.get(save_format, "saved"))
    model_file = save_format in ("h5", "savedmodel", "keras")
    if FLAGS.phase == "full" or not model_file:
        model, opt, _ = new_model_and_optimizer(keras, method)
    first, at_save, at_restore = 0, None, None
    if FLAGS.phase == "resume":
        if save_format == "checkpoint":
            latest = tf.train.latest_checkpoint(str(work))
            tf.train.Checkpoint(model=model, optimizer=opt).restore(latest).assert_existing_objects_matched()
        elif save_format == "weights":
            model.load_weights(path)
        elif is_gossip(method):  # the file gives PushSumOptimizer back with its settings, the transport among them
            model = hc.load_model(path)
        else:
            model = hc.load_model(path, compression=new_model_and_optimizer(keras, method)[2])
        opt = model.optimizer
        opt.build(model.trainable_variables)  # deferred restores happen here, as at a first step
        at_restore, first = states(model, opt), STEPS

    for step in range(first, 2 * STEPS):
        if step == STEPS and FLAGS.phase == "full":
            work.mkdir(parents=True, exist_ok=True)
            if save_format == "checkpoint":
                tf.train.Checkpoint(model=model, optimizer=opt).save(str(work / "ckpt"))
            elif save_format == "weights":
                model.save_weights(path)
            else:
                model.save(path)
            at_save = states(model, opt)
        model.train_on_batch(*batch(step, x, y))

    if export_dir and hvd.rank() == 0:
        model.save(export_dir)
        np.save(pathlib.Path(export_dir) / "inputs.npy", x[:16])
        np.save(pathlib.Path(export_dir) / "logits.npy", model.predict(x[:16], verbose=0))
    if is_gossip(method):
        opt.pushsum.flush()  # over MPI, the last step's mass in flight is still in the mailbox
    return dict(at_save=at_save, at_restore=at_restore, at_end=states(model, opt),
                num_optimizer_variables=len(opt.variables), iterations=int(opt.iterations.numpy()),
                adamw=isinstance(opt, keras.optimizers.AdamW),
                warmup_steps=None if is_gossip(method) else opt.compression_exchange.warmup_steps,
                residual_norm=float(opt.pushsum.in_flight[-1] if is_gossip(method)
                                    else opt.compression_exchange.residual_norm()),
                transport=opt.pushsum.transport if is_gossip(method) else None,
                # SGP: this rank's PushSum weight, with what is in flight to it (the ranks' sum stays n)
                mass=float(opt.pushsum.weight + opt.pushsum.in_flight[-1]) if is_gossip(method) else None)


def main(_):
    keras = tf.keras  # tf_keras or Keras 3
    hvd.init()
    (x, y), _ = digits.load(0)
    results = {}
    for i, case in enumerate(FLAGS.cases):
        save_format, method = case.split("/")
        work = pathlib.Path(FLAGS.work_dir) / case.replace("/", "-") / f"rank{hvd.rank()}"
        results[case] = run_case(keras, x, y, save_format, method, work, FLAGS.export_dir if i == 0 else None)
    report(hvd, **results)


if __name__ == "__main__":
    app.run(main)
