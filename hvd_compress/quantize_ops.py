"""Python wrappers of the blockwise low-bit quantizer's ops (Compression.quantize).

Each block of a flat float32 vector (blocks given by `bounds`, as for the sign
ops: `ops.layout_bounds(sizes, block_size)`) is coded with `bits` (2, 4 or 8)
bits per element on the uniform grid of L = 2**bits - 1 steps from the block's
min (offset) to its max (offset + L * scale):

    q = clamp(floor((x - offset) * inv + 0.5), 0, L)   (deterministic)
    q = clamp(floor((x - offset) * inv + u_i), 0, L)   (stochastic, unbiased)
    decode: offset + float32(q) * scale

with inv = L / (max - min); a block holding a NaN or an Inf (or whose range
overflows float32) gets scale = offset = NaN, so it decodes to NaN. Codes are
packed LSB first, element i at bits [i*bits, (i+1)*bits) of ceil(n*bits/8)
bytes, so a shard starting at a multiple of 8 elements starts at a whole byte.
The stochastic draws u_i in [0, 1) are a counter-based hash (one round of a 32-bit hash, 16 bits a draw) of the
seed (key, counter) and the element's index i in x: the same seed gives the
same draws, so give each step (and each rank) its own counter or key. The full
format, bit for bit, is in tf_ops/quantize_ops.cc; tests/np_reference.py
re-implements it in NumPy.
"""
import numpy as np
import tensorflow as tf

from hvd_compress import ops

QUANTIZE_OP_NAMES = ("BlockQuantizeCompress", "BlockQuantizeDecodeMean", "BlockQuantizeRecodeMean")
QUANTIZE_BITS = (2, 4, 8)

for _name in QUANTIZE_OP_NAMES:  # encodings, never gradients
    tf.no_gradient(_name)


def check_bits(bits):
    """Returns bits after checking it is 2, 4 or 8."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in QUANTIZE_BITS:
        raise ValueError(f"bits must be 2, 4 or 8 (bits per element on the wire), got {bits!r}.")
    return int(bits)


def packed_size(n, bits):
    """Bytes of the packed codes of n elements: ceil(n * bits / 8)."""
    return (int(n) * check_bits(bits) + 7) // 8


def _seed(stochastic, seed):
    if seed is None:
        if stochastic:
            raise ValueError("stochastic rounding needs a seed (key, counter): pass a new counter every step, "
                             "e.g. seed=(rank, step).")
        seed = (0, 0)
    return tf.reshape(tf.cast(seed, tf.int64), [2])


def block_quantize_compress(x, bounds, bits, stochastic=False, seed=None, plus=None):
    """Quantizes float32 x (flattened) blockwise and returns its error-feedback residual, in one op.

    x: a tensor, or a list of the parts of one vector (a bucket's tensors, read where they lie, each starting at
    one of the bounds); plus: None, or (for a list) one tensor or None per part, added to it on the way: the
    vector coded is the concatenation of x_k + plus_k (error feedback's g + e, never written as such).
    bounds: int64 [B + 1] block boundaries [0, ..., n] (ops.block_bounds / ops.layout_bounds).
    bits: 2, 4 or 8. stochastic: unbiased stochastic rounding instead of rounding to nearest.
    seed: (key, counter) int64 pair (or tensor) of the stochastic draws; required when stochastic.

    Returns (packed uint8[ceil(n*bits/8)], scales float32[B], offsets float32[B], residual), the
    residual x + plus - decode(payload) with x's shape (a list like x's for a list), in x's or plus's buffer when
    nothing else holds it.
    """
    parts = list(x) if isinstance(x, (list, tuple)) else [x]
    pluses = ([None] * len(parts) if plus is None else list(plus) if isinstance(x, (list, tuple)) else [plus])
    parts = [tf.convert_to_tensor(p) for p in parts]
    for part in parts:
        if part.dtype != tf.float32:
            raise TypeError(f"block_quantize_compress quantizes float32 tensors, got {part.dtype.name}; cast x first.")
    if len(pluses) != len(parts):
        raise ValueError(f"plus must have one tensor (or None) per part of x: {len(parts)} parts, {len(pluses)} "
                         "pluses.")
    pluses = [tf.zeros([0], tf.float32) if p is None else tf.convert_to_tensor(p, tf.float32) for p in pluses]
    packed, scales, offsets, residuals = ops.library().block_quantize_compress(
        parts, pluses, tf.convert_to_tensor(bounds, tf.int64), _seed(stochastic, seed), bits=check_bits(bits),
        stochastic=bool(stochastic))
    return packed, scales, offsets, residuals if isinstance(x, (list, tuple)) else residuals[0]


def block_quantize(x, bounds, bits, stochastic=False, seed=None):
    """The payload (packed, scales, offsets) of block_quantize_compress, without the residual."""
    return block_quantize_compress(x, bounds, bits, stochastic, seed)[:3]


def block_quantize_decode_mean(packed, scales, offsets, bounds, bits, plus=None):
    """Mean of m payloads decoded in one pass, float32[n] with n = bounds[-1].

    packed: uint8[m, ceil(n*bits/8)]; scales, offsets: float32[m, B]; or each stacked flat, as
    hvd.allgather returns them (one payload: m = 1, the plain decode). Per element, in float32:
    acc = 0; acc += offsets[r, b] + float(q_r) * scales[r, b] for r = 0..m-1 in order; acc / m.
    plus (float32 [n]): added to the mean in the same pass, as a separate float32 add would.
    """
    return ops.library().block_quantize_decode_mean(*_payloads(packed, scales, offsets, bounds, plus),
                                                    bits=check_bits(bits))


def block_quantize_recode_mean(packed, scales, offsets, bounds, bits, plus=None, stochastic=False, seed=None):
    """block_quantize_compress(block_quantize_decode_mean(packed, scales, offsets, bounds, bits, plus), bounds,
    bits, stochastic, seed), the same bits, in one pass that never writes the mean: the server's step of a two-way
    exchange, A = mean_i Q_i + e_s, D = Q(A), e_s = A - D. Returns (packed, scales, offsets, residual), the
    residual in plus's buffer when nothing else holds it."""
    return ops.library().block_quantize_recode_mean(*_payloads(packed, scales, offsets, bounds, plus),
                                                    _seed(stochastic, seed), bits=check_bits(bits),
                                                    stochastic=bool(stochastic))


def _payloads(packed, scales, offsets, bounds, plus):
    """The inputs (packed, scales, offsets, bounds, plus) of the ops that read stacked payloads, each payload
    array [m, ...] (given stacked flat, as hvd.allgather returns them, or already [m, ...]) and plus [n] or
    [0]."""
    bounds = tf.convert_to_tensor(bounds, tf.int64)
    scales = tf.convert_to_tensor(scales, tf.float32)
    offsets = tf.convert_to_tensor(offsets, tf.float32)
    packed = tf.convert_to_tensor(packed, tf.uint8)
    num_blocks = tf.size(bounds, out_type=tf.int64) - 1
    if scales.shape.rank == 1:
        scales = tf.reshape(scales, tf.stack([-1, num_blocks]))
    if offsets.shape.rank == 1:
        offsets = tf.reshape(offsets, tf.shape(scales, out_type=tf.int64))
    if packed.shape.rank == 1:
        packed = tf.reshape(packed, tf.stack([tf.shape(scales, out_type=tf.int64)[0], -1]))
    plus = tf.zeros([0], tf.float32) if plus is None else tf.reshape(tf.convert_to_tensor(plus, tf.float32), [-1])
    return packed, scales, offsets, bounds, plus
