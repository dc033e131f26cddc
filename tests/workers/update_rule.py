"""hc.DistributedOptimizer's step against the NumPy reference of the update rules, over several
steps in graph mode with a learning-rate schedule, on every rank.

One launch covers several world sizes (--world_sizes): each size n runs on the Horovod process set
of ranks 0..n-1 (the optimizer's process_set=); reports {"n/case": digest}. Every case at every size, or
under --rotation each case at one of them (the default run: the two Kerases' launches rotate opposite ways)."""
import hashlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
from hvd_compress import exchange
import np_reference as ref
from rule_inputs import DENSE, MU, SHAPE, WARMUP, adam, adam_rate, grads_of, quantize_draws, rate, sgd, train
from _worker import init_world_sizes, launch_size, op_types, report

flags.DEFINE_integer("steps", 6, "Optimizer steps (the rate drops after step 2).")
flags.DEFINE_list("world_sizes", None, "World sizes to run (default: the number of ranks).")
flags.DEFINE_list("rules", ["world", "quantize", "adam"], "Which groups of update rules to check.")
flags.DEFINE_integer("rotation", None, "Run each case at one world size only: the i-th case of each group at the "
                     "(i + rotation)-th of --world_sizes, cyclically. Launches with rotations 0 and 1 over two sizes "
                     "run every case at both. Unset: every case at every size.")
FLAGS = flags.FLAGS


def world_sizes():
    return sorted(int(n) for n in FLAGS.world_sizes or [launch_size()])


def runs_at(index, size):
    """Whether the case at `index` of its group runs at world size `size`."""
    sizes = world_sizes()
    return FLAGS.rotation is None or sizes[(index + FLAGS.rotation) % len(sizes)] == size


def rotated(cases, size):
    """Those of the cases (a dict, or a sequence) that run at world size `size`."""
    items = [item for i, item in enumerate(cases.items() if isinstance(cases, dict) else cases) if runs_at(i, size)]
    return dict(items) if isinstance(cases, dict) else items


def run(compression, nesterov, process_set):
    """Trains the two variables with hc; returns the final values."""
    w, b, opt, step = train(sgd(nesterov), FLAGS.steps, process_set.rank(), compression=compression,
                            process_set=process_set, name=f"hc.n{process_set.size()}")
    # dist-EF-SGD (onebit under SGD) decodes its update straight into w; every other rule subtracts or
    # hands on a dense tensor.
    ran = op_types(step, tf.TensorSpec(SHAPE), tf.TensorSpec([DENSE]))
    assert ("ResourceSubtractBlockSignMean" in ran) == isinstance(compression, hc.compression.OneBitCompressor), (
        compression, sorted(ran))
    layout = opt.compression_exchange.layout
    # Compression.fp16 compresses nothing: its 16-bit exchange is the one of uncompressed tensors.
    assert (layout.compressed, layout.dense) == (([], [0, 1]) if compression is hc.Compression.fp16 else ([0], [1]))
    return w, b


def reference_dense(nesterov, size, variable=1, mean=lambda gs: np.mean(gs, axis=0, dtype=np.float32)):
    """Keras SGD on the mean of the ranks' gradients of one variable (0: w, 1: b)."""
    x = np.zeros(grads_of(0, 0)[variable].size, np.float32)
    m = np.zeros_like(x)
    for t in range(FLAGS.steps):
        g = mean([grads_of(r, t)[variable].reshape(-1) for r in range(size)])
        ref.keras_sgd(x, m, g, rate(t), MU, nesterov)
    return x


def reference_onebit(block_size, two_way, nesterov, size):
    model = ref.DistEFSGD(int(np.prod(SHAPE)), size, MU, nesterov, block_size, two_way)
    x = np.zeros(int(np.prod(SHAPE)), np.float32)
    for t in range(FLAGS.steps):
        model.step(x, [grads_of(r, t)[0].reshape(-1) for r in range(size)], rate(t))
    return x


