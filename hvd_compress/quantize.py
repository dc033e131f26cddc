"""Compression.quantize: blockwise low-bit quantization, exchanged two-way over a sharded server (the
compression between fp16 and one bit that ZeRO++'s qgZ, Bagua's ByteGrad, THC and QSGD use).

Code. A bucket's flat vector is cut into blocks of `block_size` elements (never across a tensor
or a shard); per block with lo = min, hi = max and L = 2^bits - 1 levels:
    scale = (hi - lo) / L,   q_i = round((x_i - lo) / scale) in [0, L],   x^_i = lo + q_i scale
rounding to nearest, or stochastically (`stochastic=True`: q_i = floor(v_i + u_i), u_i uniform in
[0, 1), so E[x^_i] = x_i: QSGD's unbiased rounding). The draws are stateless and counter-based
(seed, bucket, rank, worker or server, step, element: nothing is stored), so a run is
reproducible and the NumPy reference draws the same. Wire: bits/8 bytes per element plus a float32
scale and offset per block (quantize_ops.py has the format bit for bit).

Exchange (exchange.ShardedTwoWay, as two-way onebit, so the bytes per worker do not grow with n):
    a_i = g_i + e_i;  Q_i = Q(a_i);  e_i = a_i - Q_i                      (worker)
    A_j = mean_i Q_i[j] + e_s;  D_j = Q(A_j);  e_s = A_j - D_j            (owner of shard j)
and the wrapped optimizer applies the mean D as the gradient (update rule ERROR_FEEDBACK; with
error_feedback=False no residual is kept, NO_FEEDBACK, and stochastic rounding keeps D unbiased).
A non-finite value makes its block's scale NaN, so it reaches every rank's update.
"""
import numpy as np

from hvd_compress import quantize_ops
from hvd_compress.compressor import ERROR_FEEDBACK, NO_FEEDBACK, StatefulCompressor, stateless_seed
from hvd_compress.exchange import ShardedTwoWay, Unsummed


class QuantizeCompressor(StatefulCompressor):
    """Blockwise `bits`-bit quantization (2, 4 or 8) with a float32 scale and offset per block of
    `block_size` elements, sharded two-way (see the module docstring)."""

    collective = "alltoall/allgather"
    floats_per_block = 2  # the code, for ShardedTwoWay: a scale and an offset per block

    def __init__(self, bits=8, block_size=256, stochastic=True, error_feedback=True, seed=0):
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2 (elements per scale and offset), got "
                             f"{block_size!r}.")
        for name, value in (("stochastic", stochastic), ("error_feedback", error_feedback)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}.")
        self.bits, self.block_size, self.seed = quantize_ops.check_bits(bits), int(block_size), int(seed)
        self.stochastic, self.error_feedback = stochastic, error_feedback
        self.update_rule = ERROR_FEEDBACK if error_feedback else NO_FEEDBACK
        self.server_feedback = error_feedback

    def __repr__(self):
        return (f"Compression.quantize(bits={self.bits}, block_size={self.block_size}, stochastic={self.stochastic}, "
                f"error_feedback={self.error_feedback}, seed={self.seed})")

    def plan(self, bucket):
        return ShardedTwoWay(self, bucket)

    def encode_parts(self, parts, bounds, salt=0, step=0):
        """A bucket's flat float32 parts (exchange.Unsummed ones: g + e, added on the way) -> ((codes uint8,
        scales, offsets), residual a - decode per part), in one pass over the parts where they lie; stochastic
        draws keyed by (seed, salt) and counted by step."""
        apart = [p if isinstance(p, Unsummed) else Unsummed(p, None) for p in parts]
        codes, scales, offsets, residuals = quantize_ops.block_quantize_compress(
            [p.value for p in apart], bounds, self.bits, self.stochastic, stateless_seed(self.seed, salt, step),
            plus=[p.residual for p in apart])
        return (codes, scales, offsets), residuals

    def decode_mean(self, payloads, bounds, plus=None):
        """Mean of stacked payloads (codes [m, bytes], scales [m, B], offsets [m, B]) -> float32 [n]
        (+ plus, in the same pass)."""
        codes, scales, offsets = payloads
        return quantize_ops.block_quantize_decode_mean(codes, scales, offsets, bounds, self.bits, plus=plus)

    def recode_mean(self, payloads, bounds, plus=None, salt=0, step=0):
        """encode_parts([decode_mean(payloads, bounds, plus)], bounds, salt, step), the same bits, in one pass that
        never writes the mean (the server's step of ShardedTwoWay)."""
        codes, scales, offsets, residual = quantize_ops.block_quantize_recode_mean(
            *payloads, bounds, self.bits, plus, self.stochastic, stateless_seed(self.seed, salt, step))
        return (codes, scales, offsets), residual
