"""Throughput of the compiled ops beside a memory copy and beside stock-TF equivalents.

    .venv/bin/python benchmarks/ops_throughput.py [--sizes=1M,16M,64M] [--repeats=7]

Every figure is GB/s of float32 input (n * 4 bytes / median time). A copy reads n floats
and writes n; a fused kernel reads and writes more (momentum_error_feed reads g, m and e
and writes m and a: five streams of n floats), so beside that table a second one gives each
fused kernel's memory traffic, the bytes it must read and write at least (TRAFFIC, in streams
of n floats), per second, as a fraction of a copy's (two streams) in the same run: a fraction
near 1 means the kernel runs at the machine's memory bandwidth. The ops are timed in rounds,
every op once a round right after a copy, and the fraction is the median over the rounds of
the pair's ratio: on a shared 2-core VM a neighbour's load that came and went between one op's
timings and the copy's moved it by 0.2 or more, which a pair a few milliseconds apart shares.
"stock TF" is
the same computation written with tf.sign/floor/cast/reshape/reduce ops, the way
pure-Python compression plugins do it. Writes results/ops_throughput.json and
prints a markdown table.

TensorFlow's BFC allocator on the CPU (TF_CPU_ALLOCATOR_USE_BFC=1, unless the environment sets it): with the
default allocator every large output is fresh memory the kernel faults in, and on an AMD EPYC that capped a copy at
1.9 GB/s at 16M floats against 6.0 with BFC (the fused Adam kernels 1.4 and 0.8 against 3.6 and 4.0), so the table
measured the allocator rather than the ops.
"""
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import results  # noqa: E402
from hvd_compress import ops, quantize_ops  # noqa: E402
from hvd_compress.compression import Compression  # noqa: E402

flags.DEFINE_list("sizes", ["1M", "16M", "64M"], "Tensor sizes in floats (K/M suffixes).")
flags.DEFINE_integer("repeats", 7, "Rounds, each timing every op once after a copy (medians are reported).")
flags.DEFINE_integer("ranks", 4, "Payloads averaged by unpack_mean and quantize's decode_mean.")
flags.DEFINE_integer("quantize_block", 256, "Block size of the quantize ops (Compression.quantize's default).")
flags.DEFINE_float("topk_ratio", 0.01, "k / n for top-k.")
flags.DEFINE_string("out", "results/ops_throughput.json", "Where to write the figures.")
FLAGS = flags.FLAGS

POWERS = (1 << np.arange(8, dtype=np.int32)).astype(np.uint8)
COPY = "copy (DeepCopy)"


def stock_pack(x):
    negative = tf.reshape(tf.cast(tf.pad(tf.cast(x < 0, tf.uint8), [[0, (-tf.size(x)) % 8]]), tf.int32),
                          [-1, 8])
    bits = tf.cast(tf.reduce_sum(negative * tf.cast(POWERS, tf.int32), axis=1), tf.uint8)
    return bits, tf.reshape(tf.reduce_mean(tf.abs(x)), [1])


def stock_unpack(bits, scales, n):
    shifts = tf.constant(np.arange(8, dtype=np.uint8))
    negative = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits[:, None], shifts), tf.constant(1, tf.uint8))
    signs = 1.0 - 2.0 * tf.cast(tf.reshape(negative, [-1])[:n], tf.float32)
    return signs * scales[0]


def stock_unpack_mean(bits, scales, n):
    return tf.reduce_mean(tf.stack([stock_unpack(bits[r], scales[r], n) for r in range(bits.shape[0])]), 0)


def stock_top_k(x, k):
    _, indices = tf.math.top_k(tf.abs(x), k, sorted=False)
    return tf.gather(x, indices), indices


def stock_compress(x, bounds):
    bits, scales = ops.block_sign_pack(x, bounds=bounds)
    return bits, scales, x - ops.block_sign_unpack(bits, scales, None, bounds=bounds)