def reference_sparse(compression, size, nesterov, schedule=None):
    """Plain error feedback on gradients, then Keras SGD on the averaged sparse gradient.
    schedule: the compressor of each step (Accordion switching ratios: one shared error)."""
    schedule = schedule or [compression] * FLAGS.steps
    d = int(np.prod(SHAPE))
    x, m = np.zeros(d, np.float32), np.zeros(d, np.float32)
    e = [np.zeros(d, np.float32) for _ in range(size)]
    for t, compression in enumerate(schedule):
        k = compression.num_selected(d)
        total = np.zeros(d, np.float32)
        for r in range(size):
            a = grads_of(r, t)[0].reshape(-1) + e[r]
            if isinstance(compression, hc.Compression.randomk):
                idx = compression.indices(d, k, t, 0).numpy()
                values = a[idx]
            else:
                values, idx = ref.top_k_abs(a, k)
            sent = ref.scatter_dense(idx, values, d)
            e[r] = a - sent
            total += sent
        ref.keras_sgd(x, m, total / np.float32(size), rate(t), MU, nesterov)
    return x


def reference_powersgd(compression, size, nesterov, schedule=None):
    """PowerSGD with error feedback (float64 NumPy), then Keras SGD on the low-rank mean. The
    update P P^T M does not depend on the signs QR picks, so NumPy's QR may differ from TF's.
    schedule: the compressor of each step (Accordion switching ranks: one shared error, a
    warm-started Q per compressor)."""
    schedule = schedule or [compression] * FLAGS.steps
    qs = {c.rank: tf.random.stateless_normal([SHAPE[1], c.rank], tf.constant([c.seed << 20, 0], tf.int64))
          .numpy().astype(np.float64) for c in schedule}
    e = [np.zeros(SHAPE) for _ in range(size)]
    x, m = np.zeros(int(np.prod(SHAPE)), np.float32), np.zeros(int(np.prod(SHAPE)), np.float32)
    for t in range(FLAGS.steps):
        ms = [grads_of(r, t)[0].astype(np.float64) + e[r] for r in range(size)]
        mean = np.mean(ms, axis=0)
        p = np.linalg.qr(mean @ qs[schedule[t].rank])[0]
        qs[schedule[t].rank] = q = mean.T @ p
        update = p @ q.T
        e = [mr - update for mr in ms]
        ref.keras_sgd(x, m, update.reshape(-1).astype(np.float32), rate(t), MU, nesterov)
    return x


def run_adam(compression, process_set, weight_decay, amsgrad=False, warmup_steps=WARMUP, with_unused=False):
    """1-bit Adam: hc's Adam (weight_decay > 0: AdamW) with `compression`; returns w, b. with_unused: a third
    variable in w's bucket has a gradient at the first step only; after it, it and its Adam slots must stay as they
    were (no decay either), as Keras leaves a variable without a gradient."""
    wrapper = dict(compression=compression, process_set=process_set, warmup_steps=warmup_steps,
                   name=f"hc.adam.n{process_set.size()}")
    if not with_unused:
        w, b, opt, _ = train(adam(weight_decay, amsgrad), FLAGS.steps, process_set.rank(), **wrapper)
        assert type(opt.compression_exchange.rule).__name__ in ('OneBitAdam', 'FrozenVarianceAdam')
        return w, b
    w = tf.Variable(np.zeros(SHAPE, np.float32), name="w")
    b = tf.Variable(np.zeros(DENSE, np.float32), name="b")
    unused = tf.Variable(np.ones(SHAPE, np.float32), name="unused")
    opt = hc.DistributedOptimizer(adam(weight_decay, amsgrad), **wrapper)

    @tf.function
    def step(gw, gb, gu=None):
        opt.apply_gradients([(gw, w), (gb, b)] + ([(gu, unused)] if gu is not None else []))

    def unused_state():
        return [unused.numpy()] + [np.asarray(s) for s in opt.compression_exchange.rule.slots[1] if s is not None]

    for t in range(FLAGS.steps):
        gw, gb = grads_of(process_set.rank(), t)
        step(tf.constant(gw), tf.constant(gb), tf.constant(gw) if t == 0 else None)
        if t == 0:
            after_first = unused_state()
    exchange_ = opt.compression_exchange
    assert exchange_.layout.buckets == [[0, 2]], exchange_.layout.buckets
    assert all(np.any(s) for s in after_first)
    assert all(np.array_equal(a, b) for a, b in zip(after_first, unused_state()))


