"""The blockwise low-bit quantization kernels (tf_ops/gpu/quantize_kernels.cu) against np_reference's
block_quantize_compress and block_quantize_decode_mean, bit for bit (no tolerance: block min and max are exact in
any order, and every other result is per element): packed codes with their zero padding bits, scales, offsets and
the residual (new, in place in x, or none), for bits 2, 4 and 8, rounding to nearest and stochastic (seeds over the
whole int64 range), one block, blocks of 1 to 2**14 + 1 elements, irregular blocks (fused tensors, random cuts),
sizes around bytes, warp spans (2048) and chunks (2**14); -0, +0, repeats, constant blocks, NaN of either sign,
+-Inf, ranges that overflow and subnormal values (the GPU keeps subnormals, as NumPy does; TensorFlow's CPU kernels
flush them); 16-byte aligned and unaligned x, residual, packed, y and plus, and payload rows that start mid-word.
Bench: n = 2**26, bits 2, 4 and 8, blocks of 256 (Compression.quantize's default) and one block, and 4-bit blocks of
4 (the per-block work at its heaviest)."""
import numpy as np

import np_reference as ref

K = ref.KCHUNK
BITS = (2, 4, 8)


def layout_bounds(sizes, block_size=None):
    """hvd_compress.ops.layout_bounds (which needs TensorFlow): blocks of tensors fused in order."""
    starts, offset = [], 0
    for size in sizes:
        if size:
            starts.extend(range(offset, offset + size, size if block_size is None else block_size))
        offset += size
    return np.array(starts + [offset], dtype=np.int64)


def random_bounds(rng, n, blocks):
    cuts = np.sort(rng.choice(np.arange(1, n), blocks - 1, replace=False))
    return np.concatenate([[0], cuts, [n]]).astype(np.int64)


def cases(rng):
    """(name, bounds) of the layouts checked."""
    out = [(f"n={n} block={b}", ref.block_bounds(n, b)) for n, b in [
        (1, None), (3, None), (5, 2), (7, 3), (8, None), (13, 4), (1000, 1), (1000, 256), (2047, None),
        (3 * 2048 + 1, 5), (K - 3, None), (K + 5, 1000), (3 * K + 17, K + 1), (100_003, 256), (200_000, None)]]
    out.append(("layout [150, 3, 0, 97] block=40", layout_bounds([150, 3, 0, 97], 40)))
    out.append((f"layout [{K - 1}, 13, {2 * K + 9}] block=97", layout_bounds([K - 1, 13, 2 * K + 9], 97)))
    out.append(("random cuts n=50000 blocks=3000", random_bounds(rng, 50_000, 3000)))
    out.append(("random cuts n=9000 blocks=8", random_bounds(rng, 9000, 8)))
    return out


def values(rng, bounds):
    """Gaussian values of a random magnitude with zeros, negative zeros and repeats; with 8 blocks or more, block 1
    holds a NaN, 2 a +Inf, 3 a -Inf, 4 is constant, 5 spans -3e38..3e38 (its range overflows), 6 is subnormal and
    7 holds a NaN with its sign bit set."""
    n = int(bounds[-1])
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.05] = -0.0
    if n:
        x[rng.random(n) < 0.05] = x[0]
    if len(bounds) > 8:
        def block(b):
            return slice(int(bounds[b]), int(bounds[b + 1]))
        x[int(rng.integers(bounds[1], bounds[2]))] = np.nan
        x[int(rng.integers(bounds[2], bounds[3]))] = np.inf
        x[int(rng.integers(bounds[3], bounds[4]))] = -np.inf
        x[block(4)] = np.float32(-1.5)
        x[int(bounds[5])] = np.float32(-3e38)
        x[int(bounds[6]) - 1] = np.float32(3e38)
        x[block(6)] = (rng.standard_normal(int(bounds[7] - bounds[6])) * 1e-40).astype(np.float32)
        x[int(rng.integers(bounds[7], bounds[8]))] = np.uint32(0xFFC00000).view(np.float32)
    return x


def device_array(cp, host, aligned):
    """host on the device, 16-byte aligned or 4 bytes past an alignment."""
    if aligned:
        return cp.asarray(host)
    buffer = cp.empty(host.size + 1, host.dtype)
    view = buffer[1:]
    view[...] = cp.asarray(host)
    return view


