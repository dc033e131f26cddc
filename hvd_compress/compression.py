"""Gradient compressors, as Horovod `Compressor` subclasses.

A compressor only encodes and decodes; how the payload travels lives in
exchange.py and all state (residuals, momentum) in optimizer.py.

Two kinds:
- Stateless and sum-compatible (`none`, `fp16`): Horovod's compress/decompress
  contract, so they also work with plain `hvd.DistributedOptimizer`.
- Stateful or needing another collective than a sum (`onebit`, `topk`): they
  implement `encode`/`decode` for `hvd_compress.DistributedOptimizer`, and
  their Horovod `compress` raises a TypeError that says so.

Usage mirrors Horovod: `compression=Compression.fp16`, or
`compression=Compression.onebit(block_size=256)`.
"""
import importlib
import inspect
import math

import numpy as np
import tensorflow as tf
from horovod.tensorflow import compression as hvd_compression

from hvd_compress import ops


class Compressor(hvd_compression.Compressor):
    """Base class of all hvd_compress compressors."""

    #: True when the compressor needs hvd_compress.DistributedOptimizer.
    requires_optimizer = False

    def __new__(cls, *args, **kwargs):
        """Records the arguments a compressor is made with (`arguments`, what a model file saves)."""
        compressor = super().__new__(cls)
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs).arguments
        compressor.arguments = {name: value for name, value in list(bound.items())[1:]}
        return compressor


class NoneCompressor(hvd_compression.NoneCompressor, Compressor):
    """No compression: gradients travel at their own precision."""

    @staticmethod
    def wire_bytes(dtype):
        """Bytes one element of this dtype takes on the wire."""
        return tf.as_dtype(dtype).size


class FP16Compressor(hvd_compression.FP16Compressor, Compressor):
    """Floating-point gradients travel as float16 and are cast back after the sum.

    bfloat16 gradients travel as float16 too (Horovod's allreduce has no
    bfloat16): exact for their 8 significant bits, but values beyond float16's
    range (|x| > 65504) become Inf.
    """

    @staticmethod
    def wire_bytes(dtype):
        """Bytes one element of this dtype takes on the wire."""
        return 2 if tf.as_dtype(dtype).is_floating else tf.as_dtype(dtype).size


class StatefulCompressor(Compressor):
    """A compressor that needs hvd_compress.DistributedOptimizer.

    Subclasses implement `encode`/`decode`; the optimizer keeps their state
    (residuals for error feedback) and chooses the collective.
    """

    requires_optimizer = True
    #: the collective the payload needs, for the error message
    collective = "allgather"

    def compresses(self, shape):
        """Whether a tensor of this shape is worth compressing (others travel uncompressed)."""
        return True

    @classmethod
    def compress(cls, tensor):
        raise TypeError(
            f"{cls.__name__} keeps per-variable error-feedback state and its payload needs an "
            f"{cls.collective} (not a sum), which hvd.DistributedOptimizer cannot do: use "
            f"hvd_compress.DistributedOptimizer(optimizer, compression=...) (or "
            f"hvd_compress.DistributedGradientTape) instead of the Horovod wrapper.")

    @classmethod
    def decompress(cls, tensor, ctx):
        cls.compress(tensor)


class OneBitCompressor(StatefulCompressor):
    """Blockwise sign compressor of dist-EF-SGD (Zheng, Huang, Kwok, NeurIPS 2019).

    C(x)_b = (||x_b||_1 / |G_b|) * sign(x_b), sign(0) = +1, for each block G_b.
    block_size=None uses one block per tensor; an integer cuts every tensor
    into blocks of that many elements. Wire: ceil(n/8) bytes of packed signs
    plus one float32 scale per block.
    """

    collective = "alltoall/allgather"

    def __init__(self, block_size=None):
        self.block_size = ops.check_block_size(block_size)

    def __repr__(self):
        return f"Compression.onebit(block_size={self.block_size})"

    def bounds(self, sizes):
        """Block bounds for a buffer of tensors with these sizes (see ops.block_bounds)."""
        return ops.block_bounds(sizes, self.block_size)

    def encode(self, flat, bounds):
        """flat [n] -> (bits uint8[ceil(n/8)], scales float32[B])."""
        return ops.block_sign_pack(flat, bounds=bounds)

    def encode_with_residual(self, flat, bounds):
        """flat float32 [n] -> ((bits, scales), flat - C(flat)): the payload and the residual it leaves,
        in one op (the residual as decode and a subtraction would give it, in flat's buffer). Not
        `compress`, which is Horovod's compressor interface (refused above)."""
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

    def subtract_mean(self, variable, payloads, bounds, offset=0):
        """variable -= elements [offset, offset + its size) of decode_mean(payloads, bounds), in place,
        in one pass over a float32 variable (the bits of that decode and assign_sub)."""
        bits, scales = payloads
        return ops.subtract_block_sign_mean(variable, bits, scales, bounds, offset)

    @staticmethod
    def payload_bytes(num_elements, num_blocks):
        """Bytes of one payload: packed signs plus float32 scales."""
        return (num_elements + 7) // 8 + 4 * num_blocks