def stock_momentum_error_feed(g, m, e, lr=0.1, momentum=0.9):
    velocity = momentum * m + g
    return velocity, lr * (momentum * velocity + g) + e


def stock_adam_momentum_feed(g, m, v, e, beta_1=0.9, epsilon=1e-7):
    """hvd_compress/adam.py's 1-bit Adam worker side before its fused kernel."""
    return (m + (g - m) * (1.0 - beta_1)) / (tf.sqrt(v) + epsilon) + e


def stock_adam_frozen_step(mean, v, alpha=1e-3, epsilon=1e-7):
    """1-bit Adam's receiving side before its fused kernel: m = mean d, delta = mean alpha."""
    return mean * (tf.sqrt(v) + epsilon), mean * alpha


def fused_decay_and_subtract(variable, delta, rate=1e-5):
    """ops.decay_and_subtract; returns a scalar (the timing reads its result; the update runs before it returns)."""
    ops.decay_and_subtract(variable, delta, rate)
    return tf.constant(0)


def stock_decay_and_subtract(variable, delta, rate=1e-5):
    """Keras's decoupled weight decay, then assign_sub: the variable's step before its fused kernel."""
    variable.assign(variable - variable * rate)
    variable.assign_sub(delta)
    return tf.constant(0)


def stock_quantize_compress(x, bits, block, seed=(1, 2)):
    """Compression.quantize's stochastic coding, 4-bit packing and residual with stock TF ops, on
    [-1, block] rows (x padded with its last value, which leaves the last block's min and max as they are)."""
    n, levels = tf.size(x), float(2**bits - 1)
    rows = tf.reshape(tf.concat([x, tf.fill([(-n) % block], x[-1])], 0), [-1, block])
    lo, hi = tf.reduce_min(rows, 1, keepdims=True), tf.reduce_max(rows, 1, keepdims=True)
    scale, inv = (hi - lo) / levels, tf.math.divide_no_nan(levels, hi - lo)
    u = tf.random.stateless_uniform(tf.shape(rows), seed)
    q = tf.clip_by_value(tf.floor((rows - lo) * inv + u), 0.0, levels)
    residual = tf.reshape(rows - (lo + q * scale), [-1])[:n]
    codes = tf.cast(tf.reshape(q, [-1])[:n], tf.uint8)
    if bits == 4:
        pairs = tf.reshape(tf.pad(codes, [[0, n % 2]]), [-1, 2])
        codes = tf.bitwise.bitwise_or(pairs[:, 0], tf.bitwise.left_shift(pairs[:, 1], 4))
    return codes, tf.reshape(scale, [-1]), tf.reshape(lo, [-1]), residual


def stock_quantize_decode_mean(packed, scales, offsets, n, bits, block):
    """The mean of m payloads of stock_quantize_compress, decoded one by one with stock TF ops."""
    decoded = []
    for r in range(packed.shape[0]):
        codes = packed[r]
        if bits == 4:
            codes = tf.reshape(tf.stack([tf.bitwise.bitwise_and(codes, 15), tf.bitwise.right_shift(codes, 4)], 1),
                               [-1])
        q = tf.reshape(tf.pad(tf.cast(codes[:n], tf.float32), [[0, (-n) % block]]), [-1, block])
        decoded.append(tf.reshape(offsets[r][:, None] + q * scales[r][:, None], [-1])[:n])
    return tf.reduce_mean(tf.stack(decoded), 0)


