"""hc.DistributedOptimizer(hierarchical=True) on hosts of several ranks (tests/hvdrun.run_hosts): its
step against a NumPy reference of the hierarchical rule, over several graph-mode steps with a
learning-rate drop, on every rank; reports {case: digest} and the layout Horovod saw. One launch runs several
--modes in turn (a launch's start-up costs more than what its ranks then run); each rank reports {mode: result}.

The reference: every rank's worker-side value a_i (dist-EF-SGD: lr times its Nesterov momentum; top-k:
its gradient); each host's mean, added in local-rank order (float32) times float32(1 / L); local rank l
exchanges shard l of its host's mean, with its error feedback e (h = mean_l + s e), with local rank l of
every other host by the compressor's flat exchange; every rank applies the gathered shards."""
import atexit
import hashlib
import os
import pathlib
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
import np_reference as ref
from rule_inputs import MU, SHAPE, WARMUP, adam, adam_rate, grads_of, quantize_draws, rate, sgd, train
from _worker import IdenticalRanks, LoggedLines, define_list_of, report

#: What a launch can run (--modes).
MODES = ["rules", "refused", "save", "resume", "fit"]
flags.DEFINE_integer("steps", 5, "rules: optimizer steps (the rate drops after step 2).")
define_list_of("modes", MODES, ["rules"],
               "What to run, in the order given. rules: the rules of --cases against their references; fit: "
               "model.fit as users run it (mixed_float16, AdamW, 1-bit Adam; it sets the global policy, so it goes "
               "last); refused: the error of a first hierarchical step that cannot run here; save: "
               "--checkpoint_steps steps of hierarchical onebit, then every rank writes a tf.train.Checkpoint under "
               "--work_dir and trains --checkpoint_steps more (the uninterrupted run); resume: reads rank r's "
               "checkpoint and trains those --checkpoint_steps (with --slow_rank, last: the exit is timed).")
flags.DEFINE_list("cases", None, "rules: the cases to run (default: every case).")
flags.DEFINE_integer("checkpoint_steps", 3, "save, resume: steps before and after the checkpoint.")
flags.DEFINE_string("work_dir", None, "save, resume: where the ranks' checkpoints are.")
flags.DEFINE_integer("slow_rank", -1, "save, resume: this rank sleeps 3 s after its last step (a slow host), and "
                     "every rank writes the time it exits at to --work_dir/exit<rank>, after hvd_compress's exit "
                     "handler.")
FLAGS = flags.FLAGS


def run(compression):
    """Trains the two variables with hc, hierarchical; their final values."""
    w, b, _, _ = train(sgd(), FLAGS.steps, hvd.rank(), compression=compression, hierarchical=True)
    return w, b


def reference(kind, hosts, local, compression):
    """The hierarchical rule of `kind` (onebit: dist-EF-SGD; topk: error feedback, then Keras SGD) on w."""
    d, n = int(np.prod(SHAPE)), hosts * local
    # PowerSGD needs whole tensors: bucket 0, w, goes whole to local rank 0
    cuts = ref.shard_cuts(d, local) if kind != "powersgd" else np.array([0] + [d] * local)
    powersgd = PowerSGDHosts(compression, hosts) if kind == "powersgd" else None
    x, m_sgd = np.zeros(d, np.float32), np.zeros(d, np.float32)
    momenta = [np.zeros(d, np.float32) for _ in range(n)]
    previous_lr = np.float32(0)
    shards = [(int(cuts[l]), int(cuts[l + 1])) for l in range(local)]
    if kind == "onebit":
        onebit = ref.HierarchicalOneBit(d, hosts, local, compression.block_size, compression.two_way)
    errors = [[np.zeros(hi - lo, np.float32) for _ in range(hosts)] for lo, hi in shards]
    for t in range(FLAGS.steps):
        grads = [grads_of(r, t)[0].reshape(-1) for r in range(n)]
        if kind == "onebit":
            scale = ref.residual_scale(rate(t), previous_lr)
            previous_lr = np.float32(rate(t))
            values = []
            for r, g in enumerate(grads):
                momenta[r] = np.float32(MU) * momenta[r] + g
                values.append(np.float32(rate(t)) * (np.float32(MU) * momenta[r] + g))
        else:
            scale, values = np.float32(1), grads
        if kind == "onebit":
            x -= onebit.error_fed_mean(values, scale)
            continue
        means = ref.host_means(values, hosts, local)
        update = np.zeros(d, np.float32)
        for l, (lo, hi) in enumerate(shards):
            if lo == hi:
                continue
            if hosts == 1:  # nothing crosses a host: the host's mean is the update
                update[lo:hi] = means[0][lo:hi]
            elif kind == "powersgd":
                update[lo:hi] = powersgd.step([means[h][lo:hi] for h in range(hosts)])
            else:
                k = compression.num_selected(hi - lo)
                total = np.zeros(hi - lo, np.float32)
                for h in range(hosts):
                    fed = means[h][lo:hi] + errors[l][h]
                    if kind == "randomk":
                        idx = compression.indices(hi - lo, k, t, 0).numpy()
                        values_h = fed[idx]
                    else:
                        values_h, idx = ref.top_k_abs(fed, k)
                    sent = ref.scatter_dense(idx, values_h, hi - lo)
                    errors[l][h] = fed - sent
                    total += sent
                update[lo:hi] = total / np.float32(hosts)
        ref.keras_sgd(x, m_sgd, update, rate(t), MU, True)
    return x


