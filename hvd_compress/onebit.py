"""Compression.onebit: dist-EF-SGD's blockwise sign compressor and its two exchanges
(Zheng, Huang, Kwok, "Communication-Efficient Distributed Blockwise Momentum SGD with
Error-Feedback", NeurIPS 2019)."""
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import ops
from hvd_compress.compressor import MOMENTUM_IN_FRONT, StatefulCompressor
from hvd_compress.exchange import (EncodedUpdate, Exchange, Exchanged, ShardedTwoWay, allgather_bytes, concat,
                                   pack_payload, split, split_payloads)


class OneBitCompressor(StatefulCompressor):
    """Blockwise sign compressor of dist-EF-SGD (Zheng, Huang, Kwok, NeurIPS 2019).

    C(x)_b = (||x_b||_1 / |G_b|) * sign(x_b), sign(0) = +1, for each block G_b.
    block_size=None uses one block per tensor; an integer cuts every tensor
    into blocks of that many elements. Wire: ceil(n/8) bytes of packed signs
    plus one float32 scale per block. two_way=True (the paper's method) compresses the
    averaged update again on a sharded server with its own error feedback (exchange.ShardedTwoWay: bytes
    per worker do not grow with the number of ranks); False allgathers every worker's update
    (SignAllgather).

    Update rule (MOMENTUM_IN_FRONT) under SGD, with or without (Nesterov) momentum:
        m_i = mu m_i + g_i;   p_i = mu m_i + g_i (Nesterov) or m_i
        a_i = lr_t p_i + s e_i;  D_i = C(a_i);  e_i = a_i - D_i        (worker EF)
        two-way:  A = mean_i D_i + s e_s;  D = C(A);  e_s = A - D      (server EF)
        one-way:  D = mean_i D_i
        x = x - D
    s = lr_t / lr_{t-1}: the residuals hold lr-scaled quantities and follow a change of rate
    (the paper leaves them; measured in docs/algorithms.md). Under other optimizers: error
    feedback on gradients, and the wrapped optimizer applies D.
    """

    collective = "alltoall/allgather"
    update_rule = MOMENTUM_IN_FRONT
    #: the code, for ShardedTwoWay: bits per element, float32 values per block (the scale), a server residual
    bits, floats_per_block, server_feedback = 1, 1, True

    def __init__(self, block_size=None, two_way=True):
        if not isinstance(two_way, bool):
            raise TypeError(f"two_way must be True or False, got {two_way!r}.")
        self.block_size, self.two_way = ops.check_block_size(block_size), two_way

    def __repr__(self):
        return f"Compression.onebit(block_size={self.block_size}, two_way={self.two_way})"

    def plan(self, bucket):
        return (ShardedTwoWay if self.two_way else SignAllgather)(self, bucket)

    def bounds(self, sizes):
        """Block bounds for a buffer of tensors with these sizes (see ops.block_bounds)."""
        return ops.block_bounds(sizes, self.block_size)

    def encode(self, flat, bounds):
        """flat [n] -> (bits uint8[ceil(n/8)], scales float32[B])."""
        return ops.block_sign_pack(flat, bounds=bounds)

    def encode_with_residual(self, flat, bounds, salt=0, step=0):
        """flat float32 [n] -> ((bits, scales), flat - C(flat)): the payload and the residual it leaves,
        in one op (the residual as decode and a subtraction would give it, in flat's buffer). Not
        `compress`, which is Horovod's compressor interface (refused above). Deterministic: salt and
        step (of ShardedTwoWay's code contract) are not used."""
        bits, scales, residual = ops.block_sign_compress(flat, bounds=bounds)
        return (bits, scales), residual

    def decode(self, payload, bounds, dtype=tf.float32):
        """One payload -> dtype[n] with +-scale per element."""
        bits, scales = payload
        return ops.block_sign_unpack(bits, scales, None, bounds=bounds, dtype=dtype)

    def decode_mean(self, payloads, bounds, dtype=tf.float32, plus=None):
        """Mean of stacked payloads (as allgathered) -> dtype[n], fused (+ float32 plus, in the same pass)."""
        bits, scales = payloads
        return ops.block_sign_unpack_mean(bits, scales, None, bounds=bounds, dtype=dtype, plus=plus)

    def encode_parts(self, parts, bounds, salt=0, step=0):
        """encode_with_residual of the bucket's parts concatenated (exchange.Unsummed ones added first), its
        residual cut back into the parts: the worker's step of ShardedTwoWay."""
        payload, residual = self.encode_with_residual(concat(parts), bounds)
        return payload, split(residual, parts)

    def recode_mean(self, payloads, bounds, plus=None, salt=0, step=0):
        """encode_with_residual(decode_mean(payloads, bounds, plus=plus), bounds): the server's step of
        ShardedTwoWay."""
        return self.encode_with_residual(self.decode_mean(payloads, bounds, plus=plus), bounds)

    def subtract_mean(self, variable, payloads, bounds, offset=0):
        """variable -= elements [offset, offset + its size) of decode_mean(payloads, bounds), in place,
        in one pass over a float32 variable (the bits of that decode and assign_sub)."""
        bits, scales = payloads
        return ops.subtract_block_sign_mean(variable, bits, scales, bounds, offset)

    @staticmethod
    def payload_bytes(num_elements, num_blocks):
        """Bytes of one payload: packed signs plus float32 scales."""
        return (num_elements + 7) // 8 + 4 * num_blocks


class SignAllgather(Exchange):
    """One-way dist-EF-SGD: every worker's packed update is allgathered, all decode the mean."""

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.bounds = ops.layout_bounds(bucket.sizes, compressor.block_size)
        n = bucket.num_elements
        self.num_blocks = len(self.bounds) - 1
        self.num_bytes = (n + 7) // 8
        self.bytes_sent = allgather_bytes(compressor.payload_bytes(n, self.num_blocks), bucket.size)

    def __call__(self, parts, state, step):
        bounds = tf.constant(self.bounds)
        (bits, scales), residual = self.compressor.encode_with_residual(concat(parts), bounds)
        gathered = hvd.allgather(pack_payload(bits, [scales]), process_set=self.bucket.process_set,
                                 name=self.bucket.name)
        everyone = split_payloads(gathered, self.bucket.size, self.num_bytes, self.num_blocks, 1)
        return Exchanged(split(residual, parts), split(EncodedUpdate(self.compressor, everyone, bounds), parts))
