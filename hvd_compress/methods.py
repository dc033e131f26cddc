"""The methods by name: one registry that the examples, the tests and the benchmarks read, so a
new compressor is one entry here.

`METHODS[name]` makes the method's compression with its defaults (`compression(name, **overrides)`
changes them); `distributed_optimizer(name, optimizer, **overrides)` wraps a Keras optimizer the
way the method trains, including the baselines that are not a compression of ours: Horovod's own
DistributedOptimizer at fp32 and fp16, and SGP's gossip.
"""
import functools

from hvd_compress.compression import Compression

#: name -> factory of the method's compression (keyword arguments override its defaults)
METHODS = {
    "none": lambda: Compression.none,  # our wrapper, full precision (Horovod's fp32 allreduce inside)
    "fp16": lambda: Compression.fp16,  # our 16-bit exchange (a sharded float32 sum)
    "onebit": Compression.onebit,  # dist-EF-SGD two-way
    "onebit_oneway": functools.partial(Compression.onebit, two_way=False),
    "quantize8": functools.partial(Compression.quantize, bits=8),
    "quantize4": functools.partial(Compression.quantize, bits=4),
    "topk": functools.partial(Compression.topk, ratio=0.01),
    "randomk": functools.partial(Compression.randomk, ratio=0.01),
    "powersgd": functools.partial(Compression.powersgd, rank=4),
    "sketch": functools.partial(Compression.sketch, ratio=4),
    "fetchsgd": functools.partial(Compression.sketch, ratio=4, mode="fetchsgd"),
}
#: methods that are not a compression of ours: baselines and gossip
OTHER_METHODS = ("horovod_fp32", "horovod_fp16", "sgp")
NAMES = tuple(METHODS) + OTHER_METHODS


def compression(name, **overrides):
    """The compression of method `name` (a key of METHODS), its defaults replaced by `overrides`."""
    if name not in METHODS:
        raise ValueError(f"unknown compression method {name!r}; known: {sorted(METHODS)}.")
    return METHODS[name](**overrides) if overrides else METHODS[name]()


def distributed_optimizer(name, optimizer, overrides=None, **wrapper_kwargs):
    """`optimizer` wrapped as method `name` trains (any of NAMES): hvd_compress.DistributedOptimizer with
    the method's compression (`overrides` its arguments), Horovod's DistributedOptimizer (horovod_fp32,
    horovod_fp16; needs tf_keras), or hvd_compress.PushSumOptimizer (sgp). wrapper_kwargs go to the wrapper."""
    if name in ("horovod_fp32", "horovod_fp16"):
        import horovod.tensorflow.keras as hvd_keras
        return hvd_keras.DistributedOptimizer(
            optimizer, compression=hvd_keras.Compression.fp16 if name == "horovod_fp16" else hvd_keras.Compression.none,
            **wrapper_kwargs)
    if name == "sgp":
        from hvd_compress.gossip import PushSumOptimizer
        return PushSumOptimizer(optimizer, **(overrides or {}), **wrapper_kwargs)
    from hvd_compress.optimizer import DistributedOptimizer
    return DistributedOptimizer(optimizer, compression=compression(name, **(overrides or {})), **wrapper_kwargs)
