"""The 1-bit sign kernels (tf_ops/gpu/sign_kernels.cu) against np_reference's pack, unpack_mean and compress: bit
for bit, for float32, float16 and bfloat16 inputs, sizes around bytes, blocks and chunks, -0 and NaN among the
values."""
import numpy as np

import np_reference as ref
from check_half import bf16_values, to_bf16_bits

#: (n, block_size): a partial byte, one element, blocks smaller than a chunk, blocks across chunks, one block.
CASES = [(1, None), (7, None), (8, None), (13, 4), (1000, 256), (ref.KCHUNK - 3, None), (ref.KCHUNK + 5, 1000),
         (3 * ref.KCHUNK + 17, ref.KCHUNK + 1), (100_003, 256), (200_000, None)]
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": None}


def inputs(rng, n, dtype):
    """(x as the kernel takes it, x as float32): normal values with some -0, +0 and a NaN."""
    x = rng.standard_normal(n).astype(np.float32) * np.float32(rng.uniform(0.01, 10))
    x[rng.integers(0, n, max(1, n // 50))] = -0.0
    x[rng.integers(0, n, max(1, n // 50))] = 0.0
    if n > 100:
        x[n // 3] = np.nan
    if dtype == "bf16":
        bits = to_bf16_bits(x)
        return bits, bf16_values(bits)
    x = x.astype(DTYPES[dtype])
    return x, x.astype(np.float32)


def pack(run, x, bounds, dtype, residual=False):
    """(bits, scales, residual or None) from the GPU."""
    cp, k = run.cp, run.k
    n, blocks = int(bounds[-1]), len(bounds) - 1
    bits, scales = cp.empty((n + 7) // 8, cp.uint8), cp.empty(blocks, cp.float32)
    workspace = cp.empty(k.hc_sign_pack_workspace_bytes(n, blocks), cp.uint8)
    x_device, bounds_device = cp.asarray(x), cp.asarray(bounds)
    if dtype == "f32":
        out = cp.empty_like(x_device) if residual else None
        k.hc_sign_pack_f32(x_device, n, bounds_device, blocks, bits, scales, out, workspace, None)
        return bits, scales, out
    getattr(k, f"hc_sign_pack_{dtype}")(x_device, n, bounds_device, blocks, bits, scales, workspace, None)
    return bits, scales, None


def unpack_mean(run, bits, scales, bounds, n, dtype, plus=None):
    cp = run.cp
    m = bits.shape[0]
    y = cp.empty(n, cp.float32 if dtype == "f32" else (cp.float16 if dtype == "f16" else cp.uint16))
    getattr(run.k, f"hc_sign_unpack_mean_{dtype}")(cp.asarray(bits), cp.asarray(scales), cp.asarray(bounds),
                                                  len(bounds) - 1, n, m, None if plus is None else cp.asarray(plus),
                                                  y, None)
    return y


def check(run):
    rng = run.rng
    for n, block_size in CASES:
        bounds = ref.block_bounds(n, block_size)
        case = f"n={n} block={block_size}"
        for dtype in DTYPES:
            x, values = inputs(rng, n, dtype)
            bits, scales, residual = pack(run, x, bounds, dtype, residual=dtype == "f32")
            want_bits, want_scales = ref.pack(values, bounds)
            run.expect(f"hc_sign_pack_{dtype}", case, bits, want_bits)
            run.expect(f"hc_sign_pack_{dtype}", case + " scales", scales, want_scales)
            if residual is not None:
                run.expect("hc_sign_pack_f32", case + " residual", residual,
                           values - ref.unpack(want_bits, want_scales, bounds))
        for m in (1, 2, 3, 5):
            payloads = [ref.pack(inputs(rng, n, "f32")[1], bounds) for _ in range(m)]
            stacked_bits = np.stack([p[0] for p in payloads])
            stacked_scales = np.stack([p[1] for p in payloads])
            mean = ref.unpack_mean([p[0] for p in payloads], [p[1] for p in payloads], bounds)
            plus = rng.standard_normal(n).astype(np.float32)
            for dtype in DTYPES:
                for with_plus in (False, True):
                    want = mean + plus if with_plus else mean
                    got = unpack_mean(run, stacked_bits, stacked_scales, bounds, n, dtype, plus if with_plus else None)
                    if dtype == "f16":
                        want = want.astype(np.float16)
                    elif dtype == "bf16":  # compared as values: NaN payloads differ between CUDA and Eigen
                        got, want = bf16_values(run.cp.asnumpy(got)), bf16_values(to_bf16_bits(want))
                    run.expect(f"hc_sign_unpack_mean_{dtype}", f"{case} m={m} plus={with_plus}", got, want)
            offset = n // 3
            size = n - offset - n // 5
            variable = rng.standard_normal(size).astype(np.float32)
            got = run.cp.asarray(variable)
            run.k.hc_sign_subtract_mean(run.cp.asarray(stacked_bits), run.cp.asarray(stacked_scales),
                                        run.cp.asarray(bounds), len(bounds) - 1, n, m, offset, size, got, None)
            run.expect("hc_sign_subtract_mean", f"{case} m={m} offset={offset}", got,
                       variable - mean[offset:offset + size])


def bench(run, n):
    cp, k = run.cp, run.k
    for block_size in (None, 256):
        bounds = cp.asarray(ref.block_bounds(n, block_size))
        blocks = len(bounds) - 1
        x = cp.asarray(run.rng.standard_normal(n).astype(np.float32))
        bits, scales = cp.empty((n + 7) // 8, cp.uint8), cp.empty(blocks, cp.float32)
        residual = cp.empty_like(x)
        workspace = cp.empty(k.hc_sign_pack_workspace_bytes(n, blocks), cp.uint8)
        label = f"blocks of {block_size or n}"
        run.time("hc_sign_pack_f32", label, n, 4 * n + n // 8 + 4 * blocks,
                 lambda: k.hc_sign_pack_f32(x, n, bounds, blocks, bits, scales, None, workspace, None))
        run.time("hc_sign_pack_f32", label + ", + residual", n, 8 * n + n // 8 + 4 * blocks,
                 lambda: k.hc_sign_pack_f32(x, n, bounds, blocks, bits, scales, residual, workspace, None))
        m = 4
        many_bits = cp.tile(bits, (m, 1))
        many_scales = cp.tile(scales, (m, 1))
        y = cp.empty(n, cp.float32)
        run.time("hc_sign_unpack_mean_f32", f"{m} payloads, blocks of {block_size or n}", n, 4 * n + m * (n // 8),
                 lambda: k.hc_sign_unpack_mean_f32(many_bits, many_scales, bounds, blocks, n, m, None, y, None))