def compress(run, x, bounds, bits, stochastic, seed, residual, aligned):
    """(packed, scales, offsets, residual or None) from the GPU; residual: 'new', 'in place' or 'none'."""
    cp, k = run.cp, run.k
    n, blocks = int(bounds[-1]), len(bounds) - 1
    x_device = device_array(cp, x, aligned)
    packed = device_array(cp, np.full((n * bits + 7) // 8, 0xA5, np.uint8), aligned)  # the padding must come back 0
    scales, offsets = cp.full(blocks, 7.0, cp.float32), cp.full(blocks, 7.0, cp.float32)
    out = {"new": device_array(cp, np.full(n, 7.0, np.float32), aligned), "in place": x_device, "none": None}[residual]
    workspace = cp.empty(max(1, k.hc_quantize_compress_workspace_bytes(blocks)), cp.uint8)
    k.hc_quantize_compress(x_device, cp.asarray(bounds), blocks, n, bits, int(stochastic), seed[0], seed[1], packed,
                           scales, offsets, out, workspace, None)
    return packed, scales, offsets, out


def decode_mean(run, packed, scales, offsets, bounds, bits, plus, aligned):
    cp = run.cp
    n, blocks, m = int(bounds[-1]), len(bounds) - 1, packed.shape[0]
    y = device_array(cp, np.full(n, 7.0, np.float32), aligned)
    run.k.hc_quantize_decode_mean(cp.asarray(packed), cp.asarray(scales), cp.asarray(offsets), cp.asarray(bounds),
                                  blocks, n, m, bits, None if plus is None else device_array(cp, plus, aligned), y,
                                  None)
    return y


def check(run):
    rng = run.rng
    residuals = ["new", "in place", "none"]
    variant = 0
    for name, bounds in cases(rng):
        n = int(bounds[-1])
        for bits in BITS:
            for stochastic in (False, True):
                variant += 1
                residual, aligned = residuals[variant % 3], variant % 4 != 0
                seed = tuple(int(s) for s in rng.integers(-2**63, 2**63 - 1, 2, dtype=np.int64))
                x = values(rng, bounds)
                case = (f"{name} bits={bits} {'stochastic' if stochastic else 'nearest'} residual={residual}"
                        f"{'' if aligned else ' unaligned'}")
                got = compress(run, x, bounds, bits, stochastic, seed, residual, aligned)
                want = ref.block_quantize_compress(x, bounds, bits, stochastic, seed)
                run.expect("hc_quantize_compress", case, got[0], want[0])
                run.expect("hc_quantize_compress", case + " scales", got[1], want[1])
                run.expect("hc_quantize_compress", case + " offsets", got[2], want[2])
                if got[3] is not None:
                    run.expect("hc_quantize_compress", case + " residual", got[3], want[3])
            for m in (1, 2, 3, 5):
                payloads = [ref.block_quantize_compress(values(rng, bounds), bounds, bits, r % 2 == 1, (r, m))[:3]
                            for r in range(m)]
                packed, scales, offsets = (np.stack([p[j] for p in payloads]) for j in range(3))
                plus = (rng.standard_normal(n) * 3).astype(np.float32)
                for with_plus in (False, True):
                    variant += 1
                    aligned = variant % 3 != 0
                    got = decode_mean(run, packed, scales, offsets, bounds, bits, plus if with_plus else None, aligned)
                    want = ref.block_quantize_decode_mean(packed, scales, offsets, bounds, bits,
                                                          plus if with_plus else None)
                    run.expect("hc_quantize_decode_mean",
                               f"{name} bits={bits} m={m} plus={with_plus}{'' if aligned else ' unaligned'}", got, want)


def bench(run, n):
    cp, k = run.cp, run.k
    x = cp.asarray(run.rng.standard_normal(n).astype(np.float32))
    residual, y = cp.empty_like(x), cp.empty_like(x)
    plus = cp.asarray(run.rng.standard_normal(n).astype(np.float32))
    m = 4
    for block_size in (256, None, 4):
        bounds = ref.block_bounds(n, block_size)
        blocks = len(bounds) - 1
        bounds_device = cp.asarray(bounds)
        workspace = cp.empty(max(1, k.hc_quantize_compress_workspace_bytes(blocks)), cp.uint8)
        scales, offsets = cp.empty(blocks, cp.float32), cp.empty(blocks, cp.float32)
        label = f"blocks of {block_size or n}"
        for bits in BITS if block_size != 4 else (4,):
            num_bytes = (n * bits + 7) // 8
            packed = cp.empty(num_bytes, cp.uint8)
            for stochastic in (False, True):

                def compress_call(bits=bits, stochastic=stochastic, packed=packed, bounds_device=bounds_device,
                                  blocks=blocks, scales=scales, offsets=offsets, workspace=workspace):
                    k.hc_quantize_compress(x, bounds_device, blocks, n, bits, int(stochastic), 1, 2, packed, scales,
                                           offsets, residual, workspace, None)
                run.time("hc_quantize_compress", f"{bits}-bit {'stochastic' if stochastic else 'nearest'}, {label}",
                         n, 8 * n + num_bytes + 8 * blocks, compress_call)
            many_packed = cp.tile(packed, (m, 1))  # holds the last compress's codes
            many_scales, many_offsets = cp.tile(scales, (m, 1)), cp.tile(offsets, (m, 1))
            for with_plus in ((False, True) if block_size == 256 else (False,)):

                def decode_call(bits=bits, many_packed=many_packed, many_scales=many_scales,
                                many_offsets=many_offsets, bounds_device=bounds_device, blocks=blocks,
                                add=plus if with_plus else None):
                    k.hc_quantize_decode_mean(many_packed, many_scales, many_offsets, bounds_device, blocks, n, m,
                                              bits, add, y, None)
                run.time("hc_quantize_decode_mean", f"{bits}-bit, {m} payloads{' + plus' if with_plus else ''}, "
                         f"{label}", n, 4 * n * (2 if with_plus else 1) + m * (num_bytes + 8 * blocks), decode_call)
            del many_packed, many_scales, many_offsets
