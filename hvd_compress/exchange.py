"""How payloads travel between ranks, the state each exchange needs, and the bytes it costs.

An exchange moves one fused bucket of error-fed values `flat` between ranks.
It declares the state it needs (`state`: StateSpecs with a name, shape and
scope, see state.py); the GradientExchange creates it once and passes it to
every step as a dict of variables, with the step's `StepInfo` (its number and,
in direct-update mode, the learning rate and momentum). A step gets the bucket's
values as one flat tensor per variable and returns, per variable, this worker's
residual and the mean update, with the new values of its state and (sketched
SGD) the coordinates where the update was applied (`Exchanged`); most
exchanges work on the bucket's concatenation (`Exchange.exchange`, returning a
`Step`: what this worker sent, its residual being flat - sent; the update may stay
encoded, an `EncodedUpdate`, which the optimizer of dist-EF-SGD decodes straight into its
variables and everything else gets decoded). An exchange that
keeps error and momentum in its own state (FetchSGD)
says `worker_feedback = False`: the worker then hands it plain gradients and
keeps no residual or momentum of its own. So
a new compressor is one compressor class (compression.py) and one exchange
class here, entered in `EXCHANGES`.

Each knows, from the static layout, the bytes one worker sends per step
(`bytes_sent`), counted for the algorithms Horovod's CPU back ends run:
- allreduce: ring (reduce-scatter + allgather), 2 (n-1)/n of the payload;
- allgather: a worker's payload reaches the n - 1 others;
- alltoall: a worker sends every shard but its own.
A worker receives as many bytes as it sends in all of these.

Every compressed payload carries non-finite values through: a NaN or Inf in
any rank's input makes the affected part of everybody's update non-finite
(the sign scales and the top-k selection do this by construction; random-k
adds a one-float "poison" sum), so no rank silently applies a finite update.
"""
import math
from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

import horovod
import horovod.tensorflow as hvd
from hvd_compress import ops
from hvd_compress.compression import (FP16Compressor, OneBitCompressor, PowerSGDCompressor,
                                      RandomKCompressor, TopKCompressor)
from hvd_compress.sketch import SketchCompressor
from hvd_compress.state import REPLICATED, SHARDED, StateSpec


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


def fuse_in_order(nbytes, threshold):
    """Buckets of consecutive items: lists of their positions, each holding at most `threshold` bytes
    (an item larger than that is a bucket of its own). nbytes: each item's bytes, in order."""
    buckets, current, current_bytes = [], [], 0
    for i, size in enumerate(nbytes):
        if current and current_bytes + size > threshold:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    return buckets + [current] if current else buckets


def poison(x):
    """0.0 when x is all finite, else NaN: added to an update, it spreads a non-finite input."""
    return tf.reduce_sum(x * 0.0)


class Bucket(NamedTuple):
    """What an exchange is planned for: one fused bucket on one world."""
    index: int  # position among the buckets (salts shared random draws)
    shapes: list  # of the tensors fused in it, in order
    rank: int
    size: int
    process_set: object
    name: str  # prefix of its collectives' names
    two_way: bool  # onebit: sharded server (True) or allgather (False)

    @property
    def sizes(self):
        return [int(np.prod(s, dtype=np.int64)) for s in self.shapes]

    @property
    def num_elements(self):
        return sum(self.sizes)


class StepInfo(NamedTuple):
    """What an exchange may read of the optimizer's step."""
    number: tf.Tensor  # the optimizer's iteration (a tape's exchange counts its own)
    learning_rate: Optional[tf.Tensor] = None  # direct-update mode only: the update is scaled inside
    momentum: float = 0.0  # direct-update mode only (else the wrapped optimizer applies its own)
    nesterov: bool = False
    #: True: an update the exchange gives as an EncodedUpdate is handed on as EncodedParts (the optimizer of
    #: dist-EF-SGD subtracts them from float32 variables itself); False: it is decoded here
    encoded_update: bool = False
    #: direct-update mode only: lr / the previous step's lr, by which residuals of lr-scaled quantities
    #: (the two-way server's) are multiplied this step (1 where the rate did not change)
    residual_scale: Optional[tf.Tensor] = None


