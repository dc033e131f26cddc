"""hc.DiLoCo's steps against the NumPy reference (np_reference.DiLoCo), on every rank, at each world size.

Each case trains w (compressed where the case compresses) and b (always uncompressed) from zero on rule_inputs'
per-rank gradients, for --steps graph-mode inner steps: the inner SGD without momentum or AdamW (each rank's
own Adam state), syncs every H steps with the case's outer optimizer and compression; the streaming cases cut
the model into fragments (w, b) whose exchanges run in the background for `delay` steps. The steps end between
syncs, so each rank's own x_i is compared. w is compared bit for bit wherever its mean is summed in a fixed order
(top-k's decoded sum in rank order; two ranks' allreduce); the uncompressed allreduce at 3 or more ranks sums in
Gloo's ring order, within float32 rounding of the reference's; theta is the same on every rank. Some cases also
run interrupted and resumed from per-rank checkpoints (RESUMED). Reports {"n/case": digest of x_i}, the bytes
per sync and whether each resumed run gave the uninterrupted one's bits."""
import hashlib
import pathlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from hvd_compress.diloco import fragment_plan
import np_reference as ref
from rule_inputs import DENSE, SHAPE, adam, adam_rate, grads_of, train
from _worker import init_world_sizes, launch_size, report

flags.DEFINE_integer("steps", 7, "Inner steps of each case (ending between syncs).")
flags.DEFINE_list("world_sizes", None, "World sizes to run (default: the number of ranks).")
FLAGS = flags.FLAGS
LR, WEIGHT_DECAY, K = 0.1, 0.05, 300
#: The cases also run interrupted after RESUME_AFTER steps (between syncs, with momentum, error feedback and Adam's
#: slots to keep; streaming: with fragment b's exchange in flight), resumed from per-rank checkpoints: x_i must be
#: the uninterrupted run's, bit for bit.
RESUMED, RESUME_AFTER = ("topk+nesterov", "heavy_ball+adamw", "streaming+topk+adamw"), 5
#: name -> (sync_every, outer_learning_rate, outer_momentum, nesterov, compressed, error_decay, inner,
#:          fragments, sync_delay, merge_alpha)
CASES = {
    "nesterov": (3, 0.7, 0.9, True, False, 1.0, "sgd", 1, 0, 0.0),
    "heavy_ball+adamw": (3, 0.5, 0.8, False, False, 1.0, "adamw", 1, 0, 0.0),
    "topk+decay": (2, 1.0, 0.0, False, True, 0.95, "sgd", 1, 0, 0.0),
    "topk+nesterov": (2, 0.7, 0.9, True, True, 1.0, "adamw", 1, 0, 0.0),
    # two fragments (w's first rows and b, starting after steps 2, 6; w's last rows, 4, 8), landing `delay` later
    "streaming+nesterov": (4, 0.7, 0.9, True, False, 1.0, "sgd", 2, 1, 0.0),
    "streaming+topk+adamw": (4, 1.0, 0.0, False, True, 0.95, "adamw", 2, 2, 0.5),
}


def settings(case, process_set):
    h, lr, mu, nesterov, compressed, decay, inner, fragments, delay, alpha = CASES[case]
    return dict(sync_every=h, outer_learning_rate=lr, outer_momentum=mu, nesterov=nesterov, error_decay=decay,
                compression=hc.Compression.topk(k=K) if compressed else hc.Compression.none, fragments=fragments,
                sync_delay=delay, merge_alpha=alpha, process_set=process_set)


def inner_optimizer(kind):
    return tf.keras.optimizers.SGD(LR) if kind == "sgd" else adam(weight_decay=WEIGHT_DECAY)


def run(case, process_set):
    w, b, opt, _ = train(inner_optimizer(CASES[case][6]), FLAGS.steps, process_set.rank(), wrap=hc.DiLoCo,
                         **settings(case, process_set))
    theta = np.concatenate([s.numpy().reshape(-1) for s in opt.diloco.snapshots])
    return np.concatenate([w, b]), theta, opt