def reference_adam(size, weight_decay, variable=0, warmup_steps=WARMUP, topk=None, **shape):
    """1-bit Adam in NumPy on one variable (0: w, compressed; 1: b, dense: Keras's Adam throughout); shape:
    block_size, two_way, amsgrad. topk: a Compression.topk, whose error feedback on gradients makes it Adam with a
    frozen variance instead."""
    d = grads_of(0, 0)[variable].size
    warmup_steps = warmup_steps if variable == 0 else FLAGS.steps
    if topk is not None:
        model = ref.FrozenVarianceAdam(d, size, warmup_steps, weight_decay=weight_decay,
                                       exchange=ref.TopKExchange(d, size, topk.num_selected(d)), **shape)
    else:
        model = ref.OneBitAdam(d, size, warmup_steps, weight_decay=weight_decay, **shape)
    x = np.zeros(d, np.float32)
    for t in range(FLAGS.steps):
        model.step(x, [grads_of(r, t)[variable].reshape(-1) for r in range(size)],
                   np.float32(adam_rate(t)))
    return x


def check_adam(process_set, digests):
    """1-bit Adam (Adam and AdamW; onebit's defaults under Adam, two-way and one-way in blocks), and top-k's Adam with
    a frozen variance, over WARMUP full-precision steps and the compressed ones after, against the NumPy reference bit
    for bit."""
    size = process_set.size()
    # onebit() under Adam takes the defaults measured there (adam.OneBitAdam.settle): a scale per 256 elements, one-way.
    cases = {"1-bit Adam, its defaults": (hc.Compression.onebit(), 0.0, False, dict(block_size=256, two_way=False)),
             "1-bit AdamW one-way blocks": (hc.Compression.onebit(block_size=64, two_way=False), 0.05, False,
                                            dict(block_size=64, two_way=False)),
             "1-bit AdamW two-way blocks amsgrad": (hc.Compression.onebit(block_size=64, two_way=True), 0.05, True,
                                                    dict(block_size=64, amsgrad=True)),
             "top-k AdamW frozen variance": (hc.Compression.topk(ratio=0.05), 0.05, False,
                                             dict(topk=hc.Compression.topk(ratio=0.05))),
             "top-k Adam amsgrad frozen variance": (hc.Compression.topk(ratio=0.05), 0.0, True,
                                                    dict(topk=hc.Compression.topk(ratio=0.05), amsgrad=True))}
    for name, (compression, weight_decay, amsgrad, shape) in rotated(cases, size).items():
        w, b = run_adam(compression, process_set, weight_decay, amsgrad)
        np.testing.assert_array_equal(w, reference_adam(size, weight_decay, 0, **shape), err_msg=f"n={size} {name}")
        # The dense variable is Keras's Adam on Horovod's ring allreduce, whose order of summation NumPy does not replay
        np.testing.assert_allclose(b, reference_adam(size, weight_decay, 1, amsgrad=amsgrad), rtol=1e-5, atol=1e-7,
                                   err_msg=f"n={size} {name} (dense)")
        uncompressed = reference_adam(size, weight_decay, 0, warmup_steps=FLAGS.steps)
        assert not np.allclose(w, uncompressed, rtol=1e-5, atol=1e-6), name  # the compressed steps show
        digests[f"{size}/{name}"] = hashlib.sha256(w.tobytes() + b.tobytes()).hexdigest()
    if runs_at(0, size):  # a group of one
        run_adam(hc.Compression.onebit(), process_set, 0.05, with_unused=True)


def run_tape(block_size, process_set):
    """A custom loop: DistributedGradientTape with a GradientExchange, then plain SGD."""
    w = tf.Variable(np.zeros(SHAPE, np.float32), name="w")
    exchange = hc.GradientExchange(hc.Compression.onebit(block_size=block_size),
                                   process_set=process_set, name=f"hc.tape.n{process_set.size()}")
    sgd = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(gw):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * gw)  # d loss / d w = gw
        tape = hc.DistributedGradientTape(tape, exchange=exchange)
        sgd.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

    for t in range(FLAGS.steps):
        step(tf.constant(grads_of(process_set.rank(), t)[0]))
    return w.numpy().reshape(-1)


def reference_tape(block_size, size):
    """Plain EF on gradients = dist-EF-SGD with mu = 0 and lr = 1 giving D, then x -= 0.1 D."""
    d = int(np.prod(SHAPE))
    model = ref.DistEFSGD(d, size, 0.0, False, block_size, True)
    x = np.zeros(d, np.float32)
    for t in range(FLAGS.steps):
        update = np.zeros(d, np.float32)
        model.step(update, [grads_of(r, t)[0].reshape(-1) for r in range(size)], 1.0)
        x += np.float32(0.1) * update  # update holds -D
    return x