def rescaled(residual, scale):
    """residual * scale (StepInfo.residual_scale), with no pass over it where the scale is 1 or None."""
    if scale is None:
        return residual
    return tf.cond(tf.equal(scale, 1.0), lambda: tf.identity(residual), lambda: residual * scale)


class Step(NamedTuple):
    """What one exchange step on the bucket's flat vector returns (Exchange.exchange)."""
    sent: Optional[tf.Tensor]  # what this worker sent: its residual is flat - sent
    update: object  # the mean update of all workers: a flat tensor, or an EncodedUpdate
    state: dict = {}  # new values of the exchange's state, by name
    applied: Optional[tf.Tensor] = None  # indices where the update was applied (sketched SGD)
    residual: Optional[tf.Tensor] = None  # flat - sent, where the compressor gives it (then sent is None)


class EncodedUpdate(NamedTuple):
    """A bucket's mean update left as the payloads it travelled in (a Step's update), decoded where it
    is used: the optimizer of dist-EF-SGD subtracts each variable's part from the variable in one
    pass (EncodedPart.subtract_from, one read and one write of the variable, where a decode and
    assign_sub take four streams); everything else gets decode().

    compressor: what decodes them (decode_mean, subtract_mean); payloads: the stacked payloads whose
    mean is the update, as compressor.decode_mean takes them; bounds: the bucket's block bounds."""
    compressor: object
    payloads: tuple
    bounds: tf.Tensor

    def decode(self):
        return self.compressor.decode_mean(self.payloads, self.bounds)

    def parts(self, sizes):
        """One EncodedPart per variable of these sizes, in the bucket's order."""
        return [EncodedPart(self, int(offset)) for offset in np.cumsum([0, *sizes[:-1]])]


class EncodedPart(NamedTuple):
    """One variable's elements of an EncodedUpdate, from `offset` in the bucket."""
    update: EncodedUpdate
    offset: int

    def subtract_from(self, variable):
        """variable -= this part of the decoded update, in place (a float32 variable of the part's size)."""
        u = self.update
        return u.compressor.subtract_mean(variable, u.payloads, u.bounds, self.offset)


def subtract(variable, delta):
    """variable -= delta: a dense tensor (cast to the variable's dtype), or an EncodedPart decoded
    straight into the variable."""
    if isinstance(delta, EncodedPart):
        return delta.subtract_from(variable)
    return variable.assign_sub(tf.cast(delta, variable.dtype))


class Exchanged(NamedTuple):
    """What one exchange step returns to the optimizer (Exchange.__call__): per variable."""
    residual: list  # this worker's residual, a flat tensor per variable (its input less what it sent)
    update: list  # the mean update of all workers, a flat tensor (or EncodedPart) per variable
    state: dict = {}
    applied: Optional[tf.Tensor] = None


class Exchange:
    """The contract of every exchange (see the module docstring).

    The optimizer calls it with the bucket's values as `parts`, one flat float32 tensor per
    variable. By default the parts are concatenated into the bucket's flat vector, which
    `exchange` works on, and the residual and update are cut back into parts (an EncodedUpdate
    into EncodedParts where the step says `encoded_update`, else decoded first). An exchange that
    can work on the parts where they lie (top-k, random-k, PowerSGD) overrides __call__ and makes
    no concatenation.
    """

    #: the StateSpecs this exchange needs, created once by the GradientExchange
    state = ()
    bytes_sent = 0.0
    #: True: the worker feeds it error-fed values (and momentum in front) and keeps the residual;
    #: False: it gets plain gradients and keeps error and momentum in its own state
    worker_feedback = True
    #: True: the worker's momentum is zeroed where Step.applied says the update was applied
    #: (sketched SGD's momentum masking)
    masks_momentum = False

    def __call__(self, parts, state, step):
        """parts: float32 error-fed values (plain gradients without worker feedback), a flat tensor per
        variable; state: {name: variable}; step: a StepInfo. Returns an Exchanged."""
        flat = tf.concat(parts, 0)
        result = self.exchange(flat, state, step)
        sizes = [int(p.shape[0]) for p in parts]
        residual = flat - result.sent if result.residual is None else result.residual
        update = result.update
        if isinstance(update, EncodedUpdate):
            update = update.parts(sizes) if step.encoded_update else tf.split(update.decode(), sizes)
        else:
            update = tf.split(update, sizes)
        return Exchanged(tf.split(residual, sizes), update, result.state, result.applied)

    def exchange(self, flat, state, step):
        """flat: the bucket's values as one float32 [n] vector. Returns a Step."""
        raise NotImplementedError

    def residual(self, state):
        """Tensors whose global norm is (an estimate of) the error this exchange holds back in its
        own state, beyond the workers' residuals."""
        return []


