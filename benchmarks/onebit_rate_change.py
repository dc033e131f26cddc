"""Onebit's residuals across a learning-rate change: rescaled (hvd_compress's rule) or kept (the paper's).

    .venv/bin/python benchmarks/onebit_rate_change.py            # 2 ranks, 12 epochs, seeds 0-3 (~10 min)

Under Keras SGD, hc.Compression.onebit() runs dist-EF-SGD (Zheng et al. 2019), whose worker and
server residuals hold learning-rate-SCALED leftovers (a_i = lr_t p_i + e_i). The paper keeps them as
they are when the rate changes, so they carry what was left at the old rate; hvd_compress multiplies
them by lr_t / lr_{t-1} in the step. This trains the bundled digits CNN (Nesterov SGD,
momentum 0.9, two-way onebit, 2 Gloo ranks, each its own shard) under two schedules:
  step:   lr 0.1*size (--lr) for the first half of the epochs, then 0.001*size (LearningRateScheduler);
  cosine: CosineDecay from 0.1*size to 1e-5 of it over the run;
with three methods (hc.methods' names, and one variant):
  none:            hc.Compression.none (Horovod-style uncompressed SGD);
  onebit:          hc.Compression.onebit(), hvd_compress's rule (residuals rescaled by new/old);
  onebit_paper:    the same, plus a callback that, before every batch whose learning rate differs
                   from the previous batch's, multiplies every residual (worker e_i, server shards
                   e_s) by old/new, undoing the step's rescale: the paper's rule.
Per epoch it records rank 0's test accuracy, the L2 norm of the weights' change over the epoch
(of all weights, and of the compressed tensors alone), the learning rate and rank 0's residual
norm; it prints a markdown table (final accuracy, movement in the first epoch after the drop and
in the last epoch) and writes results/onebit_rate_change.json. At --lr=0.1, fp32 SGD (none) sometimes
diverges on this model (a seed's step or cosine run); --lr=0.05 gives a stable baseline.
"""
import os
import pathlib
import sys
import time

from absl import app, flags

import launch
import results

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

flags.DEFINE_enum("role", "launcher", ["launcher", "worker"], "launcher: runs every configuration.")
flags.DEFINE_integer("ranks", 2, "Ranks.")
flags.DEFINE_integer("epochs", 12, "Epochs of every run (step schedule: the drop after half of them).")
flags.DEFINE_list("seeds", ["0", "1", "2", "3"], "Seeds (split, initial weights, shuffling).")
flags.DEFINE_list("schedules", ["step", "cosine"], "Learning-rate schedules.")
flags.DEFINE_list("methods", ["none", "onebit_paper", "onebit"], "Methods: names of hc.methods' compressions, or "
                  "onebit_paper.")
flags.DEFINE_integer("batch_size", 32, "Batch size per rank.")
flags.DEFINE_float("lr", 0.1, "Learning rate per rank (times the ranks); the step schedule divides it by 100.")
flags.DEFINE_string("out", "results/onebit_rate_change.json", "The runs' JSON.")
# worker mode: one run
flags.DEFINE_string("schedule", "step", "worker: the schedule.")
flags.DEFINE_string("method", "none", "worker: the method.")
flags.DEFINE_integer("seed", 0, "worker: the seed.")
flags.DEFINE_string("result", None, "worker: where rank 0 writes its JSON.")
FLAGS = flags.FLAGS
#: tensors of at least this many elements are compressed (hvd_compress's default min_compress_size); the
#: rest (biases, the first conv kernel, the last dense kernel) are averaged in fp32 and updated by Keras SGD,
#: whose velocity holds lr-scaled steps. weight_change_large: the movement of the compressed ones only.
LARGE = 1024
#: this benchmark's methods beyond hc.methods' names: name -> the name of hc.methods it trains with (and
#: the paper's rule, KeepResiduals, on top)
VARIANTS = {"onebit_paper": "onebit"}


