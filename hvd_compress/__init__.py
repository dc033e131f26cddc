"""hvd_compress: communication-efficient data-parallel training for Horovod + TF/Keras.

Importing the package selects Keras 2 (tf_keras) for `tf.keras` by setting
TF_USE_LEGACY_KERAS=1, unless the variable is already set: Horovod's Keras
integration does not average gradients under Keras 3. It takes effect as long
as `tf.keras` has not been touched before this import; `require_legacy_keras()`
refuses to go on otherwise.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from hvd_compress.compression import Compression, Compressor  # noqa: E402
from hvd_compress.keras_compat import require_legacy_keras  # noqa: E402
from hvd_compress.optimizer import (DistributedGradientTape, DistributedOptimizer,  # noqa: E402
                                    GradientExchange, load_model)
from hvd_compress import accordion, callbacks, elastic, gossip, state  # noqa: E402
from hvd_compress.gossip import PushSumOptimizer  # noqa: E402

__version__ = "0.1.0"
__all__ = ["accordion", "Compression", "Compressor", "DistributedGradientTape", "DistributedOptimizer",
           "GradientExchange", "PushSumOptimizer", "callbacks", "elastic", "gossip", "load_model",
           "require_legacy_keras", "state"]