def run_sketch(compression, process_set):
    variant = (f"{compression.mode}{int(compression.second_round)}{int(compression.apply_candidates)}"
               f"{int(compression.mask_momentum)}")
    w, _, opt, _ = train(sgd(schedule=False), FLAGS.steps, process_set.rank(), dense=False, compression=compression,
                         process_set=process_set, name=f"hc.{variant}.n{process_set.size()}")
    return w, opt.compression_exchange.exchanges[0]


def reference_sketch_on_the_concatenated_batch(exchange, size):
    d = int(np.prod(SHAPE))
    if exchange.compressor.mode == "fetchsgd":
        model = ref.FetchSGD(d, exchange.k, exchange.rows, exchange.cols, exchange.compressor.hash_seed(), MU, True)
    else:
        compressor = exchange.compressor
        model = ref.SketchedSGD(d, exchange.k, exchange.rows, exchange.cols, exchange.num_candidates,
                                compressor.hash_seed(), MU, True, compressor.second_round, compressor.apply_candidates,
                                compressor.mask_momentum)
    x = np.zeros(d, np.float32)
    for t in range(FLAGS.steps):
        mean = np.mean([grads_of(r, t)[0].reshape(-1) for r in range(size)], axis=0, dtype=np.float32)
        model.step(x, mean, 0.1)
    return x


def check_world(process_set, digests):
    """Every update rule on `process_set` against its reference; adds "n/case": digest."""
    size = process_set.size()
    cases = {
        "onebit two-way nesterov": (hc.Compression.onebit(), True,
                                    lambda: reference_onebit(None, True, True, size)),
        "onebit two-way blocks": (hc.Compression.onebit(block_size=64), False,
                                  lambda: reference_onebit(64, True, False, size)),
        "onebit one-way blocks": (hc.Compression.onebit(block_size=64, two_way=False), True,
                                  lambda: reference_onebit(64, False, True, size)),
        "topk": (hc.Compression.topk(ratio=0.05), True,
                 lambda: reference_sparse(hc.Compression.topk(ratio=0.05), size, True)),
        "randomk": (hc.Compression.randomk(ratio=0.05, seed=3), True,
                    lambda: reference_sparse(hc.Compression.randomk(ratio=0.05, seed=3), size, True)),
        "powersgd": (hc.Compression.powersgd(rank=3, seed=2), True,
                     lambda: reference_powersgd(hc.Compression.powersgd(rank=3, seed=2), size, True)),
    }
    for name, (compression, nesterov, reference) in rotated(cases, size).items():
        w, b = run(compression, nesterov, process_set)
        want = reference()
        np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6, err_msg=f"n={size} {name}")
        assert np.abs(w).max() > 0.01, name  # something was learned
        np.testing.assert_allclose(b, reference_dense(nesterov, size), rtol=1e-5, atol=1e-6, err_msg=name)
        digests[f"{size}/{name}"] = hashlib.sha256(w.tobytes() + b.tobytes()).hexdigest()
    for chunk_bytes in rotated((exchange.HALF_CHUNK_BYTES, 256), size):  # the buffer in one piece, and in 256 B pieces
        exchange.HALF_CHUNK_BYTES, default = chunk_bytes, exchange.HALF_CHUNK_BYTES
        w, b = run(hc.Compression.fp16, True, process_set)  # every tensor by the 16-bit exchange
        exchange.HALF_CHUNK_BYTES = default
        for got, variable in ((w, 0), (b, 1)):
            np.testing.assert_allclose(got, reference_dense(True, size, variable, ref.half_mean), rtol=1e-5,
                                       atol=1e-6, err_msg=f"n={size} fp16 variable {variable}, {chunk_bytes} B pieces")
        assert not np.allclose(w, reference_dense(True, size, 0), rtol=1e-5, atol=1e-6)  # float16's rounding shows
        digests[f"{size}/fp16 {chunk_bytes}"] = hashlib.sha256(w.tobytes() + b.tobytes()).hexdigest()
    sketches = {  # every candidate's exact sum (momentum masked or kept); the exact top-k among them; the
        # sketch's top-k; FetchSGD
        "sketch second_round=True": hc.Compression.sketch(ratio=6, seed=5),
        "sketch mask_momentum=True": hc.Compression.sketch(ratio=6, mask_momentum=True, seed=5),
        "sketch apply_candidates=False": hc.Compression.sketch(ratio=6, apply_candidates=False, seed=5),
        "sketch second_round=False": hc.Compression.sketch(ratio=6, second_round=False, seed=5),
        "fetchsgd": hc.Compression.sketch(ratio=6, mode="fetchsgd", seed=5),
    }
    for name, compression in rotated(sketches, size).items():
        w, ex = run_sketch(compression, process_set)
        want = reference_sketch_on_the_concatenated_batch(ex, size)
        per_step = ex.num_candidates if compression.apply_candidates else ex.k  # applied coordinates a step
        assert np.count_nonzero(w) > per_step  # several steps of them
        np.testing.assert_allclose(w, want, rtol=1e-4, atol=1e-5, err_msg=f"n={size} {name}")
        digests[f"{size}/{name}"] = hashlib.sha256(w.tobytes()).hexdigest()
    if runs_at(0, size):  # a group of one
        w = run_tape(128, process_set)
        np.testing.assert_allclose(w, reference_tape(128, size), rtol=1e-5, atol=1e-6, err_msg=f"n={size} tape")
        digests[f"{size}/tape"] = hashlib.sha256(w.tobytes()).hexdigest()


