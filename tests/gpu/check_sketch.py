"""The count-sketch kernels (tf_ops/gpu/sketch_kernels.cu) against np_reference, bit for bit: the sketch against
count_sketch (np.add.at: every cell summed in increasing i, as the CPU kernel sums it) for float32, float16 and
bfloat16 inputs, over one region and several (cols > 64K), cells of one value and of thousands; the buckets against
sketch_hash, and the cells' loads (CountSketch's count_loads) against the counts of its buckets; the query against
`query_reference`, count_sketch_query with the CPU kernel's exact ties (count_sketch_query's NumPy sort leaves the
sign of a zero median open: the CPU's 3- and 5-row networks put -0 before +0, its sort for other row counts keeps
tied values in row order), on sketches of special values (NaN of either sign, infinities, signed zeros) and rows 1 to
8, 12 and 33 (the kernel's path for more than 32 rows). No tolerance anywhere: the GPU sums each cell in the CPU's
order (a stable sort by cell, then one thread per cell). Inputs keep clear of float32 subnormals, which TensorFlow's
CPU ops flush to zero and NumPy does not.

The timed sizes are the library's defaults at n = 2**26 (hvd_compress/sketch.py, SketchCompressor.sizes):
Compression.sketch(ratio=4) is one row of F / 2 + a few columns (F = n / 4 floats per step; the other half goes to
the second round's 25 k candidates, k = F / 50), and Compression.sketch(ratio=4, mode="fetchsgd") five rows of
F / 5 columns."""
import math

import numpy as np

import np_reference as ref
from check_half import bf16_values, to_bf16_bits

#: (n, rows, cols, seed, step): tiny, around kChunk, one region of exactly 64K columns, two regions of unequal
#: widths, three regions, cells of many values (cols far below n), and the CPU test's large case.
SKETCH_CASES = [(0, 2, 7, 0, 0), (1, 1, 1, 3, 0), (7, 3, 5, 1, 2), (1000, 5, 500, 7, 0), (ref.KCHUNK - 3, 2, 97, 11, 5),
                (ref.KCHUNK + 5, 4, 1000, 2**40, 123), (100_003, 5, 20_000, 5, 0), (200_000, 2, 1 << 16, 9, 1),
                (150_001, 3, (1 << 16) + 1, 4, 0), (300_001, 1, 150_001, 6, 7), (100_000, 1, 1, 8, 0),
                (50_000, 3, 2, 10, 3), (2_500_003, 2, 150_001, 11, 0)]
QUERY_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 33]
SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -2.5, 1e-30, -7.0], np.float32)


