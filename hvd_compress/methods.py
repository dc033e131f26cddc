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
#: local-step methods (hvd_compress.DiLoCo): name -> its settings. An evaluation every 20 steps meets a sync.
LOCAL_STEP_METHODS = {
    # DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9) on the full-precision average, every 20 steps
    "diloco": lambda: dict(sync_every=20),
    # SparseLoCo: top-k 1% of the pseudo-gradient with error feedback decayed by 0.95 in place of outer momentum
    "sparseloco": lambda: dict(sync_every=20, outer_learning_rate=1.0, outer_momentum=0.0, error_decay=0.95,
                               compression=Compression.topk(ratio=0.01)),
    # DiLoCo with its pseudo-gradient in 4 bits (error-fed blockwise quantization): 1/160 of fp32's bytes a step
    "diloco_q4": lambda: dict(sync_every=20, compression=Compression.quantize(bits=4)),
    # Streaming DiLoCo: 4 fragments on staggered steps, each exchange in 4 bits and in the background for 2 steps
    "streaming_diloco": lambda: dict(sync_every=20, fragments=4, sync_delay=2, compression=Compression.quantize(bits=4)),
}
#: methods that are not a compression of ours: baselines, gossip and local steps
OTHER_METHODS = ("horovod_fp32", "horovod_fp16", "sgp", *LOCAL_STEP_METHODS)
NAMES = tuple(METHODS) + OTHER_METHODS


def compression(name, **overrides):
    """The compression of method `name` (a key of METHODS), its defaults replaced by `overrides`."""
    if name not in METHODS:
        raise ValueError(f"unknown compression method {name!r}; known: {sorted(METHODS)}.")
    return METHODS[name](**overrides) if overrides else METHODS[name]()


def distributed_optimizer(name, optimizer, overrides=None, **wrapper_kwargs):
    """`optimizer` wrapped as method `name` trains (any of NAMES): hvd_compress.DistributedOptimizer with
    the method's compression (`overrides` its arguments), Horovod's DistributedOptimizer (horovod_fp32,
    horovod_fp16; needs tf_keras), hvd_compress.PushSumOptimizer (sgp) or hvd_compress.DiLoCo (LOCAL_STEP_METHODS,
    `overrides` its settings). wrapper_kwargs go to the wrapper."""
    if name in ("horovod_fp32", "horovod_fp16"):
        import horovod.tensorflow.keras as hvd_keras
        return hvd_keras.DistributedOptimizer(
            optimizer, compression=hvd_keras.Compression.fp16 if name == "horovod_fp16" else hvd_keras.Compression.none,
            **wrapper_kwargs)
    if name == "sgp":
        from hvd_compress.gossip import PushSumOptimizer
        return PushSumOptimizer(optimizer, **(overrides or {}), **wrapper_kwargs)
    if name in LOCAL_STEP_METHODS:
        from hvd_compress.diloco import DiLoCo
        return DiLoCo(optimizer, **{**LOCAL_STEP_METHODS[name](), **(overrides or {})}, **wrapper_kwargs)
    from hvd_compress.optimizer import DistributedOptimizer
    return DistributedOptimizer(optimizer, compression=compression(name, **(overrides or {})), **wrapper_kwargs)