class DenseAllreduce:
    """Tensors that are not compressed, fused into one grouped allreduce (Horovod's own
    path), optionally through a sum-compatible Horovod compressor (none, fp16)."""

    def __init__(self, shapes, dtypes, compression, size, process_set, op, gradient_predivide_factor, name):
        self.compression, self.size, self.process_set, self.op = compression, size, process_set, op
        self.predivide, self.name = gradient_predivide_factor, name
        payload = sum(int(np.prod(s, dtype=np.int64)) * compression.wire_bytes(self.summed_dtype(d))
                      for s, d in zip(shapes, dtypes))
        self.bytes_sent = allreduce_bytes(payload, size)

    @staticmethod
    def summed_dtype(dtype):
        """Horovod's allreduce has no bfloat16: such tensors are summed as float32 (or travel as
        float16 under Compression.fp16) and cast back."""
        return tf.float32 if tf.as_dtype(dtype) == tf.bfloat16 else tf.as_dtype(dtype)

    def __call__(self, tensors):
        if not tensors:
            return []
        summed = hvd.grouped_allreduce(
            [tf.cast(t, self.summed_dtype(t.dtype)) for t in tensors], op=self.op, compression=self.compression,
            prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide,
            process_set=self.process_set, name=self.name)
        return [tf.cast(s, t.dtype) for s, t in zip(summed, tensors)]


#: HalfAllreduce's largest piece of one alltoall, per destination (see its docstring): 2 MiB where Gloo's
#: alltoall posts its receives before its sends (Horovod built with patches/horovod-0.28.1.patch), else 512 KiB
HALF_CHUNK_BYTES = 2 << 20 if getattr(horovod, "gloo_receives_first", False) else 1 << 19
#: HalfAllreduce cuts its buffer into pieces at multiples of this many float16 values (64 bytes), so that
#: each piece is a slice of the buffer that shares its memory (TensorFlow copies unaligned slices)
PIECE_ALIGN = 32


