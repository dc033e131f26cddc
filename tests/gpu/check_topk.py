"""The top-k and scatter kernels (tf_ops/gpu/topk_kernels.cu) against np_reference, bit for bit (no tolerance):

- hc_top_k_abs_{f32,f16,bf16}: the indices and values of np_reference.top_k_abs (the k largest |x|, ties to the
  lower index, in index order), over lists of parts (empty ones too; parts across the kernel's 4096-element tiles
  and the kChunk grid), on Gaussian values, small integers (ties at the threshold in many tiles), constants,
  mostly zeros (+-0 ties), and NaN / +-Inf / subnormals, for k = 0, 1, 2, 1%, half, n - 1 and n;
- hc_scatter_dense_{f32,f16,bf16}_{i32,i64}: np_reference.scatter_dense (duplicates summed in input order in
  float32, rounded once), with heavy duplicates, -0 and NaN among the values;
- hc_scatter_mean: the values of each index summed in input order in float32 (np.add.at), then / count;
- hc_gather_at, hc_zero_at: over lists of parts; hc_first_out_of_range_{i32,i64}: the first bad position;
- hc_subtract_sparse_mean: a variable's range of a bucket less its sparse mean (value / count at each index).
Out-of-range indices are skipped by the scatters and zero_at (gather_at gives 0 for them): checked too.

float16 NaNs in these checks are quiet: the GPU's key quiets a signalling float16 NaN as the CPU's conversion does
(cores.h HalfAbsKey), while NumPy's keeps it signalling."""
import numpy as np

import np_reference as ref
from check_half import bf16_values, to_bf16_bits

DTYPES = ("f32", "f16", "bf16")
#: Part sizes: one element, odd sizes, around the 4096-element tile and kChunk, several parts with empty ones.
PARTS = [[1], [7], [4095], [4096], [4097], [ref.KCHUNK - 3], [ref.KCHUNK + 5], [100_003], [1, 4096, 0, 9, 70_000],
         [300, ref.KCHUNK + 3, 2], [0, 5000, 0]]
LARGE = [(1 << 20) + 5, (1 << 20) + 4096 * 3 + 2]  # two parts, 2^21 + 12295 elements
KINDS = ("gaussian", "ties", "constant", "zeros", "special")


def stored(x32, dtype):
    """(the array as the kernel takes it, its float32 values)."""
    if dtype == "f32":
        return x32, x32
    if dtype == "f16":
        h = x32.astype(np.float16)
        return h, h.astype(np.float32)
    bits = to_bf16_bits(x32)
    return bits, bf16_values(bits)


def data(rng, n, kind):
    if kind == "gaussian":
        return (rng.standard_normal(n) * rng.uniform(0.01, 100)).astype(np.float32)
    if kind == "ties":
        return rng.integers(-4, 5, n).astype(np.float32)
    if kind == "constant":
        return np.full(n, -1.5, np.float32)
    if kind == "zeros":
        x = np.where(rng.random(n) < 0.1, rng.standard_normal(n), 0.0).astype(np.float32)
        x[rng.random(n) < 0.5 * (x == 0)] = -0.0
        return x
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 5, n)).astype(np.float32)
    x[::97] = -0.0
    x[::89] = 1e-40  # float32 subnormal (0 in float16 and flushed nowhere)
    for position, value in zip((1, 3, 5, 7, n - 1), (np.nan, np.inf, -np.inf, -np.nan, np.inf)):
        if position < n:
            x[position] = value
    return x


def device_parts(cp, arrays):
    """(device arrays, their pointers, their sizes) of a list of parts."""
    parts = [cp.asarray(a) for a in arrays]
    pointers = np.array([p.data.ptr for p in parts], np.uint64)
    sizes = np.array([p.size for p in parts], np.int64)
    return parts, pointers, sizes


def top_k(run, pointers, sizes, k, dtype):
    cp = run.cp
    workspace = cp.empty(max(1, run.k.hc_top_k_abs_workspace_bytes(sizes, len(sizes))), cp.uint8)
    values = cp.empty(k, {"f32": cp.float32, "f16": cp.float16, "bf16": cp.uint16}[dtype])
    indices = cp.empty(k, cp.int32)
    getattr(run.k, f"hc_top_k_abs_{dtype}")(pointers, sizes, len(sizes), k, values, indices, workspace, None)
    return values, indices


def ranking(values32):
    """The order np_reference.top_k_abs takes elements in (its indices for k are np.sort(order[:k]))."""
    return np.lexsort((np.arange(values32.size), -ref.abs_key(values32).astype(np.int64)))