#: The fused kernels' least memory traffic, in streams of n floats read or written (a copy: 2). Payloads of R
#: ranks: R x their size; in place (decay_and_subtract): the variable read and written.
def traffic(ranks):
    return {
        COPY: 2,
        "pack with residual (block_sign_compress)": 1 + 1 / 32 + 1,  # x; the signs, the residual
        "quantize compress (8 bits, stochastic)": 1 + 1 / 4 + 1,  # x; the codes, the residual
        "quantize compress (4 bits, stochastic)": 1 + 1 / 8 + 1,
        "quantize compress of x + e (8 bits, stochastic)": 2 + 1 / 4 + 1,  # x, e; the codes, the residual
        "quantize compress of x + e (4 bits, stochastic)": 2 + 1 / 8 + 1,
        f"unpack_mean ({ranks} payloads)": ranks / 32 + 1,
        f"quantize decode_mean (8 bits, {ranks} payloads)": ranks / 4 + 1,
        f"quantize decode_mean (4 bits, {ranks} payloads)": ranks / 8 + 1,
        f"quantize recode_mean (8 bits, {ranks} payloads + e)": ranks / 4 + 1 + 1 / 4 + 1,  # codes, e; codes, e
        f"quantize recode_mean (4 bits, {ranks} payloads + e)": ranks / 8 + 1 + 1 / 8 + 1,
        "momentum_error_feed": 3 + 2,  # g, m, e; m, a
        "adam_momentum_feed": 4 + 1,  # g, m, v, e; a
        "adam_frozen_step": 2 + 2,  # the mean, v; m, delta
        "decay_and_subtract (in place)": 2 + 1,  # x, delta; x
    }


def seconds(fn, *args):
    """One call's wall time."""
    start = time.perf_counter()
    result = fn(*args)
    tf.nest.map_structure(lambda t: t.shape, result)  # ops on CPU run synchronously
    return time.perf_counter() - start


def interleaved(cases):
    """--repeats rounds, each timing every case once in turn, right after a copy: per case, the median time and the
    median over rounds of the copy's time over the op's (the two a few milliseconds apart, so a neighbour's load that
    comes and goes on a shared machine weighs on both). Each timed call follows an untimed one of its own, so that
    it starts from the caches and buffers its kind leaves, not the other's (a copy timed right after another op
    read 1.2x a copy's speed at 1M floats)."""
    copy = cases[COPY]
    for fn, *args in cases.values():
        fn(*args)  # trace and warm up
    times = {name: [] for name in cases}
    copy_over = {name: [] for name in cases}
    for _ in range(FLAGS.repeats):
        for name, (fn, *args) in cases.items():
            seconds(*copy)
            before = seconds(*copy)
            seconds(fn, *args)
            times[name].append(seconds(fn, *args))
            copy_over[name].append(before / times[name][-1])
    return ({name: statistics.median(t) for name, t in times.items()},
            {name: statistics.median(r) for name, r in copy_over.items()})


def parse_size(text):
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def quantize_cases(x, n, e):
    """Compression.quantize's ops at 8 and 4 bits: stochastic coding with its residual in one op, of x and of the
    worker's x + e (error feedback added on the way), the mean of --ranks payloads decoded in one pass, and the
    server's step (that mean + e coded again with its residual); each beside stock TF ops doing the same."""
    block = FLAGS.quantize_block
    bounds = ops.block_bounds(n, block)
    cases = {}
    for bits in (8, 4):
        stacked = [tf.stack([t] * FLAGS.ranks) for t in quantize_ops.block_quantize(x, bounds, bits, True, (1, 2))]
        compress = f"quantize compress ({bits} bits, stochastic)"
        mean = f"quantize decode_mean ({bits} bits, {FLAGS.ranks} payloads)"
        cases[compress] = (
            tf.function(lambda t, b=bits: quantize_ops.block_quantize_compress(t, bounds, b, True, (1, 2))), x)
        cases[f"{compress}, stock TF"] = (tf.function(lambda t, b=bits: stock_quantize_compress(t, b, block)), x)
        cases[mean] = (
            tf.function(lambda p, s, o, b=bits: quantize_ops.block_quantize_decode_mean(p, s, o, bounds, b)), *stacked)
        cases[f"{mean}, stock TF"] = (
            tf.function(lambda p, s, o, b=bits: stock_quantize_decode_mean(p, s, o, n, b, block)), *stacked)
        fed = f"quantize compress of x + e ({bits} bits, stochastic)"
        cases[fed] = (tf.function(
            lambda t, b=bits: quantize_ops.block_quantize_compress([t], bounds, b, True, (1, 2), plus=[e])), x)
        cases[f"{fed}, stock TF"] = (tf.function(lambda t, b=bits: stock_quantize_compress(t + e, b, block)), x)
        recode = f"quantize recode_mean ({bits} bits, {FLAGS.ranks} payloads + e)"
        cases[recode] = (tf.function(lambda p, s, o, b=bits: quantize_ops.block_quantize_recode_mean(
            p, s, o, bounds, b, e, True, (1, 2))), *stacked)
        cases[f"{recode}, stock TF"] = (tf.function(lambda p, s, o, b=bits: stock_quantize_compress(
            stock_quantize_decode_mean(p, s, o, n, b, block) + e, b, block)), *stacked)
    return cases


