"""How payloads travel between ranks, and the bytes that costs.

Each exchange is pure: tensors in, tensors out, no state (the optimizer owns
residuals and passes them in). Each knows, from the static layout, the bytes
one worker sends per step (`bytes_sent`), counted for the algorithms Horovod's
CPU back ends run:
- allreduce: ring (reduce-scatter + allgather), 2 (n-1)/n of the payload;
- allgather: a worker's payload reaches the n - 1 others;
- alltoall: a worker sends every shard but its own.
A worker receives as many bytes as it sends in all of these.

Every compressed payload carries non-finite values through: a NaN or Inf in
any rank's input makes the affected part of everybody's update non-finite
(the sign scales and the top-k selection do this by construction; random-k
adds a one-float "poison" sum), so no rank silently applies a finite update.
"""
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import ops


def allreduce_bytes(payload_bytes, size):
    """Ring allreduce: reduce-scatter then allgather, 2 (n-1)/n of the payload each."""
    return 2 * (size - 1) * payload_bytes / size if size > 1 else 0.0


def allgather_bytes(payload_bytes, size):
    """Allgather: each worker's payload reaches the n - 1 others."""
    return (size - 1) * payload_bytes if size > 1 else 0.0


def _sign_payload(bits, scales):
    """One uint8 buffer per payload: the packed signs, then the float32 scales' bytes."""
    return tf.concat([bits, tf.reshape(tf.bitcast(scales, tf.uint8), [-1])], 0)


def _split_sign_payloads(buffer, count, num_bytes, num_blocks):
    """Inverse of _sign_payload for `count` stacked payloads of one layout:
    (bits uint8[count, num_bytes], scales float32[count, num_blocks])."""
    rows = tf.reshape(buffer, [count, num_bytes + 4 * num_blocks])
    scales = tf.bitcast(tf.reshape(rows[:, num_bytes:], [count, num_blocks, 4]), tf.float32)
    return rows[:, :num_bytes], scales


def poison(x):
    """0.0 when x is all finite, else NaN: added to an update, it spreads a non-finite input."""
    return tf.reduce_sum(x * 0.0)


class DenseAllreduce:
    """Tensors that are not compressed, fused into one grouped allreduce (Horovod's own
    path), optionally through a sum-compatible Horovod compressor (none, fp16)."""

    def __init__(self, variables, compression, size, process_set, op, gradient_predivide_factor, name):
        self.compression, self.size, self.process_set, self.op = compression, size, process_set, op
        self.predivide, self.name = gradient_predivide_factor, name
        payload = sum(v.shape.num_elements() * compression.wire_bytes(v.dtype) for v in variables)
        self.bytes_sent = allreduce_bytes(payload, size)

    def __call__(self, tensors):
        if not tensors:
            return []
        return hvd.grouped_allreduce(
            list(tensors), op=self.op, compression=self.compression,
            prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide,
            process_set=self.process_set, name=self.name)


class FullAllreduce:
    """A compressed bucket sent at full precision (Accordion's `Compression.none` setting):
    one float32 allreduce; it sends everything, so no residual is left."""

    def __init__(self, num_elements, size, process_set, name):
        self.process_set, self.name = process_set, name
        self.bytes_sent = allreduce_bytes(4 * num_elements, size)

    def __call__(self, flat):
        return flat, hvd.allreduce(flat, op=hvd.Average, process_set=self.process_set, name=self.name)


class SignAllgather:
    """One-way dist-EF-SGD: every worker's packed update is allgathered, all decode the mean."""

    def __init__(self, compressor, bounds, size, process_set, name):
        self.compressor, self.bounds, self.size = compressor, bounds, size
        self.process_set, self.name = process_set, name
        n = int(bounds[-1])
        self.num_blocks = len(bounds) - 1
        self.num_bytes = (n + 7) // 8
        self.bytes_sent = allgather_bytes(compressor.payload_bytes(n, self.num_blocks), size)

    def __call__(self, flat):
        bounds = tf.constant(self.bounds)
        bits, scales = self.compressor.encode(flat, bounds)
        sent = self.compressor.decode((bits, scales), bounds)
        gathered = hvd.allgather(_sign_payload(bits, scales), process_set=self.process_set,
                                 name=self.name)
        everyone = _split_sign_payloads(gathered, self.size, self.num_bytes, self.num_blocks)
        return sent, self.compressor.decode_mean(everyone, bounds)


