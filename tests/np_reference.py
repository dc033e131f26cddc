"""NumPy re-implementations of the compiled ops, written for clarity, not speed.

They follow the kernels' fixed summation order (tf_ops/blocks.h), so results
match bit for bit: |x| is summed in float64 over pieces of a block cut by a
global grid of KCHUNK elements, each piece with 8 interleaved lanes.
"""
import numpy as np

KCHUNK = 1 << 14  # must equal kChunk in tf_ops/blocks.h


def block_bounds(n, block_size=None):
    if n == 0:
        return np.zeros(1, np.int64)
    step = n if block_size is None else block_size
    return np.append(np.arange(0, n, step), n).astype(np.int64)


def _lane_abs_sum(piece):
    a = np.abs(piece.astype(np.float64))
    a = np.concatenate([a, np.zeros((-len(a)) % 8)]).reshape(-1, 8)
    lanes = np.add.accumulate(a, axis=0)[-1]  # sequential per lane
    return np.add.accumulate(lanes)[-1]  # lanes added in order


def pack(x, bounds):
    """(bits, scales) of block_sign_pack."""
    xf = np.asarray(x).reshape(-1).astype(np.float32)
    bits = np.packbits(xf < 0, bitorder="little")
    scales = np.empty(len(bounds) - 1, np.float32)
    for b in range(len(bounds) - 1):
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        total = 0.0
        for chunk in range(lo // KCHUNK, (hi - 1) // KCHUNK + 1):
            total += _lane_abs_sum(xf[max(lo, chunk * KCHUNK):min(hi, (chunk + 1) * KCHUNK)])
        scales[b] = np.float32(total / (hi - lo))
    return bits, scales


def unpack(bits, scales, bounds):
    """float32 decoding of one payload."""
    n = int(bounds[-1])
    negative = np.unpackbits(np.asarray(bits, np.uint8), bitorder="little")[:n].astype(bool)
    per_element = np.repeat(np.asarray(scales, np.float32), np.diff(bounds))
    return np.where(negative, -per_element, per_element).astype(np.float32)


def unpack_mean(bits_list, scales_list, bounds):
    """Mean of several payloads: float32 sum in order, then / m."""
    acc = np.zeros(int(bounds[-1]), np.float32)
    for bits, scales in zip(bits_list, scales_list):
        acc += unpack(bits, scales, bounds)
    return acc / np.float32(len(bits_list))


def abs_key(x):
    """Order-preserving key of |x| (NaN above Inf), as AbsKey in tf_ops/blocks.h."""
    return np.asarray(x).reshape(-1).astype(np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)


def top_k_abs(x, k):
    """(values, indices) of the k largest |x|, ties to the lower index, by index."""
    flat = np.asarray(x).reshape(-1)
    order = np.lexsort((np.arange(flat.size), -abs_key(flat).astype(np.int64)))
    indices = np.sort(order[:k]).astype(np.int32)
    return flat[indices], indices


def scatter_dense(indices, values, n, dtype=np.float32):
    acc = np.zeros(n, np.float32)
    np.add.at(acc, np.asarray(indices).reshape(-1), np.asarray(values).reshape(-1).astype(np.float32))
    return acc.astype(dtype)


def shard_cuts(d, n):
    shard = -(-d // (n * 8)) * 8
    return np.array([min(j * shard, d) for j in range(n + 1)], np.int64)


def half_mean(values):
    """Compression.fp16's mean in hc.DistributedOptimizer (ops.half_mean over half_pack'ed rows):
    each rank's values rounded to float16, summed in float32 in rank order, divided by their count
    in float32, rounded to float16 once; returned as float32."""
    total = values[0].astype(np.float16).astype(np.float32)
    for v in values[1:]:
        total = total + v.astype(np.float16).astype(np.float32)
    return (total / np.float32(len(values))).astype(np.float16).astype(np.float32)


def keras_sgd(x, m, g, lr, mu, nesterov):
    """tf_keras SGD's update_step (float32), in place on x and m."""
    g = g.astype(np.float32)
    m[:] = -g * np.float32(lr) + m * np.float32(mu)
    x += (-g * np.float32(lr) + m * np.float32(mu)) if nesterov else m


def compress(a, bounds):
    bits, scales = pack(a, bounds)
    return (bits, scales), unpack(bits, scales, bounds)


def residual_scale(lr, previous_lr):
    """What dist-EF-SGD's and sketched SGD's learning-rate-scaled residuals are multiplied by at a
    step: lr / the previous step's lr (float32), 1 at the first step."""
    return np.float32(lr) / previous_lr if previous_lr > 0 else np.float32(1)


class OneBitExchange:
    """The onebit exchange (shared/DESIGN.md) of n simulated workers' vectors of d elements: each sends
    C(a_i), e_i = a_i - C(a_i); two-way: shard j's owner compresses mean_i C(a_i) + s e_s again."""

    def __init__(self, d, n, block_size=None, two_way=True):
        self.n, self.two_way = n, two_way
        self.bounds = block_bounds(d, block_size)
        if two_way:
            self.cuts = shard_cuts(d, n)
            self.bounds = np.union1d(self.bounds, self.cuts)
        self.e = [np.zeros(d, np.float32) for _ in range(n)]
        self.e_server = np.zeros(d, np.float32)

    def __call__(self, fed, scale=np.float32(1)):
        """fed: the a_i, each with its worker's residual e_i in it -> D (scale: the server residual's)."""
        payloads = []
        for i, a in enumerate(fed):
            payload, sent = compress(a, self.bounds)
            self.e[i] = a - sent
            payloads.append(payload)
        if not self.two_way:
            return unpack_mean([p[0] for p in payloads], [p[1] for p in payloads], self.bounds)
        update = np.empty_like(self.e_server)
        for j in range(self.n):
            lo, hi = self.cuts[j], self.cuts[j + 1]
            if lo == hi:
                continue
            first, last = np.searchsorted(self.bounds, lo), np.searchsorted(self.bounds, hi)
            local = self.bounds[first:last + 1] - lo
            shard_bits = [np.unpackbits(b, bitorder="little")[lo:hi] for b, _ in payloads]
            averaged = unpack_mean([np.packbits(b, bitorder="little") for b in shard_bits],
                                   [s[first:last] for _, s in payloads], local)
            server_input = averaged + scale * self.e_server[lo:hi]
            _, server_sent = compress(server_input, local)
            self.e_server[lo:hi] = server_input - server_sent
            update[lo:hi] = server_sent
        return update


    def error_fed_mean(self, values, scale=np.float32(1)):
        """D of the workers' values, each with its residual (times scale) added."""
        return self([v + scale * e for v, e in zip(values, self.e)], scale)


def host_means(values, hosts, local):
    """Each host's mean of its ranks' values (ranks numbered host by host), added in local-rank order in
    float32 and multiplied by float32(1 / local)."""
    return [np.add.accumulate(np.asarray(values[h * local:(h + 1) * local], np.float32), axis=0)[-1]
            * np.float32(1 / local) for h in range(hosts)]


class HierarchicalOneBit:
    """The hierarchical onebit exchange (exchange.Hierarchical) of `hosts` hosts of `local` simulated ranks
    (numbered host by host): each host's mean of its ranks' values; local rank l exchanges shard l of it,
    with its host's residual, through the flat onebit exchange among the hosts. One host: the host's mean."""

    def __init__(self, d, hosts, local, block_size=None, two_way=True):
        self.hosts, self.local = hosts, local
        cuts = shard_cuts(d, local)
        self.shards = [(int(cuts[l]), int(cuts[l + 1])) for l in range(local)]
        self.exchanges = [OneBitExchange(hi - lo, hosts, block_size, two_way) for lo, hi in self.shards]

    def error_fed_mean(self, values, scale=np.float32(1)):
        means = host_means(values, self.hosts, self.local)
        update = np.zeros_like(means[0])
        for (lo, hi), ex in zip(self.shards, self.exchanges):
            if lo < hi:
                update[lo:hi] = (means[0][lo:hi] if self.hosts == 1 else
                                 ex.error_fed_mean([m[lo:hi] for m in means], scale))
        return update


class DistEFSGD:
    """dist-EF-SGD (shared/DESIGN.md) for n simulated workers on one flat tensor of d elements."""

    def __init__(self, d, n, mu, nesterov, block_size=None, two_way=True):
        self.n, self.mu, self.nesterov = n, np.float32(mu), nesterov
        self.exchange = OneBitExchange(d, n, block_size, two_way)
        self.m = [np.zeros(d, np.float32) for _ in range(n)]
        self.previous_lr = np.float32(0)

    def step(self, x, grads, lr, compressed=True):
        """compressed=False: Accordion's uncompressed setting, x -= mean_i(a_i), e_i = 0, e_s kept.
        The residuals follow a learning-rate change: scaled by lr / the previous step's lr."""
        scale = residual_scale(lr, self.previous_lr)
        self.previous_lr = np.float32(lr)
        fed = []
        for i, g in enumerate(grads):
            self.m[i] = self.mu * self.m[i] + g
            p = self.mu * self.m[i] + g if self.nesterov else self.m[i]
            fed.append(np.float32(lr) * p + scale * self.exchange.e[i])
        if compressed:
            x -= self.exchange(fed, scale)
            return
        self.exchange.e = [np.zeros_like(a) for a in fed]
        x -= np.add.reduce(fed) / np.float32(self.n)


class TopKExchange:
    """Top-k with error feedback on gradients for n simulated workers (Compression.topk, flat): each sends its
    k largest |a_i|, e_i = a_i - sent; the mean is the rank-ordered sum over n."""

    def __init__(self, d, n, k):
        self.n, self.k = n, k
        self.e = [np.zeros(d, np.float32) for _ in range(n)]

    def error_fed_mean(self, values):
        total = np.zeros_like(self.e[0])
        for i, g in enumerate(values):
            a = g + self.e[i]
            kept, indices = top_k_abs(a, self.k)
            sent = scatter_dense(indices, kept, a.size)
            self.e[i] = a - sent
            total += sent
        return total / np.float32(self.n)


class OneBitAdam:
    """1-bit Adam (hvd_compress/adam.py) for n simulated workers on one flat float32 tensor: Keras's
    Adam on the mean gradient for warmup_steps steps, then the momentum over d = sqrt(v) + eps, clipped at
    k B = max(1, (1 - b1) / sqrt(1 - b2)) (1 - b1^t) / sqrt(1 - b2^T_w), exchanged by onebit with the variance frozen, and the step clipped at lr. AdamW: weight_decay > 0 (x -= x (wd lr) first, the order TensorFlow
    computes Keras's x - x * wd * lr in); amsgrad: the largest v so far divides."""

    def __init__(self, d, n, warmup_steps, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=0.0,
                 block_size=None, two_way=True, amsgrad=False, hosts=None, exchange=None):
        """hosts: (H, L), the n = H L workers on H hosts of L, exchanging hierarchically (HierarchicalOneBit);
        exchange: another exchange of the compressed steps (error_fed_mean)."""
        self.n, self.warmup_steps, self.amsgrad = n, warmup_steps, amsgrad
        self.b1, self.b2, self.eps, self.wd = (np.float32(v) for v in (beta_1, beta_2, epsilon, weight_decay))
        self.k = np.float32(max(1.0, (1.0 - beta_1) / np.sqrt(1.0 - beta_2)))  # Adam's largest step over lr
        # 1 - beta in Python's float64, then float32: as Keras computes them
        self.keep_1, self.keep_2 = np.float32(1 - beta_1), np.float32(1 - beta_2)
        self.exchange = exchange or (HierarchicalOneBit(d, *hosts, block_size, two_way) if hosts else
                                     OneBitExchange(d, n, block_size, two_way))
        self.m, self.v, self.v_hat = np.zeros(d, np.float32), np.zeros(d, np.float32), np.zeros(d, np.float32)
        self.t = 0

    def step(self, x, grads, lr):
        lr, one = np.float32(lr), np.float32(1)
        self.t += 1
        if self.wd:
            x -= x * (self.wd * lr)
        variance_step = np.float32(min(self.t, self.warmup_steps))
        alpha = lr * np.sqrt(one - self.b2 ** variance_step) / (one - self.b1 ** np.float32(self.t))
        if self.t <= self.warmup_steps:
            g = np.add.accumulate(np.asarray(grads, np.float32), axis=0)[-1] * np.float32(1 / self.n)  # in rank order
            self.m += (g - self.m) * self.keep_1
            self.v += (np.square(g) - self.v) * self.keep_2
            self.v_hat = np.maximum(self.v_hat, self.v)
            x -= (self.m * np.float32(alpha)) / self.preconditioner()
            return
        bound = self.k * ((one - self.b1 ** np.float32(self.t)) / np.sqrt(one - self.b2 ** variance_step))  # k B
        x -= np.clip(self.compressed_step(grads, np.float32(alpha), np.float32(bound)), -lr, lr)

    def compressed_step(self, grads, alpha, bound):
        """The step before its clip at lr; bound: k B (B: where the bias-corrected m / d is 1)."""
        d = self.preconditioner()
        mean = self.exchange.error_fed_mean([np.clip((self.m + (g - self.m) * self.keep_1) / d, -bound, bound)
                                             for g in grads])
        self.m = mean * d
        return mean * alpha

    def preconditioner(self):
        return np.sqrt(self.v_hat if self.amsgrad else self.v) + self.eps


class FrozenVarianceAdam(OneBitAdam):
    """Adam with its variance frozen after the warm-up (hvd_compress/adam.py), for a compressor with error
    feedback on gradients (`exchange`): m follows the exchanged mean gradient, v stays."""

    def compressed_step(self, grads, alpha, bound):
        self.m += (self.exchange.error_fed_mean(grads) - self.m) * self.keep_1
        return (self.m * alpha) / self.preconditioner()


def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


REGION_COLS = 1 << 12  # kRegionCols in tf_ops/sketch_hash.h


def sketch_hash(seed, row, n, cols, step=0):
    """(buckets, signs) of coordinates 0..n-1 in one row, as SketchHash in tf_ops/sketch_hash.h: a row
    of more than REGION_COLS columns is cut into S regions and the coordinates into S segments of
    L = ceil(n / S), segment s hashed into region s; coordinate i's h = keyed_hash32(the row's key, i) gives its
    column in the region, ((h >> 12) width) >> 20, and its sign, -1 where h is odd."""
    with np.errstate(over="ignore"):
        seed = np.array([seed], np.int64).astype(np.uint64) + np.uint64(step) * np.uint64(0x632BE59BD9B4E019)
        key = _mix64(seed * np.uint64(0x9E3779B97F4A7C15)
                     + np.array([row + 1], np.uint64) * np.uint64(0xD1B54A32D192ED03))
    h = keyed_hash32(int(key[0]), np.arange(n))
    regions = -(-cols // REGION_COLS)
    segment = np.arange(n, dtype=np.int64) // max(1, -(-n // regions))
    first = segment * cols // regions
    width = (segment + 1) * cols // regions - first  # at most REGION_COLS = 2^12: the product fits in 32 bits
    buckets = first + (((h >> np.uint32(12)) * width.astype(np.uint32)) >> np.uint32(20)).astype(np.int64)
    signs = np.where(h & np.uint32(1), np.float32(-1), np.float32(1))
    return buckets, signs


def count_sketch(x, rows, cols, seed=0, step=0):
    flat = np.asarray(x).reshape(-1).astype(np.float32)
    sketch = np.zeros((rows, cols), np.float32)
    for j in range(rows):
        buckets, signs = sketch_hash(seed, j, flat.size, cols, step)
        np.add.at(sketch[j], buckets, signs * flat)  # in increasing i, like the kernel
    return sketch


def count_sketch_query(sketch, n, seed=0, step=0):
    rows, cols = sketch.shape
    values = np.empty((rows, n), np.float32)
    for j in range(rows):
        buckets, signs = sketch_hash(seed, j, n, cols, step)
        values[j] = signs * sketch[j, buckets]
    values.sort(axis=0)  # NaN last, as in the kernel
    if rows % 2:
        return values[rows // 2]
    return (values[rows // 2 - 1] + values[rows // 2]) / np.float32(2)


class SketchedSGD:
    """Sketched SGD (hvd_compress/sketch.py) for ONE worker: what n workers must equal when this one
    is given the mean of their gradients (the concatenated batch), because sketches are linear."""

    def __init__(self, d, k, rows, cols, candidates, seed, mu, nesterov, second_round=True, apply_candidates=True,
                 mask_momentum=True):
        self.d, self.k, self.rows, self.cols, self.seed = d, k, rows, cols, seed
        self.candidates, self.second_round, self.apply_candidates = candidates, second_round, apply_candidates
        self.mask_momentum = mask_momentum
        self.mu, self.nesterov = np.float32(mu), nesterov
        self.u = np.zeros(d, np.float32)
        self.e = np.zeros(d, np.float32)
        self.t = 0  # the step: hashes are drawn anew every step
        self.previous_lr = np.float32(0)

    def step(self, x, g, lr):
        scale = residual_scale(lr, self.previous_lr)
        self.previous_lr = np.float32(lr)
        self.u = self.mu * self.u + g
        p = self.mu * self.u + g if self.nesterov else self.u
        a = np.float32(lr) * p + scale * self.e
        sketch = count_sketch(a, self.rows, self.cols, self.seed, self.t)
        estimate = count_sketch_query(sketch, self.d, self.seed, self.t)
        self.t += 1
        if self.second_round:  # every candidate at its exact sum, or the exact top-k among them
            _, idx = top_k_abs(estimate, self.candidates)
            if not self.apply_candidates:
                idx = idx[top_k_abs(a[idx], self.k)[1]]
            values = a[idx]
        else:  # the sketch's own top-k, at its estimates
            _, idx = top_k_abs(estimate, self.k)
            values = estimate[idx]
        x[idx] -= values
        self.e = a.copy()
        self.e[idx] = 0
        if self.mask_momentum:
            self.u[idx] = 0
        return idx



class FetchSGD:
    """FetchSGD (hvd_compress/sketch.py, mode="fetchsgd") on the mean gradient: what n workers must
    equal, since the mean of their sketches is the sketch of their mean gradient. Momentum and error
    are sketches; the applied coordinates' cells are zeroed in both; the hashes are fixed."""

    def __init__(self, d, k, rows, cols, seed, mu, nesterov):
        self.d, self.k, self.rows, self.cols, self.seed = d, k, rows, cols, seed
        self.mu, self.nesterov = np.float32(mu), nesterov
        self.u = np.zeros((rows, cols), np.float32)
        self.e = np.zeros((rows, cols), np.float32)

    def step(self, x, g, lr):
        sketch = count_sketch(g, self.rows, self.cols, self.seed)
        self.u = self.mu * self.u + sketch
        p = self.mu * self.u + sketch if self.nesterov else self.u
        self.e = self.e + np.float32(lr) * p
        values, idx = top_k_abs(count_sketch_query(self.e, self.d, self.seed), self.k)
        x[idx] -= values
        for j in range(self.rows):
            cells = sketch_hash(self.seed, j, self.d, self.cols)[0][idx]
            self.u[j, cells] = 0
            self.e[j, cells] = 0
        return idx

# Blockwise low-bit quantizer (hvd_compress/quantize_ops.py; format in tf_ops/quantize_ops.cc).
QUANTIZE_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix32(x):
    """lowbias32 of uint32 x (wrapping), as Mix32 in tf_ops/cores.h."""
    x = (x ^ (x >> np.uint32(16))) * np.uint32(0x7FEB352D)
    x = (x ^ (x >> np.uint32(15))) * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def keyed_hash32(key, index):
    """uint32: the hashes of the indices `index` (an int array) under the 64-bit key K,
    mix32(mix32(lo32(i) ^ lo32(K)) ^ hi32(K) ^ hi32(i)), as KeyedHash32 in tf_ops/cores.h (the count sketch's cells)."""
    index = np.asarray(index).astype(np.uint64)
    with np.errstate(over="ignore"):
        low = (index & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ np.uint32(key & 0xFFFFFFFF)
        high = (index >> np.uint64(32)).astype(np.uint32) ^ np.uint32(key >> 32)
        return _mix32(_mix32(low) ^ high)


def quantize_hash32(key, index):
    """uint32: the quantizer's draws' hashes of the indices `index` under the 64-bit key K,
    mix32(lo32(j) ^ lo32(K)) ^ hi32(K) ^ hi32(j), as QuantizeHash32 in tf_ops/cores.h (one round)."""
    index = np.asarray(index).astype(np.uint64)
    with np.errstate(over="ignore"):
        low = (index & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ np.uint32(key & 0xFFFFFFFF)
        high = (index >> np.uint64(32)).astype(np.uint32) ^ np.uint32(key >> 32)
        return _mix32(low) ^ high


def quantize_uniforms(seed, n):
    """float32[n]: the stochastic draws u_i in [0, 1) of elements 0..n-1 for seed = (key, counter):
    K = splitmix64(key * 0x9E3779B97F4A7C15 ^ counter * 0xC2B2AE3D27D4EB4F); two elements share a hash, 16 bits
    each: h = quantize_hash32(K, 8 floor(i / 16) + i mod 8), u_i = (h >> 16 where i mod 16 < 8, else h & 0xFFFF) * 2^-16."""
    key, counter = np.asarray(seed, np.int64).reshape(2).view(np.uint64)
    with np.errstate(over="ignore"):
        base = np.array([key], np.uint64) * QUANTIZE_GOLDEN ^ np.array([counter], np.uint64) * np.uint64(
            0xC2B2AE3D27D4EB4F)
        k = _mix64(base + QUANTIZE_GOLDEN)[0]
    i = np.arange(n, dtype=np.int64)
    h = quantize_hash32(int(k), (i >> 4 << 3) | (i & 7))
    half = np.where((i & 8) == 0, h >> np.uint32(16), h & np.uint32(0xFFFF))
    return half.astype(np.float32) * np.float32(2.0**-16)


def quantize_params(x, bounds, bits):
    """(offsets, scales, invs) float32[B] of the blocks of float32 x."""
    levels = np.float32(2**bits - 1)
    num_blocks = len(bounds) - 1
    offsets, scales, invs = (np.empty(num_blocks, np.float32) for _ in range(3))
    for b in range(num_blocks):
        block = x[bounds[b]:bounds[b + 1]]
        with np.errstate(invalid="ignore", over="ignore"):
            lo, hi = np.min(block) + np.float32(0), np.max(block) + np.float32(0)  # -0 -> +0
            span = hi - lo
        if not np.all(np.isfinite(block)) or not np.isfinite(span):
            offsets[b], scales[b], invs[b] = np.nan, np.nan, 0
        else:
            offsets[b], scales[b] = lo, span / levels
            invs[b] = levels / span if span > 0 else np.float32(0)
    return offsets, scales, invs


def pack_codes(q, bits):
    """uint8[ceil(n*bits/8)]: code i at bits [i*bits, (i+1)*bits), LSB first, padding bits 0."""
    per_byte = 8 // bits
    q = np.concatenate([np.asarray(q, np.uint8), np.zeros((-len(q)) % per_byte, np.uint8)]).reshape(-1, per_byte)
    shifts = np.arange(per_byte, dtype=np.uint8) * np.uint8(bits)
    return np.bitwise_or.reduce(q << shifts, axis=1).astype(np.uint8)


def unpack_codes(packed, n, bits):
    """uint8[n]: the codes of pack_codes."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * np.uint8(bits)
    q = (np.asarray(packed, np.uint8)[:, None] >> shifts) & np.uint8(2**bits - 1)
    return q.reshape(-1)[:n]


def block_quantize_decode(packed, scales, offsets, bounds, bits):
    """float32[n]: offset + float32(q) * scale, per element of its block (two float32 roundings)."""
    n = int(bounds[-1])
    q = unpack_codes(packed, n, bits).astype(np.float32)
    counts = np.diff(bounds)
    return np.repeat(np.asarray(offsets, np.float32), counts) + q * np.repeat(np.asarray(scales, np.float32), counts)


def block_quantize_compress(x, bounds, bits, stochastic=False, seed=(0, 0)):
    """(packed, scales, offsets, residual) of ops block_quantize_compress."""
    x = np.asarray(x, np.float32).reshape(-1)
    bounds = np.asarray(bounds, np.int64)
    offsets, scales, invs = quantize_params(x, bounds, bits)
    counts = np.diff(bounds)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (x - np.repeat(offsets, counts)) * np.repeat(invs, counts)
        f = np.floor(v + (quantize_uniforms(seed, x.size) if stochastic else np.float32(0.5)))
    f = np.where(f > 0, f, np.float32(0))  # NaN -> 0
    f = np.where(f < np.float32(2**bits - 1), f, np.float32(2**bits - 1))
    packed = pack_codes(f.astype(np.uint8), bits)
    with np.errstate(invalid="ignore"):
        residual = x - block_quantize_decode(packed, scales, offsets, bounds, bits)
    return packed, scales, offsets, residual


def block_quantize_decode_mean(packed_list, scales_list, offsets_list, bounds, bits, plus=None):
    """Mean of m payloads: acc = 0, acc += each decode in order (float32), acc / m, + plus."""
    acc = np.zeros(int(bounds[-1]), np.float32)
    with np.errstate(invalid="ignore"):
        for packed, scales, offsets in zip(packed_list, scales_list, offsets_list):
            acc = acc + block_quantize_decode(packed, scales, offsets, bounds, bits)
        mean = acc / np.float32(len(packed_list))
        return mean if plus is None else mean + np.asarray(plus, np.float32)


def two_way_quantized_means(inputs, bounds, cuts, bits, stochastic, error_feedback, draws):
    """The two-way quantized exchange (hvd_compress/quantize.py's rule) over steps: inputs[t][r] is rank r's
    vector at step t; every worker quantizes its input + e (blocks `bounds`, draws `draws(r, False, t)`), shard
    j's owner (elements cuts[j]:cuts[j + 1]) averages the ranks' decodes of shard j in rank order, adds its
    residual and quantizes again (`draws(j, True, t)`); the mean D of each step is the owners' decodes, joined."""
    size, d = len(inputs[0]), int(cuts[-1])
    e = [np.zeros(d, np.float32) for _ in range(size)]
    e_server = [np.zeros(cuts[j + 1] - cuts[j], np.float32) for j in range(size)]
    out = []
    for t, step_inputs in enumerate(inputs):
        decoded = []  # each worker's decode, whose shards the owners average
        for r, x in enumerate(step_inputs):
            packed, scales, offsets, residual = block_quantize_compress(x + e[r], bounds, bits, stochastic,
                                                                        draws(r, False, t))
            decoded.append(block_quantize_decode(packed, scales, offsets, bounds, bits))
            if error_feedback:
                e[r] = residual
        pieces = []
        for j in range(size):
            lo, hi = cuts[j], cuts[j + 1]
            shard_bounds = bounds[(bounds >= lo) & (bounds <= hi)] - lo
            acc = np.zeros(hi - lo, np.float32)
            for r in range(size):  # the decode_mean's order: acc += each rank's decode, / m, + e_s
                acc = acc + decoded[r][lo:hi]
            mean = acc / np.float32(size) + e_server[j] if error_feedback else acc / np.float32(size)
            packed, scales, offsets, residual = block_quantize_compress(mean, shard_bounds, bits, stochastic,
                                                                        draws(j, True, t))
            if error_feedback:
                e_server[j] = residual
            pieces.append(block_quantize_decode(packed, scales, offsets, shard_bounds, bits))
        out.append(np.concatenate(pieces))
    return out


def push_sum_share(values, w, parts, before=None):
    """ops.push_sum_share in float32: [x / parts, w / parts] over the values flattened and concatenated, with
    x = values * w, or values - (1 - w) * before (the model read before the wrapped optimizer's step)."""
    w = np.float32(w)
    if before is None:
        x = [np.asarray(v, np.float32).ravel() * w for v in values]
    else:
        x = [np.asarray(v, np.float32).ravel() - (np.float32(1) - w) * np.asarray(b, np.float32).ravel()
             for v, b in zip(values, before)]
    return np.concatenate(x + [np.array([w], np.float32)]) / np.float32(parts)


class PushSum:
    """Stochastic Gradient Push (Assran et al., ICML 2019) in float32: each rank steps its numerator by its inner
    optimizer's step u_i (SGD without momentum: -lr g_i), x_i = w_i z_i + u_i, then splits (x_i, w_i) into p + 1
    equal shares (p: its out-peers at step 0), keeps one and sends one to each out-peer of step t; a message sent
    at step t is mixed in at step t + tau (overlap: tau = 1), summed in the senders' rank order; z_i = x_i / w_i.
    out_peers(rank, t) and in_peers(rank, t) name the graph."""

    def __init__(self, starts, out_peers, in_peers, tau):
        self.z = [np.asarray(s, np.float32).copy() for s in starts]
        self.w = [np.float32(1)] * len(starts)
        self.out_peers, self.in_peers, self.tau = out_peers, in_peers, tau
        self.pending = [np.zeros(self.z[0].size + 1, np.float32) for _ in starts]  # sent, not yet mixed in

    def step(self, updates, t):
        """Step t, updates[i] rank i's u_i (computed from self.z[i])."""
        n = len(self.z)
        shares = []
        for i in range(n):
            x = np.concatenate([self.z[i] * self.w[i] + updates[i], [self.w[i]]]).astype(np.float32)
            shares.append(x / np.float32(len(self.out_peers(i, 0)) + 1))
        arrivals = []
        for i in range(n):
            arrived = np.zeros_like(shares[i])
            for j in self.in_peers(i, t):
                arrived = arrived + shares[j]
            arrivals.append(arrived)
        for i in range(n):
            if self.tau:
                mixed, self.pending[i] = shares[i] + self.pending[i], arrivals[i]
            else:
                mixed = shares[i] + arrivals[i]
            self.w[i] = mixed[-1]
            self.z[i] = mixed[:-1] / self.w[i]

    def mass(self):
        """The weights' sum, the mass in flight included: n throughout."""
        return float(np.sum(self.w, dtype=np.float64) + sum(float(p[-1]) for p in self.pending))


class DiLoCo:
    """DiLoCo's outer step (hvd_compress/diloco.py) for n simulated ranks on one flat float32 vector: after the
    inner steps, Delta_i = theta - x_i; `mean(deltas)` averages them (with its own error feedback where it
    compresses; error_decay first scales that feedback, `residuals()`); m = mu m + Delta; theta -= lr (Delta +
    mu m) (Nesterov), lr m (heavy ball) or lr Delta (mu = 0); every x_i = theta.

    Streaming (`after_step`): `fragments` is a list of (index array, mean, residuals), fragment f starting its
    sync after inner steps phase_f + k H, phase_f = (f + 1) H // F; the averaged change lands `delay` steps
    later (the outer step then) and x_i's fragment becomes alpha x_i + (1 - alpha) theta."""

    def __init__(self, start, n, lr, mu, nesterov, mean, residuals=lambda: [], error_decay=1.0, sync_every=1,
                 fragments=None, delay=0, alpha=0.0):
        self.theta = np.asarray(start, np.float32).copy()
        self.x = [self.theta.copy() for _ in range(n)]
        self.m = np.zeros_like(self.theta)
        self.lr, self.mu, self.nesterov = np.float32(lr), np.float32(mu), nesterov
        self.error_decay, self.alpha, self.keep = np.float32(error_decay), np.float32(alpha), np.float32(1 - alpha)
        self.fragments = fragments or [(np.arange(self.theta.size), mean, residuals)]
        self.h, self.delay = sync_every, delay
        self.phases = [(f + 1) * sync_every // len(self.fragments) for f in range(len(self.fragments))]
        self.in_flight = {}  # fragment -> its averaged change

    def sync(self):
        """Every fragment starts and lands now (plain DiLoCo)."""
        for f in range(len(self.fragments)):
            self._start(f)
            self._land(f)

    def after_step(self, count):
        """After inner step `count` (from 1): the fragments whose exchange lands, then those that start."""
        def due(phase):
            return count >= phase and (count - phase) % self.h == 0
        for f, phase in enumerate(self.phases):
            if self.delay and due(phase + self.delay):
                self._land(f)
            if due(phase):
                self._start(f)
                if not self.delay:
                    self._land(f)

    def _start(self, f):
        index, mean, residuals = self.fragments[f]
        if self.error_decay != 1:
            for e in residuals():
                e *= self.error_decay
        self.in_flight[f] = mean([self.theta[index] - x[index] for x in self.x])

    def _land(self, f):
        index, delta = self.fragments[f][0], self.in_flight.pop(f)
        step = delta
        if self.mu:
            self.m[index] = self.mu * self.m[index] + delta
            step = delta + self.mu * self.m[index] if self.nesterov else self.m[index]
        self.theta[index] = self.theta[index] - self.lr * step
        for x in self.x:
            x[index] = (self.alpha * x[index] + self.keep * self.theta[index] if self.alpha
                        else self.theta[index])
