"""The compressors, by name: `hvd_compress.Compression` (like horovod.tensorflow.Compression).

Usage mirrors Horovod: `compression=Compression.fp16`, or
`compression=Compression.onebit(block_size=256)`. Two kinds (compressor.py has the contract):
- Stateless and sum-compatible (`none`, `fp16`): Horovod's compress/decompress contract, so they
  also work with plain `hvd.DistributedOptimizer`.
- Compressors that plan their own exchange and keep error-feedback state (`onebit`, `quantize`,
  `topk`, `randomk`, `powersgd`, `sketch`), each in a module of its own: they need
  `hvd_compress.DistributedOptimizer`, and their Horovod `compress` raises a TypeError that says so.
A compressor passed uncalled (`Compression.onebit`) means its defaults.
"""
import importlib

from hvd_compress.compressor import (Compressor, FP16Compressor, NoneCompressor,  # noqa: F401 (re-exported)
                                     StatefulCompressor)
from hvd_compress.auto import AutoCompression
from hvd_compress.onebit import OneBitCompressor
from hvd_compress.powersgd import PowerSGDCompressor
from hvd_compress.quantize import QuantizeCompressor
from hvd_compress.sketch import SketchCompressor
from hvd_compress.sparse import RandomKCompressor, TopKCompressor


class Compression:
    """The compressors, by name (like horovod.tensorflow.Compression)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    onebit = OneBitCompressor
    quantize = QuantizeCompressor
    topk = TopKCompressor
    randomk = RandomKCompressor
    powersgd = PowerSGDCompressor
    sketch = SketchCompressor
    #: the compression with the shortest predicted step, chosen during model.fit from the job's measurements
    auto = AutoCompression


def to_config(compression):
    """A compression (a compressor, or a class of one used uncalled, as Compression.fp16) as JSON data,
    for model files: {"name": its name in Compression, or "module:QualifiedName" for a class of
    another module (a user's subclass), "arguments": what it was made with}."""
    cls = compression if isinstance(compression, type) else type(compression)
    names = {factory: name for name, factory in vars(Compression).items() if isinstance(factory, type)}
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