def worker():
    import json

    import keras
    import numpy as np
    import horovod.tensorflow as hvd
    import hvd_compress as hc
    import digits

    class KeepResiduals(keras.callbacks.Callback):
        """Before a batch whose learning rate differs from the last one's: residuals *= old / new, which
        the step's rescale (new / old) undoes: the paper's rule."""

        def __init__(self):
            super().__init__()
            self.previous, self.rescales = None, 0

        def on_train_batch_begin(self, batch, logs=None):
            opt = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
            lr = float(opt.learning_rate)  # Keras 3: a schedule evaluated at opt.iterations
            if self.previous is not None and lr != self.previous:
                ex = opt.compression_exchange
                for v in [r for r in ex.residuals if r is not None] + ex.server_residuals:
                    v.assign(v * (self.previous / lr))
                self.rescales += 1
            self.previous = lr

    class Record(keras.callbacks.Callback):
        """Per epoch: test accuracy, L2 norm of the weights' change, learning rate, residual norm."""

        def __init__(self, x, y):
            super().__init__()
            self.x, self.y, self.epochs = x, y, []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = [w.copy() for w in self.model.get_weights()]

        def on_epoch_end(self, epoch, logs=None):
            opt = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
            moved = [np.sum((w - s) ** 2) for w, s in zip(self.model.get_weights(), self.start)]
            large = [m for m, s in zip(moved, self.start) if s.size >= LARGE]
            ex = opt.compression_exchange
            self.epochs.append(dict(
                test_accuracy=float(self.model.evaluate(self.x, self.y, verbose=0)[1]),
                weight_change=float(np.sqrt(sum(moved))), weight_change_large=float(np.sqrt(sum(large))),
                learning_rate=float(opt.learning_rate), loss=float(logs["loss"]),
                residual_norm=float(ex.residual_norm()) if ex.residuals else 0.0))

    hvd.init()
    keras.utils.set_random_seed(FLAGS.seed)
    size, epochs = hvd.size(), FLAGS.epochs
    (x_train, y_train), (x_test, y_test) = digits.load(FLAGS.seed)
    train, steps = digits.shard(x_train, y_train, hvd.rank(), size, FLAGS.batch_size, FLAGS.seed)
    model = digits.cnn(keras, FLAGS.seed)
    callbacks = [hc.callbacks.BroadcastGlobalVariablesCallback(0)]
    if FLAGS.schedule == "step":
        lr = FLAGS.lr * size
        callbacks.append(keras.callbacks.LearningRateScheduler(
            lambda epoch: FLAGS.lr * size * (1 if epoch < epochs // 2 else 0.01)))
    else:
        lr = keras.optimizers.schedules.CosineDecay(FLAGS.lr * size, epochs * steps, alpha=1e-5)
    sgd = keras.optimizers.SGD(lr, momentum=0.9, nesterov=True)
    compression = hc.methods.compression(VARIANTS.get(FLAGS.method, FLAGS.method))
    model.compile(optimizer=hc.DistributedOptimizer(sgd, compression=compression),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rescale = KeepResiduals() if FLAGS.method == "onebit_paper" else None
    record = Record(x_test, y_test)
    model.fit(train, epochs=epochs, steps_per_epoch=steps, verbose=0,
              callbacks=callbacks + ([rescale] if rescale else []) + [record])
    if hvd.rank() == 0:
        with open(FLAGS.result, "w") as f:
            json.dump(dict(schedule=FLAGS.schedule, method=FLAGS.method, seed=FLAGS.seed, ranks=size,
                           steps_per_epoch=steps, rescales=rescale.rescales if rescale else 0,
                           test_accuracy=record.epochs[-1]["test_accuracy"], epochs=record.epochs), f, indent=1)


def mean_sd(values):
    import numpy as np
    return f"{np.mean(values):.4g} ± {np.std(values, ddof=1) if len(values) > 1 else 0:.2g}"


def table(runs):
    drop = FLAGS.epochs // 2  # index of the first epoch after the step schedule's drop
    print(f"\n{FLAGS.ranks} ranks, {FLAGS.epochs} epochs, lr {FLAGS.lr} x ranks, seeds {','.join(FLAGS.seeds)}: "
          "mean ± sd over seeds [per seed]. Weight movement: L2 norm of the change over one epoch, of all "
          "weights / of the compressed tensors only.\n\n| schedule | method | final test accuracy | movement, epoch after the drop "
          "(all) | (compressed) | movement, last epoch (all) | (compressed) |")
    print("|---|---|---|---|---|---|---|")
    for schedule in FLAGS.schedules:
        for method in FLAGS.methods:
            rs = [r for r in runs if r["schedule"] == schedule and r["method"] == method]

            def cell(values, fmt="{:.3g}"):
                return f"{mean_sd(values)} [{', '.join(fmt.format(v) for v in values)}]"

            cells = [cell([r["test_accuracy"] for r in rs], "{:.4f}")]
            for epoch in [drop, -1]:
                for key in ["weight_change", "weight_change_large"]:
                    cells.append(cell([r["epochs"][epoch][key] for r in rs])
                                 if schedule == "step" or epoch == -1 else "-")
            print(f"| {schedule} | {method} | {' | '.join(cells)} |")


def main(_):
    if FLAGS.role == "worker":
        return worker()
    from hvd_compress import methods as registry

    launch.check_names("onebit_rate_change.py", "methods", FLAGS.methods, [*registry.METHODS, *VARIANTS])
    os.environ.update(HOROVOD_CYCLE_TIME="0.1", TF_CPP_MIN_LOG_LEVEL="2")
    print(launch.load_before(), flush=True)
    runs, begin = [], time.monotonic()
    for seed in FLAGS.seeds:
        for schedule in FLAGS.schedules:
            for method in FLAGS.methods:
                start = time.monotonic()
                r = launch.run_worker(__file__, FLAGS.ranks, [
                    f"--schedule={schedule}", f"--method={method}", f"--seed={seed}", f"--epochs={FLAGS.epochs}",
                    f"--batch_size={FLAGS.batch_size}", f"--lr={FLAGS.lr}"], threads_per_rank=1, timeout=600)
                r["seconds"] = time.monotonic() - start
                runs.append(r)
                print(f"seed {seed} {schedule} {method}: test accuracy {r['test_accuracy']:.4f}, weight change "
                      f"per epoch {[round(e['weight_change'], 4) for e in r['epochs']]} ({r['seconds']:.0f} s)",
                      flush=True)
    print(f"\n{len(runs)} runs in {time.monotonic() - begin:.0f} s")
    table(runs)
    results.save(FLAGS.out, dict(epochs=FLAGS.epochs, ranks=FLAGS.ranks, batch_size=FLAGS.batch_size,
                                 lr_per_rank=FLAGS.lr, runs=runs))
    publish(dict(epochs=FLAGS.epochs, ranks=FLAGS.ranks, batch_size=FLAGS.batch_size, lr_per_rank=FLAGS.lr,
                 runs=runs))


def learning_rate(data):
    """The learning rate per rank of a saved run (older files kept {"high": ..., "low": ...})."""
    lr = data["lr_per_rank"]
    return lr["high"] if isinstance(lr, dict) else lr


def render(data):
    """The runs as docs/benchmarks.md shows them: per schedule and method, the final test accuracy and the
    weights' movement (L2 norm of their change over an epoch) after the step schedule's drop and in the
    last epoch, mean ± sd over the seeds [per seed]."""
    runs, drop = data["runs"], data["epochs"] // 2
    seeds = sorted({r["seed"] for r in runs})
    note = (f"digits CNN, {data['ranks']} ranks, {data['epochs']} epochs, lr {learning_rate(data):g} per rank "
            f"(times the ranks), seeds {', '.join(map(str, seeds))}: mean ± sd [per seed]. onebit: residuals "
            "rescaled with the rate (hvd_compress's rule); onebit_paper: kept (the paper's rule). Movement: all "
            "weights / the compressed tensors only.")

    def cell(values, fmt="{:.3g}"):
        return f"{mean_sd(values)} [{', '.join(fmt.format(v) for v in values)}]"

    rows = []
    for schedule in dict.fromkeys(r["schedule"] for r in runs):
        for method in dict.fromkeys(r["method"] for r in runs):
            rs = [r for r in runs if r["schedule"] == schedule and r["method"] == method]
            if not rs:
                continue
            moved = [" / ".join(mean_sd([r["epochs"][epoch][key] for r in rs])
                                for key in ("weight_change", "weight_change_large"))
                     if schedule == "step" or epoch == -1 else "-" for epoch in (drop, -1)]
            rows.append([schedule, method, cell([r["test_accuracy"] for r in rs], "{:.4f}"), *moved])
    table = results.markdown_table(["schedule", "method", "final test accuracy", "movement, epoch after the drop",
                                    "movement, last epoch"], rows, align=["l", "l", "l", "r", "r"])
    return f"{note}\n\n{table}"


def publish(data):
    """The table in docs/benchmarks.md: onebit_rate_change_lr<lr>."""
    results.publish(f"onebit_rate_change_lr{learning_rate(data):g}", render(data), results.command_line(),
                    source=FLAGS.out)


if __name__ == "__main__":
    app.run(results.run(main, publish))