def check_top_k(run, sizes_list, kinds, dtypes, label):
    rng = run.rng
    for sizes in sizes_list:
        n = sum(sizes)
        for kind in kinds:
            x32 = data(rng, n, kind)
            for dtype in dtypes:
                flat, values32 = stored(x32, dtype)
                cuts = np.cumsum([0] + sizes)
                parts, pointers, size_array = device_parts(run.cp, [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:])])
                order = ranking(values32)
                for k in sorted({0, 1, 2, n // 100, n // 2, n - 1, n} & set(range(n + 1))):
                    want_indices = np.sort(order[:k]).astype(np.int32)
                    if n < 5000:
                        assert np.array_equal(want_indices, ref.top_k_abs(values32, k)[1])
                    values, indices = top_k(run, pointers, size_array, k, dtype)
                    case = f"{label} parts={sizes} {kind} k={k}"
                    run.expect(f"hc_top_k_abs_{dtype}", case + " indices", indices, want_indices)
                    run.expect(f"hc_top_k_abs_{dtype}", case + " values", values, flat[want_indices])
                del parts


def scatter_dense(run, indices, values, n, dtype, index_dtype):
    cp = run.cp
    k = indices.size
    workspace = cp.empty(max(1, run.k.hc_scatter_dense_workspace_bytes(k, n)), cp.uint8)
    y = cp.empty(n, {"f32": cp.float32, "f16": cp.float16, "bf16": cp.uint16}[dtype])
    getattr(run.k, f"hc_scatter_dense_{dtype}_{index_dtype}")(cp.asarray(indices), cp.asarray(values), k, n, y,
                                                              workspace, None)
    return y


def check_scatter_dense(run):
    rng = run.rng
    cases = [(0, 0), (1, 1), (1, 50), (9, 0), (1000, 10), (1000, 5000), (ref.KCHUNK + 5, 300), (100_003, 1000),
             (100_003, 300_000), ((1 << 22) + 3, 40_000)]
    for n, k in cases:
        indices = rng.integers(0, max(n, 1), k)
        x32 = rng.standard_normal(k).astype(np.float32)
        x32[::7] = -0.0
        if k > 20:
            x32[13] = np.nan
        for dtype in DTYPES:
            values, values32 = stored(x32, dtype)
            want = ref.scatter_dense(indices, values32, n)
            for index_dtype in ("i32", "i64"):
                got = scatter_dense(run, indices.astype(np.int32 if index_dtype == "i32" else np.int64), values, n,
                                    dtype, index_dtype)
                case = f"n={n} k={k}"
                if dtype == "f32":
                    run.expect(f"hc_scatter_dense_f32_{index_dtype}", case, got, want)
                elif dtype == "f16":
                    run.expect(f"hc_scatter_dense_f16_{index_dtype}", case, got, want.astype(np.float16))
                else:  # as values: NaN payloads differ between CUDA and Eigen
                    run.expect(f"hc_scatter_dense_bf16_{index_dtype}", case, bf16_values(run.cp.asnumpy(got)),
                               bf16_values(to_bf16_bits(want)))
    # Out-of-range indices are skipped (the op rejects them before; here they must not write anywhere).
    n = 1000
    indices = np.array([5, -1, 999, 1000, 5, 2**31 - 1, -2**31], np.int64)
    values = np.arange(1, 8, dtype=np.float32)
    keep = (indices >= 0) & (indices < n)
    want = ref.scatter_dense(indices[keep], values[keep], n)
    for index_dtype in ("i32", "i64"):
        got = scatter_dense(run, indices.astype(np.int32 if index_dtype == "i32" else np.int64), values, n, "f32",
                            index_dtype)
        run.expect(f"hc_scatter_dense_f32_{index_dtype}", "out-of-range indices skipped", got, want)


def check_parts_ops(run):
    cp, k_, rng = run.cp, run.k, run.rng
    for sizes in ([1], [9, 300], [ref.KCHUNK + 3, 0, 70_000], [1, 2, 9], [0, 4097]):
        n = sum(sizes)
        cuts = np.cumsum([0] + sizes)
        flat = rng.standard_normal(n).astype(np.float32)
        flat[::11] = -0.0
        for ranks in (1, 2, 4):
            k = max(1, n // 10)
            pairs = [ref.top_k_abs(flat + rng.standard_normal(n).astype(np.float32), k) for _ in range(ranks)]
            indices = np.concatenate([i for _, i in pairs]).astype(np.int32)
            values = np.concatenate([v for v, _ in pairs]).astype(np.float32)
            for name, (idx, vals) in {"top-k pairs": (indices, values),
                                      "random duplicates": (rng.integers(0, n, 3 * n).astype(np.int32),
                                                            rng.standard_normal(3 * n).astype(np.float32))}.items():
                outs, pointers, size_array = device_parts(cp, [np.full(s, np.nan, np.float32) for s in sizes])
                workspace = cp.empty(k_.hc_scatter_mean_workspace_bytes(idx.size, size_array, len(sizes)), cp.uint8)
                k_.hc_scatter_mean(cp.asarray(idx), cp.asarray(vals), idx.size, pointers, size_array, len(sizes),
                                   ranks, workspace, None)
                total = np.zeros(n, np.float32)
                np.add.at(total, idx, vals)  # in input order, as the CPU kernel adds
                got = np.concatenate([cp.asnumpy(o) for o in outs])
                run.expect("hc_scatter_mean", f"parts={sizes} count={ranks} {name}", got, total / np.float32(ranks))
        # gather_at and zero_at, with duplicates
        idx = np.concatenate([rng.integers(0, n, 2 * n), [0, n - 1]]).astype(np.int32)
        parts, pointers, size_array = device_parts(cp, [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:])])
        workspace = cp.empty(k_.hc_parts_workspace_bytes(len(sizes)), cp.uint8)
        got = cp.empty(idx.size, cp.float32)
        k_.hc_gather_at(pointers, size_array, len(sizes), cp.asarray(idx), idx.size, got, workspace, None)
        run.expect("hc_gather_at", f"parts={sizes}", got, flat[idx])
        k_.hc_zero_at(pointers, size_array, len(sizes), cp.asarray(idx[: n // 3 + 1]), n // 3 + 1, workspace, None)
        want = flat.copy()
        want[idx[: n // 3 + 1]] = 0.0
        run.expect("hc_zero_at", f"parts={sizes}", np.concatenate([cp.asnumpy(p) for p in parts]), want)
    # Out-of-range indices: gather gives 0, zero_at and scatter_mean skip them; the first one is found.
    sizes = [5, 6]
    flat = np.arange(1, 12, dtype=np.float32)
    parts, pointers, size_array = device_parts(cp, [flat[:5], flat[5:]])
    bad = np.array([3, 11, -1, 10, 2**31 - 1, 0], np.int32)
    workspace = cp.empty(k_.hc_parts_workspace_bytes(2), cp.uint8)
    got = cp.empty(bad.size, cp.float32)
    k_.hc_gather_at(pointers, size_array, 2, cp.asarray(bad), bad.size, got, workspace, None)
    run.expect("hc_gather_at", "out-of-range indices give 0", got, np.array([4, 0, 0, 11, 0, 1], np.float32))
    k_.hc_zero_at(pointers, size_array, 2, cp.asarray(bad), bad.size, workspace, None)
    want = flat.copy()
    want[[3, 10, 0]] = 0
    run.expect("hc_zero_at", "out-of-range indices skipped", np.concatenate([cp.asnumpy(p) for p in parts]), want)
    outs, pointers, size_array = device_parts(cp, [np.full(5, np.nan, np.float32), np.full(6, np.nan, np.float32)])
    workspace = cp.empty(k_.hc_scatter_mean_workspace_bytes(bad.size, size_array, 2), cp.uint8)
    k_.hc_scatter_mean(cp.asarray(bad), cp.asarray(np.arange(6, dtype=np.float32) + 1), bad.size, pointers,
                       size_array, 2, 2, workspace, None)
    want = np.zeros(11, np.float32)
    want[[3, 10, 0]] = np.array([1, 4, 6], np.float32) / np.float32(2)
    run.expect("hc_scatter_mean", "out-of-range indices skipped", np.concatenate([cp.asnumpy(o) for o in outs]),
               want)
    first = cp.empty(1, cp.int64)
    for index_dtype, dt in (("i32", np.int32), ("i64", np.int64)):
        for idx, n, want_first in ((bad, 11, 1), (bad, 2**31, 2), (np.arange(7), 7, 7), (np.zeros(0), 3, 0),
                                   (np.array([0, 1, 2, 3]), 3, 3)):
            getattr(k_, f"hc_first_out_of_range_{index_dtype}")(cp.asarray(np.asarray(idx).astype(dt)), len(idx), n,
                                                                first, None)
            run.expect(f"hc_first_out_of_range_{index_dtype}", f"k={len(idx)} n={n}", first,
                       np.array([want_first], np.int64))


def check_subtract_sparse_mean(run):
    """hc_subtract_sparse_mean: a variable holding elements [offset, offset + size) of a bucket, less values / count
    at the increasing, distinct bucket indices in that range (the others skipped), as the CPU kernel."""
    cp, k_, rng = run.cp, run.k, run.rng
    for n, m, count in ((1, 1, 1), (100, 0, 2), (5000, 700, 4), (100_003, 30_000, 3), ((1 << 22) + 3, 1 << 19, 2)):
        indices = np.sort(rng.choice(n, m, replace=False)).astype(np.int32)
        values = rng.standard_normal(m).astype(np.float32)
        values[::11] = -0.0
        for offset, size in ((0, n), (n // 3, n - n // 3), (0, max(1, n // 2))):
            x0 = rng.standard_normal(size).astype(np.float32)
            x = cp.asarray(x0)
            k_.hc_subtract_sparse_mean(x, size, cp.asarray(indices), cp.asarray(values), m, offset, count, None)
            want = x0.copy()
            inside = (indices >= offset) & (indices < offset + size)
            want[indices[inside] - offset] -= values[inside] / np.float32(count)
            run.expect("hc_subtract_sparse_mean", f"n={n} m={m} offset={offset} count={count}", x, want)


def check(run):
    check_top_k(run, PARTS, KINDS, DTYPES, "")
    check_top_k(run, [LARGE], ("gaussian", "ties", "special"), DTYPES, "large")
    check_scatter_dense(run)
    check_parts_ops(run)
    check_subtract_sparse_mean(run)


def bench(run, n):
    cp, k_ = run.cp, run.k
    k = n // 100
    rng = run.rng
    x32 = rng.standard_normal(n).astype(np.float32)
    sizes = np.array([n], np.int64)
    workspace = cp.empty(k_.hc_top_k_abs_workspace_bytes(sizes, 1), cp.uint8)
    indices = cp.empty(k, cp.int32)
    for dtype, case in (("f32", "Gaussian"), ("f32", "rounded to 1/64 (ties)"), ("bf16", "Gaussian"),
                        ("f16", "Gaussian")):
        host, _ = stored(np.round(x32 * 64) / np.float32(64) if "ties" in case else x32, dtype)
        x = cp.asarray(host)
        pointers = np.array([x.data.ptr], np.uint64)
        values = cp.empty(k, x.dtype)
        launcher = getattr(k_, f"hc_top_k_abs_{dtype}")
        run.time(f"hc_top_k_abs_{dtype}", f"k = 1%, {case}", n, x.nbytes + k * (x.itemsize + 4),
                 lambda: launcher(pointers, sizes, 1, k, values, indices, workspace, None))
        del x
    # The scatters, from one rank's top-k pairs (sorted unique indices) or four ranks'.
    x = cp.asarray(x32)
    values = cp.empty(k, cp.float32)
    launcher_top = k_.hc_top_k_abs_f32
    launcher_top(np.array([x.data.ptr], np.uint64), sizes, 1, k, values, indices, workspace, None)
    y = cp.empty(n, cp.float32)
    dense_ws = cp.empty(k_.hc_scatter_dense_workspace_bytes(k, n), cp.uint8)
    run.time("hc_scatter_dense_f32_i32", "k = 1%, unique indices", n, 8 * k + 4 * n,
             lambda: k_.hc_scatter_dense_f32_i32(indices, values, k, n, y, dense_ws, None))
    ranks = 4
    many_indices = cp.concatenate([cp.sort(cp.asarray(rng.choice(n, k, replace=False).astype(np.int32)))
                                   for _ in range(ranks)])
    many_values = cp.tile(values, ranks)
    pointers = np.array([y.data.ptr], np.uint64)
    mean_ws = cp.empty(k_.hc_scatter_mean_workspace_bytes(ranks * k, sizes, 1), cp.uint8)
    run.time("hc_scatter_mean", f"{ranks} ranks x k = 1%", n, 8 * ranks * k + 4 * n,
             lambda: k_.hc_scatter_mean(many_indices, many_values, ranks * k, pointers, sizes, 1, ranks, mean_ws,
                                        None))
    parts_ws = cp.empty(k_.hc_parts_workspace_bytes(1), cp.uint8)
    x_pointers = np.array([x.data.ptr], np.uint64)
    run.time("hc_gather_at", "k = 1%", n, 12 * k,
             lambda: k_.hc_gather_at(x_pointers, sizes, 1, indices, k, values, parts_ws, None))
    run.time("hc_zero_at", "k = 1%", n, 8 * k,
             lambda: k_.hc_zero_at(x_pointers, sizes, 1, indices, k, parts_ws, None))
    first = cp.empty(1, cp.int64)
    run.time("hc_first_out_of_range_i32", "k = 1%", n, 4 * k,
             lambda: k_.hc_first_out_of_range_i32(indices, k, n, first, None))