class TopKCompressor(StatefulCompressor):
    """Top-k sparsification with residuals (Stich et al. 2018; Lin et al., DGC 2018).

    With the optimizer's residual e: a = g + e; send the k entries of largest
    |a| as (values, int32 indices) via allgather; e = a - sent. Give either
    `ratio` (k = ceil(ratio * n) per tensor, at least 1) or a fixed `k`.
    """

    def __init__(self, ratio=None, k=None):
        if (ratio is None) == (k is None):
            raise ValueError("Compression.topk takes exactly one of ratio= (fraction of each tensor "
                             f"to send, in (0, 1]) or k= (entries per tensor); got ratio={ratio!r}, "
                             f"k={k!r}.")
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"ratio must be a number in (0, 1], e.g. 0.01 for 1%; got {ratio!r}.")
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
            raise ValueError(f"k must be a positive integer, got {k!r}.")
        self.ratio = None if ratio is None else float(ratio)
        self.k = None if k is None else int(k)

    def __repr__(self):
        return f"Compression.topk(ratio={self.ratio}, k={self.k})"

    def num_selected(self, num_elements):
        """k for a tensor of num_elements; a fixed k larger than the tensor is an error."""
        if self.k is None:
            return max(1, math.ceil(self.ratio * num_elements))
        if self.k > num_elements:
            raise ValueError(
                f"Compression.topk(k={self.k}) is larger than a tensor of {num_elements} elements. "
                "Use ratio= instead, or a k no larger than the smallest compressed tensor.")
        return self.k

    def encode(self, flat, k):
        """flat [n], or a list of tensors read as their concatenation -> (values [k], int32 indices [k])
        of the k largest |flat|."""
        return ops.top_k_abs(flat, k)

    def decode(self, payload, num_elements):
        """(values, indices), possibly stacked from several ranks -> dense sum [n]."""
        values, indices = payload
        return ops.scatter_dense(indices, values, num_elements)

    @staticmethod
    def decode_mean(payloads, shapes, count=None):
        """Stacked (values [m, k], indices [m, k]) of m ranks -> their mean, cut into tensors of `shapes`
        (the parts of the concatenation the indices address), with no dense tensor per rank. count:
        how many ranks' values the payloads hold (default m; random-k's one payload is a sum)."""
        values, indices = payloads
        return ops.scatter_mean(tf.reshape(indices, [-1]), tf.reshape(values, [-1]), shapes,
                                values.shape[0] if count is None else count)

    @staticmethod
    def payload_bytes(k, element_bytes=4):
        """Bytes of one payload: k values plus k int32 indices."""
        return k * (element_bytes + 4)


class RandomKCompressor(TopKCompressor):
    """Random-k sparsification with residuals (Stich, Cordonnier, Jaggi, NeurIPS 2018).

    a = g + e; every rank draws the same k coordinates from a seed shared by
    all ranks and the step number (stateless, so nothing is stored or sent),
    so only the k values travel, summed by a plain allreduce; e = a - sent.
    """

    collective = "allreduce of shared coordinates"

    def __init__(self, ratio=None, k=None, seed=0):
        super().__init__(ratio=ratio, k=k)
        self.seed = int(seed)

    def __repr__(self):
        return f"Compression.randomk(ratio={self.ratio}, k={self.k}, seed={self.seed})"

    def indices(self, num_elements, k, step, salt):
        """k distinct coordinates of [0, num_elements), the same on every rank for a step."""
        seed = tf.stack([tf.constant(self.seed * (1 << 20) + salt, tf.int64), tf.cast(step, tf.int64)])
        return tf.cast(tf.random.experimental.index_shuffle(
            tf.range(k, dtype=tf.int64), seed, num_elements - 1), tf.int32)

    def encode(self, flat, indices):
        """flat [n], or a list of tensors read as their concatenation -> (values at indices, indices)."""
        return ops.gather_at(flat, indices), indices

    @staticmethod
    def payload_bytes(k, element_bytes=4):
        """Bytes of one payload: k float32 values plus one non-finite marker."""
        return (k + 1) * element_bytes


