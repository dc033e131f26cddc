"""The fp16 kernels (tf_ops/gpu/half_kernels.cu) against NumPy's float16 casts (round to nearest even) and
np_reference.half_mean, bit for bit. bfloat16, which NumPy lacks, travels as its uint16 bits (`to_bf16_bits`)."""
import numpy as np

import np_reference as ref

SIZES = [1, 7, 1000, ref.KCHUNK + 5, 100_003]


def to_bf16_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest even (NaN stays NaN), as Eigen and CUDA round."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_values(bits):
    """bfloat16 bits -> float32 (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def values(rng, n):
    """Normal values at several scales, some beyond float16's range and below its normals, with +-0 and NaN."""
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n)).astype(np.float32)
    x[::97] = -0.0
    if n > 10:
        x[5], x[6], x[7] = np.nan, np.inf, -np.inf
    return x


def check(run):
    cp, k, rng = run.cp, run.k, run.rng
    for n in SIZES:
        case = f"n={n}"
        x = values(rng, n)
        half = cp.empty(n, cp.float16)
        k.hc_half_from_f32(cp.asarray(x), n, half, None)
        run.expect("hc_half_from_f32", case, half, x.astype(np.float16))
        bf = to_bf16_bits(x)
        k.hc_half_from_bf16(cp.asarray(bf), n, half, None)
        run.expect("hc_half_from_bf16", case, half, bf16_values(bf).astype(np.float16))
        h = x.astype(np.float16)
        out = cp.empty(n, cp.float32)
        k.hc_half_to_f32(cp.asarray(h), n, out, None)
        run.expect("hc_half_to_f32", case, out, h.astype(np.float32))
        out16 = cp.empty(n, cp.uint16)
        k.hc_half_to_bf16(cp.asarray(h), n, out16, None)
        run.expect("hc_half_to_bf16", case, bf16_values(cp.asnumpy(out16)),  # as values: NaN payloads differ
                   bf16_values(to_bf16_bits(h.astype(np.float32))))
        for count in (1, 2, 3, 7):
            rows = np.stack([values(rng, n) for _ in range(count)]).astype(np.float16)
            mean = cp.empty(n, cp.float16)
            k.hc_half_mean(cp.asarray(rows), count, n, mean, None)
            run.expect("hc_half_mean", f"{case} rows={count}", mean,
                       ref.half_mean([r.astype(np.float32) for r in rows]).astype(np.float16))


def bench(run, n):
    cp, k = run.cp, run.k
    x = cp.asarray(run.rng.standard_normal(n).astype(np.float32))
    half = cp.empty(n, cp.float16)
    out = cp.empty(n, cp.float32)
    run.time("hc_half_from_f32", "float32 -> float16", n, 6 * n, lambda: k.hc_half_from_f32(x, n, half, None))
    run.time("hc_half_to_f32", "float16 -> float32", n, 6 * n, lambda: k.hc_half_to_f32(half, n, out, None))
    rows = cp.tile(half, (4, 1))
    run.time("hc_half_mean", "4 rows", n, 2 * 4 * n + 2 * n, lambda: k.hc_half_mean(rows, 4, n, half, None))