class SignTwoWay:
    """Two-way dist-EF-SGD over a sharded server (alltoall + allgather).

    The flat update of d elements is cut into `size` shards at multiples of 8
    (so each owns whole bytes of the packed signs; the shard cuts are also
    block cuts). Worker i packs its whole update; an alltoall sends shard j of
    every worker to rank j; rank j averages them, adds its server residual
    e_s, recompresses: D_j = C(A_j), e_s = A_j - D_j; an allgather returns
    every D_j to every rank, which decode the same update D.
    """

    def __init__(self, compressor, bounds, shard_cuts, rank, size, process_set, name):
        self.compressor, self.bounds, self.rank, self.size = compressor, bounds, rank, size
        self.process_set, self.name = process_set, name
        # For each shard: its element range, block range and payload byte length.
        self.shards = []
        for j in range(size):
            lo, hi = int(shard_cuts[j]), int(shard_cuts[j + 1])
            first, last = np.searchsorted(bounds, lo), np.searchsorted(bounds, hi)
            num_bytes = (hi + 7) // 8 - lo // 8
            self.shards.append(dict(lo=lo, hi=hi, first_block=int(first), last_block=int(last),
                                    num_bytes=num_bytes, payload=num_bytes + 4 * int(last - first)))
        mine = self.shards[rank]
        self.server_size = mine["hi"] - mine["lo"]
        self.server_bounds = bounds[mine["first_block"]:mine["last_block"] + 1] - mine["lo"]
        total = sum(s["payload"] for s in self.shards)
        # alltoall: all but my own shard; allgather: my shard to the n - 1 others.
        self.bytes_sent = (total - mine["payload"]) + allgather_bytes(mine["payload"], size)

    def _shard_payloads(self, bits, scales):
        return [_sign_payload(bits[s["lo"] // 8:s["lo"] // 8 + s["num_bytes"]],
                              scales[s["first_block"]:s["last_block"]])
                for s in self.shards]

    def __call__(self, flat, server_residual):
        """Returns (what this worker sent, the update D, the new server residual)."""
        bounds = tf.constant(self.bounds)
        bits, scales = self.compressor.encode(flat, bounds)
        sent = self.compressor.decode((bits, scales), bounds)
        payloads = self._shard_payloads(bits, scales)
        received, _ = hvd.alltoall(tf.concat(payloads, 0), splits=[s["payload"] for s in self.shards],
                                   process_set=self.process_set, name=self.name + ".alltoall")
        mine = self.shards[self.rank]
        server_bounds = tf.constant(self.server_bounds)
        averaged = self.compressor.decode_mean(
            _split_sign_payloads(received, self.size, mine["num_bytes"],
                                 mine["last_block"] - mine["first_block"]), server_bounds)
        server_input = averaged + server_residual
        server_bits, server_scales = self.compressor.encode(server_input, server_bounds)
        server_sent = self.compressor.decode((server_bits, server_scales), server_bounds)
        gathered = hvd.allgather(_sign_payload(server_bits, server_scales),
                                 process_set=self.process_set, name=self.name + ".allgather")
        all_bits, all_scales, offset = [], [], 0
        for s in self.shards:
            bits_j, scales_j = _split_sign_payloads(gathered[offset:offset + s["payload"]], 1,
                                                    s["num_bytes"], s["last_block"] - s["first_block"])
            all_bits.append(bits_j[0])
            all_scales.append(scales_j[0])
            offset += s["payload"]
        update = self.compressor.decode((tf.concat(all_bits, 0), tf.concat(all_scales, 0)), bounds)
        return sent, update, server_input - server_sent


class SparseAllgather:
    """Top-k: (values, int32 indices) of every worker allgathered, summed densely, averaged."""

    def __init__(self, compressor, num_elements, k, size, process_set, name):
        self.compressor, self.n, self.k, self.size = compressor, num_elements, k, size
        self.process_set, self.name = process_set, name
        self.bytes_sent = allgather_bytes(compressor.payload_bytes(k), size)

    def __call__(self, flat):
        values, indices = self.compressor.encode(flat, self.k)
        sent = self.compressor.decode((values, indices), self.n)
        gathered = hvd.allgather(tf.concat([values, tf.bitcast(indices, tf.float32)], 0),
                                 process_set=self.process_set, name=self.name)
        gathered = tf.reshape(gathered, [self.size, 2, self.k])
        total = self.compressor.decode((gathered[:, 0], tf.bitcast(gathered[:, 1], tf.int32)), self.n)
        return sent, total / self.size


class SharedRandomAllreduce:
    """Random-k: every rank draws the same k coordinates (stateless, from seed and step),
    so only values travel, summed by a plain allreduce."""

    def __init__(self, compressor, num_elements, k, size, process_set, name):
        self.compressor, self.n, self.k, self.size = compressor, num_elements, k, size
        self.process_set, self.name = process_set, name
        self.bytes_sent = allreduce_bytes(compressor.payload_bytes(k), size)

    def __call__(self, flat, step, salt):
        indices = self.compressor.indices(self.n, self.k, step, salt)
        values = tf.gather(flat, indices)
        sent = self.compressor.decode((values, indices), self.n)
        summed = hvd.allreduce(tf.concat([values, [poison(flat)]], 0), op=hvd.Sum,
                               process_set=self.process_set, name=self.name)
        update = self.compressor.decode((summed[:-1], indices), self.n) / self.size
        return sent, update + summed[-1]


class SketchAllreduce:
    """Sketched SGD: count sketches summed by allreduce, heavy hitters recovered alike on
    every rank, then (second round) their exact sums fetched by a k-float allreduce."""

    def __init__(self, compressor, num_elements, size, process_set, name, salt):
        self.compressor, self.n, self.size = compressor, num_elements, size
        self.process_set, self.name, self.salt = process_set, name, salt
        self.k, self.rows, self.cols = compressor.sizes(num_elements)
        self.bytes_sent = (allreduce_bytes(4 * self.rows * self.cols, size)
                           + (allreduce_bytes(4 * self.k, size) if compressor.second_round else 0))

    def __call__(self, flat):
        """Returns (what this worker sent, the mean update, the candidate indices)."""
        summed = hvd.allreduce(self.compressor.encode(flat, self.rows, self.cols, self.salt), op=hvd.Sum,
                               process_set=self.process_set, name=self.name + ".sketch")
        estimate = self.compressor.estimate(summed, self.n, self.salt)
        _, indices = ops.top_k_abs(estimate, self.k)
        local = tf.gather(flat, indices)
        if self.compressor.second_round:
            values = hvd.allreduce(local, op=hvd.Sum, process_set=self.process_set,
                                   name=self.name + ".values")
        else:
            values = tf.gather(estimate, indices)
        sent = ops.scatter_dense(indices, local, self.n)
        return sent, ops.scatter_dense(indices, values, self.n) / self.size, indices


class LowRankAllreduce:
    """PowerSGD: per tensor P = M Q and Q = M^T P, each fused over the bucket into one allreduce."""

    def __init__(self, compressor, shapes, size, process_set, name):
        self.compressor, self.size, self.process_set, self.name = compressor, size, process_set, name
        self.matrices = [compressor.matrix_shape(s) for s in shapes]
        self.bytes_sent = (allreduce_bytes(4 * compressor.rank * sum(n for n, _ in self.matrices), size)
                           + allreduce_bytes(4 * compressor.rank * sum(m for _, m in self.matrices), size))

    def _fused_mean(self, factors, name):
        flat = hvd.allreduce(tf.concat([tf.reshape(f, [-1]) for f in factors], 0), op=hvd.Average,
                             process_set=self.process_set, name=name)
        out, offset = [], 0
        for f in factors:
            size = int(np.prod(f.shape))
            out.append(tf.reshape(flat[offset:offset + size], f.shape))
            offset += size
        return out

    def __call__(self, flat, qs):
        """Returns (the mean low-rank update D, the new Q factors)."""
        ms, offset = [], 0
        for n, m in self.matrices:
            ms.append(tf.reshape(flat[offset:offset + n * m], [n, m]))
            offset += n * m
        ps = self._fused_mean([tf.matmul(m, q) for m, q in zip(ms, qs)], self.name + ".p")
        ps = [tf.linalg.qr(p)[0] for p in ps]  # orthonormal columns spanning P
        new_qs = self._fused_mean([tf.matmul(m, p, transpose_a=True) for m, p in zip(ms, ps)],
                                  self.name + ".q")
        update = tf.concat([tf.reshape(tf.matmul(p, q, transpose_b=True), [-1])
                            for p, q in zip(ps, new_qs)], 0)
        return update, new_qs