def reference_quantize(hosts, local, compression):
    """Hierarchical Compression.quantize on w: local rank l's shard of each host's mean goes through the two-way
    quantized exchange among the hosts (its blocks cut at the hosts' shards, its draws keyed by the host),
    error feedback on that shard; Keras SGD on the joined update."""
    d, steps = int(np.prod(SHAPE)), range(FLAGS.steps)
    cuts = ref.shard_cuts(d, local)
    means = [ref.host_means([grads_of(r, t)[0].reshape(-1) for r in range(hosts * local)], hosts, local)
             for t in steps]
    updates = [np.zeros(d, np.float32) for _ in steps]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if lo == hi:
            continue
        inputs = [[host_means[h][lo:hi] for h in range(hosts)] for host_means in means]
        if hosts == 1:  # nothing crosses a host
            shard_updates = [step_inputs[0] for step_inputs in inputs]
        else:
            server_cuts = ref.shard_cuts(hi - lo, hosts)
            bounds = np.union1d(hc.ops.layout_bounds([hi - lo], compression.block_size), server_cuts)
            shard_updates = ref.two_way_quantized_means(inputs, bounds, server_cuts, compression.bits,
                                                        compression.stochastic, compression.error_feedback,
                                                        quantize_draws(compression))
        for update, shard in zip(updates, shard_updates):
            update[lo:hi] = shard
    x, m = np.zeros(d, np.float32), np.zeros(d, np.float32)
    for t in steps:
        ref.keras_sgd(x, m, updates[t], rate(t), MU, True)
    return x


def run_sketch(compression):
    """Hierarchical sketched SGD or FetchSGD on w alone: w's final values, and this rank's shard (elements lo:hi)
    with its sketch exchange across hosts (None where nothing crosses)."""
    w, _, opt, _ = train(sgd(schedule=False), FLAGS.steps, hvd.rank(), dense=False, compression=compression,
                         hierarchical=True)
    hierarchical = opt.compression_exchange.exchanges[0]
    lo = sum(hierarchical.splits[:hvd.local_rank()])
    return w, (lo, lo + hierarchical.splits[hvd.local_rank()]), hierarchical.inner


def reference_sketch_of_the_shard(hosts, local, shard, sketch):
    """What a hierarchical sketch gives this rank's shard: every step of the sketch is linear in what the ranks
    put in, so it is the flat rule (np_reference) on the shard of the mean of all ranks' gradients, with the shard's
    own k and sketch."""
    lo, hi = shard
    c = sketch.compressor
    if c.mode == "fetchsgd":
        model = ref.FetchSGD(hi - lo, sketch.k, sketch.rows, sketch.cols, c.hash_seed(), MU, True)
    else:
        model = ref.SketchedSGD(hi - lo, sketch.k, sketch.rows, sketch.cols, sketch.num_candidates, c.hash_seed(),
                                MU, True, c.second_round, c.apply_candidates, c.mask_momentum)
    x = np.zeros(hi - lo, np.float32)
    for t in range(FLAGS.steps):
        mean = np.mean([grads_of(r, t)[0].reshape(-1) for r in range(hosts * local)], axis=0, dtype=np.float32)
        model.step(x, mean[lo:hi], 0.1)
    return x