def inputs(rng, n, dtype):
    """(x as the kernel takes it, x as float32): normal values at a random scale, with +-0, and for larger n an
    infinity and a NaN (which turn their cells, and a minority of query rows, non-finite)."""
    x = rng.standard_normal(n).astype(np.float32) * np.float32(rng.uniform(0.01, 10))
    if n:
        x[rng.integers(0, n, max(1, n // 50))] = -0.0
        x[rng.integers(0, n, max(1, n // 50))] = 0.0
    if n > 1000:
        x[n // 3], x[n // 2] = np.nan, -np.inf
    if dtype == "bf16":
        bits = to_bf16_bits(x)
        return bits, bf16_values(bits)
    if dtype == "f16":
        x = x.astype(np.float16)
        return x, x.astype(np.float32)
    return x, x


def median_keys(v):
    """MedianKey (tf_ops/cores.h): int32 keys in the float order with NaN last and -0 before +0."""
    bits = np.asarray(v, np.float32).view(np.int32)
    keys = bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))
    return np.where(np.isnan(v), np.int32(np.iinfo(np.int32).max), keys).astype(np.int32)


def from_median_keys(keys):
    keys = np.asarray(keys, np.int32)
    return (keys ^ ((keys >> 31) & np.int32(0x7FFFFFFF))).view(np.float32)


def query_reference(sketch, n, seed=0, step=0):
    """count_sketch_query with the CPU kernel's ties (SketchMedian in tf_ops/cores.h): 1 row: its value; 3 and 5
    rows: the middle MedianKey; other counts: a stable sort with -0 and +0 tied and NaN last, the middle value or
    the float32 mean of the middle two."""
    rows, cols = sketch.shape
    values = np.empty((rows, n), np.float32)
    for j in range(rows):
        buckets, signs = ref.sketch_hash(seed, j, n, cols, step)
        values[j] = signs * sketch[j, buckets]
    if rows == 1:
        return values[0]
    if rows in (3, 5):
        return from_median_keys(np.sort(median_keys(values), axis=0)[rows // 2])
    order = np.argsort(values + np.float32(0), axis=0, kind="stable")  # + 0: -0 becomes +0, so they tie
    ordered = np.take_along_axis(values, order, axis=0)
    if rows % 2:
        return ordered[rows // 2]
    with np.errstate(invalid="ignore"):  # inf + -inf
        return (ordered[rows // 2 - 1] + ordered[rows // 2]) / np.float32(2)


def count_sketch(run, x, n, rows, cols, seed, step, dtype):
    cp, k = run.cp, run.k
    sketch = cp.full((rows, cols), np.nan, cp.float32)  # every cell must be written
    workspace = cp.empty(max(1, k.hc_count_sketch_workspace_bytes(n, cols)), cp.uint8)
    getattr(k, f"hc_count_sketch_{dtype}")(cp.asarray(x), n, seed, step, rows, cols, sketch, workspace, None)
    return sketch


def query(run, sketch, n, seed, step):
    cp = run.cp
    rows, cols = sketch.shape
    estimate = cp.full(n, np.nan, cp.float32)
    run.k.hc_count_sketch_query(cp.asarray(sketch), rows, cols, n, seed, step, estimate, None)
    return estimate


def check(run):
    cp, k, rng = run.cp, run.k, run.rng
    for n, rows, cols, seed, step in SKETCH_CASES:
        case = f"n={n} rows={rows} cols={cols} seed={seed} step={step}"
        for dtype in ("f32", "f16", "bf16") if n <= 300_001 else ("f32",):
            x, values = inputs(rng, n, dtype)
            want = ref.count_sketch(values, rows, cols, seed, step)
            got = count_sketch(run, x, n, rows, cols, seed, step, dtype)
            run.expect(f"hc_count_sketch_{dtype}", case, got, want)
            if dtype == "f32":
                run.expect("hc_count_sketch_query", case, query(run, want, n, seed, step),
                           query_reference(want, n, seed, step))
        m = min(n, 50)
        indices = np.concatenate([rng.integers(0, n, m), [0, n - 1, n, -1]] if n else [[0, -1]]).astype(np.int64)
        buckets = cp.full((rows, indices.size), -7, cp.int64)
        k.hc_count_sketch_buckets(cp.asarray(indices), indices.size, n, seed, step, rows, cols, buckets, None)
        want = np.full((rows, indices.size), -1, np.int64)
        inside = (indices >= 0) & (indices < n)
        for j in range(rows):
            want[j, inside] = ref.sketch_hash(seed, j, n, cols, step)[0][indices[inside]]
        run.expect("hc_count_sketch_buckets", case, buckets, want)
        loads = cp.full((rows, cols), -7, cp.int32)
        k.hc_count_sketch_loads(n, seed, step, rows, cols, loads, None)
        run.expect("hc_count_sketch_loads", case, loads,
                   np.array([np.bincount(ref.sketch_hash(seed, j, n, cols, step)[0], minlength=cols)
                             for j in range(rows)], np.int32).reshape(rows, cols))
    for rows in QUERY_ROWS:  # special values, as test_medians_order_non_finite_values_and_zeros_as_numpy
        for n, cols in ((5000, 40), (3, 7), (200_000, 70_000)):
            sketch = rng.choice(SPECIAL, (rows, cols)).astype(np.float32)
            sketch[:, ::3] = rng.standard_normal((rows, len(range(0, cols, 3)))).astype(np.float32)
            run.expect("hc_count_sketch_query", f"special values n={n} rows={rows} cols={cols}",
                       query(run, sketch, n, rows, 1), query_reference(sketch, n, rows, 1))
    for rows in QUERY_ROWS:  # a sketch of a vector, read back (empty cells: +-0 values)
        n, cols = 30_000, 5000
        x, _ = inputs(rng, n, "f32")
        sketch = ref.count_sketch(x, rows, cols, seed=rows)
        run.expect("hc_count_sketch_query", f"sketch of x n={n} rows={rows} cols={cols}",
                   query(run, sketch, n, rows, 0), query_reference(sketch, n, rows, 0))
    run.expect("hc_count_sketch_query", "n=0", query(run, np.ones((3, 5), np.float32), 0, 0, 0),
               np.zeros(0, np.float32))


def default_sizes(n, ratio=4):
    """(label, rows, cols, k) of Compression.sketch(ratio) and Compression.sketch(ratio, mode="fetchsgd") for a
    bucket of n elements: SketchCompressor.sizes in hvd_compress/sketch.py (25 candidates per k, half the floats on
    the sketch when there is a second round; 5 rows for FetchSGD)."""
    floats = n / ratio
    k = max(1, math.floor(floats * 0.5 / 25))
    return [(f"sketched SGD, ratio {ratio}", 1, max(1, math.floor(floats - 25 * k)), k),
            (f"FetchSGD, ratio {ratio}", 5, max(1, math.floor(floats / 5)), k)]


def bench(run, n):
    cp, k = run.cp, run.k
    x = cp.asarray(run.rng.standard_normal(n).astype(np.float32))
    estimate = cp.empty(n, cp.float32)
    for label, rows, cols, heavy in default_sizes(n):
        case = f"{label}: {rows} x {cols}"
        sketch = cp.empty((rows, cols), cp.float32)
        workspace = cp.empty(k.hc_count_sketch_workspace_bytes(n, cols), cp.uint8)
        run.time("hc_count_sketch_f32", case, n, 4 * n + 4 * rows * cols,
                 lambda: k.hc_count_sketch_f32(x, n, 0, 1, rows, cols, sketch, workspace, None))
        run.time("hc_count_sketch_query", case, n, 4 * rows * cols + 4 * n,
                 lambda: k.hc_count_sketch_query(sketch, rows, cols, n, 0, 1, estimate, None))
        m = 25 * heavy if rows == 1 else heavy  # the second round's candidates; FetchSGD's k applied
        indices = cp.asarray(np.sort(run.rng.integers(0, n, m)).astype(np.int64))
        buckets = cp.empty((rows, m), cp.int64)
        run.time("hc_count_sketch_buckets", f"{case}, {m} indices", m, 8 * m + 8 * rows * m,
                 lambda: k.hc_count_sketch_buckets(indices, m, n, 0, 1, rows, cols, buckets, None))
        del workspace, sketch
