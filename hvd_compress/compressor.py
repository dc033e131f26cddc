"""The compressor contract: what every hvd_compress compressor is.

A compressor is one small unit (one module with its exchange, see docs/architecture.md):

- `update_rule` says what the worker does around the exchange (GradientExchange reads it, never
  the compressor's class):
    ERROR_FEEDBACK     a = g + e; the exchange sends part of a; e = a - sent (kept per rank);
                       the wrapped optimizer applies the exchanged mean as the gradient (under Adam
                       and AdamW with warmup_steps > 0, Adam with its variance frozen after the
                       warm-up, adam.FrozenVarianceAdam).
    MOMENTUM_IN_FRONT  under SGD (dist-EF-SGD, sketched SGD): momentum before the compressor and
                       the learning rate inside, m = mu m + g, a = lr p + s e (p = m, or
                       mu m + g with Nesterov; s = lr / last lr), and the exchanged D is subtracted
                       from the weights (SGD's own update is bypassed); under any other optimizer
                       it is ERROR_FEEDBACK.
    EXCHANGE_FEEDBACK  the exchange keeps error and momentum in its own state (FetchSGD): the
                       worker hands it plain gradients; under SGD it gets lr and momentum and D is
                       subtracted from the weights, else the wrapped optimizer applies D.
    NO_FEEDBACK        a = g, no residual: an unbiased compressor.
- `plan(bucket) -> Exchange` makes the exchange of one fused bucket (exchange.py: the contract).
- `compresses(shape)`: whether a tensor of this shape is worth compressing.

Compressors that only cast (none, fp16) are Horovod compressors (`compress`/`decompress`) and
plan nothing: they go through the dense exchange.
"""
import inspect

import tensorflow as tf
from horovod.tensorflow import compression as hvd_compression

ERROR_FEEDBACK = "error_feedback"
MOMENTUM_IN_FRONT = "momentum_in_front"
EXCHANGE_FEEDBACK = "exchange_feedback"
NO_FEEDBACK = "none"
UPDATE_RULES = (ERROR_FEEDBACK, MOMENTUM_IN_FRONT, EXCHANGE_FEEDBACK, NO_FEEDBACK)


def seed_key(seed, salt):
    """The key of a shared random draw: a compressor's seed and a salt (a bucket's index, a tensor's
    position), the same on every rank. Every shared draw (random-k's coordinates, PowerSGD's
    starting Q, the sketches' hashes) is keyed here."""
    return int(seed) * (1 << 20) + int(salt)


def stateless_seed(seed, salt, step=0):
    """[key, step] for TensorFlow's stateless random ops: a draw of this seed, salt and step."""
    return tf.stack([tf.constant(seed_key(seed, salt), tf.int64), tf.cast(step, tf.int64)])


class Compressor(hvd_compression.Compressor):
    """Base class of all hvd_compress compressors."""

    #: True when the compressor needs hvd_compress.DistributedOptimizer (it plans an exchange).
    requires_optimizer = False
    #: none and fp16 only cast: nothing is kept
    update_rule = NO_FEEDBACK

    def __new__(cls, *args, **kwargs):
        """Records the arguments a compressor is made with (`arguments`, what a model file saves)."""
        compressor = super().__new__(cls)
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs).arguments
        compressor.arguments = {name: value for name, value in list(bound.items())[1:]}
        return compressor

    def with_defaults(self, **defaults):
        """This compressor made again with `defaults` for the arguments its maker left out (of those its __init__
        takes); itself where none applies. A worker rule's measured defaults (rules.WorkerRule.settle)."""
        parameters = inspect.signature(type(self).__init__).parameters
        missing = {name: value for name, value in defaults.items()
                   if name in parameters and name not in self.arguments}
        return type(self)(**self.arguments, **missing) if missing else self


class StatefulCompressor(Compressor):
    """A compressor that plans its own exchange and needs hvd_compress.DistributedOptimizer.

    Subclasses set `update_rule` and implement `plan(bucket)`; the optimizer keeps the
    worker's state that the rule needs (residuals, momenta) and the exchange's own state.
    """

    requires_optimizer = True
    update_rule = ERROR_FEEDBACK
    #: False: every compressed tensor is a bucket of its own (Accordion switches per layer)
    fuses_tensors = True
    #: True: its exchange works on any flat piece of a bucket, so a hierarchical exchange cuts buckets
    #: into one shard per rank of a host; False: it needs whole tensors (PowerSGD's matrices)
    splits_tensors = True
    #: True: the exchanged update is zero on most coordinates (refused with Adafactor's factored moments)
    sparse_update = False
    #: the collective the payload needs, for the error message
    collective = "allgather"
    #: where it was measured to lose accuracy under Adam and AdamW (logged when it wraps one), or None
    under_adam = None

    def compresses(self, shape):
        """Whether a tensor of this shape is worth compressing (others travel uncompressed)."""
        return True

    def plan(self, bucket):
        """The exchange (an exchange.Exchange) of one fused bucket (an exchange.Bucket)."""
        raise NotImplementedError(f"{type(self).__name__} must implement plan(bucket) -> Exchange.")

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


class NoneCompressor(hvd_compression.NoneCompressor, Compressor):
    """No compression: gradients travel at their own precision."""

    @staticmethod
    def wire_bytes(dtype):
        """Bytes one element of this dtype takes on the wire."""
        return tf.as_dtype(dtype).size


class FP16Compressor(hvd_compression.FP16Compressor, Compressor):
    """Floating-point gradients travel as float16 and are cast back after the sum (in
    hvd_compress.DistributedOptimizer: exchange.HalfAllreduce, a sharded float32 sum).

    bfloat16 gradients travel as float16 too (Horovod's allreduce has no
    bfloat16): exact for their 8 significant bits, but values beyond float16's
    range (|x| > 65504) become Inf.
    """

    @staticmethod
    def wire_bytes(dtype):
        """Bytes one element of this dtype takes on the wire."""
        return 2 if tf.as_dtype(dtype).is_floating else tf.as_dtype(dtype).size
