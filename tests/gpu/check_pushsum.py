"""PushSumShare's kernel (tf_ops/gpu/pushsum_kernels.cu) against np_reference.push_sum_share, bit for bit: parts of
several sizes (empty ones too), 2 and 3 parts, w = 1 and weights in flight, with and without the values before the
step."""
import numpy as np

import np_reference as ref

SHAPES = [[1], [7, 0, 1000], [ref.KCHUNK + 5, 3, 100_003], [0]]


def share(run, values, weight, parts, before=None):
    """The launcher's share of device arrays `values` (and `before`), weight a host float."""
    cp, k = run.cp, run.k
    sizes = np.array([v.size for v in values], np.int64)
    pointers = np.array([v.data.ptr for v in values], np.uint64)
    before_pointers = None if before is None else np.array([b.data.ptr for b in before], np.uint64)
    out = cp.empty(int(sizes.sum()) + 1, cp.float32)
    k.hc_push_sum_share(pointers, before_pointers, sizes, len(values), cp.asarray(np.float32(weight)), parts, out,
                        None)
    return out


def check(run):
    cp, rng = run.cp, run.rng
    for sizes in SHAPES:
        values = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for n in sizes]
        before = [v + rng.standard_normal(v.size).astype(np.float32) * np.float32(1e-2) for v in values]
        for parts in (2, 3):
            for w in (1.0, 0.6666667, 0.37):
                case = f"sizes={sizes} parts={parts} w={w}"
                got = share(run, [cp.asarray(v) for v in values], w, parts)
                run.expect("hc_push_sum_share", case, got, ref.push_sum_share(values, w, parts))
                got = share(run, [cp.asarray(v) for v in values], w, parts, [cp.asarray(b) for b in before])
                run.expect("hc_push_sum_share", case + " before", got, ref.push_sum_share(values, w, parts, before))


def bench(run, n):
    cp, k = run.cp, run.k
    z = cp.asarray(run.rng.standard_normal(n).astype(np.float32))
    b, out, weight = z * 0.5, cp.empty(n + 1, cp.float32), cp.asarray(np.float32(0.6666667))
    pointers, before = (np.array([a.data.ptr], np.uint64) for a in (z, b))
    sizes = np.array([n], np.int64)
    run.time("hc_push_sum_share", "with the values before the step", n, 12 * n,
             lambda: k.hc_push_sum_share(pointers, before, sizes, 1, weight, 3, out, None))