class HalfAllreduce:
    """Compression.fp16 in hvd_compress.DistributedOptimizer: 16-bit allreduce over a sharded sum.

    The tensors are fused into buckets of at most fusion_threshold_bytes of float16, each cast
    once, with F16C, into its float16 buffer (ops.half_pack: no float32 concatenation). The
    buffer is cut into pieces of at most HALF_CHUNK_BYTES per destination, and each piece into
    `size` shards (shard_cuts). Per piece, an alltoall of the piece (a slice of the buffer, no
    copy) sends shard j of every rank to rank j, which averages them in float32 and rounds the
    mean to float16 once (ops.half_mean); a second alltoall sends every rank's mean shard to
    every rank, which brings back the whole piece's mean, in order. ops.half_unpack casts the
    pieces straight into each tensor's own dtype. Per rank and bucket of d values that is
    2 (n-1)/n of 2d bytes, as a ring allreduce of float16 moves, but the sum is taken in float32
    (Horovod's fp16 sums in float16 at every hop, and on this CPU at half the speed of a float32
    sum) and every rank decodes the same bits.

    Why pieces, and their size: each piece costs Horovod's per-collective work (about 1 ms at
    10 Gbit/s), so larger pieces are faster there, but stock Gloo's alltoall posts its send before
    its receive: when one rank is ahead, the other's notice that it is ready to receive queues
    behind its own payload, and the two directions take turns (half the link's rate; 4 MiB pieces
    cost 840 ms a step at 1 Gbit/s against 600 for 512 KiB). Horovod built with this project's
    patch posts receives first; then 2 MiB pieces are the measured compromise on the 25M MLP
    (2 ranks: 1 MiB is fastest at 1 Gbit/s and slowest at 10, 4 MiB the reverse). With stock
    Horovod the pieces are 512 KiB, the fastest size there at 1 Gbit/s (docs/design.md,
    "Compression.fp16", measures the sizes).

    bfloat16 gradients travel as float16 (exact for their 8 significant bits; beyond +-65504 they
    become Inf). The mean does not depend on gradient_predivide_factor, which only guards a float16
    sum against overflow.
    """

    def __init__(self, shapes, dtypes, rank, size, process_set, op, fusion_threshold_bytes, name):
        self.shapes, self.dtypes, self.rank, self.size, self.process_set = shapes, dtypes, rank, size, process_set
        self.scale, self.name = (size if op == hvd.Sum else 1), name
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.buckets = fuse_in_order([2 * n for n in sizes], fusion_threshold_bytes)
        # Per bucket: the [begin, end) of every piece, and each piece's shard lengths (rank j owns the j-th).
        self.pieces, self.bytes_sent = [], 0
        for bucket in self.buckets:
            length = sum(sizes[i] for i in bucket)
            count = max(1, math.ceil(2 * length / (HALF_CHUNK_BYTES * size)))
            step = math.ceil(length / count / PIECE_ALIGN) * PIECE_ALIGN
            pieces = []
            for begin in range(0, length, step):
                end = min(length, begin + step)
                shards = [int(n) for n in np.diff(shard_cuts(end - begin, size))]
                pieces.append((begin, end, shards))
                # Every shard but my own to its owner, then my mean shard to the n - 1 others.
                self.bytes_sent += 2 * (end - begin - shards[rank]) + allgather_bytes(2 * shards[rank], size)
            self.pieces.append(pieces)

    def __call__(self, tensors):
        out = [None] * len(tensors)
        for b, (bucket, pieces) in enumerate(zip(self.buckets, self.pieces)):
            packed = ops.half_pack([tensors[i] for i in bucket])
            means = []  # every piece's mean, gathered from its shards' owners, in order
            for t, (begin, end, shards) in enumerate(pieces):
                received = hvd.alltoall(tf.slice(packed, [begin], [end - begin]), splits=shards,
                                        process_set=self.process_set, name=f"{self.name}.{b}.{t}.scatter")[0]
                mean = ops.half_mean(tf.reshape(received, [self.size, shards[self.rank]]))
                means.append(hvd.alltoall(tf.tile(mean, [self.size]), splits=[shards[self.rank]] * self.size,
                                          process_set=self.process_set, name=f"{self.name}.{b}.{t}.gather")[0])
            unpacked = ops.half_unpack(means, [self.shapes[i] for i in bucket], [self.dtypes[i] for i in bucket])
            for i, y in zip(bucket, unpacked):
                out[i] = y * self.scale if self.scale != 1 else y
        return out


def is_fp16(compression):
    """Whether this is Compression.fp16 (passed as the class, as Horovod's is, or an instance)."""
    return compression is FP16Compressor or isinstance(compression, FP16Compressor)


def plan_dense(compression, shapes, dtypes, rank, size, process_set, op, gradient_predivide_factor,
               fusion_threshold_bytes, name):
    """The exchange of the tensors that are not compressed: HalfAllreduce under Compression.fp16,
    else Horovod's grouped allreduce (DenseAllreduce)."""
    if is_fp16(compression):
        return HalfAllreduce(shapes, dtypes, rank, size, process_set, op, fusion_threshold_bytes, name)
    return DenseAllreduce(shapes, dtypes, compression, size, process_set, op, gradient_predivide_factor, name)