def measure(n):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(n).astype(np.float32))
    k = max(1, int(FLAGS.topk_ratio * n))
    bits, scales = ops.block_sign_pack(x)
    stacked_bits = tf.stack([bits] * FLAGS.ranks)
    stacked_scales = tf.stack([scales] * FLAGS.ranks)
    bounds = ops.block_bounds(n)
    # Compression.sketch(ratio=4)'s sketch (1 row of n/8 columns), and FetchSGD's at ratio 4 (5 rows of n/20).
    _, _, cols, _ = Compression.sketch(ratio=4).sizes(n)
    _, fetch_rows, fetch_cols, _ = Compression.sketch(ratio=4, mode="fetchsgd").sizes(n)
    shapes = {1: cols, fetch_rows: fetch_cols}
    sketches = {rows: ops.count_sketch(x, rows, c) for rows, c in shapes.items()}
    loads = ops.count_sketch(x, 1, cols, count_loads=True)[1]
    half = tf.cast(x, tf.float16)
    m, e = (tf.constant(rng.standard_normal(n).astype(np.float32)) for _ in range(2))
    v = tf.abs(m) * 1e-4
    weights = [tf.Variable(m) for _ in range(2)]
    cases = {
        COPY: (tf.function(lambda t: tf.raw_ops.DeepCopy(x=t)), x),
        "tf.identity": (tf.function(tf.identity), x),
        "pack": (tf.function(lambda t: ops.block_sign_pack(t, bounds=bounds)), x),
        "pack, stock TF": (tf.function(stock_pack), x),
        "unpack": (tf.function(lambda b, s: ops.block_sign_unpack(b, s, n, bounds=bounds)), bits, scales),
        "unpack, stock TF": (tf.function(lambda b, s: stock_unpack(b, s, n)), bits, scales),
        f"unpack_mean ({FLAGS.ranks} payloads)": (
            tf.function(lambda b, s: ops.block_sign_unpack_mean(b, s, n, bounds=bounds)),
            stacked_bits, stacked_scales),
        f"unpack_mean ({FLAGS.ranks} payloads), stock TF": (
            tf.function(lambda b, s: stock_unpack_mean(b, s, n)), stacked_bits, stacked_scales),
        f"top_k_abs (k = {FLAGS.topk_ratio:g} n)": (tf.function(lambda t: ops.top_k_abs(t, k)), x),
        f"top_k_abs (k = {FLAGS.topk_ratio:g} n), stock TF": (tf.function(lambda t: stock_top_k(t, k)), x),
        # Onebit's payload with its residual in one op, against pack, unpack and a subtraction.
        "pack with residual (block_sign_compress)": (
            tf.function(lambda t: ops.block_sign_compress(t, bounds=bounds)), x),
        "pack with residual, as pack + unpack + sub": (tf.function(lambda t: stock_compress(t, bounds)), x),
        **quantize_cases(x, n, e),
        # dist-EF-SGD's worker step (Nesterov) in one pass, against the six TensorFlow ops it replaces.
        "momentum_error_feed": (tf.function(lambda g: ops.momentum_error_feed(g, m, e, 0.1, 0.9, True)), x),
        "momentum_error_feed, stock TF": (tf.function(lambda g: stock_momentum_error_feed(g, m, e)), x),
        # 1-bit Adam's worker side (a = momentum over d + e) and receiving side (m = D d, delta = D alpha), each
        # in one pass, against the TensorFlow ops they replace.
        "adam_momentum_feed": (tf.function(lambda g: ops.adam_momentum_feed(g, m, v, e, 0.9, 1e-7)), x),
        "adam_momentum_feed, stock TF": (tf.function(lambda g: stock_adam_momentum_feed(g, m, v, e)), x),
        "adam_frozen_step": (tf.function(lambda d: ops.adam_frozen_step(d, m, v, 1e-3, 0.9, 1e-7, True)), x),
        "adam_frozen_step, stock TF": (tf.function(lambda d: stock_adam_frozen_step(d, v)), x),
        # The variable's step under AdamW (weight decay, then x -= delta), in place in one pass.
        "decay_and_subtract (in place)": (tf.function(lambda d: fused_decay_and_subtract(weights[0], d)), x),
        "decay_and_subtract, stock TF": (tf.function(lambda d: stock_decay_and_subtract(weights[1], d)), x),
        # Compression.fp16's casts into and out of its float16 buffer (F16C), and TensorFlow's tf.cast.
        "half_pack": (tf.function(lambda t: ops.half_pack([t])), x),
        "half_pack, stock TF": (tf.function(lambda t: tf.cast(t, tf.float16)), x),
        "half_unpack": (tf.function(lambda h: ops.half_unpack(h, [(n,)], [tf.float32])), half),
        "half_unpack, stock TF": (tf.function(lambda h: tf.cast(h, tf.float32)), half),
    }
    for rows, c in shapes.items():
        shape = f"{rows} x n/{round(n / c)}"
        cases[f"count_sketch ({shape})"] = (tf.function(lambda t, r=rows, c=c: ops.count_sketch(t, r, c)), x)
        cases[f"count_sketch_query ({shape})"] = (tf.function(lambda s: ops.count_sketch_query(s, n)), sketches[rows])
    # Sketched SGD's candidates at ratio 4 (n/8 of n) with this worker's values there: the one-row selection over
    # cells, and what it replaced.
    candidates = Compression.sketch(ratio=4).sizes(n)[3]
    cases["count_sketch_top_k (1 x n/8, n/8 of n)"] = (
        tf.function(lambda s, t: ops.count_sketch_top_k(s, t, candidates)), sketches[1], x)
    # As sketched SGD runs them: the sketch counts its cells' loads, and the selection takes them.
    cases["count_sketch (1 x n/8), counting its cells' loads"] = (
        tf.function(lambda t: ops.count_sketch(t, 1, cols, count_loads=True)), x)
    cases["count_sketch_top_k (1 x n/8, n/8 of n), given the loads"] = (
        tf.function(lambda s, t, l: ops.count_sketch_top_k(s, t, candidates, loads=l)), sketches[1], x, loads)
    cases["count_sketch_top_k, as query + top_k_abs + gather"] = (tf.function(
        lambda s, t: tf.gather(t, ops.top_k_abs(ops.count_sketch_query(s, n), candidates)[1])), sketches[1], x)
    times, copy_over = interleaved(cases)
    return {name: n * 4 / t / 1e9 for name, t in times.items()}, copy_over