QUANTIZE_SHAPES = [(60, 50), (37, 29)]  # one bucket of two tensors, 4073 elements: odd shards and blocks


def run_quantize_tape(compression, process_set):
    """DistributedGradientTape with a GradientExchange of `compression` (quantize): the averaged
    gradient it returns at every step, as one flat vector."""
    ws = [tf.Variable(np.zeros(s, np.float32)) for s in QUANTIZE_SHAPES]
    exchange_ = hc.GradientExchange(compression, process_set=process_set,
                                    name=f"hc.quantize{compression.bits}.n{process_set.size()}")

    @tf.function
    def step(gs):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(w * g) for w, g in zip(ws, gs)])  # d loss / d w = g
        grads = hc.DistributedGradientTape(tape, exchange=exchange_).gradient(loss, ws)
        return tf.concat([tf.reshape(g, [-1]) for g in grads], 0)

    return [step([tf.constant(g) for g in quantize_grads(process_set.rank(), t)]).numpy() for t in range(FLAGS.steps)]


def quantize_grads(rank, step):
    rng = np.random.default_rng(1000 + 100 * step + rank)
    return [(rng.standard_normal(s) * (1 + i)).astype(np.float32) for i, s in enumerate(QUANTIZE_SHAPES)]


def reference_quantize(c, size):
    """The two-way quantized exchange in NumPy (np_reference.two_way_quantized_means) of quantize_grads:
    the bucket's blocks and the ranks' shards, draws keyed by rank and side (bucket 0)."""
    sizes = [int(np.prod(s)) for s in QUANTIZE_SHAPES]
    cuts = exchange.shard_cuts(sum(sizes), size)
    inputs = [[np.concatenate([g.reshape(-1) for g in quantize_grads(r, t)]) for r in range(size)]
              for t in range(FLAGS.steps)]
    return ref.two_way_quantized_means(inputs, np.union1d(hc.ops.layout_bounds(sizes, c.block_size), cuts), cuts,
                                       c.bits, c.stochastic, c.error_feedback, quantize_draws(c))


def check_quantize(process_set, digests):
    """Compression.quantize at 8, 4 and 2 bits, stochastic or not, with and without error feedback: the
    averaged gradient of every step equals the NumPy reference's bit for bit."""
    size = process_set.size()
    for compression in rotated((hc.Compression.quantize(bits=8, block_size=64), hc.Compression.quantize(bits=4, seed=3),
                                hc.Compression.quantize(bits=2, block_size=100, stochastic=False),
                                hc.Compression.quantize(bits=4, block_size=128, error_feedback=False)), size):
        got = run_quantize_tape(compression, process_set)
        for t, (g, want) in enumerate(zip(got, reference_quantize(compression, size))):
            np.testing.assert_array_equal(g, want, err_msg=f"n={size} {compression!r} step {t}")
        assert np.abs(got[-1]).max() > 0.1, compression
        digests[f"{size}/{compression!r}"] = hashlib.sha256(np.concatenate(got).tobytes()).hexdigest()


def main(_):
    digests = {}
    for process_set in init_world_sizes(world_sizes()).values():
        for check in FLAGS.rules:
            {"world": check_world, "quantize": check_quantize, "adam": check_adam}[check](process_set, digests)
    report(hvd, digests=digests)


if __name__ == "__main__":
    app.run(main)