def reference_dense(hosts, local, variable, half=False):
    """Keras SGD on the hierarchical mean of one variable's gradients (0: w, 1: b): the hosts' means, then
    their mean (in 16 bits under Compression.fp16)."""
    x = np.zeros(grads_of(0, 0)[variable].size, np.float32)
    m = np.zeros_like(x)
    for t in range(FLAGS.steps):
        means = ref.host_means([grads_of(r, t)[variable].reshape(-1) for r in range(hosts * local)], hosts, local)
        g = ref.half_mean(means) if half and hosts > 1 else np.mean(means, axis=0, dtype=np.float32)
        ref.keras_sgd(x, m, g, rate(t), MU, True)
    return x


def run_adam(compression, weight_decay):
    """1-bit Adam (AdamW: weight_decay > 0), hierarchical, WARMUP steps at full precision; w's final values."""
    return train(adam(weight_decay), FLAGS.steps, hvd.rank(), dense=False, compression=compression,
                 warmup_steps=WARMUP, hierarchical=True)[0]


def reference_adam(hosts, local, compression, weight_decay):
    d = int(np.prod(SHAPE))
    model = ref.OneBitAdam(d, hosts * local, WARMUP, weight_decay=weight_decay, block_size=compression.block_size,
                           two_way=compression.two_way, hosts=(hosts, local))
    x = np.zeros(d, np.float32)
    for t in range(FLAGS.steps):
        model.step(x, [grads_of(r, t)[0].reshape(-1) for r in range(hosts * local)], np.float32(adam_rate(t)))
    return x


class PowerSGDHosts:
    """PowerSGD (float64 NumPy, warm-started Q, error feedback) among hosts on their means of w: the update
    P Q^T does not depend on the signs QR picks, so NumPy's QR may differ from TensorFlow's."""

    def __init__(self, compression, hosts):
        self.q = tf.random.stateless_normal([SHAPE[1], compression.rank], tf.constant([compression.seed << 20, 0],
                                                                                     tf.int64)).numpy().astype(np.float64)
        self.e = [np.zeros(SHAPE) for _ in range(hosts)]

    def step(self, means):
        ms = [m.reshape(SHAPE).astype(np.float64) + e for m, e in zip(means, self.e)]
        mean = np.mean(ms, axis=0)
        p = np.linalg.qr(mean @ self.q)[0]
        self.q = mean.T @ p
        update = p @ self.q.T
        self.e = [m - update for m in ms]
        return update.reshape(-1).astype(np.float32)


def refused():
    """The error a hierarchical step gives here (before any collective), or None."""
    w = tf.Variable(np.zeros(SHAPE, np.float32))
    opt = hc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hc.Compression.onebit(), hierarchical=True)
    try:
        tf.function(lambda g: opt.apply_gradients([(g, w)]))(tf.ones(SHAPE))
    except ValueError as e:
        return str(e)
    return None


def checkpointed(mode):
    """Hierarchical onebit with per-rank checkpoints (see --mode): w's digest, every rank's; what was logged."""
    logged = LoggedLines.attach()
    w = tf.Variable(np.zeros(SHAPE, np.float32), name="w")
    opt = hc.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=MU), compression=hc.Compression.onebit(),
                                  hierarchical=True)
    checkpoint = tf.train.Checkpoint(w=w, optimizer=opt)
    path = f"{FLAGS.work_dir}/rank{hvd.rank()}/ckpt"
    first = 0
    if mode == "resume":
        checkpoint.read(path).expect_partial()
        first = FLAGS.checkpoint_steps
    step = tf.function(lambda g: opt.apply_gradients([(g, w)]))
    for t in range(first, 2 * FLAGS.checkpoint_steps):
        if mode == "save" and t == FLAGS.checkpoint_steps:
            checkpoint.write(path)
        step(tf.constant(grads_of(hvd.rank(), t)[0]))
    if hvd.rank() == FLAGS.slow_rank:
        time.sleep(3)
    return dict(digest=hashlib.sha256(w.numpy().tobytes()).hexdigest(), moved=float(np.abs(w.numpy()).max()),
                logged=logged.lines, finished=time.time())


def fit():
    """model.fit as users run it: a Keras model under mixed_float16, AdamW with onebit (1-bit Adam after a warm-up),
    hierarchical, rank 0's weights broadcast first; ranks checked identical after every batch; the losses."""
    keras = tf.keras
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    opt = hc.DistributedOptimizer(keras.optimizers.AdamW(1e-3), compression=hc.Compression.onebit(), warmup_steps=5,
                                  hierarchical=True)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.standard_normal((320, 64)).astype(np.float32), rng.integers(0, 10, 320)
    identical = IdenticalRanks("onebit")
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0,
                        callbacks=[hc.callbacks.BroadcastGlobalVariablesCallback(0), identical])
    return dict(losses=history.history["loss"], steps_checked=identical.checked,
                loss_scaled=type(model.optimizer).__name__)