def agree_on_finiteness(grads, process_set, name):
    """Makes every rank's gradients NaN when any rank's are not all finite (one scalar allreduce).

    For tf.keras.mixed_precision.LossScaleOptimizer, which decides locally whether a step
    overflowed: after this every rank takes the same skip/apply decision (no rank waits in a
    collective the others skipped), and the loss scale evolves identically on every rank."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in present]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])
    everywhere = hvd.allreduce(tf.cast(finite, tf.float32), op=hvd.Min, process_set=process_set, name=name) > 0.5

    def agreed(g):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(agreed(g.values), g.indices, g.dense_shape)
        return tf.cond(everywhere, lambda: g, lambda: g * tf.constant(np.nan, g.dtype))

    return [None if g is None else agreed(g) for g in grads]


class FullAllreduce(Exchange):
    """A compressed bucket sent at full precision (Accordion's `Compression.none` setting):
    one float32 allreduce; it sends everything, so no residual is left."""

    def __init__(self, bucket):
        self.bucket = bucket
        self.bytes_sent = allreduce_bytes(4 * bucket.num_elements, bucket.size)

    def exchange(self, flat, state, step):
        return Step(flat, hvd.allreduce(flat, op=hvd.Average, process_set=self.bucket.process_set,
                                        name=self.bucket.name))


class SignAllgather(Exchange):
    """One-way dist-EF-SGD: every worker's packed update is allgathered, all decode the mean."""

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.bounds = ops.layout_bounds(bucket.sizes, compressor.block_size)
        n = bucket.num_elements
        self.num_blocks = len(self.bounds) - 1
        self.num_bytes = (n + 7) // 8
        self.bytes_sent = allgather_bytes(compressor.payload_bytes(n, self.num_blocks), bucket.size)

    def exchange(self, flat, state, step):
        bounds = tf.constant(self.bounds)
        (bits, scales), residual = self.compressor.encode_with_residual(flat, bounds)
        gathered = hvd.allgather(_sign_payload(bits, scales), process_set=self.bucket.process_set,
                                 name=self.bucket.name)
        everyone = _split_sign_payloads(gathered, self.bucket.size, self.num_bytes, self.num_blocks)
        return Step(None, EncodedUpdate(self.compressor, everyone, bounds), residual=residual)


def shard_cuts(num_elements, size):
    """Cuts [0, ..., d] of d elements into `size` shards at multiples of 8 (trailing ones may be
    empty, e.g. 5 elements on 2 ranks: [0, 5, 5])."""
    shard = math.ceil(num_elements / size / 8) * 8
    return np.array([min(j * shard, num_elements) for j in range(size + 1)], np.int64)


class SignTwoWay(Exchange):
    """Two-way dist-EF-SGD over a sharded server (alltoall + allgather).

    The flat update of d elements is cut into `size` shards at multiples of 8
    (so each owns whole bytes of the packed signs; the shard cuts are also
    block cuts). Worker i packs its whole update; an alltoall sends shard j of
    every worker to rank j; rank j averages them, adds its server residual
    e_s, recompresses: D_j = C(A_j), e_s = A_j - D_j; an allgather returns
    every D_j to every rank, which decode the same update D. The server
    residual is sharded state: rank j's holds shard j of this world size.
    """

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        cuts = shard_cuts(bucket.num_elements, bucket.size)
        self.bounds = bounds = np.union1d(ops.layout_bounds(bucket.sizes, compressor.block_size), cuts)
        # For each shard: its element range, block range and payload byte length.
        self.shards = []
        for j in range(bucket.size):
            lo, hi = int(cuts[j]), int(cuts[j + 1])
            first, last = np.searchsorted(bounds, lo), np.searchsorted(bounds, hi)
            num_bytes = (hi + 7) // 8 - lo // 8 if hi > lo else 0  # lo is a multiple of 8 unless empty
            self.shards.append(dict(lo=lo, hi=hi, first_block=int(first), last_block=int(last),
                                    num_bytes=num_bytes, payload=num_bytes + 4 * int(last - first)))
        mine = self.shards[bucket.rank]
        self.server_bounds = bounds[mine["first_block"]:mine["last_block"] + 1] - mine["lo"]
        self.state = (StateSpec("server_residual", (mine["hi"] - mine["lo"],), SHARDED),)
        total = sum(s["payload"] for s in self.shards)
        # alltoall: all but my own shard; allgather: my shard to the n - 1 others.
        self.bytes_sent = (total - mine["payload"]) + allgather_bytes(mine["payload"], bucket.size)

    def residual(self, state):
        return [state["server_residual"]]

    def _shard_payloads(self, bits, scales):
        return [_sign_payload(bits[s["lo"] // 8:s["lo"] // 8 + s["num_bytes"]],
                              scales[s["first_block"]:s["last_block"]])
                for s in self.shards]

    def exchange(self, flat, state, step):
        bounds, process_set, name = tf.constant(self.bounds), self.bucket.process_set, self.bucket.name
        (bits, scales), residual = self.compressor.encode_with_residual(flat, bounds)
        payloads = self._shard_payloads(bits, scales)
        received, _ = hvd.alltoall(tf.concat(payloads, 0), splits=[s["payload"] for s in self.shards],
                                   process_set=process_set, name=name + ".alltoall")
        mine = self.shards[self.bucket.rank]
        server_bounds = tf.constant(self.server_bounds)
        error_fed_mean = self.compressor.decode_mean(  # A_j = mean + e_s, in one pass
            _split_sign_payloads(received, self.bucket.size, mine["num_bytes"],
                                 mine["last_block"] - mine["first_block"]), server_bounds,
            plus=rescaled(state["server_residual"], step.residual_scale))
        (server_bits, server_scales), server_residual = self.compressor.encode_with_residual(
            error_fed_mean, server_bounds)
        gathered = hvd.allgather(_sign_payload(server_bits, server_scales),
                                 process_set=process_set, name=name + ".allgather")
        all_bits, all_scales, offset = [], [], 0
        for s in self.shards:
            bits_j, scales_j = _split_sign_payloads(gathered[offset:offset + s["payload"]], 1,
                                                    s["num_bytes"], s["last_block"] - s["first_block"])
            all_bits.append(bits_j[0])
            all_scales.append(scales_j[0])
            offset += s["payload"]
        update = EncodedUpdate(self.compressor, (tf.concat(all_bits, 0)[None], tf.concat(all_scales, 0)[None]), bounds)
        return Step(None, update, {"server_residual": server_residual}, residual=residual)


class SparseAllgather(Exchange):
    """Top-k: (values, int32 indices) of every worker allgathered, their mean scattered.

    It works on the bucket's parts where they lie: the top k of their concatenation is selected
    in place (ops.top_k_abs over the list), the residual is the parts with the selection zeroed
    in place (ops.zero_at), and the allgathered pairs of all ranks are summed, in rank order,
    straight into one dense tensor per variable and divided by the number of ranks
    (ops.scatter_mean). The only dense tensors it makes are those the wrapped optimizer gets.
    """

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.n = bucket.num_elements
        self.k = compressor.num_selected(self.n)
        self.bytes_sent = allgather_bytes(compressor.payload_bytes(self.k), bucket.size)

    def __call__(self, parts, state, step):
        values, indices = self.compressor.encode(parts, self.k)
        residual = ops.zero_at(parts, indices)
        gathered = hvd.allgather(tf.concat([values, tf.bitcast(indices, tf.float32)], 0),
                                 process_set=self.bucket.process_set, name=self.bucket.name)
        gathered = tf.reshape(gathered, [self.bucket.size, 2, self.k])
        update = self.compressor.decode_mean((gathered[:, 0], tf.bitcast(gathered[:, 1], tf.int32)),
                                             [p.shape for p in parts])
        return Exchanged(residual, update)


class SharedRandomAllreduce(Exchange):
    """Random-k: every rank draws the same k coordinates (stateless, from seed, step and the
    bucket's index), so only values travel, summed by a plain allreduce.

    Like top-k it works on the bucket's parts where they lie: the values are read at the
    coordinates (ops.gather_at), the residual is the parts with them zeroed in place
    (ops.zero_at), and the summed values are scattered straight into each variable's update
    (ops.scatter_mean). One extra value carries NaN from a rank whose input is not all finite.
    """

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.n = bucket.num_elements
        self.k = compressor.num_selected(self.n)
        self.bytes_sent = allreduce_bytes(compressor.payload_bytes(self.k), bucket.size)

    def __call__(self, parts, state, step):
        indices = self.compressor.indices(self.n, self.k, step.number, self.bucket.index)
        values, _ = self.compressor.encode(parts, indices)
        poisoned = tf.add_n([poison(p) for p in parts])
        with tf.control_dependencies([values, poisoned]):  # the parts are free by then: zeroed in place, not copied
            residual = ops.zero_at(parts, indices)
        summed = hvd.allreduce(tf.concat([values, [poisoned]], 0), op=hvd.Sum,
                               process_set=self.bucket.process_set, name=self.bucket.name)
        update = self.compressor.decode_mean((summed[None, :-1], indices[None]), [p.shape for p in parts],
                                             count=self.bucket.size)
        return Exchanged(residual, [u + summed[-1] for u in update])


class SketchAllreduce(Exchange):
    """Sketched SGD (hvd_compress/sketch.py): count sketches summed by allreduce, candidates found
    alike on every rank, their exact sums fetched by a second allreduce and applied (all of them, or
    the exact top-k among them with apply_candidates=False)."""

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.n = bucket.num_elements
        self.k, self.rows, self.cols, self.num_candidates = compressor.sizes(self.n)
        self.masks_momentum = compressor.mask_momentum
        self.bytes_sent = (allreduce_bytes(4 * self.rows * self.cols, bucket.size)
                           + (allreduce_bytes(4 * self.num_candidates, bucket.size)
                              if compressor.second_round else 0))

    def exchange(self, flat, state, step):
        process_set, name, salt = self.bucket.process_set, self.bucket.name, self.bucket.index
        summed = hvd.allreduce(self.compressor.encode(flat, self.rows, self.cols, salt, step.number), op=hvd.Sum,
                               process_set=process_set, name=name + ".sketch")
        estimate = self.compressor.estimate(summed, self.n, salt, step.number)
        if self.compressor.second_round:
            _, candidates = ops.top_k_abs(estimate, self.num_candidates)
            local = tf.gather(flat, candidates)
            values = hvd.allreduce(local, op=hvd.Sum, process_set=process_set, name=name + ".values")
            applied = candidates
            if not self.compressor.apply_candidates:
                values, chosen = ops.top_k_abs(values, self.k)
                applied, local = tf.gather(candidates, chosen), tf.gather(local, chosen)
        else:
            _, applied = ops.top_k_abs(estimate, self.k)
            values, local = tf.gather(estimate, applied), tf.gather(flat, applied)
        sent = ops.scatter_dense(applied, local, self.n)
        return Step(sent, ops.scatter_dense(applied, values, self.n) / self.bucket.size, applied=applied)


class SketchSpaceAllreduce(Exchange):
    """FetchSGD (hvd_compress/sketch.py): the sketches of plain gradients averaged by one allreduce,
    momentum and error accumulated in sketch space (replicated state), the top-k of the error
    sketch's estimates applied and their cells zeroed. Hashes are fixed: the state accumulates."""

    worker_feedback = False

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.n = bucket.num_elements
        self.k, self.rows, self.cols, _ = compressor.sizes(self.n)
        self.state = (StateSpec("sketch_momentum", (self.rows, self.cols), REPLICATED),
                      StateSpec("sketch_error", (self.rows, self.cols), REPLICATED))
        self.bytes_sent = allreduce_bytes(4 * self.rows * self.cols, bucket.size)

    def residual(self, state):
        # Each row of a count sketch keeps the vector's squared norm in expectation.
        return [state["sketch_error"] / math.sqrt(self.rows)]

    def exchange(self, flat, state, step):
        salt = self.bucket.index
        sketch = hvd.allreduce(self.compressor.encode(flat, self.rows, self.cols, salt), op=hvd.Average,
                               process_set=self.bucket.process_set, name=self.bucket.name + ".sketch")
        momentum = step.momentum * state["sketch_momentum"] + sketch
        pushed = step.momentum * momentum + sketch if step.nesterov else momentum
        error = state["sketch_error"] + (pushed if step.learning_rate is None else step.learning_rate * pushed)
        values, applied = ops.top_k_abs(self.compressor.estimate(error, self.n, salt), self.k)
        cells = self.compressor.buckets(applied, self.n, self.rows, self.cols, salt)
        rows = tf.repeat(tf.range(self.rows, dtype=tf.int64), self.k)
        keep = tf.tensor_scatter_nd_update(tf.ones([self.rows, self.cols]),
                                           tf.stack([rows, tf.reshape(cells, [-1])], 1), tf.zeros([self.rows * self.k]))
        return Step(flat, ops.scatter_dense(applied, values, self.n),
                    {"sketch_momentum": momentum * keep, "sketch_error": error * keep})


class LowRankAllreduce(Exchange):
    """PowerSGD: per tensor P = M Q and Q = M^T P, each fused over the bucket into one allreduce.

    Q is replicated state (every rank computes the same Q from the same
    allreduced P), warm-started across steps; without warm start a fresh
    shared normal draw from (seed, bucket, tensor, step) is used each step.
    """

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.matrices = [compressor.matrix_shape(s) for s in bucket.shapes]
        self.state = tuple(StateSpec(f"powersgd_q/{j}", (m, compressor.rank), REPLICATED,
                                     initializer=self._shared_normal(j))
                           for j, (_, m) in enumerate(self.matrices)) if compressor.warm_start else ()
        rank, size = compressor.rank, bucket.size
        self.bytes_sent = (allreduce_bytes(4 * rank * sum(n for n, _ in self.matrices), size)
                           + allreduce_bytes(4 * rank * sum(m for _, m in self.matrices), size))

    def _shared_normal(self, j, step=0):
        seed = tf.stack([tf.constant(self.compressor.seed * (1 << 20) + self.bucket.index * 4096 + j,
                                     tf.int64), tf.cast(step, tf.int64)])
        return lambda shape, dtype=tf.float32: tf.random.stateless_normal(shape, seed, dtype=dtype)

    def _fused_mean(self, factors, name):
        flat = hvd.allreduce(tf.concat([tf.reshape(f, [-1]) for f in factors], 0), op=hvd.Average,
                             process_set=self.bucket.process_set, name=name)
        out, offset = [], 0
        for f in factors:
            size = int(np.prod(f.shape))
            out.append(tf.reshape(flat[offset:offset + size], f.shape))
            offset += size
        return out

    def __call__(self, parts, state, step):
        """Works on each variable's part as its matrix, with no concatenation of the bucket."""
        if self.compressor.warm_start:
            qs = [state[spec.name] for spec in self.state]
        else:
            qs = [self._shared_normal(j, step.number)([m, self.compressor.rank])
                  for j, (_, m) in enumerate(self.matrices)]
        ms = [tf.reshape(part, shape) for part, shape in zip(parts, self.matrices)]
        ps = self._fused_mean([tf.matmul(m, q) for m, q in zip(ms, qs)], self.bucket.name + ".p")
        ps = [tf.linalg.qr(p)[0] for p in ps]  # orthonormal columns spanning P
        # M^T P as (P^T M)^T: the product reads M along its rows, 3.5x faster on one CPU thread than
        # a transposed M (8.2 against 2.3 ms for a 3500 x 3500 M at rank 4); the transpose is of [r, m].
        new_qs = self._fused_mean([tf.transpose(tf.matmul(p, m, transpose_a=True)) for m, p in zip(ms, ps)],
                                  self.bucket.name + ".q")
        updates = [tf.reshape(tf.matmul(p, q, transpose_b=True), [-1]) for p, q in zip(ps, new_qs)]
        # PowerSGD's error is against the shared approximation: what is sent is the update itself.
        return Exchanged([part - u for part, u in zip(parts, updates)], updates,
                         {spec.name: q for spec, q in zip(self.state, new_qs)})


def _sign(compressor, bucket):
    return (SignTwoWay if bucket.two_way else SignAllgather)(compressor, bucket)


def _sketch(compressor, bucket):
    return (SketchSpaceAllreduce if compressor.mode == "fetchsgd" else SketchAllreduce)(compressor, bucket)


#: compressor class -> the exchange it travels by; `plan` looks a compressor's class up here.
EXCHANGES = {
    OneBitCompressor: _sign,
    TopKCompressor: SparseAllgather,
    RandomKCompressor: SharedRandomAllreduce,
    SketchCompressor: _sketch,
    PowerSGDCompressor: LowRankAllreduce,
}


def plan(compressor, bucket):
    """The exchange of `bucket` under `compressor` (None: Accordion's uncompressed setting, or a
    bucket with a tensor the compressor would not shrink)."""
    if compressor is None or not all(compressor.compresses(s) for s in bucket.shapes):
        return FullAllreduce(bucket)
    if type(compressor) not in EXCHANGES:
        raise TypeError(f"{compressor!r} is not supported by hvd_compress.DistributedOptimizer yet.")
    return EXCHANGES[type(compressor)](compressor, bucket)