def reference(case, n, rank):
    """(rank's x_i, theta) after the steps."""
    h, lr, mu, nesterov, compressed, decay, inner, fragments, delay, alpha = CASES[case]
    d, cut = int(np.prod(SHAPE)), int(np.prod(SHAPE))
    topk = ref.TopKExchange(cut, n, K) if compressed else None

    def plain_mean(deltas):
        return np.add.reduce(deltas) / np.float32(n)

    def mean(deltas):
        if topk is None:
            return plain_mean(deltas)
        w_mean = topk.error_fed_mean([delta[:cut] for delta in deltas])
        return np.concatenate([w_mean, plain_mean([delta[cut:] for delta in deltas])])

    def residuals():
        return topk.e if topk else []

    parts = None if fragments == 1 else [fragment_reference(pieces, n, cut, compressed) for pieces in
                                         fragment_plan([SHAPE, (DENSE,)], fragments)]
    diloco = ref.DiLoCo(np.zeros(d + DENSE, np.float32), n, lr, mu, nesterov, mean, residuals=residuals,
                        error_decay=decay, sync_every=h, fragments=parts, delay=delay, alpha=alpha)
    adams = [ref.OneBitAdam(d + DENSE, 1, FLAGS.steps, weight_decay=WEIGHT_DECAY) for _ in range(n)]
    for t in range(FLAGS.steps):
        for r in range(n):
            g = np.concatenate([part.reshape(-1) for part in grads_of(r, t)])
            if inner == "sgd":
                diloco.x[r] = diloco.x[r] - np.float32(LR) * g
            else:
                adams[r].step(diloco.x[r], [g], np.float32(adam_rate(t)))
        diloco.after_step(t + 1)
    return diloco.x[rank], diloco.theta


def fragment_reference(pieces, n, cut, compressed):
    """(flat indices, mean, residuals) of a fragment of hc.diloco.fragment_plan's pieces of w (rows of SHAPE,
    top-k where the case compresses: each piece is at least min_compress_size) and b (plain)."""
    row = SHAPE[1]
    flat = [np.arange(p.start * row, p.stop * row) if p.index == 0 else cut + np.arange(p.start, p.stop)
            for p in pieces]
    sizes = [len(f) for f in flat]
    compressed_size = sum(size for p, size in zip(pieces, sizes) if p.index == 0) if compressed else 0
    topk = ref.TopKExchange(compressed_size, n, K) if compressed_size else None

    def mean(deltas):
        plain = np.add.reduce([d[compressed_size:] for d in deltas]) / np.float32(n)
        return plain if topk is None else np.concatenate(
            [topk.error_fed_mean([d[:compressed_size] for d in deltas]), plain])

    return np.concatenate(flat), mean, lambda: topk.e if topk else []


def check(case, process_set):
    n = process_set.size()
    x, theta, opt = run(case, process_set)
    want, want_theta = reference(case, n, process_set.rank())
    name = f"{n}/{case}"
    cut = int(np.prod(SHAPE))
    exact = n == 2 or CASES[case][4]  # w's mean in a fixed order
    for got, expected, what in ((x, want, "x_i"), (theta, want_theta, "theta")):
        if exact:
            np.testing.assert_array_equal(got[:cut], expected[:cut], err_msg=f"{name} {what} (w)")
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"{name} {what}")
    assert np.abs(x).max() > 0.01 and not np.array_equal(x, theta), name  # trained, and stepped past the sync
    thetas = hvd.allgather(tf.constant(theta[None]), process_set=process_set, name=f"theta.{name}").numpy()
    assert (thetas == thetas[0]).all(), name  # theta: the same bits on every rank
    return name, hashlib.sha256(x.tobytes()).hexdigest(), opt.diloco.bytes_per_sync


def resumed(case, process_set, directory):
    """x_i after the case's steps, interrupted after RESUME_AFTER of them: each rank saves a per-rank checkpoint
    (tf.train.Checkpoint of the variables and the optimizer) and restores it into new variables and a new
    optimizer, which take the remaining steps."""
    inner = CASES[case][6]
    path = None
    for steps in (range(RESUME_AFTER), range(RESUME_AFTER, FLAGS.steps)):
        w, b = tf.Variable(np.zeros(SHAPE, np.float32)), tf.Variable(np.zeros(DENSE, np.float32))
        opt = hc.DiLoCo(inner_optimizer(inner), **settings(case, process_set))
        checkpoint = tf.train.Checkpoint(w=w, b=b, optimizer=opt)
        if path is not None:
            checkpoint.restore(path)

        @tf.function
        def step(gw, gb):
            opt.apply_gradients([(gw, w), (gb, b)])

        for t in steps:
            step(*map(tf.constant, grads_of(process_set.rank(), t)))
        path = checkpoint.write(str(directory / f"{process_set.size()}-{case}-rank{process_set.rank()}"))
    return np.concatenate([w.numpy().reshape(-1), b.numpy()])


def main(_):
    process_sets = init_world_sizes([int(n) for n in FLAGS.world_sizes or [launch_size()]])
    digests, sent, resumes = {}, {}, {}
    for case in CASES:
        for process_set in process_sets.values():
            name, digests[name], sent[name] = check(case, process_set)
            if case in RESUMED:
                x = resumed(case, process_set, pathlib.Path(FLAGS.out_dir))
                resumes[name] = hashlib.sha256(x.tobytes()).hexdigest() == digests[name]
    report(hvd, digests=digests, bytes_per_sync=sent, resumed_exactly=resumes)


if __name__ == "__main__":
    app.run(main)