class PowerSGDCompressor(StatefulCompressor):
    """PowerSGD low-rank compression (Vogels, Karimireddy, Jaggi, NeurIPS 2019).

    A tensor is viewed as a matrix M [n, m] (a conv kernel [kh, kw, in, out]
    as [kh kw in, out]); with the error e and a Q [m, r] kept from the last
    step (warm start):
        M = g + e;  P = allreduce_mean(M Q);  P = orthogonalize(P)
        Q = allreduce_mean(M^T P);  D = P Q^T;  e = M - D
    P and Q of all tensors of a bucket travel in one fused allreduce each.
    A tensor that r (n + m) values would not shrink by `min_compression`
    travels uncompressed.
    """

    collective = "allreduce of low-rank factors"

    def __init__(self, rank=4, min_compression=2.0, warm_start=True, seed=0):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}.")
        if not isinstance(min_compression, (int, float)) or min_compression < 1:
            raise ValueError(f"min_compression must be a number >= 1, got {min_compression!r}.")
        self.rank, self.min_compression = int(rank), float(min_compression)
        self.warm_start, self.seed = bool(warm_start), int(seed)

    def __repr__(self):
        return (f"Compression.powersgd(rank={self.rank}, min_compression={self.min_compression}, "
                f"warm_start={self.warm_start}, seed={self.seed})")

    @staticmethod
    def matrix_shape(shape):
        """[n, m] of a tensor viewed as a matrix (last dimension = columns)."""
        shape = [int(d) for d in shape]
        return [int(np.prod(shape[:-1])), shape[-1]] if len(shape) >= 2 else None

    def compresses(self, shape):
        matrix = self.matrix_shape(shape)
        return matrix is not None and matrix[0] * matrix[1] >= self.min_compression * self.rank * sum(matrix)

    def payload_bytes(self, shapes):
        """Float32 values of P and Q that one worker contributes, over these tensors."""
        return 4 * sum(self.rank * sum(self.matrix_shape(s)) for s in shapes)


class Compression:
    """The compressors, by name (like horovod.tensorflow.Compression)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    onebit = OneBitCompressor
    topk = TopKCompressor
    randomk = RandomKCompressor
    powersgd = PowerSGDCompressor

    @staticmethod
    def sketch(ratio=None, k=None, rows=None, cols=None, candidates=None, second_round=None, seed=0,
               mode="sketched", apply_candidates=None, mask_momentum=None):
        """Count-sketch compression: sketched SGD, or mode="fetchsgd" (hvd_compress.sketch.SketchCompressor)."""
        from hvd_compress.sketch import SketchCompressor  # sketch.py builds on this module
        return SketchCompressor(ratio=ratio, k=k, rows=rows, cols=cols, candidates=candidates,
                                second_round=second_round, seed=seed, mode=mode, apply_candidates=apply_candidates,
                                mask_momentum=mask_momentum)


def to_config(compression):
    """A compression (a compressor, or a class of one used uncalled, as Compression.fp16) as JSON data,
    for model files: {"name": its name in Compression, or "module:QualifiedName" for a class of
    another module (a user's subclass), "arguments": what it was made with}."""
    cls = compression if isinstance(compression, type) else type(compression)
    names = {getattr(Compression, name): name for name in ("none", "fp16", "onebit", "topk", "randomk", "powersgd")}
    from hvd_compress.sketch import SketchCompressor  # sketch.py builds on this module
    names[SketchCompressor] = "sketch"
    config = {"name": names.get(cls, f"{cls.__module__}:{cls.__qualname__}")}
    if not isinstance(compression, type):
        config["arguments"] = compression.arguments
    return config


def from_config(config):
    """The compression to_config recorded."""
    name = config["name"]
    if ":" in name:
        module, qualname = name.split(":")
        factory = importlib.import_module(module)
        for part in qualname.split("."):
            factory = getattr(factory, part)
    else:
        factory = getattr(Compression, name)
    return factory(**config["arguments"]) if "arguments" in config else factory