def main(_):
    sizes = [parse_size(s) for s in FLAGS.sizes]
    threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
    figures = {"threads": threads, "gb_per_s": {}, "copy_over_op": {}, "repeats": FLAGS.repeats,
               "bfc": os.environ["TF_CPU_ALLOCATOR_USE_BFC"] == "1", "ranks": FLAGS.ranks}
    for text, n in zip(FLAGS.sizes, sizes):
        figures["gb_per_s"][text], figures["copy_over_op"][text] = measure(n)
        print(f"measured {text} floats", flush=True)
    names = list(next(iter(figures["gb_per_s"].values())))
    print(f"\nGB/s of float32 input, median of {FLAGS.repeats} rounds, {threads} CPU threads "
          f"(TensorFlow {tf.__version__})\n")
    print("| op | " + " | ".join(FLAGS.sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{figures['gb_per_s'][s][name]:.2f}" for s in FLAGS.sizes) + " |")
    print()
    for s in FLAGS.sizes:
        r = figures["gb_per_s"][s]
        copy = r[COPY]
        print(f"{s}: pack {r['pack'] / copy:.0%} of copy, {r['pack'] / r['pack, stock TF']:.1f}x stock TF; "
              f"unpack {r['unpack'] / copy:.0%} of copy, {r['unpack'] / r['unpack, stock TF']:.1f}x stock TF")
        for bits in (8, 4):
            name = f"quantize compress ({bits} bits, stochastic)"
            mean = f"quantize decode_mean ({bits} bits, {FLAGS.ranks} payloads)"
            print(f"{s}: {name} {r[name] / copy:.0%} of copy, {r[name] / r[name + ', stock TF']:.1f}x stock TF; "
                  f"decode_mean {r[mean] / copy:.0%} of copy, {r[mean] / r[mean + ', stock TF']:.1f}x stock TF")
    results.save(FLAGS.out, figures)
    publish(figures)


def render(figures):
    """The figures as docs/benchmarks.md shows them: GB/s of float32 input per op and size."""
    sizes = list(figures["gb_per_s"])
    names = list(figures["gb_per_s"][sizes[0]])
    allocator = ("TensorFlow's BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=1)" if figures.get("bfc")
                 else "TensorFlow's default CPU allocator")
    paired = "copy_over_op" in figures
    timing = (f"median time over {figures['repeats']} rounds, each timing every op once in turn, right after a copy"
              if paired else "median time")
    note = f"GB/s of float32 input (n x 4 bytes / {timing}), {figures['threads']} CPU threads, {allocator}."
    table = results.markdown_table(["op", *sizes],
                                   [[name, *(f"{figures['gb_per_s'][s][name]:.2f}" for s in sizes)] for name in names])
    streams = traffic(figures.get("ranks", 4))
    fused = [name for name in streams if name in names]
    traffic_note = ("The fused kernels' memory traffic: the streams of n floats each must read and write at least "
                    "(a copy: 2), and its traffic per second as a fraction of a copy's at the same size: " +
                    ("streams / 2 x the copy's time over the op's, the copy timed just before the op, the median "
                     "over the rounds." if paired else "GB/s of input x streams / the copy's x 2."))
    traffic_table = results.markdown_table(
        ["op", "streams", *(f"{s}: of a copy's traffic" for s in sizes)],
        [[name, f"{streams[name]:.3g}", *(f"{of_copy(figures, s, name, streams):.2f}x" for s in sizes)]
         for name in fused])
    return f"{note}\n\n{table}\n\n{traffic_note}\n\n{traffic_table}"


def of_copy(figures, size, name, streams):
    """The op's memory traffic per second over a copy's at one size: paired with the copy before it in each round
    (figures of a run before the pairing: the ratio of the medians)."""
    if "copy_over_op" in figures:
        return streams[name] / streams[COPY] * figures["copy_over_op"][size][name]
    gb_per_s = figures["gb_per_s"][size]
    return gb_per_s[name] * streams[name] / (gb_per_s[COPY] * streams[COPY])


def publish(figures):
    """The table in docs/benchmarks.md: ops_throughput."""
    results.publish("ops_throughput", render(figures), results.command_line(), source=FLAGS.out)


if __name__ == "__main__":
    app.run(results.run(main, publish))