def rules():
    """Every case of --cases against its reference on this rank: {case: digest}, the layout Horovod saw, and the
    warnings logged about a single host."""
    logged = LoggedLines.attach()
    hosts, local = hvd.cross_size(), hvd.local_size()
    cases = {"onebit two-way": ("onebit", hc.Compression.onebit()),
             "onebit one-way blocks": ("onebit", hc.Compression.onebit(block_size=64, two_way=False)),
             "topk": ("topk", hc.Compression.topk(ratio=0.05)),
             "randomk": ("randomk", hc.Compression.randomk(ratio=0.05, seed=3)),
             "powersgd": ("powersgd", hc.Compression.powersgd(rank=3, seed=2)),
             "quantize 4 bits": ("quantize", hc.Compression.quantize(bits=4, block_size=64, seed=3)),
             "quantize 8 bits rounded without feedback": ("quantize", hc.Compression.quantize(
                 stochastic=False, error_feedback=False)),
             "none": ("none", hc.Compression.none), "fp16": ("fp16", hc.Compression.fp16)}
    adam = {"1-bit Adam two-way": (hc.Compression.onebit(block_size=None, two_way=True), 0.0),
            "1-bit AdamW one-way blocks": (hc.Compression.onebit(block_size=64, two_way=False), 0.05)}
    sketches = {"sketch": hc.Compression.sketch(ratio=6, seed=5),
                "fetchsgd": hc.Compression.sketch(ratio=6, mode="fetchsgd", seed=5)}
    chosen = FLAGS.cases or [*adam, *sketches, *cases]
    assert set(chosen) <= {*adam, *sketches, *cases}, f"--cases: unknown {set(chosen) - {*adam, *sketches, *cases}}"
    adam, sketches, cases = ({name: case for name, case in group.items() if name in chosen}
                             for group in (adam, sketches, cases))
    digests = {}
    for name, (compression, weight_decay) in adam.items():
        w = run_adam(compression, weight_decay)
        np.testing.assert_array_equal(w, reference_adam(hosts, local, compression, weight_decay),
                                      err_msg=f"{hosts}x{local} {name}")
        digests[name] = hashlib.sha256(w.tobytes()).hexdigest()
    for name, compression in sketches.items():
        w, (lo, hi), sketch = run_sketch(compression)
        if sketch is not None:  # (one host: the host's mean is the update, as "none" checks)
            np.testing.assert_allclose(w[lo:hi], reference_sketch_of_the_shard(hosts, local, (lo, hi), sketch),
                                       rtol=1e-4, atol=1e-5, err_msg=f"{hosts}x{local} {name}, shard {lo}:{hi}")
            assert np.count_nonzero(w[lo:hi]) > sketch.k, name  # several steps of coordinates
        digests[name] = hashlib.sha256(w.tobytes()).hexdigest()
    for name, (kind, compression) in cases.items():
        w, b = run(compression)
        want = (reference_dense(hosts, local, 0, half=kind == "fp16") if kind in ("none", "fp16") else
                reference_quantize(hosts, local, compression) if kind == "quantize" else
                reference(kind, hosts, local, compression))
        np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6, err_msg=f"{hosts}x{local} {name}")
        np.testing.assert_allclose(b, reference_dense(hosts, local, 1, half=kind == "fp16"), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{hosts}x{local} {name}: the uncompressed variable")
        assert np.abs(w).max() > 0.01, name
        digests[name] = hashlib.sha256(w.tobytes() + b.tobytes()).hexdigest()
    return dict(digests=digests, layout=[hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
                single_host_warnings=sum("on a single host" in line for line in logged.lines))


def main(_):
    if FLAGS.slow_rank >= 0:  # registered before hvd.init and hvd_compress's handler: runs after both
        exited = pathlib.Path(FLAGS.work_dir, f"exit{os.environ['HOROVOD_RANK']}")
        atexit.register(lambda: exited.write_text(str(time.time())))
    hvd.init()
    run = {"rules": rules, "refused": refused, "save": lambda: checkpointed("save"),
           "resume": lambda: checkpointed("resume"), "fit": fit}
    report(hvd, **{mode: run[mode]() for mode in FLAGS.modes})


if __name__ == "__main__":
    app.run(main)
